"""The in-memory baseline transport: the one every data-plane comparison is made against.

The driver holds the whole step's ``TensorDict``, cuts it into per-rank shards with the same
planner the data plane uses, and ships each rank its shard through the Ray object store
(``ray.put`` on the driver, ``ray.get`` on the worker); results come back to the driver as
tensors. In the async trainer finished groups wait in the collectors' outboxes and travel to the
driver through Ray. Every byte passes through the driver.

Deliberately independent of the data plane: this module imports only the planner and the row
helpers (``nemo_dataplane.rows``) (plus torch, ray, tensordict), never the store client,
adapters, fan-out, column I/O or worker fetch, so the baseline cannot quietly use them.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import ray
import torch
from tensordict import TensorDict

from algorithms.metrics import payload_bytes
from algorithms.rollouts import ClaimedGroup, Job, group_from_tags, rows_from_state, rows_state
from algorithms.transports.base import BatchIO, Loaded, RolloutSink, RolloutSource, Transport
from nemo_dataplane.codec import is_jagged, jagged_from_rows, jagged_rows
from nemo_dataplane.driver.planner import Preshards
from nemo_dataplane.rows import select_rows, split_microbatches

__all__ = [
    "LegacyBatchIO",
    "LegacyShard",
    "LegacySink",
    "LegacySource",
    "LegacyTransport",
    "concat_batches",
    "fetch_shard",
    "legacy_shard",
    "ship_shards",
]


@dataclass(frozen=True)
class LegacyShard:
    """One DP rank's shard as the driver ships it.

    Attributes:
        rank: the DP rank.
        data: that rank's rows, in the rank's local order (every field of the batch).
        plan: the rank's packing plan, :meth:`Preshards.rank_plan` (identical to the data plane's).
        extra_info: the same batch-level entries a fan-out meta carries.
    """

    rank: int
    data: TensorDict
    plan: dict[str, Any]
    extra_info: dict[str, Any] = field(default_factory=dict)

    def microbatches(self) -> list[TensorDict]:
        """The shard cut by the driver's plan (as ``FetchedBatch.microbatches`` does)."""
        return split_microbatches(self.data, self.plan)


def legacy_shard(batch: TensorDict, preshards: Preshards) -> list[LegacyShard]:
    """Cut ``batch`` into one :class:`LegacyShard` per DP rank, following ``preshards``.

    Raises:
        ValueError: the batch's row count differs from the plan's.
    """
    n = batch.batch_size[0] if batch.batch_dims else 0
    if n != preshards.num_samples:
        raise ValueError(f"legacy_shard: the batch has {n} rows but the plan covers {preshards.num_samples}")
    shards = []
    for r in range(preshards.dp_world):
        info = preshards.rank_extra_info(r)  # what the rank's fan-out meta carries
        plan = info.pop("packing")
        shards.append(
            LegacyShard(rank=r, data=select_rows(batch, preshards.rank_indices[r]), plan=plan, extra_info=info)
        )
    return shards


def ship_shards(shards: Sequence[LegacyShard]) -> list[ray.ObjectRef]:
    """``ray.put`` each shard from the driver; pass the refs to the rank actors."""
    return [ray.put(s) for s in shards]


def fetch_shard(ref: ray.ObjectRef | LegacyShard, timeout_s: float = 300.0) -> LegacyShard:
    """Worker side: resolve a shipped shard (Ray resolves top-level ref arguments already, so a
    ``LegacyShard`` passes through).

    Raises:
        ray.exceptions.GetTimeoutError: the object did not arrive within ``timeout_s``.
    """
    if isinstance(ref, LegacyShard):
        return ref
    return ray.get(ref, timeout=timeout_s)


def concat_batches(batches: Sequence[TensorDict]) -> TensorDict:
    """Rows of ``batches`` one after another (jagged fields stay jagged); every batch must have
    the same fields.

    Raises:
        ValueError: no batches, or batches with different fields (names them).
    """
    if not batches:
        raise ValueError("concat_batches: no batches")
    names: list[str] = [str(k) for k in batches[0].keys()]
    for i, b in enumerate(batches[1:], 1):
        if sorted(b.keys()) != sorted(names):
            raise ValueError(f"concat_batches: batch {i} has fields {sorted(b.keys())}, batch 0 has {sorted(names)}")
    cols: dict[str, torch.Tensor] = {}
    for name in names:
        parts = [b[name] for b in batches]
        if is_jagged(parts[0]):
            cols[name] = jagged_from_rows([r for p in parts for r in jagged_rows(p)])
        else:
            cols[name] = torch.cat(parts, 0)
    return TensorDict(cols, batch_size=[sum(b.batch_size[0] for b in batches)])


