"""TransferQueue's own ``KVBatchMeta`` contract (its tests/test_metadata.py), run against ours.

Written afresh from the behaviours TransferQueue 0.1.11 tests, not copied. Deliberate
differences, each asserted here as ours: sequences are tuples (not lists), and the meta is
frozen, so ``reorder`` returns a new meta instead of permuting in place. Every test also runs
the same scenario through ``transfer_queue.metadata.KVBatchMeta`` so a change of behaviour in
either class shows up as a failure here.
"""

from __future__ import annotations

from typing import Any

import pytest
from transfer_queue.metadata import KVBatchMeta as TQMeta

from nemo_dataplane.meta import KVBatchMeta


def _both(**kw: Any) -> tuple[KVBatchMeta, TQMeta]:
    return KVBatchMeta(**kw), TQMeta(**kw)


def test_init_and_sizes() -> None:
    ours, theirs = _both(
        keys=["a", "b", "c"], tags=[{"s": 0}, {"s": 1}, {"s": 2}], partition_id="p0", fields=["f1", "f2"]
    )
    assert ours.size == theirs.size == len(ours) == 3
    assert list(ours.keys) == theirs.keys and ours.partition_id == theirs.partition_id == "p0"
    assert list(ours.fields or ()) == theirs.fields


def test_empty_init() -> None:
    ours, theirs = KVBatchMeta(), TQMeta()
    assert ours.size == theirs.size == 0
    assert ours.keys == () and ours.tags == () and ours.partition_id is None and ours.fields is None
    assert theirs.fields is None


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        (dict(keys=["a", "b"], tags=[{}]), "keys and tags must have same length"),
        (dict(keys=["a", "a"], tags=[{}, {}]), "Got duplicated keys"),
        (dict(keys=["a"], tags=[{}], fields=["f", "f"]), "Got duplicated fields"),
    ],
)
def test_init_validation(kw: dict[str, Any], message: str) -> None:
    for cls in (KVBatchMeta, TQMeta):
        with pytest.raises(ValueError, match=message):
            cls(**kw)


def test_select_keys_keeps_partition_fields_extra_info() -> None:
    kw = dict(
        keys=["a", "b", "c"],
        tags=[{"i": 0}, {"i": 1}, {"i": 2}],
        partition_id="p0",
        fields=["f1", "f2"],
        extra_info={"t": "v"},
    )
    for m in _both(**kw):
        sel = m.select_keys(["a", "c"])
        assert list(sel.keys) == ["a", "c"] and list(sel.tags) == [{"i": 0}, {"i": 2}]
        assert sel.partition_id == "p0" and list(sel.fields) == ["f1", "f2"] and sel.extra_info == {"t": "v"}


def test_select_keys_errors() -> None:
    for m in _both(keys=["a", "b", "c"], tags=[{}, {}, {}]):
        with pytest.raises(ValueError, match="Contain duplicate keys"):
            m.select_keys(["a", "a"])
        with pytest.raises(RuntimeError, match="not found in current batch"):
            m.select_keys(["a", "nope"])
    with pytest.raises(KeyError):  # ours is also a KeyError, for this library's callers
        KVBatchMeta(keys=["a"], tags=[{}]).select_keys(["nope"])


def test_reorder() -> None:
    kw = dict(keys=["a", "b", "c"], tags=[{"i": 0}, {"i": 1}, {"i": 2}])
    ours, theirs = _both(**kw)
    theirs.reorder([2, 0, 1])  # in place
    new = ours.reorder([2, 0, 1])  # ours: a new meta, the old one unchanged
    assert list(new.keys) == theirs.keys == ["c", "a", "b"]
    assert list(new.tags) == theirs.tags == [{"i": 2}, {"i": 0}, {"i": 1}]
    assert ours.keys == ("a", "b", "c")


