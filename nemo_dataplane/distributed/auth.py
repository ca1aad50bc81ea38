"""Rendezvous stores that bind only where asked and refuse records this job did not write.

``torch.distributed.TCPStore`` hosted with ``is_master=True`` listens on every interface
whatever host it is given, and serves anyone who connects. Two measures bound that:

* :func:`host_tcp_store` binds the listening socket itself to exactly ``host`` (a loopback
  address for single-node runs, the node's address for multi-node ones) and hands it to
  TCPStore through ``master_listen_fd``, so nothing listens on other interfaces.
* :class:`AuthStore` wraps any store so that every value is written as
  ``HMAC-SHA256(secret, instance, version, key, value) || version || value`` and checked on
  every read: a record forged or altered by a process without the job's secret, copied under
  another key, replayed from another store or group instance (``instance``, agreed by
  :func:`bind_instance`) or from an older version of a record rewritten in place
  (``version``) is refused with :class:`StoreAuthError` naming the key. Counters (``add``) and
  key presence (``check``/``wait``) are not authenticated: a forger can delay or fail a
  rendezvous (denial of service), never make a process use a value it supplied.

The secret is per job: the trainer makes one (:func:`new_job_secret`, or takes
``$NEMO_DATAPLANE_SECRET`` from the driver's environment) and hands it to its workers as an
argument of the calls that form the groups, in memory only: never through a store, nor an
actor's ``runtime_env`` (Ray writes that to a log file). :func:`job_secret` resolves a
constructor's argument, else that variable of the calling process, else ``None``
(unauthenticated; see :func:`authenticated` for the warning this gives). The variable may be
shared by several runs: the instance binding, not the secret, keeps their records apart.

What the server itself bounds: torch's TCPStore server refuses a key over 8 KiB and a value over
8 MiB in one message (it drops that connection); records keep within both
(:data:`MAX_RECORD_BYTES`), and one grown past them by appends is refused unused. It bounds
neither the number of keys nor appends to one: any process that reaches the port can grow the
hosting process's memory, a denial of service like a forger's delays (docs/reliability.md,
"Trust boundary"), never a way to make a process use its data.
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
import ipaddress
import os
import secrets
import socket
import warnings
from collections.abc import Callable
from typing import Any, cast

import torch.distributed as dist

from nemo_dataplane.errors import NemoDataplaneError

__all__ = [
    "MAX_KEY_BYTES",
    "MAX_RECORD_BYTES",
    "SECRET_ENV",
    "AuthStore",
    "StoreAuthError",
    "StoreSecurityWarning",
    "authenticated",
    "bind_instance",
    "host_tcp_store",
    "is_loopback",
    "job_secret",
    "new_job_secret",
]

SECRET_ENV = "NEMO_DATAPLANE_SECRET"
_MAC_BYTES = hashlib.sha256().digest_size
_VERSION_BYTES = 8
# Domain separation: a tag of this format can never equal one computed over another message layout.
_DOMAIN = b"nemo-dataplane/store-record/2\0"
_NONCE_BYTES = 32
# torch's TCPStore server (its libuv backend, which host_tcp_store runs) refuses a key over 8 KiB
# and a value over 8 MiB in one message, closing that client's connection. Records keep within
# both, so a write of ours too large fails here naming the key, not as a dropped connection.
MAX_KEY_BYTES = 8 * 2**10
MAX_RECORD_BYTES = 8 * 2**20 - _MAC_BYTES - _VERSION_BYTES  # a record's value, before its tag


class StoreAuthError(NemoDataplaneError, RuntimeError):
    """A store record failed authentication: forged, tampered with, or written without this
    job's secret. The message names the key."""


class StoreSecurityWarning(UserWarning):
    """A store reachable beyond this host is used without a job secret."""


def new_job_secret() -> str:
    """A fresh per-job secret (hex, 256 bits) to hand to every process of the job."""
    return secrets.token_hex(32)


def job_secret(secret: bytes | str | None = None) -> bytes | None:
    """``secret`` as bytes, else the ``NEMO_DATAPLANE_SECRET`` environment variable, else ``None``.

    Raises:
        ValueError: the secret is empty.
    """
    if secret is None:
        secret = os.environ.get(SECRET_ENV) or None
        if secret is None:
            return None
    raw = secret.encode() if isinstance(secret, str) else bytes(secret)
    if not raw:
        raise ValueError(f"the store secret is empty (argument or ${SECRET_ENV})")
    return raw


def is_loopback(host: str) -> bool:
    """Whether every address ``host`` resolves to is a loopback address."""
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except OSError:
        return False
    # A SOCK_STREAM address is (host, port, ...) with a str host.
    return bool(infos) and all(ipaddress.ip_address(cast(str, i[4][0]).split("%")[0]).is_loopback for i in infos)


def _as_bytes(value: Any) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)


