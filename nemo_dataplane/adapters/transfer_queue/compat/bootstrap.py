"""Starting and finding a TransferQueue store: controller, storage units, placement, clients,
where they listen, who may talk to them, how fast they start, the controller's lock (quirks 1, 2,
8, 12, 13, 14, 15)."""

from __future__ import annotations

import inspect
import os
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any, cast

import psutil
import ray
from omegaconf import DictConfig, OmegaConf
from transfer_queue.client import AsyncTransferQueueClient
from transfer_queue.controller import TransferQueueController
from transfer_queue.storage import SimpleStorageUnit

from nemo_dataplane.adapters.transfer_queue.compat import hosted
from nemo_dataplane.adapters.transfer_queue.compat.claims import CLAIM_SAMPLER, WAIT_GROUP, WAIT_THREADS, ClaimSampler
from nemo_dataplane.adapters.transfer_queue.compat.common import BACKEND, quiet_logs
from nemo_dataplane.adapters.transfer_queue.compat.wire import (
    AuthenticatedStorageManager,
    WireKeys,
    authenticate_context,
    guard_stats,
    serve_authenticated,
)
from nemo_dataplane.adapters.transfer_queue.compat.writes import PRODUCED


def base_config(num_storage_units: int) -> DictConfig:
    """TransferQueue's default config with ``num_storage_units`` SimpleStorage units.

    The shape matches what ``tq.init()`` stores in the controller, so TransferQueue's own
    clients (``tq.init()`` in another process) can attach to a store we created.
    """
    conf = OmegaConf.create({}, flags={"allow_objects": True})
    # An installed package's files are on disk: files() gives a Path, which OmegaConf.load opens.
    defaults = OmegaConf.load(cast(Path, resources.files("transfer_queue") / "config.yaml"))
    conf = cast(DictConfig, OmegaConf.merge(conf, defaults))  # a mapping merged into a DictConfig
    conf.backend.storage_backend = BACKEND
    conf.backend[BACKEND].num_data_storage_units = int(num_storage_units)
    # What create_controller starts, recorded so attaching clients know claims work (quirk 8).
    conf.controller.sampler = CLAIM_SAMPLER
    conf.controller.polling_mode = True
    return conf


def _actor_options(quiet: bool) -> dict[str, Any]:
    """Quiet actors get no ``runtime_env``, so Ray can hand each an idle prestarted worker (an
    actor with one needs a fresh worker process, seconds on a loaded machine); their logs
    are muted from inside once they run (:func:`ask_server_info`, quirk 6). Verbose ones keep
    ``TQ_NUM_THREADS=1``, read at import: with TransferQueue's default 8 above the core count, a
    unit warns on every request (quirk 3)."""
    return {} if quiet else {"runtime_env": {"env_vars": {"TQ_NUM_THREADS": "1"}}}


def _listen_on(host: str | None, actor: Any) -> None:
    """Make ``actor``'s ``_init_zmq_socket`` bind ``host`` (quirk 12). Runs in the actor's own
    process, which exists only to serve this store, before the TransferQueue class binds anything.

    The name is replaced in the globals that very function reads: Ray ships a class that is not
    importable under its own name (TransferQueue's raw class hides behind its ``ray.remote``
    wrapper) by value, with a copy of its module's globals, and wraps its methods; so neither
    the module nor the wrapper's globals would do.
    """
    if host is None:
        return
    for cls in type(actor).__mro__:
        if "_init_zmq_socket" in vars(cls):
            inspect.unwrap(vars(cls)["_init_zmq_socket"]).__globals__["get_node_ip_address"] = lambda: host
            return
    raise TypeError(f"{type(actor).__name__} has no _init_zmq_socket: TransferQueue changed, quirk 12 needs a look")


# ray.remote turns TransferQueue's classes into ActorClasses; the class itself is
# ``__ray_actor_class__``. TransferQueue's annotations say neither.
_RawController: Any = TransferQueueController.__ray_actor_class__  # type: ignore[attr-defined]
if not callable(getattr(_RawController, "_handle_request", None)):
    # _Controller's lock (quirk 14) wraps it: without it, ops of .hosted would race the ZMQ thread.
    raise ImportError("TransferQueueController has no _handle_request: TransferQueue changed, quirk 14 needs a look")
_RawStorageUnit: Any = SimpleStorageUnit.__ray_actor_class__  # type: ignore[attr-defined]


