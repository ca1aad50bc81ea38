"""ObservedClient: one event per op (errors recorded then re-raised), byte accounting."""

from __future__ import annotations

import asyncio

import pytest
import torch

from nemo_dataplane.adapters.memory import InMemoryClient
from nemo_dataplane.observability import ObservedClient, OpEvent
from nemo_dataplane.testing.conformance import jagged


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
