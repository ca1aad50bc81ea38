"""The authenticated wire: ZMQ CURVE on every socket of a store we start (quirk 15).

TransferQueue's controller and storage units decode every frame that reaches their ROUTER
sockets with ``pickle``, and accept a connection from anyone. Here:

* :func:`wire_keys` derives one CURVE key pair for the servers and one for the clients from a
  secret (HMAC-SHA256 under a fixed label, one per role; any 32 bytes are a Curve25519 secret).
* :func:`serve_authenticated` runs in a controller's or storage unit's own process before
  TransferQueue builds its sockets: every ROUTER it makes becomes a CURVE server with the
  servers' secret key, whose connections a ZAP handler (:class:`Guard`, one thread per process)
  admits only when they prove the clients' key. ``ZAP_ENFORCE_DOMAIN`` makes a missing handler
  a refusal. So no frame of a peer without the client key is ever delivered to the socket, let
  alone decoded: a plain client fails at the ZMTP greeting (mechanism mismatch), one with the
  wrong server key at its first CURVE box, one with the right server key but another client key
  at the ZAP check. The guard also counts every handshake, per endpoint (:func:`guard_stats`).
* Clients: :func:`authenticate_context` sets the client keys as a context's defaults (every
  socket TransferQueue's client and storage manager open on it later carries them), and
  :class:`AuthenticatedStorageManager` does the storage manager's start-up handshake with the
  controller on a socket that carries them too (TransferQueue opens that one on a private
  context inside its constructor).
* :func:`admit_transfer_queue_clients`: for a process that uses TransferQueue's own API
  (``tq.init()``) against one of our stores; it patches TransferQueue in that process, so only
  such a process calls it, on purpose.
"""

from __future__ import annotations

import hashlib
import hmac
import inspect
import itertools
import queue
import threading
import uuid
from dataclasses import dataclass, field
from typing import Any

import zmq
from transfer_queue.storage.managers.simple_storage_manager import AsyncSimpleStorageManager
from transfer_queue.utils.zmq_utils import create_zmq_socket
from zmq.utils import z85
from zmq.utils.monitor import parse_monitor_message

# Labels of the two derived keys (domain separation from every other use of the secret).
_LABEL = b"nemo-dataplane/transfer-queue-wire/1\0"
ZAP_DOMAIN = b"nemo-dataplane"
_ZAP_ENDPOINT = "inproc://zeromq.zap.01"  # libzmq's fixed ZAP address, one per context
_HANDSHAKE_EVENTS = (
    zmq.EVENT_HANDSHAKE_SUCCEEDED
    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)
_POLL_MS = 100  # how soon the guard adopts sockets registered while it waits


@dataclass(frozen=True, repr=False)
class WireKeys:
    """A store's CURVE keys (Z85). Its repr shows only the servers' public key."""

    server_public: bytes
    server_secret: bytes
    client_public: bytes
    client_secret: bytes

    def __repr__(self) -> str:
        return f"WireKeys(server_public={self.server_public.decode()!r})"


def wire_keys(secret: bytes) -> WireKeys:
    """The store keys derived from ``secret`` (non-empty): the same secret, the same keys."""
    if not secret:
        raise ValueError("the wire keys need a non-empty secret")

    def pair(role: bytes) -> tuple[bytes, bytes]:
        sk = z85.encode(hmac.new(secret, _LABEL + role, hashlib.sha256).digest())
        return zmq.curve_public(sk), sk

    (sp, ss), (cp, cs) = pair(b"server"), pair(b"client")
    return WireKeys(server_public=sp, server_secret=ss, client_public=cp, client_secret=cs)


def _client_options(keys: WireKeys) -> list[tuple[int, bytes]]:
    return [
        (zmq.CURVE_SERVERKEY, keys.server_public),
        (zmq.CURVE_PUBLICKEY, keys.client_public),
        (zmq.CURVE_SECRETKEY, keys.client_secret),
    ]


def authenticate_context(ctx: zmq.Context[Any], keys: WireKeys) -> None:
    """Make every socket ``ctx`` opens from now on a CURVE client holding ``keys`` (pyzmq
    applies a context's default options to each new socket; sockets already open keep theirs)."""
    for opt, value in _client_options(keys):
        ctx.setsockopt(opt, value)


class AuthenticatedStorageManager(AsyncSimpleStorageManager):
    """TransferQueue's SimpleStorage manager whose start-up handshake with the controller carries
    the client keys; every other socket it opens is on the (authenticated) context it is given."""

    def __init__(self, controller_info: Any, config: Any, *, zmq_context: Any, keys: WireKeys) -> None:
        self.nd_keys = keys  # read by _connect_to_controller, which the base constructor calls
        super().__init__(controller_info, config, zmq_context=zmq_context)

    def _connect_to_controller(self) -> None:
        ctx: zmq.Context[Any] = zmq.Context()
        authenticate_context(ctx, self.nd_keys)
        try:
            self.controller_handshake_socket = create_zmq_socket(
                ctx=ctx,
                socket_type=zmq.DEALER,
                ip=self.controller_info.ip,
                identity=f"{self.storage_manager_id}-controller_handshake_socket-{uuid.uuid4().hex[:8]}".encode(),
            )
            self._do_handshake_with_controller()
        finally:
            sock, self.controller_handshake_socket = self.controller_handshake_socket, None
            if sock is not None and not sock.closed:
                sock.close(linger=0)
            ctx.term()


