"""TransferQueue adapter: :class:`DataPlaneClient` over TransferQueue 0.1.11 on Ray.

Keys, field names and per-key tags are stored exactly as TransferQueue's own
``kv_batch_put`` stores them, so ``transfer_queue.kv_batch_get``/``kv_list`` in any process
read what this adapter wrote and vice versa. On top of TransferQueue it adds what the client
contract asks for (see :mod:`nemo_dataplane.client`): ``KeyError`` for missing keys or fields
instead of silently dropped rows, dense fields coming back dense, timeouts on every op, and a
controller lifetime owned by the client that created it.

Layout: TransferQueue returns every non-scalar field as a jagged nested tensor. To hand back what
was put, each key carries one reserved tag, ``__nd_layout__ = {field: "dense" | "jagged"}``,
merged on every put and stripped from the tags callers see. A field written by another
TransferQueue client (no layout entry) comes back dense when every row is a scalar and jagged
otherwise, which is TransferQueue's own rule.

Data path: writes use TransferQueue's own ZMQ protocol (dense fields one frame per field and
storage unit; jagged fields too, cut into rows inside the unit). Reads ask each storage unit for
one contiguous buffer per field through the Ray object store instead of TransferQueue's one
frame per row; stores whose units we cannot address (made by ``tq.init()``) fall back to the
per-row protocol. When the controller holds the store's only unit (the default on a small
node), each put, get and clear is one call to the controller instead (compat quirk 14), atomic
against every other op. Every TransferQueue quirk worked around here lives in :mod:`.compat`.

Claims (``kv_claim`` and friends) ride on TransferQueue's own production/consumption
bookkeeping; see :mod:`.claims`. Bootstrap, lifecycle and the bounded op plumbing (timeouts,
the liveness watch that raises :class:`StoreLostError`) are :mod:`.store`'s.

Why not ``transfer_queue.init()/kv_*``: those keep the client, controller and storage handles
in module globals that go stale after ``ray.shutdown()`` (a second ``init`` in the same process
then fails), and ``transfer_queue.close()`` from *any* process kills the shared controller.
Each adapter instance therefore owns its client and, if it created the store, the actor handles.
"""

from __future__ import annotations

import asyncio
import functools
import threading
from collections.abc import Mapping, Sequence
from typing import Any, cast

import torch
from tensordict import TensorDict

from nemo_dataplane.adapters.actor_store import Bootstrap
from nemo_dataplane.adapters.steps import Blocking, Steps, drive
from nemo_dataplane.adapters.transfer_queue import compat, results
from nemo_dataplane.adapters.transfer_queue.claims import TransferQueueClaims
from nemo_dataplane.adapters.transfer_queue.store import (
    LIVENESS_EVERY_S,
    LIVENESS_PING_S,
    StoreLostError,
    TransferQueueStore,
    admit_transfer_queue_clients,
    auto_storage_units,
)
from nemo_dataplane.client import (
    DataPlaneError,
    Fields,
    add_error_note,
    check_keys,
    check_partition,
    check_put_args,
    check_select_fields,
    resolve_get_target,
)
from nemo_dataplane.codec import is_jagged
from nemo_dataplane.config import DataPlaneConfig, TransferQueueConfig, config_section
from nemo_dataplane.distributed.auth import job_secret
from nemo_dataplane.meta import KVBatchMeta

LAYOUT_TAG = results.LAYOUT_TAG
DEFAULT_CONTROLLER = "TransferQueueController"  # TransferQueue's own names: tq.init() attaches
DEFAULT_NAMESPACE = "transfer_queue"
__all__ = [
    "LAYOUT_TAG",
    "LIVENESS_EVERY_S",
    "LIVENESS_PING_S",
    "StoreLostError",
    "TransferQueueClient",
    "admit_transfer_queue_clients",
    "auto_storage_units",
]


