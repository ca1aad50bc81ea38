"""The policy loss and the advantage estimator, each chosen by name from a registry
(``grpo.loss``, ``grpo.advantage``) and handed to those who use them: :func:`make_loss` to the
training engine (which calls the :class:`PolicyLoss` it is given), :func:`make_advantage` to the
step. Each sees only :class:`LossSettings` / the ``grpo`` section, not the whole trainer config.

Losses (all clipped surrogates with the k3 KL term and the off-policy correction of
:func:`~algorithms.grpo.policy_loss`, token-mean over the step's tokens):

* ``grpo`` (default): the token-level ratio clipped at ``1 +- clip_eps``.
* ``dapo``: DAPO's clip-higher, ``[1 - clip_eps, 1 + clip_eps_high]`` (``grpo.clip_eps_high``,
  e.g. 0.28 against 0.2), so low-probability tokens may grow further before the clip holds them.
* ``gspo``: GSPO's sequence-level ratio: every token of a response takes
  ``exp(mean over the response of (logprobs - old))``, clipped as a whole (GSPO's clip widths are
  small, e.g. ``clip_eps=4e-4``).

Advantages: ``grpo`` (default): ``(r - group mean) / (group std + eps)``, or ``r - group mean``
with ``grpo.normalize_std=false`` (Dr. GRPO's choice); ``rloo``: ``r_i`` minus the mean of the
other responses of its group.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from torch import Tensor

from algorithms.config import TrainerConfig
from algorithms.config_sections import AsyncConfig, GRPOConfig
from algorithms.grpo import group_advantages, policy_loss, rloo_advantages

__all__ = ["ADVANTAGES", "LOSSES", "LossSettings", "PolicyLoss", "loss_of", "make_advantage", "make_loss"]


@dataclass(frozen=True)
class LossSettings:
    """What a policy loss reads of the run's config."""

    clip_eps: float
    clip_eps_high: float | None
    kl_coef: float
    kl_clamp: float | None
    loss_agg: str
    is_cap: float
    is_mode: str

    @classmethod
    def of(cls, grpo: GRPOConfig, async_: AsyncConfig) -> LossSettings:
        return cls(
            clip_eps=grpo.clip_eps,
            clip_eps_high=grpo.clip_eps_high,
            kl_coef=grpo.kl_coef,
            kl_clamp=grpo.kl_clamp,
            loss_agg=grpo.loss_agg,
            is_cap=async_.is_cap,
            is_mode=async_.is_mode,
        )


class PolicyLoss(Protocol):
    """``(logprobs, old, ref, advantages, mask, *, global_token_count, behaviour_logprobs)`` ->
    ``(loss, metrics)``: the contract of :func:`~algorithms.grpo.policy_loss`, its settings bound."""

    def __call__(
        self,
        logprobs: Tensor,
        old_logprobs: Tensor,
        ref_logprobs: Tensor | None,
        advantages: Tensor,
        mask: Tensor,
        *,
        global_token_count: float | Tensor | None = None,
        behaviour_logprobs: Tensor | None = None,
    ) -> tuple[Tensor, dict[str, Tensor]]: ...


def _bound(s: LossSettings, **extra: Any) -> PolicyLoss:
    return functools.partial(
        policy_loss,
        clip_eps=s.clip_eps,
        kl_coef=s.kl_coef,
        loss_agg=s.loss_agg,  # type: ignore[arg-type]  # checked by the config's Literal
        is_cap=s.is_cap,
        is_mode=s.is_mode,  # type: ignore[arg-type]  # checked by the config's Literal
        kl_clamp=s.kl_clamp,
        **extra,
    )


def _grpo(s: LossSettings) -> PolicyLoss:
    return _bound(s)


def _dapo(s: LossSettings) -> PolicyLoss:
    return _bound(s, clip_eps_high=s.clip_eps if s.clip_eps_high is None else s.clip_eps_high)


def _gspo(s: LossSettings) -> PolicyLoss:
    return _bound(s, ratio_level="sequence")


LOSSES: dict[str, Callable[[LossSettings], PolicyLoss]] = {"grpo": _grpo, "dapo": _dapo, "gspo": _gspo}


def make_loss(name: str, settings: LossSettings) -> PolicyLoss:
    """The loss ``grpo.loss`` names, its settings bound."""
    try:
        return LOSSES[name](settings)
    except KeyError:
        raise ValueError(f"grpo.loss: unknown loss {name!r}; known: {sorted(LOSSES)}") from None


def loss_of(cfg: TrainerConfig) -> PolicyLoss:
    """The run's loss: ``grpo.loss`` with the ``grpo`` and ``async`` settings it reads."""
    return make_loss(cfg.grpo.loss, LossSettings.of(cfg.grpo, cfg.async_))


Advantage = Callable[[Tensor, int], Tensor]  # (rewards [B], group size) -> advantages [B], float32

ADVANTAGES: dict[str, Callable[[GRPOConfig], Advantage]] = {
    "grpo": lambda g: functools.partial(group_advantages, normalize_std=g.normalize_std),
    "rloo": lambda g: rloo_advantages,
}


def make_advantage(grpo: GRPOConfig) -> Advantage:
    """The estimator ``grpo.advantage`` names."""
    try:
        return ADVANTAGES[grpo.advantage](grpo)
    except KeyError:
        raise ValueError(f"grpo.advantage: unknown estimator {grpo.advantage!r}; known: {sorted(ADVANTAGES)}") from None
