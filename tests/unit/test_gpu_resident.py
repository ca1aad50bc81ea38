"""GPU-resident rollout fields (``data_plane.gpu_fields``, nemo_dataplane/wrappers/gpu_resident.py).

On CPU (CI): the wrapper keeps the whole store contract (the shipped conformance suite, with the
suite's own field names named as GPU fields) and CPU tensors of a named field take the host path
bit-exact. On 2 GPUs (skipped elsewhere): a process on GPU 0 puts through a real TransferQueue
store, a process on GPU 1 reads the rows back bit-exact with no host copy of the data in the store,
and the putter lets its tensors go once the keys are cleared (at once for its own clears; by a
listing, on demand or in the background of its next put, for other clients').
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from nemo_dataplane.adapters.memory import InMemoryClient
from nemo_dataplane.client import DataPlaneClient
from nemo_dataplane.factory import build_data_plane_client
from nemo_dataplane.refit.cuda import compact as ipc
from nemo_dataplane.testing.conformance import DataPlaneConformance
from nemo_dataplane.testing.fields import assert_same_field, jagged
from nemo_dataplane.wrappers.gpu_resident import (
    MAX_ROW_DIMS,
    RECORD_WIDTH,
    SUFFIX,
    GpuResidentClient,
    _parse,
    _records,
)

REPO = Path(__file__).resolve().parents[2]
# The conformance suite's own field names: every one of its gets goes through the wrapper's path.
SUITE_FIELDS = ("x", "ids", "score", "len", "src", "i", "a", "w", "t", "b", "c", "d", "uid", "bf", "hid", "tenfold")


class TestGpuResidentConformance(DataPlaneConformance):
    @pytest.fixture
    def client(self) -> Iterator[DataPlaneClient]:
        c = GpuResidentClient(InMemoryClient(), SUITE_FIELDS)
        yield c
        c.close()

    def remote_config(self) -> None:
        return None  # around the in-process store

    def fresh_config(self) -> dict[str, Any]:
        return {"backend": "memory", "gpu_fields": list(SUITE_FIELDS)}


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


def _two_puts() -> tuple[torch.Tensor, torch.Tensor]:
    """Records of a jagged put of 3 rows ([len, 2] each) and of another put's 2 rows, handles unlike."""
    lengths = torch.tensor([4, 0, 7])
    starts = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)[:-1]]) * 2
    shapes = torch.stack([lengths, torch.full((3,), 2)], dim=1)
    a = _records("ids", b'{"put": "a"}', starts, lengths * 2, shapes, jagged=True)
    b = _records(
        "ids",
        b'{"put": "bb", "pad": 1}',
        torch.tensor([0, 3]),
        torch.tensor([3, 5]),
        torch.tensor([[3, 1], [5, 1]]),
        True,
    )
    return a, b


def test_records_are_fixed_width_int64_and_parse_back_whatever_puts_and_order_they_come_from() -> None:
    a, b = _two_puts()
    assert a.shape == (3, RECORD_WIDTH) and b.shape == (2, RECORD_WIDTH) and a.dtype == torch.int64
    one = _parse("ids", a)
    assert len(one.blobs) == 1 and json.loads(one.blobs[0]) == {"put": "a"} and one.jagged
    assert one.starts.tolist() == [0, 8, 8] and one.sizes.tolist() == [8, 0, 14]
    assert one.shapes.tolist() == [[4, 2], [0, 2], [7, 2]] and one.group.tolist() == [0, 0, 0]
    # Rows of two puts, interleaved (a read by keys in any order): grouped by the handle they need.
    mixed = _parse("ids", torch.stack([b[1], a[2], b[0], a[0]]))
    handles = [json.loads(x) for x in mixed.blobs]
    assert sorted(h["put"] for h in handles) == ["a", "bb"]
    put_of = [handles[g]["put"] for g in mixed.group.tolist()]
    assert put_of == ["bb", "a", "bb", "a"]
    assert mixed.starts.tolist() == [3, 8, 0, 0] and mixed.shapes.tolist() == [[5, 1], [7, 2], [3, 1], [4, 2]]


def test_records_refuse_what_they_cannot_hold_and_name_the_field() -> None:
    a, _ = _two_puts()
    dense = _records("lp", b"{}", torch.tensor([0, 4]), torch.tensor([4, 4]), torch.tensor([[4], [4]]), jagged=False)
    with pytest.raises(ValueError, match="'ids'.*jagged and as dense"):
        _parse("ids", torch.cat([a, dense]))
    with pytest.raises(ValueError, match="'lp'.*not GPU-resident records"):
        _parse("lp", torch.zeros(2, 5, dtype=torch.int64))
    too_many = torch.ones(2, MAX_ROW_DIMS + 1, dtype=torch.int64)
    with pytest.raises(ValueError, match=f"'lp' has rows of {MAX_ROW_DIMS + 1} dimensions"):
        _records("lp", b"{}", torch.zeros(2, dtype=torch.int64), torch.ones(2, dtype=torch.int64), too_many, False)
    with pytest.raises(RuntimeError, match="'lp': its CUDA IPC handle takes"):
        _records(
            "lp",
            b"x" * 10_000,
            torch.zeros(1, dtype=torch.int64),
            torch.ones(1, dtype=torch.int64),
            torch.ones(1, 1, dtype=torch.int64),
            False,
        )