class TransferQueueClient(TransferQueueClaims, TransferQueueStore):
    """:class:`DataPlaneClient` backed by a TransferQueue controller and SimpleStorage units.

    Args:
        config: the ``data_plane.transfer_queue`` section (or a whole ``DataPlaneConfig``).
        bootstrap: ``"auto"`` attaches to the named controller or creates it; ``True`` creates
            it (error if it exists); ``False`` only attaches (what worker actors use).
        controller_name / namespace: the Ray actor to attach to or create. Defaults are
            TransferQueue's own, so ``transfer_queue.init()`` elsewhere joins the same store
            (after :func:`~.store.admit_transfer_queue_clients` in that process).
        secret: what a store this client creates derives its wire keys from (``None``:
            ``$NEMO_DATAPLANE_SECRET``, else a fresh secret). Only processes holding the keys
            reach the store's sockets; clients that attach get them from the controller
            through Ray (compat quirk 15).

    Only the client that created the controller (``owns_store``) shuts it and the storage units
    down on :meth:`close`; attached clients just disconnect. When this client had to start Ray
    itself, ``close`` also shuts Ray down.

    Raises:
        DataPlaneError: nothing to attach to (``bootstrap=False``), a controller already exists
            (``bootstrap=True``), or bootstrap could not finish within ``bootstrap_timeout_s``
            (the message says which resources were missing).
    """

    BACKEND = "transfer_queue"
    # nemo_dataplane first: its import hook keeps tensordict from loading torch._dynamo.
    ACTOR_MODULES = ("nemo_dataplane", "nemo_dataplane.adapters.transfer_queue.compat.bootstrap")
    SECTION = "transfer_queue"
    NAME_KWARG = "controller_name"
    WHAT = "TransferQueue controller"

    def __init__(
        self,
        config: TransferQueueConfig | DataPlaneConfig | Mapping[str, Any] | None = None,
        bootstrap: Bootstrap = "auto",
        controller_name: str = DEFAULT_CONTROLLER,
        namespace: str = DEFAULT_NAMESPACE,
        secret: bytes | str | None = None,
        *,
        _plain_wire: bool = False,  # benchmarks only (bench_data_plane.py --compare-plain-wire): no wire keys
    ) -> None:
        self.cfg = _tq_config(config)
        self._secret = job_secret(secret)
        self._plain_wire = _plain_wire
        self._wire = None
        self._controller: Any = None
        self._storage: dict[str, Any] = {}
        self._units: dict[str, Any] = {}
        self._hosted: Any = None
        self._control: Any = None
        self._ours = False
        self._local_units = False
        self._tq: Any = None
        self._claims_unsupported: str | None = None
        self._watched: list[tuple[str, Any]] = []  # (what, actor handle) checked while an op is slow
        self._lost: str | None = None  # set once a watched actor is found dead: every op fails at once
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self.startup_phases = {}
        if self.cfg.quiet:
            compat.quiet_logs()
        with compat.preserve_torch_threads():
            self._open(bootstrap, controller_name, namespace, log_to_driver=not self.cfg.quiet)
        self._loop, self._thread = compat.loop_thread(f"nd-tq-{controller_name}")

    # ------------------------------------------------------------------- put
    def _prepare_put(
        self, keys: Sequence[str], partition_id: str, fields: Fields | None, tags: Any
    ) -> tuple[list[str], str, dict[str, torch.Tensor], list[dict[str, Any]] | None]:
        keys, partition_id, columns, tag_list = check_put_args(keys, partition_id, fields, tags)
        if tag_list is not None:
            for i, t in enumerate(tag_list):
                if LAYOUT_TAG in t:
                    raise ValueError(f"tags[{i}] (key {keys[i]!r}) uses the reserved tag name {LAYOUT_TAG!r}")
        # Detach and make contiguous up front so a bad tensor fails before the store is touched.
        columns = {k: (v.detach() if is_jagged(v) else v.detach().contiguous()) for k, v in columns.items()}
        return keys, partition_id, columns, tag_list

    def _put(
        self,
        keys: list[str],
        partition_id: str,
        columns: dict[str, torch.Tensor],
        tag_list: list[dict[str, Any]] | None,
    ) -> Steps[KVBatchMeta]:
        if self._hosted is not None:
            return (yield from self._put_hosted(keys, partition_id, columns, tag_list))
        meta: KVBatchMeta = yield self._put_apart(keys, partition_id, columns, tag_list)
        return meta

    async def _put_apart(
        self,
        keys: list[str],
        partition_id: str,
        columns: dict[str, torch.Tensor],
        tag_list: list[dict[str, Any]] | None,
    ) -> KVBatchMeta:
        """A put across actors: the key lookup, the rows to the units, the tags with the
        production notice (quirk 10); a failure removes the keys it created."""
        if columns and self._local_units and compat.rides_inline(columns):
            # A small put rides inside the units' calls.
            bm, chunk = await self._retrieve(keys, partition_id, create=True), compat.chunk_of(columns)
        elif columns and self._local_units:
            # The one copy of the rows into shared memory overlaps the controller's key lookup.
            bm, chunk = await asyncio.gather(
                self._retrieve(keys, partition_id, create=True), asyncio.to_thread(compat.put_chunk, columns)
            )
        else:
            bm, chunk = await self._retrieve(keys, partition_id, create=True), None
        if bm.size != len(keys):
            raise DataPlaneError(
                f"TransferQueue returned {bm.size} slots for {len(keys)} keys in partition {partition_id!r}"
            )
        # Keys with no tags yet were created by this call (every put of ours leaves a tag):
        # those are removed again if the write fails, so a failed put leaves no keys behind.
        # Limitation: a key another TransferQueue client wrote without tags looks the same, so
        # a failed upsert over such a key removes it too.
        fresh = [i for i, cm in enumerate(bm.custom_meta) if not cm]
        before_fields = list(bm.field_schema.keys())
        layout = results.layout_of(columns)
        new_meta = compat.merged_tags(bm.custom_meta, tag_list, layout)
        bm.custom_meta = new_meta
        try:
            # Our controller takes the tags with the production notice, after the rows: one
            # request (quirk 10). Another's takes them beside the rows (other actors), then it.
            jobs = [] if self._ours else [compat.set_tags(self._tq, partition_id, bm.global_indexes, new_meta)]
            if columns:
                jagged = results.jagged_in(layout)
                jobs.append(compat.put_rows(self._tq, bm, columns, jagged, self._units, chunk))
            # Wait for all before judging: cleanup must not race a tag write still in flight.
            outcomes = await asyncio.gather(*jobs, return_exceptions=True)
            for r in outcomes:
                if isinstance(r, BaseException):
                    raise r
            # put_rows's field schema (the loop raised errors); only with tags stored may a
            # claimer see the rows as produced.
            schema = cast("dict[str, dict[str, Any]]", outcomes[-1]) if columns else {}
            if self._ours:
                await compat.set_tags(self._tq, partition_id, bm.global_indexes, new_meta, schema)
            elif columns:
                await compat.mark_produced(self._tq, bm, schema)
        except BaseException as error:
            if fresh:
                # Bounded like any op; a failed clean-up is noted on the put's own error, which
                # is the one raised.
                try:
                    await asyncio.wait_for(
                        asyncio.shield(self._tq.async_clear_samples(bm.select_samples(fresh))),
                        self.cfg.op_timeout_s,
                    )
                except Exception as e:  # noqa: BLE001
                    add_error_note(
                        error,
                        f"removing the {len(fresh)} key(s) this failed put created in partition "
                        f"{partition_id!r} (e.g. {keys[fresh[0]]!r}) also failed: {type(e).__name__}: {e}",
                    )
            raise
        return results.put_meta(keys, partition_id, columns, new_meta, before_fields)

    def _put_hosted(
        self,
        keys: list[str],
        partition_id: str,
        columns: dict[str, torch.Tensor],
        tag_list: list[dict[str, Any]] | None,
    ) -> Steps[KVBatchMeta]:
        """The whole put as one request to the controller holding the only unit (quirk 14)."""
        layout = results.layout_of(columns)
        chunk: list[Any] = []
        if columns:
            # A small batch rides in the request itself; a large one is put once, and the unit
            # maps that object (quirk 11).
            if compat.rides_inline(columns):
                chunk = [compat.chunk_of(columns)]
            else:
                chunk = [(yield Blocking(functools.partial(compat.put_chunk, columns)))]
        jagged = results.jagged_in(layout)
        schema = compat.field_schema(len(keys), columns, jagged) if columns else {}
        done = yield self._hosted.nd_put.remote(partition_id, keys, tag_list, layout, schema, chunk)
        return results.put_meta(keys, partition_id, columns, done.tags, done.fields_before)

    def kv_batch_put(
        self,
        keys: Sequence[str],
        partition_id: str,
        fields: Fields | None,
        tags: Sequence[Mapping[str, Any]] | None = None,
    ) -> KVBatchMeta:
        keys, pid, columns, tag_list = self._prepare_put(keys, partition_id, fields, tags)
        return self._run_steps("kv_batch_put", pid, len(keys), self._put(keys, pid, columns, tag_list))

    async def async_kv_batch_put(
        self,
        keys: Sequence[str],
        partition_id: str,
        fields: Fields | None,
        tags: Sequence[Mapping[str, Any]] | None = None,
    ) -> KVBatchMeta:
        keys, pid, columns, tag_list = self._prepare_put(keys, partition_id, fields, tags)
        return await self._run_async("kv_batch_put", pid, len(keys), drive(self._put(keys, pid, columns, tag_list)))

    # ------------------------------------------------------------------- get
    async def _missing_keys(self, keys: list[str], partition_id: str, bm: Any) -> list[str]:
        if bm.size == 0:
            return keys
        present = set(
            await self._tq.async_kv_retrieve_keys(global_indexes=bm.global_indexes, partition_id=partition_id)
        )
        return [k for k in keys if k not in present]

    async def _unreadable(self, keys: list[str], partition_id: str, names: list[str]) -> list[str]:
        """Those of ``keys`` gone from ``partition_id`` now, or whose rows lack one of ``names``
        (a clear zeroes production before it removes keys)."""
        bm = await self._retrieve(keys, partition_id, create=False)
        if bm.size != len(keys):
            return await self._missing_keys(keys, partition_id, bm)
        gis, status = await self._tq.async_get_production_status(data_fields=names, partition_id=partition_id)
        if gis is None or status is None:  # some field is stored nowhere in the partition now
            return keys
        ready = dict(zip(gis.tolist(), status.bool().all(dim=1).tolist()))
        return [k for k, gi in zip(keys, bm.global_indexes) if not ready.get(gi, False)]

    def _get(self, keys: list[str], partition_id: str, names: list[str]) -> Steps[TensorDict]:
        """All rows of ``keys`` as put, or ``KeyError``: nothing in between, even when a clear of
        the same keys runs meanwhile (TransferQueue has no read lease): the error then names the
        keys whose rows went while they were read."""
        if not keys:
            return TensorDict({}, batch_size=[0])
        try:
            return (yield from self._read(keys, partition_id, names))
        except (results.NotProduced, compat.StorageKeyNotFoundError):
            gone = yield self._unreadable(keys, partition_id, names)
            raise results.cleared_meanwhile(gone or keys, partition_id) from None

    def _read(self, keys: list[str], partition_id: str, names: list[str]) -> Steps[TensorDict]:
        if self._hosted is not None:
            # Lookup and the unit's answer in one request (quirk 14); rows it cannot stack
            # take TransferQueue's per-row protocol below.
            loc = yield self._hosted.nd_locate.remote(partition_id, keys, names)
            if loc.missing:
                raise results.not_there(loc.missing, partition_id)
            results.check_stored(names, loc.fields, keys, loc.tags, partition_id)
            if loc.reply is not None:
                cols = yield from compat.read_columns(self._tq, self._units, loc, names, first=[loc.reply])
                if cols is not None:
                    return results.columns_batch(cols, names, keys, loc.tags)
        bm = yield self._retrieve(keys, partition_id, create=False)
        if bm.size != len(keys):
            missing = yield self._missing_keys(keys, partition_id, bm)
            raise results.not_there(missing, partition_id)
        results.check_stored(names, list(bm.field_schema.keys()), keys, bm.custom_meta, partition_id)
        cols = (yield from compat.read_columns(self._tq, self._units, bm, names)) if self._units else None
        if cols is None:  # a store we cannot read in bulk: TransferQueue's per-row protocol
            rows = yield compat.get_rows(self._tq, bm, names)
            cols = {}
            for name in names:
                try:
                    cols[name] = compat.column_from_rows(rows[name])
                except (TypeError, ValueError) as e:
                    raise type(e)(f"field {name!r}: {e}") from None
        return results.columns_batch(cols, names, keys, bm.custom_meta)

    def kv_batch_get(
        self,
        meta_or_keys: KVBatchMeta | Sequence[str],
        select_fields: Sequence[str],
        partition_id: str | None = None,
    ) -> TensorDict:
        keys, pid = resolve_get_target(meta_or_keys, partition_id)
        names = check_select_fields(select_fields)
        return self._run_steps("kv_batch_get", pid, len(keys), self._get(keys, pid, names))

    async def async_kv_batch_get(
        self,
        meta_or_keys: KVBatchMeta | Sequence[str],
        select_fields: Sequence[str],
        partition_id: str | None = None,
    ) -> TensorDict:
        keys, pid = resolve_get_target(meta_or_keys, partition_id)
        names = check_select_fields(select_fields)
        return await self._run_async("kv_batch_get", pid, len(keys), drive(self._get(keys, pid, names)))

    # --------------------------------------------------- clear / list / partitions
    def _clear(self, keys: list[str] | None, partition_id: str) -> Steps[None]:
        if self._hosted is not None and (keys is None or keys):
            yield self._hosted.nd_clear.remote(partition_id, keys)
        else:
            yield self._clear_apart(keys, partition_id)

    async def _clear_apart(self, keys: list[str] | None, partition_id: str) -> None:
        if keys is None:
            if partition_id in await self._tq.async_get_partition_list():
                await self._tq.async_clear_partition(partition_id)
            return
        if not keys:
            return
        bm = await self._retrieve(keys, partition_id, create=False)
        if bm.size:
            await self._tq.async_clear_samples(bm)

    def kv_clear(self, keys: Sequence[str] | None, partition_id: str) -> None:
        pid = check_partition(partition_id)
        key_list = None if keys is None else check_keys(keys, allow_empty=True)
        self._run_steps("kv_clear", pid, -1 if key_list is None else len(key_list), self._clear(key_list, pid))

    async def async_kv_clear(self, keys: Sequence[str] | None, partition_id: str) -> None:
        pid = check_partition(partition_id)
        key_list = None if keys is None else check_keys(keys, allow_empty=True)
        n = -1 if key_list is None else len(key_list)
        await self._run_async("kv_clear", pid, n, drive(self._clear(key_list, pid)))

    async def _list(self, partition_id: str) -> KVBatchMeta:
        info = (await self._tq.async_kv_list(partition_id)).get(partition_id, {})
        keys = list(info.keys())
        fields: list[str] = []
        if keys:
            bm = await self._retrieve(keys, partition_id, create=False)
            fields = results.field_order(list(bm.field_schema.keys()), info[keys[0]])
        return KVBatchMeta(
            keys=tuple(keys),
            tags=tuple([results.public_tags(info[k]) for k in keys]),
            partition_id=partition_id,
            fields=tuple(fields),
        )

    def kv_list(self, partition_id: str) -> KVBatchMeta:
        pid = check_partition(partition_id)
        return self._run("kv_list", pid, 0, self._list(pid))

    async def async_kv_list(self, partition_id: str) -> KVBatchMeta:
        pid = check_partition(partition_id)
        return await self._run_async("kv_list", pid, 0, self._list(pid))

    async def _partitions(self) -> list[str]:
        info = await self._tq.async_kv_list(None)  # every partition, with its keys and tags
        # TransferQueue keeps a partition whose keys were cleared one by one: not ours to list.
        return [p for p, keys in info.items() if keys]

    def kv_partitions(self) -> list[str]:
        return self._run("kv_partitions", "*", 0, self._partitions())

    async def async_kv_partitions(self) -> list[str]:
        return await self._run_async("kv_partitions", "*", 0, self._partitions())


# ---------------------------------------------------------------- helpers
def _tq_config(config: Any) -> TransferQueueConfig:
    return TransferQueueConfig() if config is None else config_section(config, "transfer_queue", "config")
