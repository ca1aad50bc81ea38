"""Per-row integrity digests (data_plane.verify_integrity) through the real backends.

The store is corrupted the way a bad write or a bit flip would: different bytes under the same
key, written through the raw backend client (below the wrapper), so the recorded tag stays.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import pytest
import torch

from nemo_dataplane.client import DataIntegrityError, DataPlaneError
from nemo_dataplane.codec import jagged_from_rows
from nemo_dataplane.factory import build_data_plane_client
from nemo_dataplane.wrappers.integrity import TAG_PREFIX, IntegrityCheck, row_digests


@pytest.fixture(params=["memory", "transfer_queue", "ray"])
def raw(request: pytest.FixtureRequest) -> Any:
    if request.param == "memory":
        from nemo_dataplane.adapters.memory import InMemoryClient

        return InMemoryClient()
    return request.getfixturevalue({"transfer_queue": "tq_client", "ray": "ray_store_client"}[request.param])


def _fields(n: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(n)
    return {
        "ids": jagged_from_rows([torch.randint(0, 100, (1 + i % 4,), generator=g) for i in range(n)]),
        "reward": torch.randn(n, generator=g),
        "logits": torch.randn(n, 3, generator=g).to(torch.bfloat16),
    }


def test_digests_cover_dtype_shape_and_bytes() -> None:
    x = torch.arange(6, dtype=torch.int32).reshape(3, 2)
    d = row_digests(x)
    assert len(set(d)) == 3
    assert row_digests(x.view(torch.float32)) != d  # same bytes, other dtype
    assert row_digests(torch.arange(6, dtype=torch.int32).reshape(3, 2, 1)) != d  # same bytes, other shape
    j = jagged_from_rows([torch.arange(2), torch.arange(3), torch.arange(0)])
    assert row_digests(j)[1] == row_digests(jagged_from_rows([torch.arange(3)]))[0]  # a row is its own slice


def test_uncorrupted_round_trips_pass_and_a_corrupted_row_names_key_and_field(raw: Any) -> None:
    client = IntegrityCheck(raw)
    pid = f"integrity-{uuid.uuid4().hex[:8]}"
    keys = [f"k{i}" for i in range(6)]
    fields = _fields(6)
    try:
        meta = client.kv_batch_put(keys, pid, fields, tags=[{"i": i} for i in range(6)])
        # The digests round-trip as tags through the backend, next to the caller's own.
        listed = dict(zip(raw.kv_list(pid).keys, raw.kv_list(pid).tags))
        assert listed["k2"]["i"] == 2 and listed["k2"][TAG_PREFIX + "reward"] == row_digests(fields["reward"])[2]
        out = client.kv_batch_get(meta, ["ids", "reward", "logits"])
        assert torch.equal(out["reward"], fields["reward"])
        client.kv_batch_get(meta.subset([1, 4]), ["logits"])  # a column subset of some rows
        client.kv_batch_get(keys, ["reward"], partition_id=pid)  # keys only: tags read from the store

        # Corrupt k3's reward below the wrapper: the recorded digest no longer matches.
        raw.kv_batch_put(["k3"], pid, {"reward": torch.tensor([123.0])})
        with pytest.raises(DataIntegrityError, match=r"key 'k3', field 'reward'") as e:
            client.kv_batch_get(meta, ["ids", "reward"])
        assert isinstance(e.value, DataPlaneError) and pid in str(e.value)
        with pytest.raises(DataIntegrityError, match=r"key 'k3', field 'reward'"):
            client.kv_batch_get(keys, ["reward"], partition_id=pid)
        with pytest.raises(DataIntegrityError, match=r"key 'k3', field 'reward'"):
            asyncio.run(client.async_kv_batch_get(meta, ["reward"]))
        # Other fields and other rows of the same partition still read fine.
        client.kv_batch_get(meta, ["ids", "logits"])
        client.kv_batch_get(meta.subset([0, 1, 2, 4, 5]), ["reward"])

        # A jagged row corrupted with the same length.
        bad = jagged_from_rows([fields["ids"].unbind()[5] + 1])
        raw.kv_batch_put(["k5"], pid, {"ids": bad})
        with pytest.raises(DataIntegrityError, match=r"key 'k5', field 'ids'"):
            client.kv_batch_get(meta.subset([5]), ["ids"])

        # A legitimate rewrite through the wrapper: the old meta's digests are stale, the
        # store's are current, so the get passes.
        client.kv_batch_put(["k3"], pid, {"reward": torch.tensor([7.0])})
        assert client.kv_batch_get(meta.subset([3]), ["reward"])["reward"].tolist() == [7.0]
    finally:
        raw.kv_clear(None, pid)


def test_a_row_written_without_digests_is_refused(raw: Any) -> None:
    client = IntegrityCheck(raw)
    pid = f"integrity-{uuid.uuid4().hex[:8]}"
    try:
        meta = raw.kv_batch_put(["a", "b"], pid, {"x": torch.arange(2)})
        with pytest.raises(DataIntegrityError, match=r"key 'a', field 'x': no digest was recorded"):
            client.kv_batch_get(meta, ["x"])
    finally:
        raw.kv_clear(None, pid)


def test_the_factory_wraps_when_the_key_is_on() -> None:
    on = build_data_plane_client({"backend": "memory", "verify_integrity": True})
    assert isinstance(on, IntegrityCheck)
    off = build_data_plane_client({"backend": "memory"})
    assert not isinstance(off, IntegrityCheck)
    meta = on.kv_batch_put(["a"], "p", {"x": torch.ones(1, 2)})
    assert meta.tags[0][TAG_PREFIX + "x"] == row_digests(torch.ones(1, 2))[0]
