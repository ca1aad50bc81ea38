"""The actors behind the Ray object-store backend (:mod:`nemo_dataplane.adapters.ray_store.client`).

* :class:`StoreIndex`, the named metadata actor: partitions -> keys -> tags and, per field, the
  object (a "chunk": fields of one put) and row that holds the key's value. It holds object
  refs, never tensors, and is the single place where puts become visible, claims are taken and
  objects are freed.
* :class:`Keeper`, one per node: re-creates a writer's chunk as the return value of a call that
  the index makes, which Ray stores on the keeper's node and makes *owned by the index*. That is
  how a row outlives the process that put it (Ray >= 2.56 has no ``ray.put(_owner=...)``).

This module imports neither torch nor the client on purpose: both actors start in a fresh Ray
worker, and importing torch there would add seconds to the store's start-up. Chunks travel as
numpy arrays (Ray hands those over out of band, straight from shared memory).

Rows are kept as columns (:class:`~.table.Partition`), so a put or a read of
thousands of keys costs one dict lookup per key and a few vector operations.

Put protocol (two messages, one round trip on the writer's critical path): ``begin`` checks
the keys against the current rows, locks them and returns the merged tags and fields; the writer
``ray.put``s its chunks meanwhile, then sends ``commit`` without waiting for its reply. Every
reader, lister, clearer or claimer that touches a locked key (or, for partition-wide ops, a
partition with a put in flight) waits for the commit, so a put that returned is visible to every
process. Ray does not promise that an async actor starts one caller's tasks in submission
order, so ``commit`` (or ``abort``) may arrive before its ``begin``; it then waits for it.
"""

from __future__ import annotations

import asyncio
import builtins
import itertools
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import ray

from nemo_dataplane.adapters.locate import where_of
from nemo_dataplane.adapters.ray_store.table import Partition

# Errors cross the actor boundary as ("error", kind, message) replies rather than raised
# exceptions: a raised one costs a traceback per call and arrives wrapped in RayTaskError.
Reply = tuple[Any, ...]


def _error(kind: str, message: str) -> Reply:
    return ("error", kind, message)


class _Chunk:
    __slots__ = ("adopted", "adopting", "ref", "users", "writer")

    def __init__(self, ref: Any, users: int, writer: str) -> None:
        self.ref = ref  # the writer's object until a keeper's copy (owned by the index) replaces it
        self.users = users  # (row, field) cells pointing here; dropped (freed) at 0
        self.writer = writer
        self.adopting = False
        self.adopted = False


class _Txn:
    __slots__ = ("done", "fields", "keys", "keyset", "pid", "tags")

    def __init__(self, pid: str, keys: list[str]) -> None:
        self.pid = pid
        self.keys = keys
        self.keyset = frozenset(keys)
        self.tags: list[dict[str, Any]] = []
        self.fields: list[str] = []
        self.done = asyncio.Event()  # committed or aborted: the keys are free again


class Keeper:
    """Re-creates chunks so that the caller (the index) owns them; one per node, no state."""

    def ready(self) -> bool:
        return True

    def keep(self, value: Any) -> tuple[Any, bool]:
        # ``value`` arrives mapped from the writer's object on this node; returning it makes Ray
        # copy it once into a new object whose owner is the caller. The second return value is a
        # small flag the index awaits without fetching the chunk itself.
        return value, True


