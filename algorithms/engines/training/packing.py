"""Packed micro-batches: the fetched jagged ``input_ids`` already *is* the packed sequence.

A micro-batch's jagged ``input_ids`` (``torch.nested``, layout ``jagged``) holds every row's
tokens back to back (``values()``) and the row boundaries (``offsets()``): exactly the ``[1, T]``
token stream and the cumulative sequence lengths that Megatron-core's ``PackedSeqParams``
(``qkv_format="thd"``) wants, so the worker never re-packs. Pure torch; tested on CPU.

Per-token log-probs come back in the trainer's padded form ``[N, L - 1]`` (position ``t`` of
row ``j`` scores token ``t + 1``), so ``algorithms.grpo.policy_loss`` runs unchanged.
"""

from __future__ import annotations

import torch
from torch import Tensor

from algorithms.grpo import entropy_from_logits

__all__ = ["block_causal_mask", "packed_from_jagged", "packed_logprobs", "unpack_to_padded"]


def packed_from_jagged(input_ids: Tensor) -> tuple[Tensor, Tensor]:
    """``(tokens [1, T] int64, cu_seqlens [N + 1] int32)`` from a jagged nested ``[N, *]`` tensor
    (no copy of the tokens beyond the dtype). Raises ``ValueError`` for anything else or an
    empty row."""
    if not (isinstance(input_ids, Tensor) and input_ids.is_nested):
        raise ValueError("packed_from_jagged: input_ids must be a jagged torch.nested tensor")
    values, offsets = input_ids.values(), input_ids.offsets()  # type: ignore[attr-defined]  # NJT API, unstubbed
    lens = offsets[1:] - offsets[:-1]
    if bool((lens <= 0).any()):
        raise ValueError(f"packed_from_jagged: empty row at index {int((lens <= 0).nonzero()[0])}")
    return values.reshape(1, -1).long(), offsets.to(torch.int32)


def block_causal_mask(cu_seqlens: Tensor, total: int | None = None) -> Tensor:
    """``[1, 1, T, T]`` bool, True where attention is *masked* (Megatron's convention): a token
    sees only earlier-or-equal tokens of its own sequence. The local (non-TE) attention has no
    varlen kernel, so this dense mask is how it consumes ``cu_seqlens``; RoPE is relative, so
    the sequences' offsets inside the pack do not change their scores."""
    T = int(cu_seqlens[-1]) if total is None else total
    seg = torch.repeat_interleave(
        torch.arange(cu_seqlens.numel() - 1, device=cu_seqlens.device),
        (cu_seqlens[1:] - cu_seqlens[:-1]).long(),
        output_size=T,
    )
    pos = torch.arange(T, device=cu_seqlens.device)
    allowed = (seg[:, None] == seg[None, :]) & (pos[None, :] <= pos[:, None])
    return (~allowed).reshape(1, 1, T, T)


def packed_logprobs(
    logits: Tensor, tokens: Tensor, cu_seqlens: Tensor, *, temperature: float = 1.0, return_entropy: bool = False
) -> tuple[Tensor, Tensor | None]:
    """Per packed position ``t``: ``log p(tokens[t + 1])`` within its sequence (0 at each
    sequence's last token), and optionally the entropy there. ``logits [T, V]``, ``tokens [T]``."""
    if temperature <= 0:
        raise ValueError(f"packed_logprobs: temperature must be > 0, got {temperature}")
    logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    T = tokens.numel()
    nxt = torch.cat([tokens[1:], tokens[:1]])
    lp = torch.log_softmax(logits, dim=-1).gather(-1, nxt.reshape(-1, 1).long()).squeeze(-1)
    last = torch.zeros(T, dtype=torch.bool, device=tokens.device)
    last[(cu_seqlens[1:] - 1).long()] = True
    lp = torch.where(last, torch.zeros_like(lp), lp)
    ent = None
    if return_entropy:
        ent = entropy_from_logits(logits)
        ent = torch.where(last, torch.zeros_like(ent), ent)
    return lp, ent


def unpack_to_padded(x: Tensor, cu_seqlens: Tensor, width: int) -> Tensor:
    """Packed per-token ``[T]`` -> ``[N, width]``: row ``j`` gets its first ``len_j - 1`` values
    (the scores of tokens 1..len_j-1), the rest 0. Differentiable (a gather)."""
    n = cu_seqlens.numel() - 1
    starts = cu_seqlens[:-1].long().reshape(-1, 1)
    lens = (cu_seqlens[1:] - cu_seqlens[:-1]).long().reshape(-1, 1)
    col = torch.arange(width, device=x.device).reshape(1, -1)
    keep = col < (lens - 1)
    idx = torch.where(keep, starts + col, torch.zeros_like(col))
    return torch.where(keep, x[idx.reshape(-1)].reshape(n, width), torch.zeros((), dtype=x.dtype, device=x.device))
