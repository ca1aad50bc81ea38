"""What every weight-transfer family shares, whatever moves its bytes.

* errors: ``RefitError`` (a refit failed; the message names the ranks and tensors at fault)
  and ``RefitMismatchError`` (sender and receiver disagree on names, shapes or dtypes; raised
  on every rank before any bulk data moves);
* ``TensorSpec`` and ``NamedTensors``: how endpoints describe and accept their tensors;
* the refit header's constants (``MAGIC``, ``STATUS_*``): every refit carries the sender's
  magic, a fingerprint of what was agreed at prepare, the version and a status, so a receiver
  learns of an abort or a stale layout before any bulk data moves (docs/refit.md, sections 2-3);
* ``Endpoint``: store keys under the group's prefix and a channel, a counter per prepare and
  per refit, and error reports between ranks;
* the facade: ``WeightSender`` / ``WeightReceiver``, the one interface every family
  implements, which ``nemo_dataplane.refit.factory`` builds from a ``WeightTransferConfig``.

No family module is imported here; the families import this one.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

import torch

from nemo_dataplane.distributed.stateless_group import StatelessProcessGroup
from nemo_dataplane.dtypes import dtype_from_name as _dtype_from_name
from nemo_dataplane.dtypes import dtype_name
from nemo_dataplane.errors import NemoDataplaneError

__all__ = [
    "MAGIC",
    "STATUS_ABORT",
    "STATUS_OK",
    "Endpoint",
    "NamedTensors",
    "RefitError",
    "RefitMismatchError",
    "TensorSpec",
    "WeightReceiver",
    "WeightSender",
    "clip",
    "current_tensors",
    "dtype_from_name",
    "dtype_name",
    "reusable",
    "to_dict",
]

MAGIC = 0x52454649  # "REFI"
STATUS_OK = 0
STATUS_ABORT = 1
# Mismatch messages list at most this many lines per rank.
MAX_LISTED = 20

NamedTensors = (
    Mapping[str, torch.Tensor]
    | Iterable[tuple[str, torch.Tensor]]
    | Callable[[], Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]]
)


class RefitError(NemoDataplaneError, RuntimeError):
    """A refit failed; the message names the rank(s) and tensor(s) at fault."""


class RefitMismatchError(RefitError):
    """Sender and receiver layouts differ; raised on every rank before any bulk transfer."""


def dtype_from_name(name: str, field: str = "refit metadata") -> torch.dtype:
    """The dtype of the shared table (``nemo_dataplane.dtypes.DTYPES``); ``RefitError`` naming
    ``field`` for any other name."""
    return _dtype_from_name(name, field, RefitError)


@dataclass(frozen=True)
class TensorSpec:
    """Name, shape and dtype of one transferred tensor."""

    name: str
    shape: tuple[int, ...]
    dtype: str  # torch dtype name without the "torch." prefix, e.g. "bfloat16"

    @classmethod
    def of(cls, name: str, tensor: torch.Tensor) -> TensorSpec:
        return cls(name, tuple(int(s) for s in tensor.shape), dtype_name(tensor.dtype))

    @property
    def torch_dtype(self) -> torch.dtype:
        return dtype_from_name(self.dtype)

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * self.torch_dtype.itemsize


def clip(lines: list[str]) -> str:
    """``lines`` joined, at most ``MAX_LISTED`` of them."""
    shown = lines[:MAX_LISTED]
    more = f"; ... and {len(lines) - MAX_LISTED} more" if len(lines) > MAX_LISTED else ""
    return "; ".join(shown) + more


def reusable(source: NamedTensors) -> NamedTensors:
    """``source`` in a form that can be read again at every refit: a mapping or a callable as
    it is (a callable is re-evaluated each time, so it may return fresh views), any other
    iterable of pairs as a dict (a generator such as ``module.named_parameters()`` can be
    iterated once only)."""
    if callable(source) or isinstance(source, Mapping):
        return source
    return to_dict(source)


def to_dict(items: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """``items`` as a dict; raises on a non-tensor value or a repeated name."""
    pairs = items.items() if isinstance(items, Mapping) else items
    out: dict[str, torch.Tensor] = {}
    for name, t in pairs:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"named tensor {name!r} is a {type(t).__name__}, not a torch.Tensor")
        if name in out:
            raise ValueError(f"tensor name {name!r} appears twice")
        out[name] = t
    return out


def current_tensors(source: NamedTensors) -> dict[str, torch.Tensor]:
    """What ``source`` holds now (a callable is called once), as a dict."""
    got = source() if callable(source) else source
    return dict(got) if isinstance(got, Mapping) else to_dict(got)


class Endpoint:
    """What every refit endpoint shares: its tensors, store keys, counters, error reports.

    Keys live under ``<group prefix>/refit/<channel>/``; ``_gen`` counts ``prepare_refit_info()``
    calls (a new prepare never reads an earlier one's keys) and ``_seq`` counts refits (error
    keys carry it, so a failed refit's report cannot stop the next one).
    """

    def __init__(self, group: StatelessProcessGroup, named_tensors: NamedTensors, channel: str) -> None:
        self.group = group
        self.channel = channel
        self._source = reusable(named_tensors)
        self._gen = 0
        self._seq = 0
        # Fingerprint of what the ranks agreed on at prepare; every refit header carries it.
        self._fp = 0

    def _key(self, *parts: object) -> str:
        return "/".join([self.group.prefix, "refit", self.channel, *(str(p) for p in parts)])

    def _tensors(self) -> Mapping[str, torch.Tensor]:
        src = self._source() if callable(self._source) else self._source
        return src if isinstance(src, Mapping) else to_dict(src)

    def _publish_error(self, msg: str) -> None:
        with contextlib.suppress(Exception):
            self.group.store.set(self._key("error", self._seq, self.group.rank), msg.encode())  # type: ignore[arg-type]  # torch's stub: str only

    def _errors_of(self, ranks: Iterable[int]) -> str | None:
        store = self.group.store
        found = []
        for r in ranks:
            if store.check([self._key("error", self._seq, r)]):
                msg = store.get(self._key("error", self._seq, r)).decode()
                found.append(msg if msg.startswith(f"rank {r}:") else f"rank {r}: {msg}")
        return "; ".join(found) or None

    def release_buffers(self) -> None:
        """Free staging buffers (re-allocated by the next refit); none at this level."""

    def close(self) -> None:
        """Free buffers (and whatever a transport holds). Idempotent.

        Call before destroying the group; a later ``prepare_refit_info()`` sets up again.
        """
        self.release_buffers()


# ---------------------------------------------------------------- the facade


class WeightSender(ABC):
    """Trainer side of a weight transfer, whatever the family (``factory.build_weight_sender``).

    Every method is collective with every rank of the group (each receiver calls the matching
    ``WeightReceiver`` method). Contract, checked by
    ``nemo_dataplane.testing.weight_transfer_conformance``:

    * ``prepare_refit_info()`` once before the first refit (and again after ``close()`` or
      whenever the tensors' names, shapes or dtypes change): agrees on them with every
      receiver; a disagreement raises ``RefitMismatchError`` on every rank, naming the
      parameters, before any weights move;
    * ``send_weights(version)`` moves the current values, tagged with ``version``; if this
      rank's tensors no longer match what was prepared it raises (``RefitMismatchError``), every
      receiver raises ``RefitError`` without touching its tensors, and the next refit works;
    * ``close()`` frees what the sender holds; idempotent; call on every rank before destroying
      the group.
    """

    version: int | None

    @abstractmethod
    def prepare_refit_info(self) -> object:
        """Agree on the tensors with every receiver; returns the family's description of it."""

    @abstractmethod
    def send_weights(self, version: int) -> None:
        """Send the current weights as refit ``version``."""

    @abstractmethod
    def close(self) -> None:
        """Release handles and buffers (idempotent)."""


class WeightReceiver(ABC):
    """Generator side of a weight transfer (``factory.build_weight_receiver``): writes into its
    tensors in place, so whoever holds them (an inference engine) sees the new values.

    ``receive_weights()`` returns the version the sender passed and stores it in ``version``
    (``None`` before the first refit); otherwise as ``WeightSender``. Some transports leave the
    values valid on the stream that was current at the call rather than on the host (the
    family documents it); synchronise that stream before reading them elsewhere.
    """

    version: int | None

    @abstractmethod
    def prepare_refit_info(self) -> object:
        """Agree on the tensors with the senders and every other receiver."""

    @abstractmethod
    def receive_weights(self) -> int:
        """Receive one refit into the tensors in place; return its version."""

    @abstractmethod
    def close(self) -> None:
        """Release handles and buffers (idempotent)."""
