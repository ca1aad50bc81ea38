"""A process group that lives outside ``torch.distributed``'s global state.

Trainer and generator processes each already run their own ``torch.distributed`` world (or
none); a refit group joins ranks of both without touching either. Ranks meet through a
``TCPStore`` hosted by rank 0 and build their communicator from it:

* ``backend="nccl"``: rank 0 creates an NCCL unique id with nccl4py and publishes it in the
  store; every rank builds an ``nccl.core.Communicator`` on its CUDA device.
* ``backend="gloo"``: a ``ProcessGroupGloo`` built directly on a prefixed view of the store
  (no ``init_process_group``), for CPU-only machines and CI.

Every key lives under ``spg/<group_name>/`` so several groups can share one store, and any
number of groups can live in one process. Every host-side wait is bounded by ``timeout``.

Rank 0's store listens on ``host`` only (loopback stays loopback, see
:func:`~nemo_dataplane.distributed.auth.host_tcp_store`); with a job secret every record is
authenticated (:class:`~nemo_dataplane.distributed.auth.AuthStore`) and bound to this instance
of the group (:func:`~nemo_dataplane.distributed.auth.bind_instance`, agreed at the
rendezvous), see ``docs/reliability.md`` ("Trust boundary").

Size: one class, ~600 lines, on purpose. Its bootstrap, collectives and bounded waits share one
state machine (usable, broken, aborted, destroyed) that every op checks and every failure sets;
the pieces that need none of it already live apart (``work.py``: work handles and wire dtypes;
``auth.py``: the store and its records).
"""

from __future__ import annotations

import contextlib
import datetime
import socket
import threading
import time
import warnings
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Literal, overload

import torch
import torch.distributed as dist

from nemo_dataplane.distributed.abort import posted_abort
from nemo_dataplane.distributed.auth import (
    AuthStore,
    StoreAuthError,
    authenticated,
    bind_instance,
    host_tcp_store,
    is_loopback,
    job_secret,
)
from nemo_dataplane.distributed.loopback import gloo_options, pin_collectives_to_loopback
from nemo_dataplane.distributed.work import (
    _EVENT_POLL_MAX_S,
    _NATIVE_DTYPES,
    StatelessGroupError,
    StatelessGroupTimeout,
    Work,
    _import_nccl,
    _try,
    call_with_deadline,
    start_daemon,
    wire_view,
)
from nemo_dataplane.timeouts import check_timeout

__all__ = [
    "StatelessGroupError",
    "StatelessGroupTimeout",
    "StatelessProcessGroup",
    "Work",
    "wire_view",
]

DEFAULT_TIMEOUT_S = 300.0

# Polling cadence for store keys and CUDA events: start tight so fast paths stay fast, back
# off so long waits do not hammer the store server.
_POLL_MIN_S = 0.0002
_POLL_MAX_S = 0.02
# CUDA event queries are cheap and their latency is on the refit's critical path: spin (yielding
# the GIL) for the first _EVENT_SPIN_S of a wait, then sleep at most _EVENT_POLL_MAX_S (work.py).
_EVENT_SPIN_S = 0.05
# Watch callbacks cost a store round trip; run them at most this often.
_WATCH_EVERY_S = 0.1
# How long an NCCL abort may block before a daemon thread carries it on (it can wait on a kernel).
_ABORT_JOIN_S = 10.0
# The same for a broken gloo group's release: nothing waits for it, a healthy one ends at once.
_RELEASE_JOIN_S = 0.5


