"""What every weight-transfer family shares, whatever moves its bytes.

* errors: ``RefitError`` (a refit failed; the message names the ranks and tensors at fault)
  and ``RefitMismatchError`` (sender and receiver disagree on names, shapes or dtypes; raised
  on every rank before any bulk data moves);
* ``TensorSpec`` and ``NamedTensors``: how endpoints describe and accept their tensors;
* the refit header's constants (``MAGIC``, ``STATUS_*``): every refit carries the sender's
  magic, a fingerprint of what was agreed at prepare, the version and a status, so a receiver
  learns of an abort or a stale layout before any bulk data moves (docs/refit.md, sections 2-3);
* ``Endpoint``: store keys under the group's prefix and a channel, a counter per prepare and
  per refit, and error reports between ranks.

No family module is imported here; the families import this one.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Union

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
    "clip",
    "dtype_from_name",
    "dtype_name",
    "to_dict",
]

MAGIC = 0x52454649  # "REFI"
STATUS_OK = 0
STATUS_ABORT = 1
# Mismatch messages list at most this many lines per rank.
MAX_LISTED = 20

NamedTensors = Union[
    Mapping[str, torch.Tensor],
    Iterable[tuple[str, torch.Tensor]],
    Callable[[], Union[Mapping[str, torch.Tensor], Iterable[tuple[str, torch.Tensor]]]],
]


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


def _materialize(source: NamedTensors) -> NamedTensors:
    # A generator (e.g. module.named_parameters()) can be iterated once only; callables are
    # re-evaluated at every refit so they may return fresh views.
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


class Endpoint:
    """What every refit endpoint shares: its tensors, store keys, counters, error reports.

    Keys live under ``<group prefix>/refit/<channel>/``; ``_gen`` counts ``prepare_refit_info()``
    calls (a new prepare never reads an earlier one's keys) and ``_seq`` counts refits (error
    keys carry it, so a failed refit's report cannot stop the next one).
    """

    def __init__(self, group: StatelessProcessGroup, named_tensors: NamedTensors, channel: str) -> None:
        self.group = group
        self.channel = channel
        self._source = _materialize(named_tensors)
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
            self.group.store.set(self._key("error", self._seq, self.group.rank), msg.encode())

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

