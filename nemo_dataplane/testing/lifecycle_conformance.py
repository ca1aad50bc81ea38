"""Conformance tests for a client's life: use after ``close()``, the bootstrap modes, owner-only
teardown, and the store seen from other processes (Ray actors).

:class:`LifecycleConformance` is a base of
:class:`~nemo_dataplane.testing.conformance.DataPlaneConformance`. Its two hooks say how to
reach the store; neither is left to a silent default:

* ``remote_config()`` (required): a ``data_plane`` config through which another process
  reaches the same store with ``build_data_plane_client(cfg, bootstrap=False)``, or ``None`` to
  declare an in-process store. Not defined: the tests that need it fail, saying so. ``None``:
  the cross-process and bootstrap tests are skipped with that reason.
* ``fresh_config()``: a config of a store nobody created yet (each call a new one, e.g. a unique
  actor name); the bootstrap test creates, attaches to, closes and tears it down. A shared
  store needs it; so does an in-process one, whose use-after-close test closes a client built
  from it (``{"backend": "pkg.module:Class"}``; a shared store's test closes an attached one).

The cross-process tests need Ray in the test process (the actors are Ray actors; your store
need not use Ray). Without it they fail, naming the fix: call ``ray.init()`` in a session
fixture your ``client`` fixture depends on, or use :func:`conformance_ray`. The actors get
this process's import path (as the trainers' workers get the driver's), so a backend importable
here is importable there.

Clients these tests build go through ``build_data_plane_client`` with the wrappers' checks off
(``verify_rows``, ``verify_integrity``), so the backend itself is what is checked.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import pytest
import torch
from tensordict import TensorDict

from nemo_dataplane.client import DataPlaneClient, DataPlaneError
from nemo_dataplane.meta import KVBatchMeta
from nemo_dataplane.testing.fields import (
    assert_same_field,
    from_wire,
    jagged,
    random_field,
    rows_of,
    to_wire,
    unique_keys,
)

__all__ = ["LifecycleConformance", "conformance_ray"]


@pytest.fixture(scope="session")
def conformance_ray() -> Iterator[Any]:
    """Ray in the test process for the whole session (2 CPUs, no dashboard), shut down at the end
    if this fixture started it. Import it into your ``conftest.py`` and make your ``client``
    fixture depend on it (or call ``ray.init`` yourself)."""
    import ray

    started = not ray.is_initialized()
    if started:
        ray.init(address="local", num_cpus=2, include_dashboard=False)
    yield ray
    if started and ray.is_initialized():
        ray.shutdown()


def _build(cfg: Mapping[str, Any], bootstrap: bool | str) -> DataPlaneClient:
    """The backend named by ``cfg`` through the factory, without the factory's checking wrappers."""
    from nemo_dataplane.factory import build_data_plane_client

    plain = {**dict(cfg), "verify_rows": False, "verify_integrity": False}
    return build_data_plane_client(plain, bootstrap=bootstrap)  # type: ignore[arg-type]  # "auto" is a Bootstrap


def _import_path() -> list[str]:
    """This process's import path (cwd first): what the actors need to import the backend."""
    return [p for p in [os.getcwd(), *sys.path] if p and os.path.isdir(p)]


