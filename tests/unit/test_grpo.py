"""GRPO math: advantages, dynamic sampling and the clipped/KL loss against hand computations."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

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
    parts = [
        policy_loss(lp[s], old[s], ref[s], adv[s], mask[s], global_token_count=total, **kw)
        for s in (slice(0, 2), slice(2, 6))
    ]
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
    groups=st.lists(st.lists(st.sampled_from([0.0, 0.25, 0.5, 1.0]), min_size=4, max_size=4), min_size=1, max_size=6),
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


# ---------------------------------------------------------------- off-policy correction (async)
def _batch(seed: int = 0, n: int = 6, t: int = 7) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    lp = (-torch.rand(n, t, generator=g) * 3).requires_grad_(True)
    old = lp.detach() + 0.1 * torch.randn(n, t, generator=g)
    ref = lp.detach() + 0.1 * torch.randn(n, t, generator=g)
    adv = torch.randn(n, generator=g)
    mask = (torch.rand(n, t, generator=g) > 0.2).float()
    return lp, old, ref, adv, mask


def test_on_policy_async_loss_equals_sync_loss() -> None:
    """max_staleness=0: the behaviour log-probs are the proximal policy's up to the sampler's float
    error. Exactly equal behaviour gives the bitwise-same loss and gradient; the sampler's
    KV-cached float error (measured < 1e-5 per token between models.generate and
    sequence_logprobs, tests/unit/test_models.py) moves the loss by < 1e-5 relative."""
    lp, old, ref, adv, mask = _batch()
    kw = dict(clip_eps=0.2, kl_coef=0.05, global_token_count=float(mask.sum()))
    sync_loss, sync_m = policy_loss(lp, old, ref, adv, mask, **kw)
    (g_sync,) = torch.autograd.grad(sync_loss, lp)
    async_loss, async_m = policy_loss(lp, old, ref, adv, mask, behaviour_logprobs=old.clone(), **kw)
    (g_async,) = torch.autograd.grad(async_loss, lp)
    assert torch.equal(sync_loss, async_loss) and torch.equal(g_sync, g_async)
    assert float(async_m["is_truncated_frac"]) == 0.0 and float(async_m["behaviour_kl"]) == 0.0
    noisy = old + 1e-6 * torch.randn(old.shape, generator=torch.Generator().manual_seed(1))
    near_loss, _ = policy_loss(lp, old, ref, adv, mask, behaviour_logprobs=noisy, **kw)
    assert abs(float(near_loss) - float(sync_loss)) <= 1e-5 * max(1.0, abs(float(sync_loss)))


def test_decoupled_loss_matches_an_independent_per_token_computation() -> None:
    lp, old, ref, adv, mask = _batch(seed=3)
    behaviour = old - torch.linspace(-1.5, 1.5, old.numel()).reshape(old.shape)  # weights 0.22 .. 4.5
    cap, eps, kl_coef = 2.0, 0.2, 0.0
    for mode in ("truncate", "mask"):
        loss, m = policy_loss(
            lp,
            old,
            None,
            adv,
            mask,
            clip_eps=eps,
            kl_coef=kl_coef,
            behaviour_logprobs=behaviour,
            is_cap=cap,
            is_mode=mode,
        )
        total, n_tok, n_over = 0.0, 0.0, 0.0
        for i in range(lp.shape[0]):
            for j in range(lp.shape[1]):
                if mask[i, j] == 0:
                    continue
                r = math.exp(float(lp[i, j]) - float(old[i, j]))
                a = float(adv[i])
                pg = max(-a * r, -a * min(max(r, 1 - eps), 1 + eps))
                w = math.exp(float(old[i, j]) - float(behaviour[i, j]))
                over = w > cap
                w = min(w, cap) if mode == "truncate" else (0.0 if over else w)
                total += w * pg
                n_tok += 1
                n_over += over
        assert math.isclose(float(loss), total / n_tok, rel_tol=1e-5), mode
        assert math.isclose(float(m["is_truncated_frac"]), n_over / n_tok, rel_tol=1e-6)
        assert 0 < n_over < n_tok  # the case exercises both sides of the cap


def test_behaviour_logprobs_shape_and_cap_are_checked() -> None:
    lp, old, ref, adv, mask = _batch()
    with pytest.raises(ValueError, match="behaviour_logprobs shape"):
        policy_loss(lp, old, ref, adv, mask, clip_eps=0.2, kl_coef=0.0, behaviour_logprobs=old[:, :3])
    with pytest.raises(ValueError, match="is_cap"):
        policy_loss(lp, old, ref, adv, mask, clip_eps=0.2, kl_coef=0.0, behaviour_logprobs=old, is_cap=0.0)


# ---------------------------------------------------------------- the KL anchors (stale samples)
def test_the_kl_clamp_caps_each_tokens_k3_and_its_gradient_as_computed_by_hand() -> None:
    d = torch.tensor([[-25.0, -3.0, -0.5, 0.0, 0.7, 2.0, 3.0, 30.0]])  # ref - lp, per token
    lp = torch.full_like(d, -2.0).requires_grad_(True)
    ref = lp.detach() + d
    mask, adv = torch.ones_like(d), torch.zeros(1)  # no policy-gradient term: the KL alone
    clamp, coef = 10.0, 0.5
    loss, m = policy_loss(lp, lp.detach(), ref, adv, mask, clip_eps=0.2, kl_coef=coef, kl_clamp=clamp)
    (grad,) = torch.autograd.grad(loss, lp)
    want_kl, want_grad = [], []
    for x in d[0].tolist():
        x = max(-20.0, min(20.0, x))
        k3 = math.exp(x) - x - 1
        want_kl.append(min(k3, clamp))
        # d k3 / d lp = -(e^x - 1) where the clamp does not bind, else 0.
        want_grad.append(0.0 if k3 >= clamp else -(math.exp(x) - 1) * coef / d.numel())
    assert math.isclose(float(m["kl"]), sum(want_kl) / d.numel(), rel_tol=1e-6)
    assert torch.allclose(grad[0], torch.tensor(want_grad), rtol=1e-5, atol=1e-7), (grad, want_grad)
    assert torch.isfinite(grad).all() and float(grad.abs().max()) <= (math.exp(2.53) - 1) * coef / d.numel()


def test_behaviour_samples_weight_the_kl_by_the_same_capped_weight_as_the_policy_gradient() -> None:
    lp, old, ref, adv, mask = _batch(seed=5)
    behaviour = old - torch.linspace(-2.0, 1.0, old.numel()).reshape(old.shape)  # weights 0.14 .. 7.4
    cap, coef = 2.0, 0.3
    loss, m = policy_loss(
        lp, old, ref, adv, mask, clip_eps=0.2, kl_coef=coef, behaviour_logprobs=behaviour, is_cap=cap, kl_clamp=10.0
    )
    pg_only, _ = policy_loss(
        lp, old, ref, adv, mask, clip_eps=0.2, kl_coef=0.0, behaviour_logprobs=behaviour, is_cap=cap
    )
    kl_sum, n = 0.0, float(mask.sum())
    for i in range(lp.shape[0]):
        for j in range(lp.shape[1]):
            if mask[i, j]:
                x = float(ref[i, j]) - float(lp[i, j])
                w = min(math.exp(float(old[i, j]) - float(behaviour[i, j])), cap)
                kl_sum += w * min(math.exp(x) - x - 1, 10.0)
    assert math.isclose(float(m["kl"]), kl_sum / n, rel_tol=1e-5)
    assert math.isclose(float(loss), float(pg_only) + coef * kl_sum / n, rel_tol=1e-5)


def test_a_stale_token_the_policy_has_ruled_out_no_longer_swamps_the_step() -> None:
    """The 0.82B async divergence, reduced to one token: an older policy sampled it (behaviour
    log-prob -1), the current one has collapsed away from it (-30), the reference still likes it
    (-2). Unanchored, k3 = e^28 ~ 1.4e12 and its gradient as large: clipping the whole gradient
    to max_grad_norm then leaves the step pointing along that token alone."""
    lp = torch.tensor([[-30.0, -0.1, -0.2]], requires_grad=True)
    ref = torch.tensor([[-2.0, -0.1, -0.3]])
    behaviour = torch.tensor([[-1.0, -0.1, -0.2]])
    old, adv, mask = lp.detach().clone(), torch.tensor([1.0]), torch.ones(1, 3)
    kw = dict(clip_eps=0.2, kl_coef=0.01)

    def kl_and_grad(**extra: object) -> tuple[float, float]:
        loss, m = policy_loss(lp, old, ref, adv, mask, **kw, **extra)  # type: ignore[arg-type]
        (g,) = torch.autograd.grad(loss, lp)
        assert torch.isfinite(g).all()
        return float(m["kl"]), float(g.abs().max())

    kl, grad = kl_and_grad()  # the estimator as it was: k3 of a token the sampler did not draw from pi
    assert kl > 1e10 and grad > 1e8
    for anchors in (
        {"behaviour_logprobs": behaviour},
        {"kl_clamp": 10.0},
        {"behaviour_logprobs": behaviour, "kl_clamp": 10.0},
    ):
        kl, grad = kl_and_grad(**anchors)
        assert kl <= 10.0 and grad < 1.0, (anchors, kl, grad)
