"""Task-mediated claims for the TransferQueue adapter, on TransferQueue's own bookkeeping.

The controller already tracks, per partition, which rows hold which fields (production status)
and which rows each task has consumed. A claim is one Ray call to the controller, which scans,
picks, marks the rows consumed and looks their keys up in a single step under the lock its
request thread holds; so concurrent claimers of a task, in any process, never get the same row.
How it is shaped (polling mode, our sampler, the wait) is in :mod:`.compat` (quirks 8-10).

* Waiting: the claim waits inside the controller until ``batch_size`` rows are claimable or the
  deadline passes, then takes what is there. It is woken whenever rows are produced (by any
  client, TransferQueue's own included), so it returns as soon as its rows are there; it never
  polls. The whole call is bounded by ``timeout_s + op_timeout_s``.
* Production: a row counts as produced for a field once this adapter (or TransferQueue's own
  put) has written it; a tags-only put produces nothing. Our puts store tags before they mark
  rows produced, so a claimed meta carries the tags of the put that produced it.
* Clears: clearing a row resets its consumption in TransferQueue, so a key cleared and put
  again is claimable again; an upsert leaves consumption alone.
* Order: oldest key first (insertion order of keys, not TransferQueue's global index order).

Limits: a claim whose call is cancelled (``op_timeout_s`` on a stalled controller, or a cancelled
``async_kv_claim``) tells the controller, where a claim still waiting then stops without taking
rows; one that had already picked its rows consumes them without returning them. Claims need a
store started by this adapter (:func:`.compat.claims_unsupported`); ``kv_claim_status`` works on
any TransferQueue store.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Awaitable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from nemo_dataplane.adapters.transfer_queue import compat
from nemo_dataplane.client import (
    ClaimsNotSupported,
    ClaimStatus,
    DataPlaneClient,
    check_claim_args,
    check_keys,
    check_partition,
    check_select_fields,
    check_task,
)
from nemo_dataplane.meta import KVBatchMeta

T = TypeVar("T")


class TransferQueueClaims(DataPlaneClient):
    """The claim half of :class:`~.client.TransferQueueClient` (a mixin: it uses the
    adapter's TransferQueue client ``_tq``, its op runners and ``_claims_unsupported``)."""

    # Provided by TransferQueueClient: its TransferQueue client, the controller's actor handle,
    # config, op runners (which take an optional limit_s replacing op_timeout_s) and why claims
    # cannot run (None: they can).
    _tq: Any
    _control: Any
    cfg: Any
    _claims_unsupported: str | None

    if TYPE_CHECKING:  # pragma: no cover - TransferQueueStore's, declared here for the type checker

        def _run(
            self, op: str, partition_id: str, n_keys: int, coro: Awaitable[T], limit_s: float | None = None
        ) -> T: ...

        async def _run_async(
            self, op: str, partition_id: str, n_keys: int, coro: Awaitable[T], limit_s: float | None = None
        ) -> T: ...

    # ------------------------------------------------------------ checks
    def _require_claims(self) -> None:
        if self._claims_unsupported is not None:
            raise ClaimsNotSupported(self._claims_unsupported)

    def _claim_args(
        self, partition_id: str, task: str, fields: Sequence[str], batch_size: int, timeout_s: float
    ) -> tuple[str, str, list[str], int, float]:
        task, names, batch_size, timeout_s = check_claim_args(task, fields, batch_size, timeout_s)
        pid = check_partition(partition_id)
        self._require_claims()
        return pid, task, names, batch_size, timeout_s

    def _mark_args(self, keys: Sequence[str], partition_id: str, task: str) -> tuple[list[str], str, str]:
        key_list = check_keys(keys, allow_empty=True)
        pid = check_partition(partition_id)
        task = check_task(task)
        self._require_claims()
        return key_list, pid, task

    @staticmethod
    def _status_args(partition_id: str, task: str, fields: Sequence[str]) -> tuple[str, str, list[str]]:
        return check_partition(partition_id), check_task(task), check_select_fields(fields)

    # ------------------------------------------------------------ bodies
    async def _claim(self, pid: str, task: str, names: list[str], batch_size: int, timeout_s: float) -> KVBatchMeta:
        now = time.time()
        until, give_up, claim_id = now + timeout_s, now + timeout_s + self.cfg.op_timeout_s, uuid.uuid4().hex
        # It waits inside the controller, woken when rows are produced (no polling); the caller
        # stops waiting at the deadline plus op_timeout_s (the op's own bound, _run).
        try:
            keys, tags = await compat.ask_claim(self._control, pid, task, names, batch_size, until, give_up, claim_id)
        except asyncio.CancelledError:
            # Its caller is gone (cancelled, or past op_timeout_s): it must not take rows now.
            compat.cancel_claim(self._control, claim_id, give_up)
            raise
        return KVBatchMeta(keys=tuple(keys), tags=tuple(tags), partition_id=pid, fields=tuple(names))

    async def _mark(self, keys: list[str], pid: str, task: str) -> None:
        if keys:
            await compat.mark_rows(self._tq, pid, task, keys)

    async def _status(self, pid: str, task: str, names: list[str]) -> ClaimStatus:
        (cons_gi, cons), (prod_gi, prod) = await asyncio.gather(
            self._tq.async_get_consumption_status(task_name=task, partition_id=pid),
            self._tq.async_get_production_status(data_fields=names, partition_id=pid),
        )
        if cons_gi is None:  # no such partition
            return ClaimStatus(pid, task, rows=0, produced=0, claimed=0, claimable=0)
        consumed = {g for g, c in zip(cons_gi.tolist(), cons.tolist()) if c}
        produced: set[int] = set()
        if prod_gi is not None and prod is not None:  # None: some field never stored here
            ready = prod.bool().all(dim=1) if prod.numel() else prod.new_zeros(prod.shape[0]).bool()
            produced = {g for g, r in zip(prod_gi.tolist(), ready.tolist()) if r}
        return ClaimStatus(
            pid,
            task,
            rows=len(cons_gi),
            produced=len(produced),
            claimed=len(consumed),
            claimable=len(produced - consumed),
        )

    # ------------------------------------------------------------ API
    def kv_claim(
        self, partition_id: str, task: str, fields: Sequence[str], batch_size: int, timeout_s: float
    ) -> KVBatchMeta:
        pid, task, names, n, wait = self._claim_args(partition_id, task, fields, batch_size, timeout_s)
        return self._run("kv_claim", pid, n, self._claim(pid, task, names, n, wait), wait + self.cfg.op_timeout_s)

    async def async_kv_claim(
        self, partition_id: str, task: str, fields: Sequence[str], batch_size: int, timeout_s: float
    ) -> KVBatchMeta:
        pid, task, names, n, wait = self._claim_args(partition_id, task, fields, batch_size, timeout_s)
        return await self._run_async(
            "kv_claim", pid, n, self._claim(pid, task, names, n, wait), wait + self.cfg.op_timeout_s
        )

    def kv_mark_consumed(self, keys: Sequence[str], partition_id: str, task: str) -> None:
        key_list, pid, task = self._mark_args(keys, partition_id, task)
        self._run("kv_mark_consumed", pid, len(key_list), self._mark(key_list, pid, task))

    async def async_kv_mark_consumed(self, keys: Sequence[str], partition_id: str, task: str) -> None:
        key_list, pid, task = self._mark_args(keys, partition_id, task)
        await self._run_async("kv_mark_consumed", pid, len(key_list), self._mark(key_list, pid, task))

    def kv_claim_status(self, partition_id: str, task: str, fields: Sequence[str]) -> ClaimStatus:
        pid, task, names = self._status_args(partition_id, task, fields)
        return self._run("kv_claim_status", pid, 0, self._status(pid, task, names))

    async def async_kv_claim_status(self, partition_id: str, task: str, fields: Sequence[str]) -> ClaimStatus:
        pid, task, names = self._status_args(partition_id, task, fields)
        return await self._run_async("kv_claim_status", pid, 0, self._status(pid, task, names))
