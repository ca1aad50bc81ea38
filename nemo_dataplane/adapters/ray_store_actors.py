"""The actors behind the Ray object-store backend (:mod:`nemo_dataplane.adapters.ray_store`).

* :class:`StoreIndex`, the named metadata actor: partitions -> keys -> tags and, per field, the
  object (a "chunk": one field of one put) and row that holds the key's value. It holds object
  refs, never tensors, and is the single place where puts become visible, claims are taken and
  objects are freed.
* :class:`Keeper`, one per node: re-creates a writer's chunk as the return value of a call that
  the index makes, which Ray stores on the keeper's node and makes *owned by the index*. That is
  how a row outlives the process that put it (Ray >= 2.56 has no ``ray.put(_owner=...)``).

This module imports neither torch nor the client on purpose: both actors start in a fresh Ray
worker, and importing torch there would add seconds to the store's start-up. Chunks travel as
numpy arrays (Ray hands those over out of band, straight from shared memory).

Put protocol (two messages, one round trip on the writer's critical path): ``begin`` validates
against the current rows, locks the keys and returns the merged tags and fields; the writer
``ray.put``s its chunks meanwhile, then sends ``commit`` without waiting for its reply. Every
reader, lister, clearer or claimer that touches a locked key (or, for partition-wide ops, a
partition with a pending put) waits for the commit, so a put that returned is visible to every
process. Actor tasks from one caller start in submission order, so a writer's own later ops
always run after its commit.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Sequence
from typing import Any

import ray

# Errors cross the actor boundary as ("error", kind, message) replies rather than raised
# exceptions: a raised one costs a traceback per call and arrives wrapped in RayTaskError.
Reply = tuple[Any, ...]


def _error(kind: str, message: str) -> Reply:
    return ("error", kind, message)


class _Row:
    __slots__ = ("cells", "seq", "tags")

    def __init__(self, seq: int) -> None:
        self.tags: dict[str, Any] = {}
        self.cells: dict[str, tuple[int, int]] = {}  # field -> (chunk id, row position in the chunk)
        self.seq = seq  # row identity for claims: a key cleared and put again is a new row


class _Chunk:
    __slots__ = ("adopted", "adopting", "jagged", "ref", "users", "writer")

    def __init__(self, ref: Any, jagged: bool, users: int, writer: str) -> None:
        self.ref = ref  # the writer's object until a keeper's copy (owned by the index) replaces it
        self.jagged = jagged
        self.users = users  # rows whose cell points here; the chunk is dropped (freed) at 0
        self.writer = writer
        self.adopting = False
        self.adopted = False


class _Txn:
    __slots__ = ("created", "done", "fields", "keys", "pid", "ready", "tags")

    def __init__(self, pid: str, keys: list[str]) -> None:
        self.pid = pid
        self.keys = keys
        self.tags: list[dict[str, Any]] = []
        self.fields: list[tuple[str, bool]] = []
        self.created: list[bool] = []
        self.ready = asyncio.get_running_loop().create_future()  # begin finished (True) or failed (False)
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
        self._parts: dict[str, dict[str, _Row]] = {}
        self._chunks: dict[int, _Chunk] = {}
        self._txns: dict[str, _Txn] = {}
        self._locks: dict[tuple[str, str], _Txn] = {}
        self._pending: dict[str, set[_Txn]] = {}  # partition -> puts between begin and commit
        self._claims: dict[tuple[str, str], set[int]] = {}  # (partition, task) -> claimed row seqs
        self._changed: dict[str, asyncio.Condition] = {}  # partition -> notified on commit / clear
        self._keepers: dict[str, Any] = {}
        self._adoptions: dict[str, set[asyncio.Task]] = {}  # writer -> adoptions in flight
        self._seq = itertools.count()
        self._chunk_ids = itertools.count()
        self._lock_timeout_s = float(lock_timeout_s)
        self._adopt = bool(adopt)

    def ready(self) -> dict[str, Any]:
        return {"adopt": self._adopt, "lock_timeout_s": self._lock_timeout_s}

    # ----------------------------------------------------------------- locks
    async def _wait_free(self, pid: str, keys: Sequence[str] | None) -> None:
        """Wait until no put in flight holds ``keys`` (``None``: any key of ``pid``).

        A put still pending after ``lock_timeout_s`` is presumed dead (its writer never sent the
        commit) and aborted, so its keys are never left locked.
        """
        while True:
            if keys is None:
                txn = next(iter(self._pending.get(pid, ())), None)
            else:
                txn = next((t for k in keys if (t := self._locks.get((pid, k))) is not None), None)
            if txn is None:
                return
            try:
                await asyncio.wait_for(txn.done.wait(), self._lock_timeout_s)
            except asyncio.TimeoutError:
                self._release(txn)

    def _release(self, txn: _Txn) -> None:
        for k in txn.keys:
            if self._locks.get((txn.pid, k)) is txn:
                del self._locks[(txn.pid, k)]
        pending = self._pending.get(txn.pid)
        if pending is not None:
            pending.discard(txn)
            if not pending:
                del self._pending[txn.pid]
        for tid, t in list(self._txns.items()):
            if t is txn:
                del self._txns[tid]
        if not txn.ready.done():
            txn.ready.set_result(False)
        txn.done.set()

    # ------------------------------------------------------------------- put
    async def begin(
        self,
        txn_id: str,
        pid: str,
        keys: list[str],
        tags: list[dict[str, Any]] | None,
        fields: list[tuple[str, bool]],
    ) -> Reply:
        """Lock ``keys`` and return ``("ok", merged tags per key, fields stored on every key)``."""
        txn = _Txn(pid, keys)
        self._txns[txn_id] = txn  # before any await: the writer's commit, started next, finds it
        try:
            await self._wait_free(pid, keys)
        except BaseException:
            self._txns.pop(txn_id, None)
            txn.ready.set_result(False)
            raise
        part = self._parts.get(pid, {})
        new_names = [name for name, _ in fields]
        merged, names_per_row = [], []
        for i, k in enumerate(keys):
            row = part.get(k)
            t = dict(row.tags) if row is not None else {}
            if tags is not None:
                t.update(tags[i])
            merged.append(t)
            old = list(row.cells) if row is not None else []
            names_per_row.append(old + [n for n in new_names if n not in old])
            txn.created.append(row is None)
        common = names_per_row[0]
        for names in names_per_row[1:]:
            present = set(names)
            common = [n for n in common if n in present]
        txn.tags, txn.fields = merged, list(fields)
        for k in keys:
            self._locks[(pid, k)] = txn
        self._pending.setdefault(pid, set()).add(txn)
        txn.ready.set_result(True)
        return ("ok", merged, common)

    async def commit(self, txn_id: str, refs: list[Any], writer: str, node_id: str | None) -> Reply:
        """Apply the put ``begin`` prepared: ``refs[i]`` holds field ``i``'s rows in key order."""
        txn = self._txns.get(txn_id)
        if txn is None:
            return _error("DataPlaneError", f"put {txn_id} is unknown or was aborted (its begin failed or timed out)")
        try:
            ok = await asyncio.wait_for(asyncio.shield(txn.ready), self._lock_timeout_s)
        except asyncio.TimeoutError:
            ok = False
        if not ok or self._txns.get(txn_id) is not txn:
            return _error("DataPlaneError", f"put {txn_id} was aborted before its commit arrived")
        pid, keys = txn.pid, txn.keys
        part = self._parts.setdefault(pid, {})
        cids = []
        for (_, jagged), ref in zip(txn.fields, refs):
            cid = next(self._chunk_ids)
            self._chunks[cid] = _Chunk(ref, jagged, len(keys), writer)
            cids.append(cid)
        for i, k in enumerate(keys):
            row = part.get(k)
            if row is None:
                row = part[k] = _Row(next(self._seq))
            row.tags = txn.tags[i]
            for (name, _), cid in zip(txn.fields, cids):
                old = row.cells.get(name)
                row.cells[name] = (cid, i)
                if old is not None:
                    self._unuse(old[0])
        del self._txns[txn_id]
        self._release(txn)
        await self._notify(pid)
        if self._adopt and node_id is not None:
            for cid in cids:
                self._start_adoption(cid, node_id)
        return ("ok",)

    async def abort(self, txn_id: str) -> None:
        """Drop a put whose chunks could not be written (nothing of it was applied)."""
        txn = self._txns.get(txn_id)
        if txn is not None:
            self._release(txn)

    def _unuse(self, cid: int) -> None:
        chunk = self._chunks[cid]
        chunk.users -= 1
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
                .options(
                    num_cpus=0,
                    scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=node_id, soft=True),
                )
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
    async def resolve(self, pid: str, keys: list[str], fields: list[str]) -> Reply:
        """Where each field of ``keys`` lives: ``("ok", {field: runs}, {chunk: ref})``.

        ``runs`` is a list of ``(chunk id, first row, count)`` covering the keys in order, so a
        read of whole puts in order is a handful of slices.
        """
        await self._wait_free(pid, keys)
        part = self._parts.get(pid, {})
        rows = []
        missing = []
        for k in keys:
            row = part.get(k)
            if row is None:
                missing.append(k)
            else:
                rows.append(row)
        if missing:
            return _error("KeyError", f"{len(missing)} key(s) not in partition {pid!r}: {missing[:10]}")
        out: dict[str, Any] = {}
        refs: dict[int, Any] = {}
        for name in fields:
            lacking = [k for k, r in zip(keys, rows) if name not in r.cells]
            if lacking:
                return _error(
                    "KeyError",
                    f"field {name!r} is not stored for {len(lacking)} key(s) in partition {pid!r}, e.g. {lacking[:5]}",
                )
            runs: list[list[int]] = []
            last_cid, last_pos = -1, -2
            for r in rows:
                cid, pos = r.cells[name]
                if cid == last_cid and pos == last_pos + 1:
                    runs[-1][2] += 1
                else:
                    runs.append([cid, pos, 1])
                last_cid, last_pos = cid, pos
            for cid, _, _ in runs:
                if cid not in refs:
                    refs[cid] = self._chunks[cid].ref
            out[name] = runs
        return ("ok", out, refs)

    # ----------------------------------------------------------- list / clear
    async def list(self, pid: str) -> Reply:
        await self._wait_free(pid, None)
        part = self._parts.get(pid, {})
        rows = list(part.values())
        return ("ok", list(part), [r.tags for r in rows], _common_fields(rows))

    async def clear(self, pid: str, keys: list[str] | None) -> Reply:
        await self._wait_free(pid, keys)
        part = self._parts.get(pid)
        if part is None:
            return ("ok",)
        if keys is None:
            gone = list(part.values())
            del self._parts[pid]
            for (p, task) in [c for c in self._claims if c[0] == pid]:
                del self._claims[(p, task)]
        else:
            gone = [row for k in keys if (row := part.pop(k, None)) is not None]
            if not part:
                del self._parts[pid]
        for row in gone:
            for cid, _ in row.cells.values():
                self._unuse(cid)
        if keys is not None and gone:
            seqs = {row.seq for row in gone}
            for ck, claimed in self._claims.items():
                if ck[0] == pid:
                    claimed.difference_update(seqs)
        await self._notify(pid)
        return ("ok",)

    async def partitions(self) -> list[str]:
        return [p for p, part in self._parts.items() if part]

    # ---------------------------------------------------------------- claims
    def _claimable(self, pid: str, task: str, fields: list[str]) -> tuple[list[str], list[_Row]]:
        part = self._parts.get(pid, {})
        claimed = self._claims.get((pid, task), set())
        keys, rows = [], []
        for k, row in part.items():
            if row.seq not in claimed and (pid, k) not in self._locks and all(f in row.cells for f in fields):
                keys.append(k)
                rows.append(row)
        return keys, rows

    async def claim(self, pid: str, task: str, fields: list[str], batch_size: int, timeout_s: float) -> Reply:
        """Claim up to ``batch_size`` produced rows for ``task`` (see ``DataPlaneClient.kv_claim``)."""
        deadline = time.monotonic() + timeout_s
        cond = self._changed.setdefault(pid, asyncio.Condition())
        async with cond:
            while True:
                keys, rows = self._claimable(pid, task, fields)
                left = deadline - time.monotonic()
                if len(keys) >= batch_size or left <= 0:
                    break
                try:
                    await asyncio.wait_for(cond.wait(), left)
                except asyncio.TimeoutError:
                    pass
        keys, rows = keys[:batch_size], rows[:batch_size]
        if rows:
            self._claims.setdefault((pid, task), set()).update(r.seq for r in rows)
        return ("ok", keys, [r.tags for r in rows], _common_fields(rows) if rows else list(fields))

    async def mark_consumed(self, pid: str, task: str, keys: list[str]) -> Reply:
        await self._wait_free(pid, keys)
        part = self._parts.get(pid, {})
        seqs = [part[k].seq for k in keys if k in part]
        if seqs:
            self._claims.setdefault((pid, task), set()).update(seqs)
        return ("ok",)

    async def claim_status(self, pid: str, task: str, fields: list[str]) -> Reply:
        await self._wait_free(pid, None)
        part = self._parts.get(pid, {})
        claimed = self._claims.get((pid, task), set())
        rows = len(part)
        produced = sum(1 for r in part.values() if all(f in r.cells for f in fields))
        n_claimed = sum(1 for r in part.values() if r.seq in claimed)
        claimable = sum(1 for r in part.values() if r.seq not in claimed and all(f in r.cells for f in fields))
        return ("ok", rows, produced, n_claimed, claimable)

    # ----------------------------------------------------------------- stats
    async def stats(self) -> dict[str, int]:
        """Counts for tests and the benchmark (rows, chunks, how many chunks the index owns)."""
        chunks = list(self._chunks.values())
        return {
            "partitions": sum(1 for p in self._parts.values() if p),
            "rows": sum(len(p) for p in self._parts.values()),
            "chunks": len(chunks),
            "adopting": sum(1 for c in chunks if c.adopting),
            "writer_owned": sum(1 for c in chunks if not c.adopted),
            "pending_puts": len(self._txns),
            "keepers": len(self._keepers),
        }


def _common_fields(rows: Sequence[_Row]) -> list[str]:
    """Fields stored on every row, in the first row's order (the reference client's rule)."""
    if not rows:
        return []
    common = list(rows[0].cells)
    for r in rows[1:]:
        common = [f for f in common if f in r.cells]
    return common
