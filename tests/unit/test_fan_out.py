"""fan_out_per_rank_metas over the in-memory reference store and the real TransferQueue."""

from __future__ import annotations

import asyncio
import random
import sys
from collections.abc import Mapping, Sequence
from typing import Any

import pytest
import torch
from tensordict import TensorDict

from nemo_dataplane.adapters.memory import InMemoryClient
from nemo_dataplane.client import DataPlaneClient
from nemo_dataplane.config import PackingConfig
from nemo_dataplane.driver.fan_out import async_fan_out_per_rank_metas, fan_out_per_rank_metas
from nemo_dataplane.driver.preshard import driver_balanced_preshards
from nemo_dataplane.meta import KVBatchMeta
from nemo_dataplane.rows import select_rows
from nemo_dataplane.wrappers.observed import ObservedClient

SEQ = PackingConfig(mode="sequence", max_tokens_per_microbatch=96)


def _batch(n: int, seed: int = 0) -> TensorDict:
    rng = random.Random(seed)
    lens = [rng.randint(2, 60) for _ in range(n)]
    offsets = torch.zeros(n + 1, dtype=torch.int64)
    offsets[1:] = torch.cumsum(torch.tensor(lens), 0)
    total = int(offsets[-1])
    return TensorDict(
        {
            "input_ids": torch.nested.nested_tensor_from_jagged(torch.randint(0, 1000, (total,)), offsets=offsets),
            "logprobs": torch.nested.nested_tensor_from_jagged(torch.randn(total), offsets=offsets.clone()),
            "seq_len": torch.tensor(lens),
            "reward": torch.randn(n),
            "pixel_extra": torch.randn(n, 2, 3),  # an extra field no fixed list would know
        },
        batch_size=[n],
    )


def _assert_same(a: TensorDict, b: TensorDict) -> None:
    assert sorted(a.keys()) == sorted(b.keys())
    for name in a.keys():
        x, y = a[name], b[name]
        assert x.dtype == y.dtype, name
        if x.is_nested:
            assert y.is_nested and torch.equal(x.values(), y.values()) and torch.equal(x.offsets(), y.offsets()), name
        else:
            assert torch.equal(x, y), name


def test_tensordict_source_writes_every_field_under_prefix(store: tuple[DataPlaneClient, str]) -> None:
    client, pid = store
    batch = _batch(20)
    pre = driver_balanced_preshards(batch, 4, SEQ)
    metas = fan_out_per_rank_metas(client, pre, batch, partition_id=pid, key_prefix="step3/train")
    assert len(metas) == 4
    for r, meta in enumerate(metas):
        assert list(meta.keys) == [f"step3/train/{i}" for i in pre.rank_indices[r]]
        assert set(meta.fields or ()) == set(batch.keys())
        assert [t["seq_len"] for t in meta.tags] == [int(batch["seq_len"][i]) for i in pre.rank_indices[r]]
        assert meta.partition_id == pid
        info = meta.extra_info or {}
        assert info["packing"] == pre.rank_plan(r)
        assert info["global_forward_pad_seqlen"] == int(batch["seq_len"].max())
        assert (info["dp_rank"], info["dp_world"]) == (r, 4)
        got = client.kv_batch_get(meta, sorted(batch.keys()))
        _assert_same(got, select_rows(batch, pre.rank_indices[r]))
    assert len(client.kv_list(pid)) == 20


def test_concurrent_fan_outs_with_different_prefixes_do_not_collide(store: tuple[DataPlaneClient, str]) -> None:
    client, pid = store
    a, b = _batch(12, seed=1), _batch(12, seed=2)
    pa, pb = driver_balanced_preshards(a, 2, SEQ), driver_balanced_preshards(b, 2, SEQ)

    async def both() -> tuple[list[KVBatchMeta], list[KVBatchMeta]]:
        return await asyncio.gather(
            async_fan_out_per_rank_metas(client, pa, a, partition_id=pid, key_prefix="s1/lp"),
            async_fan_out_per_rank_metas(client, pb, b, partition_id=pid, key_prefix="s1/ref"),
        )

    ma, mb = asyncio.run(both())
    assert len(client.kv_list(pid)) == 24
    for metas, batch, pre in ((ma, a, pa), (mb, b, pb)):
        for r, meta in enumerate(metas):
            _assert_same(
                client.kv_batch_get(meta, ["input_ids", "reward"]),
                select_rows(batch, pre.rank_indices[r]).select("input_ids", "reward"),
            )


def test_meta_source_is_resliced_without_io(store: tuple[DataPlaneClient, str]) -> None:
    client, pid = store
    batch = _batch(10)
    keys = [f"rollout/{i}" for i in range(10)]
    stored = client.kv_batch_put(
        keys, pid, batch, tags=[{"seq_len": int(s), "uid": i} for i, s in enumerate(batch["seq_len"])]
    )
    stored = stored.with_extra_info(step=7)
    pre = driver_balanced_preshards(stored, 2, SEQ)
    observed = ObservedClient(client)
    metas = fan_out_per_rank_metas(observed, pre, stored, partition_id=pid, key_prefix="unused")
    assert sum(observed.op_counts.values()) == 0  # no store op at all
    for r, meta in enumerate(metas):
        assert list(meta.keys) == [keys[i] for i in pre.rank_indices[r]]  # the source's keys kept
        assert [t["uid"] for t in meta.tags] == list(pre.rank_indices[r])
        assert meta.fields == stored.fields
        assert meta.extra_info["step"] == 7 and meta.extra_info["packing"] == pre.rank_plan(r)
    with pytest.raises(ValueError, match="cannot move partitions"):
        fan_out_per_rank_metas(None, pre, stored, partition_id="elsewhere", key_prefix="x")


