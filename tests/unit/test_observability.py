"""ObservedClient: one event per op (errors recorded then re-raised), byte accounting."""

from __future__ import annotations

import asyncio

import pytest
import torch

from nemo_dataplane.adapters.memory import InMemoryClient
from nemo_dataplane.testing.fields import jagged
from nemo_dataplane.wrappers.observed import ObservedClient, OpEvent, Outstanding


def _observed() -> tuple[ObservedClient, list[OpEvent]]:
    events: list[OpEvent] = []
    return ObservedClient(InMemoryClient(), events.append), events


def test_events_for_every_op_with_sizes() -> None:
    c, events = _observed()
    ids = jagged([3, 5])  # 8 int64 = 64 bytes
    meta = c.kv_batch_put(["a", "b"], "p", {"ids": ids, "x": torch.zeros(2, 4)})  # + 32 bytes
    out = c.kv_batch_get(meta, ["x"])
    c.kv_list("p")
    c.kv_clear(["a"], "p")
    c.kv_clear(None, "p")
    assert [e.op for e in events] == ["kv_batch_put", "kv_batch_get", "kv_list", "kv_clear", "kv_clear"]
    put, get, lst, clr, clr_all = events
    assert (put.partition_id, put.n_keys, put.n_bytes, put.status) == ("p", 2, 96, "ok")
    assert (get.n_keys, get.n_bytes) == (2, 32) and out["x"].shape == (2, 4)
    assert lst.n_keys == 2 and clr.n_keys == 1 and clr_all.n_keys == -1
    assert all(e.wall_ms >= 0 for e in events)
    assert c.op_counts == {"kv_batch_put": 1, "kv_batch_get": 1, "kv_list": 1, "kv_clear": 2}
    assert c.bytes_by_op["kv_batch_put"] == 96
    assert put.to_dict()["op"] == "kv_batch_put"


def test_errors_are_recorded_then_reraised_unchanged() -> None:
    c, events = _observed()
    with pytest.raises(KeyError, match="ghost"):
        c.kv_batch_get(["ghost"], ["x"], partition_id="p")
    with pytest.raises(ValueError, match="repeat"):
        c.kv_batch_put(["a", "a"], "p", {"x": torch.zeros(2)})
    assert [(e.op, e.status) for e in events] == [("kv_batch_get", "error"), ("kv_batch_put", "error")]
    assert events[0].error is not None and events[0].error.startswith("KeyError") and "ghost" in events[0].error
    assert c.bytes_outstanding == 0  # a failed put holds nothing


def test_bytes_outstanding_and_peak_follow_puts_upserts_and_clears() -> None:
    c, _ = _observed()
    c.kv_batch_put(["a", "b"], "p", {"x": torch.zeros(2, 8)})  # 2 x 32 bytes
    assert c.bytes_outstanding == 64
    c.kv_batch_put(["a"], "p", {"x": torch.zeros(1, 8)})  # upsert: same size, no growth
    assert c.bytes_outstanding == 64
    c.kv_batch_put(["a"], "p", {"y": torch.zeros(1, 2, dtype=torch.float64)})  # +16
    c.kv_batch_put(["z"], "q", {"x": torch.zeros(1, 4)})  # +16 elsewhere
    assert c.bytes_outstanding == 96 and c.peak_bytes_outstanding == 96
    c.kv_clear(["a", "missing"], "p")
    assert c.bytes_outstanding == 48
    c.kv_clear(None, "p")
    assert c.bytes_outstanding == 16 and c.peak_bytes_outstanding == 96
    c.kv_clear(None, "q")
    assert c.bytes_outstanding == 0


def test_async_twins_are_observed_too() -> None:
    c, events = _observed()

    async def run() -> None:
        await asyncio.gather(
            c.async_kv_batch_put(["a"], "p", {"x": torch.zeros(1, 4)}),
            c.async_kv_batch_put(["b"], "q", {"x": torch.zeros(1, 4)}),
        )
        await c.async_kv_batch_get(["a"], ["x"], partition_id="p")
        await c.async_kv_list("q")
        await c.async_kv_clear(None, "p")

    asyncio.run(run())
    assert sorted(e.op for e in events) == ["kv_batch_get", "kv_batch_put", "kv_batch_put", "kv_clear", "kv_list"]
    assert c.bytes_outstanding == 16 and c.peak_bytes_outstanding == 32


