"""The TransferQueue store's authenticated wire (compat quirk 15): no frame of a client without
the store's keys reaches TransferQueue's decoder, on any port of any of its actors."""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from nemo_dataplane.adapters.transfer_queue import compat
from nemo_dataplane.adapters.transfer_queue.client import TransferQueueClient
from nemo_dataplane.adapters.transfer_queue.store import new_store_keys
from nemo_dataplane.config import TransferQueueConfig

psutil = pytest.importorskip("psutil")
zmq = pytest.importorskip("zmq")

WAIT_S = 30.0


@pytest.fixture(scope="module")
def wired(ray_session: Any) -> Iterator[TransferQueueClient]:
    """A store of two units, one in the controller's process and one standalone: every kind of
    listening actor."""
    cfg = TransferQueueConfig(
        num_storage_units=2,
        unit_in_controller=True,
        controller_num_cpus=0.1,  # beside the session's store on 2 CPUs
        storage_unit_num_cpus=0.1,
        bootstrap_timeout_s=120,
        op_timeout_s=60,
    )
    client = TransferQueueClient(
        cfg,
        bootstrap=True,
        controller_name=f"wire-{uuid.uuid4().hex[:6]}",
    )
    yield client
    client.close()


def _store_listeners(client: TransferQueueClient) -> dict[int, list[int]]:
    """pid -> every TCP port that process listens on, for each process of the store."""
    import ray

    handles = [client._controller, *client._storage.values()]
    pids = set(ray.get([h.__ray_call__.remote(lambda actor: os.getpid()) for h in handles], timeout=60))
    return {
        pid: sorted(
            c.laddr.port for c in psutil.Process(pid).net_connections(kind="tcp") if c.status == psutil.CONN_LISTEN
        )
        for pid in pids
    }


