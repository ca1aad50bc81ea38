"""Rendezvous stores: records authenticated with the job secret, listeners bound to their host.

Real ``TCPStore``s and real gloo groups; the forger is a plain TCPStore client, as any process
that reaches the port would be.
"""

from __future__ import annotations

import datetime
import importlib.util
import re
import socket
import threading
import time
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from nemo_dataplane.distributed.auth import (
    MAX_KEY_BYTES,
    MAX_RECORD_BYTES,
    SECRET_ENV,
    AuthStore,
    StoreAuthError,
    StoreSecurityWarning,
    host_tcp_store,
    is_loopback,
)
from nemo_dataplane.distributed.stateless_group import StatelessGroupError, StatelessProcessGroup
from nemo_dataplane.refit.protocol import Endpoint

_spec = importlib.util.spec_from_file_location("_refit_procs", Path(__file__).with_name("_refit_procs.py"))
P: Any = importlib.util.module_from_spec(_spec)  # type: ignore[arg-type]
_spec.loader.exec_module(P)  # type: ignore[union-attr]

TD = datetime.timedelta(seconds=10)


def _client(port: int) -> dist.TCPStore:
    """A process without the secret that reaches the store (no wrapper, raw records)."""
    return dist.TCPStore(P.HOST, port, 1, False, timeout=TD)


def _non_loopback_address() -> str | None:
    """An address of this machine other than loopback (None if it has none)."""
    found: list[str] = []
    try:
        found += [i[4][0] for i in socket.getaddrinfo(socket.gethostname(), None, socket.AF_INET)]
    except OSError:
        pass
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:  # no packet is sent: connect() on UDP only picks the outgoing interface
            s.connect(("192.0.2.1", 9))
            found.append(s.getsockname()[0])
        except OSError:
            pass
    return next((a for a in found if not is_loopback(a) and a != "0.0.0.0"), None)


def test_forged_and_tampered_records_are_refused_naming_the_key() -> None:
    port = P.free_port()
    with StatelessProcessGroup(P.HOST, port, 0, 1, "gloo", timeout=10, group_name="refit", secret="job-1") as g:
        forger = _client(port)
        g.store.set("spg/refit/ok", b"genuine")
        assert g.store.get("spg/refit/ok") == b"genuine"
        # A record written without the secret (e.g. a forged refit layout).
        forger.set("spg/refit/0/layout/dst", b'{"params": {}}')
        with pytest.raises(StoreAuthError, match=r"'spg/refit/0/layout/dst' failed authentication"):
            g.store.get("spg/refit/0/layout/dst")
        # A genuine record with one byte changed.
        raw = bytearray(forger.get("spg/refit/ok"))
        raw[-1] ^= 1
        forger.set("spg/refit/ok", bytes(raw))
        with pytest.raises(StoreAuthError, match="spg/refit/ok"):
            g.store.get("spg/refit/ok")
        # A genuine record copied under another key (its tag covers the key).
        g.store.set("spg/refit/a", b"v")
        forger.set("spg/refit/b", forger.get("spg/refit/a"))
        with pytest.raises(StoreAuthError, match="spg/refit/b"):
            g.store.get("spg/refit/b")
        # Written with another job's secret.
        AuthStore(forger, b"job-2").set("spg/refit/c", b"v")
        with pytest.raises(StoreAuthError, match="spg/refit/c"):
            g.store.get("spg/refit/c")
        # The group itself still works: its own gloo rendezvous went through the same wrapper.
        t = torch.arange(4)
        g.broadcast(t, 0)
        g.barrier()


def test_an_older_version_of_a_rewritten_record_is_refused() -> None:
    port = P.free_port()
    with StatelessProcessGroup(P.HOST, port, 0, 1, "gloo", timeout=10, group_name="refit", secret="job-1") as g:
        assert isinstance(g.store, AuthStore)
        forger = _client(port)
        key = "spg/refit/weights_version"
        g.store.set(key, b"version=1", version=1)
        old = forger.get(key)  # captured by whoever reaches the store
        g.store.set(key, b"version=2", version=2)
        assert g.store.get(key, version=2) == b"version=2"
        forger.set(key, old)  # the version 1 record replayed over version 2
        with pytest.raises(StoreAuthError, match=r"'spg/refit/weights_version' is version 1, expected version 2"):
            g.store.get(key, version=2)
        # The version is under the tag: relabelling the old record as version 2 breaks it.
        forger.set(key, old[:32] + (2).to_bytes(8, "big") + old[40:])
        with pytest.raises(StoreAuthError, match=r"'spg/refit/weights_version' failed authentication"):
            g.store.get(key, version=2)


