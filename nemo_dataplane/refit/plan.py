"""The broadcast refit's transfer schedule: which tensors go packed in buckets, which on their own.

A pure function of the ``RefitInfo`` both sides agreed on, so every rank derives the same one
(docs/refit.md, section 3). The shard-to-shard schedule lives in ``reshard.py``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from nemo_dataplane.refit.copies import align as _align

if TYPE_CHECKING:
    from nemo_dataplane.refit.protocol import RefitInfo

__all__ = [
    "DEFAULT_BUCKET_BYTES_CPU",
    "DEFAULT_BUCKET_BYTES_GPU",
    "DEFAULT_GROUP_BYTES",
    "MAX_OPS_PER_GROUP",
    "Bucket",
    "Direct",
    "build_plan",
    "group_directs",
]

DEFAULT_BUCKET_BYTES_GPU = 1 << 30
DEFAULT_BUCKET_BYTES_CPU = 64 << 20
# Direct tensors are issued in NCCL groups (one launch each) of at most this many ops / bytes
# (RefitInfo.group_bytes): large enough to amortise launch cost, small enough that the first
# group starts moving early.
MAX_OPS_PER_GROUP = 64
DEFAULT_GROUP_BYTES = 256 << 20


@dataclass(frozen=True)
class Bucket:
    """Tensors packed back to back: ``entries`` are (index into RefitInfo.tensors, byte offset)."""

    nbytes: int
    entries: tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class Direct:
    """One tensor broadcast on its own."""

    index: int


def build_plan(info: RefitInfo) -> list[Bucket | Direct]:
    """The transfer schedule, a pure function of ``info`` so every rank derives the same one.

    Direct tensors go in the sender's order as they come; small tensors fill buckets in the
    sender's order (a direct tensor between them does not close a bucket), a bucket going out
    when the next tensor does not fit and the last one at the end. Empty tensors are skipped.
    """
    plan: list[Bucket | Direct] = []
    entries: list[tuple[int, int]] = []
    end = 0

    def close() -> None:
        nonlocal entries, end
        if entries:
            plan.append(Bucket(end, tuple(entries)))
        entries, end = [], 0

    for i, spec in enumerate(info.tensors):
        n = spec.nbytes
        if n == 0:
            continue
        if n >= info.direct_bytes or n > info.bucket_bytes:
            plan.append(Direct(i))
            continue
        off = _align(end)
        if off + n > info.bucket_bytes:
            close()
            off = 0
        entries.append((i, off))
        end = off + n
    close()
    return plan


def group_directs(plan: Sequence[Bucket | Direct], nbytes: Sequence[int], group_bytes: int,
                  max_ops: int = MAX_OPS_PER_GROUP) -> list[Bucket | list[int]]:
    """``plan`` with consecutive ``Direct`` items merged into lists of tensor indices, each list
    one NCCL group launch: cut once it holds ``group_bytes`` (``nbytes[i]`` per tensor) or
    ``max_ops`` tensors, and at every bucket. Pure, so sender and receivers issue the same
    launches."""
    out: list[Bucket | list[int]] = []
    group: list[int] = []
    size = 0
    for item in plan:
        if isinstance(item, Bucket):
            if group:
                out.append(group)
                group, size = [], 0
            out.append(item)
            continue
        group.append(item.index)
        size += nbytes[item.index]
        if size >= group_bytes or len(group) >= max_ops:
            out.append(group)
            group, size = [], 0
    if group:
        out.append(group)
    return out
