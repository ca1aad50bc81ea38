"""Where a tensor-parallel generator's refit lands: this TP rank's shard of every trainer
parameter, received straight into the engine's own parameters (vLLM's column-, row- and
vocab-parallel tensors, q/k/v and gate/up fused), so no rank ever holds a whole copy.

The receiving side's layout is the default naming rules (``build_layout``) over a ``dp x tp``
mesh of the group's receiver ranks (engine ``e``'s TP rank ``t`` is group rank
``senders + e * tp + t``) with vLLM's fusions. Every receiver builds it alike from the same
inputs, so the reshard protocol's layout check agrees.

Two departures from an even split, both decided from the engine's parameter shapes (the same on
every TP rank):

* vLLM pads a vocabulary to a multiple of 64 before splitting it over TP ranks. When its rows per
  rank equal ``torch.chunk``'s, the padding only trails the last rank's real rows (received into
  the leading rows); otherwise the ranks hold different row ranges than an even split, so each
  receives that parameter whole and keeps its own rows.
* A received dtype or a layout the parameter cannot take in place (not contiguous) goes to a
  staging tensor of the shard's size and is copied in after the refit.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from nemo_dataplane.dtypes import check_shape, dtype_from_name
from nemo_dataplane.refit import DEFAULT_FUSIONS, Layout, Mesh, build_layout

__all__ = ["ShardTargets", "shard_targets"]


@dataclass
class ShardTargets:
    """What :func:`shard_targets` decided for one TP rank.

    ``rank``: its group rank; ``layout``: the receiving side's layout (pass it as the receiver's
    ``shards``); ``tensors``: the tensors to receive into, by local name (the parameters
    themselves, or staging); ``installs``: ``(parameter view, received view)`` pairs to copy
    after each refit; ``whole``: parameters received whole (vLLM's vocabulary split differs).
    """

    rank: int
    layout: Layout
    tensors: dict[str, torch.Tensor]
    installs: list[tuple[torch.Tensor, torch.Tensor]]
    whole: list[str]

    def install(self) -> None:
        """Copy what went to staging into the parameters (after each received refit)."""
        for target, received in self.installs:
            target.copy_(received)


def shard_targets(
    specs: Sequence[tuple[str, Sequence[int], str]],
    params: Mapping[str, torch.Tensor],
    *,
    senders: int,
    world_size: int,
    first_rank: int,
    tp_rank: int,
    tp: int,
    device: torch.device,
) -> ShardTargets:
    """Receive targets for TP rank ``tp_rank`` of the engine whose first group rank is
    ``first_rank``. ``specs``: the trainer's parameters (name, full shape, dtype name), as the
    senders announce them; ``params``: the engine's parameters on this rank, by name.

    Raises:
        RuntimeError: naming every parameter the two sides do not agree on (missing on either
            side, or a shard shape the engine's parameter cannot hold), with the TP rank.
    """
    receivers = world_size - senders
    if tp < 1 or receivers % tp or not 0 <= tp_rank < tp:
        raise RuntimeError(
            f"tensor-parallel refit: {receivers} receiver ranks do not split into engines of {tp} (TP rank {tp_rank})"
        )
    rank = first_rank + tp_rank
    full = {
        name: (check_shape(shape, f"param {name!r} shape"), dtype_from_name(dtype, f"param {name!r} dtype"))
        for name, shape, dtype in specs
    }
    mesh = Mesh.of(range(senders, world_size), dp=receivers // tp, tp=tp)
    layout = build_layout(mesh, full, fusions=DEFAULT_FUSIONS)
    whole = [
        n
        for n, p in layout.params.items()
        if p.rule == "vocab" and n in params and params[n].shape[0] != -(-p.shape[0] // tp)
    ]
    if whole:
        layout = build_layout(
            mesh, full, fusions=DEFAULT_FUSIONS, overrides={n: ["Replicate", "Replicate"] for n in whole}
        )
    tensors: dict[str, torch.Tensor] = {}
    installs: list[tuple[torch.Tensor, torch.Tensor]] = []
    problems: list[str] = []
    local = layout.local_tensors(rank)
    for name, lt in local.items():
        param = params.get(name)
        if param is None:
            problems.append(f"{name}: the trainer sends it, the engine has no such parameter")
            continue
        data = param.data
        shape = tuple(lt.shape)
        dtype = dtype_from_name(lt.dtype, f"param {name!r} dtype")
        if name in whole:
            start = tp_rank * data.shape[0]
            rows = max(0, min(data.shape[0], shape[0] - start))
            received = torch.empty(shape, dtype=dtype, device=device)
            tensors[name] = received
            installs.append((data[:rows], received[start : start + rows]))
            continue
        if shape == tuple(data.shape):
            target = data
        elif (
            layout.params.get(name) is not None
            and layout.params[name].rule == "vocab"
            and (shape[1:] == tuple(data.shape[1:]) and shape[0] <= data.shape[0])
        ):
            target = data[: shape[0]]  # the rows after it are vLLM's vocabulary padding
        else:
            problems.append(f"{name}: this rank's shard is {list(shape)}, the engine's parameter {list(data.shape)}")
            continue
        if target.dtype == dtype and target.is_contiguous():
            tensors[name] = target
        else:
            received = torch.empty(shape, dtype=dtype, device=device)
            tensors[name] = received
            installs.append((target, received))
    problems += [
        f"{n}: the engine's parameter receives nothing from the trainer" for n in sorted(set(params) - set(local))
    ]
    if problems:
        raise RuntimeError(
            f"tensor-parallel refit, TP rank {tp_rank} (group rank {rank}): the trainer's parameters do "
            "not fit the engine's: " + "; ".join(problems)
        )
    return ShardTargets(rank, layout, tensors, installs, whole)