class AuthStore(dist.Store):
    """A ``torch.distributed.Store`` whose values carry an HMAC-SHA256 over their context, key and value.

    Usable wherever a store is (``PrefixStore``, ``ProcessGroupGloo``, ``init_process_group``):
    every ``set``/``compare_set`` writes ``tag || version || value`` and every ``get`` checks it,
    where ``tag = HMAC-SHA256(secret, instance, version, key, value)``:

    * ``instance``: bytes unique to one instance of a group (empty until :func:`bind_instance`
      or :meth:`bound`): a record written for another store or group instance, even with the
      same secret, is refused;
    * ``version``: for a record rewritten in place, which rewrite it is (``0`` for records
      written once); ``get(key, version=n)`` refuses a genuine record of any other version, so
      an older one replayed over a newer one is caught;
    * ``key``: a record copied under another key is refused.

    A refused record raises :class:`StoreAuthError` naming the key. ``add``, ``check``,
    ``wait``, ``delete_key`` and ``num_keys`` pass through unauthenticated (counters and presence
    carry no data a process acts on beyond timing).
    """

    def __init__(self, inner: dist.Store, secret: bytes, *, instance: bytes = b"") -> None:
        super().__init__()
        if not secret:
            raise ValueError("AuthStore needs a non-empty secret")
        # Never nest: a view of a view would tag twice and only ever read its own records.
        self.inner: dist.Store = inner.inner if isinstance(inner, AuthStore) else inner
        self._secret = bytes(secret)
        self.instance = bytes(instance)

    def bound(self, instance: bytes) -> AuthStore:
        """A view of the same store whose records are bound to ``instance`` (this one is unchanged,
        so groups sharing one store each bind their own view)."""
        return AuthStore(self.inner, self._secret, instance=instance)

    def _tag(self, key: str, version: bytes, value: bytes) -> bytes:
        k = key.encode()
        # Length prefixes keep the fields apart: no two (instance, key, value) split alike.
        msg = b"".join(
            (
                _DOMAIN,
                len(self.instance).to_bytes(4, "big"),
                self.instance,
                version,
                len(k).to_bytes(4, "big"),
                k,
                value,
            )
        )
        return hmac.new(self._secret, msg, hashlib.sha256).digest()

    def _seal(self, key: str, value: Any, version: int = 0) -> bytes:
        if not 0 <= version < 1 << (8 * _VERSION_BYTES):
            raise ValueError(f"record version must be in [0, 2**64), got {version}")
        v = _as_bytes(value)
        if len(v) > MAX_RECORD_BYTES or len(key.encode()) > MAX_KEY_BYTES:
            raise ValueError(
                f"store record {key[:100]!r}: a key of {len(key.encode())} bytes and a value of {len(v)} bytes; the "
                f"store takes keys up to {MAX_KEY_BYTES} and records up to {MAX_RECORD_BYTES} bytes"
            )
        ver = version.to_bytes(_VERSION_BYTES, "big")
        return self._tag(key, ver, v) + ver + v

    def _open(self, key: str, raw: bytes, version: int = 0) -> bytes:
        raw = bytes(raw)
        head = _MAC_BYTES + _VERSION_BYTES
        if len(raw) > head + MAX_RECORD_BYTES:  # grown by appends: no record of this job's is
            raise StoreAuthError(
                f"store record {key!r} is {len(raw)} bytes, more than any record this job writes "
                f"({head + MAX_RECORD_BYTES}); refusing to use it"
            )
        tag, ver, value = raw[:_MAC_BYTES], raw[_MAC_BYTES:head], raw[head:]
        if len(raw) < head or not hmac.compare_digest(tag, self._tag(key, ver, value)):
            raise StoreAuthError(
                f"store record {key!r} failed authentication: it was forged, tampered with, written by a "
                f"process without this job's secret (${SECRET_ENV}), or replayed from another store or "
                "group instance; refusing to use it"
            )
        got = int.from_bytes(ver, "big")
        if got != version:
            older = "an older record replayed over a newer one" if got < version else "not the one expected"
            raise StoreAuthError(
                f"store record {key!r} is version {got}, expected version {version} ({older}); refusing to use it"
            )
        return value

    # ``version`` is keyword-only with a default, so torch (PrefixStore, gloo) calls these as
    # plain Store methods.
    def set(self, key: str, value: Any, *, version: int = 0) -> None:
        """Write ``value`` under ``key`` as record ``version`` (0: a record written once)."""
        self.inner.set(key, self._seal(key, value, version))  # type: ignore[arg-type]  # torch's stub: str only

    def get(self, key: str, *, version: int = 0) -> bytes:
        """The value under ``key``; :class:`StoreAuthError` unless it authenticates as record ``version``."""
        return self._open(key, self.inner.get(key), version)

    def compare_set(self, key: str, expected: Any, desired: Any) -> bytes:
        # The tag is deterministic, so a sealed ``expected`` matches the stored record exactly;
        # an empty ``expected`` means "key absent" to TCPStore and stays empty.
        exp = self._seal(key, expected) if _as_bytes(expected) else b""
        sealed = self._seal(key, desired)
        return self._open(key, self.inner.compare_set(key, exp, sealed))  # type: ignore[arg-type]  # as in set()

    def add(self, key: str, amount: int) -> int:
        return self.inner.add(key, amount)

    def check(self, keys: list[str]) -> bool:
        return self.inner.check(keys)

    def wait(self, keys: list[str], timeout: datetime.timedelta | None = None) -> None:
        if timeout is None:
            self.inner.wait(keys)
        else:
            self.inner.wait(keys, timeout)

    def delete_key(self, key: str) -> bool:
        return self.inner.delete_key(key)

    def num_keys(self) -> int:
        return self.inner.num_keys()

    def set_timeout(self, timeout: datetime.timedelta) -> None:
        self.inner.set_timeout(timeout)

    @property
    def timeout(self) -> datetime.timedelta:
        timeout: datetime.timedelta = self.inner.timeout  # type: ignore[attr-defined]  # in torch, not its stub
        return timeout


