"""Planner properties (hypothesis) and the documented edge cases."""

from __future__ import annotations

import json
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nemo_dataplane.config import PackingConfig
from nemo_dataplane.driver.planner import Preshards, plan, plan_dynamic, plan_none, plan_sequence_packing

BUDGET = 256
CONFIGS = {
    "none": PackingConfig(mode="none", micro_batch_size=3),
    "sequence": PackingConfig(mode="sequence", max_tokens_per_microbatch=BUDGET),
    "dynamic": PackingConfig(mode="dynamic", max_tokens_per_microbatch=BUDGET),
}

lengths = st.lists(st.integers(min_value=1, max_value=300), min_size=1, max_size=80)


def _check_plan(p: Preshards, lens: list[int], dp: int, cfg: PackingConfig) -> None:
    n = len(lens)
    flat = [i for r in p.rank_indices for i in r]
    # Every sample lands exactly once.
    assert sorted(flat) == list(range(n))
    # Equal micro-batch counts, none empty, and micro-batches partition each shard.
    assert len({len(m) for m in p.microbatches}) == 1
    for r in range(dp):
        positions = [q for mb in p.microbatches[r] for q in mb]
        assert sorted(positions) == list(range(len(p.rank_indices[r])))
        assert all(len(mb) >= 1 for mb in p.microbatches[r])
        for mb, tokens in zip(p.microbatches[r], p.microbatch_tokens[r]):
            members = [lens[p.rank_indices[r][q]] for q in mb]
            assert tokens == sum(members)
            if cfg.mode == "none":
                assert len(mb) <= cfg.micro_batch_size
            elif len(mb) > 1:  # a lone over-budget sample may exceed the budget (documented)
                cost = sum(members) if cfg.mode == "sequence" else len(members) * max(members)
                assert cost <= cfg.max_tokens_per_microbatch
    # Inverse permutation restores the caller's order.
    assert [flat[p.inverse_permutation[j]] for j in range(n)] == list(range(n))
    assert p.global_forward_pad_seqlen == max(lens)
    # The per-rank plan is JSON-able and agrees with the plan.
    for r in range(dp):
        rp = json.loads(json.dumps(p.rank_plan(r)))
        assert rp["sample_indices"] == list(p.rank_indices[r])
        assert rp["num_microbatches"] == p.num_microbatches


@pytest.mark.parametrize("mode", sorted(CONFIGS))
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(lens=lengths, dp=st.sampled_from([1, 2, 3, 4, 8]))
def test_plan_properties(mode: str, lens: list[int], dp: int) -> None:
    cfg = CONFIGS[mode]
    try:
        p = plan(lens, dp, cfg)
    except ValueError as e:
        # Only the documented infeasible cases may raise, and they say why with the counts.
        assert "sample" in str(e) and f"dp_world={dp}" in str(e)
        return
    _check_plan(p, lens, dp, cfg)


@settings(max_examples=40, deadline=None)
@given(lens=st.lists(st.integers(min_value=1, max_value=200), min_size=16, max_size=64), dp=st.sampled_from([2, 4]))
def test_sequence_packing_balances_tokens_across_ranks(lens: list[int], dp: int) -> None:
    p = plan_sequence_packing(lens, dp, 400)
    loads = [sum(t) for t in p.microbatch_tokens]
    # LPT over micro-batches: the spread is at most one micro-batch's worth of tokens.
    assert max(loads) - min(loads) <= max(max(t) for t in p.microbatch_tokens)


@settings(max_examples=60, deadline=None)
@given(lens=lengths)
def test_sequence_packing_is_first_fit_tight(lens: list[int]) -> None:
    # First-fit property (dp=1, so no split for the DP multiple): no two micro-batches could be
    # merged within the budget. A planner that put samples alone or split greedily fails this.
    p = plan_sequence_packing(lens, 1, BUDGET)
    tokens = sorted(p.microbatch_tokens[0])
    if len(tokens) > 1:
        assert tokens[0] + tokens[1] > BUDGET


def test_shuffled_lengths_restore_caller_order() -> None:
    lens = list(range(10, 330, 10))
    random.Random(7).shuffle(lens)
    for cfg in CONFIGS.values():
        p = plan(lens, 4, cfg)
        # Results computed per rank in local order come back in the caller's order.
        rank_results = [[lens[i] * 2 for i in idx] for idx in p.rank_indices]
        assert p.restore_order(rank_results) == [x * 2 for x in lens]
        # Balancing did reorder (otherwise the order test would be vacuous).
        assert [i for r in p.rank_indices for i in r] != list(range(len(lens)))


