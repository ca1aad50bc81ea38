"""The packed family behind the weight-transfer facade (``refit/factory.py``): ``RefitSender`` on
group rank 0, ``RefitReceiver`` on every other rank, options from a ``WeightTransferConfig``."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from nemo_dataplane.config import ConfigError
from nemo_dataplane.distributed.stateless_group import StatelessProcessGroup
from nemo_dataplane.refit.config import WeightTransferConfig
from nemo_dataplane.refit.packed.endpoints import RefitReceiver, RefitSender
from nemo_dataplane.refit.protocol import NamedTensors

__all__ = ["build_receiver", "build_sender"]


def _one_sender(senders: int) -> None:
    if senders != 1:
        raise ValueError(
            f"the packed family sends whole weights from one rank (senders=1), got senders={senders}; "
            "weights sharded over several ranks need family='reshard'"
        )


def build_sender(
    config: WeightTransferConfig,
    group: StatelessProcessGroup,
    named_tensors: NamedTensors,
    *,
    senders: int = 1,
    full_shapes: Mapping[str, tuple[Sequence[int], torch.dtype | str]] | None = None,
    device: torch.device | str | int | None = None,
) -> RefitSender:
    """A ``RefitSender`` of ``named_tensors`` (whole, on the group's device).

    ``full_shapes`` and ``device`` are not needed here: the tensors are whole and must live on
    the group's device (``prepare_refit_info()`` names any that does not).
    """
    del full_shapes, device
    _one_sender(senders)
    return RefitSender(
        group, named_tensors, config.bucket_bytes, direct_bytes=config.direct_bytes, transport=config.transport
    )


def build_receiver(
    config: WeightTransferConfig,
    group: StatelessProcessGroup,
    named_tensors: NamedTensors,
    *,
    senders: int = 1,
    device: torch.device | str | int | None = None,
    shards: object | None = None,
) -> RefitReceiver:
    """A ``RefitReceiver`` into ``named_tensors`` from group rank 0 (it follows the sender's options)."""
    del config, device
    if shards is not None:
        raise ConfigError(
            "the packed refit sends whole tensors to every receiver; receivers that hold shards "
            "(tensor-parallel generators) need family='reshard'"
        )
    _one_sender(senders)
    return RefitReceiver(group, named_tensors, src=0)
