"""What refit endpoints agree on: metadata, the handshake, versions, fingerprints, errors.

``prepare_refit_info()`` (once, collective): the sender publishes a ``RefitInfo`` (names,
shapes, dtypes, schedule parameters) in the group's store; each receiver checks it against its
own tensors and posts ``ok`` or its list of mismatches; every rank waits for all posts and
raises if any rank failed, so no bulk transfer starts on a bad layout. Each refit then carries
a 4-int header ``[magic, fingerprint, version, status]`` (docs/refit.md, sections 2-3).

``Endpoint`` is the part every transport shares: store keys, the status handshake, error
reports between ranks, the reusable device header, side streams.
"""

from __future__ import annotations

import contextlib
import json
import zlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Union

import torch

from nemo_dataplane.distributed.stateless_group import StatelessProcessGroup
from nemo_dataplane.dtypes import check_shape, dtype_name
from nemo_dataplane.dtypes import dtype_from_name as _dtype_from_name
from nemo_dataplane.refit.plan import DEFAULT_GROUP_BYTES, Bucket, Direct, build_plan, group_directs
from nemo_dataplane.errors import NemoDataplaneError

__all__ = [
    "DEFAULT_TRANSPORT_GPU",
    "MAGIC",
    "STATUS_ABORT",
    "STATUS_NEW_HANDLES",
    "STATUS_OK",
    "TRANSPORTS",
    "Endpoint",
    "NamedTensors",
    "RefitError",
    "RefitInfo",
    "RefitMismatchError",
    "TensorSpec",
    "clip",
    "diff_specs",
    "dtype_from_name",
    "dtype_name",
    "to_dict",
]

MAGIC = 0x52454649  # "REFI"
STATUS_OK = 0
STATUS_ABORT = 1
# ipc: the sender's tensors moved to new storage; new handles are in the store for this refit.
STATUS_NEW_HANDLES = 2
TRANSPORTS = ("auto", "broadcast", "p2p", "ipc")
# What transport="auto" picks on NCCL when CUDA IPC is not possible (gloo: always "broadcast").
DEFAULT_TRANSPORT_GPU = "broadcast"
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


