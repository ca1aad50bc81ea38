"""GRPO math: advantages, dynamic sampling and the clipped/KL loss against hand computations."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
import torch

from algorithms.grpo import (
    dynamic_sampling_mask,
    entropy_from_logits,
    group_advantages,
    masked_mean,
    policy_loss,
)


def test_group_advantages_hand_computed() -> None:
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 0.5, 0.5, 0.5, 0.5, 1.0, 1.0, 0.0, 0.0])
    adv = group_advantages(rewards, 4, eps=0.0)
    # group 0: mean 0.25, unbiased std sqrt(0.25) = 0.5
    assert torch.allclose(adv[:4], torch.tensor([1.5, -0.5, -0.5, -0.5]))
    # group 1 (all equal) is covered with eps > 0 below; with eps=0 it would be 0/0.
    # group 2: mean 0.5, std sqrt(1/3)
    s = math.sqrt(1.0 / 3.0)
    assert torch.allclose(adv[8:], torch.tensor([0.5 / s, 0.5 / s, -0.5 / s, -0.5 / s]))


def test_group_advantages_equal_group_is_zero_with_eps() -> None:
    adv = group_advantages(torch.tensor([0.3, 0.3, 0.3, 1.0, 0.0, 0.0]), 3)
    assert torch.equal(adv[:3], torch.zeros(3))
    assert adv[3] > 0 and adv[4] < 0 and torch.isclose(adv.reshape(2, 3).sum(1), torch.zeros(2), atol=1e-6).all()


def test_group_advantages_no_std_and_dtype() -> None:
    adv = group_advantages(torch.tensor([2, 0, 1, 1], dtype=torch.int64), 2, normalize_std=False)
    assert adv.dtype == torch.float32
    assert torch.equal(adv, torch.tensor([1.0, -1.0, 0.0, 0.0]))


@pytest.mark.parametrize(
    ("rewards", "group_size", "match"),
    [
        (torch.zeros(5), 2, "not a multiple of group_size 2"),
        (torch.zeros(4), 0, "group_size must be >= 1"),
        (torch.zeros(2, 2), 2, "1-D"),
        (torch.zeros(3), 1, "group_size >= 2"),
    ],
)
def test_group_advantages_rejects_bad_input(rewards: torch.Tensor, group_size: int, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        group_advantages(rewards, group_size)


def test_dynamic_sampling_mask() -> None:
    r = torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0, 0.5, 0.0, 0.0, 0.0])
    mask = dynamic_sampling_mask(r, 3)
    assert mask.dtype == torch.bool
    assert mask.tolist() == [False, False, False, True, True, True, False, False, False]
    with pytest.raises(ValueError, match="multiple"):
        dynamic_sampling_mask(torch.zeros(4), 3)


def test_masked_mean_and_entropy() -> None:
    v = torch.tensor([[1.0, 2.0, 100.0], [3.0, 100.0, 100.0]])
    m = torch.tensor([[1, 1, 0], [1, 0, 0]])
    assert masked_mean(v, m).item() == pytest.approx(2.0)
    assert torch.allclose(masked_mean(v, m, dim=1), torch.tensor([1.5, 3.0]))
    assert masked_mean(v, torch.zeros_like(m)).item() == 0.0
    ent = entropy_from_logits(torch.tensor([[0.0, 0.0, 0.0, 0.0], [100.0, 0.0, 0.0, 0.0]]))
    assert ent[0].item() == pytest.approx(math.log(4))
    assert ent[1].item() == pytest.approx(0.0, abs=1e-6)


def _loss_inputs() -> dict[str, torch.Tensor]:
    # Two sequences, three token slots; the last slot of sequence 1 is padding with junk values.
    lp = torch.log(torch.tensor([[0.5, 0.6, 0.2], [0.3, 0.4, 0.9]]))
    old = torch.log(torch.tensor([[0.25, 0.6, 0.4], [0.6, 0.4, 0.1]]))
    ref = torch.log(torch.tensor([[0.5, 0.3, 0.2], [0.3, 0.8, 0.5]]))
    adv = torch.tensor([1.0, -2.0])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    return {"lp": lp, "old": old, "ref": ref, "adv": adv, "mask": mask}


def _hand_loss(x: dict[str, torch.Tensor], clip: float, kl_coef: float) -> tuple[float, float, float, float]:
    """Token-by-token reference in plain Python floats."""
    tot = pg_tot = kl_tot = clip_n = 0.0
    n_tok = 0
    for i in range(2):
        for t in range(3):
            if not x["mask"][i, t]:
                continue
            a = float(x["adv"][i])
            r = math.exp(float(x["lp"][i, t]) - float(x["old"][i, t]))
            un, cl = -a * r, -a * min(max(r, 1 - clip), 1 + clip)
            pg = max(un, cl)
            d = float(x["ref"][i, t]) - float(x["lp"][i, t])
            kl = math.exp(d) - d - 1
            tot += pg + kl_coef * kl
            pg_tot += pg
            kl_tot += kl
            clip_n += cl > un
            n_tok += 1
    return tot / n_tok, pg_tot / n_tok, kl_tot / n_tok, clip_n / n_tok


def test_policy_loss_matches_hand_computation() -> None:
    x = _loss_inputs()
    loss, met = policy_loss(x["lp"], x["old"], x["ref"], x["adv"], x["mask"], clip_eps=0.2, kl_coef=0.1)
    want, want_pg, want_kl, want_clip = _hand_loss(x, 0.2, 0.1)
    assert loss.item() == pytest.approx(want, rel=1e-5)
    assert met["pg_loss"].item() == pytest.approx(want_pg, rel=1e-5)
    assert met["kl"].item() == pytest.approx(want_kl, rel=1e-5)
    # ratios: 2.0 (A>0, clipped at 1.2), 1.0, 0.5 (A>0: unclipped -0.5 is larger), 0.5 (A<0, clipped at 0.8), 1.0
    assert met["clip_frac"].item() == pytest.approx(2 / 5)
    assert want_clip == pytest.approx(2 / 5)


def test_policy_loss_gradient_direction() -> None:
    x = _loss_inputs()
    lp = x["lp"].clone().requires_grad_(True)
    loss, _ = policy_loss(lp, x["old"], None, x["adv"], x["mask"], clip_eps=0.2, kl_coef=0.0)
    loss.backward()
    g = lp.grad
    assert g is not None
    # Clipped tokens and padding get no gradient; unclipped tokens are pushed along their advantage.
    assert g[0, 0] == 0 and g[1, 0] == 0 and g[1, 2] == 0
    assert g[0, 1] < 0 and g[0, 2] < 0  # A > 0: loss decreases as logprob rises
    assert g[1, 1] > 0  # A < 0
    # d/dlp of -A*exp(lp-old)/5 at ratio 1: -A/5
    assert g[1, 1].item() == pytest.approx(2.0 / 5, rel=1e-5)


def test_policy_loss_kl_zero_at_reference_and_positive_elsewhere() -> None:
    x = _loss_inputs()
    _, met = policy_loss(x["lp"], x["lp"], x["lp"], x["adv"], x["mask"], clip_eps=0.2, kl_coef=1.0)
    assert met["kl"].item() == 0.0
    assert met["clip_frac"].item() == 0.0
    loss_no_kl, _ = policy_loss(x["lp"], x["old"], x["ref"], x["adv"], x["mask"], clip_eps=0.2, kl_coef=0.0)
    loss_kl, met = policy_loss(x["lp"], x["old"], x["ref"], x["adv"], x["mask"], clip_eps=0.2, kl_coef=0.5)
    assert met["kl"].item() > 0
    assert loss_kl.item() == pytest.approx(loss_no_kl.item() + 0.5 * met["kl"].item(), rel=1e-6)


def test_policy_loss_ignores_padding_even_if_nonfinite() -> None:
    x = _loss_inputs()
    base, _ = policy_loss(x["lp"], x["old"], x["ref"], x["adv"], x["mask"], clip_eps=0.2, kl_coef=0.1)
    lp = x["lp"].clone()
    lp[1, 2] = float("-inf")
    old = x["old"].clone()
    old[1, 2] = float("-inf")
    loss, met = policy_loss(lp, old, x["ref"], x["adv"], x["mask"].bool(), clip_eps=0.2, kl_coef=0.1)
    assert torch.isfinite(loss) and all(torch.isfinite(v) for v in met.values())
    assert loss.item() == pytest.approx(base.item(), rel=1e-6)


def test_micro_batches_sum_to_whole_batch_with_global_token_count() -> None:
    torch.manual_seed(0)
    N, T = 6, 5
    lp = torch.randn(N, T) * 0.3 - 1.0
    old = lp + torch.randn(N, T) * 0.2
    ref = lp + torch.randn(N, T) * 0.2
    adv = torch.randn(N)
    mask = (torch.rand(N, T) > 0.3).long()
    kw = dict(clip_eps=0.2, kl_coef=0.05)
    whole, wm = policy_loss(lp, old, ref, adv, mask, **kw)
    total = float(mask.sum())
    parts = [policy_loss(lp[s], old[s], ref[s], adv[s], mask[s], global_token_count=total, **kw) for s in (slice(0, 2), slice(2, 6))]
    assert sum(p[0] for p in parts).item() == pytest.approx(whole.item(), rel=1e-6)
    for k in ("kl", "clip_frac", "pg_loss"):
        assert sum(p[1][k] for p in parts).item() == pytest.approx(wm[k].item(), rel=1e-5, abs=1e-7)
    # Without the global count each part is its own mean, which differs from the whole-batch mean.
    local = [policy_loss(lp[s], old[s], ref[s], adv[s], mask[s], **kw)[0] for s in (slice(0, 2), slice(2, 6))]
    assert sum(local).item() != pytest.approx(whole.item(), rel=1e-3)


def test_seq_mean_token_mean() -> None:
    x = _loss_inputs()
    loss, _ = policy_loss(
        x["lp"], x["old"], None, x["adv"], x["mask"], clip_eps=0.2, kl_coef=0.0, loss_agg="seq_mean_token_mean"
    )
    # per-token pg (see test_policy_loss_matches_hand_computation): seq0 = [-1.2, -1.0, -0.5], seq1 = [1.6, 2.0]
    want = ((-1.2 - 1.0 - 0.5) / 3 + (1.6 + 2.0) / 2) / 2
    assert loss.item() == pytest.approx(want, rel=1e-5)


def test_policy_loss_rejects_bad_shapes() -> None:
    x = _loss_inputs()
    with pytest.raises(ValueError, match="old_logprobs shape"):
        policy_loss(x["lp"], x["old"][:, :2], x["ref"], x["adv"], x["mask"], clip_eps=0.2, kl_coef=0.1)
    with pytest.raises(ValueError, match="advantages must be"):
        policy_loss(x["lp"], x["old"], x["ref"], x["adv"][:1], x["mask"], clip_eps=0.2, kl_coef=0.1)
    with pytest.raises(ValueError, match="loss_agg"):
        policy_loss(x["lp"], x["old"], x["ref"], x["adv"], x["mask"], clip_eps=0.2, kl_coef=0.1, loss_agg="sum")  # type: ignore[arg-type]


@settings(max_examples=60, deadline=None)
@given(
    groups=st.lists(
        st.lists(st.sampled_from([0.0, 0.25, 0.5, 1.0]), min_size=4, max_size=4), min_size=1, max_size=6
    ),
    scale=st.floats(0.1, 10.0),
    shift=st.floats(-5.0, 5.0),
)
def test_group_advantages_properties(groups: list[list[float]], scale: float, shift: float) -> None:
    r = torch.tensor([x for g in groups for x in g], dtype=torch.float64)
    adv = group_advantages(r, 4, eps=0.0 if all(len(set(g)) > 1 for g in groups) else 1e-6).reshape(-1, 4)
    keep = dynamic_sampling_mask(r, 4).reshape(-1, 4)
    for i, g in enumerate(groups):
        assert keep[i].all().item() == (len(set(g)) > 1)
        assert adv[i].sum().abs().item() < 1e-4  # centred per group
        if len(set(g)) > 1:
            assert adv[i].std().item() == pytest.approx(1.0, abs=1e-3)  # unit std (eps negligible)
            # ranking inside a group follows the rewards
            for a in range(4):
                for b in range(4):
                    if g[a] > g[b]:
                        assert adv[i, a] > adv[i, b]
        else:
            assert torch.equal(adv[i], torch.zeros(4))
    # Normalised advantages ignore an affine change of the reward scale.
    adv2 = group_advantages(r * scale + shift, 4, eps=0.0 if bool(keep.all()) else 1e-9).reshape(-1, 4)
    assert torch.allclose(adv2[keep], adv.to(adv2.dtype)[keep], atol=1e-3)