def test_a_refit_record_of_an_earlier_round_is_refused_in_a_later_one() -> None:
    # Refit records are never rewritten in place: each round's keys carry the prepare
    # generation and the refit sequence, so an earlier round's record replayed into a later
    # round sits under another key than the one it was tagged for.
    port = P.free_port()
    with StatelessProcessGroup(P.HOST, port, 0, 1, "gloo", timeout=10, group_name="refit", secret="job-1") as g:
        forger = _client(port)
        ep = Endpoint(g, {}, "default")
        ep._seq = 1
        ep._publish_error("rank 0: sender failed during refit of version 1")
        old = forger.get(ep._key("error", 1, 0))
        ep._seq = 2
        forger.set(ep._key("error", 2, 0), old)
        with pytest.raises(StoreAuthError, match=re.escape(repr(ep._key("error", 2, 0)))):
            ep._errors_of([0])


def test_a_record_copied_from_another_store_with_the_same_secret_is_refused() -> None:
    ports = (P.free_port(), P.free_port())
    kw: dict[str, Any] = {"timeout": 10, "group_name": "refit", "secret": "shared-by-every-run"}
    with (
        StatelessProcessGroup(P.HOST, ports[0], 0, 1, "gloo", **kw) as a,
        StatelessProcessGroup(P.HOST, ports[1], 0, 1, "gloo", **kw) as b,
    ):
        key = "spg/refit/0/info"
        a.store.set(key, b'{"params": {}}')
        assert a.store.get(key) == b'{"params": {}}'
        _client(ports[1]).set(key, _client(ports[0]).get(key))  # same key, same secret, other store
        with pytest.raises(StoreAuthError, match=r"'spg/refit/0/info' failed authentication.*another store"):
            b.store.get(key)
        assert isinstance(a.store, AuthStore) and isinstance(b.store, AuthStore)
        assert a.store.instance and a.store.instance != b.store.instance
        # A record tagged with the job secret but bound to no instance (as before this binding).
        AuthStore(_client(ports[1]), b"shared-by-every-run").set(key, b"{}")
        with pytest.raises(StoreAuthError, match="spg/refit/0/info"):
            b.store.get(key)


def _pair(port: int, secret: str) -> tuple[StatelessProcessGroup, StatelessProcessGroup]:
    """Ranks 0 and 1 of a gloo group, built on two threads of this process."""
    out: dict[int, StatelessProcessGroup] = {}

    def join(r: int) -> None:
        out[r] = StatelessProcessGroup(P.HOST, port, r, 2, "gloo", timeout=10, secret=secret)

    t = threading.Thread(target=join, args=(1,))
    t.start()
    join(0)
    t.join(30)
    assert not t.is_alive() and set(out) == {0, 1}
    return out[0], out[1]


@pytest.mark.parametrize("arrival", ["forged", "replayed"])
def test_a_false_barrier_arrival_does_not_release_the_barrier(arrival: str) -> None:
    port = P.free_port()
    key = "spg/default/barrier/0/1"  # rank 1's arrival at barrier #0
    if arrival == "forged":
        record = b"1"  # what a genuine arrival wrote before records were authenticated
    else:  # a genuine arrival of rank 1, from another instance of the group (same secret)
        other_port = P.free_port()
        o0, o1 = _pair(other_port, "job-1")
        t = threading.Thread(target=o1.barrier)
        t.start()
        o0.barrier()
        t.join(30)
        record = _client(other_port).get(key)
        o0.destroy()
        o1.destroy()
    g0, g1 = _pair(port, "job-1")
    try:
        # Rank 1 never reaches the barrier; the forger makes its key exist. Checking presence
        # alone, barrier() returned here.
        _client(port).set(key, record)
        t0 = time.monotonic()
        with pytest.raises(StoreAuthError, match=rf"arrival of rank 1: store record '{key}' failed authentication"):
            g0.barrier(timeout=5)
        assert time.monotonic() - t0 < 5, "refused on sight, not at the barrier's timeout"
        with pytest.raises(StatelessGroupError, match="broken"):
            g0.barrier(timeout=5)
    finally:
        g0.destroy()
        g1.destroy()


def test_the_server_refuses_an_oversized_value_or_key_and_ours_stay_within_it() -> None:
    """torch's server (the libuv backend host_tcp_store runs) drops a client that sends a value over
    8 MiB or a key over 8 KiB, storing nothing; the wrapper refuses such a write itself, naming the
    key, and refuses a record grown past the cap by appends before using it."""
    server = host_tcp_store(P.HOST, 0, 1, TD)
    store = AuthStore(_client(server.port), b"job-1")
    before = server.num_keys()
    for key, value in (("big", b"x" * (8 * 2**20 + 1)), ("k" * (MAX_KEY_BYTES + 1), b"v")):
        plain = _client(server.port)
        with pytest.raises(RuntimeError, match="Connection reset by peer|Broken pipe"):
            plain.set(key, value)
            plain.get(key)  # a set has no reply: the dropped connection shows at the next request
    assert server.num_keys() == before, "nothing of the oversized writes was stored"
    store.set("spg/refit/0/info", b"i" * MAX_RECORD_BYTES)  # the largest record fits the server's cap
    assert len(store.get("spg/refit/0/info")) == MAX_RECORD_BYTES
    with pytest.raises(ValueError, match=r"'spg/refit/0/big'.* up to 8388568 bytes"):
        store.set("spg/refit/0/big", b"x" * (MAX_RECORD_BYTES + 1))
    with pytest.raises(ValueError, match="keys up to 8192"):
        store.set("k" * (MAX_KEY_BYTES + 1), b"v")
    # A stranger appends to a genuine record: it is refused by its size, its bytes never parsed.
    _client(server.port).append("spg/refit/0/info", b"y")
    with pytest.raises(StoreAuthError, match=r"'spg/refit/0/info' is 8388609 bytes, more than any record"):
        store.get("spg/refit/0/info")


