"""GRPO math as pure torch functions: group-relative advantages, dynamic sampling, clipped loss.

Layout convention: a batch of ``B = num_groups * group_size`` samples is stored group-major, i.e.
the ``group_size`` responses to one prompt are contiguous. Per-token tensors are ``[N, T]`` and
aligned with each other (position ``t`` is the log-prob of token ``t + 1`` of the sequence, as
returned by :func:`algorithms.models.sequence_logprobs`).
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

__all__ = [
    "dynamic_sampling_mask",
    "entropy_from_logits",
    "group_advantages",
    "masked_mean",
    "masked_sum",
    "policy_loss",
]

LossAgg = Literal["token_mean", "seq_mean_token_mean"]


def _check_groups(rewards: Tensor, group_size: int, fn: str) -> Tensor:
    if rewards.dim() != 1:
        raise ValueError(f"{fn}: rewards must be 1-D [B], got shape {tuple(rewards.shape)}")
    if group_size < 1:
        raise ValueError(f"{fn}: group_size must be >= 1, got {group_size}")
    if rewards.numel() % group_size != 0:
        raise ValueError(f"{fn}: batch size {rewards.numel()} is not a multiple of group_size {group_size}")
    return rewards.reshape(-1, group_size)


def group_advantages(
    rewards: Tensor, group_size: int, *, normalize_std: bool = True, eps: float = 1e-6
) -> Tensor:
    """Per-sample advantage ``(r - mean_group) / (std_group + eps)`` (float32, shape ``[B]``).

    ``std`` is the unbiased sample std of the group; with ``normalize_std=False`` the advantage is
    just ``r - mean_group``. A group whose rewards are all equal gets advantage 0. Needs
    ``group_size >= 2`` when normalising (the std of one sample is undefined).
    """
    g = _check_groups(rewards, group_size, "group_advantages").to(torch.float32)
    centered = g - g.mean(dim=1, keepdim=True)
    if normalize_std:
        if group_size < 2:
            raise ValueError("group_advantages: normalize_std=True needs group_size >= 2")
        centered = centered / (g.std(dim=1, keepdim=True) + eps)
    return centered.reshape(-1)


def dynamic_sampling_mask(rewards: Tensor, group_size: int) -> Tensor:
    """Bool ``[B]``: False for every sample of a group whose rewards are all equal (no learning signal)."""
    g = _check_groups(rewards, group_size, "dynamic_sampling_mask")
    keep = (g != g[:, :1]).any(dim=1, keepdim=True)
    return keep.expand_as(g).reshape(-1)


def masked_sum(values: Tensor, mask: Tensor) -> Tensor:
    return (values * mask.to(values.dtype)).sum()


def masked_mean(values: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mean of ``values`` where ``mask`` is set; 0 (not NaN) where the mask is empty."""
    m = mask.to(values.dtype)
    if dim is None:
        return (values * m).sum() / m.sum().clamp_min(1.0)
    return (values * m).sum(dim) / m.sum(dim).clamp_min(1.0)


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Entropy of the categorical over the last dim, computed in float32; shape ``logits.shape[:-1]``."""
    logits = logits.float()
    logp = torch.log_softmax(logits, dim=-1)
    return -(logp.exp() * logp).sum(dim=-1)


def policy_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    ref_logprobs: Tensor | None,
    advantages: Tensor,
    mask: Tensor,
    *,
    clip_eps: float,
    kl_coef: float,
    loss_agg: LossAgg = "token_mean",
    global_token_count: float | Tensor | None = None,
    global_seq_count: float | Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Clipped policy-gradient loss with a k3 KL penalty to the reference policy.

    Per token: ``ratio = exp(logprobs - old_logprobs)``,
    ``pg = max(-A * ratio, -A * clip(ratio, 1 - clip_eps, 1 + clip_eps))``,
    ``kl = exp(ref - logprobs) - (ref - logprobs) - 1`` (k3, >= 0), ``loss = pg + kl_coef * kl``.

    Aggregation over tokens where ``mask`` is set:
      * ``"token_mean"``: ``sum(loss * mask) / D`` with ``D = global_token_count`` if given, else
        ``mask.sum()``. Passing the token count of the whole rank-batch makes the losses of its
        micro-batches sum to the whole-batch loss (gradient accumulation without rescaling).
      * ``"seq_mean_token_mean"``: mean over sequences of each sequence's token mean; the sum over
        sequences is divided by ``global_seq_count`` if given, else by ``N``.

    Metrics (detached, float32 scalars) ``pg_loss``, ``kl``, ``clip_frac`` (fraction of tokens
    where the clipped term is the active one), ``ratio`` (mean), are aggregated with the same
    denominator as the loss, so they also sum over micro-batches. ``ref_logprobs=None`` or
    ``kl_coef == 0`` skips the KL term (``kl`` is then reported as 0 when no reference is given).
    """
    if logprobs.dim() != 2:
        raise ValueError(f"policy_loss: logprobs must be [N, T], got shape {tuple(logprobs.shape)}")
    for name, t in (("old_logprobs", old_logprobs), ("mask", mask)) + (
        (("ref_logprobs", ref_logprobs),) if ref_logprobs is not None else ()
    ):
        if t.shape != logprobs.shape:
            raise ValueError(
                f"policy_loss: {name} shape {tuple(t.shape)} != logprobs shape {tuple(logprobs.shape)}"
            )
    if advantages.shape != (logprobs.shape[0],):
        raise ValueError(
            f"policy_loss: advantages must be [N]={logprobs.shape[0]}, got shape {tuple(advantages.shape)}"
        )
    if clip_eps < 0:
        raise ValueError(f"policy_loss: clip_eps must be >= 0, got {clip_eps}")

    m = mask.to(logprobs.dtype)
    adv = advantages.to(logprobs.dtype).unsqueeze(1)
    # The mask also zeroes garbage in padded positions (e.g. inf - inf) before it can reach exp().
    log_ratio = torch.where(m > 0, logprobs - old_logprobs, torch.zeros_like(logprobs))
    ratio = torch.exp(log_ratio)
    pg_unclipped = -adv * ratio
    pg_clipped = -adv * torch.clamp(ratio, 1.0 - clip_eps, 1.0 + clip_eps)
    pg = torch.maximum(pg_unclipped, pg_clipped)
    clipped = (pg_clipped > pg_unclipped).to(logprobs.dtype)

    if ref_logprobs is not None:
        d = torch.where(m > 0, ref_logprobs - logprobs, torch.zeros_like(logprobs))
        kl = torch.exp(d) - d - 1.0
    else:
        kl = torch.zeros_like(logprobs)
    per_token = pg + kl_coef * kl if (ref_logprobs is not None and kl_coef != 0.0) else pg

    if loss_agg == "token_mean":
        # An all-masked micro-batch contributes 0, not NaN.
        denom = m.sum().clamp_min(1.0) if global_token_count is None else torch.as_tensor(global_token_count, dtype=m.dtype)

        def agg(x: Tensor) -> Tensor:
            return (x * m).sum() / denom

    elif loss_agg == "seq_mean_token_mean":
        tok_per_seq = m.sum(dim=1).clamp_min(1.0)
        denom = (
            torch.as_tensor(float(max(m.shape[0], 1)), dtype=m.dtype)
            if global_seq_count is None
            else torch.as_tensor(global_seq_count, dtype=m.dtype)
        )

        def agg(x: Tensor) -> Tensor:
            return ((x * m).sum(dim=1) / tok_per_seq).sum() / denom

    else:
        raise ValueError(f"policy_loss: loss_agg must be 'token_mean' or 'seq_mean_token_mean', got {loss_agg!r}")

    if float(denom) <= 0:
        raise ValueError(f"policy_loss: global token/sequence count must be > 0, got {float(denom)}")
    loss = agg(per_token)
    with torch.no_grad():
        metrics = {
            "pg_loss": agg(pg).detach().float(),
            "kl": agg(kl).detach().float(),
            "clip_frac": agg(clipped).detach().float(),
            "ratio": agg(ratio).detach().float(),
        }
    return loss, metrics