def test_the_compact_handle_form_packs_torchs_rebuild_arguments_and_reads_them_back() -> None:
    # What torch's reduce_tensor hands over for a CUDA tensor, in kind: classes, sizes, a dtype,
    # a device, IPC handles (bytes), ints, flags, None.
    args = (
        torch.Tensor,
        torch.Size([4096]),
        (1,),
        0,
        torch.storage.TypedStorage,
        torch.bfloat16,
        torch.device("cuda", 1),
        bytes(range(64)),
        1 << 40,
        512,
        False,
        b"/torch_1234_5678_0",
        3,
        None,
        True,
    )
    out = bytearray()
    for a in args:
        ipc._pack(a, out)
    assert len(out) < 200  # the JSON form of such a handle is ~730 bytes
    at, back = 0, []
    for _ in args:
        v, at = ipc._unpack(bytes(out), at)
        back.append(v)
    assert at == len(out)
    assert back == [torch.Tensor, (4096,), (1,), 0, torch.storage.TypedStorage, torch.bfloat16, 1, *args[7:]]
    with pytest.raises(ValueError, match="unknown tag b'x' at byte 0"):
        ipc._unpack(b"x", 0)
    with pytest.raises(TypeError, match="cannot export a handle argument"):
        ipc._pack(object(), bytearray())
    with pytest.raises(ValueError, match="not a compact handle"):
        ipc.open_compact(b"{}")


def test_a_record_naming_a_handle_longer_than_its_slot_is_refused_naming_the_field() -> None:
    a, _ = _two_puts()
    bad = a.clone()
    bad[:, 9] = RECORD_WIDTH * 8
    with pytest.raises(ValueError, match="'ids': a record names a handle of"):
        _parse("ids", bad)


_GPU_PROBE = r"""
import json, os, sys, time
import ray, torch
from nemo_dataplane.factory import build_data_plane_client
from nemo_dataplane.testing.fields import jagged

ray.init(address="local", num_cpus=4, num_gpus=0, include_dashboard=False, log_to_driver=False)
CFG = {"backend": "transfer_queue", "gpu_fields": ["ids", "logprobs"]}
READER_GPU = min(1, torch.cuda.device_count() - 1)  # one GPU: another process on the same one


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

    def clear_own(self, keys):
        self.c.kv_clear(keys, "roll")
        return self.c.held_puts()

    def release_cleared(self):
        return self.c.release_cleared(), self.c.held_puts()

    def wait_held(self, n, timeout):
        deadline = time.monotonic() + timeout
        while self.c.held_puts() != n and time.monotonic() < deadline:
            time.sleep(0.01)
        return self.c.held_puts()


@ray.remote(num_cpus=0.5)
class Reader:
    def __init__(self):
        torch.cuda.set_device(READER_GPU)
        self.c = build_data_plane_client(CFG, bootstrap=False)

    def get(self, meta, by_keys):
        got = self.c.kv_batch_get(list(meta.keys) if by_keys else meta, ["ids", "logprobs"], "roll")
        return {"device": str(got["logprobs"].device), "ids": got["ids"].cpu(), "lp": got["logprobs"].cpu()}

    def records(self, meta):
        inner = self.c
        while hasattr(inner, "inner"):
            inner = inner.inner
        rec = inner.kv_batch_get(meta, ["logprobs@cuda"], "roll")["logprobs@cuda"]
        return rec.numel() * rec.element_size(), int(rec[0, 9])


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
out["record_bytes"], out["handle_bytes"] = ray.get(r.records.remote(meta))
out["payload_bytes"] = lp.numel() * 4
# Its own clear lets a put go at once; another client's clear is found by a listing.
meta2 = ray.get(p.put.remote(8, 2))[0]
out["held_two"] = ray.get(p.wait_held.remote(2, 0))
out["held_after_own_clear"] = ray.get(p.clear_own.remote(list(meta2.keys)))
owner.kv_clear(list(meta.keys), "roll")
out["released_on_demand"] = ray.get(p.release_cleared.remote())
meta3 = ray.get(p.put.remote(2, 3))[0]
owner.kv_clear(list(meta3.keys), "roll")
ray.get(p.put.remote(2, 4))  # starts the background listing that finds put 3 gone
out["held_after_background"] = ray.get(p.wait_held.remote(1, 30))
print(json.dumps(out))
"""


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_rows_put_on_gpu0_are_read_on_gpu1_bit_exact_through_a_real_store_and_released_after_clear() -> None:
    # On one GPU the reader is another process on the same GPU (CUDA IPC works there too).
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
        assert got[f"device_{by_keys}"] == f"cuda:{min(1, torch.cuda.device_count() - 1)}"
        assert got[f"ids_equal_{by_keys}"] and got[f"lp_equal_{by_keys}"]
    # The store holds one fixed-size record a row (the handle fits it), not the rows (16 KiB each).
    assert got["record_bytes"] == 64 * RECORD_WIDTH * 8 < got["payload_bytes"] / 40, got
    assert 0 < got["handle_bytes"] <= (RECORD_WIDTH - 10) * 8
    assert got["held_two"] == 2 and got["held_after_own_clear"] == 1
    assert got["released_on_demand"] == [1, 0]
    assert got["held_after_background"] == 1