def test_compare_set_round_trips_through_the_tag() -> None:
    store = AuthStore(host_tcp_store(P.HOST, 0, 1, TD), b"s")
    assert store.compare_set("k", b"", b"first") == b"first"
    assert store.compare_set("k", b"first", b"second") == b"second"
    assert store.compare_set("k", b"wrong", b"third") == b"second"
    assert store.get("k") == b"second"


def test_a_rank_with_another_secret_cannot_join() -> None:
    port = P.free_port()
    errors: dict[int, BaseException] = {}

    def rank(r: int, secret: str) -> None:
        try:
            StatelessProcessGroup(P.HOST, port, r, 2, "gloo", timeout=6, secret=secret).destroy()
        except BaseException as e:  # noqa: BLE001 - inspected below
            errors[r] = e

    t = threading.Thread(target=rank, args=(0, "job-1"))
    t.start()
    rank(1, "job-2")
    t.join(30)
    assert not t.is_alive()
    # The rendezvous reads the instance nonce rank 0 wrote: rank 1 refuses it, naming the key.
    assert isinstance(errors.get(1), (StoreAuthError, StatelessGroupError)), errors
    assert "failed authentication" in str(errors[1]) and "spg/default/instance/0" in str(errors[1])
    assert 0 in errors  # rank 0 never sees a working peer: it fails within its timeout


def test_the_secret_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(SECRET_ENV, "from-env")
    port = P.free_port()
    with StatelessProcessGroup(P.HOST, port, 0, 1, "gloo", timeout=10) as g:
        assert isinstance(g.store, AuthStore)
        g.store.set("x", b"1")
        # Another process with the same secret reads it once bound to the same group instance.
        assert AuthStore(_client(port), b"from-env", instance=g.store.instance).get("x") == b"1"
    monkeypatch.delenv(SECRET_ENV)
    with StatelessProcessGroup(P.HOST, P.free_port(), 0, 1, "gloo", timeout=10) as g:
        assert not isinstance(g.store, AuthStore)  # loopback, no secret: unauthenticated, silently


def test_a_loopback_store_is_not_reachable_on_a_non_loopback_address() -> None:
    addr = _non_loopback_address()
    if addr is None:
        pytest.skip("this machine has no non-loopback address")
    # Positive control: a plain TCPStore given the same loopback host listens everywhere.
    plain = dist.TCPStore(P.HOST, 0, 1, True, timeout=TD, wait_for_workers=False)
    socket.create_connection((addr, plain.port), timeout=2).close()
    del plain
    ours = host_tcp_store(P.HOST, 0, 1, TD)
    socket.create_connection((P.HOST, ours.port), timeout=2).close()
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection((addr, ours.port), timeout=2)
    # The same through a group hosted by rank 0 on loopback.
    port = P.free_port()
    with StatelessProcessGroup(P.HOST, port, 0, 1, "gloo", timeout=10, secret="s"):
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection((addr, port), timeout=2)


def test_no_secret_on_a_reachable_host_warns() -> None:
    addr = _non_loopback_address()
    if addr is None:
        pytest.skip("this machine has no non-loopback address")
    with pytest.warns(StoreSecurityWarning, match="no job secret"):
        StatelessProcessGroup(addr, P.free_port(), 0, 1, "gloo", timeout=10).destroy()
    with warnings.catch_warnings():
        warnings.simplefilter("error", StoreSecurityWarning)
        StatelessProcessGroup(addr, P.free_port(), 0, 1, "gloo", timeout=10, secret="s").destroy()


def test_hosting_on_a_taken_port_names_the_address() -> None:
    with socket.socket() as s:
        s.bind((P.HOST, 0))
        s.listen(1)
        port = s.getsockname()[1]
        with pytest.raises(OSError, match=f"{P.HOST}:{port}"):
            host_tcp_store(P.HOST, port, 1, TD)


def test_a_rendezvous_host_that_does_not_resolve_fails_within_the_timeout_naming_the_address() -> None:
    import time

    host = "no-such-host.invalid"  # RFC 2606: never resolves
    t0 = time.monotonic()
    with pytest.raises(StatelessGroupError, match=rf"cannot resolve rendezvous host '{re.escape(host)}'"):
        StatelessProcessGroup(host, 29999, 0, 2, "gloo", timeout=3)  # the rank that hosts the store
    with pytest.raises(StatelessGroupError, match=rf"{re.escape(host)}:29999"):
        StatelessProcessGroup(host, 29999, 1, 2, "gloo", timeout=3)  # a rank that joins it
    assert time.monotonic() - t0 < 3 + 5, "each attempt is bounded by the group's timeout"