class _Controller(_RawController):  # type: ignore[misc]  # TransferQueue's class is untyped
    """TransferQueue's controller, listening on ``listen_host`` (``None``: the node's address),
    admitting only clients holding ``wire``'s client key (quirk 15; ``None``: anyone, benchmarks
    only); with ``unit_config``, it also holds storage unit 0 in its process (``nd_unit``), which
    it then stands in for: what a unit's callers use (``storage_data``, ``shutdown``) is that unit's.

    Claims wait inside it (:func:`.claims.wait_claim`) on ``nd_produced``, a condition on
    ``nd_lock`` notified whenever rows become produced or consumption is reset, whoever asked
    (a ZMQ request, or an op of :mod:`.hosted`).
    """

    def __init__(
        self,
        *args: Any,
        listen_host: str | None = None,
        unit_config: dict[str, Any] | None = None,
        wire: WireKeys | None = None,
        **kwargs: Any,
    ) -> None:
        self.nd_constructed_at = time.time()  # its module is imported by now (ActorStart)
        # Held by every ZMQ request and every op of .hosted (quirk 14); before super() starts
        # the request thread.
        self.nd_lock = threading.RLock()
        self.nd_produced = threading.Condition(self.nd_lock)
        self.nd_claims = {"waiting": 0, "scans": 0}  # claims waiting now, scans made (.claims)
        self.nd_cancelled: dict[str, float] = {}  # claims whose callers gave up -> until when to keep the note
        self.nd_wire = wire  # handed to clients that attach (through Ray: ask_config)
        _listen_on(listen_host, self)
        serve_authenticated(self, wire)
        super().__init__(*args, **kwargs)
        if wire is not None:
            # Its own connections to the units (TransferQueue's metrics exporter) carry the keys.
            authenticate_context(self.zmq_context, wire)
        self.nd_unit = (
            None if unit_config is None else _StorageUnit(config=unit_config, listen_host=listen_host, wire=wire)
        )

    # The one-request ops of .hosted as methods: a method call costs ~0.5 ms less than the same
    # function through ``__ray_call__`` (measured on 2 shared cores: 1.1-1.4 against 1.7-2.1 ms).
    def nd_put(self, *args: Any) -> hosted.PutDone:
        return hosted.put(self, *args)

    def nd_locate(self, *args: Any) -> hosted.Located:
        return hosted.locate_rows(self, *args)

    def nd_clear(self, *args: Any) -> None:
        hosted.clear(self, *args)

    def _handle_request(self, request_msg: Any, monitor: Any) -> Any:
        with self.nd_lock:
            return super()._handle_request(request_msg, monitor)

    def update_production_status(self, *args: Any, **kwargs: Any) -> Any:
        with self.nd_lock:
            done = super().update_production_status(*args, **kwargs)
            self.nd_produced.notify_all()
            return done

    def _handle_set_custom_meta_request(self, request_msg: Any) -> Any:
        """TransferQueue's SET_CUSTOM_META, then, when the body carries a production notice
        (``writes.set_tags``), the NOTIFY_DATA_UPDATE work: tags before production (quirk 10),
        one request. Runs on the request thread under ``nd_lock``."""
        reply = super()._handle_set_custom_meta_request(request_msg)
        notice = request_msg.body.get(PRODUCED)
        if notice and not self.update_production_status(**notice):
            raise RuntimeError(f"TransferQueue could not record production in partition {notice['partition_id']!r}")
        return reply

    def reset_consumption(self, *args: Any, **kwargs: Any) -> Any:
        with self.nd_lock:
            done = super().reset_consumption(*args, **kwargs)
            self.nd_produced.notify_all()
            return done

    @property
    def storage_data(self) -> Any:
        if self.nd_unit is None:
            raise AttributeError("this TransferQueue controller holds no storage unit")
        return self.nd_unit.storage_data

    def shutdown(self) -> None:
        if self.nd_unit is not None:
            self.nd_unit.shutdown()


class _NoSleep:
    """The ``time`` module as TransferQueue's storage unit sees it while it constructs (quirk 13):
    ``sleep`` returns at once, everything else is ``time``'s."""

    @staticmethod
    def sleep(seconds: float) -> None:
        del seconds

    def __getattr__(self, name: str) -> Any:
        return getattr(time, name)


