"""A store capacity for every backend: ``data_plane.max_rows`` keys, all partitions together.

TransferQueue's SimpleStorage has a per-unit ``total_storage_size`` that fails a put half-way
through its units; the Ray backend has no capacity at all (the in-memory one only an optional
byte bound, ``max_bytes``). :class:`CapacityGuard` gives them one meaning, checked in one place:
before a put that creates keys, the store is listed (``kv_partitions`` + ``kv_list``: every
writer's keys, not only this client's) and a put that would leave more than ``max_rows`` keys
raises :class:`StoreFullError` naming the key and writes nothing. Writes to keys that already
exist (new fields of a row) never count.

The check is not atomic across processes: writers that check at the same moment can together
overshoot ``max_rows`` by at most one put each. It costs one listing per put, and only when
``max_rows`` is set. The factory wraps the client when ``data_plane.max_rows`` is set.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from typing import Any

# StoreFullError lives in the client module (a backend's own bound raises it too); re-exported here.
from nemo_dataplane.client import DataPlaneClient, Fields, StoreFullError
from nemo_dataplane.meta import KVBatchMeta
from nemo_dataplane.wrappers.base import ForwardingClient

__all__ = ["CapacityGuard", "StoreFullError"]


class CapacityGuard(ForwardingClient):
    """Forwards every call to ``inner``; a put that would leave more than ``max_rows`` keys in
    the store raises :class:`StoreFullError` first."""

    def __init__(self, inner: DataPlaneClient, max_rows: int) -> None:
        if max_rows < 1:
            raise ValueError(f"data_plane.max_rows must be >= 1, got {max_rows}")
        super().__init__(inner)
        self.max_rows = int(max_rows)

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

    def kv_batch_put(
        self,
        keys: Sequence[str],
        partition_id: str,
        fields: Fields | None,
        tags: Sequence[Mapping[str, Any]] | None = None,
    ) -> KVBatchMeta:
        keys = list(keys)
        self._check(keys, partition_id)
        return self.inner.kv_batch_put(keys, partition_id, fields, tags)

    async def async_kv_batch_put(
        self,
        keys: Sequence[str],
        partition_id: str,
        fields: Fields | None,
        tags: Sequence[Mapping[str, Any]] | None = None,
    ) -> KVBatchMeta:
        keys = list(keys)
        await asyncio.to_thread(self._check, keys, partition_id)
        return await self.inner.async_kv_batch_put(keys, partition_id, fields, tags)
