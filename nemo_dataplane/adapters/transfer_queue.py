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
per-row protocol. Every TransferQueue quirk worked around here lives in :mod:`.tq_compat`.

Claims (``kv_claim`` and friends) ride on TransferQueue's own production/consumption
bookkeeping; see :mod:`.tq_claims`.

Why not ``transfer_queue.init()/kv_*``: those keep the client, controller and storage handles
in module globals that go stale after ``ray.shutdown()`` (a second ``init`` in the same process
then fails), and ``transfer_queue.close()`` from *any* process kills the shared controller.
Each adapter instance therefore owns its client and, if it created the store, the actor handles.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import threading
import time
import uuid
from collections.abc import Awaitable, Mapping, Sequence
from typing import Any, TypeVar

import ray
import torch
from tensordict import TensorDict

from nemo_dataplane.adapters import tq_compat as compat
from nemo_dataplane.adapters.actor_store import ActorBackedClient, Bootstrap
from nemo_dataplane.adapters.tq_claims import TransferQueueClaims
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
from nemo_dataplane.codec import is_jagged, make_batch
from nemo_dataplane.config import DataPlaneConfig, TransferQueueConfig, config_section
from nemo_dataplane.meta import KVBatchMeta

LAYOUT_TAG = compat.LAYOUT_TAG
DEFAULT_CONTROLLER = "TransferQueueController"  # TransferQueue's own names: tq.init() attaches
DEFAULT_NAMESPACE = "transfer_queue"

T = TypeVar("T")
# An op still pending after this long checks that the store's actors are alive (every second):
# a dead controller or storage unit fails the op within ~LIVENESS_EVERY_S + LIVENESS_PING_S,
# naming the actor, instead of running into op_timeout_s.
LIVENESS_EVERY_S = 1.0
LIVENESS_PING_S = 2.0


class StoreLostError(DataPlaneError):
    """A TransferQueue controller or storage unit this client depends on died; the store is gone."""


