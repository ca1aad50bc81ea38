"""The packed refit's metadata and transfer schedule: which tensors go packed in buckets, which
on their own.

``RefitInfo`` is what the sender announces once at prepare; the schedule is a pure function of
it, so every rank derives the same one (docs/refit.md, section 3).
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

from nemo_dataplane.dtypes import check_shape
from nemo_dataplane.refit.copies import align as _align
from nemo_dataplane.refit.protocol import RefitError, TensorSpec, dtype_from_name

__all__ = [
    "DEFAULT_GROUP_BYTES",
    "DEFAULT_TRANSPORT_GPU",
    "MAX_OPS_PER_GROUP",
    "Bucket",
    "Direct",
    "RefitInfo",
    "build_plan",
    "group_directs",
]

# Direct tensors are issued in NCCL groups (one launch each) of at most this many ops / bytes
# (RefitInfo.group_bytes): large enough to amortise launch cost, small enough that the first
# group starts moving early.
MAX_OPS_PER_GROUP = 64
DEFAULT_GROUP_BYTES = 256 << 20
# What transport="auto" picks on NCCL when CUDA IPC is not possible (gloo: always "broadcast").
DEFAULT_TRANSPORT_GPU = "broadcast"


@dataclass(frozen=True)
class RefitInfo:
    """What the sender announces once. Later protocol versions add fields (e.g. layouts)."""

    tensors: tuple[TensorSpec, ...]
    bucket_bytes: int
    direct_bytes: int
    src: int
    group_bytes: int = DEFAULT_GROUP_BYTES
    # "broadcast": every transfer is one broadcast from ``src``; "p2p": ``src`` sends to each
    # receiver with NCCL/gloo send/recv (one NCCL group per transfer); "ipc": receivers copy
    # from the sender's memory through CUDA IPC handles (same host).
    transport: str = "broadcast"
    protocol: int = 1
    extra: dict[str, object] = field(default_factory=dict)

    def to_bytes(self) -> bytes:
        d = asdict(self)
        d["tensors"] = [[t.name, list(t.shape), t.dtype] for t in self.tensors]
        return json.dumps(d, sort_keys=True, separators=(",", ":")).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> RefitInfo:
        """Decode and validate (dtype from the fixed table, shapes of non-negative ints, sizes).

        Raises:
            RefitError: a malformed or out-of-range field (message names it).
        """
        try:
            d = json.loads(data)
            tensors = []
            for i, (n, s, dt) in enumerate(d.pop("tensors")):
                where = f"refit info tensors[{i}] ({n!r})"
                dtype_from_name(dt, f"{where} dtype")
                tensors.append(TensorSpec(str(n), check_shape(s, f"{where} shape", RefitError), dt))
            info = cls(tensors=tuple(tensors), **d)
        except RefitError:
            raise
        except (TypeError, ValueError, KeyError) as e:
            raise RefitError(f"malformed refit info: {type(e).__name__}: {e}") from e
        for name in ("bucket_bytes", "direct_bytes", "src", "group_bytes", "protocol"):
            v = getattr(info, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise RefitError(f"refit info {name}: must be a non-negative int, got {v!r}")
        return info

    def fingerprint(self) -> int:
        """A 31-bit checksum of the metadata; travels in every refit header."""
        return zlib.crc32(self.to_bytes()) & 0x7FFFFFFF

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)


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


def group_directs(
    plan: Sequence[Bucket | Direct], nbytes: Sequence[int], group_bytes: int, max_ops: int = MAX_OPS_PER_GROUP
) -> list[Bucket | list[int]]:
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