def authenticated(store: dist.Store, secret: bytes | None, *, where: str, loopback: bool) -> dist.Store:
    """``store`` wrapped in an :class:`AuthStore` when there is a secret.

    Without one the store is returned as is (records unauthenticated). That is accepted
    silently when the store is reachable on loopback only (``loopback``: the exposure is to
    processes of this host), and with a :class:`StoreSecurityWarning` naming ``where`` otherwise.
    """
    if isinstance(store, AuthStore):
        return store
    if secret is not None:
        return AuthStore(store, secret)
    if not loopback:
        warnings.warn(
            f"{where}: no job secret (argument or ${SECRET_ENV}); records in a store reachable beyond "
            "this host are not authenticated, so any process that reaches it can forge them",
            StoreSecurityWarning,
            stacklevel=3,
        )
    return store


def bind_instance(
    store: AuthStore, prefix: str, rank: int, world_size: int, wait: Callable[[list[str]], None]
) -> AuthStore:
    """Agree with every rank of a group on an identifier of this group instance; return ``store``
    bound to it (collective: every rank of the group calls it once, with the same ``prefix``).

    Each rank draws a fresh 256-bit nonce and publishes it (an authenticated record under
    ``<prefix>/instance/<rank>``); ``wait(keys)`` returns once every rank's key exists (bounded,
    the caller's wait); the instance is SHA-256 over the prefix, the world size and every rank's
    nonce, this rank's taken from memory, never from the store. So no instance repeats one of
    another run or store (each rank's own fresh nonce is in it), and a nonce record replayed
    from elsewhere only makes ranks disagree: their records then fail authentication (a
    refusal, not an acceptance).

    Raises:
        StoreAuthError: a rank's nonce record failed authentication (names its key).
    """
    keys = [f"{prefix}/instance/{r}" for r in range(world_size)]
    mine = secrets.token_bytes(_NONCE_BYTES)
    store.set(keys[rank], mine)
    wait(keys)
    h = hashlib.sha256(_DOMAIN + b"instance\0" + prefix.encode() + b"\0" + world_size.to_bytes(4, "big"))
    for r, key in enumerate(keys):
        nonce = mine if r == rank else store.get(key)
        if len(nonce) != _NONCE_BYTES:
            raise StoreAuthError(
                f"store record {key!r} is not a {_NONCE_BYTES}-byte instance nonce; refusing to use it"
            )
        h.update(nonce)
    return store.bound(h.digest())


def host_tcp_store(host: str, port: int, world_size: int, timeout: datetime.timedelta) -> dist.TCPStore:
    """Host a ``TCPStore`` listening on ``host:port`` only (``port=0``: one the OS picks).

    TCPStore alone binds every interface; here the socket is bound to ``host`` first and
    handed over, so a store hosted on ``127.0.0.1`` cannot be reached from another machine.

    Raises:
        OSError: ``host`` does not resolve or ``host:port`` cannot be bound (message names it).
    """
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[
            0
        ]
    except OSError as e:
        raise OSError(f"cannot resolve rendezvous host {host!r}: {e}") from e
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(128)
    except OSError as e:
        sock.close()
        raise OSError(f"cannot listen on {host}:{port}: {e}") from e
    bound_port = sock.getsockname()[1]
    fd = sock.detach()  # the store owns the listening socket from here on
    try:
        return dist.TCPStore(
            host,
            bound_port,
            world_size,
            True,
            timeout=timeout,
            wait_for_workers=False,
            master_listen_fd=fd,
            use_libuv=True,
        )
    except Exception:
        os.close(fd)
        raise
