"""Tensor copy helpers shared by the refit transports (no communication here)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

__all__ = ["ALIGN", "align", "copy_all", "slot_views"]

# Each slot starts on this boundary so a slice can be viewed as any dtype and copies stay
# vectorised.
ALIGN = 256
_UINT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def copy_all(dst: Sequence[torch.Tensor], src: Sequence[torch.Tensor]) -> None:
    """``dst[i].copy_(src[i])`` for all i (same shapes and dtypes), on the current stream.

    GPU: as few kernel launches as torch allows. CPU: numpy copies of the raw bits, single
    threaded on purpose: every torch CPU copy of a mid-size tensor wakes the OpenMP pool, and
    with gloo's threads and a second rank on the same cores those wake-ups cost far more than
    the copies (docs/refit.md, section 3).
    """
    if not dst:
        return
    if dst[0].device.type == "cpu":
        for d, x in zip(dst, src):
            try:
                bits = _UINT_OF_SIZE[d.element_size()]
                np.copyto(d.detach().view(bits).numpy(), x.detach().view(bits).numpy())
            except (KeyError, RuntimeError, TypeError):
                d.copy_(x)
        return
    try:
        torch._foreach_copy_(list(dst), list(src))
    except (RuntimeError, TypeError, NotImplementedError, AttributeError):
        for d, x in zip(dst, src):
            d.copy_(x)


def slot_views(like: Sequence[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """Contiguous tensors shaped and typed like ``like``, carved out of one new buffer."""
    offsets, end = [], 0
    for t in like:
        off = align(end)
        offsets.append(off)
        end = off + t.numel() * t.element_size()
    buf = torch.empty(max(end, 1), dtype=torch.uint8, device=device)
    return [buf[off : off + t.numel() * t.element_size()].view(t.dtype).view(t.shape) for off, t in zip(offsets, like)]
