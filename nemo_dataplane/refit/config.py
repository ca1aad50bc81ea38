"""Refit options: ``WeightTransferConfig``, with each default and each set of choices stated once.

``nemo_dataplane.refit.factory`` builds a sender or receiver of any registered family from it;
the families import their defaults and choices from here (nothing here imports a family).
No refit behaviour is selected by environment variables.

Mapping shape (``WeightTransferConfig.from_dict``; all keys optional)::

    family: packed          # packed | reshard | a family registered with register_weight_transfer
    transport: auto         # packed: auto | broadcast | p2p | ipc; reshard: auto | p2p | ipc
    bucket_bytes: null      # null: 1 GiB on GPU, 64 MiB on CPU (packed on GPU: per tensor, no buckets)
    direct_bytes: null      # null: the family's default (see the field)
    ipc_done: event         # reshard ipc: event | host
    ipc_map_peers: true     # reshard ipc: map receivers on other GPUs into the sender's context
    sender_layout: tp       # reshard: how the senders split the weights: tp | fsdp
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from nemo_dataplane.config import ConfigError, build_config

__all__ = [
    "BUILTIN_TRANSPORTS",
    "DEFAULT_BUCKET_BYTES_CPU",
    "DEFAULT_BUCKET_BYTES_GPU",
    "IPC_DONE_SIGNALS",
    "MIN_BUCKET_BYTES",
    "PACKED_TRANSPORTS",
    "RESHARD_TRANSPORTS",
    "SENDER_LAYOUTS",
    "WeightTransferConfig",
]

# Staging per bucket when none is given: GPU memory is plentiful next to a model, host memory
# of a CPU (gloo) refit less so.
DEFAULT_BUCKET_BYTES_GPU = 1 << 30
DEFAULT_BUCKET_BYTES_CPU = 64 << 20
# The smallest bucket both built-in families accept (one aligned slot of the packed family).
MIN_BUCKET_BYTES = 256

# transport= choices. packed: "broadcast" (one broadcast per transfer), "p2p" (send/recv from
# the source to each receiver), "ipc" (CUDA IPC peer copies on one host), "auto" (ipc where
# possible, else broadcast). reshard: "p2p" (send/recv over the group), "ipc" (copy-engine
# copies into the receivers' exported tensors), "auto" (ipc where every pair can, else p2p).
PACKED_TRANSPORTS = ("auto", "broadcast", "p2p", "ipc")
RESHARD_TRANSPORTS = ("auto", "p2p", "ipc")
BUILTIN_TRANSPORTS: dict[str, tuple[str, ...]] = {"packed": PACKED_TRANSPORTS, "reshard": RESHARD_TRANSPORTS}

# How a reshard ipc receiver learns that its senders' copies landed (reshard/ipc_control.py).
IpcDone = Literal["event", "host"]
IPC_DONE_SIGNALS: tuple[str, ...] = ("event", "host")

# How a reshard's senders split the weights (reshard/facade.py): "tp", tensor parallelism by the
# default naming rules (column-, row-, vocab-parallel); "fsdp", dim 0 of every tensor in
# torch.chunk sizes over the senders (FSDP2's fully_shard layout).
SenderLayout = Literal["tp", "fsdp"]
SENDER_LAYOUTS: tuple[str, ...] = ("tp", "fsdp")

_SECTION = "refit"


def _int_or_none(value: Any, name: str, minimum: int) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(
            f"{_SECTION}.{name} must be an integer >= {minimum} (or null: the family's default), got {value!r}"
        )


@dataclass(frozen=True)
class WeightTransferConfig:
    """How trainer weights reach the generator: which family, over which transport, with what staging.

    Attributes:
        family: the registered family to build: ``"packed"`` (one trainer rank sends whole
            weights to every generator rank) or ``"reshard"`` (every trainer TP rank sends only
            the slices each generator rank holds), or a third party's
            (``factory.register_weight_transfer``; checked when building).
        transport: how bytes move; ``"auto"`` lets the family pick (CUDA IPC on one host, else
            collectives). Choices per built-in family: ``BUILTIN_TRANSPORTS``.
        bucket_bytes: staging buffer size. None: ``DEFAULT_BUCKET_BYTES_GPU`` on GPU,
            ``DEFAULT_BUCKET_BYTES_CPU`` on CPU; a packed refit on GPU then sends every tensor on
            its own instead of packing (given explicitly, it packs).
        direct_bytes: tensors (packed) or contiguous pieces (reshard) at least this large skip
            the buckets and move on their own, zero-copy. None: packed, tensors larger than a
            bucket (0 on GPU when ``bucket_bytes`` is None); reshard, 1 MiB.
        ipc_done: reshard with CUDA IPC: ``"event"``: a receiver's stream waits on its senders'
            interprocess CUDA events, so ``receive_weights()`` returns with the weights valid on
            the stream current at the call, not yet on the host; ``"host"``: every rank waits
            until the senders' copies finished, so the weights are complete on return. Must be
            the same on every rank (the refit header refuses a disagreement).
        ipc_map_peers: reshard with CUDA IPC, a receiver on another GPU than its sender: map
            its memory into the sender's GPU context (needs cuda-bindings; where refused, the
            next way is taken automatically). False: torch opens it in the receiver GPU's
            context and non-contiguous pieces go as 2D copy-engine copies.
        sender_layout: reshard with several senders: how they split the weights; ``"tp"``
            (tensor-parallel shards by the default naming rules) or ``"fsdp"`` (every tensor
            split along dim 0 in ``torch.chunk`` sizes, sender ``i`` holding chunk ``i``: what
            ``fully_shard`` leaves on each rank).
    """

    family: str = "packed"
    transport: str = "auto"
    bucket_bytes: int | None = None
    direct_bytes: int | None = None
    ipc_done: IpcDone = "event"
    ipc_map_peers: bool = True
    sender_layout: SenderLayout = "tp"

    def __post_init__(self) -> None:
        if not isinstance(self.family, str) or not self.family:
            raise ConfigError(f"{_SECTION}.family must be a non-empty string, got {self.family!r}")
        if not isinstance(self.transport, str) or not self.transport:
            raise ConfigError(f"{_SECTION}.transport must be a non-empty string, got {self.transport!r}")
        choices = BUILTIN_TRANSPORTS.get(self.family)
        if choices is not None and self.transport not in choices:
            raise ConfigError(
                f"{_SECTION}.transport must be one of {list(choices)} for family "
                f"{self.family!r}, got {self.transport!r}"
            )
        _int_or_none(self.bucket_bytes, "bucket_bytes", MIN_BUCKET_BYTES)
        _int_or_none(self.direct_bytes, "direct_bytes", 0)
        if self.ipc_done not in IPC_DONE_SIGNALS:
            raise ConfigError(f"{_SECTION}.ipc_done must be one of {list(IPC_DONE_SIGNALS)}, got {self.ipc_done!r}")
        if not isinstance(self.ipc_map_peers, bool):
            raise ConfigError(f"{_SECTION}.ipc_map_peers must be true or false, got {self.ipc_map_peers!r}")
        if self.sender_layout not in SENDER_LAYOUTS:
            raise ConfigError(
                f"{_SECTION}.sender_layout must be one of {list(SENDER_LAYOUTS)}, got {self.sender_layout!r}"
            )

    @classmethod
    def from_dict(
        cls, data: Mapping[str, Any] | WeightTransferConfig | None, path: str = _SECTION
    ) -> WeightTransferConfig:
        """Validate a plain mapping (e.g. a YAML section) into a config.

        Raises:
            ConfigError: an unknown key, a value of the wrong type or out of range (named).
        """
        if isinstance(data, WeightTransferConfig):
            return data
        return build_config(cls, dict(data or {}), path)