def _refusal(event: int, value: int) -> str:
    """Why a handshake failed, from its monitor event."""
    if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
        return "client_key"  # a CURVE peer whose key the ZAP handler refused
    if event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
        # No CURVE at all (a plain client), else a box that does not open (another server key).
        return "mechanism" if value == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH else "protocol"
    return "no_detail"  # e.g. the peer hung up mid-handshake


@dataclass
class _Counts:
    admitted: dict[str, int] = field(default_factory=dict)  # endpoint -> handshakes that succeeded
    refused: dict[str, dict[str, int]] = field(default_factory=dict)  # endpoint -> why -> handshakes
    zap_admitted: int = 0
    zap_refused: int = 0


class Guard:
    """This process's ZAP handler and handshake counter: one daemon thread serving the ZAP
    socket of every context that holds a protected server socket, and reading every such
    socket's monitor. Sockets are made (and bound) by :meth:`protect` in the caller's thread and
    handed over through a queue; a context being terminated has its guard sockets closed at once,
    so ``term()`` never waits on them."""

    def __init__(self, client_public: bytes) -> None:
        self.client_key = z85.decode(client_public)
        self._zap: dict[int, zmq.Socket[Any]] = {}  # id(ctx) -> its ZAP socket (made in protect)
        self._handoff: queue.SimpleQueue[tuple[str, zmq.Socket[Any]]] = queue.SimpleQueue()
        self._counts = _Counts()
        self._lock = threading.Lock()
        self._made = threading.Lock()
        self._monitors = itertools.count()
        self._thread = threading.Thread(target=self._run, name="nd-wire-guard", daemon=True)
        self._thread.start()

    def protect(self, ctx: zmq.Context[Any], sock: zmq.Socket[Any]) -> None:
        """Make ``sock`` (a ROUTER not yet bound) a CURVE server with ``server_secret`` whose
        peers must present the client key; counted from its first handshake."""
        with self._made:
            if id(ctx) not in self._zap:
                zap = ctx.socket(zmq.REP)
                zap.bind(_ZAP_ENDPOINT)  # before any server socket of ctx can take a connection
                self._zap[id(ctx)] = zap
                self._handoff.put(("zap", zap))
            monitor = f"inproc://nd-wire-monitor-{next(self._monitors)}"
        sock.monitor(monitor, _HANDSHAKE_EVENTS)
        events = ctx.socket(zmq.PAIR)
        events.connect(monitor)
        self._handoff.put(("monitor", events))

    def stats(self) -> dict[str, Any]:
        with self._lock:
            c = self._counts
            return {
                "admitted": dict(c.admitted),
                "refused": {endpoint: dict(why) for endpoint, why in c.refused.items()},
                "zap_admitted": c.zap_admitted,
                "zap_refused": c.zap_refused,
            }

    # ------------------------------------------------------------ the thread
    def _run(self) -> None:
        poller = zmq.Poller()
        kinds: dict[zmq.Socket[Any], str] = {}
        while True:
            while not self._handoff.empty():
                kind, sock = self._handoff.get()
                kinds[sock] = kind
                poller.register(sock, zmq.POLLIN)
            try:
                ready = dict(poller.poll(_POLL_MS))
            except zmq.ContextTerminated:
                self._drop_terminated(poller, kinds)
                continue
            for sock in ready:
                try:
                    if kinds[sock] == "zap":
                        self._answer(sock)
                    else:
                        self._count(sock)
                except zmq.ContextTerminated:
                    self._drop_terminated(poller, kinds)
                    break

    def _drop_terminated(self, poller: zmq.Poller, kinds: dict[zmq.Socket[Any], str]) -> None:
        for sock in list(kinds):
            try:
                sock.get(zmq.EVENTS)
            except zmq.ZMQError:  # ETERM: its context is being terminated; let term() finish
                poller.unregister(sock)
                del kinds[sock]
                sock.close(linger=0)
                with self._made:
                    self._zap = {k: z for k, z in self._zap.items() if z is not sock}

    def _answer(self, zap: zmq.Socket[Any]) -> None:
        """One ZAP request (RFC 27): admit CURVE peers holding the client key, refuse the rest."""
        frames = zap.recv_multipart()
        version, request_id, mechanism, creds = frames[0], frames[1], frames[5], frames[6:]
        ok = mechanism == b"CURVE" and len(creds) == 1 and hmac.compare_digest(creds[0], self.client_key)
        with self._lock:
            if ok:
                self._counts.zap_admitted += 1
            else:
                self._counts.zap_refused += 1
        status = (b"200", b"OK") if ok else (b"400", b"not this store's client key")
        zap.send_multipart([version, request_id, *status, b"", b""])

    def _count(self, events: zmq.Socket[Any]) -> None:
        msg = parse_monitor_message(events.recv_multipart())
        endpoint = msg["endpoint"].decode(errors="replace")
        with self._lock:
            if msg["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self._counts.admitted[endpoint] = self._counts.admitted.get(endpoint, 0) + 1
            else:
                why = self._counts.refused.setdefault(endpoint, {})
                reason = _refusal(msg["event"], msg["value"])
                why[reason] = why.get(reason, 0) + 1


_GUARD: Guard | None = None
_GUARD_LOCK = threading.Lock()


def _guard(keys: WireKeys) -> Guard:
    """This process's guard (a store's actor process serves one store: one client key)."""
    global _GUARD
    with _GUARD_LOCK:
        if _GUARD is None:
            _GUARD = Guard(keys.client_public)
        elif not hmac.compare_digest(_GUARD.client_key, z85.decode(keys.client_public)):
            raise RuntimeError("this process already serves a store with other wire keys")
        return _GUARD


def guard_stats(actor: Any) -> dict[str, Any] | None:
    """Runs inside a store's actor (``__ray_call__``): its process's handshake counts
    (``admitted`` per endpoint; ``refused`` per endpoint and reason: ``mechanism`` (a peer
    without CURVE), ``protocol`` (a CURVE box that does not open: another server key),
    ``client_key`` (the ZAP handler refused its key), ``no_detail``; ``zap_admitted`` /
    ``zap_refused``); ``None`` when nothing in it is protected."""
    del actor
    return None if _GUARD is None else _GUARD.stats()


def _protect_routers(original: Any, keys: WireKeys) -> Any:
    """``create_zmq_socket`` whose ROUTER sockets (the listening ones) are CURVE servers that admit
    only ``keys``' clients; every other kind (the storage unit's in-process DEALERs) as made."""

    def create(*args: Any, **kwargs: Any) -> Any:
        sock = original(*args, **kwargs)
        if sock.type == zmq.ROUTER:
            sock.setsockopt(zmq.CURVE_SERVER, 1)
            sock.setsockopt(zmq.CURVE_SECRETKEY, keys.server_secret)
            sock.setsockopt(zmq.ZAP_DOMAIN, ZAP_DOMAIN)
            sock.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)  # no handler answering: refuse
            _guard(keys).protect(sock.context, sock)
        return sock

    create.nd_protects = True  # type: ignore[attr-defined]  # marks the wrapper: never wrapped twice
    return create