class _StorageUnit(_RawStorageUnit):  # type: ignore[misc]  # as above
    """TransferQueue's storage unit, listening on ``listen_host`` (``None``: the node's address),
    admitting only clients holding ``wire``'s client key (quirk 15), constructed without its
    fixed 0.5 s wait (quirk 13)."""

    def __init__(self, *args: Any, listen_host: str | None = None, wire: WireKeys | None = None, **kwargs: Any) -> None:
        self.nd_constructed_at = time.time()  # its module is imported by now (ActorStart)
        _listen_on(listen_host, self)
        serve_authenticated(self, wire)
        # The wait lets the worker thread connect before the proxy thread forwards; the backend
        # is a DEALER, whose send blocks until a peer connects, so nothing is lost without it.
        # The globals the very function reads (as in _listen_on), in this actor's process only.
        found = [c for c in type(self).__mro__ if "_start_process_put_get" in vars(c)]
        if not found:
            raise TypeError("SimpleStorageUnit has no _start_process_put_get: TransferQueue changed, quirk 13")
        names = inspect.unwrap(vars(found[0])["_start_process_put_get"]).__globals__
        real, names["time"] = names.get("time", time), _NoSleep()
        try:
            super().__init__(*args, **kwargs)
        finally:
            names["time"] = real


# Claims wait on threads of their own (.claims.ask_claim), so a waiting claim never holds up the
# Ray calls every other op makes (.hosted).
_ControllerActor: Any = ray.remote(concurrency_groups={WAIT_GROUP: WAIT_THREADS})(_Controller)  # type: ignore[call-overload]  # ray.remote's stubs lack it
_StorageUnitActor: Any = ray.remote(_StorageUnit)


def unit_config(conf: DictConfig) -> dict[str, Any]:
    """What every storage unit of ``conf``'s store is constructed with."""
    # A DictConfig node converts to a dict.
    out = dict(cast("dict[str, Any]", OmegaConf.to_container(conf.backend[BACKEND], resolve=True)))
    out["_run_id"] = os.urandom(8).hex()
    return out


def _on_node(node_id: str | None) -> dict[str, Any]:
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return {} if node_id is None else {"scheduling_strategy": NodeAffinitySchedulingStrategy(node_id, soft=False)}


def create_controller(
    name: str,
    namespace: str,
    num_cpus: float,
    quiet: bool,
    listen_host: str | None = None,
    hosted_unit: dict[str, Any] | None = None,
    node_id: str | None = None,
    wire: WireKeys | None = None,
) -> Any:
    """Start the named controller actor with ``num_cpus`` (TQ hard-codes 1, quirk 1), in polling
    mode with :class:`ClaimSampler` (quirk 8), its sockets bound to ``listen_host`` (``None``:
    the node's address; quirk 12) and admitting only ``wire``'s clients (quirk 15), on
    ``node_id`` if given. With ``hosted_unit`` (a :func:`unit_config`) it also holds storage
    unit 0: one process, one import of TransferQueue and torch, instead of two. Pass ``quiet``
    again to :func:`ask_server_info`."""
    return _ControllerActor.options(
        name=name,
        namespace=namespace,
        num_cpus=num_cpus,
        **_actor_options(quiet),
        **_on_node(node_id),
    ).remote(
        sampler=ClaimSampler(),  # type: ignore[no-untyped-call]  # TQ's sampler __init__
        polling_mode=True,
        listen_host=listen_host,
        unit_config=hosted_unit,
        wire=wire,
    )


def create_storage_units(
    unit_conf: dict[str, Any],
    name_prefix: str,
    namespace: str,
    num_cpus: float,
    quiet: bool,
    node_ids: Sequence[str] | None = None,
    listen_host: str | None = None,
    first: int = 0,
    wire: WireKeys | None = None,
) -> dict[str, Any]:
    """Start the store's SimpleStorage units ``first`` and on (``unit_conf``:
    :func:`unit_config`) with fractional CPUs; returns ``{name: handle}``.

    With ``node_ids``, unit ``i`` is pinned to node ``node_ids[i % len(node_ids)]``. Their
    sockets bind ``listen_host`` (``None``: their node's address; quirk 12) and admit only
    ``wire``'s clients (quirk 15). Pass ``quiet`` again to :func:`ask_server_info`.
    """
    handles: dict[str, Any] = {}
    for rank in range(first, int(unit_conf["num_data_storage_units"])):
        name = f"{name_prefix}.StorageUnit#{rank}"
        handles[name] = _StorageUnitActor.options(
            name=name,
            namespace=namespace,
            num_cpus=num_cpus,
            **_actor_options(quiet),
            **_on_node(node_ids[rank % len(node_ids)] if node_ids else None),
        ).remote(config=unit_conf, listen_host=listen_host, wire=wire)
    return handles