def diff_specs(sent: Sequence[TensorSpec], local: Sequence[TensorSpec], *, then: str = "",
               now: str = "") -> list[str]:
    """Human-readable differences between the sender's and a receiver's tensors (empty if none).

    With ``then``/``now`` labels it instead compares one side's tensors over time.
    """
    mine = {s.name: s for s in local}
    theirs = {s.name: s for s in sent}
    a, b = (then, now) if then else ("sender", "receiver")
    out: list[str] = []
    for s in sent:
        m = mine.get(s.name)
        if m is None:
            out.append(f"{s.name}: gone since prepare_refit_info()" if then
                       else f"{s.name}: sent by the trainer, but the receiver has no such tensor")
            continue
        if m.shape != s.shape:
            out.append(f"{s.name}: shape {a} {list(s.shape)} != {b} {list(m.shape)}")
        if m.dtype != s.dtype:
            out.append(f"{s.name}: dtype {a} {s.dtype} != {b} {m.dtype}")
    for m in local:
        if m.name not in theirs:
            out.append(f"{m.name}: new since prepare_refit_info()" if then
                       else f"{m.name}: receiver tensor not sent by the trainer (it would go stale)")
    return out


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
    """What every refit endpoint shares: store keys, plan, buffers, streams, the handshake."""

    def __init__(self, group: StatelessProcessGroup, named_tensors: NamedTensors, channel: str) -> None:
        self.group = group
        self.channel = channel
        self._source = _materialize(named_tensors)
        self._gen = 0
        self.info: RefitInfo | None = None
        self.plan: list[Bucket | Direct] = []
        self._bufs: list[torch.Tensor] = []
        self._wire: list[torch.Tensor] = []
        self._views: list[list[torch.Tensor]] | None = None
        self._fp = 0
        # Refits so far; error keys carry it so a failed refit's report cannot stop the next.
        self._seq = 0
        self._streams: tuple[torch.cuda.Stream, torch.cuda.Stream] | None = None
        self._cuda = group.backend == "nccl"
        # Reused refit header: pinned host copy (no blocking host-to-device copy per refit).
        self._hdr_host: torch.Tensor | None = None
        self._hdr_dev: torch.Tensor | None = None
        self._last_status = STATUS_OK

    # -- helpers

    def _key(self, *parts: object) -> str:
        return "/".join([self.group.prefix, "refit", self.channel, *(str(p) for p in parts)])

    def _tensors(self) -> Mapping[str, torch.Tensor]:
        src = self._source() if callable(self._source) else self._source
        return src if isinstance(src, Mapping) else to_dict(src)

    def _specs_and_tensors(self) -> tuple[list[TensorSpec], dict[str, torch.Tensor]]:
        tensors = self._tensors()
        dev = self.group.device
        bad = [f"{n} on {t.device}" for n, t in tensors.items() if t.device != dev]
        if bad:
            raise RefitError(f"rank {self.group.rank}: tensors must be on the group's device {dev}: {clip(bad)}")
        return [TensorSpec.of(n, t) for n, t in tensors.items()], tensors

    def _compile(self, info: RefitInfo) -> None:
        """Precompute everything a refit needs from ``info`` so the hot path is plain lookups."""
        self.info = info
        self.plan = build_plan(info)
        self._fp = info.fingerprint()
        self._names = [t.name for t in info.tensors]
        self._shapes = [torch.Size(t.shape) for t in info.tensors]
        self._dtypes = [t.torch_dtype for t in info.tensors]
        self._bucket_idx = [[i for i, _ in b.entries] for b in self.plan if isinstance(b, Bucket)]
        self._launches = group_directs(self.plan, [t.nbytes for t in info.tensors], info.group_bytes)
        self.release_buffers()

    def _ordered(self, tensors: Mapping[str, torch.Tensor]) -> list[torch.Tensor]:
        """Tensors in ``info`` order, checked against ``info`` (layout may not change after prepare)."""
        assert self.info is not None
        out = []
        for name, shape, dt in zip(self._names, self._shapes, self._dtypes):
            t = tensors.get(name)
            if t is None or t.shape != shape or t.dtype != dt:
                break
            out.append(t)
        if len(out) == len(self._names) and len(tensors) == len(out):
            return out
        problems = diff_specs(self.info.tensors, [TensorSpec.of(n, t) for n, t in tensors.items()],
                              then="at prepare_refit_info()", now="now")
        raise RefitMismatchError(
            f"rank {self.group.rank}: tensors changed since prepare_refit_info(): {clip(problems)}")

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

    def _side_streams(self) -> tuple[torch.cuda.Stream, torch.cuda.Stream]:
        if self._streams is None:
            dev = self.group.device
            self._streams = (torch.cuda.Stream(dev), torch.cuda.Stream(dev))
        return self._streams

    def _header_on(self, stream: torch.cuda.Stream, version: int = 0, status: int = STATUS_OK,
                   fill: bool = True) -> torch.Tensor:
        """The reusable device header, written on ``stream`` (sender: the values; receiver: zeros).

        Only one refit is in flight per endpoint and each ends with a host sync of the stream
        the header travelled on, so the pinned source is free again by the next call.
        """
        with torch.cuda.stream(stream):
            if self._hdr_dev is None:
                # Made on ``stream``: an initialising kernel on another stream could land after
                # the header written here (seen on 2x H200: a receiver read an all-zero header).
                self._hdr_host = torch.zeros(4, dtype=torch.int64, pin_memory=True)
                self._hdr_dev = torch.empty(4, dtype=torch.int64, device=self.group.device)
            if fill:
                self._hdr_host.numpy()[:] = (MAGIC, self._fp, version, status)  # type: ignore[union-attr]
                self._hdr_dev.copy_(self._hdr_host, non_blocking=True)  # type: ignore[arg-type]
            else:
                self._hdr_dev.zero_()
        return self._hdr_dev

    def _check_header(self, header: torch.Tensor) -> int:
        """Receiver: the version in ``header``; raises on an abort or a wrong magic/fingerprint."""
        assert self.info is not None
        magic, fp, version, status = (int(x) for x in header.tolist())
        g = self.group
        src = self.info.src
        self._last_status = status
        if status == STATUS_ABORT:
            why = self._errors_of([src]) or "no reason posted"
            raise RefitError(f"rank {g.rank}: sender rank {src} aborted refit of version {version}: {why}")
        if magic != MAGIC or fp != self._fp:
            msg = (f"refit header mismatch (magic {magic:#x}, fingerprint {fp} vs ours "
                   f"{self._fp}): sender and receiver prepared different layouts")
            self._publish_error(msg)
            raise RefitError(f"rank {g.rank}: {msg}")
        return version

    def _watch(self) -> str | None:
        """What a peer reported failing in this refit: the sender watches every receiver, a
        receiver the sender."""
        src = self.info.src  # type: ignore[union-attr]
        g = self.group
        return self._errors_of([src] if g.rank != src else (r for r in range(g.world_size) if r != src))

    def _peers(self) -> list[int]:
        return [r for r in range(self.group.world_size) if r != self.info.src]  # type: ignore[union-attr]

    def _handshake(self, my_status: str, what: str) -> None:
        """Post this rank's status, wait for everyone's, raise if any rank failed.

        The error lists this rank's own problems first, then every other failing rank's.
        """
        g = self.group
        g.store.set(self._key(self._gen, "status", g.rank), my_status.encode())
        g.wait_for_ranks(lambda r: self._key(self._gen, "status", r), range(g.world_size), what)
        others = []
        for r in range(g.world_size):
            st = g.store.get(self._key(self._gen, "status", r)).decode()
            if st != "ok" and r != g.rank:
                others.append(f"rank {r}: {st}")
        if my_status == "ok" and not others:
            return
        mine = [] if my_status == "ok" else [f"this rank: {my_status}"]
        raise RefitMismatchError(
            f"rank {g.rank}: refit handshake failed, no weights were moved. " + " | ".join(mine + others))

    def release_buffers(self) -> None:
        """Free the bucket buffers (they are re-allocated by the next refit)."""
        self._bufs = []
        self._wire = []
        self._views = None

    def close(self) -> None:
        """Free buffers (and whatever a transport holds). Idempotent.

        Call before destroying the group; a later ``prepare_refit_info()`` sets up again.
        """
        self.release_buffers()
