"""The reshard family behind the weight-transfer facade (``refit/factory.py``).

Senders are group ranks ``0 .. senders - 1``, each holding its shard of every parameter under
its Hugging Face name: the trainer's tensor-parallel ranks (group rank = TP rank; the layout
follows ``build_layout``'s default rules) or, with ``sender_layout="fsdp"``, its fully sharded
ranks (every tensor split along dim 0 in ``torch.chunk`` sizes, sender ``i`` holding chunk
``i``). Every other rank receives whole tensors (generator data-parallel replicas at TP=1).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from nemo_dataplane.distributed.stateless_group import StatelessProcessGroup
from nemo_dataplane.refit.config import WeightTransferConfig
from nemo_dataplane.refit.protocol import NamedTensors, current_tensors, reusable
from nemo_dataplane.refit.reshard.endpoints import ReshardReceiver, ReshardSender
from nemo_dataplane.refit.reshard.layout import Layout, Mesh
from nemo_dataplane.refit.reshard.rules import build_layout

__all__ = ["FSDP_RULES", "build_receiver", "build_sender"]

# fully_shard's layout as a naming rule: every parameter column-split (dim 0) over its mesh dim.
FSDP_RULES: tuple[tuple[str, str], ...] = ((r"", "column"),)

FullShapes = Mapping[str, tuple[Sequence[int], torch.dtype | str]]


def _shapes(source: NamedTensors) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    return {n: (tuple(t.shape), t.dtype) for n, t in current_tensors(source).items()}


def build_sender(
    config: WeightTransferConfig,
    group: StatelessProcessGroup,
    named_tensors: NamedTensors,
    *,
    senders: int = 1,
    full_shapes: FullShapes | None = None,
    device: torch.device | str | int | None = None,
) -> ReshardSender:
    """A ``ReshardSender`` of this rank's shards (``named_tensors``) under a layout of ``senders``
    ranks split as ``config.sender_layout`` says (``tp`` or ``fsdp``).

    ``full_shapes``: the unsharded name -> (shape, dtype), identical on every sender; may be
    left out only when ``senders == 1`` (the tensors are then whole). ``device``: where the
    shards live (default: the group's device; with ``transport="ipc"`` the group may be gloo).
    """
    named_tensors = reusable(named_tensors)
    if full_shapes is None:
        if senders != 1:
            raise ValueError(f"reshard with senders={senders}: pass full_shapes (the unsharded shapes and dtypes)")
        full_shapes = _shapes(named_tensors)
    if config.sender_layout == "fsdp":
        # Every name matches the one rule: dim 0 over the "fsdp" mesh dim, 1-D norms included.
        layout = build_layout(Mesh.of(range(senders), fsdp=senders), full_shapes, rules=FSDP_RULES, tp="fsdp")
    else:
        layout = build_layout(Mesh.of(range(senders), tp=senders), full_shapes)
    return ReshardSender(
        group,
        named_tensors,
        layout,
        config.bucket_bytes,
        direct_bytes=config.direct_bytes,
        transport=config.transport,
        device=device,
        ipc_done=config.ipc_done,
        ipc_map_peers=config.ipc_map_peers,
    )


def build_receiver(
    config: WeightTransferConfig,
    group: StatelessProcessGroup,
    named_tensors: NamedTensors,
    *,
    senders: int = 1,
    device: torch.device | str | int | None = None,
    shards: Layout | None = None,
) -> ReshardReceiver:
    """A ``ReshardReceiver`` into ``named_tensors``. Without ``shards``: whole tensors, one
    replica of the receiving side (every rank from ``senders`` on holds the same whole tensors).
    With it: the receiving side's layout, whose mesh must be ranks ``senders..world-1``, and
    ``named_tensors`` this rank's local tensors under it."""
    named_tensors = reusable(named_tensors)
    receivers = list(range(senders, group.world_size))
    if shards is None:
        layout = build_layout(Mesh.of(receivers, dp=len(receivers), tp=1), _shapes(named_tensors))
    else:
        if sorted(shards.mesh.ranks) != receivers:
            raise ValueError(
                f"the receiving layout's mesh holds group ranks {sorted(shards.mesh.ranks)}, but the "
                f"receivers are ranks {receivers[0] if receivers else '-'}..{group.world_size - 1}"
            )
        layout = shards
    return ReshardReceiver(group, named_tensors, layout, device=device, ipc_done=config.ipc_done)
