"""`ForwardingClient`: a :class:`DataPlaneClient` that hands every call to an inner client.

The wrappers (capacity, integrity, observation) derive from it and override only the calls they
change, so a method added to the contract is forwarded by every wrapper at once instead of being
silently served by the ABC's default (e.g. an async twin running the wrapper's sync method in a
thread, or a claim default raising ``ClaimsNotSupported`` in front of a backend that has claims).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from tensordict import TensorDict

from nemo_dataplane.client import ClaimStatus, DataPlaneClient, Fields
from nemo_dataplane.meta import KVBatchMeta

__all__ = ["ForwardingClient"]


class ForwardingClient(DataPlaneClient):
    """Forwards every method of the contract (sync, async, claims, listing, ``close``) to
    ``inner`` unchanged; ``with wrapper:`` closes ``inner`` on exit. Attributes the contract
    does not define (``owns_store``, ``flush``, ...) read through to ``inner``."""

    def __init__(self, inner: DataPlaneClient) -> None:
        self.inner = inner

    def __getattr__(self, name: str) -> Any:
        if name == "inner":  # not set yet (half-built object): no recursion
            raise AttributeError(name)
        return getattr(self.inner, name)

    # ------------------------------------------------------------------ by key
    def kv_batch_put(
        self,
        keys: Sequence[str],
        partition_id: str,
        fields: Fields | None,
        tags: Sequence[Mapping[str, Any]] | None = None,
    ) -> KVBatchMeta:
        return self.inner.kv_batch_put(keys, partition_id, fields, tags)

    def kv_batch_get(
        self, meta_or_keys: KVBatchMeta | Sequence[str], select_fields: Sequence[str], partition_id: str | None = None
    ) -> TensorDict:
        return self.inner.kv_batch_get(meta_or_keys, select_fields, partition_id)

    def kv_clear(self, keys: Sequence[str] | None, partition_id: str) -> None:
        self.inner.kv_clear(keys, partition_id)

    def kv_list(self, partition_id: str) -> KVBatchMeta:
        return self.inner.kv_list(partition_id)

    def kv_partitions(self) -> list[str]:
        return self.inner.kv_partitions()

    # ------------------------------------------------------------------ claims
    def kv_claim(
        self, partition_id: str, task: str, fields: Sequence[str], batch_size: int, timeout_s: float
    ) -> KVBatchMeta:
        return self.inner.kv_claim(partition_id, task, fields, batch_size, timeout_s)

    def kv_mark_consumed(self, keys: Sequence[str], partition_id: str, task: str) -> None:
        self.inner.kv_mark_consumed(keys, partition_id, task)

    def kv_claim_status(self, partition_id: str, task: str, fields: Sequence[str]) -> ClaimStatus:
        return self.inner.kv_claim_status(partition_id, task, fields)

    # --------------------------------------------------------------- lifecycle
    def close(self) -> None:
        self.inner.close()

    # ------------------------------------------------------------ async twins
    # Forwarded to the inner twins, so a backend's native async path stays in use.
    async def async_kv_batch_put(
        self,
        keys: Sequence[str],
        partition_id: str,
        fields: Fields | None,
        tags: Sequence[Mapping[str, Any]] | None = None,
    ) -> KVBatchMeta:
        return await self.inner.async_kv_batch_put(keys, partition_id, fields, tags)

    async def async_kv_batch_get(
        self, meta_or_keys: KVBatchMeta | Sequence[str], select_fields: Sequence[str], partition_id: str | None = None
    ) -> TensorDict:
        return await self.inner.async_kv_batch_get(meta_or_keys, select_fields, partition_id)

    async def async_kv_clear(self, keys: Sequence[str] | None, partition_id: str) -> None:
        await self.inner.async_kv_clear(keys, partition_id)

    async def async_kv_list(self, partition_id: str) -> KVBatchMeta:
        return await self.inner.async_kv_list(partition_id)

    async def async_kv_partitions(self) -> list[str]:
        return await self.inner.async_kv_partitions()

    async def async_kv_claim(
        self, partition_id: str, task: str, fields: Sequence[str], batch_size: int, timeout_s: float
    ) -> KVBatchMeta:
        return await self.inner.async_kv_claim(partition_id, task, fields, batch_size, timeout_s)

    async def async_kv_mark_consumed(self, keys: Sequence[str], partition_id: str, task: str) -> None:
        await self.inner.async_kv_mark_consumed(keys, partition_id, task)

    async def async_kv_claim_status(self, partition_id: str, task: str, fields: Sequence[str]) -> ClaimStatus:
        return await self.inner.async_kv_claim_status(partition_id, task, fields)
