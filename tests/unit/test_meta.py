"""KVBatchMeta: validation, transforms (pure, never aliasing), lossless TransferQueue round trips."""

from __future__ import annotations

import pytest

from nemo_dataplane.meta import KVBatchMeta


def _meta(n: int = 5, **kw: object) -> KVBatchMeta:
    return KVBatchMeta(
        keys=[f"k{i}" for i in range(n)],
        tags=[{"i": i, "len": 10 * i} for i in range(n)],
        partition_id=kw.pop("partition_id", "train"),  # type: ignore[arg-type]
        fields=kw.pop("fields", ("ids", "logp")),  # type: ignore[arg-type]
        extra_info=kw.pop("extra_info", {"plan": [1, 2]}),  # type: ignore[arg-type]
    )


# ---------------------------------------------------------------- validation
@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"keys": ["a", "b"], "tags": [{}]}, r"one tag dict per key\): got 1 tags for 2 keys"),
        ({"keys": ["a", "a"], "tags": [{}, {}]}, r"Got duplicated keys \[.a.\]"),
        ({"keys": ["a", 3], "tags": [{}, {}]}, r"keys\[1\] must be a str"),
        ({"keys": ["a"], "tags": ["x"]}, r"tags\[0\] \(key 'a'\) must be a dict"),
        ({"keys": ["a"], "tags": [{}], "fields": ["f", "f"]}, "fields: Got duplicated fields"),
        ({"keys": ["a"], "tags": [{}], "partition_id": 7}, "partition_id must be a str"),
    ],
)
def test_invalid_metas_are_rejected_with_a_reason(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        KVBatchMeta(**kwargs)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"keys": "abc", "tags": [{}, {}, {}]},  # would be the keys "a", "b", "c"
        {"keys": b"ab", "tags": [{}, {}]},
        {"keys": ["a"], "tags": [{}], "fields": "ids"},  # would be the fields "i", "d", "s"
    ],
)
def test_one_string_for_keys_or_fields_is_refused_not_split(kwargs: dict) -> None:
    name = "fields" if "fields" in kwargs else "keys"
    with pytest.raises(TypeError, match=rf"KVBatchMeta\.{name} must be a sequence of str"):
        KVBatchMeta(**kwargs)


def test_meta_is_frozen_and_owns_its_dicts() -> None:
    tags = [{"i": 0}]
    info = {"plan": [1]}
    m = KVBatchMeta(keys=["a"], tags=tags, extra_info=info)
    tags[0]["i"] = 99
    info["plan"].append(2)
    assert m.tags[0] == {"i": 0} and m.extra_info == {"plan": [1]}
    with pytest.raises(AttributeError):
        m.keys = ("b",)  # type: ignore[misc]
    assert isinstance(m.keys, tuple) and isinstance(m.tags, tuple)
    # tag values that are containers are copied deeply (scalars-only tags take a shallow path)
    nested = [{"spans": [1, 2], "n": 3}, {"n": 4}]
    m2 = KVBatchMeta(keys=["a", "b"], tags=nested)
    nested[0]["spans"].append(3)
    nested[1]["n"] = 0
    assert m2.tags == ({"spans": [1, 2], "n": 3}, {"n": 4})
    assert m2.subset([0]).tags[0]["spans"] is not m2.tags[0]["spans"]


# ---------------------------------------------------------------- transforms
def test_subset_reorder_select_keys() -> None:
    m = _meta()
    s = m.subset([3, -1, 0])
    assert s.keys == ("k3", "k4", "k0") and [t["i"] for t in s.tags] == [3, 4, 0]
    assert s.partition_id == "train" and s.fields == ("ids", "logp") and s.extra_info == {"plan": [1, 2]}
    with pytest.raises(IndexError, match="index 5 out of range"):
        m.subset([5])
    with pytest.raises(ValueError, match="repeated"):
        m.subset([1, -4])  # same key twice through a negative index
    r = m.reorder([4, 3, 2, 1, 0])
    assert r.keys == tuple(reversed(m.keys))
    with pytest.raises(ValueError, match="does not match"):
        m.reorder([0, 1, 2])
    with pytest.raises(ValueError, match="permutation"):
        m.reorder([0, 1, 2, 3, 7])
    sk = m.select_keys(["k2", "k0"])
    assert sk.keys == ("k2", "k0") and sk.tags[0]["i"] == 2
    with pytest.raises(KeyError, match="zz"):
        m.select_keys(["k1", "zz"])
    with pytest.raises(RuntimeError, match="not found in current batch"):  # TransferQueue's type
        m.select_keys(["zz"])
    with pytest.raises(ValueError, match="duplicate"):
        m.select_keys(["k1", "k1"])


