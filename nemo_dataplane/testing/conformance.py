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

        # required: the config through which another process (a Ray actor) reaches the same
        # store with build_data_plane_client(cfg, bootstrap=False); None declares an in-process store.
        def remote_config(self):
            return {"backend": "my_pkg.store:MyStoreClient", "backend_kwargs": {...}}

        # a store of this backend nobody created yet (a unique name each call)
        def fresh_config(self):
            return {"backend": "my_pkg.store:MyStoreClient", "backend_kwargs": {"name": unique()}}

Every test works in its own partition (the ``pid`` fixture) and clears it afterwards, so a
shared, long-lived store is fine. The in-memory reference client is the executable spec: this
suite checks that a backend behaves like it, not how it stores data.

The suite's parts, each a base of :class:`DataPlaneConformance`: the by-key contract (here);
large reads (:class:`~nemo_dataplane.testing.scale_conformance.ScaleConformance`); claims
(:class:`~nemo_dataplane.testing.claim_conformance.ClaimConformance`; a backend without them sets
``supports_claims = False``); use after close, the bootstrap modes, owner-only teardown and other
processes (:class:`~nemo_dataplane.testing.lifecycle_conformance.LifecycleConformance`, which
says what ``remote_config``/``fresh_config`` mean and fails, rather than skips, what it cannot
run: a hook not defined, Ray not initialized).
"""

from __future__ import annotations

import asyncio
import math
import uuid
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch

from nemo_dataplane.client import DataPlaneClient
from nemo_dataplane.codec import SUPPORTED_DTYPES
from nemo_dataplane.meta import KVBatchMeta
from nemo_dataplane.testing.claim_conformance import ClaimConformance
from nemo_dataplane.testing.fields import assert_same_field, jagged, random_field, rows_of, unique_keys
from nemo_dataplane.testing.lifecycle_conformance import LifecycleConformance, conformance_ray
from nemo_dataplane.testing.scale_conformance import ScaleConformance, assert_rows

__all__ = ["DataPlaneConformance", "assert_rows", "assert_same_field", "conformance_ray", "jagged", "random_field"]


class DataPlaneConformance(ScaleConformance, ClaimConformance, LifecycleConformance):
    """Contract tests for a :class:`DataPlaneClient`; subclass, provide ``client`` and define
    ``remote_config`` (and ``fresh_config``): see the module docstring."""

    @pytest.fixture
    def client(self) -> Iterator[DataPlaneClient]:
        raise NotImplementedError("subclasses provide a `client` fixture yielding the backend under test")

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

    def test_tag_values_round_trip_with_their_types(self, client: DataPlaneClient, pid: str) -> None:
        values: dict[str, Any] = {
            "none": None,
            "yes": True,
            "no": False,
            "zero": 0,
            "neg": -7,
            "max64": 2**63 - 1,
            "min64": -(2**63),
            "half": 0.5,
            "negzero": -0.0,
            "nan": float("nan"),
            "inf": float("inf"),
            "ninf": float("-inf"),
            "tiny": 5e-324,
            "text": "h\u00e9llo \u2713 \U0001f600",
            "empty": "",
            "list": [1, 2.5, "x", None, True, [3, []]],
            "dict": {"a": 1, "b": {"c": [False, {}]}},
        }
        keys = unique_keys(2)
        meta = client.kv_batch_put(keys, pid, {"x": torch.zeros(2)}, tags=[values, {"only": 1}])
        _assert_same_tags("the put's meta", meta.tags[0], values)
        _assert_same_tags("kv_list", client.kv_list(pid).tags[0], values)
        merged = {**values, "zero": 1.0, "one": [None]}  # an int replaced by a float, a new list
        _assert_same_tags(
            "a tags-only upsert",
            client.kv_batch_put(keys[:1], pid, None, [{"zero": 1.0, "one": [None]}]).tags[0],
            merged,
        )
        _assert_same_tags("kv_list after the upsert", client.kv_list(pid).tags[0], merged)
        if self.supports_claims:
            _assert_same_tags("kv_claim", client.kv_claim(pid, "tags", ["x"], 1, 0).tags[0], merged)

    def test_tag_values_that_are_not_json_values_are_refused_naming_the_tag(
        self, client: DataPlaneClient, pid: str
    ) -> None:
        bad: list[tuple[Any, Any]] = [
            ("pair", (1, 2)),
            ("tensor", torch.tensor(1)),
            ("np_float", np.float32(1.0)),
            ("raw", b"x"),
            ("a_set", {1}),
            ("huge", 2**64),
            ("nested", [1, (2,)]),
            ("int_named", {1: "a"}),
        ]
        for name, value in bad:
            with pytest.raises(TypeError, match=repr(name)):
                client.kv_batch_put(["k"], pid, {"x": torch.zeros(1)}, tags=[{name: value}])
            with pytest.raises(TypeError, match=repr(name)):
                client.kv_batch_put(["k"], pid, None, tags=[{name: value}])
        bad_names: list[Any] = [1, ""]  # deliberately not tag names
        for bad_name in bad_names:
            with pytest.raises(TypeError, match="tag name"):
                client.kv_batch_put(["k"], pid, {"x": torch.zeros(1)}, tags=[{bad_name: 1}])
        assert client.kv_list(pid).keys == ()  # nothing written

    def test_meta_fields_name_each_field_once_in_any_order(self, client: DataPlaneClient, pid: str) -> None:
        keys = unique_keys(3)
        metas = [
            ("a put", client.kv_batch_put(keys, pid, {"b": torch.zeros(3), "a": jagged([1, 2, 3])}), {"a", "b"}),
            # an upsert in reversed key order, one field again and one new
            (
                "an upsert",
                client.kv_batch_put(keys[::-1], pid, {"c": torch.ones(3), "a": jagged([3, 0, 2], seed=1)}),
                {"a", "b", "c"},
            ),
            ("a put to some keys", client.kv_batch_put(keys[1:], pid, {"d": torch.ones(2)}), {"a", "b", "c", "d"}),
            ("kv_list", client.kv_list(pid), {"a", "b", "c"}),
        ]
        for what, meta, want in metas:
            fields = list(meta.fields or ())
            assert len(fields) == len(set(fields)), f"{what}: meta.fields names a field twice: {fields}"
            assert set(fields) == want, f"{what}: meta.fields {sorted(fields)}, stored on every key: {sorted(want)}"
        if self.supports_claims:  # a claim's meta names at least the fields it claimed by, at most those stored
            fields = list(client.kv_claim(pid, "f", ["d", "a"], 2, 0).fields or ())
            assert len(fields) == len(set(fields)), f"kv_claim: meta.fields names a field twice: {fields}"
            assert {"a", "d"} <= set(fields) <= {"a", "b", "c", "d"}, f"kv_claim: meta.fields {sorted(fields)}"

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


def _same_tag_value(a: Any, b: Any) -> bool:
    """Equal and of the same type, all the way down; NaN equals NaN, -0.0 is not 0.0."""
    if type(a) is not type(b):
        return False
    if isinstance(a, float):
        return (math.isnan(a) and math.isnan(b)) or (a == b and math.copysign(1.0, a) == math.copysign(1.0, b))
    if isinstance(a, list):
        return len(a) == len(b) and all(_same_tag_value(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same_tag_value(a[k], b[k]) for k in a)
    return bool(a == b)


def _assert_same_tags(what: str, got: Any, want: dict[str, Any]) -> None:
    assert isinstance(got, dict), f"{what}: tags are a {type(got).__name__}, not a dict"
    assert set(got) == set(want), f"{what}: tag names {sorted(got)} != {sorted(want)}"
    wrong = {k: (got[k], want[k]) for k in want if not _same_tag_value(got[k], want[k])}
    assert not wrong, f"{what}: tags changed value or type (got, put): {wrong!r}"