@dataclass(frozen=True)
class ActorStart:
    """How an actor we started came up, as its own process saw it (wall-clock epochs, since
    the driver's ``perf_counter`` is not comparable across processes)."""

    born: float  # when its worker process started (before the actor was asked for: prestarted)
    constructing: float  # when its constructor began: its class (TransferQueue, torch) was imported
    up: float  # when it first answered: constructed
    cpu_s: float  # CPU seconds its process had used by then (Ray's own start included)

    def phases(self, asked: float) -> dict[str, float]:
        """Seconds from ``asked`` (the epoch its creation was submitted) to a worker process
        (0 for a prestarted one), from then to its constructor (importing its class) and on to
        its first answer (constructing), plus its CPU seconds: wall well above CPU means it
        waited for a core."""
        process = max(asked, self.born)
        return {
            "process_s": process - asked,
            "import_s": self.constructing - process,
            "construct_s": self.up - self.constructing,
            "cpu_s": self.cpu_s,
        }


def ask_server_info(handle: Any, quiet: bool, unit: bool = False) -> Any:
    """Ask an actor we started for its ZMQ endpoints (a ref for :func:`server_info`): with
    ``unit``, those of the storage unit it is or holds. It answers as soon as it is constructed,
    so asking every actor at once times each one's own start. A ``quiet`` one first mutes
    TransferQueue's loggers in its process."""
    return handle.__ray_call__.remote(_started, quiet, unit)


def server_info(ref: Any, timeout_s: float) -> tuple[Any, ActorStart]:
    """The endpoints :func:`ask_server_info` asked for, and how the actor came up. Raises
    ``ray.exceptions.GetTimeoutError`` after ``timeout_s``."""
    info, start = ray.get(ref, timeout=timeout_s)
    return info, ActorStart(*start)


def _started(actor: Any, quiet: bool, unit: bool) -> tuple[Any, tuple[float, float, float, float]]:
    """Runs inside a controller or storage unit (``__ray_call__``)."""
    if quiet:
        quiet_logs()
    serves = actor.nd_unit if unit and getattr(actor, "nd_unit", None) is not None else actor
    me = psutil.Process()
    cpu = me.cpu_times()
    stamps = (me.create_time(), actor.nd_constructed_at, time.time(), cpu.user + cpu.system)
    return serves.get_zmq_server_info(), stamps


def storage_units_of(conf: DictConfig) -> int:
    return int(conf.backend[BACKEND].num_data_storage_units)


def make_client(conf: DictConfig, client_id: str, wire: WireKeys | None) -> AsyncTransferQueueClient:
    """A client of our own (quirk 2): not ``interface._TQ_CLIENT``, so no stale globals; every
    socket it opens carries ``wire``'s client keys (quirk 15; ``None``: a store without them)."""
    client = AsyncTransferQueueClient(client_id=client_id, controller_info=conf.controller.zmq_info)
    if wire is None:
        client.initialize_storage_manager(manager_type=BACKEND, config=conf.backend[BACKEND])
        return client
    # Its pools open their sockets on first use: none exists yet.
    authenticate_context(client.zmq_context, wire)
    client.storage_manager = AuthenticatedStorageManager(
        conf.controller.zmq_info, conf.backend[BACKEND], zmq_context=client.zmq_context, keys=wire
    )
    return client


def ask_config(handle: Any) -> Any:
    """Ask a controller for its store's config (``None`` until published) and wire keys
    (``None``: a store without them, e.g. one made by ``tq.init()``): a ref for ``ray.get``.
    Only through Ray, whose callers can run code in the controller anyway (its token)."""
    return handle.__ray_call__.remote(_config_and_keys)


def _config_and_keys(actor: Any) -> tuple[Any, WireKeys | None]:
    return actor.get_config(), getattr(actor, "nd_wire", None)


def ask_wire_stats(handle: Any) -> Any:
    """Ask a store's actor for its process's handshake counts (:func:`.wire.guard_stats`): a ref."""
    return handle.__ray_call__.remote(guard_stats)


def unit_handles(conf: DictConfig, namespace: str) -> dict[str, Any]:
    """Storage-unit id -> actor handle for stores whose units are named actors in ``namespace``
    (ours are); empty when they cannot all be found (e.g. a store made by ``tq.init()``)."""
    out: dict[str, Any] = {}
    for name, info in dict(conf.backend[BACKEND].zmq_info).items():
        try:
            out[info.id] = ray.get_actor(name, namespace=namespace)
        except ValueError:
            return {}
    return out


def unit_nodes(units: Mapping[str, Any], timeout_s: float) -> dict[str, str]:
    """Unit id -> the Ray node it runs on."""
    ids = list(units)
    nodes = ray.get([units[u].__ray_call__.remote(_node_of) for u in ids], timeout=timeout_s)
    return dict(zip(ids, nodes))


def _node_of(actor: Any) -> str:
    return ray.get_runtime_context().get_node_id()
