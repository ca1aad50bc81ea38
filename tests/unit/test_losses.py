"""The loss and advantage registries (algorithms/losses.py): GRPO is the call the engine made
before (bitwise), DAPO's clip-higher and GSPO's sequence ratio and RLOO's leave-one-out baseline
match hand-computed cases, unknown names are refused naming the key, and the engine the factory
builds carries the run's loss."""

from __future__ import annotations

import math

import pytest
import torch

from algorithms.config import ConfigError, load_config
from algorithms.config_sections import AsyncConfig, GRPOConfig
from algorithms.grpo import policy_loss
from algorithms.losses import LossSettings, make_advantage, make_loss


def _settings(**over: object) -> LossSettings:
    grpo = GRPOConfig(**{"clip_eps": 0.2, "kl_coef": 0.0, **over})  # type: ignore[arg-type]
    return LossSettings.of(grpo, AsyncConfig())


def _one_sequence(ratios: list[float], adv: float) -> tuple[torch.Tensor, ...]:
    old = torch.zeros(1, len(ratios))
    lp = torch.tensor([[math.log(r) for r in ratios]], requires_grad=True)
    return lp, old, torch.tensor([adv]), torch.ones(1, len(ratios))


@pytest.mark.parametrize("behaviour", [False, True])
def test_the_grpo_loss_is_bitwise_the_call_the_engine_made_before(behaviour: bool) -> None:
    g = torch.Generator().manual_seed(0)
    lp = torch.randn(6, 9, generator=g, requires_grad=True)
    old, ref, beh = (lp.detach() + 0.3 * torch.randn(6, 9, generator=g) for _ in range(3))
    adv, mask = torch.randn(6, generator=g), (torch.rand(6, 9, generator=g) > 0.2).float()
    s = _settings(kl_coef=0.05)
    got, m = make_loss("grpo", s)(
        lp, old, ref, adv, mask, global_token_count=40.0, behaviour_logprobs=beh if behaviour else None
    )
    (g_got,) = torch.autograd.grad(got, lp)
    want, w = policy_loss(
        lp, old, ref, adv, mask, clip_eps=0.2, kl_coef=0.05, loss_agg="token_mean", global_token_count=40.0,
        behaviour_logprobs=beh if behaviour else None, is_cap=2.0, is_mode="truncate", kl_clamp=10.0,
    )  # fmt: skip
    (g_want,) = torch.autograd.grad(want, lp)
    assert torch.equal(got, want) and torch.equal(g_got, g_want)
    assert all(torch.equal(m[k], w[k]) for k in w) and m.keys() == w.keys()


def test_dapo_clips_higher_above_and_at_clip_eps_below() -> None:
    # Ratios 1.5 and 0.5, advantage +1: GRPO holds the first at 1.2; DAPO (0.28 above) at 1.28;
    # below, the unclipped 0.5 is the larger surrogate for both.
    lp, old, adv, mask = _one_sequence([1.5, 0.5], 1.0)
    grpo, _ = make_loss("grpo", _settings())(lp, old, None, adv, mask)
    dapo, _ = make_loss("dapo", _settings(clip_eps_high=0.28))(lp, old, None, adv, mask)
    assert grpo.item() == pytest.approx((-1.2 - 0.5) / 2, abs=1e-6)
    assert dapo.item() == pytest.approx((-1.28 - 0.5) / 2, abs=1e-6)
    # A negative advantage: the lower clip (1 - 0.2) binds the small ratio for both.
    lp, old, adv, mask = _one_sequence([1.5, 0.5], -1.0)
    dapo, _ = make_loss("dapo", _settings(clip_eps_high=0.28))(lp, old, None, adv, mask)
    assert dapo.item() == pytest.approx((1.5 + 0.8) / 2, abs=1e-6)


def test_gspo_takes_the_sequence_ratio_clips_it_whole_and_spreads_its_gradient_over_the_tokens() -> None:
    # Token ratios 1.5 and 0.5: the sequence's is exp(mean log) = sqrt(0.75), inside the clip.
    lp, old, adv, mask = _one_sequence([1.5, 0.5], 1.0)
    loss, m = make_loss("gspo", _settings())(lp, old, None, adv, mask)
    s = math.sqrt(0.75)
    assert loss.item() == pytest.approx(-s, abs=1e-6) and m["ratio"].item() == pytest.approx(s, abs=1e-6)
    (grad,) = torch.autograd.grad(loss, lp)
    assert grad[0].tolist() == pytest.approx([-s / 2, -s / 2], abs=1e-6)  # d(-s)/d lp_t = -s / |y|
    # Both tokens doubled: the sequence ratio 2 is clipped at 1.2 as a whole, and no gradient flows.
    lp, old, adv, mask = _one_sequence([2.0, 2.0], 1.0)
    loss, m = make_loss("gspo", _settings())(lp, old, None, adv, mask)
    (grad,) = torch.autograd.grad(loss, lp)
    assert loss.item() == pytest.approx(-1.2, abs=1e-6) and m["clip_frac"].item() == 1.0
    assert grad.abs().sum().item() == 0.0


def test_rloo_subtracts_the_mean_of_the_other_responses_of_the_group() -> None:
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 5.0])
    adv = make_advantage(GRPOConfig(advantage="rloo"))(rewards, 4)
    want = [2 / 3, -2 / 3, -2 / 3, 2 / 3, -1.0, -1.0, -1.0, 3.0]
    assert adv.tolist() == pytest.approx(want, abs=1e-6)
    grpo = make_advantage(GRPOConfig(normalize_std=False))(rewards, 4)
    assert grpo.tolist() == pytest.approx([0.5, -0.5, -0.5, 0.5, -0.75, -0.75, -0.75, 2.25], abs=1e-6)
    with pytest.raises(ValueError, match="rloo_advantages: needs group_size >= 2"):
        make_advantage(GRPOConfig(advantage="rloo"))(rewards, 1)


def test_unknown_names_are_refused_naming_the_key() -> None:
    with pytest.raises(ValueError, match=r"grpo.loss: unknown loss 'ppo'; known: \['dapo', 'grpo', 'gspo'\]"):
        make_loss("ppo", _settings())
    with pytest.raises(ConfigError, match="grpo.loss"):
        load_config(None, ["grpo.loss=ppo"])
    with pytest.raises(ConfigError, match="grpo.advantage"):
        load_config(None, ["grpo.advantage=vtrace"])
    with pytest.raises(ConfigError, match="clip_eps_high"):
        load_config(None, ["grpo.clip_eps_high=-0.1"])


def test_the_training_engine_the_factory_builds_minimises_the_runs_loss() -> None:
    from algorithms.engines.training import build_training_engine

    hf = [f"policy.model.hf_config.{k}={v}" for k, v in {"hidden_size": 16, "intermediate_size": 32,
          "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 2}.items()]  # fmt: skip
    for name, extra in (("grpo", {}), ("gspo", {"ratio_level": "sequence"}), ("dapo", {"clip_eps_high": 0.28})):
        over = [f"grpo.loss={name}", "grpo.clip_eps_high=0.28"] if name == "dapo" else [f"grpo.loss={name}"]
        cfg = load_config(None, [*hf, *over])
        engine = build_training_engine(cfg, torch.device("cpu"), vocab_size=32, pad_id=0)
        kw = engine.loss.keywords  # type: ignore[attr-defined]
        assert engine.loss.func is policy_loss and kw["clip_eps"] == cfg.grpo.clip_eps  # type: ignore[attr-defined]
        assert {k: kw[k] for k in extra} == extra and ("ratio_level" in kw) == (name == "gspo")