class _BarrierClient(InMemoryClient):
    """Each async put waits until ``n`` puts are in flight: only a concurrent fan-out finishes."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.n = n
        self.in_flight = 0
        self.max_in_flight = 0

    async def async_kv_batch_put(
        self, keys: Sequence[str], partition_id: str, fields: Any, tags: Sequence[Mapping[str, Any]] | None = None
    ) -> KVBatchMeta:
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        while self.max_in_flight < self.n:
            await asyncio.sleep(0.001)
        out = self.kv_batch_put(keys, partition_id, fields, tags)
        self.in_flight -= 1
        return out


def test_ranks_are_written_concurrently_in_one_gather() -> None:
    batch = _batch(16)
    pre = driver_balanced_preshards(batch, 4, SEQ)
    client = _BarrierClient(4)
    # A loop of blocking puts would never have 4 in flight and would hit the timeout.
    metas = fan_out_per_rank_metas(client, pre, batch, partition_id="p", key_prefix="s", timeout_s=10)
    assert client.max_in_flight == 4 and len(metas) == 4


class _FailingClient(InMemoryClient):
    """Fails the put of the keys containing ``bad_key``, after the other ranks' puts landed."""

    def __init__(self, bad_key: str) -> None:
        super().__init__()
        self.bad_key = bad_key

    async def async_kv_batch_put(
        self, keys: Sequence[str], partition_id: str, fields: Any, tags: Sequence[Mapping[str, Any]] | None = None
    ) -> KVBatchMeta:
        if self.bad_key in keys:
            await asyncio.sleep(0.05)
            raise RuntimeError("storage unit lost")
        return self.kv_batch_put(keys, partition_id, fields, tags)


def test_failed_fan_out_leaves_no_keys() -> None:
    batch = _batch(12)
    pre = driver_balanced_preshards(batch, 3, SEQ)
    client = _FailingClient("s/5")
    with pytest.raises(RuntimeError, match="storage unit lost"):
        fan_out_per_rank_metas(client, pre, batch, partition_id="p", key_prefix="s")
    assert len(client.kv_list("p")) == 0


class _FailingClearClient(_FailingClient):
    async def async_kv_clear(self, keys: Sequence[str] | None, partition_id: str) -> None:
        raise ConnectionError("store unreachable")


def test_failed_cleanup_is_reported_on_the_fan_out_error() -> None:
    batch = _batch(12)
    pre = driver_balanced_preshards(batch, 3, SEQ)
    with pytest.raises(RuntimeError, match="storage unit lost") as info:
        fan_out_per_rank_metas(_FailingClearClient("s/5"), pre, batch, partition_id="p", key_prefix="s")
    notes = " ".join(getattr(info.value, "__notes__", []))
    if sys.version_info >= (3, 11):
        assert "partition 'p' also failed: ConnectionError: store unreachable" in notes


def test_mismatched_sizes_raise() -> None:
    batch = _batch(8)
    pre = driver_balanced_preshards(_batch(9), 2, SEQ)
    with pytest.raises(ValueError, match="8 rows but the plan covers 9"):
        fan_out_per_rank_metas(InMemoryClient(), pre, batch, partition_id="p", key_prefix="s")
    with pytest.raises(ValueError, match="key_prefix"):
        fan_out_per_rank_metas(
            InMemoryClient(), driver_balanced_preshards(batch, 2, SEQ), batch, partition_id="p", key_prefix=""
        )
    for bad in (None, 0, -1.0, float("nan"), float("inf"), "10"):
        with pytest.raises(ValueError, match="fan-out: timeout_s must be"):
            fan_out_per_rank_metas(
                InMemoryClient(),
                driver_balanced_preshards(batch, 2, SEQ),
                batch,
                partition_id="p",
                key_prefix="s",
                timeout_s=bad,
            )  # type: ignore[arg-type]


def test_sync_fan_out_works_inside_a_running_event_loop() -> None:
    # E.g. called from an async Ray actor method: asyncio.run would refuse there.
    batch = _batch(8)
    pre = driver_balanced_preshards(batch, 2, SEQ)
    client = InMemoryClient()

    async def caller() -> list[KVBatchMeta]:
        return fan_out_per_rank_metas(client, pre, batch, partition_id="p", key_prefix="s")

    metas = asyncio.run(caller())
    assert sorted(k for m in metas for k in m.keys) == sorted(f"s/{i}" for i in range(8))


class _HangingClient(InMemoryClient):
    """Writes every rank's put at once, except the one holding ``stuck_key``, which never returns."""

    def __init__(self, stuck_key: str) -> None:
        super().__init__()
        self.stuck_key = stuck_key

    async def async_kv_batch_put(
        self, keys: Sequence[str], partition_id: str, fields: Any, tags: Sequence[Mapping[str, Any]] | None = None
    ) -> KVBatchMeta:
        if self.stuck_key in keys:
            await asyncio.sleep(3600)
        return self.kv_batch_put(keys, partition_id, fields, tags)


def test_fan_out_times_out_and_clears_what_it_wrote() -> None:
    batch = _batch(12)
    pre = driver_balanced_preshards(batch, 3, SEQ)
    client = _HangingClient("s/0")
    with pytest.raises(TimeoutError, match="did not finish in 0.3s"):
        fan_out_per_rank_metas(client, pre, batch, partition_id="p", key_prefix="s", timeout_s=0.3)
    assert len(client.kv_list("p")) == 0