class LegacyTransport(Transport):
    """The driver holds the rollout ``TensorDict``, computes on it in memory and ships each rank its
    shard with ``ray.put``; log-probs come back to the driver as tensors. Nothing is stored
    outside the driver's memory, so release and outstanding are trivial."""

    name = "legacy"

    def sink(self) -> LegacySink:
        return LegacySink()

    def batch_io(self) -> LegacyBatchIO:
        return LegacyBatchIO(self.cfg.trainer.step_timeout_s)

    def source(self, pool: Any) -> LegacySource:
        return LegacySource(pool)

    def concat(self, parts: Sequence[Any]) -> TensorDict:
        return concat_batches(list(parts))

    def keep(self, handle: Any, keep_idx: list[int], drop_idx: list[int]) -> Any:
        return select_rows(handle, keep_idx)

    def write_advantages(self, handle: Any, advantages: torch.Tensor) -> Any:
        handle.set("advantages", advantages)
        return handle

    def rank_inputs(self, handle: Any, preshards: Preshards, step: int) -> list[Any]:
        shards = legacy_shard(handle, preshards)
        self.driver_bytes += sum(payload_bytes(s) for s in shards)
        return ship_shards(shards)

    def input_bytes(self, inputs: Sequence[Any]) -> int:
        return 0  # counted when rank_inputs put them

    def absorb(self, handle: Any, preshards: Preshards, field: str, rank_results: Sequence[Mapping[str, Any]]) -> Any:
        per_rank = [jagged_rows(r[field]) for r in rank_results]
        handle.set(field, jagged_from_rows(preshards.restore_order(per_rank)))
        return handle

    def release(self, handle: Any) -> None:
        return None

    def outstanding(self, audit: bool = False) -> int:
        return 0

    def stored_keys(self) -> dict[str, list[str]]:
        return {}

    def clear_all(self) -> None:
        return None

    def snapshot(self, group: ClaimedGroup) -> dict[str, Any]:
        return {"rows": rows_state(group.rows)}

    def restore(self, group_id: int, version: int, state: Mapping[str, Any]) -> TensorDict:
        return rows_from_state(state["rows"])


class LegacySink(RolloutSink):
    """Sync: the rows go back to the driver in the collector's reply. Async: finished groups wait
    in this outbox until the driver takes them through Ray."""

    def open(self) -> None:
        # Made in the collector: a lock does not travel from the driver.
        self._cv = threading.Condition()
        self._outbox: collections.deque[dict[str, Any]] = collections.deque()

    def deliver(
        self, jobs: Sequence[Job], batch: TensorDict, tags: list[dict[str, Any]], version: int
    ) -> tuple[Any, int]:
        return batch, 0

    def stream(
        self,
        jobs: Sequence[Job],
        batch: TensorDict,
        tags: list[dict[str, Any]],
        version: int,
        stopped: Callable[[], bool],
    ) -> float:
        n = len(tags) // max(len(jobs), 1)
        with self._cv:
            for g, j in enumerate(jobs):
                rows = range(g * n, (g + 1) * n)
                self._outbox.append(
                    {"group_id": j.group_id, "rows": select_rows(batch, rows), "tags": tags[rows.start : rows.stop]}
                )
            self._cv.notify_all()
        return 0.0

    def unconsumed_groups(self) -> int:
        return len(self._outbox)

    def take(self, max_groups: int, timeout_s: float, stopped: Callable[[], bool]) -> list[dict[str, Any]]:
        """Pop up to ``max_groups`` finished groups, waiting up to ``timeout_s`` for one (less once
        ``stopped()``: the producer failed)."""
        deadline = time.monotonic() + timeout_s
        with self._cv:
            while not self._outbox and not stopped() and time.monotonic() < deadline:
                self._cv.wait(max(0.0, min(0.2, deadline - time.monotonic())))
            return [self._outbox.popleft() for _ in range(min(max_groups, len(self._outbox)))]


class LegacySource(RolloutSource):
    """Takes finished groups from the collectors' outboxes through Ray (``CollectorPool.take``)."""

    def __init__(self, pool: Any) -> None:
        self.pool = pool

    def claim(self, need_groups: int, timeout_s: float) -> list[ClaimedGroup]:
        return [group_from_tags(g["group_id"], g["rows"], g["tags"]) for g in self.pool.take(need_groups, timeout_s)]

    def drop(self, group: ClaimedGroup) -> None:
        return None  # its rows were only ever in this process


class LegacyBatchIO(BatchIO):
    """A rank's input is its shard (resolved by Ray from the driver's ``ray.put``); results go back
    to the driver as tensors in the call's reply."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s  # bound on resolving a shard shipped through Ray

    def resolve(self, batch: Any) -> Any:
        # A compiled graph passes the shard's ObjectRef as it is (Ray resolves task arguments only).
        return fetch_shard(batch, timeout_s=self.timeout_s)

    def load(self, batch: Any, fields: Sequence[str]) -> Loaded:
        n = batch.data.batch_size[0]
        plan = batch.plan
        positions = [list(mb) for mb in plan["microbatches"]] if plan and "microbatches" in plan else [list(range(n))]
        return Loaded(batch.microbatches(), positions, n, 0)

    def store(self, batch: Any, columns: Mapping[str, torch.Tensor]) -> tuple[dict[str, Any], int]:
        return dict(columns), 0