def test_claim_ops_are_forwarded_and_recorded() -> None:
    c, events = _observed()
    c.kv_batch_put(["a", "b", "c"], "p", {"x": torch.zeros(3)})
    meta = c.kv_claim("p", "t", ["x"], 2, 0)
    c.kv_mark_consumed(["c", "ghost"], "p", "t")
    status = c.kv_claim_status("p", "t", ["x"])
    parts = c.kv_partitions()
    with pytest.raises(ValueError, match="task"):
        c.kv_claim("p", "", ["x"], 1, 0)
    assert meta.keys == ("a", "b") and parts == ["p"]
    assert (status.rows, status.claimed, status.claimable) == (3, 3, 0)
    got = [(e.op, e.partition_id, e.n_keys, e.status) for e in events[1:]]
    assert got == [
        ("kv_claim", "p", 2, "ok"),
        ("kv_mark_consumed", "p", 2, "ok"),
        ("kv_claim_status", "p", 3, "ok"),
        ("kv_partitions", None, 0, "ok"),
        ("kv_claim", "p", 0, "error"),
    ]


def test_async_claim_twins_are_observed() -> None:
    c, events = _observed()

    async def run() -> tuple[int, int]:
        await c.async_kv_batch_put(["a", "b"], "p", {"x": torch.zeros(2)})
        m1, m2 = await asyncio.gather(c.async_kv_claim("p", "t", ["x"], 1, 0), c.async_kv_claim("p", "t", ["x"], 1, 0))
        await c.async_kv_mark_consumed(["a"], "p", "u")
        status = await c.async_kv_claim_status("p", "u", ["x"])
        assert await c.async_kv_partitions() == ["p"]
        return len(set(m1.keys) | set(m2.keys)), status.claimed

    assert asyncio.run(run()) == (2, 1)
    assert [e.op for e in events].count("kv_claim") == 2
    assert {"kv_mark_consumed", "kv_claim_status", "kv_partitions"} <= {e.op for e in events}


def test_snapshot_is_own_accounting_and_store_snapshot_sees_every_writer() -> None:
    inner = InMemoryClient()
    events: list[OpEvent] = []
    c = ObservedClient(inner, events.append)
    c.kv_batch_put(["a", "b"], "p", {"x": torch.zeros(2, 4)})  # 2 x 16 bytes
    c.kv_batch_put(["t"], "q", None, tags=[{"only": "tags"}])  # a key without bytes still counts
    inner.kv_batch_put(["w"], "r", {"x": torch.zeros(1)})  # a writer not going through the wrapper
    assert c.snapshot() == {"p": Outstanding(keys=2, bytes=32), "q": Outstanding(keys=1, bytes=0)}
    assert c.store_snapshot() == {"p": ("a", "b"), "q": ("t",), "r": ("w",)}
    assert events[-1].op == "store_snapshot" and events[-1].n_keys == 4
    c.kv_clear(["a"], "p")
    c.kv_clear(None, "q")
    inner.kv_clear(["b"], "p")  # cleared behind the wrapper's back: only the store view knows
    assert c.snapshot() == {"p": Outstanding(keys=1, bytes=16)}
    assert c.store_snapshot() == {"r": ("w",)}


def test_without_the_ledger_every_op_is_still_timed_and_nothing_is_tracked_per_key() -> None:
    events: list[OpEvent] = []
    c = ObservedClient(InMemoryClient(), events.append, track_outstanding=False)
    c.kv_batch_put(["a", "b"], "p", {"x": torch.zeros(2, 4)})
    c.kv_clear(["a"], "p")
    assert [e.op for e in events] == ["kv_batch_put", "kv_clear"] and events[0].n_bytes == 32
    assert all(e.ended_at > 0 and e.wall_ms >= 0 for e in events)
    assert c.bytes_outstanding == 0 and c.snapshot() == {}
    tracked = ObservedClient(InMemoryClient())
    tracked.kv_batch_put(["a", "b"], "p", {"x": torch.zeros(2, 4)})
    assert tracked.bytes_outstanding == 32  # the default keeps the ledger