@pytest.mark.parametrize(("indexes", "message"), [([0, 1], "does not match"), ([0, 0, 1], "Contain duplicate indexes")])
def test_reorder_validation(indexes: list[int], message: str) -> None:
    for m in _both(keys=["a", "b", "c"], tags=[{}, {}, {}]):
        with pytest.raises(ValueError, match=message):
            m.reorder(indexes)


def test_chunk() -> None:
    kw = dict(
        keys=[f"k{i}" for i in range(10)],
        tags=[{"i": i} for i in range(10)],
        partition_id="p0",
        fields=["f1"],
        extra_info={"t": "v"},
    )
    for m in _both(**kw):
        parts = m.chunk(3)
        assert [len(p) for p in parts] == [4, 3, 3]
        assert parts[0].partition_id == "p0" and list(parts[0].fields) == ["f1"] and parts[0].extra_info == {"t": "v"}
        assert list(parts[0].keys) == ["k0", "k1", "k2", "k3"] and list(parts[1].keys) == ["k4", "k5", "k6"]
        assert list(parts[1].tags) == [{"i": 4}, {"i": 5}, {"i": 6}]


def test_chunk_more_chunks_than_samples() -> None:
    for m in _both(keys=["a", "b"], tags=[{}, {}]):
        assert [len(p) for p in m.chunk(5)] == [1, 1, 0, 0, 0]


def test_concat() -> None:
    a = dict(keys=["k0", "k1"], tags=[{"i": 0}, {"i": 1}], partition_id="p0", fields=["f1"], extra_info={"t": "v"})
    b = dict(keys=["k2", "k3"], tags=[{"i": 2}, {"i": 3}], partition_id="p0", fields=["f1"], extra_info={"t": "v"})
    for cls in (KVBatchMeta, TQMeta):
        r = cls.concat([cls(**a), cls(**b)])
        assert r.size == 4 and list(r.keys) == ["k0", "k1", "k2", "k3"]
        assert list(r.tags) == [{"i": 0}, {"i": 1}, {"i": 2}, {"i": 3}]
        assert r.partition_id == "p0" and list(r.fields) == ["f1"] and r.extra_info == {"t": "v"}


def test_concat_skips_empty_metas_and_empty_list() -> None:
    for cls in (KVBatchMeta, TQMeta):
        r = cls.concat([cls(), cls(keys=["k0"], tags=[{"i": 0}]), cls()])
        assert list(r.keys) == ["k0"] and list(r.tags) == [{"i": 0}]
        e = cls.concat([])
        assert e.size == 0 and len(e.keys) == 0 and len(e.tags) == 0
        # an empty meta of another partition is skipped before partitions are compared
        r = cls.concat([cls(partition_id="other"), cls(keys=["k0"], tags=[{}], partition_id="p0")])
        assert r.partition_id == "p0"


@pytest.mark.parametrize(
    ("other", "message"),
    [
        (dict(fields=["f2"]), "Field names do not match"),
        (dict(partition_id="p1"), "Partition do not match"),
        (dict(extra_info={"step": 2}), "conflicting"),
    ],
)
def test_concat_validation(other: dict[str, Any], message: str) -> None:
    base = dict(keys=["k0"], tags=[{}], partition_id="p0", fields=["f1"], extra_info={"step": 1})
    for cls in (KVBatchMeta, TQMeta):
        with pytest.raises(ValueError, match=message):
            cls.concat([cls(**base), cls(**{**base, "keys": ["k1"], **other})])


def test_tags_and_extra_info_are_deep_copied() -> None:
    tags = [{"data": [1, 2, 3]}]
    extra = {"nested": {"value": 1}}
    for cls in (KVBatchMeta, TQMeta):
        m = cls(keys=["k"], tags=tags, extra_info=extra)
        m.tags[0]["data"].append(4)
        m.extra_info["nested"]["value"] = 999
        assert tags[0]["data"] == [1, 2, 3] and extra["nested"]["value"] == 1
