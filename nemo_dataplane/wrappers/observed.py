"""A wrapper client that records every op and how many bytes the store holds.

``ObservedClient(inner, on_event)`` forwards each call to ``inner`` and reports one
:class:`OpEvent` per call (errors are recorded, then re-raised unchanged). It keeps
``bytes_outstanding`` (payload bytes this client put and has not cleared) and its peak, so a
trainer can check that a step left nothing behind.

Two views of what is left in the store:

* :meth:`ObservedClient.snapshot` - keys and bytes this wrapper put and has not cleared, by
  partition. No store access; blind to what other clients (workers, other processes) wrote or
  cleared.
* :meth:`ObservedClient.store_snapshot` - every key in the store, by partition, listed through
  ``kv_partitions`` + ``kv_list`` (one event, op ``store_snapshot``). Sees every writer; costs
  one listing per partition.

The factory puts it outside every other wrapper, so what they refuse (a full store, a corrupted
row) is recorded as the failed op the caller made, and their own store reads are not.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Any

from tensordict import TensorDict

from nemo_dataplane.client import ClaimStatus, DataPlaneClient, Fields
from nemo_dataplane.codec import batch_nbytes, normalize_fields, tensor_nbytes
from nemo_dataplane.meta import KVBatchMeta
from nemo_dataplane.wrappers.base import ForwardingClient

__all__ = ["ObservedClient", "OpEvent", "Outstanding"]


@dataclass(frozen=True)
class OpEvent:
    """One store operation as seen by the caller."""

    op: str
    partition_id: str | None
    n_keys: int
    n_bytes: int
    wall_ms: float
    status: str  # "ok" | "error"
    error: str | None = None
    ended_at: float = 0.0  # wall clock (time.time()) when the op returned: events of processes line up

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Outstanding:
    """Keys and payload bytes one partition holds (as far as the wrapper's accounting knows)."""

    keys: int
    bytes: int


class ObservedClient(ForwardingClient):
    """Records ``{op, partition_id, n_keys, n_bytes, wall_ms, status}`` for every call of the
    contract (``close`` aside) and passes each :class:`OpEvent` to ``on_event``."""

    def __init__(
        self,
        inner: DataPlaneClient,
        on_event: Callable[[OpEvent], None] | None = None,
        *,
        track_outstanding: bool = True,
    ) -> None:
        super().__init__(inner)
        self._on_event = on_event
        self._track = track_outstanding  # off: no per-key ledger (bytes_outstanding, snapshot() stay empty)
        self._lock = threading.Lock()
        self._held: dict[tuple[str, str], dict[str, int]] = {}
        self.bytes_outstanding = 0
        self.peak_bytes_outstanding = 0
        self.op_counts: Counter[str] = Counter()
        self.bytes_by_op: Counter[str] = Counter()

    # ------------------------------------------------------------- recording
    def _emit(self, op: str, pid: str | None, n_keys: int, n_bytes: int, t0: float, err: BaseException | None) -> None:
        event = OpEvent(
            op=op,
            partition_id=pid,
            n_keys=n_keys,
            n_bytes=n_bytes,
            wall_ms=(time.perf_counter() - t0) * 1e3,
            status="ok" if err is None else "error",
            error=None if err is None else f"{type(err).__name__}: {err}",
            ended_at=time.time(),
        )
        with self._lock:
            self.op_counts[op] += 1
            self.bytes_by_op[op] += n_bytes
        if self._on_event is not None:
            self._on_event(event)

    def _account_put(self, keys: Sequence[str], pid: str, fields: Fields | None) -> None:
        if not self._track:
            return
        columns = normalize_fields(fields, len(keys))
        per_row = {name: tensor_nbytes(t) // max(len(keys), 1) for name, t in columns.items()}
        with self._lock:
            for k in keys:
                held = self._held.setdefault((pid, k), {})
                for name, nb in per_row.items():
                    self.bytes_outstanding += nb - held.get(name, 0)
                    held[name] = nb
            self.peak_bytes_outstanding = max(self.peak_bytes_outstanding, self.bytes_outstanding)

    def _account_clear(self, keys: Sequence[str] | None, pid: str) -> None:
        if not self._track:
            return
        with self._lock:
            targets = [hk for hk in self._held if hk[0] == pid] if keys is None else [(pid, k) for k in keys]
            for hk in targets:
                held = self._held.pop(hk, None)
                if held:
                    self.bytes_outstanding -= sum(held.values())

    @staticmethod
    def _get_target(meta_or_keys: KVBatchMeta | Sequence[str], pid: str | None) -> tuple[int, str | None]:
        if isinstance(meta_or_keys, KVBatchMeta):
            return len(meta_or_keys), meta_or_keys.partition_id or pid
        return len(list(meta_or_keys)), pid

    @contextmanager
    def _recording(self, op: str, pid: str | None, n_keys: int, n_bytes: int = 0) -> Iterator[_Tally]:
        tally = _Tally(n_bytes)
        t0 = time.perf_counter()
        try:
            yield tally
        except BaseException as e:
            self._emit(op, pid, n_keys, tally.n_bytes, t0, e)
            raise
        self._emit(op, pid, n_keys if tally.n_keys is None else tally.n_keys, tally.n_bytes, t0, None)

    # ----------------------------------------------------------------- sync
    def kv_batch_put(
        self,
        keys: Sequence[str],
        partition_id: str,
        fields: Fields | None,
        tags: Sequence[Mapping[str, Any]] | None = None,
    ) -> KVBatchMeta:
        keys = list(keys)
        with self._recording("kv_batch_put", partition_id, len(keys), _nbytes(fields)):
            meta = self.inner.kv_batch_put(keys, partition_id, fields, tags)
            self._account_put(keys, partition_id, fields)
            return meta

    def kv_batch_get(
        self,
        meta_or_keys: KVBatchMeta | Sequence[str],
        select_fields: Sequence[str],
        partition_id: str | None = None,
    ) -> TensorDict:
        n_keys, pid = self._get_target(meta_or_keys, partition_id)
        with self._recording("kv_batch_get", pid, n_keys) as tally:
            out = self.inner.kv_batch_get(meta_or_keys, select_fields, partition_id)
            tally.n_bytes = batch_nbytes(out)
            return out

    def kv_clear(self, keys: Sequence[str] | None, partition_id: str) -> None:
        keys = None if keys is None else list(keys)
        with self._recording("kv_clear", partition_id, -1 if keys is None else len(keys)):
            self.inner.kv_clear(keys, partition_id)
            self._account_clear(keys, partition_id)

    def kv_list(self, partition_id: str) -> KVBatchMeta:
        with self._recording("kv_list", partition_id, 0) as tally:
            meta = self.inner.kv_list(partition_id)
            tally.n_keys = len(meta)
            return meta

    def kv_claim(
        self, partition_id: str, task: str, fields: Sequence[str], batch_size: int, timeout_s: float
    ) -> KVBatchMeta:
        with self._recording("kv_claim", partition_id, 0) as tally:
            meta = self.inner.kv_claim(partition_id, task, fields, batch_size, timeout_s)
            tally.n_keys = len(meta)
            return meta

    def kv_mark_consumed(self, keys: Sequence[str], partition_id: str, task: str) -> None:
        keys = list(keys)
        with self._recording("kv_mark_consumed", partition_id, len(keys)):
            self.inner.kv_mark_consumed(keys, partition_id, task)

    def kv_claim_status(self, partition_id: str, task: str, fields: Sequence[str]) -> ClaimStatus:
        with self._recording("kv_claim_status", partition_id, 0) as tally:
            status = self.inner.kv_claim_status(partition_id, task, fields)
            tally.n_keys = status.rows
            return status

    def kv_partitions(self) -> list[str]:
        with self._recording("kv_partitions", None, 0):
            return self.inner.kv_partitions()

    # ------------------------------------------------------------ snapshots
    def snapshot(self) -> dict[str, Outstanding]:
        """Keys and bytes this wrapper put and has not cleared, by partition (its own
        accounting, no store access: what other clients wrote or cleared is not in it)."""
        out: dict[str, list[int]] = {}
        with self._lock:
            for (pid, _), held in self._held.items():
                acc = out.setdefault(pid, [0, 0])
                acc[0] += 1
                acc[1] += sum(held.values())
        return {pid: Outstanding(keys=k, bytes=b) for pid, (k, b) in out.items()}

    def store_snapshot(self) -> dict[str, tuple[str, ...]]:
        """Every key in the whole store, by partition (``kv_partitions`` then ``kv_list`` of
        each), whoever wrote it: what a driver checks for leaks at the end of a step.

        Not atomic across partitions.
        """
        with self._recording("store_snapshot", None, 0) as tally:
            listing = {pid: self.inner.kv_list(pid).keys for pid in self.inner.kv_partitions()}
            listing = {pid: keys for pid, keys in listing.items() if keys}  # cleared meanwhile
            tally.n_keys = sum(len(k) for k in listing.values())
            return listing

    # ---------------------------------------------------------------- async
    async def async_kv_batch_put(
        self,
        keys: Sequence[str],
        partition_id: str,
        fields: Fields | None,
        tags: Sequence[Mapping[str, Any]] | None = None,
    ) -> KVBatchMeta:
        keys = list(keys)
        with self._recording("kv_batch_put", partition_id, len(keys), _nbytes(fields)):
            meta = await self.inner.async_kv_batch_put(keys, partition_id, fields, tags)
            self._account_put(keys, partition_id, fields)
            return meta

    async def async_kv_batch_get(
        self,
        meta_or_keys: KVBatchMeta | Sequence[str],
        select_fields: Sequence[str],
        partition_id: str | None = None,
    ) -> TensorDict:
        n_keys, pid = self._get_target(meta_or_keys, partition_id)
        with self._recording("kv_batch_get", pid, n_keys) as tally:
            out = await self.inner.async_kv_batch_get(meta_or_keys, select_fields, partition_id)
            tally.n_bytes = batch_nbytes(out)
            return out

    async def async_kv_clear(self, keys: Sequence[str] | None, partition_id: str) -> None:
        keys = None if keys is None else list(keys)
        with self._recording("kv_clear", partition_id, -1 if keys is None else len(keys)):
            await self.inner.async_kv_clear(keys, partition_id)
            self._account_clear(keys, partition_id)

    async def async_kv_list(self, partition_id: str) -> KVBatchMeta:
        with self._recording("kv_list", partition_id, 0) as tally:
            meta = await self.inner.async_kv_list(partition_id)
            tally.n_keys = len(meta)
            return meta

    async def async_kv_claim(
        self, partition_id: str, task: str, fields: Sequence[str], batch_size: int, timeout_s: float
    ) -> KVBatchMeta:
        with self._recording("kv_claim", partition_id, 0) as tally:
            meta = await self.inner.async_kv_claim(partition_id, task, fields, batch_size, timeout_s)
            tally.n_keys = len(meta)
            return meta

    async def async_kv_mark_consumed(self, keys: Sequence[str], partition_id: str, task: str) -> None:
        keys = list(keys)
        with self._recording("kv_mark_consumed", partition_id, len(keys)):
            await self.inner.async_kv_mark_consumed(keys, partition_id, task)

    async def async_kv_claim_status(self, partition_id: str, task: str, fields: Sequence[str]) -> ClaimStatus:
        with self._recording("kv_claim_status", partition_id, 0) as tally:
            status = await self.inner.async_kv_claim_status(partition_id, task, fields)
            tally.n_keys = status.rows
            return status

    async def async_kv_partitions(self) -> list[str]:
        with self._recording("kv_partitions", None, 0):
            return await self.inner.async_kv_partitions()


@dataclass
class _Tally:
    n_bytes: int = 0
    n_keys: int | None = None


def _nbytes(fields: Any) -> int:
    return batch_nbytes(fields) if isinstance(fields, (TensorDict, Mapping)) else 0
