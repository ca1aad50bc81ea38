"""Data-plane op timings as every caller sees them, gathered on the driver, and the data plane's
share of a trainer step.

Each process that holds a store client (the driver, every policy rank, every collector) records
its client's ops in an :class:`OpLog` (the client's ``on_event``: ``ObservedClient``). The ranks
hand theirs to the driver in each call's reply and the collectors in each poll, so nothing
listens per worker; the driver's transport merges them with its own
(:meth:`algorithms.transports.Transport.drain_ops`). A step's records feed ``metrics.jsonl``
(:func:`op_summary`) and the Prometheus endpoint (:mod:`algorithms.exporter`).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:  # the baseline transport must not load the data plane
    from nemo_dataplane.wrappers.observed import OpEvent

__all__ = ["DIRECTIONS", "WAITING_OPS", "OpLog", "OpRecord", "direction", "op_summary", "union_seconds"]

# Ops that block until rows exist: their time is the wait for rollouts, not data-plane work.
WAITING_OPS = frozenset({"kv_claim"})
# Which way an op's payload bytes go, for ``nemo_dataplane_bytes_total{direction}``.
DIRECTIONS = {"kv_batch_put": "put", "kv_batch_get": "get", "kv_claim": "get"}


class OpRecord(NamedTuple):
    """One op: its name, seconds, payload bytes, keys, wall-clock end (``time.time()``) and where
    it ran (``driver`` | ``rank`` | ``collector``)."""

    op: str
    seconds: float
    n_bytes: int
    n_keys: int
    ended_at: float
    source: str


def direction(op: str) -> str | None:
    return DIRECTIONS.get(op)


class OpLog:
    """A client's ``on_event`` sink in one process (thread-safe); its owner drains it."""

    def __init__(self, source: str) -> None:
        self.source = source
        self._lock = threading.Lock()
        self._records: list[OpRecord] = []

    def __call__(self, event: OpEvent) -> None:
        rec = OpRecord(
            event.op, event.wall_ms / 1e3, int(event.n_bytes), int(event.n_keys), float(event.ended_at), self.source
        )
        with self._lock:
            self._records.append(rec)

    def extend(self, records: Iterable[Sequence[Any]]) -> None:
        """Add records another process drained (plain tuples after Ray)."""
        recs = [OpRecord(str(r[0]), float(r[1]), int(r[2]), int(r[3]), float(r[4]), str(r[5])) for r in records]
        with self._lock:
            self._records.extend(recs)

    def drain(self) -> list[OpRecord]:
        with self._lock:
            out, self._records = self._records, []
        return out


def union_seconds(intervals: Iterable[tuple[float, float]], lo: float, hi: float) -> float:
    """Length of the union of ``intervals`` clipped to ``[lo, hi]``: overlapping time counts once."""
    spans = sorted((max(a, lo), min(b, hi)) for a, b in intervals if b > lo and a < hi)
    total, end = 0.0, lo
    for a, b in spans:
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def op_summary(records: Sequence[OpRecord], step_begin: float, step_end: float) -> dict[str, float]:
    """The step's data-plane figures for ``metrics.jsonl``: ``dataplane_s`` (the union of the
    driver's and the policy ranks' op intervals inside the step: the trainer's critical path;
    collectors run beside it; a claim's long poll is the wait for rollouts, which the trainer's
    idle ratio counts, not data-plane work) and ``dataplane_step_fraction`` (over the step's wall time), the op
    count, and the bytes put and got by every caller."""
    trainer = [
        (r.ended_at - r.seconds, r.ended_at)
        for r in records
        if r.source in ("driver", "rank") and r.op not in WAITING_OPS
    ]
    busy = union_seconds(trainer, step_begin, step_end)
    wall = max(step_end - step_begin, 1e-9)
    out = {"dataplane_s": busy, "dataplane_step_fraction": min(busy / wall, 1.0), "dp_ops": float(len(records))}
    for way in ("put", "get"):
        out[f"dp_bytes_{way}"] = float(sum(r.n_bytes for r in records if direction(r.op) == way))
    return out
