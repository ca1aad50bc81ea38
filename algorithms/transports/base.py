"""How rollouts move between the trainer's processes: one interface, each side supplied.

A transport is chosen once (:func:`algorithms.transports.make_transport`, from
``data_plane.enabled``) and everything after it talks to these interfaces, never to a store or
to Ray's object store directly:

* :class:`Transport`, the driver's side: bring the store up and down; the step's data movements
  (keep rows, write advantages, pre-shard, per-rank inputs, absorb results, release); counts.
  It also supplies the other three sides.
* :class:`RolloutSink`, the collector's side: deliver a generated batch now (sync) or stream it
  as it is produced (async), with backpressure.
* :class:`RolloutSource`, the async driver's side: whole groups as they are produced.
* :class:`BatchIO`, a policy rank's side: read its share of a step's rows, hand back results.

The driver builds the sink and the batch I/O (plain, picklable objects holding config only) and
passes them to the actors, which ``open()`` them in their own process.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from tensordict import TensorDict

from algorithms.config import TrainerConfig
from algorithms.rollouts import ClaimedGroup, Job
from algorithms.telemetry import OpLog, OpRecord
from nemo_dataplane.driver.planner import Preshards
from nemo_dataplane.driver.preshard import driver_balanced_preshards

__all__ = ["BatchIO", "Loaded", "RolloutSink", "RolloutSource", "Transport"]


class RolloutSink(ABC):
    """Where a collector delivers generated groups. Built on the driver, opened in the collector."""

    def open(self) -> None:
        """Attach to whatever carries the rows (in the collector's process)."""

    @abstractmethod
    def deliver(
        self, jobs: Sequence[Job], batch: TensorDict, tags: list[dict[str, Any]], version: int
    ) -> tuple[Any, int]:
        """Sync: hand ``jobs``' rows over now; returns ``(handle, bytes stored)``, the handle being
        what the driver's :class:`Transport` moves. A failed delivery leaves none of its rows."""

    @abstractmethod
    def stream(
        self,
        jobs: Sequence[Job],
        batch: TensorDict,
        tags: list[dict[str, Any]],
        version: int,
        stopped: Callable[[], bool],
    ) -> float:
        """Async: make ``jobs``' rows available to :class:`RolloutSource`, waiting for room if the
        store is full (until ``stopped()`` or the sink's bound); returns the seconds waited. A
        failed delivery leaves none of its rows."""

    @abstractmethod
    def unconsumed_groups(self) -> int:
        """Groups delivered and not yet taken by the trainer (the collector's backpressure)."""

    def take(self, max_groups: int, timeout_s: float, stopped: Callable[[], bool]) -> list[dict[str, Any]]:
        """Groups held by the collector itself, for a source that takes them through Ray."""
        raise NotImplementedError(f"{type(self).__name__}: rows are not held by the collector")

    def stats(self) -> dict[str, float]:
        """Counters for the driver (summed over collectors)."""
        return {}

    def drain_ops(self) -> list[OpRecord]:
        """The store ops this sink made since the last call (none where nothing is stored)."""
        return []

    def close(self) -> None:
        """Detach (idempotent)."""


class RolloutSource(ABC):
    """The async trainer's view of delivered groups."""

    @abstractmethod
    def claim(self, need_groups: int, timeout_s: float) -> list[ClaimedGroup]:
        """Whole groups delivered since the last call (oldest first), waiting up to ``timeout_s``
        for up to ``need_groups``; may return fewer or none."""

    @abstractmethod
    def drop(self, group: ClaimedGroup) -> None:
        """A claimed group that will not be trained: its rows leave the store."""

    def discard(self, group_id: int) -> None:
        """Forget partial rows of a group whose delivery failed (its writer cleared them)."""

    def partial_rows(self) -> int:
        """Rows held of groups not yet complete."""
        return 0

    def forget(self, group_ids: Sequence[int]) -> None:
        """Groups whose writer was lost mid-way: whatever of their rows was delivered (held
        here or still in the store) is dropped, so they can be generated again."""
        for gid in group_ids:
            self.discard(gid)


@dataclass
class Loaded:
    """A policy rank's rows for one call: its micro-batches, each one's positions within the
    rank's shard, the shard's size and the bytes read from the store."""

    microbatches: list[TensorDict]
    positions: list[list[int]]
    size: int
    nbytes: int


class BatchIO(ABC):
    """A policy rank's reader/writer of step batches. Built on the driver, opened on the rank."""

    def open(self, rank: int, replica_group: Any, timeout_s: float) -> None:
        """Attach in the rank's process; ``replica_group``: the rank's TP group (``None``: the rank
        is its own replica)."""

    def resolve(self, batch: Any) -> Any:
        """A per-rank input as the rank receives it through a compiled graph (not resolved by Ray)."""
        return batch

    @abstractmethod
    def load(self, batch: Any, fields: Sequence[str]) -> Loaded:
        """The rank's rows of ``batch`` (``fields`` only), cut into the driver's micro-batches."""

    @abstractmethod
    def store(self, batch: Any, columns: Mapping[str, torch.Tensor]) -> tuple[dict[str, Any], int]:
        """Hand the rank's per-row results back: ``(what the call returns to the driver, bytes
        written to the store)``."""

    def drain_ops(self) -> list[OpRecord]:
        """The store ops this rank made since the last call (none where nothing is stored)."""
        return []

    def close(self) -> None:
        """Detach (idempotent)."""


class Transport(ABC):
    """The driver's side. ``handle`` is whatever this transport moves for a batch of rows.

    ``driver_bytes`` (bytes through the driver this step) and ``column_bytes`` (bytes the driver
    itself wrote to the store) are counted by the step and reset after it.
    """

    name: ClassVar[str]
    # What :meth:`start` brings up, as the start-up display names it (None: nothing to wait for).
    startup_phase: ClassVar[str | None] = None

    def __init__(self, cfg: TrainerConfig) -> None:
        self.cfg = cfg
        self.driver_bytes = 0
        self.column_bytes = 0
        # Every caller's store ops (algorithms.telemetry): the driver's own, and those the ranks
        # and collectors report; the step drains them.
        self.ops = OpLog("driver")

    def drain_ops(self) -> list[OpRecord]:
        """Store ops recorded since the last call, from every process that reported them."""
        return self.ops.drain()

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """Bring up what carries the rows (before the workers attach)."""

    def actor_modules(self) -> tuple[str, ...]:
        """Modules the actors that :meth:`start` creates import (Ray's idle workers may import
        them ahead); empty: it creates none."""
        return ()

    def startup_detail(self) -> dict[str, float]:
        """Where :meth:`start` spent its time, in seconds by phase (empty: nothing measured)."""
        return {}

    def close(self) -> None:
        """Shut it down (idempotent; best effort after a failure)."""

    def capacity_rows(self) -> int | None:
        """Rows the store holds at most (``None``: unbounded)."""
        return None

    def label(self) -> str:
        """What the run's output calls this transport (its store named, where it has one)."""
        return self.name

    def require_claims(self) -> None:
        """Raise ``ConfigError`` (naming the key at fault) when :meth:`source` could not take
        groups as they are produced; called before anything starts. Default: it can."""

    # ------------------------------------------------------------------ the other sides
    @abstractmethod
    def sink(self) -> RolloutSink:
        """A collector's sink (opened in the collector)."""

    @abstractmethod
    def batch_io(self) -> BatchIO:
        """A policy rank's reader/writer (opened on the rank)."""

    @abstractmethod
    def source(self, pool: Any) -> RolloutSource:
        """The async trainer's source of groups; ``pool``: the collectors (``CollectorPool``)."""

    # ------------------------------------------------------------------ a step's data movements
    @abstractmethod
    def concat(self, parts: Sequence[Any]) -> Any:
        """One handle of the rows of ``parts`` (groups' rows), in order."""

    @abstractmethod
    def keep(self, handle: Any, keep_idx: list[int], drop_idx: list[int]) -> Any:
        """The rows ``keep_idx`` of ``handle``; rows ``drop_idx`` are released."""

    @abstractmethod
    def write_advantages(self, handle: Any, advantages: torch.Tensor) -> Any:
        """Attach the per-row advantages."""

    def preshard(self, handle: Any, dp_world: int) -> Preshards:
        """One plan (ranks x micro-batches) from every row's ``seq_len``."""
        return driver_balanced_preshards(handle, dp_world, self.cfg.data_plane.packing)

    @abstractmethod
    def rank_inputs(self, handle: Any, preshards: Preshards, step: int) -> list[Any]:
        """One input per DP rank."""

    @abstractmethod
    def input_bytes(self, inputs: Sequence[Any]) -> int:
        """Bytes through the driver to send ``inputs`` not yet counted by :meth:`rank_inputs`."""

    @abstractmethod
    def absorb(self, handle: Any, preshards: Preshards, field: str, rank_results: Sequence[Mapping[str, Any]]) -> Any:
        """The handle once the ranks produced per-row ``field``."""

    @abstractmethod
    def release(self, handle: Any) -> None:
        """The rows of ``handle`` leave the store (a no-op where nothing is stored)."""

    @abstractmethod
    def outstanding(self, audit: bool = False) -> int:
        """Rows held outside the driver right now: the rollouts' count (cheap, every step), or
        with ``audit`` a listing of the whole store (at exit and every ``logging.audit_every``
        steps: rows anywhere else, or a count that disagrees with the listing, show up there)."""

    @abstractmethod
    def stored_keys(self) -> dict[str, list[str]]:
        """Every key held, by partition (a listing of the whole store; empty where nothing is
        stored). The trainer reads it before its final clear to tell leaked rows from rows of
        groups still in flight."""

    @abstractmethod
    def clear_all(self) -> None:
        """Drop every row held (resume, shutdown)."""

    # ------------------------------------------------------------------ checkpointed groups
    @abstractmethod
    def snapshot(self, group: ClaimedGroup) -> dict[str, Any]:
        """A claimed group's rows (and tags) as plain tensors, for a checkpoint: what
        :meth:`restore` takes back (``torch.load(weights_only=True)`` reads it)."""

    @abstractmethod
    def restore(self, group_id: int, version: int, state: Mapping[str, Any]) -> Any:
        """Put a :meth:`snapshot` back where this transport keeps rows, already taken by the
        trainer (a source never delivers it again); returns the rows' handle."""
