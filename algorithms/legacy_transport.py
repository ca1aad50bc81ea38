"""The legacy transport: the baseline every data-plane comparison is made against.

The driver holds the whole step's ``TensorDict``, cuts it into per-rank shards with the same
planner the data plane uses, and ships each rank its shard through the Ray object store
(``ray.put`` on the driver, ``ray.get`` on the worker). Every byte passes through the driver.

Deliberately independent of the data plane: this module imports only the planner and the row
helpers (``nemo_dataplane.rows``) (plus torch, ray, tensordict), never the store client,
adapters, fan-out, column I/O or worker fetch, so the baseline cannot quietly use them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import ray
import torch
from tensordict import TensorDict

from nemo_dataplane.codec import is_jagged, jagged_from_rows, jagged_rows
from nemo_dataplane.driver.planner import Preshards
from nemo_dataplane.rows import select_rows, split_microbatches

__all__ = ["LegacyShard", "LegacyTransport", "concat_batches", "fetch_shard", "legacy_shard", "ship_shards"]


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
        shards.append(LegacyShard(rank=r, data=select_rows(batch, preshards.rank_indices[r]), plan=plan, extra_info=info))
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
    names = list(batches[0].keys())
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


class LegacyTransport:
    """The baseline: the driver holds the rollout ``TensorDict``, computes on it in memory and
    ships each rank its shard with ``ray.put``; log-probs come back to the driver as tensors.
    Nothing is stored outside the driver's memory, so release and outstanding are trivial."""

    name = "legacy"

    def __init__(self, cfg: Any) -> None:
        self.cfg = cfg
        self.driver_bytes = 0
        self.column_bytes = 0

    def partition(self) -> None:
        return None

    def rollouts(self, result: Mapping[str, Any]) -> Any:
        return result["batch"]

    def keep(self, handle: Any, keep_idx: list[int], drop_idx: list[int]) -> Any:
        return select_rows(handle, keep_idx)

    def write_advantages(self, handle: Any, advantages: torch.Tensor) -> Any:
        handle.set("advantages", advantages)
        return handle

    def preshard(self, handle: Any, dp_world: int) -> Any:
        from nemo_dataplane.driver.preshard import driver_balanced_preshards

        return driver_balanced_preshards(handle, dp_world, self.cfg.data_plane.packing)

    def rank_inputs(self, handle: Any, preshards: Any, step: int) -> list[Any]:
        from algorithms.metrics import payload_bytes

        shards = legacy_shard(handle, preshards)
        self.driver_bytes += sum(payload_bytes(s) for s in shards)
        return ship_shards(shards)

    def absorb(self, handle: Any, preshards: Any, field: str, rank_results: Sequence[Mapping[str, Any]]) -> Any:
        per_rank = [jagged_rows(r[field]) for r in rank_results]
        handle.set(field, jagged_from_rows(preshards.restore_order(per_rank)))
        return handle

    def release(self, handle: Any) -> None:
        return None

    def outstanding(self) -> int:
        return 0
