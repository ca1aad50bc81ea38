"""What a reshard rank compares at prepare and at every refit: its tensors against what its
layout gives it, and its layout against the one its side published. Each returns one
human-readable line per problem, naming the tensor or parameter (empty: none)."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from nemo_dataplane.dtypes import dtype_name
from nemo_dataplane.refit.reshard.layout import Layout, LocalTensor

__all__ = ["diff_layouts", "diff_locals"]


def diff_locals(
    want: Mapping[str, LocalTensor], tensors: Mapping[str, torch.Tensor], device: torch.device
) -> list[str]:
    """``tensors`` against the local tensors a layout gives the rank (names, shapes, dtypes, device)."""
    out = []
    for name, lt in want.items():
        t = tensors.get(name)
        if t is None:
            out.append(f"{name}: the layout gives this rank {list(lt.shape)} {lt.dtype}, but it has no such tensor")
            continue
        shape, dt = tuple(t.shape), dtype_name(t.dtype)
        if shape != lt.shape or dt != lt.dtype:
            out.append(
                f"{name}: the layout gives this rank {list(lt.shape)} {lt.dtype}, the tensor is {list(shape)} {dt}"
            )
        if t.device != device:
            out.append(f"{name}: on {t.device}, expected {device}")
    out += [f"{n}: tensor not in the layout (it would go stale)" for n in tensors if n not in want]
    return out


def diff_layouts(own: Layout, published: Layout) -> list[str]:
    """Where this rank's layout differs from the one its side's first rank published: the
    parameters it adds, lacks or describes otherwise (shape, dtype, placements), and the mesh."""
    out = []
    if own.mesh != published.mesh:
        out.append(f"mesh {own.mesh} here, {published.mesh} published")
    for name, p in own.params.items():
        q = published.params.get(name)
        if q is None:
            out.append(f"{name}: in this rank's layout only")
        elif (p.shape, p.dtype) != (q.shape, q.dtype):
            out.append(f"{name}: {list(p.shape)} {p.dtype} here, {list(q.shape)} {q.dtype} published")
        elif p != q:
            out.append(
                f"{name}: placements {[str(x) for x in p.placements]} here, {[str(x) for x in q.placements]} published"
            )
    out += [f"{name}: missing from this rank's layout" for name in published.params if name not in own.params]
    if dict(own.fused) != dict(published.fused):
        out.append("the fused tensors differ")
    return out