class LifecycleConformance:
    """See the module docstring. Needs ``client`` and ``pid`` fixtures and ``supports_claims``."""

    supports_claims: bool

    def remote_config(self) -> Mapping[str, Any] | None:
        """A config reaching the same store from another process, or ``None`` for an in-process
        store. Every backend's test class defines it (see the module docstring)."""
        raise NotImplementedError

    def fresh_config(self) -> Mapping[str, Any] | None:
        """A config of a new store of this backend, nobody's yet (see the module docstring)."""
        return None

    # ----------------------------------------------------------------- hooks
    def _shared(self) -> Mapping[str, Any] | None:
        try:
            return self.remote_config()
        except NotImplementedError:
            pytest.fail(
                f"{type(self).__name__} does not define remote_config(): return the data_plane config through which "
                "another process reaches this store (build_data_plane_client(cfg, bootstrap=False)), or None to "
                "declare an in-process store (the cross-process and bootstrap tests are then skipped, saying so)"
            )

    def _shared_or_skip(self) -> Mapping[str, Any]:
        cfg = self._shared()
        if cfg is None:
            pytest.skip("remote_config() is None: an in-process store, not reachable from other processes")
        return cfg

    def _fresh(self, why: str) -> Mapping[str, Any]:
        cfg = self.fresh_config()
        if cfg is None:
            pytest.fail(
                f"{type(self).__name__} does not define fresh_config(), which {why}: return the config of a store "
                "of this backend that nobody created yet (e.g. a unique actor name in backend_kwargs; "
                "{'backend': 'pkg.module:Class'} for an in-process store)"
            )
        return cfg

    @staticmethod
    def _ray() -> Any:
        import ray

        if not ray.is_initialized():
            pytest.fail(
                "the cross-process tests run the store's clients in Ray actors, but Ray is not initialized in the "
                "test process: call ray.init() in a session fixture your `client` fixture depends on, or import "
                "nemo_dataplane.testing.conformance.conformance_ray into your conftest.py and depend on it"
            )
        return ray

    # ----------------------------------------------------------- use after close
    def test_after_close_every_method_raises_and_a_second_close_is_harmless(
        self, client: DataPlaneClient, pid: str
    ) -> None:
        # A client of its own to close: attached to the shared store, or of a new in-process one.
        shared = self._shared()
        if shared is not None:
            c = _build(shared, bootstrap=False)
        else:
            c = _build(self._fresh("the use-after-close test closes a client of its own"), bootstrap="auto")
        try:
            c.kv_batch_put(["a"], pid, {"x": torch.ones(1)})
            assert c.kv_batch_get(["a"], ["x"], partition_id=pid)["x"].tolist() == [1.0]
        finally:
            c.close()
        c.close()  # twice: harmless
        meta = KVBatchMeta(keys=("a",), tags=({},), partition_id=pid, fields=("x",))
        calls: list[tuple[str, Callable[[], Any]]] = [
            ("kv_batch_put", lambda: c.kv_batch_put(["b"], pid, {"x": torch.ones(1)})),
            ("kv_batch_get", lambda: c.kv_batch_get(meta, ["x"])),
            ("kv_batch_get (keys)", lambda: c.kv_batch_get(["a"], ["x"], partition_id=pid)),
            ("kv_list", lambda: c.kv_list(pid)),
            ("kv_clear", lambda: c.kv_clear(["a"], pid)),
            ("kv_clear (all)", lambda: c.kv_clear(None, pid)),
            ("kv_partitions", c.kv_partitions),
            ("async_kv_batch_put", lambda: asyncio.run(c.async_kv_batch_put(["b"], pid, {"x": torch.ones(1)}))),
            ("async_kv_batch_get", lambda: asyncio.run(c.async_kv_batch_get(meta, ["x"]))),
            ("async_kv_list", lambda: asyncio.run(c.async_kv_list(pid))),
            ("async_kv_clear", lambda: asyncio.run(c.async_kv_clear(None, pid))),
            ("async_kv_partitions", lambda: asyncio.run(c.async_kv_partitions())),
        ]
        if self.supports_claims:
            calls += [
                ("kv_claim", lambda: c.kv_claim(pid, "t", ["x"], 1, 5.0)),
                ("kv_mark_consumed", lambda: c.kv_mark_consumed(["a"], pid, "t")),
                ("kv_claim_status", lambda: c.kv_claim_status(pid, "t", ["x"])),
                ("async_kv_claim", lambda: asyncio.run(c.async_kv_claim(pid, "t", ["x"], 1, 5.0))),
            ]
        for name, call in calls:
            t0 = time.monotonic()
            with pytest.raises(DataPlaneError, match="closed") as e:
                call()
            waited = time.monotonic() - t0
            assert waited < 4.0, f"{name} after close took {waited:.1f}s to raise ({e.value}): it waited on the store"

    # -------------------------------------------------------------- ownership
    def test_an_attached_clients_close_leaves_the_store_serving(self, client: DataPlaneClient, pid: str) -> None:
        cfg = self._shared_or_skip()
        attached = _build(cfg, bootstrap=False)
        try:
            attached.kv_batch_put(["a", "b"], pid, {"x": torch.tensor([1, 2])})
            assert client.kv_batch_get(["b", "a"], ["x"], partition_id=pid)["x"].tolist() == [2, 1]
        finally:
            attached.close()
        # The store the test's client uses still serves, its rows intact; a new client attaches.
        assert client.kv_batch_get(["a", "b"], ["x"], partition_id=pid)["x"].tolist() == [1, 2]
        again = _build(cfg, bootstrap=False)
        try:
            assert again.kv_list(pid).keys == ("a", "b")
        finally:
            again.close()
        assert client.kv_list(pid).keys == ("a", "b")

    def test_bootstrap_modes_and_only_the_owner_tears_the_store_down(self, client: DataPlaneClient, pid: str) -> None:
        self._shared_or_skip()
        cfg = self._fresh("the bootstrap test creates and tears down a store of its own")
        with pytest.raises(DataPlaneError):
            _build(cfg, bootstrap=False)  # nothing to attach to: an error, and nothing created
        owner = _build(cfg, bootstrap="auto")  # creates: nothing to attach to
        others: list[DataPlaneClient] = []
        try:
            owner.kv_batch_put(["k"], pid, {"x": torch.tensor([7])})
            with pytest.raises(DataPlaneError):
                others.append(_build(cfg, bootstrap=True))  # it exists now: True refuses
            others.append(_build(cfg, bootstrap=False))
            others.append(_build(cfg, bootstrap="auto"))  # exists: attaches, does not own
            for other in others:
                assert other.kv_batch_get(["k"], ["x"], partition_id=pid)["x"].tolist() == [7]
            for other in others:
                other.close()
            assert owner.kv_batch_get(["k"], ["x"], partition_id=pid)["x"].tolist() == [7], (
                "closing an attached client tore the store down"
            )
            owner.kv_clear(None, pid)
        finally:
            for other in others:
                other.close()
            owner.close()
        # The owner's close ended the store: attaching fails again once that took effect (a Ray
        # actor's kill is asynchronous), within 30 s.
        deadline = time.monotonic() + 30.0
        while True:
            try:
                late = _build(cfg, bootstrap=False)
            except DataPlaneError:
                break
            late.close()
            assert time.monotonic() < deadline, "30 s after the owner's close a client still attaches to its store"
            time.sleep(0.1)  # poll interval: the teardown may still be under way

    # ---------------------------------------------------------- cross-process
    def test_put_in_one_actor_read_in_another(self, client: DataPlaneClient, pid: str) -> None:
        cfg = self._shared_or_skip()
        ray = self._ray()
        writer, reader = (_Peer.remote(dict(cfg), _import_path()) for _ in range(2))
        try:
            n = 300  # a large read crosses the process boundary too
            fields = {
                "ids": jagged([i % 7 for i in range(n)], seed=3),
                "logp": random_field((n, 4), torch.float32, seed=7),
            }
            keys = unique_keys(n)
            tags = [{"w": i} for i in range(n)]
            wire = to_wire(TensorDict(fields, batch_size=[n]))
            meta = ray.get(writer.put.remote(keys, pid, wire, tags), timeout=120)
            assert meta.keys == tuple(keys) and meta.tags[5] == {"w": 5}
            order = [(i * 37) % n for i in range(n)]  # 37 is prime to n: a permutation
            got = from_wire(ray.get(reader.get.remote(meta.reorder(order), ["ids", "logp"]), timeout=120))
            assert_same_field("ids (read in another process)", got["ids"], rows_of(fields["ids"], order))
            assert_same_field("logp (read in another process)", got["logp"], fields["logp"][order])
            # and the test process's client sees the same store, the partition included
            assert client.kv_list(pid).keys == tuple(keys)
            assert pid in client.kv_partitions()
        finally:
            _stop([writer, reader])

    def test_claimers_in_several_processes_never_share_a_row(self, client: DataPlaneClient, pid: str) -> None:
        cfg = self._shared_or_skip()
        if not self.supports_claims:
            pytest.skip("backend opts out of claims (supports_claims = False)")
        ray = self._ray()
        peers = [_Peer.remote(dict(cfg), _import_path()) for _ in range(2)]
        try:
            ray.get([p.ping.remote() for p in peers], timeout=120)  # both attached before racing
            n = 60
            client.kv_batch_put(unique_keys(n), pid, {"x": torch.arange(n)})
            remote = [p.claim_all.remote(pid, "t", ["x"], 2) for p in peers]
            local: list[str] = []
            while got := client.kv_claim(pid, "t", ["x"], 2, 0).keys:
                local.extend(got)
            per_process = [local, *ray.get(remote, timeout=120)]
            everything = [k for keys in per_process for k in keys]
            assert len(everything) == len(set(everything)) == n, "a row went to two processes, or was lost"
        finally:
            _stop(peers)