def test_chunk_sizes_and_concat_inverse() -> None:
    m = _meta(7)
    parts = m.chunk(3)
    assert [len(p) for p in parts] == [3, 2, 2]
    assert KVBatchMeta.concat(parts) == m
    assert [len(p) for p in m.chunk(10)] == [1] * 7 + [0] * 3
    with pytest.raises(ValueError, match="n must be >= 1"):
        m.chunk(0)


def test_concat_rules() -> None:
    a = _meta(2, fields=("ids", "logp", "r"))
    b = KVBatchMeta(
        keys=["x"], tags=[{}], partition_id="train", fields=("r", "ids", "logp"), extra_info={"plan": [1, 2]}
    )
    c = KVBatchMeta.concat([a, b])
    assert c.keys == ("k0", "k1", "x") and c.fields == ("ids", "logp", "r")  # same set, first's order
    assert KVBatchMeta.concat([a, b.replace_fields(None)]).fields is None  # unknown for some keys
    with pytest.raises(ValueError, match="Field names do not match"):
        KVBatchMeta.concat([a, b.replace_fields(["r", "ids"])])
    with pytest.raises(ValueError, match="Partition do not match"):
        KVBatchMeta.concat([a, KVBatchMeta(keys=["y"], tags=[{}], partition_id="val")])
    with pytest.raises(ValueError, match="duplicated keys"):
        KVBatchMeta.concat([a, a])
    with pytest.raises(ValueError, match="'plan' has conflicting"):
        KVBatchMeta.concat([a, b.with_extra_info(plan=[9])])
    u = KVBatchMeta.concat([a, b.with_extra_info(step=4)])
    assert u.extra_info == {"plan": [1, 2], "step": 4}  # union
    assert KVBatchMeta.concat([]) == KVBatchMeta()
    # empties are skipped before the partition check
    assert KVBatchMeta.concat([KVBatchMeta(partition_id="val"), a]) == a


def test_field_and_info_transforms_return_new_metas() -> None:
    m = _meta()
    assert m.replace_fields(["a"]).fields == ("a",) and m.fields == ("ids", "logp")
    assert m.add_fields(["logp", "adv"]).fields == ("ids", "logp", "adv")
    assert KVBatchMeta(keys=["a"], tags=[{}], fields=None).add_fields(["x"]).fields == ("x",)
    e = m.with_extra_info(step=3)
    assert e.extra_info == {"plan": [1, 2], "step": 3} and m.extra_info == {"plan": [1, 2]}


def test_merge_tags_and_tag_values() -> None:
    m = _meta(3)
    s = m.merge_tags({"step": 1})
    assert all(t["step"] == 1 for t in s.tags) and "step" not in m.tags[0]
    p = m.merge_tags([{"a": 1}, {"a": 2}, {"len": -1}])
    assert p.tag_values("len") == [0, 10, -1]
    with pytest.raises(ValueError, match="3 keys"):
        m.merge_tags([{"a": 1}])
    with pytest.raises(KeyError, match=r"missing on 1 key\(s\), e.g. \[.k2.\]"):
        p.tag_values("a")


# ------------------------------------------------------------ TQ round trips
@pytest.mark.parametrize("fields", [("ids", "logp"), None, ()])
@pytest.mark.parametrize("extra_info", [{"plan": {"mb": [[0, 1]]}}, None, {}])
def test_lossless_round_trip_through_transfer_queue_meta(fields: tuple | None, extra_info: dict | None) -> None:
    from transfer_queue.metadata import KVBatchMeta as TQMeta

    m = KVBatchMeta(
        keys=["a", "b"], tags=[{"x": 1}, {"y": [2]}], partition_id="p", fields=fields, extra_info=extra_info
    )
    tq = m.to_transfer_queue()
    assert isinstance(tq, TQMeta)
    assert tq.keys == ["a", "b"] and tq.tags == [{"x": 1}, {"y": [2]}] and tq.partition_id == "p"
    assert tq.fields == (None if fields is None else list(fields))
    back = KVBatchMeta.from_transfer_queue(tq)
    assert back == m
    assert back.extra_info == extra_info and back.fields == (None if fields is None else tuple(fields))
    # the other direction: a meta TransferQueue built itself
    native = TQMeta(keys=["q"], tags=[{"t": 1}], partition_id="p", fields=None, extra_info=None)
    again = KVBatchMeta.from_transfer_queue(native).to_transfer_queue()
    assert (again.keys, again.tags, again.partition_id, again.fields, again.extra_info) == (
        native.keys,
        native.tags,
        native.partition_id,
        native.fields,
        native.extra_info,
    )
    # no aliasing across the boundary
    tq.tags[0]["x"] = 42
    assert m.tags[0] == {"x": 1}
