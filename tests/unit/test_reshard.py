"""The resharding plan (in process): pieces, coverage, replica spreading, fallback, messages, errors."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from nemo_dataplane.refit.reshard.layout import Mesh
from nemo_dataplane.refit.reshard.p2p import Exchange
from nemo_dataplane.refit.reshard.plan import ReshardPlanError, plan_reshard
from nemo_dataplane.refit.reshard.rules import DEFAULT_FUSIONS, build_layout

sys.path.insert(0, str(Path(__file__).parent))
import _reshard_procs as R  # noqa: E402


def test_tp2_to_tp1_worked_example() -> None:
    """The example of docs/refit.md, section 6."""
    shapes = {"o.weight": ((4, 6), torch.bfloat16), "q_proj.weight": ((4, 6), torch.bfloat16)}
    rules = ((r"^o\.", "row"), (r"q_proj", "column"))
    src = build_layout(Mesh.of([0, 1], tp=2), shapes, rules=rules)
    dst = build_layout(Mesh.of([2], tp=1), shapes, rules=rules)
    plan = plan_reshard(src, dst, bucket_bytes=1024)
    got = [(p.param, p.box, p.src, p.dst, p.nbytes) for p in plan.pieces]
    assert got == [
        ("o.weight", ((0, 4), (0, 3)), 0, 2, 24),  # row-parallel: each sender's columns
        ("o.weight", ((0, 4), (3, 6)), 1, 2, 24),
        ("q_proj.weight", ((0, 2), (0, 6)), 0, 2, 24),  # column-parallel: each sender's rows
        ("q_proj.weight", ((2, 4), (0, 6)), 1, 2, 24),
    ]
    assert plan.bytes_to(2) == plan.owned_bytes(2) == 96 and plan.fallback == ()
    # o's columns land strided in the receiver's tensor, so they are packed; one bucket per pair
    (m,) = plan.messages(0, 2)
    assert not m.direct and m.nbytes == 48
    assert [(e.param, e.dst_region, e.offset) for e in m.entries] == [
        ("o.weight", ((0, 4), (0, 3)), 0),
        ("q_proj.weight", ((0, 2), (0, 6)), 24),
    ]


@pytest.mark.parametrize("case", sorted(R.RESHARD_CASES))
def test_every_receiver_gets_exactly_what_it_owns(case: str) -> None:
    src, dst = R.reshard_layouts(case)
    plan = plan_reshard(src, dst, bucket_bytes=1024)
    for r in dst.mesh.ranks:
        assert plan.bytes_to(r) == plan.owned_bytes(r) > 0
        # the pieces tile each local part exactly once: count every element
        for name, lt in dst.local_tensors(r).items():
            for param, box, _ in lt.parts:
                hits = torch.zeros([hi - lo for lo, hi in box], dtype=torch.int32)
                for p in plan.pieces:
                    if p.dst == r and p.param == param:
                        hits[tuple(slice(a - lo, b - lo) for (a, b), (lo, _) in zip(p.box, box))] += 1
                assert bool((hits == 1).all()), (case, r, name, param)
    assert sum(plan.bytes_from(s) for s in src.mesh.ranks) == plan.total_bytes
    # both ends of every pair see the same messages in the same rounds
    for s, r in plan.pairs:
        from_s = [m for rnd in plan.rounds(s) for m in rnd if m.dst == r]
        to_r = [m for rnd in plan.rounds(r) for m in rnd if m.src == s]
        assert from_s == to_r == plan.messages(s, r)


def test_replicas_share_the_sending() -> None:
    src, dst = R.reshard_layouts("dp2tp2->tp2")  # senders 0..3 = (dp, tp), receivers 4, 5
    plan = plan_reshard(src, dst, bucket_bytes=1024)
    assert all(plan.bytes_from(s) > 0 for s in src.mesh.ranks)
    for p in plan.pieces:  # a sender only ever sends what it holds
        assert src.box(p.param, p.src) is not None
    # each piece of a parameter comes from one replica; consecutive parameters alternate
    q0 = {p.src for p in plan.pieces if p.param == "model.layers.0.self_attn.q_proj.weight" and p.dst == 4}
    k0 = {p.src for p in plan.pieces if p.param == "model.layers.0.self_attn.k_proj.weight" and p.dst == 4}
    assert len(q0) == len(k0) == 1 and q0 != k0


def test_unknown_rule_moves_whole_from_one_sender() -> None:
    src, dst = R.reshard_layouts("tp2->tp1")
    plan = plan_reshard(src, dst, bucket_bytes=1024)
    assert plan.fallback == ("model.layers.0.mlp.router_A_log", "model.layers.1.self_attn.sinks")
    (p,) = [p for p in plan.pieces if p.param == "model.layers.0.mlp.router_A_log"]
    assert p.src == 0 and p.box == ((0, 5),)


def test_packing_is_aligned_bounded_and_directs_are_contiguous() -> None:
    src, dst = R.reshard_layouts("tp1->tp2")
    plan = plan_reshard(src, dst, bucket_bytes=600, direct_bytes=200)
    cap = 600 // 2  # sender 0 has two peers
    for s, r in plan.pairs:
        for m in plan.messages(s, r):
            if m.direct:
                (e,) = m.entries
                assert e.contiguous and e.nbytes >= 200
                continue
            assert m.nbytes <= cap
            end = 0
            for e in sorted(m.entries, key=lambda e: e.offset):
                assert e.offset % e.itemsize == 0 and e.offset >= end
                end = e.offset + e.nbytes
            assert end == m.nbytes  # no padding: the wire carries payload only
    assert any(m.direct for s, r in plan.pairs for m in plan.messages(s, r))
    # a piece bigger than a bucket (and not sent directly) is cut into parts, each within it
    plan = plan_reshard(src, dst, bucket_bytes=600, direct_bytes=1 << 20)
    big = [e for m in plan.messages(0, 1) for e in m.entries if e.param == "model.embed_tokens.weight"]
    assert all(m.nbytes <= cap and not m.direct for m in plan.messages(0, 1))
    assert len(big) > 1 and sum(e.nbytes for e in big) == 19 * 16 * 2
    ex = Exchange(None, plan.rounds(0), True, src.local_tensors(0), torch.device("cpu"))  # type: ignore[arg-type]
    assert ex.staging_bytes <= 2 * (600 + 16 * len(ex.peers))


def test_plan_errors_name_the_parameter() -> None:
    src, dst = R.reshard_layouts("tp2->tp1", extra_receiver_param=True)
    with pytest.raises(
        ReshardPlanError, match="model.layers.1.self_attn.q_norm.weight: receiver parameter that no sender layout has"
    ):
        plan_reshard(src, dst)
    shapes = {"a.weight": ((4, 4), torch.float32), "b.weight": ((4,), torch.float32)}
    ok = build_layout(Mesh.of([0], tp=1), shapes)
    bad = build_layout(Mesh.of([1], tp=1), {"a.weight": ((4, 5), torch.float32), "b.weight": ((4,), torch.bfloat16)})
    with pytest.raises(
        ReshardPlanError,
        match=r"a.weight: full shape sender \[4, 4\] != receiver \[4, 5\].*"
        r"b.weight: dtype sender float32 != receiver bfloat16",
    ):
        plan_reshard(ok, bad)
    fewer = build_layout(Mesh.of([1], tp=1), {"a.weight": ((4, 4), torch.float32)})
    with pytest.raises(ReshardPlanError, match="sender parameter.*that no receiver layout has: b.weight"):
        plan_reshard(ok, fewer)
    with pytest.raises(ReshardPlanError, match=r"group rank\(s\) \[0\] are in both"):
        plan_reshard(ok, build_layout(Mesh.of([0], tp=1), shapes))


def test_plan_is_cached_and_fingerprinted_by_content() -> None:
    src, dst = R.reshard_layouts("pp2->pp1")
    a = plan_reshard(src, dst, bucket_bytes=4096)
    assert plan_reshard(*R.reshard_layouts("pp2->pp1"), bucket_bytes=4096) is a
    b = plan_reshard(src, dst, bucket_bytes=8192)
    assert b is not a and b.fingerprint != a.fingerprint


def test_fused_receiver_gets_vllm_order() -> None:
    src, dst = R.reshard_layouts("tp1->tp2")
    assert "model.layers.0.self_attn.qkv_proj.weight" in dst.fused
    plan = plan_reshard(src, dst, bucket_bytes=1 << 20)
    # receiver 2 (TP rank 1) takes q rows 8:16 into its rows 0:8, k rows 4:8 into 8:12, v into 12:16
    got = sorted(
        (e.param.split(".")[-2], e.src_region, e.dst_region)
        for m in plan.messages(0, 2)
        for e in m.entries
        if e.dst_local == "model.layers.0.self_attn.qkv_proj.weight"
    )
    assert got == [
        ("k_proj", ((4, 8), (0, 16)), ((8, 12), (0, 16))),
        ("q_proj", ((8, 16), (0, 16)), ((0, 8), (0, 16))),
        ("v_proj", ((4, 8), (0, 16)), ((12, 16), (0, 16))),
    ]
    assert DEFAULT_FUSIONS["qkv_proj"] == ("q_proj", "k_proj", "v_proj")


@pytest.mark.parametrize("bucket", [300, 1024, 4096])
def test_every_staging_slot_is_aligned_for_its_dtype(bucket: int) -> None:
    """Several packed messages share a round's buffer; each slot must be viewable as its dtype."""
    for case in R.RESHARD_CASES:
        src, dst = R.reshard_layouts(case)
        plan = plan_reshard(src, dst, bucket_bytes=bucket, direct_bytes=1 << 20)
        for rank in (*src.mesh.ranks, *dst.mesh.ranks):
            lay = src if rank in src.mesh.coords else dst
            locals_ = lay.local_tensors(rank)
            ex = Exchange(
                None,
                plan.rounds(rank),
                rank in src.mesh.coords,
                locals_,  # type: ignore[arg-type]
                torch.device("cpu"),
            )
            tensors = {n: torch.zeros(lt.shape, dtype=getattr(torch, lt.dtype)) for n, lt in locals_.items()}
            for rnd in ex._view_plan(tensors):  # raises if a slot is misaligned for its dtype
                for _, _, slots, views in rnd[0]:
                    assert [s.shape for s in slots] == [v.shape for v in views]


def test_a_layout_that_differs_from_its_sides_names_the_parameters() -> None:
    from nemo_dataplane.refit.reshard.checks import diff_layouts

    shapes = {
        "model.norm.weight": ((16,), torch.float32),
        "model.layers.0.self_attn.q_proj.weight": ((8, 4), torch.bfloat16),
    }
    published = build_layout(Mesh.of([2, 3], dp=2, tp=1), shapes)
    assert diff_layouts(published, published) == []
    other = dict(shapes)
    other["model.norm.weight"] = ((17,), torch.float32)
    other.pop("model.layers.0.self_attn.q_proj.weight")
    other["model.extra.bias"] = ((2,), torch.float32)
    got = diff_layouts(build_layout(Mesh.of([2, 3], dp=2, tp=1), other), published)
    assert got == [
        "model.norm.weight: [17] float32 here, [16] float32 published",
        "model.extra.bias: in this rank's layout only",
        "model.layers.0.self_attn.q_proj.weight: missing from this rank's layout",
    ]
    tp2 = diff_layouts(build_layout(Mesh.of([2, 3], tp=2), shapes), published)
    assert tp2[0].startswith("mesh ") and "placements" in tp2[1]
