"""Builds a weight sender or receiver of any registered family from a ``WeightTransferConfig``.

Callers name no family class and take no branch on the family::

    cfg = WeightTransferConfig(family="reshard", transport="ipc", bucket_bytes=8 << 20)
    # trainer TP rank r (group rank r of senders=tp):
    sender = build_weight_sender(cfg, group, shards, senders=tp, full_shapes=shapes, device=dev)
    # generator (group ranks tp, tp + 1, ...):
    receiver = build_weight_receiver(cfg, group, tensors, senders=tp, device=dev)
    sender.prepare_refit_info() / receiver.prepare_refit_info()   # once, collective
    sender.send_weights(step) / receiver.receive_weights()         # every refit

Conventions every family follows, so that one call fits all: group ranks ``0 .. senders - 1``
send, every other rank receives; a sender passes its own tensors (whole for ``packed``, which
needs ``senders=1``; its tensor-parallel shards for ``reshard``, with ``full_shapes`` the
unsharded shapes); every receiver holds whole tensors and is written in place.

Families are registered by name (``register_weight_transfer``); ``packed`` and ``reshard``
are built in, and a third party adds its own the same way, then checks it with
``nemo_dataplane.testing.weight_transfer_conformance``.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from nemo_dataplane.config import ConfigError
from nemo_dataplane.distributed.stateless_group import StatelessProcessGroup
from nemo_dataplane.refit.config import PACKED_TRANSPORTS, RESHARD_TRANSPORTS, WeightTransferConfig
from nemo_dataplane.refit.packed import facade as _packed
from nemo_dataplane.refit.protocol import NamedTensors, WeightReceiver, WeightSender
from nemo_dataplane.refit.reshard import facade as _reshard
from nemo_dataplane.refit.reshard.layout import Layout

__all__ = [
    "FullShapes",
    "ReceiverFactory",
    "SenderFactory",
    "WeightTransferFamily",
    "build_weight_receiver",
    "build_weight_sender",
    "register_weight_transfer",
    "weight_transfer_families",
    "weight_transfer_family",
]

FullShapes = Mapping[str, tuple[Sequence[int], torch.dtype | str]]
Device = torch.device | str | int | None


class SenderFactory(Protocol):
    """How a family builds its sender; called by ``build_weight_sender`` with its arguments."""

    def __call__(
        self,
        config: WeightTransferConfig,
        group: StatelessProcessGroup,
        named_tensors: NamedTensors,
        *,
        senders: int,
        full_shapes: FullShapes | None,
        device: Device,
    ) -> WeightSender: ...


class ReceiverFactory(Protocol):
    """How a family builds its receiver; called by ``build_weight_receiver`` with its arguments."""

    def __call__(
        self,
        config: WeightTransferConfig,
        group: StatelessProcessGroup,
        named_tensors: NamedTensors,
        *,
        senders: int,
        device: Device,
        shards: Layout | None = None,
    ) -> WeightReceiver: ...


@dataclass(frozen=True)
class WeightTransferFamily:
    """A registered family: its builders and, if it restricts them, its ``transport`` choices."""

    name: str
    sender: SenderFactory
    receiver: ReceiverFactory
    transports: tuple[str, ...] | None = None


_families: dict[str, WeightTransferFamily] = {}
_lock = threading.Lock()


def register_weight_transfer(
    name: str,
    sender: SenderFactory,
    receiver: ReceiverFactory,
    *,
    transports: Sequence[str] | None = None,
    replace: bool = False,
) -> WeightTransferFamily:
    """Make ``WeightTransferConfig(family=name)`` build with ``sender`` / ``receiver``.

    ``transports``: the values ``config.transport`` may take for this family (None: any, the
    family checks). Registering a taken name raises ``ValueError`` unless ``replace``. Register
    at import of the module that defines the family, so every process that imports it (each
    rank) has it.
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"a weight-transfer family needs a non-empty name, got {name!r}")
    if not callable(sender) or not callable(receiver):
        raise TypeError(f"family {name!r}: sender and receiver must be callables")
    family = WeightTransferFamily(name, sender, receiver, None if transports is None else tuple(transports))
    with _lock:
        if name in _families and not replace:
            raise ValueError(f"weight-transfer family {name!r} is already registered (pass replace=True)")
        _families[name] = family
    return family


def weight_transfer_families() -> tuple[str, ...]:
    """The registered family names, sorted."""
    with _lock:
        return tuple(sorted(_families))