def auto_storage_units(free_cpus: float) -> int:
    """One storage unit per two free CPUs, at least 1 and at most 8.

    A unit serializes on one thread; half the CPUs stay with the processes that put and get.
    """
    return max(1, min(8, int(free_cpus) // 2))


class TransferQueueClient(TransferQueueClaims, ActorBackedClient):
    """:class:`DataPlaneClient` backed by a TransferQueue controller and SimpleStorage units.

    Args:
        config: the ``data_plane.transfer_queue`` section (or a whole ``DataPlaneConfig``).
        bootstrap: ``"auto"`` attaches to the named controller or creates it; ``True`` creates
            it (error if it exists); ``False`` only attaches (what worker actors use).
        controller_name / namespace: the Ray actor to attach to or create. Defaults are
            TransferQueue's own, so ``transfer_queue.init()`` elsewhere joins the same store.

    Only the client that created the controller (``owns_store``) shuts it and the storage units
    down on :meth:`close`; attached clients just disconnect. When this client had to start Ray
    itself, ``close`` also shuts Ray down.

    Raises:
        DataPlaneError: nothing to attach to (``bootstrap=False``), a controller already exists
            (``bootstrap=True``), or bootstrap could not finish within ``bootstrap_timeout_s``
            (the message says which resources were missing).
    """

    BACKEND = "transfer_queue"
    SECTION = "transfer_queue"
    NAME_KWARG = "controller_name"
    WHAT = "TransferQueue controller"

    def __init__(
        self,
        config: TransferQueueConfig | DataPlaneConfig | Mapping[str, Any] | None = None,
        bootstrap: Bootstrap = "auto",
        controller_name: str = DEFAULT_CONTROLLER,
        namespace: str = DEFAULT_NAMESPACE,
    ) -> None:
        self.cfg = _tq_config(config)
        self._controller: Any = None
        self._storage: dict[str, Any] = {}
        self._units: dict[str, Any] = {}
        self._local_units = False
        self._tq: Any = None
        self._claims_unsupported: str | None = None
        self._watched: list[tuple[str, Any]] = []  # (what, actor handle) checked while an op is slow
        self._lost: str | None = None  # set once a watched actor is found dead: every op fails at once
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        if self.cfg.quiet:
            compat.quiet_logs()
        with compat.preserve_torch_threads():
            self._open(bootstrap, controller_name, namespace, log_to_driver=not self.cfg.quiet)
        self._loop, self._thread = compat.loop_thread(f"nd-tq-{controller_name}")

    @property
    def controller_name(self) -> str:
        return self.actor_name

    def _connect(self, conf: Any) -> Any:
        """This client's view of the store ``conf`` describes: unit handles, placement, claims, client."""
        self.num_storage_units = compat.storage_units_of(conf)
        # Bulk reads need the units' actor handles; stores made by tq.init() have none we can
        # find, and are read through TransferQueue's per-row protocol instead.
        self._units = compat.unit_handles(conf, self.namespace)
        if self._units:
            here = ray.get_runtime_context().get_node_id()
            nodes = compat.unit_nodes(self._units, self.cfg.bootstrap_timeout_s)
            # Units all on this node map one shared chunk per put; else each gets its rows.
            self._local_units = all(node == here for node in nodes.values())
        self._claims_unsupported = compat.claims_unsupported(conf)
        controller = self._controller or self._find()
        self._watched = [(f"TransferQueue controller {self.controller_name!r}", controller)] + [
            (f"TransferQueue storage unit {uid!r}", h) for uid, h in self._units.items()
        ]
        self._tq = compat.make_client(conf, f"nd_{os.getpid()}_{uuid.uuid4().hex[:6]}")
        return conf

    # ------------------------------------------------------------- bootstrap
    def _attach(self, handle: Any) -> Any:
        deadline = time.monotonic() + self.cfg.bootstrap_timeout_s
        while True:
            left = deadline - time.monotonic()
            try:
                conf = ray.get(handle.get_config.remote(), timeout=max(left, 0.01))
            except ray.exceptions.GetTimeoutError:
                conf = None
            if conf is not None:
                return self._connect(conf)
            if time.monotonic() >= deadline:
                raise DataPlaneError(
                    f"TransferQueue controller {self.controller_name!r} (namespace {self.namespace!r}) exists "
                    f"but published no config within bootstrap_timeout_s={self.cfg.bootstrap_timeout_s}s; "
                    "is the process that creates it stuck or dead?"
                )
            time.sleep(0.2)

    def _create(self) -> Any:
        cfg = self.cfg
        free = float(ray.available_resources().get("CPU", 0.0))
        nodes = None
        if cfg.storage_placement == "per_node":
            # One unit per node (num_storage_units, if set, round-robin over them): rows a reader
            # finds on its own node's unit come through shared memory, the rest node to node.
            nodes = sorted(n["NodeID"] for n in ray.nodes() if n.get("Alive"))
        n_units = cfg.num_storage_units or (len(nodes) if nodes else auto_storage_units(free))
        need = cfg.controller_num_cpus + n_units * cfg.storage_unit_num_cpus
        what = (
            f"TransferQueue needs {need:g} CPUs for its controller ({cfg.controller_num_cpus:g}) and "
            f"{n_units} storage unit(s) ({cfg.storage_unit_num_cpus:g} each), cluster has {free:g} free"
        )
        hint = (
            "lower data_plane.transfer_queue.num_storage_units / storage_unit_num_cpus / "
            "controller_num_cpus, or give Ray more CPUs"
        )
        if need > free + 1e-9:
            raise DataPlaneError(f"{what}; {hint}")
        deadline = time.monotonic() + cfg.bootstrap_timeout_s

        def wait_info(handle: Any, who: str) -> Any:
            try:
                return compat.server_info(handle, max(deadline - time.monotonic(), 0.01), cfg.quiet)
            except ray.exceptions.GetTimeoutError:
                raise DataPlaneError(
                    f"TransferQueue bootstrap timed out after {cfg.bootstrap_timeout_s}s waiting for {who}; "
                    f"{what} (other actors may hold CPUs); {hint}"
                ) from None

        # Controller and units start at once: each is a fresh worker importing TransferQueue
        # (seconds each), and none needs another to construct.
        self._controller = compat.create_controller(
            self.controller_name, self.namespace, cfg.controller_num_cpus, cfg.quiet
        )
        self.owns_store = True
        conf = compat.base_config(n_units)
        self._storage = compat.create_storage_units(
            conf, self.controller_name, self.namespace, cfg.storage_unit_num_cpus, cfg.quiet, nodes
        )
        conf.controller.zmq_info = wait_info(self._controller, "the controller")
        conf.backend[compat.BACKEND].zmq_info = {
            name: wait_info(h, f"storage unit {name}") for name, h in self._storage.items()
        }
        ray.get(self._controller.store_config.remote(conf), timeout=max(deadline - time.monotonic(), 0.01))
        return self._connect(conf)

    # ------------------------------------------------------------- lifecycle
    def _teardown(self) -> None:
        """Kill what this client created (storage units, controller); never someone else's."""
        if not self.owns_store:
            self._storage, self._controller = {}, None
            return
        handles = list(self._storage.values())
        if handles and ray.is_initialized():
            try:
                ray.get([h.shutdown.remote() for h in handles], timeout=10)
            except Exception:  # noqa: BLE001 - best effort; killed below either way
                pass
        for h in [*handles, self._controller]:
            if h is not None and ray.is_initialized():
                try:
                    ray.kill(h)
                except Exception:  # noqa: BLE001
                    pass
        self._storage, self._controller = {}, None
        self.owns_store = False

    def _disconnect(self) -> None:
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
            if self._thread is not None:
                self._thread.join(timeout=5)
            if not self._loop.is_running():
                self._loop.close()
        if self._tq is not None:
            try:
                self._tq.close()
            except Exception:  # noqa: BLE001 - closing a dead connection must not raise
                pass

    def _check_open(self, coro: Any = None) -> None:
        """Raise if closed or the store was lost; ``coro`` (the op not run) is closed first."""
        if self._closed or self._lost is not None:
            if coro is not None and hasattr(coro, "close"):
                coro.close()
            if self._closed:
                raise DataPlaneError("TransferQueueClient is closed")
            raise StoreLostError(f"the TransferQueue store is gone: {self._lost}")

    async def _lost_actor(self) -> str | None:
        """The first watched actor found dead (``None``: all alive, or too busy to tell)."""
        if not self._watched:
            return None
        pings = {asyncio.wrap_future(h.__ray_ready__.remote().future()): what for what, h in self._watched if h}
        done, _ = await asyncio.wait(pings, timeout=LIVENESS_PING_S)
        for fut in done:
            err = fut.exception()
            if isinstance(err, ray.exceptions.RayActorError):
                return f"{pings[fut]} died or was lost ({type(err).__name__})"
        return None

    # ----------------------------------------------------------- op plumbing
    def _timeout_error(self, op: str, partition_id: str, n_keys: int, limit_s: float | None) -> TimeoutError:
        limit = f"op_timeout_s={self.cfg.op_timeout_s}s" if limit_s is None else f"{limit_s:g}s"
        return TimeoutError(
            f"TransferQueue {op} on partition {partition_id!r} ({n_keys} keys) did not finish within {limit}"
        )

    async def _bounded(self, op: str, partition_id: str, n_keys: int, coro: Awaitable[T], limit_s: float | None) -> T:
        """``coro`` within ``op_timeout_s`` (or ``limit_s``); while it is pending, every
        ``LIVENESS_EVERY_S`` the store's actors are checked, and a dead one fails the op at once.

        Raises:
            TimeoutError: the limit passed. StoreLostError: the controller or a storage unit died.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + (self.cfg.op_timeout_s if limit_s is None else limit_s)
        task = asyncio.ensure_future(coro)
        try:
            while True:
                left = deadline - loop.time()
                if left <= 0:
                    raise self._timeout_error(op, partition_id, n_keys, limit_s)
                done, _ = await asyncio.wait({task}, timeout=min(LIVENESS_EVERY_S, left))
                if done:
                    if isinstance(task.exception(), ray.exceptions.RayActorError):  # a call to a dead unit
                        err = task.exception()
                        lost = await self._lost_actor() or f"a TransferQueue actor died or was lost ({err})"
                        self._lost = lost
                        raise StoreLostError(
                            f"TransferQueue {op} on partition {partition_id!r} ({n_keys} keys) failed: {lost}"
                        ) from err
                    return task.result()
                lost = await self._lost_actor()
                if lost is not None:
                    self._lost = lost
                    raise StoreLostError(
                        f"TransferQueue {op} on partition {partition_id!r} ({n_keys} keys) cannot finish: {lost}"
                    )
        finally:
            if not task.done():
                task.cancel()

    def _run(self, op: str, partition_id: str, n_keys: int, coro: Awaitable[T], limit_s: float | None = None) -> T:
        """Run ``coro`` on the client's loop, bounded by ``op_timeout_s`` (or ``limit_s``)."""
        self._check_open(coro)
        assert self._loop is not None
        with compat.preserve_torch_threads():
            fut = asyncio.run_coroutine_threadsafe(self._bounded(op, partition_id, n_keys, coro, limit_s), self._loop)
            try:
                # The op bounds itself; the grace covers scheduling onto a busy loop.
                return fut.result(timeout=(self.cfg.op_timeout_s if limit_s is None else limit_s) + 5)
            except concurrent.futures.TimeoutError:
                fut.cancel()
                raise self._timeout_error(op, partition_id, n_keys, limit_s) from None

    async def _run_async(
        self, op: str, partition_id: str, n_keys: int, coro: Awaitable[T], limit_s: float | None = None
    ) -> T:
        self._check_open(coro)
        with compat.preserve_torch_threads():
            return await self._bounded(op, partition_id, n_keys, coro, limit_s)

    async def _retrieve(self, keys: list[str], partition_id: str, create: bool) -> Any:
        return await self._tq.async_kv_retrieve_meta(keys=keys, partition_id=partition_id, create=create)

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

    async def _put(
        self,
        keys: list[str],
        partition_id: str,
        columns: dict[str, torch.Tensor],
        tag_list: list[dict[str, Any]] | None,
    ) -> KVBatchMeta:
        if columns and self._local_units:
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
        layout = {name: ("jagged" if is_jagged(t) else "dense") for name, t in columns.items()}
        new_meta = []
        for i, cm in enumerate(bm.custom_meta):
            merged = dict(cm)
            if tag_list is not None:
                merged.update(tag_list[i])
            if layout:
                merged[LAYOUT_TAG] = {**cm.get(LAYOUT_TAG, {}), **layout}
            new_meta.append(merged)
        bm.custom_meta = new_meta
        try:
            # Rows and tags go to different actors and do not depend on each other: send both
            # at once (TransferQueue's own put does them one after the other).
            jobs = [compat.set_tags(self._tq, partition_id, bm.global_indexes, new_meta)]
            if columns:
                jagged = {k for k, v in layout.items() if v == "jagged"}
                jobs.append(compat.put_rows(self._tq, bm, columns, jagged, self._units, chunk))
            # Wait for both before judging: cleanup must not race a tag write still in flight.
            results = await asyncio.gather(*jobs, return_exceptions=True)
            for r in results:
                if isinstance(r, BaseException):
                    raise r
            if columns:
                # Only now, with tags stored, may a claimer see the rows as produced (quirk 10).
                await compat.mark_produced(self._tq, bm, results[1])
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
        known = _field_order(before_fields + [f for f in columns if f not in before_fields], new_meta[0])
        return KVBatchMeta(
            keys=keys,
            tags=[_public_tags(cm) for cm in new_meta],
            partition_id=partition_id,
            fields=known,
        )

    def kv_batch_put(
        self,
        keys: Sequence[str],
        partition_id: str,
        fields: Fields | None,
        tags: Sequence[Mapping[str, Any]] | None = None,
    ) -> KVBatchMeta:
        keys, pid, columns, tag_list = self._prepare_put(keys, partition_id, fields, tags)
        return self._run("kv_batch_put", pid, len(keys), self._put(keys, pid, columns, tag_list))

    async def async_kv_batch_put(
        self,
        keys: Sequence[str],
        partition_id: str,
        fields: Fields | None,
        tags: Sequence[Mapping[str, Any]] | None = None,
    ) -> KVBatchMeta:
        keys, pid, columns, tag_list = self._prepare_put(keys, partition_id, fields, tags)
        return await self._run_async("kv_batch_put", pid, len(keys), self._put(keys, pid, columns, tag_list))

    # ------------------------------------------------------------------- get
    async def _missing_keys(self, keys: list[str], partition_id: str, bm: Any) -> list[str]:
        if bm.size == 0:
            return keys
        present = set(await self._tq.async_kv_retrieve_keys(global_indexes=bm.global_indexes, partition_id=partition_id))
        return [k for k in keys if k not in present]

    async def _get(self, keys: list[str], partition_id: str, names: list[str]) -> TensorDict:
        if not keys:
            return TensorDict({}, batch_size=[0])
        bm = await self._retrieve(keys, partition_id, create=False)
        if bm.size != len(keys):
            missing = await self._missing_keys(keys, partition_id, bm)
            raise KeyError(f"{len(missing)} key(s) not in partition {partition_id!r}: {missing[:10]}")
        stored = set(bm.field_schema.keys())
        for name in names:
            if name not in stored:
                lacking = [k for k, cm in zip(keys, bm.custom_meta) if name not in cm.get(LAYOUT_TAG, {})]
                where = f"e.g. {lacking[:5]}" if lacking else "(some keys lack it)"
                raise KeyError(
                    f"field {name!r} is not stored for {len(lacking) or 'some'} key(s) in partition "
                    f"{partition_id!r}, {where}"
                )
        try:
            cols = await compat.read_columns(self._tq, self._units, bm, names) if self._units else None
            if cols is None:  # a store we cannot read in bulk: TransferQueue's per-row protocol
                rows = await compat.get_rows(self._tq, bm, names)
                cols = {}
                for name in names:
                    try:
                        cols[name] = compat.column_from_rows(rows[name])
                    except (TypeError, ValueError) as e:
                        raise type(e)(f"field {name!r}: {e}") from None
        except compat.StorageKeyNotFoundError as e:
            raise KeyError(f"keys of partition {partition_id!r} were cleared while being read: {e}") from None
        columns = {
            name: col if isinstance(col, torch.Tensor)  # already in the layout it was put with
            else _assemble(name, col, [cm.get(LAYOUT_TAG, {}).get(name) for cm in bm.custom_meta])
            for name, col in ((n, cols[n]) for n in names)
        }
        return make_batch(columns, len(keys))

    def kv_batch_get(
        self,
        meta_or_keys: KVBatchMeta | Sequence[str],
        select_fields: Sequence[str],
        partition_id: str | None = None,
    ) -> TensorDict:
        keys, pid = resolve_get_target(meta_or_keys, partition_id)
        names = check_select_fields(select_fields)
        return self._run("kv_batch_get", pid, len(keys), self._get(keys, pid, names))

    async def async_kv_batch_get(
        self,
        meta_or_keys: KVBatchMeta | Sequence[str],
        select_fields: Sequence[str],
        partition_id: str | None = None,
    ) -> TensorDict:
        keys, pid = resolve_get_target(meta_or_keys, partition_id)
        names = check_select_fields(select_fields)
        return await self._run_async("kv_batch_get", pid, len(keys), self._get(keys, pid, names))

    # ----------------------------------------------------------- clear / list
    async def _clear(self, keys: list[str] | None, partition_id: str) -> None:
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
        self._run("kv_clear", pid, -1 if key_list is None else len(key_list), self._clear(key_list, pid))

    async def async_kv_clear(self, keys: Sequence[str] | None, partition_id: str) -> None:
        pid = check_partition(partition_id)
        key_list = None if keys is None else check_keys(keys, allow_empty=True)
        await self._run_async("kv_clear", pid, -1 if key_list is None else len(key_list), self._clear(key_list, pid))

    async def _list(self, partition_id: str) -> KVBatchMeta:
        info = (await self._tq.async_kv_list(partition_id)).get(partition_id, {})
        keys = list(info.keys())
        fields: list[str] = []
        if keys:
            bm = await self._retrieve(keys, partition_id, create=False)
            fields = _field_order(list(bm.field_schema.keys()), info[keys[0]])
        return KVBatchMeta(
            keys=keys,
            tags=[_public_tags(info[k]) for k in keys],
            partition_id=partition_id,
            fields=fields,
        )

    def kv_list(self, partition_id: str) -> KVBatchMeta:
        pid = check_partition(partition_id)
        return self._run("kv_list", pid, 0, self._list(pid))

    async def async_kv_list(self, partition_id: str) -> KVBatchMeta:
        pid = check_partition(partition_id)
        return await self._run_async("kv_list", pid, 0, self._list(pid))


# ---------------------------------------------------------------- helpers
def _tq_config(config: Any) -> TransferQueueConfig:
    return TransferQueueConfig() if config is None else config_section(config, "transfer_queue", "config")


def _field_order(fields: list[str], first_key_meta: Mapping[str, Any]) -> list[str]:
    """``fields`` in the order they were first put on the first key (the reference client's
    order); fields without a layout entry (written by other clients) keep their place at the end."""
    layout = first_key_meta.get(LAYOUT_TAG, {})
    common = set(fields)
    return [f for f in layout if f in common] + [f for f in fields if f not in layout]


_public_tags = compat.public_tags


def _assemble(name: str, col: compat.Column, layouts: list[str | None]) -> torch.Tensor:
    """One field in the layout it was put with, from a :class:`~.tq_compat.Column` (no per-row ops).

    Raises:
        ValueError: dense rows of different shapes, or scalar rows asked to be jagged.
    """
    if any(lay == "jagged" for lay in layouts):
        jagged = True
    elif all(lay == "dense" for lay in layouts):
        jagged = False
    else:  # written by another TransferQueue client: TransferQueue's own rule (scalars dense)
        jagged = not (col.lengths is None and col.values.dim() == 1)
    if not jagged:
        if col.lengths is not None:
            raise ValueError(f"field {name!r}: rows have different shapes; put it as a jagged nested tensor")
        return col.values
    try:
        rag = col.ragged()
    except ValueError as e:
        raise ValueError(f"field {name!r}: {e}") from None
    assert rag.lengths is not None
    offsets = torch.zeros(rag.lengths.numel() + 1, dtype=torch.int64)
    torch.cumsum(rag.lengths, 0, out=offsets[1:])
    return torch.nested.nested_tensor_from_jagged(rag.values, offsets=offsets)