def _stop(actors: list[Any]) -> None:
    """Close each actor's client, then kill the actors (also when a close fails or times out)."""
    import ray

    try:
        ray.get([a.close.remote() for a in actors], timeout=30)
    finally:
        for a in actors:
            ray.kill(a)


def _peer_cls() -> Any:
    import ray

    @ray.remote(num_cpus=0)
    class Peer:
        """A separate process attaching to the store (bootstrap=False), as worker actors do."""

        def __init__(self, cfg: dict[str, Any], import_path: list[str]) -> None:
            sys.path[:0] = [p for p in import_path if p not in sys.path]
            self.client = _build(cfg, bootstrap=False)

        def put(self, keys: list[str], pid: str, wire: dict[str, Any], tags: list[dict[str, Any]]) -> KVBatchMeta:
            return self.client.kv_batch_put(keys, pid, from_wire(wire), tags)

        def get(self, meta: KVBatchMeta, fields: list[str]) -> dict[str, Any]:
            return to_wire(self.client.kv_batch_get(meta, fields))

        def ping(self) -> bool:
            return True

        def claim_all(self, pid: str, task: str, fields: list[str], batch_size: int) -> list[str]:
            """Claim until a claim comes back empty; the keys this process got."""
            mine: list[str] = []
            while got := self.client.kv_claim(pid, task, fields, batch_size, 0).keys:
                mine.extend(got)
            return mine

        def close(self) -> None:
            self.client.close()

    return Peer


class _LazyPeer:
    """Defers ``ray.remote`` until first use so importing this module does not need Ray."""

    _cls: Any = None

    def remote(self, *args: Any, **kwargs: Any) -> Any:
        if _LazyPeer._cls is None:
            _LazyPeer._cls = _peer_cls()
        return _LazyPeer._cls.remote(*args, **kwargs)


_Peer = _LazyPeer()