def weight_transfer_family(name: str) -> WeightTransferFamily:
    """The family registered as ``name``; ``ConfigError`` naming ``refit.family`` otherwise."""
    with _lock:
        family = _families.get(name)
    if family is None:
        raise ConfigError(
            f"refit.family={name!r} is not a registered weight-transfer family; "
            f"registered: {list(weight_transfer_families())}"
        )
    return family


def _resolve(config: WeightTransferConfig | Mapping[str, Any]) -> tuple[WeightTransferConfig, WeightTransferFamily]:
    cfg = WeightTransferConfig.from_dict(config)
    family = weight_transfer_family(cfg.family)
    if family.transports is not None and cfg.transport not in family.transports:
        raise ConfigError(
            f"refit.transport must be one of {list(family.transports)} for family {cfg.family!r}, got {cfg.transport!r}"
        )
    return cfg, family


def _check_ranks(group: StatelessProcessGroup, senders: int, sending: bool) -> None:
    if isinstance(senders, bool) or not isinstance(senders, int) or not 1 <= senders < group.world_size:
        raise ValueError(
            f"senders must be an int in [1, {group.world_size - 1}] (group ranks 0..senders-1 send, "
            f"the others receive), got {senders!r}"
        )
    if sending != (group.rank < senders):
        role = "a sender" if sending else "a receiver"
        raise ValueError(
            f"group rank {group.rank} cannot be {role} with senders={senders}: ranks 0..{senders - 1} "
            "send, the others receive"
        )


def build_weight_sender(
    config: WeightTransferConfig | Mapping[str, Any],
    group: StatelessProcessGroup,
    named_tensors: NamedTensors,
    *,
    senders: int = 1,
    full_shapes: FullShapes | None = None,
    device: Device = None,
) -> WeightSender:
    """The sender of ``config.family`` on this rank of ``group`` (one of ranks ``0..senders-1``).

    Args:
        config: the options (a mapping is validated as ``WeightTransferConfig.from_dict``).
        group: the refit group: every sender and every receiver.
        named_tensors: name -> tensor (a dict, pairs, or a callable returning either, called
            again at each refit); this rank's tensors (``reshard``: its TP shards).
        senders: how many ranks send; for ``reshard`` the trainer's tensor-parallel size.
        full_shapes: unsharded name -> (shape, dtype), for families that shard (``reshard``
            with ``senders > 1``); others ignore it.
        device: where the tensors live, if not on the group's device (a gloo control group
            with CUDA tensors); families that need the group's device ignore it.

    Raises:
        ConfigError: an unregistered family or a transport it does not offer (named).
        ValueError: a rank that is not a sender under ``senders``, or arguments the family refuses.
    """
    cfg, family = _resolve(config)
    _check_ranks(group, senders, sending=True)
    sender = family.sender(cfg, group, named_tensors, senders=senders, full_shapes=full_shapes, device=device)
    if not isinstance(sender, WeightSender):
        raise TypeError(f"family {cfg.family!r} built a {type(sender).__name__}, not a WeightSender")
    return sender


def build_weight_receiver(
    config: WeightTransferConfig | Mapping[str, Any],
    group: StatelessProcessGroup,
    named_tensors: NamedTensors,
    *,
    senders: int = 1,
    device: Device = None,
    shards: Layout | None = None,
) -> WeightReceiver:
    """The receiver of ``config.family`` on this rank of ``group`` (a rank from ``senders`` on),
    writing into ``named_tensors`` (whole tensors) in place. Arguments and errors as
    ``build_weight_sender``; every rank must pass the same ``config`` and ``senders``.

    ``shards``: receivers that hold shards (tensor-parallel generators) pass the whole receiving
    side's layout (identical on each of them; e.g. ``build_layout`` over a ``dp x tp`` mesh with
    ``fusions``); ``named_tensors`` are then this rank's local tensors under it. Only families
    that reshard take it (``reshard``; ``packed`` raises ``ConfigError``), and a family's
    receiver is called with it only when it is given."""
    cfg, family = _resolve(config)
    _check_ranks(group, senders, sending=False)
    extra = {} if shards is None else {"shards": shards}
    receiver = family.receiver(cfg, group, named_tensors, senders=senders, device=device, **extra)
    if not isinstance(receiver, WeightReceiver):
        raise TypeError(f"family {cfg.family!r} built a {type(receiver).__name__}, not a WeightReceiver")
    return receiver


register_weight_transfer("packed", _packed.build_sender, _packed.build_receiver, transports=PACKED_TRANSPORTS)
register_weight_transfer("reshard", _reshard.build_sender, _reshard.build_receiver, transports=RESHARD_TRANSPORTS)