class _Opens:
    """Unpickling this opens (creates) ``path``: a stand-in for any code a pickle can run."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)

    def __reduce__(self) -> tuple[Any, tuple[str, str]]:
        return open, (self.path, "a")


def _payload(path: Path) -> list[bytes]:
    """A TransferQueue request whose decoding creates ``path``."""
    from transfer_queue.utils.zmq_utils import ZMQMessage, ZMQRequestType

    msg = ZMQMessage.create(ZMQRequestType.HANDSHAKE, sender_id="x", body={"x": _Opens(path)})
    return [bytes(f) for f in msg.serialize()]


def _send(endpoint: str, frames: list[bytes], options: list[tuple[int, bytes]]) -> tuple[Any, Any]:
    """A DEALER to ``endpoint`` that sends ``frames`` (identity as TransferQueue's storage
    managers have, so a unit's proxy forwards it to the decoder); its context and the socket,
    which the caller keeps until done (a collected socket closes). A connection refused before
    the frames were queued leaves them unsent (nothing to refuse but the handshake)."""
    from transfer_queue.utils.zmq_utils import STORAGE_MANAGER_IDENTITY_PREFIX

    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RECONNECT_IVL, -1)  # one connection: one handshake the store counts
    sock.setsockopt(zmq.IDENTITY, f"{STORAGE_MANAGER_IDENTITY_PREFIX}{uuid.uuid4().hex[:8]}".encode())
    for opt, value in options:
        sock.setsockopt(opt, value)
    sock.connect(endpoint)
    sock.setsockopt(zmq.SNDTIMEO, 2000)
    try:
        sock.send_multipart(frames)
    except zmq.Again:
        pass
    return ctx, sock


def _within(what: str, cond: Callable[[], bool], detail: Callable[[], Any] = lambda: "") -> None:
    deadline = time.monotonic() + WAIT_S
    while not cond():
        assert time.monotonic() < deadline, f"{what} within {WAIT_S}s: {detail()}"
        time.sleep(0.02)


def _curve(keys: compat.WireKeys, server_public: bytes | None = None) -> list[tuple[int, bytes]]:
    return [
        (zmq.CURVE_SERVERKEY, server_public or keys.server_public),
        (zmq.CURVE_PUBLICKEY, keys.client_public),
        (zmq.CURVE_SECRETKEY, keys.client_secret),
    ]


def test_no_frame_of_a_client_without_the_store_keys_is_decoded_on_any_port(
    wired: TransferQueueClient, tmp_path: Path
) -> None:
    """A pickled request that would create a file is sent to every port the store's processes
    listen on by a plain ZMQ client, one with another store's keys, and one that knows this
    store's server key but not its client key: each connection is refused at the handshake (and
    counted), nothing is created, and the store keeps serving. The same frames from a client
    holding the keys do reach the decoder on each port (they create their file): the keys, and
    nothing else, keep the others out."""
    keys = wired._wire
    assert keys is not None
    listeners = _store_listeners(wired)
    endpoints = {f"tcp://127.0.0.1:{p}" for ports in listeners.values() for p in ports}
    # Controller: handshake and request ports, the unit it holds; the standalone unit: one.
    zmq_endpoints = endpoints & _published(wired)
    assert len(zmq_endpoints) == 4, (listeners, _published(wired))
    # Everything else is Ray's own core-worker port (one per process, token-authenticated).
    assert len(endpoints - zmq_endpoints) == len(listeners)

    other = compat.wire_keys(b"another store's secret")
    attackers = {
        "plain": [],
        "other_store_keys": _curve(other),
        "no_client_key": _curve(other, server_public=keys.server_public),  # refused by the ZAP handler
    }

    def counts(endpoint: str) -> tuple[int, int]:
        """Refusals at ``endpoint``, and by the ZAP handler (any endpoint)."""
        stats = wired.wire_stats()
        return sum(stats["refused"].get(endpoint, {}).values()), stats["zap_refused"]

    for endpoint in sorted(endpoints):
        for name, options in attackers.items():
            refused, zap_refused = counts(endpoint)
            # Each attacker connects once: one more refusal here, and one more by ZAP for the
            # one that proves a client key.
            want = (refused + 1, zap_refused + (name == "no_client_key"))
            ctx, _sock = _send(endpoint, _payload(tmp_path / f"{name}-{endpoint.rsplit(':', 1)[1]}"), options)
            try:
                if endpoint in zmq_endpoints:
                    _within(
                        f"{name} refused at {endpoint}",
                        lambda e=endpoint, w=want: all(n >= m for n, m in zip(counts(e), w)),
                        wired.wire_stats,
                    )
            finally:
                ctx.destroy(linger=0)

    # The same frames with the keys: decoded on every port.
    for endpoint in sorted(zmq_endpoints):
        made = tmp_path / f"keyed-{endpoint.rsplit(':', 1)[1]}"
        ctx, _sock = _send(endpoint, _payload(made), _curve(keys))
        try:
            _within(f"the keyed request decoded at {endpoint}", made.exists)
        finally:
            ctx.destroy(linger=0)
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith("keyed-")) == []

    pid = f"wire-{uuid.uuid4().hex[:6]}"
    meta = wired.kv_batch_put(["a", "b"], pid, {"x": torch.arange(6).view(2, 3)})
    assert wired.kv_batch_get(meta, ["x"])["x"].tolist() == [[0, 1, 2], [3, 4, 5]]
    wired.kv_clear(None, pid)


def _published(client: TransferQueueClient) -> set[str]:
    """The endpoints the store's config publishes (what TransferQueue's clients dial)."""
    tq = client._tq
    infos = [tq._controller, *tq.storage_manager.storage_unit_infos.values()]
    return {info.to_addr(port) for info in infos for port in info.ports}


def test_a_client_that_attaches_gets_the_keys_from_the_controller_and_is_admitted(
    wired: TransferQueueClient,
) -> None:
    """A client that attaches (bootstrap=False, as every worker's; no secret of its own) gets the
    store's keys from the controller through Ray; its connections are admitted (counted) and
    served. (Clients in other processes: the conformance suite's actor tests, on this wire.)"""
    pid = f"wire-{uuid.uuid4().hex[:6]}"
    wired.kv_batch_put(["k"], pid, {"x": torch.tensor([7.0])})
    before = wired.wire_stats()
    attached = TransferQueueClient(
        TransferQueueConfig(op_timeout_s=60), bootstrap=False, controller_name=wired.controller_name
    )
    try:
        assert attached._wire == wired._wire
        assert attached.kv_list(pid).keys == ("k",)
        assert attached.kv_batch_get(["k"], ["x"], partition_id=pid)["x"].tolist() == [7.0]
        after = wired.wire_stats()
        assert after["zap_admitted"] > before["zap_admitted"] and after["zap_refused"] == before["zap_refused"]
    finally:
        attached.close()
        wired.kv_clear(None, pid)


def test_wire_keys_follow_the_secret_and_never_show_their_secret_halves() -> None:
    a, b = compat.wire_keys(b"s1"), compat.wire_keys(b"s2")
    assert a == compat.wire_keys(b"s1") and a != b
    assert len({a.server_public, a.client_public, b.server_public, b.client_public}) == 4
    assert zmq.curve_public(a.server_secret) == a.server_public and zmq.curve_public(a.client_secret) == a.client_public
    assert a.server_secret.decode() not in repr(a) and a.client_secret.decode() not in repr(a)
    with pytest.raises(ValueError, match="non-empty"):
        compat.wire_keys(b"")


def test_a_store_made_with_a_secret_derives_its_keys_from_it() -> None:
    """``secret=`` (or ``$NEMO_DATAPLANE_SECRET``) is what a created store's keys come from; without
    one each store gets fresh keys; no keys only when asked (benchmarks)."""
    assert new_store_keys(b"job secret") == compat.wire_keys(b"job secret")
    assert new_store_keys(None) != new_store_keys(None)
    assert new_store_keys(b"job secret", plain=True) is None