class StoreIndex:
    """Metadata of every partition; see the module docstring for the protocol.

    Args:
        lock_timeout_s: how long an op waits for keys locked by a put in flight, and how long a
            put may stay between ``begin`` and ``commit`` before a waiter aborts it.
        adopt: re-create every chunk on a keeper so that rows outlive their writer.
    """

    def __init__(self, lock_timeout_s: float, adopt: bool) -> None:
        self._parts: dict[str, Partition] = {}
        self._chunks: dict[int, _Chunk] = {}
        self._txns: dict[str, _Txn] = {}  # puts between begin and commit
        self._begun: dict[str, asyncio.Future[_Txn | None]] = {}  # put id -> its begin's outcome (a _Txn or None)
        self._pending: dict[str, set[_Txn]] = {}  # partition -> puts between begin and commit
        self._changed: dict[str, asyncio.Condition] = {}  # partition -> notified on commit / clear
        self._keepers: dict[str, Any] = {}
        self._adoptions: dict[str, set[asyncio.Task[None]]] = {}  # writer -> adoptions in flight
        self._chunk_ids = itertools.count()
        self._lock_timeout_s = float(lock_timeout_s)
        self._adopt = bool(adopt)

    def ready(self) -> dict[str, Any]:
        return {"adopt": self._adopt, "lock_timeout_s": self._lock_timeout_s}

    # ----------------------------------------------------------------- locks
    async def _wait_free(self, pid: str, keys: Sequence[str] | None) -> None:
        """Wait until no put in flight holds any of ``keys`` (``None``: any key of ``pid``).

        A put still pending after ``lock_timeout_s`` is presumed dead (its writer never sent the
        commit) and aborted, so its keys are never left locked.
        """
        while self._pending.get(pid):
            txn: _Txn | None
            if keys is None:
                txn = next(iter(self._pending[pid]))
            else:
                txn = next((t for t in self._pending[pid] if not t.keyset.isdisjoint(keys)), None)
                if txn is None:
                    return
            try:
                await asyncio.wait_for(txn.done.wait(), self._lock_timeout_s)
            except asyncio.TimeoutError:
                self._release(txn)

    def _release(self, txn: _Txn) -> None:
        pending = self._pending.get(txn.pid)
        if pending is not None:
            pending.discard(txn)
            if not pending:
                del self._pending[txn.pid]
        for tid in [tid for tid, t in self._txns.items() if t is txn]:
            del self._txns[tid]
        txn.done.set()

    def _outcome(self, txn_id: str) -> asyncio.Future[_Txn | None]:
        """The future of put ``txn_id``'s begin, made by whichever of its messages comes first."""
        fut = self._begun.get(txn_id)
        if fut is None:
            fut = self._begun[txn_id] = asyncio.get_running_loop().create_future()
        return fut

    async def _await_begin(self, txn_id: str) -> _Txn | None:
        fut = self._outcome(txn_id)
        try:
            return await asyncio.wait_for(asyncio.shield(fut), self._lock_timeout_s)
        except asyncio.TimeoutError:
            if not fut.done():
                fut.set_result(None)  # a begin arriving later finds the put abandoned
            return None
        finally:
            self._begun.pop(txn_id, None)

    # ------------------------------------------------------------------- put
    async def begin(
        self, txn_id: str, pid: str, keys: list[str], tags: list[dict[str, Any]] | None, fields: list[str]
    ) -> Reply:
        """Lock ``keys`` and return ``("ok", merged tags per key, fields stored on every key)``."""
        fut = self._outcome(txn_id)
        if fut.done():  # aborted (or given up on) before this message arrived
            self._begun.pop(txn_id, None)
            return _error("DataPlaneError", f"put {txn_id} was aborted before it began")
        txn = _Txn(pid, keys)
        try:
            await self._wait_free(pid, keys)
            reply = self._prepare(txn, tags, fields)
        except BaseException:
            if not fut.done():
                fut.set_result(None)
            raise
        if fut.done():  # given up on while waiting for the keys
            return _error("DataPlaneError", f"put {txn_id} was aborted while waiting for its keys")
        self._txns[txn_id] = txn
        self._pending.setdefault(pid, set()).add(txn)
        fut.set_result(txn)
        return reply

    def _prepare(self, txn: _Txn, tags: list[dict[str, Any]] | None, fields: list[str]) -> Reply:
        keys = txn.keys
        part = self._parts.get(txn.pid)
        slots = part.lookup(keys) if part is not None else np.full(len(keys), -1, dtype=np.int64)
        old = slots >= 0
        if not old.any():
            merged = [dict(t) for t in tags] if tags is not None else [{} for _ in keys]
            common = list(fields)
        else:
            assert part is not None
            merged = [dict(part.tags[s]) if s >= 0 else {} for s in slots.tolist()]
            if tags is not None:
                for m, t in zip(merged, tags):
                    m.update(t)
            new = set(fields)
            existing = slots[old]
            common = [f for f, c in part.cid.items() if f in new or (old.all() and bool((c[existing] >= 0).all()))]
            common += [f for f in fields if f not in part.cid]
        txn.tags, txn.fields = merged, list(fields)
        return ("ok", merged, common)

    async def commit(
        self, txn_id: str, bundles: list[tuple[list[str], Any]], writer: str, node_id: str | None
    ) -> Reply:
        """Apply the put ``begin`` prepared: each bundle's object holds those fields' rows in key order."""
        txn = await self._await_begin(txn_id)
        if txn is None or self._txns.get(txn_id) is not txn:
            return _error("DataPlaneError", f"put {txn_id} was aborted: its begin failed or its keys stayed locked")
        try:
            cids = self._apply(txn, bundles, writer)
        finally:
            self._release(txn)
        await self._notify(txn.pid)
        if self._adopt and node_id is not None:
            for cid in cids:
                self._start_adoption(cid, node_id)
        return ("ok",)

    def _apply(self, txn: _Txn, bundles: list[tuple[list[str], Any]], writer: str) -> list[int]:
        keys, n = txn.keys, len(txn.keys)
        part = self._parts.setdefault(txn.pid, Partition())
        slots = part.lookup(keys)  # again: a compaction may have renumbered slots since begin
        new = slots < 0
        if new.all():
            slots = part.append(keys, txn.tags)
        else:
            idx = slots.tolist()
            for i in np.flatnonzero(~new).tolist():
                part.tags[idx[i]] = txn.tags[i]
            if new.any():
                fresh = np.flatnonzero(new).tolist()
                slots[new] = part.append([keys[i] for i in fresh], [txn.tags[i] for i in fresh])
        rows = np.arange(n, dtype=np.int64)
        cids = []
        for names, ref in bundles:
            cid = next(self._chunk_ids)
            self._chunks[cid] = _Chunk(ref, n * len(names), writer)
            cids.append(cid)
            for name in names:
                self._unuse(part.set_cells(name, slots, cid, rows))
        return cids

    async def abort(self, txn_id: str) -> None:
        """Drop a put whose chunks could not be written (nothing of it was applied)."""
        fut = self._outcome(txn_id)
        if not fut.done():
            fut.set_result(None)  # its begin, still waiting or yet to arrive, gives up
            return
        self._begun.pop(txn_id, None)
        txn = fut.result()
        if txn is not None:
            self._release(txn)

    def _unuse(self, cids: np.ndarray) -> None:
        cids = cids[cids >= 0]
        if cids.size == 0:
            return
        ids, counts = np.unique(cids, return_counts=True)
        for cid, k in zip(ids.tolist(), counts.tolist()):
            chunk = self._chunks[cid]
            chunk.users -= k
            if chunk.users == 0:
                del self._chunks[cid]  # the last ref held here: Ray frees the object

    async def _notify(self, pid: str) -> None:
        cond = self._changed.get(pid)
        if cond is not None:
            async with cond:
                cond.notify_all()

    # -------------------------------------------------------------- adoption
    def _keeper(self, node_id: str) -> Any:
        handle = self._keepers.get(node_id)
        if handle is None:
            from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

            handle = (
                ray.remote(Keeper)
                .options(num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=node_id, soft=True))
                .remote()
            )
            self._keepers[node_id] = handle
        return handle

    def _start_adoption(self, cid: int, node_id: str) -> None:
        chunk = self._chunks.get(cid)
        if chunk is None:
            return
        chunk.adopting = True
        value_ref, flag_ref = self._keeper(node_id).keep.options(num_returns=2).remote(chunk.ref)
        task = asyncio.get_running_loop().create_task(self._finish_adoption(cid, chunk, value_ref, flag_ref))
        running = self._adoptions.setdefault(chunk.writer, set())
        running.add(task)
        task.add_done_callback(running.discard)

    async def _finish_adoption(self, cid: int, chunk: _Chunk, value_ref: Any, flag_ref: Any) -> None:
        try:
            await flag_ref  # a bool; the chunk itself is never fetched here
        except Exception:  # noqa: BLE001 - keeper or writer died: the writer's object stays in use
            chunk.adopting = False
            return
        chunk.adopting = False
        if self._chunks.get(cid) is chunk:
            chunk.ref = value_ref  # the writer's object is released with its last ref
            chunk.adopted = True

    async def flush(self, writer: str, timeout_s: float) -> int:
        """Wait (at most ``timeout_s``) until ``writer``'s chunks are owned by this actor; returns
        how many of its live chunks are still owned by the writer."""
        running = list(self._adoptions.get(writer, ()))
        if running:
            await asyncio.wait(running, timeout=timeout_s)
        if not self._adopt:
            return 0
        return sum(1 for c in self._chunks.values() if c.writer == writer and not c.adopted)

    # ------------------------------------------------------------------- get
    def _slots(self, pid: str, keys: list[str]) -> tuple[Partition | None, np.ndarray, list[str]]:
        part = self._parts.get(pid)
        if part is None:
            return None, np.zeros(0, dtype=np.int64), list(keys)
        slots = part.lookup(keys)
        missing = [keys[i] for i in np.flatnonzero(slots < 0).tolist()]
        return part, slots, missing

    async def resolve(self, pid: str, keys: list[str], fields: list[str]) -> Reply:
        """Where each field of ``keys`` lives: ``("ok", {field: where}, {chunk: ref})``.

        ``where`` is :func:`~nemo_dataplane.adapters.locate.where_of`'s compact form.
        """
        await self._wait_free(pid, keys)
        part, slots, missing = self._slots(pid, keys)
        if missing:
            return _error("KeyError", f"{len(missing)} key(s) not in partition {pid!r}: {missing[:10]}")
        assert part is not None
        out: dict[str, Any] = {}
        used: set[int] = set()
        for name in fields:
            c = part.cid[name][slots] if name in part.cid else np.full(len(keys), -1, dtype=np.int64)
            lacking = np.flatnonzero(c < 0)
            if lacking.size:
                some = [keys[i] for i in lacking[:5].tolist()]
                return _error(
                    "KeyError",
                    f"field {name!r} is not stored for {lacking.size} key(s) in partition {pid!r}, e.g. {some}",
                )
            p = part.pos[name][slots]
            out[name] = where_of(c, p)
            used.update(np.unique(c).tolist())
        return ("ok", out, {cid: self._chunks[cid].ref for cid in used})

    # ----------------------------------------------------------- list / clear
    async def list(self, pid: str) -> Reply:
        await self._wait_free(pid, None)
        part = self._parts.get(pid)
        if part is None:
            return ("ok", [], [], [])
        slots = np.flatnonzero(part.live[: part.n])
        idx = slots.tolist()
        return ("ok", [part.keys[i] for i in idx], [part.tags[i] for i in idx], part.common_fields(slots))

    # (Below, ``list`` in an annotation would name the method above: hence ``builtins.list``.)
    async def clear(self, pid: str, keys: builtins.list[str] | None) -> Reply:
        await self._wait_free(pid, keys)
        part = self._parts.get(pid)
        if part is None:
            return ("ok",)
        if keys is None:
            slots = np.flatnonzero(part.live[: part.n])
        else:
            slots = part.lookup(keys)
            slots = slots[slots >= 0]
        for released in part.remove(slots):
            self._unuse(released)
        if part.nlive == 0:
            del self._parts[pid]
        elif part.n - part.nlive > max(1024, part.nlive) and not self._pending.get(pid):
            part.compact()
        await self._notify(pid)
        return ("ok",)

    async def partitions(self) -> builtins.list[str]:
        for pid in list(self._pending):
            await self._wait_free(pid, None)
        return [p for p, part in self._parts.items() if part.nlive]

    # ---------------------------------------------------------------- claims
    async def claim(self, pid: str, task: str, fields: builtins.list[str], batch_size: int, timeout_s: float) -> Reply:
        """Claim up to ``batch_size`` produced rows for ``task`` (see ``DataPlaneClient.kv_claim``)."""
        deadline = time.monotonic() + timeout_s
        await self._wait_free(pid, None)  # puts that returned to their writers count as produced
        cond = self._changed.setdefault(pid, asyncio.Condition())
        async with cond:
            while True:
                part = self._parts.get(pid)
                ready = np.zeros(0, dtype=np.int64)
                if part is not None:
                    ready = np.flatnonzero(part.produced(fields) & ~part.task(task)[: part.n])
                left = deadline - time.monotonic()
                if ready.size >= batch_size or left <= 0:
                    break
                try:
                    await asyncio.wait_for(cond.wait(), left)
                except asyncio.TimeoutError:
                    pass
        if part is None or ready.size == 0:
            return ("ok", [], [], list(fields))
        take = ready[:batch_size]
        part.task(task)[take] = True
        idx = take.tolist()
        return ("ok", [part.keys[i] for i in idx], [part.tags[i] for i in idx], part.common_fields(take))

    async def mark_consumed(self, pid: str, task: str, keys: builtins.list[str]) -> Reply:
        await self._wait_free(pid, keys)
        part = self._parts.get(pid)
        if part is not None:
            slots = part.lookup(keys)
            part.task(task)[slots[slots >= 0]] = True
        return ("ok",)

    async def claim_status(self, pid: str, task: str, fields: builtins.list[str]) -> Reply:
        await self._wait_free(pid, None)
        part = self._parts.get(pid)
        if part is None:
            return ("ok", 0, 0, 0, 0)
        produced = part.produced(fields)
        claimed = part.task(task)[: part.n] & part.live[: part.n]
        return ("ok", part.nlive, int(produced.sum()), int(claimed.sum()), int((produced & ~claimed).sum()))

    # ----------------------------------------------------------------- stats
    async def stats(self) -> dict[str, int]:
        """Counts for tests and the benchmark (rows, chunks, how many chunks the index owns)."""
        chunks = list(self._chunks.values())
        return {
            "partitions": sum(1 for p in self._parts.values() if p.nlive),
            "rows": sum(p.nlive for p in self._parts.values()),
            "chunks": len(chunks),
            "adopting": sum(1 for c in chunks if c.adopting),
            "writer_owned": sum(1 for c in chunks if not c.adopted),
            "pending_puts": len(self._txns),
            "keepers": len(self._keepers),
        }