class StatelessProcessGroup:
    """A communicator among ``world_size`` processes, independent of ``torch.distributed``'s world.

    Contract:
      * Construction is collective: it returns on every rank only once all ranks have joined,
        the communicator is built and a warm-up broadcast from rank 0 checked out; otherwise
        it raises ``StatelessGroupError`` naming the ranks that never arrived.
      * ``gloo``: operations block the host (bounded) unless ``async_op=True``.
        ``nccl``: operations are enqueued on ``stream`` (default: the current stream of
        ``device``) and are ordered with later work on that stream, like NCCL itself; use
        ``synchronize()`` or the returned ``Work`` to wait on the host (bounded).
      * dtypes a backend cannot carry (float8 variants, ...) travel as a ``uint8`` view of the
        same bytes for ``broadcast``/``send``/``recv``; reductions on them are refused.
      * After a timeout or a peer failure the group is broken; further calls raise.

    Args:
        host: address of the rendezvous store (rank 0 listens there).
        port: its TCP port.
        rank: this process's rank in the group, ``0 <= rank < world_size``.
        world_size: number of processes in the group.
        backend: ``"nccl"`` (GPU, via nccl4py) or ``"gloo"`` (CPU).
        timeout: seconds every wait may take, rendezvous included.
        device: CUDA device for ``nccl`` (default: the current device); ignored for gloo.
        group_name: key prefix inside the store; distinct groups sharing one store need
            distinct names.
        store: an existing ``torch.distributed.Store`` to use instead of creating a TCPStore
            at ``host:port``.
        nccl_config: fields of ``nccl.core.NCCLConfig`` (e.g. ``{"min_ctas": 32}``) for the
            communicator; ignored for gloo.
        secret: the job's secret (default: ``$NEMO_DATAPLANE_SECRET``). With one, every record
            this group (gloo's rendezvous and barriers included) writes or reads is
            HMAC-authenticated and bound to this group instance: a forged record, or one
            replayed from another store or group instance, raises ``StoreAuthError`` naming its
            key; every rank needs the same one.
            Without one, records are unauthenticated: accepted silently when ``host`` is a
            loopback address (only this host can reach the store), with a
            ``StoreSecurityWarning`` otherwise.
    """

    def __init__(
        self,
        host: str,
        port: int,
        rank: int,
        world_size: int,
        backend: str = "gloo",
        timeout: float = DEFAULT_TIMEOUT_S,
        *,
        device: torch.device | int | str | None = None,
        group_name: str = "default",
        store: dist.Store | None = None,
        nccl_config: dict[str, Any] | None = None,
        secret: bytes | str | None = None,
    ) -> None:
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
        if backend not in ("nccl", "gloo"):
            raise ValueError(f"backend must be 'nccl' or 'gloo', got {backend!r}")
        timeout = check_timeout(timeout, "timeout", allow_zero=False)
        self.host = host
        self.port = int(port)
        self.rank = rank
        self.world_size = world_size
        self.backend = backend
        self.timeout = float(timeout)
        self.group_name = group_name
        self.prefix = f"spg/{group_name}"
        self._broken = False
        self._destroyed = False
        self._barrier_count = 0
        self._nccl: Any = None
        self._comm: Any = None
        self._pg: Any = None
        self._in_coalesce = False
        self._nccl_config = dict(nccl_config or {})

        if backend == "nccl":
            # Import first: a missing extra should fail before any peer is kept waiting on us.
            self._nccl = _import_nccl()
            if not torch.cuda.is_available():
                raise self._error(StatelessGroupError, "backend='nccl' needs a CUDA device, none is visible")
            dev = torch.device("cuda", device) if isinstance(device, int) else torch.device(device or "cuda")
            if dev.type != "cuda":
                raise ValueError(f"backend='nccl' needs a CUDA device, got {dev}")
            self.device = dev if dev.index is not None else torch.device("cuda", torch.cuda.current_device())
        else:
            self.device = torch.device("cpu")

        t0 = time.monotonic()
        self._loopback = is_loopback(host)
        self._owns_store = store is None
        self.store: dist.Store = authenticated(
            store if store is not None else self._connect_store(),
            job_secret(secret),
            where=f"StatelessProcessGroup {group_name!r} at {self.store_address}",
            loopback=self._loopback,
        )
        self._rendezvous()
        if backend == "nccl":
            self._init_nccl()
        else:
            self._init_gloo()
        self._warm_up()
        self.init_seconds = time.monotonic() - t0

    # ------------------------------------------------------------------ setup

    @property
    def store_address(self) -> str:
        return f"{self.host}:{self.port}"

    def _where(self) -> str:
        return (
            f"rank {self.rank} of world size {self.world_size}, group {self.group_name!r}, store {self.store_address}"
        )

    def _error(self, cls: type[StatelessGroupError], msg: str) -> StatelessGroupError:
        return cls(f"[{self._where()}] {msg}")

    def _connect_store(self) -> dist.Store:
        td = datetime.timedelta(seconds=self.timeout)
        if self.rank == 0:
            try:
                return host_tcp_store(self.host, self.port, self.world_size, td)
            except Exception as e:
                raise self._error(StatelessGroupError, f"rank 0 could not host the rendezvous store: {e}") from e
        try:
            # TCPStore's own connect retries overshoot its timeout severalfold; probe the port
            # ourselves so "rank 0 never arrived" is reported on time.
            self._await_port(time.monotonic() + self.timeout)
            return dist.TCPStore(self.host, self.port, self.world_size, False, timeout=td)
        except Exception as e:
            raise self._error(
                StatelessGroupTimeout,
                f"could not reach the rendezvous store within {self.timeout:g}s; "
                f"rank 0 (which hosts it) never arrived: missing ranks [0] ({e})",
            ) from e

    def _await_port(self, deadline: float) -> None:
        sleep = _POLL_MIN_S
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"nothing listens on {self.store_address}")
            try:
                socket.create_connection((self.host, self.port), timeout=min(1.0, remaining)).close()
                return
            except OSError:
                time.sleep(min(sleep, max(remaining, 0)))
                sleep = min(sleep * 2, 0.05)

    def _key(self, *parts: object) -> str:
        return "/".join([self.prefix, *(str(p) for p in parts)])

    def _rendezvous(self) -> None:
        # ``add`` rather than ``set``: a second process claiming the same rank is caught here
        # instead of corrupting the communicator later.
        if self.store.add(self._key("arrived", self.rank), 1) != 1:
            raise self._error(StatelessGroupError, f"rank {self.rank} joined twice: another process already claimed it")
        if isinstance(self.store, AuthStore):
            # Every rank publishes its instance nonce on arrival, so waiting for them all is the
            # rendezvous; from here on every record is bound to this group instance.
            self.store = bind_instance(
                self.store,
                self.prefix,
                self.rank,
                self.world_size,
                lambda keys: self.wait_for_ranks(keys.__getitem__, range(self.world_size), "rendezvous"),
            )
        else:
            self.wait_for_ranks(lambda r: self._key("arrived", r), range(self.world_size), "rendezvous")

    def _init_gloo(self) -> None:
        prefixed = dist.PrefixStore(self._key("gloo"), self.store)
        td = datetime.timedelta(seconds=self.timeout)

        def build() -> Any:
            if self._loopback:
                # Every rank is on this host: gloo listens on loopback, whatever GLOO_SOCKET_IFNAME
                # or the hostname would pick (docs/reliability.md, "Trust boundary").
                return dist.ProcessGroupGloo(prefixed, self.rank, self.world_size, gloo_options(self.host, td))
            return dist.ProcessGroupGloo(prefixed, self.rank, self.world_size, td)

        # gloo waits in C++ for every peer's address until its own timeout; waiting for it here
        # instead sees an abort posted meanwhile (abort.py). A thread left behind ends at gloo's
        # timeout, a daemon that never holds up the interpreter's exit.
        done, box = start_daemon(build, f"spg-gloo-{self.group_name}")
        self._poll(done.is_set, "gloo group construction", timeout=self.timeout + 5.0, max_sleep=0.01)
        if "error" in box:
            raise self._error(StatelessGroupError, f"gloo group construction failed: {box['error']}") from box["error"]
        self._pg = box["result"]

    def _init_nccl(self) -> None:
        nccl = self._nccl
        uid_key = self._key("nccl_unique_id")
        if self._loopback:
            # NCCL's bootstrap listens on NCCL_SOCKET_IFNAME's interface (read at the process's
            # first communicator); every rank is on this host, so that is loopback.
            pin_collectives_to_loopback()
        if self.rank == 0:
            self.store.set(uid_key, nccl.get_unique_id().as_bytes)
        else:
            self.wait_for_ranks(lambda r: uid_key, [0], "NCCL unique id from rank 0")
        uid = nccl.UniqueId.from_bytes(self.store.get(uid_key))

        def _build() -> Any:
            # NCCL binds the communicator to the device current at init time.
            config = nccl.NCCLConfig(**self._nccl_config) if self._nccl_config else None
            with torch.cuda.device(self.device):
                return nccl.Communicator.init(self.world_size, self.rank, uid, config)

        # ncclCommInitRank blocks until every rank joins and has no timeout of its own; run it
        # on a daemon thread so a rank dying after the store rendezvous cannot hang us forever,
        # nor (a pool thread would be joined at exit) keep the interpreter from exiting.
        try:
            self._comm = call_with_deadline(_build, self.timeout, f"spg-init-{self.group_name}")
        except TimeoutError as e:
            self._broken = True
            raise self._error(
                StatelessGroupTimeout,
                f"NCCL communicator init did not finish within {self.timeout:g}s although every rank reached the store",
            ) from e
        except Exception as e:
            raise self._error(StatelessGroupError, f"NCCL communicator init failed: {e}") from e

    def _warm_up(self) -> None:
        # A value rank 0 alone knows: seeing it everywhere proves data really moved.
        expected = 1000 + self.world_size
        t = torch.full((4,), expected if self.rank == 0 else -1, dtype=torch.int32, device=self.device)
        self.broadcast(t, src=0)
        self.synchronize()
        got = t.tolist()
        if got != [expected] * 4:
            raise self._error(
                StatelessGroupError,
                f"warm-up broadcast from rank 0 returned {got}, expected {[expected] * 4}; "
                "the communicator is not usable",
            )

    # ------------------------------------------------------------------ waiting

    def _mark_broken(self) -> None:
        self._broken = True

    def _check_usable(self, op: str) -> None:
        if self._destroyed:
            raise self._error(StatelessGroupError, f"{op} on a destroyed group")
        if self._broken:
            raise self._error(StatelessGroupError, f"{op} on a broken group (an earlier operation timed out or failed)")

    def _poll(
        self,
        done: Callable[[], bool],
        what: str,
        *,
        timeout: float | None = None,
        watch: Callable[[], str | None] | None = None,
        abort_on_timeout: bool = False,
        detail: Callable[[], str] | None = None,
        max_sleep: float = _POLL_MAX_S,
        spin_s: float = 0.0,
    ) -> None:
        # Every per-call wait (barrier, wait_for_ranks, ...) ends here: a NaN would never expire.
        timeout = self.timeout if timeout is None else check_timeout(timeout, "timeout")
        start = time.monotonic()
        spin_until = start + spin_s
        deadline = start + timeout
        next_watch = start + _WATCH_EVERY_S
        sleep = _POLL_MIN_S
        while True:
            try:
                if done():
                    return
                now = time.monotonic()
                # A member's death seen from outside (abort.py): stop now, not at the deadline.
                aborted = posted_abort(self.store, self.prefix) if now >= next_watch else None
            except dist.DistError as e:
                # The store host (rank 0) is gone, usually because it gave up first.
                self._broken = True
                extra = f"; {detail()}" if detail is not None else ""
                raise self._error(
                    StatelessGroupError, f"{what}: lost the rendezvous store hosted by rank 0 ({e}){extra}"
                ) from e
            if aborted is not None:
                self._broken = True
                if abort_on_timeout:
                    self._abort()
                raise self._error(StatelessGroupError, f"{what} stopped: the group was aborted: {aborted}")
            if watch is not None and now >= next_watch:
                msg = watch()
                if msg:
                    if abort_on_timeout:
                        self._abort()
                    raise self._error(StatelessGroupError, f"{what} stopped: {msg}")
            if now >= next_watch:
                next_watch = now + _WATCH_EVERY_S
            if now >= deadline:
                if abort_on_timeout:
                    self._abort()
                extra = f"; {detail()}" if detail is not None else ""
                raise self._error(StatelessGroupTimeout, f"{what} did not finish within {timeout:g}s{extra}")
            if now < spin_until:
                time.sleep(0)
                continue
            time.sleep(sleep)
            sleep = min(sleep * 2, max_sleep)

    def wait_for_ranks(
        self,
        key_of: Callable[[int], str],
        ranks: Iterable[int],
        what: str,
        *,
        timeout: float | None = None,
        watch: Callable[[], str | None] | None = None,
        verify: Callable[[int], None] | None = None,
    ) -> None:
        """Wait until ``key_of(r)`` exists in the store for every rank ``r`` in ``ranks``.

        ``verify(r)``, if given, runs once ``r``'s key exists (in the same poll, so no extra
        round trips follow the last arrival) and raises to refuse it. On timeout raises
        ``StatelessGroupTimeout`` listing the ranks whose key never appeared.
        """
        pending = sorted(set(ranks))

        def arrived(present: list[int]) -> None:
            nonlocal pending
            for r in present:
                if verify is not None:
                    verify(r)
            pending = [r for r in pending if r not in present]

        def done() -> bool:
            if pending and self.store.check([key_of(r) for r in pending]):
                arrived(pending)
            elif len(pending) > 1:
                arrived([r for r in pending if self.store.check([key_of(r)])])
            return not pending

        self._poll(done, what, timeout=timeout, watch=watch, detail=lambda: f"missing ranks {pending} never arrived")

    def _abort(self) -> None:
        self._broken = True
        if self._comm is not None:
            comm, self._comm = self._comm, None
            # ncclCommAbort can itself block while a kernel waits on a dead peer; never let it
            # turn a bounded wait into a hang: give it a few seconds on a daemon thread.
            t = threading.Thread(target=_try, args=(comm.abort,), name=f"spg-abort-{self.group_name}", daemon=True)
            t.start()
            t.join(timeout=min(_ABORT_JOIN_S, self.timeout))
        if self._pg is not None and hasattr(self._pg, "abort"):
            with contextlib.suppress(Exception):
                self._pg.abort()

    def _stream_handle(self, stream: torch.cuda.Stream | None) -> int:
        s = torch.cuda.current_stream(self.device) if stream is None else stream
        return int(s.cuda_stream)

    def synchronize(
        self,
        stream: torch.cuda.Stream | None = None,
        *,
        watch: Callable[[], str | None] | None = None,
        what: str = "synchronize",
    ) -> None:
        """Block the host until work enqueued so far on ``stream`` finished (nccl); no-op for gloo.

        Bounded by the group's timeout: on expiry the NCCL communicator is aborted (which frees
        the GPU from a collective whose peer is gone) and ``StatelessGroupTimeout`` is raised.
        """
        if self.backend != "nccl":
            return
        self._check_usable(what)
        s = torch.cuda.current_stream(self.device) if stream is None else stream
        ev = torch.cuda.Event()  # type: ignore[no-untyped-call]  # torch.cuda.Event is unannotated
        ev.record(s)
        self._poll(
            ev.query, what, watch=watch, abort_on_timeout=True, max_sleep=_EVENT_POLL_MAX_S, spin_s=_EVENT_SPIN_S
        )

    # ------------------------------------------------------------------ operations

    def _issue(
        self,
        what: str,
        async_op: bool,
        stream: torch.cuda.Stream | None,
        gloo_work: Any = None,
        wait_only: bool = False,
    ) -> Work | None:
        if self.backend == "gloo":
            w = Work(self, what, gloo_work=gloo_work, wait_only=wait_only)
            if async_op:
                return w
            w.wait()
            return None
        if not async_op:
            return None
        if self._in_coalesce:
            raise ValueError("async_op=True is not supported inside coalesce(); synchronize the stream instead")
        ev = torch.cuda.Event()  # type: ignore[no-untyped-call]  # torch.cuda.Event is unannotated
        ev.record(torch.cuda.current_stream(self.device) if stream is None else stream)
        return Work(self, what, event=ev)

    @overload
    def broadcast(
        self, tensor: torch.Tensor, src: int, stream: torch.cuda.Stream | None = None, *, async_op: Literal[True]
    ) -> Work: ...
    @overload
    def broadcast(
        self, tensor: torch.Tensor, src: int, stream: torch.cuda.Stream | None = None, async_op: bool = False
    ) -> Work | None: ...
    def broadcast(
        self, tensor: torch.Tensor, src: int, stream: torch.cuda.Stream | None = None, async_op: bool = False
    ) -> Work | None:
        """Broadcast ``tensor`` from rank ``src`` into ``tensor`` on every rank (in place)."""
        self._check_usable("broadcast")
        self._check_peer(src, "src")
        wire = wire_view(tensor.detach(), self.backend)
        what = f"broadcast of {wire.numel()} x {wire.dtype} from rank {src}"
        if self.backend == "nccl":
            self._comm.broadcast(wire, wire, src, stream=self._stream_handle(stream))
            return self._issue(what, async_op, stream)
        return self._issue(what, async_op, None, self._pg.broadcast(wire, src))

    @overload
    def all_reduce(
        self, tensor: torch.Tensor, op: str = "sum", stream: torch.cuda.Stream | None = None, *, async_op: Literal[True]
    ) -> Work: ...
    @overload
    def all_reduce(
        self, tensor: torch.Tensor, op: str = "sum", stream: torch.cuda.Stream | None = None, async_op: bool = False
    ) -> Work | None: ...
    def all_reduce(
        self, tensor: torch.Tensor, op: str = "sum", stream: torch.cuda.Stream | None = None, async_op: bool = False
    ) -> Work | None:
        """Reduce ``tensor`` across ranks in place; ``op`` in sum/prod/max/min (nccl also avg)."""
        self._check_usable("all_reduce")
        if tensor.dtype not in _NATIVE_DTYPES[self.backend] or tensor.dtype == torch.bool:
            raise TypeError(f"all_reduce cannot reduce {tensor.dtype} on {self.backend}; its bytes are not numbers")
        wire = wire_view(tensor.detach(), self.backend)
        what = f"all_reduce({op}) of {wire.numel()} x {wire.dtype}"
        if self.backend == "nccl":
            nccl = self._nccl
            ops = {"sum": nccl.SUM, "prod": nccl.PROD, "max": nccl.MAX, "min": nccl.MIN, "avg": nccl.AVG}
            if op not in ops:
                raise ValueError(f"unknown reduce op {op!r}; one of {sorted(ops)}")
            self._comm.allreduce(wire, wire, ops[op], stream=self._stream_handle(stream))
            return self._issue(what, async_op, stream)
        ops_g = {
            "sum": dist.ReduceOp.SUM,
            "prod": dist.ReduceOp.PRODUCT,
            "max": dist.ReduceOp.MAX,
            "min": dist.ReduceOp.MIN,
        }
        if op not in ops_g:
            raise ValueError(f"unknown reduce op {op!r} for gloo; one of {sorted(ops_g)}")
        opts = dist.AllreduceOptions()
        opts.reduceOp = ops_g[op]  # type: ignore[assignment]  # torch's stub: ReduceOp.SUM etc. are RedOpType
        return self._issue(what, async_op, None, self._pg.allreduce([wire], opts))

    @overload
    def send(
        self, tensor: torch.Tensor, dst: int, stream: torch.cuda.Stream | None = None, *, async_op: Literal[True]
    ) -> Work: ...
    @overload
    def send(
        self, tensor: torch.Tensor, dst: int, stream: torch.cuda.Stream | None = None, async_op: bool = False
    ) -> Work | None: ...
    def send(
        self, tensor: torch.Tensor, dst: int, stream: torch.cuda.Stream | None = None, async_op: bool = False
    ) -> Work | None:
        """Send ``tensor`` to rank ``dst`` (matched by a ``recv`` there)."""
        self._check_usable("send")
        self._check_peer(dst, "dst", not_self=True)
        wire = wire_view(tensor.detach(), self.backend)
        what = f"send of {wire.numel()} x {wire.dtype} to rank {dst}"
        if self.backend == "nccl":
            self._comm.send(wire, dst, stream=self._stream_handle(stream))
            return self._issue(what, async_op, stream)
        return self._issue(what, async_op, None, self._pg.send([wire], dst, 0), wait_only=True)

    @overload
    def recv(
        self, tensor: torch.Tensor, src: int, stream: torch.cuda.Stream | None = None, *, async_op: Literal[True]
    ) -> Work: ...
    @overload
    def recv(
        self, tensor: torch.Tensor, src: int, stream: torch.cuda.Stream | None = None, async_op: bool = False
    ) -> Work | None: ...
    def recv(
        self, tensor: torch.Tensor, src: int, stream: torch.cuda.Stream | None = None, async_op: bool = False
    ) -> Work | None:
        """Receive into ``tensor`` from rank ``src``."""
        self._check_usable("recv")
        self._check_peer(src, "src", not_self=True)
        wire = wire_view(tensor.detach(), self.backend)
        what = f"recv of {wire.numel()} x {wire.dtype} from rank {src}"
        if self.backend == "nccl":
            self._comm.recv(wire, src, stream=self._stream_handle(stream))
            return self._issue(what, async_op, stream)
        return self._issue(what, async_op, None, self._pg.recv([wire], src, 0), wait_only=True)

    @contextlib.contextmanager
    def coalesce(self) -> Iterator[None]:
        """Group the NCCL operations issued inside into one launch (no-op for gloo)."""
        if self.backend != "nccl":
            yield
            return
        self._in_coalesce = True
        self._nccl.group_start()
        try:
            yield
        finally:
            self._in_coalesce = False
            self._nccl.group_end()

    def barrier(self, *, timeout: float | None = None) -> None:
        """Wait until every rank reached this barrier; on timeout name the ranks that did not.

        On nccl, first waits (bounded) for this rank's current stream so that a barrier also
        orders device work, then meets through the store. With a job secret a rank counts as
        arrived only once its arrival record authenticates: a forged one, or one replayed from
        another group instance, raises ``StoreAuthError`` naming its key (and breaks the group).
        Rank 0, when it hosts the store, returns only after every rank has seen the barrier
        complete, so it may ``destroy()`` (and stop the store) right after.
        """
        if timeout is not None:
            check_timeout(timeout, "timeout")  # before the barrier's key is posted
        self._check_usable("barrier")
        self.synchronize(what="barrier (device work before it)")
        n = self._barrier_count
        self._barrier_count += 1
        key_of: Callable[[int], str] = lambda r: self._key("barrier", n, r)  # noqa: E731
        self.store.set(key_of(self.rank), b"1")  # type: ignore[arg-type]  # torch's stub: str only

        def verify(r: int) -> None:
            # A key's presence proves nothing: any process reaching the store can create one.
            # Reading the record makes AuthStore check its tag.
            if r == self.rank:
                return
            try:
                self.store.get(key_of(r))
            except StoreAuthError as e:
                self._broken = True
                raise StoreAuthError(f"[{self._where()}] barrier #{n}, arrival of rank {r}: {e}") from e

        self.wait_for_ranks(key_of, range(self.world_size), f"barrier #{n}", timeout=timeout, verify=verify)
        # The rank hosting the store leaves last: a destroy() right after the barrier would
        # otherwise take the store from under peers that have not yet polled the last arrival.
        left_key = self._key("barrier", n, "left")
        left = self.store.add(left_key, 1)
        if self._owns_store and self.rank == 0 and left < self.world_size:
            self._poll(
                lambda: self.store.add(left_key, 0) >= self.world_size,
                f"barrier #{n} (waiting for every rank to leave it)",
                timeout=timeout,
            )
        # Every rank in barrier n has left barrier n-1, so barrier n-2's keys are unobserved.
        if n >= 2:
            with contextlib.suppress(Exception):
                self.store.delete_key(self._key("barrier", n - 2, self.rank))
                if self.rank == 0:
                    self.store.delete_key(self._key("barrier", n - 2, "left"))

    def _check_peer(self, r: int, name: str, not_self: bool = False) -> None:
        if not 0 <= r < self.world_size:
            raise ValueError(f"{name}={r} is not a rank of a group of world size {self.world_size}")
        if not_self and r == self.rank:
            raise ValueError(f"{name}={r} is this rank itself")

    def destroy(self, *, abort: bool = False) -> None:
        """Release the communicator (and the store, if this rank hosts it). Idempotent; never raises.

        nccl: a healthy communicator is destroyed (which, per NCCL, all ranks on a node should
        do together); a broken one, or any with ``abort`` (a member is known lost, e.g. the
        group is being re-formed without it), is aborted so destroy cannot hang on a dead peer.

        Every part is released even when an earlier one fails (destroy runs on shutdown and
        error paths, where raising would hide the first error); each failure is then reported
        as one ``RuntimeWarning`` naming the group, this rank and what failed.
        """
        if self._destroyed:
            return
        self._destroyed = True
        failed: list[str] = []
        if self._comm is not None:
            comm, self._comm = self._comm, None
            how = "abort" if self._broken or abort else "destroy"
            try:
                getattr(comm, how)()
            except Exception as e:  # noqa: BLE001 - reported below, after the rest is released
                failed.append(f"communicator {how}: {type(e).__name__}: {e}")
        if self._pg is not None:
            pg, self._pg = self._pg, None
            if self._broken or abort:
                # gloo's release (its destructor joins its worker threads) waits for work pending on
                # a peer that is gone, until gloo's own timeout: the last reference is dropped on a
                # daemon thread, which carries the wait on if it outlasts a few seconds.
                box = [pg]
                del pg

                def release() -> None:
                    if hasattr(box[0], "shutdown"):
                        _try(box[0].shutdown)
                    box.clear()

                t = threading.Thread(target=release, name=f"spg-release-{self.group_name}", daemon=True)
                t.start()
                t.join(timeout=_RELEASE_JOIN_S)
            elif hasattr(pg, "shutdown"):
                try:
                    pg.shutdown()
                except Exception as e:  # noqa: BLE001 - reported below
                    failed.append(f"process group shutdown: {type(e).__name__}: {e}")
        if self._owns_store:
            # Released with the group; a destroyed group is not used again (store is typed for its life).
            self.store = None  # type: ignore[assignment]
        if failed:
            warnings.warn(
                f"[{self._where()}] destroy released the group, but {'; '.join(failed)}",
                RuntimeWarning,
                stacklevel=2,
            )

    def __enter__(self) -> StatelessProcessGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.destroy()

    def __repr__(self) -> str:
        state = "destroyed" if self._destroyed else "broken" if self._broken else "ok"
        return f"StatelessProcessGroup({self.backend}, {self._where()}, device={self.device}, {state})"
