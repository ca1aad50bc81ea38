"""Property-based fuzzing (hypothesis) of the pure parts: meta transforms, codec round trips,
planners and pre-shards, config loading. The only exceptions allowed are the documented ones.

``max_examples`` is kept small per test so the module runs in well under 30 s on one core.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from transfer_queue.metadata import KVBatchMeta as TQMeta

from algorithms.config import TrainerConfig, load_config
from nemo_dataplane.adapters.memory import InMemoryClient
from nemo_dataplane.codec import DTYPE_CODES
from nemo_dataplane.config import ConfigError, PackingConfig, config_key
from nemo_dataplane.driver.preshard import driver_balanced_preshards
from nemo_dataplane.meta import KVBatchMeta, MissingKeysError
from nemo_dataplane.testing.fields import assert_same_field, random_field

FAST = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# ------------------------------------------------------------------ KVBatchMeta
tag_values = st.one_of(st.integers(-5, 5), st.text(max_size=3), st.none(), st.lists(st.integers(0, 3), max_size=2))
metas = st.builds(
    lambda keys, tags, pid, fields, info: KVBatchMeta(
        keys=keys, tags=tags[: len(keys)], partition_id=pid, fields=fields, extra_info=info
    ),
    st.lists(st.text(min_size=1, max_size=4), unique=True, max_size=12),
    st.lists(st.dictionaries(st.sampled_from("abc"), tag_values, max_size=2), min_size=12, max_size=12),
    st.one_of(st.none(), st.sampled_from(["train", "val"])),
    st.one_of(st.none(), st.lists(st.sampled_from(["ids", "logp", "adv", "r"]), unique=True, max_size=4)),
    st.dictionaries(st.sampled_from(["plan", "step"]), tag_values, max_size=2),
)


@FAST
@given(m=metas, n=st.integers(1, 15))
def test_meta_chunk_concat_inverse_and_matches_transfer_queue(m: KVBatchMeta, n: int) -> None:
    parts = m.chunk(n)
    assert len(parts) == n and max(map(len, parts)) - min(map(len, parts)) <= 1
    joined = KVBatchMeta.concat(parts)
    if len(m):
        assert joined == m
    else:
        assert joined == KVBatchMeta()  # all parts empty: TransferQueue's empty meta
    theirs = [p.keys for p in m.to_transfer_queue().chunk(n)]
    assert [list(p.keys) for p in parts] == theirs
    tq_joined = TQMeta.concat([p.to_transfer_queue() for p in parts])
    assert list(joined.keys) == tq_joined.keys and list(joined.tags) == tq_joined.tags


@FAST
@given(m=metas, data=st.data())
def test_meta_reorder_select_round_trip(m: KVBatchMeta, data: st.DataObject) -> None:
    perm = data.draw(st.permutations(range(len(m))))
    r = m.reorder(perm)
    inverse = sorted(range(len(perm)), key=lambda i: perm[i])
    assert r.reorder(inverse) == m
    chosen = data.draw(st.lists(st.sampled_from(m.keys), unique=True) if len(m) else st.just([]))
    s = m.select_keys(chosen)
    assert list(s.keys) == chosen
    assert [t for t in s.tags] == [m.tags[m.keys.index(k)] for k in chosen]
    assert s.fields == m.fields and s.extra_info == m.extra_info and s.partition_id == m.partition_id
    with pytest.raises(MissingKeysError):
        m.select_keys([*chosen, "\x00absent"])
    assert KVBatchMeta.from_transfer_queue(m.to_transfer_queue()) == m


@FAST
@given(a=metas, b=metas)
def test_meta_concat_only_documented_errors_and_agrees_with_transfer_queue(a: KVBatchMeta, b: KVBatchMeta) -> None:
    try:
        ours: KVBatchMeta | Exception = KVBatchMeta.concat([a, b])
    except ValueError as e:
        ours = e
    try:
        theirs: Any = TQMeta.concat([a.to_transfer_queue(), b.to_transfer_queue()])
    except ValueError as e:
        theirs = e
    # Deliberate differences: unknown fields (None) next to known ones make ours unknown, and
    # empty extra_info stays {} (TransferQueue: None); everything else must agree.
    if isinstance(ours, Exception) or isinstance(theirs, Exception):
        none_mix = len(a) and len(b) and (a.fields is None) != (b.fields is None)
        if not none_mix:
            assert type(ours) is type(theirs), (ours, theirs)
        return
    assert list(ours.keys) == theirs.keys and list(ours.tags) == theirs.tags
    assert ours.partition_id == theirs.partition_id
    assert ours.extra_info == (theirs.extra_info or {})


# ------------------------------------------------------------------ codec round trips
SPECIAL = {
    torch.float16: [float("nan"), float("inf"), -float("inf"), 65504.0, -0.0],
    torch.bfloat16: [float("nan"), float("inf"), 3.0e38, -0.0],
    torch.float32: [float("nan"), -float("inf"), 3.4e38, 1e-45, -0.0],
    torch.float64: [float("nan"), float("inf"), 1.7e308, 5e-324, -0.0],
    torch.int64: [2**63 - 1, -(2**63)],
    torch.int32: [2**31 - 1, -(2**31)],
    torch.int16: [2**15 - 1, -(2**15)],
    torch.int8: [127, -128],
    torch.uint8: [255, 0],
    torch.bool: [True, False],
}


def _with_specials(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    flat = t.reshape(-1)
    for i, v in enumerate(SPECIAL[dtype][: flat.numel()]):
        flat[i] = v
    return t


@FAST
@given(
    dtype=st.sampled_from(DTYPE_CODES),
    batch=st.integers(1, 6),
    rest=st.lists(st.integers(0, 3), max_size=2),
    lengths=st.lists(st.integers(0, 5), min_size=1, max_size=6),
    seed=st.integers(0, 2**16),
)
def test_codec_round_trip_is_bit_exact(
    dtype: torch.dtype, batch: int, rest: list[int], lengths: list[int], seed: int
) -> None:
    dense = _with_specials(random_field((batch, *rest), dtype, seed), dtype)
    values = _with_specials(random_field((sum(lengths), 2), dtype, seed + 1), dtype)
    offsets = torch.tensor([0, *torch.cumsum(torch.tensor(lengths), 0).tolist()], dtype=torch.int64)
    jag = torch.nested.nested_tensor_from_jagged(values, offsets=offsets)
    client = InMemoryClient()
    try:
        keys_d = [f"d{i}" for i in range(batch)]
        keys_j = [f"j{i}" for i in range(len(lengths))]
        client.kv_batch_put(keys_d, "p", {"x": dense})
        client.kv_batch_put(keys_j, "p", {"ids": jag})
        assert_same_field("x", client.kv_batch_get(keys_d, ["x"], "p")["x"], dense)
        assert_same_field("ids", client.kv_batch_get(keys_j, ["ids"], "p")["ids"], jag)
        client.kv_clear(None, "p")
        assert len(client.kv_list("p")) == 0
    finally:
        client.close()


# ------------------------------------------------------------------ planners / pre-shards
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    lens=st.lists(st.integers(0, 2000), max_size=64),
    dp=st.integers(1, 9),
    mode=st.sampled_from(["none", "sequence", "dynamic"]),
    budget=st.integers(1, 1500),
)
def test_driver_balanced_preshards_any_lengths_any_dp(lens: list[int], dp: int, mode: str, budget: int) -> None:
    cfg = (
        PackingConfig(mode=mode, micro_batch_size=max(1, budget // 100))
        if mode == "none"
        else PackingConfig(mode=mode, max_tokens_per_microbatch=budget)
    )
    meta = KVBatchMeta(keys=[f"k{i}" for i in range(len(lens))], tags=[{"seq_len": s} for s in lens], partition_id="p")
    try:
        p = driver_balanced_preshards(meta, dp, cfg)
    except ValueError as e:  # documented: fewer samples than ranks, or too few for the bins
        assert len(lens) < dp or "cannot" in str(e), e
        return
    flat = [i for r in p.rank_indices for i in r]
    assert sorted(flat) == list(range(len(lens)))  # every sample exactly once
    assert len({len(m) for m in p.microbatches}) == 1  # equal micro-batch counts on every rank
    assert p.restore_order([[f"k{i}" for i in r] for r in p.rank_indices]) == list(meta.keys)
    assert [flat[p.inverse_permutation[j]] for j in range(len(lens))] == list(range(len(lens)))


# ------------------------------------------------------------------ config loading
BASE = ["policy.model.arch=gpt2", "policy.model.hf_config={n_layer: 1}"]


def _leaves(cls: type, prefix: str = "") -> list[tuple[str, Any]]:
    out: list[tuple[str, Any]] = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        key = f"{prefix}{config_key(f)}"
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            out += _leaves(tp, key + ".")
        else:
            out.append((key, tp))
    return out


LEAVES = [(k, tp) for k, tp in _leaves(TrainerConfig) if tp is not Any and k != "data_plane.backend_kwargs"]
NUMERIC = [k for k, tp in LEAVES if tp in (int, float) or tp in (int | None, float | None)]


def _wrong_value(tp: Any) -> Any:
    """A value no field of type ``tp`` accepts."""
    origin = typing.get_origin(tp)
    if origin is typing.Literal:
        return "\u2603not-an-option"
    members = typing.get_args(tp) if origin in (typing.Union, types.UnionType) else ()
    if any(typing.get_origin(a) is typing.Literal for a in members) and str not in members:
        return "\u2603not-an-option"  # e.g. int | "auto": neither a number nor the option
    if tp in (int, float) or tp in (int | None, float | None):
        return "twelve"
    if tp is bool:
        return "maybe"
    if tp in (str, str | None):
        return 12
    if origin is tuple:
        return "x"
    return 7  # mappings


def _set(data: dict[str, Any], dotted: str, value: Any) -> dict[str, Any]:
    node = data
    *parents, leaf = dotted.split(".")
    for p in parents:
        node = node.setdefault(p, {})
    node[leaf] = value
    return data


def _base() -> dict[str, Any]:
    return {"policy": {"model": {"arch": "gpt2", "hf_config": {"n_layer": 1}}}}


@FAST
@given(
    key=st.sampled_from(["mode", "max_tokens_per_microbatch", "micro_batch_size"]),
    value=st.sampled_from(["none", "sequence", "dynamic", 1, 7, 4096]),
)
def test_one_packing_key_keeps_the_other_section_defaults(key: str, value: Any) -> None:
    """Regression (fuzz finding): a single ``data_plane.packing.*`` key used to replace the
    section and drop its default ``micro_batch_size=4``; sections now merge per key."""
    assume(isinstance(value, str) == (key == "mode"))
    try:
        packing = TrainerConfig.from_dict(_set(_base(), f"data_plane.packing.{key}", value)).data_plane.packing
    except ConfigError as e:
        # Only "sequence"/"dynamic" without a token budget is incomplete; the error names it.
        assert key == "mode" and value != "none" and "max_tokens_per_microbatch" in str(e), str(e)
        return
    assert getattr(packing, key) == value
    for other, default in (("mode", "none"), ("max_tokens_per_microbatch", None), ("micro_batch_size", 4)):
        if other != key:
            assert getattr(packing, other) == default, (other, packing)
    cli = load_config(None, ["policy.model.arch=gpt2", f"data_plane.packing.{key}={value}"]).data_plane.packing
    assert cli == packing  # the same through CLI overrides


def test_base_config_is_valid() -> None:
    TrainerConfig.from_dict(_base())


@FAST
@given(leaf=st.sampled_from(LEAVES))
def test_config_wrong_type_names_the_key(leaf: tuple[str, Any]) -> None:
    key, tp = leaf
    with pytest.raises(ConfigError) as e:
        TrainerConfig.from_dict(_set(_base(), key, _wrong_value(tp)))
    assert key in str(e.value)


@FAST
@given(
    section=st.sampled_from(sorted({k.rsplit(".", 1)[0] for k, _ in LEAVES if "." in k})),
    name=st.from_regex(r"[a-z_]{1,12}", fullmatch=True),
)
def test_config_unknown_key_names_the_key(section: str, name: str) -> None:
    assume(f"{section}.{name}" not in {k for k, _ in LEAVES} and name not in {"backend_kwargs"})
    assume(not any(k.startswith(f"{section}.{name}.") for k, _ in LEAVES))
    with pytest.raises(ConfigError, match="unknown config key") as e:
        TrainerConfig.from_dict(_set(_base(), f"{section}.{name}", 1))
    assert f"{section}.{name}" in str(e.value)


@FAST
@given(key=st.sampled_from(NUMERIC), value=st.one_of(st.integers(-(10**6), 10**6), st.floats(allow_nan=True)))
def test_config_any_number_is_accepted_or_refused_naming_the_key(key: str, value: float) -> None:
    tp = dict(LEAVES)[key]
    if tp in (int, int | None):
        value = int(value) if isinstance(value, float) and math.isfinite(value) else value
    try:
        TrainerConfig.from_dict(_set(_base(), key, value))
    except ConfigError as e:
        assert key in str(e), (key, value, str(e))


@pytest.mark.parametrize(
    "key",
    [
        k
        for k in NUMERIC
        if k.endswith(("timeout_s", "steps", "dp_size", "bucket_bytes", "prompts_per_step", "claim_poll_s"))
    ],
)
def test_config_out_of_range_refused_naming_the_key(key: str) -> None:
    with pytest.raises(ConfigError) as e:
        TrainerConfig.from_dict(_set(_base(), key, -1))
    assert key in str(e.value)


@FAST
@given(leaf=st.sampled_from(LEAVES))
def test_config_override_strings_of_the_wrong_type_name_the_key(leaf: tuple[str, Any]) -> None:
    key, tp = leaf
    assume(tp not in (str, str | None))  # any override string is a valid string
    try:
        load_config(None, [*BASE, f"{key}=\u2603x"])
    except ConfigError as e:
        assert key in str(e)
    else:
        raise AssertionError(f"{key}={chr(0x2603)}x accepted")