def test_equal_microbatch_counts_where_local_packing_would_differ() -> None:
    # Rank-local packing of two contiguous halves gives 1 vs 4 micro-batches here: the deadlock.
    lens = [10] * 8 + [200] * 8
    local = [plan_sequence_packing(half, 1, 400).num_microbatches for half in (lens[:8], lens[8:])]
    assert local == [1, 4]
    p = plan_sequence_packing(lens, 2, 400)
    assert len(p.microbatches[0]) == len(p.microbatches[1]) == 3
    loads = [sum(t) for t in p.microbatch_tokens]
    assert sum(loads) == sum(lens) and max(loads) - min(loads) <= 0.1 * sum(lens)


def test_over_budget_sample_gets_its_own_microbatch() -> None:
    lens = [1000, 10, 10, 10, 20, 30]
    for fn in (plan_sequence_packing, plan_dynamic):
        p = fn(lens, 2, 100)
        owner = [(r, mb) for r in range(2) for mb in p.microbatches[r] if 0 in [p.rank_indices[r][q] for q in mb]]
        assert len(owner) == 1 and len(owner[0][1]) == 1


def test_dynamic_counts_padded_tokens() -> None:
    # Padded cost: 2 * 60 = 120 > 100 although the packed sum (70) fits.
    p = plan_dynamic([60, 10], 1, 100)
    assert p.num_microbatches == 2
    p = plan_sequence_packing([60, 10], 1, 100)
    assert p.num_microbatches == 1


def test_none_mode_fixed_micro_batch_size() -> None:
    p = plan_none([5] * 16, 2, 4)
    assert p.num_microbatches == 2
    assert all(len(mb) == 4 for mbs in p.microbatches for mb in mbs)


@pytest.mark.parametrize(
    ("lens", "dp", "cfg", "match"),
    [
        ([10, 10, 10], 4, CONFIGS["none"], r"3 sample\(s\) over dp_world=4"),
        ([10] * 5, 4, PackingConfig(mode="none", micro_batch_size=1), r"only 5 samples"),
        ([90] * 5, 4, PackingConfig(mode="sequence", max_tokens_per_microbatch=100), r"only 5 samples"),
        ([10, -1, 3], 1, CONFIGS["sequence"], r"seq_lens\[1\]"),
        ([10, 2.5], 1, CONFIGS["sequence"], r"seq_lens\[1\]"),
    ],
)
def test_infeasible_or_bad_input_raises_with_counts(lens, dp, cfg, match) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError, match=match):
        plan(lens, dp, cfg)


def test_bad_dp_world_and_budget() -> None:
    with pytest.raises(ValueError, match="dp_world"):
        plan_sequence_packing([1, 2], 0, 10)
    with pytest.raises(ValueError, match="max_tokens_per_microbatch"):
        plan_sequence_packing([1, 2], 1, 0)
    with pytest.raises(IndexError, match="rank 2"):
        plan_none([1, 2], 2, 1).rank_plan(2)


def test_plans_are_deterministic() -> None:
    lens = [random.Random(3).randint(1, 500) for _ in range(50)]
    for cfg in CONFIGS.values():
        assert plan(lens, 4, cfg) == plan(list(lens), 4, cfg)


def _reference_ffd(lens: list[int], budget: int) -> list[list[int]]:
    """Textbook first-fit decreasing, O(n * bins): the obviously-correct reference."""
    bins: list[list[int]] = []
    loads: list[int] = []
    for i in sorted(range(len(lens)), key=lambda i: (-lens[i], i)):
        for b, load in enumerate(loads):
            if load + lens[i] <= budget:
                bins[b].append(i)
                loads[b] += lens[i]
                break
        else:
            bins.append([i])
            loads.append(lens[i])
    return bins


@settings(max_examples=80, deadline=None)
@given(lens=st.lists(st.integers(min_value=0, max_value=300), min_size=1, max_size=60), budget=st.integers(1, 400))
def test_sequence_packing_matches_reference_first_fit_decreasing(lens: list[int], budget: int) -> None:
    p = plan_sequence_packing(lens, 1, budget)
    got = sorted(sorted(p.rank_indices[0][q] for q in mb) for mb in p.microbatches[0])
    assert got == sorted(sorted(b) for b in _reference_ffd(lens, budget))
