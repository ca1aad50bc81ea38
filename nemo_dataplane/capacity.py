"""A store capacity for every backend: ``data_plane.max_rows`` keys, all partitions together.

TransferQueue's SimpleStorage has a per-unit ``total_storage_size`` that fails a put half-way
through its units; the Ray and in-memory backends have no capacity at all. :class:`CapacityGuard`
gives them one meaning, checked in one place: before a put that creates keys, the store is
listed (``kv_partitions`` + ``kv_list``: every writer's keys, not only this client's) and a put
that would leave more than ``max_rows`` keys raises :class:`StoreFullError` naming the key and
writes nothing. Writes to keys that already exist (new fields of a row) never count.

The check is not atomic across processes: writers that check at the same moment can together
overshoot ``max_rows`` by at most one put each. It costs one listing per put, and only when
``max_rows`` is set. The factory wraps the client when ``data_plane.max_rows`` is set.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from typing import Any

from tensordict import TensorDict

from nemo_dataplane.client import ClaimStatus, DataPlaneClient, DataPlaneError, Fields
from nemo_dataplane.meta import KVBatchMeta

__all__ = ["CapacityGuard", "StoreFullError"]


class StoreFullError(DataPlaneError):
    """A put would exceed ``data_plane.max_rows``; nothing of it was written."""


class CapacityGuard(DataPlaneClient):
    """Forwards every call to ``inner``; a put that would leave more than ``max_rows`` keys in
    the store raises :class:`StoreFullError` first. Other attributes read through to ``inner``."""

    def __init__(self, inner: DataPlaneClient, max_rows: int) -> None:
        if max_rows < 1:
            raise ValueError(f"data_plane.max_rows must be >= 1, got {max_rows}")
        self.inner = inner
        self.max_rows = int(max_rows)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def rows_in_store(self) -> int:
        """Keys in the whole store (every partition, every writer)."""
        return sum(len(self.inner.kv_list(p)) for p in self.inner.kv_partitions())

    def _check(self, keys: Sequence[str], partition_id: str) -> None:
        held, existing = 0, set()
        for p in self.inner.kv_partitions():  # one listing serves both counts
            listed = self.inner.kv_list(p).keys
            held += len(listed)
            if p == partition_id:
                existing = set(listed)
        new = sum(1 for k in set(keys) if k not in existing)
        if new and held + new > self.max_rows:
            raise StoreFullError(
                f"store full: data_plane.max_rows={self.max_rows} reached ({held} keys held, a put of {new} new "
                f"keys to partition {partition_id!r} would make {held + new}); nothing was written"
            )

    # ----------------------------------------------------------------- sync
    def kv_batch_put(
        self, keys: Sequence[str], partition_id: str, fields: Fields | None,
        tags: Sequence[Mapping[str, Any]] | None = None,
    ) -> KVBatchMeta:
        keys = list(keys)
        self._check(keys, partition_id)
        return self.inner.kv_batch_put(keys, partition_id, fields, tags)

    def kv_batch_get(
        self, meta_or_keys: KVBatchMeta | Sequence[str], select_fields: Sequence[str], partition_id: str | None = None
    ) -> TensorDict:
        return self.inner.kv_batch_get(meta_or_keys, select_fields, partition_id)

    def kv_clear(self, keys: Sequence[str] | None, partition_id: str) -> None:
        self.inner.kv_clear(keys, partition_id)

    def kv_list(self, partition_id: str) -> KVBatchMeta:
        return self.inner.kv_list(partition_id)

    def kv_claim(
        self, partition_id: str, task: str, fields: Sequence[str], batch_size: int, timeout_s: float
    ) -> KVBatchMeta:
        return self.inner.kv_claim(partition_id, task, fields, batch_size, timeout_s)

    def kv_mark_consumed(self, keys: Sequence[str], partition_id: str, task: str) -> None:
        self.inner.kv_mark_consumed(keys, partition_id, task)

    def kv_claim_status(self, partition_id: str, task: str, fields: Sequence[str]) -> ClaimStatus:
        return self.inner.kv_claim_status(partition_id, task, fields)

    def kv_partitions(self) -> list[str]:
        return self.inner.kv_partitions()

    def close(self) -> None:
        self.inner.close()

    # ---------------------------------------------------------------- async
    async def async_kv_batch_put(
        self, keys: Sequence[str], partition_id: str, fields: Fields | None,
        tags: Sequence[Mapping[str, Any]] | None = None,
    ) -> KVBatchMeta:
        keys = list(keys)
        await asyncio.to_thread(self._check, keys, partition_id)
        return await self.inner.async_kv_batch_put(keys, partition_id, fields, tags)

    async def async_kv_batch_get(
        self, meta_or_keys: KVBatchMeta | Sequence[str], select_fields: Sequence[str], partition_id: str | None = None
    ) -> TensorDict:
        return await self.inner.async_kv_batch_get(meta_or_keys, select_fields, partition_id)

    async def async_kv_clear(self, keys: Sequence[str] | None, partition_id: str) -> None:
        await self.inner.async_kv_clear(keys, partition_id)

    async def async_kv_list(self, partition_id: str) -> KVBatchMeta:
        return await self.inner.async_kv_list(partition_id)

    async def async_kv_claim(
        self, partition_id: str, task: str, fields: Sequence[str], batch_size: int, timeout_s: float
    ) -> KVBatchMeta:
        return await self.inner.async_kv_claim(partition_id, task, fields, batch_size, timeout_s)

    async def async_kv_mark_consumed(self, keys: Sequence[str], partition_id: str, task: str) -> None:
        await self.inner.async_kv_mark_consumed(keys, partition_id, task)

    async def async_kv_claim_status(self, partition_id: str, task: str, fields: Sequence[str]) -> ClaimStatus:
        return await self.inner.async_kv_claim_status(partition_id, task, fields)

    async def async_kv_partitions(self) -> list[str]:
        return await self.inner.async_kv_partitions()
