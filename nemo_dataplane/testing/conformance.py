"""The client contract as a reusable pytest suite: subclass :class:`DataPlaneConformance`.

A backend passes when every test here passes against it. In your own test file::

    import pytest
    from nemo_dataplane.testing.conformance import DataPlaneConformance

    class TestMyStore(DataPlaneConformance):
        @pytest.fixture
        def client(self):
            c = MyStoreClient(...)
            yield c
            c.close()

        # optional: a config that actors can pass to build_data_plane_client(cfg, bootstrap=False)
        # to reach the same store from another process; None skips the cross-process test.
        def remote_config(self):
            return {"backend": "my_pkg.store:MyStoreClient", "backend_kwargs": {...}}

Every test works in its own partition (the ``pid`` fixture) and clears it afterwards, so a
shared, long-lived store is fine. The in-memory reference client is the executable spec: this
suite checks that a backend behaves like it, not how it stores data.

The claim tests (``kv_claim`` and friends) come from
:class:`~nemo_dataplane.testing.claim_conformance.ClaimConformance`, a base of the suite; a
backend without claims sets ``supports_claims = False`` on its test class.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator, Mapping
from typing import Any

import pytest
import torch
from tensordict import TensorDict

from nemo_dataplane.client import DataPlaneClient
from nemo_dataplane.codec import SUPPORTED_DTYPES
from nemo_dataplane.meta import KVBatchMeta
from nemo_dataplane.testing.claim_conformance import ClaimConformance
from nemo_dataplane.testing.fields import (
    assert_same_field,
    from_wire,
    jagged,
    random_field,
    rows_of,
    to_wire,
    unique_keys,
)

__all__ = ["DataPlaneConformance", "assert_same_field", "jagged", "random_field"]


class DataPlaneConformance(ClaimConformance):
    """Contract tests for a :class:`DataPlaneClient`; subclass and provide ``client``."""

    @pytest.fixture
    def client(self) -> Iterator[DataPlaneClient]:
        raise NotImplementedError("subclasses provide a `client` fixture yielding the backend under test")

    def remote_config(self) -> Mapping[str, Any] | None:
        """A ``data_plane`` config that reaches the same store from another process, or None."""
        return None

    @pytest.fixture
    def pid(self, client: DataPlaneClient) -> Iterator[str]:
        partition = f"conf-{uuid.uuid4().hex[:10]}"
        yield partition
        client.kv_clear(None, partition)

    # ----------------------------------------------------------- round trips
    def test_every_dtype_round_trips_bit_exact(self, client: DataPlaneClient, pid: str) -> None:
        n = 5
        fields: dict[str, torch.Tensor] = {}
        for i, dtype in enumerate(sorted(SUPPORTED_DTYPES, key=str)):
            tag = str(dtype).replace("torch.", "")
            fields[f"dense_{tag}"] = random_field((n, 3), dtype, seed=i)
            fields[f"scalar_{tag}"] = random_field((n,), dtype, seed=100 + i)
            fields[f"jagged_{tag}"] = jagged([2, 0, 5, 1, 3], dtype=dtype, seed=200 + i)
        meta = client.kv_batch_put(unique_keys(n), pid, fields)
        assert set(meta.fields or ()) == set(fields)
        out = client.kv_batch_get(meta, list(fields))
        assert set(out.keys()) == set(fields)
        for name, want in fields.items():
            assert_same_field(name, out[name], want)

    def test_jagged_and_dense_shapes_keep_their_layout(self, client: DataPlaneClient, pid: str) -> None:
        n = 4
        fields = {
            "ids": jagged([3, 0, 7, 1]),  # [B, j] with an empty row
            "hidden": jagged([2, 4, 1, 3], 5, dtype=torch.float32, seed=1),  # [B, j, D]
            "equal_len": jagged([4, 4, 4, 4], seed=2),  # equal lengths: still jagged
            "dense3d": random_field((n, 2, 3), torch.float32, seed=3),
            "reward": random_field((n,), torch.float32, seed=4),
        }
        meta = client.kv_batch_put(unique_keys(n), pid, fields)
        out = client.kv_batch_get(meta, list(fields))
        for name, want in fields.items():
            assert_same_field(name, out[name], want)
        assert out.batch_size == torch.Size([n])

    def test_rows_come_back_in_the_order_asked(self, client: DataPlaneClient, pid: str) -> None:
        n = 8
        fields = {"ids": jagged([1, 2, 3, 4, 5, 6, 7, 8]), "x": torch.arange(n * 2, dtype=torch.float32).view(n, 2)}
        meta = client.kv_batch_put(unique_keys(n), pid, fields)
        order = [5, 2, 7, 0, 3, 6, 1, 4]
        out = client.kv_batch_get(meta.reorder(order), ["ids", "x"])
        assert_same_field("ids", out["ids"], rows_of(fields["ids"], order))
        assert_same_field("x", out["x"], rows_of(fields["x"], order))
        by_keys = client.kv_batch_get([f"k{i}" for i in order], ["x"], partition_id=pid)
        assert torch.equal(by_keys["x"], fields["x"][order])

    def test_partial_field_selection_returns_only_those_fields(self, client: DataPlaneClient, pid: str) -> None:
        n = 3
        fields = {"a": torch.ones(n, 2), "b": torch.zeros(n, 4, dtype=torch.int32), "c": jagged([1, 2, 3])}
        meta = client.kv_batch_put(unique_keys(n), pid, fields)
        out = client.kv_batch_get(meta, ["c", "a"])
        assert set(out.keys()) == {"a", "c"}
        assert_same_field("a", out["a"], fields["a"])
        assert_same_field("c", out["c"], fields["c"])

    def test_get_subset_of_keys(self, client: DataPlaneClient, pid: str) -> None:
        n = 6
        x = torch.arange(n, dtype=torch.int64)
        meta = client.kv_batch_put(unique_keys(n), pid, {"x": x})
        out = client.kv_batch_get(meta.subset([4, 1]), ["x"])
        assert out["x"].tolist() == [4, 1]

    # --------------------------------------------------------- tags & upsert
    def test_tags_round_trip_and_merge_on_upsert(self, client: DataPlaneClient, pid: str) -> None:
        keys = unique_keys(3)
        meta = client.kv_batch_put(keys, pid, {"x": torch.zeros(3)}, tags=[{"len": i, "src": "gen"} for i in range(3)])
        assert [t["len"] for t in meta.tags] == [0, 1, 2]
        meta2 = client.kv_batch_put(keys[:2], pid, None, tags=[{"score": 0.5}, {"len": 9}])
        assert meta2.tags[0] == {"len": 0, "src": "gen", "score": 0.5}
        assert meta2.tags[1] == {"len": 9, "src": "gen"}
        listed = client.kv_list(pid)
        assert list(listed.tags) == [
            {"len": 0, "src": "gen", "score": 0.5},
            {"len": 9, "src": "gen"},
            {"len": 2, "src": "gen"},
        ]
        assert meta2.fields is not None and "x" in meta2.fields

    def test_upsert_of_some_fields_keeps_the_others(self, client: DataPlaneClient, pid: str) -> None:
        keys = unique_keys(3)
        client.kv_batch_put(keys, pid, {"a": torch.zeros(3, 2), "b": jagged([1, 2, 3])})
        meta = client.kv_batch_put(keys[1:], pid, {"a": torch.ones(2, 2)})
        assert set(meta.fields or ()) == {"a", "b"}
        out = client.kv_batch_get(keys, ["a", "b"], partition_id=pid)
        assert out["a"].tolist() == [[0, 0], [1, 1], [1, 1]]
        assert_same_field("b", out["b"], jagged([1, 2, 3]))
        # a new field on some keys only: stored on those, not listed as common
        client.kv_batch_put(keys[:1], pid, {"c": torch.ones(1)})
        assert set(client.kv_list(pid).fields or ()) == {"a", "b"}
        assert client.kv_batch_get(keys[:1], ["c"], partition_id=pid)["c"].tolist() == [1.0]

    def test_put_returns_meta_of_exactly_the_keys_put(self, client: DataPlaneClient, pid: str) -> None:
        meta = client.kv_batch_put(["z", "a", "m"], pid, {"x": torch.zeros(3)}, tags=[{}, {"t": 1}, {}])
        assert isinstance(meta, KVBatchMeta)
        assert meta.keys == ("z", "a", "m") and meta.partition_id == pid
        assert meta.tags == ({}, {"t": 1}, {})

    # ---------------------------------------------------------- clear & list
    def test_list_clear_semantics(self, client: DataPlaneClient, pid: str) -> None:
        keys = ["c", "a", "b", "d"]
        client.kv_batch_put(keys, pid, {"x": torch.arange(4)}, tags=[{"i": i} for i in range(4)])
        listed = client.kv_list(pid)
        assert listed.keys == tuple(keys) and listed.partition_id == pid
        assert [t["i"] for t in listed.tags] == [0, 1, 2, 3]
        assert set(listed.fields or ()) == {"x"}
        client.kv_clear(["a", "nope"], pid)  # absent keys are ignored
        assert client.kv_list(pid).keys == ("c", "b", "d")
        with pytest.raises(KeyError, match="'a'"):
            client.kv_batch_get(["a"], ["x"], partition_id=pid)
        assert client.kv_batch_get(["d", "c"], ["x"], partition_id=pid)["x"].tolist() == [3, 0]
        client.kv_batch_put(["a"], pid, {"x": torch.tensor([7])})  # re-put goes to the end
        assert client.kv_list(pid).keys == ("c", "b", "d", "a")
        client.kv_clear(None, pid)
        empty = client.kv_list(pid)
        assert empty.keys == () and len(empty) == 0

    def test_clear_and_list_of_unknown_partition_are_no_ops(self, client: DataPlaneClient, pid: str) -> None:
        ghost = f"{pid}-never-written"
        client.kv_clear(None, ghost)
        client.kv_clear(["x", "y"], ghost)
        assert client.kv_list(ghost).keys == ()
        client.kv_batch_put(["k"], pid, {"x": torch.ones(1)})
        client.kv_clear(None, ghost)  # must not touch other partitions
        assert client.kv_list(pid).keys == ("k",)

    def test_partitions_are_isolated(self, client: DataPlaneClient, pid: str) -> None:
        other = f"{pid}-b"
        try:
            client.kv_batch_put(["k"], pid, {"x": torch.tensor([1])})
            client.kv_batch_put(["k"], other, {"x": torch.tensor([2])})
            assert client.kv_batch_get(["k"], ["x"], partition_id=pid)["x"].tolist() == [1]
            assert client.kv_batch_get(["k"], ["x"], partition_id=other)["x"].tolist() == [2]
        finally:
            client.kv_clear(None, other)

    # -------------------------------------------------------------- partitions
    def test_partitions_lists_exactly_the_partitions_holding_keys(self, client: DataPlaneClient, pid: str) -> None:
        a, b, ghost = pid, f"{pid}-b", f"{pid}-ghost"

        def mine() -> list[str]:
            # The store may be shared with other tests: judge only this test's partitions.
            listed = client.kv_partitions()
            assert len(listed) == len(set(listed)), f"a partition is listed twice: {sorted(listed)}"
            return sorted(p for p in listed if p.startswith(pid))

        try:
            assert mine() == []
            client.kv_batch_put(["k0", "k1"], a, {"x": torch.zeros(2)})
            assert mine() == [a]
            client.kv_batch_put(["t0", "t1"], b, None, tags=[{}, {"only": "tags"}])  # keys without fields count
            assert mine() == [a, b]
            # Reads, lists, clears and refused puts of an unknown partition do not create it.
            with pytest.raises(KeyError):
                client.kv_batch_get(["k"], ["x"], partition_id=ghost)
            client.kv_list(ghost)
            client.kv_clear(None, ghost)
            client.kv_clear(["k"], ghost)
            with pytest.raises(ValueError):
                client.kv_batch_put(["k", "k"], ghost, {"x": torch.zeros(2)})
            assert mine() == [a, b]
            client.kv_clear(["k0", "nope"], a)
            assert mine() == [a, b]  # one key left
            client.kv_clear(["k1"], a)  # its last key, cleared by name
            assert mine() == [b]
            client.kv_clear(["t0", "t1"], b)  # emptied key by key in one call
            assert mine() == []
            client.kv_batch_put(["k0"], a, {"x": torch.ones(1)})  # a new key brings it back
            assert mine() == [a]
            assert asyncio.run(client.async_kv_partitions()).count(a) == 1
            client.kv_clear(None, a)
            assert mine() == []
        finally:
            for p in (b, ghost):
                client.kv_clear(None, p)

    # ----------------------------------------------------------------- errors
    def test_missing_keys_raise_key_error_naming_them(self, client: DataPlaneClient, pid: str) -> None:
        client.kv_batch_put(["a", "b"], pid, {"x": torch.zeros(2)})
        with pytest.raises(KeyError) as e:
            client.kv_batch_get(["a", "ghost1", "b", "ghost2"], ["x"], partition_id=pid)
        assert "ghost1" in str(e.value) and "ghost2" in str(e.value)
        with pytest.raises(KeyError, match="ghost"):
            client.kv_batch_get(["ghost"], ["x"], partition_id=f"{pid}-never-written")

    def test_missing_fields_raise_key_error_naming_them(self, client: DataPlaneClient, pid: str) -> None:
        client.kv_batch_put(["a", "b"], pid, {"x": torch.zeros(2)})
        client.kv_batch_put(["a"], pid, {"y": torch.zeros(1)})
        with pytest.raises(KeyError, match="'nope'"):
            client.kv_batch_get(["a", "b"], ["x", "nope"], partition_id=pid)
        with pytest.raises(KeyError, match="'y'") as e:
            client.kv_batch_get(["a", "b"], ["y"], partition_id=pid)
        assert "'b'" in str(e.value)

    def test_duplicate_keys_raise_value_error(self, client: DataPlaneClient, pid: str) -> None:
        with pytest.raises(ValueError, match="'a'"):
            client.kv_batch_put(["a", "b", "a"], pid, {"x": torch.zeros(3)})
        assert client.kv_list(pid).keys == ()
        client.kv_batch_put(["a", "b"], pid, {"x": torch.zeros(2)})
        with pytest.raises(ValueError):
            client.kv_batch_get(["a", "a"], ["x"], partition_id=pid)

    def test_mismatched_batch_size_names_the_field(self, client: DataPlaneClient, pid: str) -> None:
        with pytest.raises(ValueError, match="'short'"):
            client.kv_batch_put(unique_keys(3), pid, {"ok": torch.zeros(3), "short": torch.zeros(2, 4)})
        with pytest.raises(ValueError, match="'jag'"):
            client.kv_batch_put(unique_keys(3), pid, {"jag": jagged([1, 2])})
        with pytest.raises(ValueError):
            client.kv_batch_put(unique_keys(2), pid, {"x": torch.zeros(2)}, tags=[{}])
        assert client.kv_list(pid).keys == ()  # nothing half-written

    def test_bad_types_raise_type_error_naming_the_field(self, client: DataPlaneClient, pid: str) -> None:
        with pytest.raises(TypeError, match="'cplx'"):
            bad = {"ok": torch.zeros(2), "cplx": torch.zeros(2, dtype=torch.complex64)}
            client.kv_batch_put(unique_keys(2), pid, bad)
        with pytest.raises(TypeError, match="'text'"):
            not_tensors: dict[str, Any] = {"text": ["a", "b"]}  # deliberately not tensors
            client.kv_batch_put(unique_keys(2), pid, not_tensors)
        with pytest.raises(TypeError, match="'u16'"):
            client.kv_batch_put(unique_keys(2), pid, {"u16": torch.zeros(2, dtype=torch.uint16)})
        assert client.kv_list(pid).keys == ()

    def test_argument_errors(self, client: DataPlaneClient, pid: str) -> None:
        client.kv_batch_put(["a"], pid, {"x": torch.zeros(1)})
        with pytest.raises(ValueError, match="partition_id"):
            client.kv_batch_get(["a"], ["x"])  # plain keys need a partition
        with pytest.raises(ValueError):
            client.kv_batch_get(["a"], [], partition_id=pid)
        with pytest.raises(ValueError):
            client.kv_batch_put(["a"], pid, None)  # neither fields nor tags
        with pytest.raises(ValueError):
            client.kv_batch_put([], pid, {"x": torch.zeros(0)})
        meta = client.kv_list(pid)
        with pytest.raises(ValueError, match="contradicts"):
            client.kv_batch_get(meta, ["x"], partition_id=f"{pid}-other")
        assert client.kv_batch_get([], ["x"], partition_id=pid).batch_size == torch.Size([0])

    # ------------------------------------------------------------------ async
    def test_async_twins_gathered_concurrently(self, client: DataPlaneClient, pid: str) -> None:
        parts = [f"{pid}-{i}" for i in range(3)]

        async def scenario() -> list[Any]:
            metas = await asyncio.gather(
                *(
                    client.async_kv_batch_put(
                        unique_keys(4, f"p{i}_"),
                        p,
                        {"x": torch.full((4, 2), float(i)), "ids": jagged([1, 2, 3, i])},
                        tags=[{"i": i}] * 4,
                    )
                    for i, p in enumerate(parts)
                )
            )
            gets = await asyncio.gather(*(client.async_kv_batch_get(m, ["x", "ids"]) for m in metas))
            lists = await asyncio.gather(*(client.async_kv_list(p) for p in parts))
            await asyncio.gather(*(client.async_kv_clear(None, p) for p in parts))
            after = await asyncio.gather(*(client.async_kv_list(p) for p in parts))
            return [metas, gets, lists, after]

        try:
            metas, gets, lists, after = asyncio.run(scenario())
        finally:
            for p in parts:
                client.kv_clear(None, p)
        for i, (meta, out, listed, gone) in enumerate(zip(metas, gets, lists, after)):
            assert meta.partition_id == parts[i]
            assert torch.equal(out["x"], torch.full((4, 2), float(i)))
            assert_same_field("ids", out["ids"], jagged([1, 2, 3, i]))
            assert listed.keys == tuple(unique_keys(4, f"p{i}_")) and listed.tags[0] == {"i": i}
            assert gone.keys == ()

    # ---------------------------------------------------------- cross-process
    def test_put_in_one_actor_read_in_another(self, client: DataPlaneClient, pid: str) -> None:
        cfg = self.remote_config()
        if cfg is None:
            pytest.skip("in-process backend: no store shared between processes")
        import ray

        if not ray.is_initialized():
            pytest.skip("needs a running Ray cluster (ray_session fixture)")
        writer = _Peer.remote(dict(cfg))
        reader = _Peer.remote(dict(cfg))
        try:
            fields = {"ids": jagged([3, 1, 4]), "logp": random_field((3, 4), torch.float32, seed=7)}
            meta = ray.get(
                writer.put.remote(unique_keys(3), pid, to_wire(TensorDict(fields, batch_size=[3])), [{"w": 1}] * 3),
                timeout=120,
            )
            assert meta.keys == tuple(unique_keys(3)) and meta.tags[0] == {"w": 1}
            got = from_wire(ray.get(reader.get.remote(meta.reorder([2, 0, 1]), ["ids", "logp"]), timeout=120))
            assert_same_field("ids", got["ids"], rows_of(fields["ids"], [2, 0, 1]))
            assert_same_field("logp", got["logp"], fields["logp"][[2, 0, 1]])
            # and the driver-side client sees the same store, the partition included
            assert client.kv_list(pid).keys == tuple(unique_keys(3))
            assert pid in client.kv_partitions()
        finally:
            # Both actors are killed even when a close fails or times out.
            try:
                ray.get([actor.close.remote() for actor in (writer, reader)], timeout=30)
            finally:
                for actor in (writer, reader):
                    ray.kill(actor)

    def test_claimers_in_several_processes_never_share_a_row(self, client: DataPlaneClient, pid: str) -> None:
        cfg = self.remote_config()
        if cfg is None or not self.supports_claims:
            pytest.skip("no store shared between processes, or no claims")
        import ray

        if not ray.is_initialized():
            pytest.skip("needs a running Ray cluster (ray_session fixture)")
        peers = [_Peer.remote(dict(cfg)) for _ in range(2)]
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
            try:
                ray.get([p.close.remote() for p in peers], timeout=30)
            finally:
                for p in peers:
                    ray.kill(p)


def _peer_cls() -> Any:
    import ray

    @ray.remote(num_cpus=0)
    class Peer:
        """A separate process attaching to the store (bootstrap=False), as worker actors do."""

        def __init__(self, cfg: dict[str, Any]) -> None:
            from nemo_dataplane.factory import build_data_plane_client

            self.client = build_data_plane_client(cfg, bootstrap=False)

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