def serve_authenticated(actor: Any, keys: WireKeys | None) -> None:
    """Before ``actor``'s TransferQueue constructor runs (in its own process, which serves only
    this store): every ROUTER its ``_init_zmq_socket`` makes is protected (:class:`Guard`).
    ``None``: unauthenticated (benchmarks only)."""
    if keys is None:
        return
    names = _globals_of(actor, "_init_zmq_socket")
    if not getattr(names["create_zmq_socket"], "nd_protects", False):
        names["create_zmq_socket"] = _protect_routers(names["create_zmq_socket"], keys)


def _globals_of(actor: Any, method: str) -> dict[str, Any]:
    """The globals ``actor``'s TransferQueue ``method`` reads (bootstrap's ``_listen_on`` says why
    these and not the module's)."""
    for cls in type(actor).__mro__:
        if method in vars(cls):
            names: dict[str, Any] = inspect.unwrap(vars(cls)[method]).__globals__
            return names
    raise TypeError(f"{type(actor).__name__} has no {method}: TransferQueue changed, quirk 15 needs a look")


def admit_transfer_queue_clients(keys: WireKeys) -> None:
    """Let TransferQueue's own clients in this process (``tq.init()``, ``kv_*``) reach a store
    protected with ``keys``: every DEALER TransferQueue opens here from now on without keys of
    its own carries them (a later call replaces the keys). Patches TransferQueue in the calling
    process: call it only in a process meant to use TransferQueue's API directly, before
    ``tq.init()``."""
    import transfer_queue.storage.managers.base as managers
    import transfer_queue.utils.zmq_utils as zmq_utils

    for module in (zmq_utils, managers):
        original = getattr(module.create_zmq_socket, "nd_original", module.create_zmq_socket)

        def create(*args: Any, _original: Any = original, **kwargs: Any) -> Any:
            sock = _original(*args, **kwargs)
            if sock.type == zmq.DEALER and sock.get(zmq.MECHANISM) == zmq.NULL:
                for opt, value in _client_options(keys):
                    sock.setsockopt(opt, value)
            return sock

        create.nd_original = original  # type: ignore[attr-defined]
        module.create_zmq_socket = create  # type: ignore[attr-defined]
