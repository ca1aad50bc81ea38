"""The TransferQueue store's actors as one client sees them: bootstrap (create or attach to the
controller and storage units), lifecycle (teardown of what this client created, disconnect) and
the op plumbing every data op runs through (a private event loop, ``op_timeout_s`` on each op,
and a liveness watch that turns a dead controller or storage unit into :class:`StoreLostError`
within seconds), and who may talk to the store (its wire keys, :func:`admit_transfer_queue_clients`).
The data ops themselves (put/get/clear/list) are
:class:`~nemo_dataplane.adapters.transfer_queue.client.TransferQueueClient`'s; every TransferQueue
quirk worked around lives in :mod:`.compat`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import time
import uuid
from collections.abc import Awaitable
from typing import Any, TypeVar

import ray

from nemo_dataplane.adapters.actor_store import ActorBackedClient
from nemo_dataplane.adapters.steps import OpEnded, Steps, SyncDriver
from nemo_dataplane.adapters.transfer_queue import compat
from nemo_dataplane.client import DataPlaneError
from nemo_dataplane.distributed.auth import new_job_secret

T = TypeVar("T")
# An op still pending after this long checks that the store's actors are alive (every second):
# a dead controller or storage unit fails the op within ~LIVENESS_EVERY_S + LIVENESS_PING_S,
# naming the actor, instead of running into op_timeout_s.
LIVENESS_EVERY_S = 1.0
LOOPBACK_HOST = "127.0.0.1"
LIVENESS_PING_S = 2.0


def new_store_keys(secret: bytes | None, plain: bool = False) -> compat.WireKeys | None:
    """The wire keys of a store a client creates: derived from ``secret``, else from a fresh one;
    ``None`` (the store takes any client) only with ``plain``, which benchmarks alone set."""
    return None if plain else compat.wire_keys(secret or new_job_secret().encode())


def admit_transfer_queue_clients(
    controller_name: str = "TransferQueueController", namespace: str = "transfer_queue", timeout_s: float = 60.0
) -> None:
    """Let TransferQueue's own API in this process (``tq.init()``, ``kv_*``) use the store whose
    controller is ``controller_name``: its wire keys (compat quirk 15), asked from the controller
    through Ray, go on every socket TransferQueue opens here from now on. Call it before
    ``tq.init()``, only in a process meant to use TransferQueue's API directly (it patches
    TransferQueue in this process). A store without keys (made by ``tq.init()``) needs nothing.

    Raises:
        DataPlaneError: no such controller, or it did not answer within ``timeout_s``.
    """
    try:
        handle = ray.get_actor(controller_name, namespace=namespace)
        _, keys = ray.get(compat.ask_config(handle), timeout=timeout_s)
    except (ValueError, ray.exceptions.GetTimeoutError, ray.exceptions.RayActorError) as e:
        raise DataPlaneError(
            f"cannot get the wire keys of TransferQueue controller {controller_name!r} (namespace {namespace!r}): {e}"
        ) from e
    if keys is not None:
        compat.admit_transfer_queue_clients(keys)


class StoreLostError(DataPlaneError):
    """A TransferQueue controller or storage unit this client depends on died; the store is gone."""


def auto_storage_units(free_cpus: float) -> int:
    """One storage unit per two free CPUs, at least 1 and at most 8.

    A unit serializes on one thread; half the CPUs stay with the processes that put and get.
    """
    return max(1, min(8, int(free_cpus) // 2))


class TransferQueueStore(ActorBackedClient):
    """Bootstrap, lifecycle and bounded op plumbing of :class:`TransferQueueClient` (its base;
    the attributes are set by that class's ``__init__``)."""

    cfg: Any
    _controller: Any
    _storage: dict[str, Any]
    _units: dict[str, Any]
    _hosted: Any  # the controller, when it holds the store's only unit; else None
    _control: Any  # the controller's actor handle (created or found), once connected
    _ours: bool  # the controller is compat's subclass (a store this adapter started)
    _local_units: bool
    _tq: Any
    _claims_unsupported: str | None
    _watched: list[tuple[str, Any]]
    _lost: str | None
    _secret: bytes | None  # what a store this client creates derives its wire keys from
    _plain_wire: bool  # benchmarks only: a store this client creates takes any client
    _wire: compat.WireKeys | None  # the store's; None: it takes any client
    _loop: asyncio.AbstractEventLoop | None
    _thread: Any
    # Where bringing the store up went (seconds; set by a client that created it, else empty):
    # per actor kind, process_s (waiting for a worker process; 0 for a prestarted one),
    # import_s (importing TransferQueue and torch), construct_s (to its first answer), cpu_s (its
    # process's CPU time by then); actors_up_s (submit to all answering), config_connect_s (config, this client).
    startup_phases: dict[str, float]

    @property
    def controller_name(self) -> str:
        return self.actor_name

    def _connect(self, conf: Any) -> Any:
        """This client's view of the store ``conf`` describes: unit handles, placement, claims,
        client (with the store's wire keys, ``self._wire``)."""
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
        # Only compat's controller records the claim sampler; it also takes tags and production
        # in one request (compat quirk 10).
        self._ours = self._claims_unsupported is None
        controller = self._control = self._controller or self._find()
        # A unit the controller holds (registered under the controller's name) dies with it: one
        # watch, named for both.
        hosted = [
            info.id
            for name, info in dict(conf.backend[compat.BACKEND].zmq_info).items()
            if name == self.controller_name
        ]
        # Its only unit in the controller's process: each op is one request to it (quirk 14).
        self._hosted = controller if hosted and self.num_storage_units == 1 and self._units else None
        also = f" (and its storage unit {hosted[0]!r})" if hosted else ""
        self._watched = [(f"TransferQueue controller {self.controller_name!r}{also}", controller)] + [
            (f"TransferQueue storage unit {uid!r}", h) for uid, h in self._units.items() if uid not in hosted
        ]
        self._tq = compat.make_client(conf, f"nd_{os.getpid()}_{uuid.uuid4().hex[:6]}", self._wire)
        return conf

    # ------------------------------------------------------------- bootstrap
    def _attach(self, handle: Any) -> Any:
        deadline = time.monotonic() + self.cfg.bootstrap_timeout_s
        while True:
            left = deadline - time.monotonic()
            try:
                conf, self._wire = ray.get(compat.ask_config(handle), timeout=max(left, 0.01))
            except ray.exceptions.GetTimeoutError:
                conf = None
            except ray.exceptions.RayActorError as e:
                raise StoreLostError(
                    f"TransferQueue controller {self.controller_name!r} died or was lost while attaching "
                    f"({type(e).__name__})"
                ) from e
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
        free = float(ray.available_resources().get("CPU", 0.0))  # type: ignore[no-untyped-call]  # ray: unannotated
        nodes = None
        alive = sorted(n["NodeID"] for n in ray.nodes() if n.get("Alive"))  # type: ignore[no-untyped-call]  # ray
        if cfg.storage_placement == "per_node":
            # One unit per node (num_storage_units, if set, round-robin over them): rows a reader
            # finds on its own node's unit come through shared memory, the rest node to node.
            nodes = alive
        # TransferQueue decodes what reaches its ports with pickle: a one-node cluster's store
        # listens on loopback only (compat quirk 12; docs/reliability.md, "Trust boundary").
        loopback = cfg.listen == "loopback" or (cfg.listen == "auto" and len(alive) == 1)
        listen_host = LOOPBACK_HOST if loopback else None
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

        def wait_info(ref: Any, who: str) -> tuple[Any, compat.ActorStart]:
            try:
                return compat.server_info(ref, max(deadline - time.monotonic(), 0.01))
            except ray.exceptions.GetTimeoutError:
                raise DataPlaneError(
                    f"TransferQueue bootstrap timed out after {cfg.bootstrap_timeout_s}s waiting for {who}; "
                    f"{what} (other actors may hold CPUs); {hint}"
                ) from None
            except ray.exceptions.RayActorError as e:
                raise StoreLostError(f"TransferQueue bootstrap: {who} died or was lost ({type(e).__name__})") from e

        # Controller and units start at once: each is a worker process importing TransferQueue
        # (torch, tensordict: seconds each), and none needs another to construct. With one unit
        # the controller holds it (one process, one import: the store is up sooner and costs
        # one process less; docs/data-flow.md, "Start-up").
        hosted = n_units == 1 if cfg.unit_in_controller is None else cfg.unit_in_controller
        # Only clients holding the store's keys reach its sockets (compat quirk 15); clients
        # that attach ask the controller for them through Ray.
        self._wire = new_store_keys(self._secret, self._plain_wire)
        conf = compat.base_config(n_units)
        unit_conf = compat.unit_config(conf)
        asked, t0 = time.time(), time.perf_counter()
        self._controller = compat.create_controller(
            self.controller_name,
            self.namespace,
            cfg.controller_num_cpus + (cfg.storage_unit_num_cpus if hosted else 0.0),
            cfg.quiet,
            listen_host,
            hosted_unit=unit_conf if hosted else None,
            node_id=nodes[0] if hosted and nodes else None,
            wire=self._wire,
        )
        self.owns_store = True
        # The controller stands in for the unit it holds: found under the controller's name.
        self._storage = {self.controller_name: self._controller} if hosted else {}
        self._storage.update(
            compat.create_storage_units(
                unit_conf,
                self.controller_name,
                self.namespace,
                cfg.storage_unit_num_cpus,
                cfg.quiet,
                nodes,
                listen_host,
                first=1 if hosted else 0,
                wire=self._wire,
            )
        )
        asks = {name: compat.ask_server_info(h, cfg.quiet, unit=True) for name, h in self._storage.items()}
        conf.controller.zmq_info, started = wait_info(
            compat.ask_server_info(self._controller, cfg.quiet), "the controller"
        )
        phases = {f"controller_{k}": v for k, v in started.phases(asked).items()}
        units = {name: wait_info(ref, f"storage unit {name}") for name, ref in asks.items()}
        conf.backend[compat.BACKEND].zmq_info = {name: info for name, (info, _) in units.items()}
        # The slowest unit: the store is up when the last one is.
        slowest = max((s for _, s in units.values()), key=lambda s: s.up)
        phases.update({f"units_{k}": v for k, v in slowest.phases(asked).items()})
        t1 = time.perf_counter()
        phases["actors_up_s"] = t1 - t0
        try:
            ray.get(self._controller.store_config.remote(conf), timeout=max(deadline - time.monotonic(), 0.01))
        except ray.exceptions.RayActorError as e:
            lost = f"the controller died or was lost ({type(e).__name__})"
            raise StoreLostError(f"TransferQueue bootstrap: {lost}") from e
        out = self._connect(conf)
        phases["config_connect_s"] = time.perf_counter() - t1
        self.startup_phases = phases
        return out

    def wire_stats(self) -> dict[str, Any]:
        """The store's handshakes as its actors counted them (compat quirk 15): ``admitted`` per
        endpoint (``tcp://host:port``), ``refused`` per endpoint and reason (``mechanism``: a
        client without CURVE; ``protocol``: another store's server key; ``client_key``: a key
        the store does not admit; ``no_detail``), and ``zap_admitted``/``zap_refused`` (peers that
        proved a client key, right or wrong). Empty counts for a store without wire keys."""
        # The unit a controller holds answers through the controller: one process, one count.
        actors = [self._controller or self._find(), *self._units.values()]
        handles = {h._actor_id: h for h in actors if h is not None}
        out: dict[str, Any] = {"admitted": {}, "refused": {}, "zap_admitted": 0, "zap_refused": 0}
        for stats in ray.get([compat.ask_wire_stats(h) for h in handles.values()], timeout=self.cfg.op_timeout_s):
            if stats is None:
                continue
            for endpoint, n in stats["admitted"].items():
                out["admitted"][endpoint] = out["admitted"].get(endpoint, 0) + n
            for endpoint, why in stats["refused"].items():
                into = out["refused"].setdefault(endpoint, {})
                for reason, n in why.items():
                    into[reason] = into.get(reason, 0) + n
            out["zap_admitted"] += stats["zap_admitted"]
            out["zap_refused"] += stats["zap_refused"]
        return out

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

    def _lost_actor_now(self) -> str | None:
        """The first watched actor found dead (``None``: all alive, or too busy to tell); blocks
        up to ``LIVENESS_PING_S``."""
        pings = {h.__ray_ready__.remote(): what for what, h in self._watched if h}
        if not pings:
            return None
        done, _ = ray.wait(list(pings), num_returns=len(pings), timeout=LIVENESS_PING_S)
        for ref in done:
            try:
                ray.get(ref)
            except ray.exceptions.RayActorError as err:
                return f"{pings[ref]} died or was lost ({type(err).__name__})"
        return None

    async def _lost_actor(self) -> str | None:
        return await asyncio.to_thread(self._lost_actor_now) if self._watched else None

    # ----------------------------------------------------------- op plumbing
    def _timeout_error(self, op: str, partition_id: str, n_keys: int, limit_s: float | None) -> TimeoutError:
        limit = f"op_timeout_s={self.cfg.op_timeout_s}s" if limit_s is None else f"{limit_s:g}s"
        return TimeoutError(
            f"TransferQueue {op} on partition {partition_id!r} ({n_keys} keys) did not finish within {limit}"
        )

    def _store_lost(
        self, op: str, partition_id: str, n_keys: int, why: str, err: BaseException | None = None
    ) -> StoreLostError:
        """Record the store as lost and the error naming the op it ended: ``err`` (a call to a
        dead actor) failed it, else a liveness check found ``why`` while it was pending."""
        self._lost = why if err is None else why or f"a TransferQueue actor died or was lost ({err})"
        what = f"TransferQueue {op} on partition {partition_id!r} ({n_keys} keys)"
        lost = StoreLostError(f"{what} {'cannot finish' if err is None else 'failed'}: {self._lost}")
        lost.__cause__ = err
        return lost

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
                    err = task.exception()
                    if isinstance(err, ray.exceptions.RayActorError):  # a call to a dead unit
                        raise self._store_lost(op, partition_id, n_keys, await self._lost_actor() or "", err)
                    return task.result()
                dead = await self._lost_actor()
                if dead is not None:
                    raise self._store_lost(op, partition_id, n_keys, dead)
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

    def _run_steps(self, op: str, partition_id: str, n_keys: int, steps: Steps[T], limit_s: float | None = None) -> T:
        """Run the op body ``steps`` in the calling thread (:class:`~..steps.SyncDriver`): its
        Ray waits are ``ray.get`` here, only its awaitables go to the client's loop; bounded
        like :meth:`_run` (one deadline for the whole op, the same liveness watch)."""
        self._check_open(steps)
        deadline = time.monotonic() + (self.cfg.op_timeout_s if limit_s is None else limit_s)

        def wait_refs(refs: Any) -> Any:
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise OpEnded(self._timeout_error(op, partition_id, n_keys, limit_s))
                try:
                    return ray.get(refs, timeout=min(LIVENESS_EVERY_S, left))
                except ray.exceptions.GetTimeoutError:
                    dead = self._lost_actor_now()
                    if dead is not None:
                        raise OpEnded(self._store_lost(op, partition_id, n_keys, dead)) from None
                except ray.exceptions.RayActorError as err:  # a call to a dead controller or unit
                    lost = self._store_lost(op, partition_id, n_keys, self._lost_actor_now() or "", err)
                    raise OpEnded(lost) from None

        def run_awaitable(awaitable: Awaitable[Any]) -> Any:
            try:
                return self._run(op, partition_id, n_keys, awaitable, max(deadline - time.monotonic(), 1e-3))
            except StoreLostError as e:
                raise OpEnded(e) from None
            except TimeoutError as e:
                if time.monotonic() < deadline:  # the body's own, not the op's bound
                    raise
                raise OpEnded(self._timeout_error(op, partition_id, n_keys, limit_s)) from e

        with compat.preserve_torch_threads():
            return SyncDriver(wait_refs, run_awaitable)(steps)

    async def _run_async(
        self, op: str, partition_id: str, n_keys: int, coro: Awaitable[T], limit_s: float | None = None
    ) -> T:
        self._check_open(coro)
        with compat.preserve_torch_threads():
            return await self._bounded(op, partition_id, n_keys, coro, limit_s)

    async def _retrieve(self, keys: list[str], partition_id: str, create: bool) -> Any:
        return await self._tq.async_kv_retrieve_meta(keys=keys, partition_id=partition_id, create=create)
