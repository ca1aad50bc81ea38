"""GPU-resident rollout fields (``data_plane.gpu_fields``, nemo_dataplane/wrappers/gpu_resident.py).

On CPU (CI): the wrapper keeps the whole store contract (the shipped conformance suite, with the
suite's own field names named as GPU fields) and CPU tensors of a named field take the host path
bit-exact. On 2 GPUs (skipped elsewhere): a process on GPU 0 puts through a real TransferQueue
store, a process on GPU 1 reads the rows back bit-exact with no host copy of the data in the store,
and the putter lets its tensors go once the keys are cleared.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from nemo_dataplane.adapters.memory import InMemoryClient
from nemo_dataplane.client import DataPlaneClient
from nemo_dataplane.factory import build_data_plane_client
from nemo_dataplane.testing.conformance import DataPlaneConformance
from nemo_dataplane.testing.fields import assert_same_field, jagged
from nemo_dataplane.wrappers.gpu_resident import SUFFIX, GpuResidentClient

REPO = Path(__file__).resolve().parents[2]
# The conformance suite's own field names: every one of its gets goes through the wrapper's path.
SUITE_FIELDS = ("x", "ids", "score", "len", "src", "i", "a", "w", "t", "b", "c")


class TestGpuResidentConformance(DataPlaneConformance):
    @pytest.fixture
    def client(self) -> Iterator[DataPlaneClient]:
        c = GpuResidentClient(InMemoryClient(), SUITE_FIELDS)
        yield c
        c.close()


def test_cpu_tensors_of_a_gpu_field_take_the_host_path_bit_exact() -> None:
    c = build_data_plane_client({"backend": "memory", "gpu_fields": ["ids", "logprobs"]})
    assert isinstance(c, GpuResidentClient) and c.fields == {"ids", "logprobs"}
    ids = jagged([3, 0, 5, 2], seed=1, dtype=torch.int64)
    lp = torch.randn(4, 6)
    meta = c.kv_batch_put([f"k{i}" for i in range(4)], "p", {"ids": ids, "logprobs": lp, "r": torch.ones(4)})
    # Stored as given, under its own name: no records, nothing held.
    assert set(meta.fields or ()) == {"ids", "logprobs", "r"} and not any(SUFFIX in f for f in meta.fields or ())
    assert c.held_puts() == 0
    for source in (meta, list(meta.keys)):  # by meta and by keys (the keys path asks for @cuda first)
        got = c.kv_batch_get(source, ["ids", "logprobs"], "p")
        assert_same_field("ids", got["ids"], ids)
        assert torch.equal(got["logprobs"], lp)
    with pytest.raises(KeyError, match="nope"):
        c.kv_batch_get(list(meta.keys), ["ids", "nope"], "p")
    with pytest.raises(KeyError, match="k9"):
        c.kv_batch_get(["k0", "k9"], ["ids"], "p")
    c.close()


_GPU_PROBE = r"""
import json, os, sys, time
import ray, torch
from nemo_dataplane.factory import build_data_plane_client
from nemo_dataplane.testing.fields import jagged

ray.init(address="local", num_cpus=4, num_gpus=0, include_dashboard=False, log_to_driver=False)
CFG = {"backend": "transfer_queue", "gpu_fields": ["ids", "logprobs"]}


@ray.remote(num_cpus=0.5)
class Putter:
    def __init__(self):
        torch.cuda.set_device(0)
        self.c = build_data_plane_client(CFG, bootstrap=False)

    def put(self, n, seed):
        g = torch.Generator().manual_seed(seed)
        lengths = [int(x) for x in torch.randint(1, 300, (n,), generator=g)]
        ids = jagged(lengths, seed=seed, dtype=torch.int64).to("cuda:0")
        lp = torch.randn(n, 4096, generator=g).to("cuda:0")
        meta = self.c.kv_batch_put([f"s{seed}_{i}" for i in range(n)], "roll", {"ids": ids, "logprobs": lp})
        return meta, ids.cpu(), lp.cpu(), self.c.held_puts()

    def held_after_next_put(self):
        self.put(2, 999)
        return self.c.held_puts()


@ray.remote(num_cpus=0.5)
class Reader:
    def __init__(self):
        torch.cuda.set_device(1)
        self.c = build_data_plane_client(CFG, bootstrap=False)

    def get(self, meta, by_keys):
        got = self.c.kv_batch_get(list(meta.keys) if by_keys else meta, ["ids", "logprobs"], "roll")
        return {"device": str(got["logprobs"].device), "ids": got["ids"].cpu(), "lp": got["logprobs"].cpu()}

    def stored_bytes(self, meta):
        inner = self.c
        while hasattr(inner, "inner"):
            inner = inner.inner
        rec = inner.kv_batch_get(meta, ["logprobs@cuda"], "roll")["logprobs@cuda"]
        return int(rec.values().numel())


owner = build_data_plane_client({"backend": "transfer_queue"}, bootstrap=True)
p, r = Putter.remote(), Reader.remote()
meta, ids, lp, held = ray.get(p.put.remote(64, 1))
out = {"held": held, "fields": list(meta.fields)}
for by_keys in (False, True):
    got = ray.get(r.get.remote(meta, by_keys))
    out[f"device_{by_keys}"] = got["device"]
    same_values = torch.equal(got["ids"].values(), ids.values())
    out[f"ids_equal_{by_keys}"] = bool(same_values and torch.equal(got["ids"].offsets(), ids.offsets()))
    out[f"lp_equal_{by_keys}"] = bool(torch.equal(got["lp"], lp))
out["record_bytes"] = ray.get(r.stored_bytes.remote(meta))
out["payload_bytes"] = lp.numel() * 4
owner.kv_clear(list(meta.keys), "roll")
out["held_after_clear"] = ray.get(p.held_after_next_put.remote())
print(json.dumps(out))
"""


@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs on one host"
)
def test_rows_put_on_gpu0_are_read_on_gpu1_bit_exact_through_a_real_store_and_released_after_clear() -> None:
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    env.pop("CUDA_VISIBLE_DEVICES", None)
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(_GPU_PROBE)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-4000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    print(got)
    assert got["held"] == 1
    assert set(got["fields"]) == {"ids@cuda", "logprobs@cuda"}
    for by_keys in (False, True):
        assert got[f"device_{by_keys}"] == "cuda:1"
        assert got[f"ids_equal_{by_keys}"] and got[f"lp_equal_{by_keys}"]
    # The store holds handles (a few hundred bytes a row), not the rows (16 KiB of log-probs each).
    assert got["record_bytes"] < got["payload_bytes"] / 10, got
    # Cleared keys: the putter's next put lets the first put's tensors go (the second is held).
    assert got["held_after_clear"] == 1
