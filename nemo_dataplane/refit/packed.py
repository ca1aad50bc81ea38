"""Packed weight refit: trainer rank ``src`` broadcasts its parameters to every generator rank.

Protocol (see docs/refit.md):

1. ``prepare_refit_info()`` (once, collective): the sender publishes a ``RefitInfo`` (names,
   shapes, dtypes, bucket schedule parameters) in the group's store; each receiver checks it
   against its own tensors and posts ``ok`` or its list of mismatches; every rank waits for
   all posts and raises if any rank failed, so no bulk transfer starts on a bad layout.
2. ``send_weights(version)`` / ``receive_weights()`` (each refit, collective): a 4-int header
   ``[magic, fingerprint, version, status]`` is broadcast, then the plan derived from the
   ``RefitInfo`` (identical on all ranks): small tensors packed back to back into buckets of
   ``bucket_bytes``, each bucket one broadcast; tensors of at least ``direct_bytes`` (and any
   larger than a bucket) broadcast on their own, straight from/into the tensor when it is
   contiguous. Two bucket buffers alternate, so packing bucket k+1 (sender) and unpacking
   bucket k-1 (receiver) overlap with broadcasting bucket k.

Peak extra memory per rank: two buckets (allocated on first use, kept for later refits until
``release_buffers()``), plus one temporary copy of a direct tensor that is not contiguous.

``transport="ipc"`` (same host, CUDA; ``nemo_dataplane/refit/ipc.py``) moves no bulk data over
the group: CUDA IPC handles are exchanged once, and every refit is copy-engine peer copies
between the two processes' tensors. ``push`` (default where possible): the sender writes into
the receivers' exported tensors, gated on the GPU by a readiness ``all_reduce``, then sends the
header and a verdict. ``pull``: receivers copy out of the sender's exported tensors after the
header, then acknowledge. docs/refit.md, section 3a.
"""

from __future__ import annotations

import contextlib
import json
import time
import zlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Union

import torch

from nemo_dataplane.distributed.stateless_group import StatelessProcessGroup
from nemo_dataplane.refit import ipc as _ipc
from nemo_dataplane.refit.copies import ALIGN as _ALIGN
from nemo_dataplane.refit.copies import align as _align
from nemo_dataplane.refit.copies import copy_all

__all__ = [
    "DEFAULT_BUCKET_BYTES_CPU",
    "DEFAULT_BUCKET_BYTES_GPU",
    "DEFAULT_GROUP_BYTES",
    "TRANSPORTS",
    "Bucket",
    "Direct",
    "NamedTensors",
    "RefitError",
    "RefitInfo",
    "RefitMismatchError",
    "RefitReceiver",
    "RefitSender",
    "TensorSpec",
    "build_plan",
    "diff_specs",
]

DEFAULT_BUCKET_BYTES_GPU = 1 << 30
DEFAULT_BUCKET_BYTES_CPU = 64 << 20
_MAGIC = 0x52454649  # "REFI"
_STATUS_OK = 0
_STATUS_ABORT = 1
# ipc: the sender's tensors moved to new storage; new handles are in the store for this refit.
_STATUS_NEW_HANDLES = 2
# Direct tensors are issued in NCCL groups (one launch each) of at most this many ops / bytes
# (RefitInfo.group_bytes): large enough to amortise launch cost, small enough that the first
# group starts moving early.
_MAX_OPS_PER_GROUP = 64
DEFAULT_GROUP_BYTES = 256 << 20
TRANSPORTS = ("auto", "broadcast", "p2p", "ipc")
# What transport="auto" picks on NCCL when CUDA IPC is not possible (gloo: always "broadcast").
DEFAULT_TRANSPORT_GPU = "broadcast"
# transport="auto" on NCCL picks "ipc" when every rank is on the sender's host and can see its
# GPU (falling back to DEFAULT_TRANSPORT_GPU if opening the handles fails anywhere), for at most
# AUTO_IPC_MAX_RECEIVERS receivers: each receiver pulls its own copy out of the sender's GPU,
# so several share the sender's NVLink bandwidth, where a broadcast forwards along a ring
# (measured: one receiver on 2x H200, docs/refit.md section 5).
AUTO_PICKS_IPC = True
AUTO_IPC_MAX_RECEIVERS = 1
IPC_COPY_ON = ("src", "dst")
# "push": receivers export their tensors once and the sender writes into them with copy-engine
# copies, gated on the GPU by the receivers' readiness: no host round trip before the first
# byte moves. "pull": the sender exports its tensors and each receiver copies them out after
# the refit header reached its host. None: push where the sender sees the receivers' GPUs,
# else pull (docs/refit.md, section 3).
IPC_DIRECTIONS = ("push", "pull")
# Mismatch messages list at most this many lines per rank.
_MAX_LISTED = 20

NamedTensors = Union[
    Mapping[str, torch.Tensor],
    Iterable[tuple[str, torch.Tensor]],
    Callable[[], Union[Mapping[str, torch.Tensor], Iterable[tuple[str, torch.Tensor]]]],
]


class RefitError(RuntimeError):
    """A refit failed; the message names the rank(s) and tensor(s) at fault."""


class RefitMismatchError(RefitError):
    """Sender and receiver layouts differ; raised on every rank before any bulk transfer."""


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _dtype_from_name(name: str) -> torch.dtype:
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise RefitError(f"unknown dtype {name!r} in refit metadata (torch {torch.__version__})")
    return dt



@dataclass(frozen=True)
class TensorSpec:
    """Name, shape and dtype of one transferred tensor."""

    name: str
    shape: tuple[int, ...]
    dtype: str  # torch dtype name without the "torch." prefix, e.g. "bfloat16"

    @classmethod
    def of(cls, name: str, tensor: torch.Tensor) -> TensorSpec:
        return cls(name, tuple(int(s) for s in tensor.shape), _dtype_name(tensor.dtype))

    @property
    def torch_dtype(self) -> torch.dtype:
        return _dtype_from_name(self.dtype)

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
        d = json.loads(data)
        tensors = tuple(TensorSpec(n, tuple(s), dt) for n, s, dt in d.pop("tensors"))
        return cls(tensors=tensors, **d)

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


def group_directs(plan: Sequence[Bucket | Direct], nbytes: Sequence[int], group_bytes: int,
                  max_ops: int = _MAX_OPS_PER_GROUP) -> list[Bucket | list[int]]:
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


def _clip(lines: list[str]) -> str:
    shown = lines[:_MAX_LISTED]
    more = f"; ... and {len(lines) - _MAX_LISTED} more" if len(lines) > _MAX_LISTED else ""
    return "; ".join(shown) + more


def _materialize(source: NamedTensors) -> NamedTensors:
    # A generator (e.g. module.named_parameters()) can be iterated once only; callables are
    # re-evaluated at every refit so they may return fresh views.
    if callable(source) or isinstance(source, Mapping):
        return source
    return _to_dict(source)


def _to_dict(items: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    pairs = items.items() if isinstance(items, Mapping) else items
    out: dict[str, torch.Tensor] = {}
    for name, t in pairs:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"named tensor {name!r} is a {type(t).__name__}, not a torch.Tensor")
        if name in out:
            raise ValueError(f"tensor name {name!r} appears twice")
        out[name] = t
    return out


class _Endpoint:
    """What sender and receiver share: store keys, plan, buffers, streams."""

    def __init__(self, group: StatelessProcessGroup, named_tensors: NamedTensors, channel: str) -> None:
        self.group = group
        self.channel = channel
        self._source = _materialize(named_tensors)
        self._gen = 0
        self.info: RefitInfo | None = None
        self.plan: list[Bucket | Direct] = []
        self._bufs: list[torch.Tensor] = []
        self._views: list[list[torch.Tensor]] | None = None
        self._fp = 0
        # Refits so far; error keys carry it so a failed refit's report cannot stop the next.
        self._seq = 0
        self._streams: tuple[torch.cuda.Stream, torch.cuda.Stream] | None = None
        self._cuda = group.backend == "nccl"
        # transport="ipc" state (see nemo_dataplane/refit/ipc.py)
        self._ipc_views: list[torch.Tensor | None] | None = None  # receiver: sender's memory
        self._ipc_plan_cache: tuple | None = None
        self._ipc_keep: list[torch.Tensor] | None = None  # sender: the exported tensors
        self._ipc_sig: list | None = None
        self._ipc_streams: tuple[torch.cuda.Stream, torch.cuda.Stream] | None = None
        # ipc_direction="push": the sender's view of the receivers' memory and its copy stream;
        # the receiver's exported targets.
        self._push_src: _ipc.PushSource | None = None
        self._push_tgt: _ipc.PushTargets | None = None
        self._push_stream: torch.cuda.Stream | None = None
        self._flags: torch.Tensor | None = None  # push: [ready, verdict]
        # Reused refit header: pinned host copy (no blocking host-to-device copy per refit).
        self._hdr_host: torch.Tensor | None = None
        self._hdr_dev: torch.Tensor | None = None
        # Receiver, transport="ipc": set ipc_timing to record CUDA events around the copies and
        # the ack; ipc_phases then holds the last refit's host timestamps (perf_counter) and
        # GPU times (docs/refit.md, section 5).
        self.ipc_timing = False
        self.ipc_phases: dict[str, object] = {}
        self._copier: _ipc.PeerCopier | None = None
        self._ack: torch.Tensor | None = None
        self._last_status = _STATUS_OK
        # Why transport="auto" did not end up on "ipc" (None: it did, or it was not asked for).
        self.ipc_fallback_reason: str | None = None

    # -- helpers

    def _key(self, *parts: object) -> str:
        return "/".join([self.group.prefix, "refit", self.channel, *(str(p) for p in parts)])

    def _tensors(self) -> Mapping[str, torch.Tensor]:
        src = self._source() if callable(self._source) else self._source
        return src if isinstance(src, Mapping) else _to_dict(src)

    def _specs_and_tensors(self) -> tuple[list[TensorSpec], dict[str, torch.Tensor]]:
        tensors = self._tensors()
        dev = self.group.device
        bad = [f"{n} on {t.device}" for n, t in tensors.items() if t.device != dev]
        if bad:
            raise RefitError(f"rank {self.group.rank}: tensors must be on the group's device {dev}: {_clip(bad)}")
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
            f"rank {self.group.rank}: tensors changed since prepare_refit_info(): {_clip(problems)}")

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

    def _bucket_views(self) -> list[list[torch.Tensor]]:
        """Per bucket, typed views of its slot in the two reusable buffers (built once)."""
        if self._views is None:
            buckets = [b for b in self.plan if isinstance(b, Bucket)]
            views: list[list[torch.Tensor]] = []
            self._wire = []
            if buckets:
                size = max(b.nbytes for b in buckets)
                bufs = [torch.empty(size, dtype=torch.uint8, device=self.group.device)
                        for _ in range(min(2, len(buckets)))]
                for k, b in enumerate(buckets):
                    buf = bufs[k & 1]
                    views.append([buf[off: off + self.info.tensors[i].nbytes]  # type: ignore[union-attr]
                                  .view(self._dtypes[i]).view(self._shapes[i]) for i, off in b.entries])
                    self._wire.append(buf[: b.nbytes])
                self._bufs = bufs
            self._views = views
        return self._views

    def _side_streams(self) -> tuple[torch.cuda.Stream, torch.cuda.Stream]:
        if self._streams is None:
            dev = self.group.device
            self._streams = (torch.cuda.Stream(dev), torch.cuda.Stream(dev))
        return self._streams

    def _header_on(self, stream: torch.cuda.Stream, version: int = 0, status: int = _STATUS_OK,
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
                self._hdr_host.numpy()[:] = (_MAGIC, self._fp, version, status)  # type: ignore[union-attr]
                self._hdr_dev.copy_(self._hdr_host, non_blocking=True)  # type: ignore[arg-type]
            else:
                self._hdr_dev.zero_()
        return self._hdr_dev

    def _peers(self) -> list[int]:
        return [r for r in range(self.group.world_size) if r != self.info.src]  # type: ignore[union-attr]

    def _xfer(self, t: torch.Tensor, stream: torch.cuda.Stream | None = None, async_op: bool = False) -> list:
        """Move ``t`` from ``src`` to every receiver (sender: reads it; receiver: writes it).

        Returns the gloo work handles (``async_op``); NCCL ops are enqueued on ``stream``.
        """
        g = self.group
        info = self.info
        assert info is not None
        if info.transport != "p2p":
            w = g.broadcast(t, info.src, stream=stream, async_op=async_op)
            return [w] if w is not None else []
        if g.rank != info.src:
            w = g.recv(t, info.src, stream=stream, async_op=async_op)
            return [w] if w is not None else []
        peers = self._peers()
        if self._cuda and len(peers) > 1 and not g._in_coalesce:
            with g.coalesce():
                for r in peers:
                    g.send(t, r, stream=stream)
            return []
        works = [g.send(t, r, stream=stream, async_op=async_op) for r in peers]
        return [w for w in works if w is not None]

    def _connect_p2p(self) -> None:
        """p2p transport: a small send/recv so NCCL sets up the connections now, not mid-refit."""
        info = self.info
        assert info is not None
        if info.transport != "p2p":
            return
        g = self.group
        t = torch.full((4,), 7 + info.src, dtype=torch.int32, device=g.device)
        if g.rank != info.src:
            t.fill_(-1)
        stream = torch.cuda.current_stream(g.device) if self._cuda else None
        for w in self._xfer(t, stream=stream, async_op=not self._cuda):
            w.wait()
        g.synchronize()
        if g.rank != info.src and t.tolist() != [7 + info.src] * 4:
            raise RefitError(f"rank {g.rank}: p2p connection check from sender rank {info.src} "
                             f"returned {t.tolist()}")

    def release_buffers(self) -> None:
        """Free the bucket buffers (they are re-allocated by the next refit)."""
        self._bufs = []
        self._wire: list[torch.Tensor] = []
        self._views = None

    def close(self) -> None:
        """Free buffers and drop CUDA IPC handles (sender: exported, receiver: opened). Idempotent.

        Call before destroying the group; a later ``prepare_refit_info()`` sets up again.
        """
        self.release_buffers()
        self._drop_ipc()

    def _drop_ipc(self) -> None:
        had = (self._ipc_views is not None or self._ipc_keep is not None or self._push_src is not None
               or self._push_tgt is not None)
        self._push_src = None
        self._push_tgt = None
        self._push_stream = None
        self._ipc_views = None
        self._ipc_plan_cache = None
        self._ipc_keep = None
        self._ipc_sig = None
        self._ipc_streams = None
        if had and self._cuda:
            with contextlib.suppress(Exception):
                torch.cuda.ipc_collect()

    def _post_host(self) -> None:
        if self._cuda:
            g = self.group
            g.store.set(self._key(self._gen, "host", g.rank), json.dumps(_ipc.host_record(g.device)).encode())

    def _ipc_agree(self, my_status: str) -> None:
        """Every rank posts whether its IPC setup worked; all decide alike: go on, fall back, or raise."""
        g = self.group
        info = self.info
        assert info is not None
        g.store.set(self._key(self._gen, "ipc_open", g.rank), my_status.encode())
        g.wait_for_ranks(lambda r: self._key(self._gen, "ipc_open", r), range(g.world_size),
                         "CUDA IPC setup (waiting for every rank to open the sender's handles)")
        bad = []
        for r in range(g.world_size):
            st = g.store.get(self._key(self._gen, "ipc_open", r)).decode()
            if st != "ok":
                bad.append(f"rank {r}: {st}")
        if not bad:
            return
        self._drop_ipc()
        if info.extra.get("ipc_fallback"):
            # transport="auto": every rank switches to the NCCL transport the same way.
            self._compile(replace(info, transport=DEFAULT_TRANSPORT_GPU, extra={}))
            self.ipc_fallback_reason = "; ".join(bad)
            return
        raise RefitError(f"rank {g.rank}: transport='ipc' setup failed, no weights were moved: {_clip(bad)}")

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


class RefitSender(_Endpoint):
    """Trainer side: broadcasts ``named_tensors`` from this rank (the group's ``src``).

    Args:
        group: the refit group; this rank is the source.
        named_tensors: name -> tensor (a dict, pairs, or a callable returning either); tensors
            may be non-contiguous; they must keep their layout after ``prepare_refit_info``.
        bucket_bytes: bucket size (default 1 GiB on GPU, 64 MiB on CPU).
        direct_bytes: tensors at least this large skip the buckets and go on their own; ``0``
            sends every tensor on its own. Default: ``0`` on GPU when ``bucket_bytes`` is not
            given (per-tensor measured fastest over NVLink, docs/refit.md section 5), otherwise
            only tensors larger than a bucket.
        group_bytes: on GPU, direct tensors are issued in NCCL groups of about this many bytes.
        transport: ``"broadcast"`` (one broadcast per transfer), ``"p2p"`` (send/recv from the
            source to each receiver; measured no faster than broadcast on 2x H200, kept for
            comparison), ``"ipc"`` (same host, NCCL group: receivers copy from this process's
            tensors through CUDA IPC handles with copy-engine peer copies; raises if a rank is
            elsewhere or cannot open the handles) or ``"auto"`` (on NCCL with at most
            ``AUTO_IPC_MAX_RECEIVERS`` receivers: ``"ipc"`` when every rank is on this host and
            sees this GPU, falling back to ``DEFAULT_TRANSPORT_GPU`` if setup fails anywhere;
            otherwise ``DEFAULT_TRANSPORT_GPU``; on gloo: broadcast).
            ``self.transport`` holds the one in use after ``prepare_refit_info()``.
        ipc_direction: ``"ipc"``: ``"push"`` (receivers export their tensors once; at
            ``send_weights()`` this process writes into them with copy-engine copies, gated on
            the GPU by every receiver having entered ``receive_weights()`` and finished its
            queued work on them; no host round trip before the first byte moves), ``"pull"``
            (receivers open this process's tensors and copy them out once the refit header
            reached their host) or ``None`` (push where this process sees every receiver's GPU,
            else pull). docs/refit.md, section 3.
        ipc_copy_on: pull only: the receiver issues its copies on a stream of the sender's GPU
            (``"src"``) or of its own (``"dst"``); measured equal.
        channel: store namespace, for several senders on one group.
    """

    def __init__(self, group: StatelessProcessGroup, named_tensors: NamedTensors,
                 bucket_bytes: int | None = None, *, direct_bytes: int | None = None,
                 group_bytes: int = DEFAULT_GROUP_BYTES, transport: str = "auto",
                 ipc_direction: str | None = None, ipc_copy_on: str = "src",
                 channel: str = "default") -> None:
        super().__init__(group, named_tensors, channel)
        if transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {TRANSPORTS}, got {transport!r}")
        if transport == "ipc" and not self._cuda:
            raise ValueError("transport='ipc' needs CUDA tensors on an NCCL group (backend='nccl')")
        if ipc_copy_on not in IPC_COPY_ON:
            raise ValueError(f"ipc_copy_on must be one of {IPC_COPY_ON}, got {ipc_copy_on!r}")
        self.ipc_copy_on = ipc_copy_on
        if ipc_direction is not None and ipc_direction not in IPC_DIRECTIONS:
            raise ValueError(f"ipc_direction must be one of {IPC_DIRECTIONS} or None, got {ipc_direction!r}")
        self.ipc_direction = ipc_direction
        self._direction = "pull"
        self._requested = transport
        packed_by_default = bucket_bytes is not None or not self._cuda
        if bucket_bytes is None:
            bucket_bytes = DEFAULT_BUCKET_BYTES_GPU if self._cuda else DEFAULT_BUCKET_BYTES_CPU
        if bucket_bytes < _ALIGN:
            raise ValueError(f"bucket_bytes must be >= {_ALIGN}, got {bucket_bytes}")
        self.bucket_bytes = int(bucket_bytes)
        if direct_bytes is None:
            # GPU default: per-tensor (measured faster than packing on NVLink, docs/refit.md);
            # an explicit bucket_bytes, or CPU, means packing.
            direct_bytes = self.bucket_bytes + 1 if packed_by_default else 0
        self.direct_bytes = int(direct_bytes)
        self.group_bytes = int(group_bytes)
        if transport == "auto":
            transport = DEFAULT_TRANSPORT_GPU if self._cuda else "broadcast"
        self.transport = transport
        self.src = group.rank
        self.version: int | None = None

    def prepare_refit_info(self) -> RefitInfo:
        """Publish names/shapes/dtypes; return once every receiver accepted them (collective).

        Raises ``RefitMismatchError`` listing each receiver's mismatches if any rank rejects.
        """
        g = self.group
        self._gen += 1
        self._drop_ipc()
        self._post_host()
        try:
            specs, tensors = self._specs_and_tensors()
            transport, fallback = self._choose_transport()
            extra: dict[str, object] = {}
            if transport == "ipc":
                extra = {"ipc_fallback": fallback, "ipc_direction": self._direction}
                if self._direction == "pull":
                    extra.update(ipc_copy_on=self.ipc_copy_on)
            info = RefitInfo(tuple(specs), self.bucket_bytes, self.direct_bytes, self.src, self.group_bytes,
                             transport=transport, extra=extra)
        except Exception as e:
            # Receivers are waiting on this key; tell them why instead of letting them time out.
            g.store.set(self._key(self._gen, "info"), json.dumps({"error": str(e)}).encode())
            raise
        g.store.set(self._key(self._gen, "info"), info.to_bytes())
        self._compile(info)
        self._handshake("ok", "refit handshake (waiting for receivers to check the layout)")
        if info.transport == "ipc" and info.extra.get("ipc_direction") == "push":
            self._open_push(self._ordered(tensors))
        elif info.transport == "ipc":
            self._export_ipc(self._ordered(tensors))
        self._connect_p2p()
        self.transport = self.info.transport  # type: ignore[union-attr]
        return self.info  # type: ignore[return-value]

    def _choose_transport(self) -> tuple[str, bool]:
        """(transport, whether a failed IPC setup may fall back); ipc/auto check the ranks' hosts."""
        want = self._requested
        if not self._cuda:
            return ("broadcast" if want == "auto" else want), False
        g = self.group
        if want not in ("ipc", "auto") or (want == "auto" and (
                not AUTO_PICKS_IPC or g.world_size - 1 > AUTO_IPC_MAX_RECEIVERS)):
            return (DEFAULT_TRANSPORT_GPU if want == "auto" else want), False
        g.wait_for_ranks(lambda r: self._key(self._gen, "host", r), range(g.world_size),
                         "refit host check (waiting for every rank's host and GPU)")
        records = {r: json.loads(g.store.get(self._key(self._gen, "host", r))) for r in range(g.world_size)}
        push_problems = _ipc.ipc_problems(records, g.rank, push=True)
        problems = _ipc.ipc_problems(records, g.rank)
        if self.ipc_direction in (None, "push") and not push_problems:
            self._direction = "push"
            return "ipc", want == "auto"
        if self.ipc_direction == "push":
            problems = push_problems
        elif not problems:
            self._direction = "pull"
            return "ipc", want == "auto"
        if want == "ipc":
            raise RefitError(f"rank {g.rank}: transport='ipc' needs every rank on the sender's host with "
                             f"its GPU visible: {_clip(problems)}")
        self.ipc_fallback_reason = "; ".join(problems)
        return DEFAULT_TRANSPORT_GPU, False

    def _export_blob(self, tensors: list[torch.Tensor]) -> bytes:
        return _ipc.export_tensors([t if t.numel() else None for t in tensors], self.group.device)

    def _export_ipc(self, tensors: list[torch.Tensor]) -> None:
        g = self.group
        status = "ok"
        try:
            blob = self._export_blob(tensors)
        except Exception as e:
            status = f"sender could not export CUDA IPC handles: {e}"
            blob = json.dumps({"error": status}).encode()
        g.store.set(self._key(self._gen, "ipc_handles"), blob)
        if status == "ok":
            self._ipc_keep = list(tensors)
            self._ipc_sig = _ipc.signature(tensors)
        self._ipc_agree(status)

    def _open_push(self, tensors: list[torch.Tensor]) -> None:
        """Push: open every receiver's exported tensors once and plan the copies into them."""
        g = self.group
        peers = self._peers()
        key = lambda r: self._key(self._gen, "ipc_dst", r)  # noqa: E731
        g.wait_for_ranks(key, peers, "CUDA IPC handles of the receivers' tensors (ipc_direction='push')")
        status = "ok"
        try:
            if self._copier is None:
                self._copier = _ipc.PeerCopier()
            self._push_stream = torch.cuda.Stream(g.device)
            self._push_src = _ipc.PushSource({r: g.store.get(key(r)) for r in peers}, g.device, self._copier)
            self._push_src.plan(tensors, self._push_stream)
        except Exception as e:
            self._drop_ipc()
            status = f"sender could not open the receivers' CUDA IPC handles: {e}"
        self._ipc_agree(status)

    def _send_push(self, version: int) -> None:
        """Push: gate, copies, then the checks, the header (after the copies) and the verdict.

        The copies of the current plan are issued before this refit's tensors are looked up
        and checked: host work before the first byte moves is on the critical path. If the
        tensors moved, the copies are redone from the new ones before the header goes out; if
        their layout changed, the header aborts the refit (the receivers' tensors are then
        undefined, as after a failure mid-transfer on the other transports). Each refit is, on
        both sides and in this order: readiness all_reduce, header broadcast, verdict all_reduce.
        """
        g = self.group
        ph = self.ipc_phases = {"t_enter": time.perf_counter()}
        cur = torch.cuda.current_stream(g.device)
        comm, _ = self._side_streams()
        push, src, copier = self._push_stream, self._push_src, self._copier
        assert push is not None and src is not None and copier is not None
        if self._flags is None:
            self._flags = torch.zeros(2, dtype=torch.int32, device=g.device)
        # ``ready`` is 0 everywhere and stays 0: the all_reduce is only a gate. Each receiver
        # joins it once its own queued work on its tensors is done, and the copies queued
        # behind it on our copy stream wait for that on the GPU, not on this host.
        ready, verdict = self._flags[:1], self._flags[1:]
        timing = self.ipc_timing
        if timing:
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        failed: Exception | None = None
        gated = False
        try:
            push.wait_stream(cur)  # read the weights after whatever wrote them
            if src.needs_gather:
                with torch.cuda.stream(push):
                    src.gather()  # non-contiguous sources into scratch (needs no receiver)
            g.all_reduce(ready, "max", stream=push)
            gated = True
            ph["t_gate"] = time.perf_counter()
            if timing:
                e0.record(push)
            copier.issue(*src.current, push, [push])
            ph["t_issued"] = time.perf_counter()
            tensors = self._ordered(self._tensors())
            redo = src.plan(tensors, push)
            if redo is not None:  # our tensors moved: copy again from where they are now
                if src.needs_gather:
                    with torch.cuda.stream(push):
                        src.gather()
                copier.issue(*redo, push, [push])
            if timing:
                e1.record(push)
        except Exception as e:
            failed = e
            self._publish_error(f"sender failed to push refit version {version}: {e}")
            if not gated:  # keep the receivers' sequence of collectives
                g.all_reduce(ready, "max", stream=comm)
        comm.wait_stream(push)
        g.broadcast(self._header_on(comm, version, _STATUS_ABORT if failed else _STATUS_OK), self.src,
                    stream=comm)
        with torch.cuda.stream(comm):
            verdict.zero_()
        g.all_reduce(verdict, "max", stream=comm)
        ph["t_header_sent"] = time.perf_counter()
        # Later writes to the weights (optimizer step) wait for the copies reading them.
        cur.wait_stream(comm)
        g.synchronize(comm, watch=self._watch, what=f"refit push of version {version}")
        if failed is not None:
            if isinstance(failed, RefitError):
                raise failed
            raise RefitError(f"rank {g.rank}: failed to push refit version {version}: {failed}") from failed
        if timing:
            ph["copy_gpu_ms"] = e0.elapsed_time(e1)
            ph["copy_mode"] = copier.mode  # type: ignore[assignment]
        if int(verdict.item()):
            why = self._watch() or "no reason posted"
            raise RefitError(f"rank {g.rank}: a receiver could not take refit version {version} "
                             f"(the copies went to memory it no longer uses): {why}")

    def send_weights(self, version: int) -> None:
        """Broadcast all tensors, tagged with ``version``; returns when the last byte left (bounded)."""
        if self.info is None:
            raise RefitError(f"rank {self.group.rank}: call prepare_refit_info() before send_weights()")
        self._seq += 1
        if self._push_src is not None:
            with torch.no_grad():
                self._send_push(version)  # checks the tensors itself, after issuing the copies
            self.version = version
            return
        try:
            ordered = self._ordered(self._tensors())
        except Exception as e:
            # Receivers are blocked on the header broadcast: tell them to stop, then raise.
            self._publish_error(str(e))
            self._broadcast_header(version, _STATUS_ABORT)
            raise
        try:
            with torch.no_grad():
                if self.info.transport == "ipc":
                    self._send_ipc(ordered, version)
                elif self._cuda:
                    self._send_cuda(ordered, version)
                else:
                    self._send_cpu(ordered, version)
        except Exception as e:
            self._publish_error(f"sender failed during refit of version {version}: {e}")
            raise
        self.version = version

    def _header(self, version: int, status: int) -> torch.Tensor:
        assert self.info is not None
        return torch.tensor([_MAGIC, self._fp, version, status], dtype=torch.int64,
                            device=self.group.device)

    def _broadcast_header(self, version: int, status: int) -> None:
        g = self.group
        with contextlib.suppress(Exception):
            g.broadcast(self._header(version, status), self.src)
            g.synchronize()

    def _watch(self) -> str | None:
        return self._errors_of(r for r in range(self.group.world_size) if r != self.src)

    def _send_ipc(self, tensors: list[torch.Tensor], version: int) -> None:
        """Header (with new handles if a tensor moved), then wait for every receiver's ack."""
        g = self.group
        self.ipc_phases = {"t_enter": time.perf_counter()}
        status = _STATUS_OK
        old = None
        sig = _ipc.signature(tensors)
        if sig != self._ipc_sig:
            # A tensor now lives elsewhere (e.g. the callable returned new tensors): publish new
            # handles for this refit; the old tensors stay alive until the receivers' ack.
            g.store.set(self._key(self._gen, "ipc_handles", self._seq), self._export_blob(tensors))
            old, self._ipc_keep, self._ipc_sig = self._ipc_keep, list(tensors), sig
            status = _STATUS_NEW_HANDLES
        cur = torch.cuda.current_stream(g.device)
        comm, _ = self._side_streams()
        if self._ack is None:
            self._ack = torch.zeros(1, dtype=torch.int32, device=g.device)
        # The header leaves only after whatever wrote the weights on the current stream, so a
        # receiver that has it may read them.
        comm.wait_stream(cur)
        g.broadcast(self._header_on(comm, version, status), self.src, stream=comm)
        self.ipc_phases["t_header_sent"] = time.perf_counter()
        with torch.cuda.stream(comm):
            self._ack.zero_()
        g.all_reduce(self._ack, "max", stream=comm)
        # Later writes to the weights (optimizer step) wait for every receiver's ack.
        cur.wait_stream(comm)
        g.synchronize(comm, watch=self._watch, what=f"refit send of version {version} (waiting for receivers' ack)")
        del old
        if int(self._ack.item()):
            why = self._watch() or "no reason posted"
            raise RefitError(f"rank {g.rank}: a receiver failed to copy refit version {version}: {why}")

    def _send_cpu(self, tensors: list[torch.Tensor], version: int) -> None:
        g = self.group
        views = self._bucket_views()
        works = [g.broadcast(self._header(version, _STATUS_OK), self.src, async_op=True)]
        in_flight: list[list] = [[], []]  # per buffer: the transfers still reading it
        keep: list[torch.Tensor] = []  # contiguous copies of direct tensors, alive until sent
        k = 0
        for item in self.plan:
            if isinstance(item, Bucket):
                slot = k & 1
                for w in in_flight[slot]:
                    w.wait(watch=self._watch)
                copy_all(views[k], [tensors[i] for i in self._bucket_idx[k]])
                in_flight[slot] = self._xfer(self._wire[k], async_op=True)
                k += 1
            else:
                t = tensors[item.index]
                wire = t if t.is_contiguous() else t.contiguous()
                keep.append(wire)
                works += self._xfer(wire, async_op=True)
        for w in [*works, *in_flight[0], *in_flight[1]]:
            w.wait(watch=self._watch)

    def _send_cuda(self, tensors: list[torch.Tensor], version: int) -> None:
        g = self.group
        cur = torch.cuda.current_stream(g.device)
        comm, pack = self._side_streams()
        # Both side streams start after whatever produced the weights on the current stream.
        comm.wait_stream(cur)
        pack.wait_stream(cur)
        g.broadcast(self._header_on(comm, version, _STATUS_OK), self.src, stream=comm)
        views = self._bucket_views()
        free: list[torch.cuda.Event | None] = [None, None]  # per buffer: its last broadcast done
        k = 0
        for item in self._launches:
            if isinstance(item, Bucket):
                slot = k & 1
                with torch.cuda.stream(pack):
                    if free[slot] is not None:
                        pack.wait_event(free[slot])
                    copy_all(views[k], [tensors[i] for i in self._bucket_idx[k]])
                    packed = torch.cuda.Event()
                    packed.record(pack)
                comm.wait_event(packed)
                self._xfer(self._wire[k], stream=comm)
                done = torch.cuda.Event()
                done.record(comm)
                free[slot] = done
                k += 1
                continue
            keep = []  # contiguous copies must outlive the group launch
            with torch.cuda.stream(comm), g.coalesce():
                for i in item:
                    t = tensors[i]
                    wire = t if t.is_contiguous() else t.contiguous()
                    keep.append(wire)
                    self._xfer(wire, stream=comm)
            del keep
        # Later writes to the weights (optimizer step) must wait for the broadcasts reading them.
        cur.wait_stream(comm)
        cur.wait_stream(pack)
        g.synchronize(comm, watch=self._watch, what=f"refit send of version {version}")


class RefitReceiver(_Endpoint):
    """Generator side: receives into ``named_tensors`` in place from rank ``src``.

    ``version`` holds the version of the last completed refit (``None`` before the first).
    """

    def __init__(self, group: StatelessProcessGroup, named_tensors: NamedTensors, src: int = 0,
                 *, channel: str = "default") -> None:
        super().__init__(group, named_tensors, channel)
        if src == group.rank:
            raise ValueError(f"RefitReceiver on rank {src}, which is the source; use RefitSender there")
        self.src = src
        self.version: int | None = None

    def prepare_refit_info(self) -> RefitInfo:
        """Read the sender's metadata, check it against our tensors, agree with every rank (collective).

        Raises ``RefitMismatchError`` listing the mismatches (ours and other ranks') before any
        bulk data moves.
        """
        g = self.group
        self._gen += 1
        self._drop_ipc()
        self._post_host()
        key = self._key(self._gen, "info")
        g.wait_for_ranks(lambda r: key, [self.src], f"refit info from sender rank {self.src}")
        raw = g.store.get(key)
        decoded = json.loads(raw)
        if "error" in decoded:
            msg = f"sender rank {self.src} failed to prepare: {decoded['error']}"
            g.store.set(self._key(self._gen, "status", g.rank), msg.encode())
            raise RefitError(f"rank {g.rank}: {msg}")
        info = RefitInfo.from_bytes(raw)
        problems: list[str] = []
        try:
            specs, _ = self._specs_and_tensors()
            problems = diff_specs(info.tensors, specs)
        except RefitError as e:
            problems = [str(e)]
        if info.src != self.src:
            problems.insert(0, f"sender is rank {info.src}, receiver expects src={self.src}")
        status = "ok" if not problems else f"{len(problems)} mismatch(es): {_clip(problems)}"
        self._handshake(status, "refit handshake (waiting for every rank to check the layout)")
        self._compile(info)
        if info.transport == "ipc" and info.extra.get("ipc_direction") == "push":
            self._export_push()
        elif info.transport == "ipc":
            self._open_ipc()
        self._connect_p2p()
        return self.info  # type: ignore[return-value]

    def _open_ipc(self) -> None:
        """Open the sender's handles once (torch caches one mapping per segment), check a copy works."""
        g = self.group
        key = self._key(self._gen, "ipc_handles")
        g.wait_for_ranks(lambda r: key, [self.src], f"CUDA IPC handles from sender rank {self.src}")
        status = "ok"
        try:
            self._load_views(g.store.get(key))
        except Exception as e:
            self._drop_ipc()
            status = f"could not open the CUDA IPC handles of sender rank {self.src}: {e}"
        self._ipc_agree(status)

    def _export_push(self) -> None:
        """Push: export our tensors (strided ones through staging slots) for the sender to open."""
        g = self.group
        status = "ok"
        try:
            self._push_tgt = _ipc.PushTargets(self._ordered(self._tensors()), g.device)
            blob = self._push_tgt.blob()
        except Exception as e:
            self._push_tgt = None
            status = f"could not export CUDA IPC handles of the destination tensors: {e}"
            blob = json.dumps({"error": status}).encode()
        g.store.set(self._key(self._gen, "ipc_dst", g.rank), blob)
        self._ipc_agree(status)

    def _recv_push(self) -> int:
        """Push: post readiness (after our queued work on the tensors), then check our tensors
        while the sender's copies run, and wait for its header (sent after the copies) and the
        verdict. Takes part in every step even when we refuse, so the sender and the group
        carry on; raises afterwards."""
        g = self.group
        tgt = self._push_tgt
        assert tgt is not None
        self.ipc_phases = {"t_enter": time.perf_counter()}
        cur = torch.cuda.current_stream(g.device)
        comm, _ = self._side_streams()
        if self._flags is None:
            self._flags = torch.zeros(2, dtype=torch.int32, device=g.device)
        ready, verdict = self._flags[:1], self._flags[1:]  # ready: always 0, a gate (see the sender)
        # Ready only once the work already queued on our tensors (e.g. generation) is done.
        comm.wait_stream(cur)
        g.all_reduce(ready, "max", stream=comm)
        header = self._header_on(comm, fill=False)
        g.broadcast(header, self.src, stream=comm)
        refused: RefitError | None = None
        try:
            moved = tgt.moved(self._ordered(self._tensors()))
            if moved:
                refused = RefitError(
                    f"rank {g.rank}: ipc_direction='push': tensor(s) {_clip([self._names[i] for i in moved])} "
                    f"moved to new storage since prepare_refit_info(); this refit went to the old storage; "
                    f"call prepare_refit_info() again on every rank")
        except RefitError as e:
            refused = e
        if refused is not None:
            self._publish_error(str(refused))
        with torch.cuda.stream(comm):
            verdict.fill_(0 if refused is None else 1)
        g.all_reduce(verdict, "max", stream=comm)
        g.synchronize(comm, watch=self._watch, what=f"waiting for the refit push from sender rank {self.src}")
        self.ipc_phases["t_header"] = time.perf_counter()
        version = self._check_header(header)
        if refused is not None:
            raise refused
        if tgt.needs_scatter:
            with torch.cuda.stream(comm):
                tgt.scatter()
            g.synchronize(comm, watch=self._watch, what=f"refit receive of version {version}")
        cur.wait_stream(comm)
        return version

    def _load_views(self, blob: bytes) -> None:
        g = self.group
        views = _ipc.open_tensors(blob)
        src_dev = next((v.device for v in views if v is not None), g.device)
        s_dst = torch.cuda.Stream(g.device)
        s_src = s_dst if src_dev == g.device else torch.cuda.Stream(src_dev)
        _ipc.probe(views, g.device)
        if self._copier is None:
            self._copier = _ipc.PeerCopier()
        self._ipc_views = views
        self._ipc_streams = (s_dst, s_src)

    def receive_weights(self) -> int:
        """Receive one refit into our tensors in place; return (and store) its version."""
        if self.info is None:
            raise RefitError(f"rank {self.group.rank}: call prepare_refit_info() before receive_weights()")
        self._seq += 1
        if self._push_tgt is not None:
            with torch.no_grad():
                self.version = self._recv_push()  # checks the tensors itself, after posting ready
            return self.version
        try:
            ordered = self._ordered(self._tensors())
        except RefitMismatchError as e:
            # Nothing was received yet; the sender is told and its send stops at the timeout
            # check instead of hanging.
            self._publish_error(str(e))
            raise
        try:
            with torch.no_grad():
                if self.info.transport == "ipc":
                    version = self._recv_ipc(ordered)
                elif self._cuda:
                    version = self._recv_cuda(ordered)
                else:
                    version = self._recv_cpu(ordered)
        except RefitError:
            raise
        except Exception as e:
            self._publish_error(f"receiver failed: {e}")
            raise
        self.version = version
        return version

    def _watch(self) -> str | None:
        return self._errors_of([self.src])

    def _check_header(self, header: torch.Tensor) -> int:
        assert self.info is not None
        magic, fp, version, status = (int(x) for x in header.tolist())
        g = self.group
        self._last_status = status
        if status == _STATUS_ABORT:
            why = self._errors_of([self.src]) or "no reason posted"
            raise RefitError(f"rank {g.rank}: sender rank {self.src} aborted refit of version {version}: {why}")
        if magic != _MAGIC or fp != self._fp:
            msg = (f"refit header mismatch (magic {magic:#x}, fingerprint {fp} vs ours "
                   f"{self._fp}): sender and receiver prepared different layouts")
            self._publish_error(msg)
            raise RefitError(f"rank {g.rank}: {msg}")
        return version

    def _ipc_plan(self, tensors: list[torch.Tensor]) -> tuple[list, list]:
        """Copy plan for our tensors, reused while they stay where they were (same pointers, strides)."""
        assert self._ipc_views is not None and self._copier is not None
        key = _ipc.signature(tensors)
        cached = self._ipc_plan_cache
        if cached is not None and cached[0] is self._ipc_views and cached[1] == key:
            return cached[2]
        pairs = [(d, s) for d, s in zip(tensors, self._ipc_views) if s is not None]
        plan = self._copier.plan([d for d, _ in pairs], [s for _, s in pairs])
        self._ipc_plan_cache = (self._ipc_views, key, plan)
        return plan

    def _ipc_copy_streams(self) -> tuple[torch.cuda.Stream, list[torch.cuda.Stream]]:
        """(the stream the raw copies go on, every stream the copies use) for ``ipc_copy_on``."""
        assert self._ipc_streams is not None
        s_dst, s_src = self._ipc_streams
        raw = s_dst if self.info.extra.get("ipc_copy_on", "src") == "dst" else s_src  # type: ignore[union-attr]
        return raw, list(dict.fromkeys([s_src, s_dst]))

    def _recv_ipc(self, tensors: list[torch.Tensor]) -> int:
        """Pull: wait for the header, peer-copy every tensor from the sender's memory, ack."""
        g = self.group
        ph = self.ipc_phases = {"t_enter": time.perf_counter()}
        timing = self.ipc_timing
        cur = torch.cuda.current_stream(g.device)
        comm, _ = self._side_streams()
        # Planned before the header arrives, so it overlaps with the sender's side.
        runs, slow = self._ipc_plan(tensors)
        if self._ack is None:
            self._ack = torch.zeros(1, dtype=torch.int32, device=g.device)
        comm.wait_stream(cur)
        header = self._header_on(comm, fill=False)
        g.broadcast(header, self.src, stream=comm)
        g.synchronize(comm, watch=self._watch, what=f"waiting for the refit header from sender rank {self.src}")
        ph["t_header"] = time.perf_counter()
        version = self._check_header(header)
        failed = None
        if timing:
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        try:
            if self._last_status == _STATUS_NEW_HANDLES:
                self._load_views(g.store.get(self._key(self._gen, "ipc_handles", self._seq)))
                runs, slow = self._ipc_plan(tensors)
            raw, used = self._ipc_copy_streams()
            for s in used:  # the tensors may still be read by work on the current stream
                s.wait_stream(cur)
            if timing:
                e0.record(raw)
            self._copier.issue(runs, slow, raw, used)  # type: ignore[union-attr]
            if timing:
                e1.record(raw)
        except Exception as e:
            failed = f"receiver failed to copy refit version {version}: {e}"
            self._publish_error(failed)
        ph["t_issued"] = time.perf_counter()
        assert self._ipc_streams is not None  # replaced by _load_views only once it succeeded
        s_dst = self._ipc_streams[0]
        for s in self._ipc_copy_streams()[1]:
            if s is not s_dst:
                s_dst.wait_stream(s)
        # The ack leaves once the copies are done; the sender may then overwrite its tensors.
        comm.wait_stream(s_dst)
        if timing:
            a0, a1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a0.record(comm)
        with torch.cuda.stream(comm):
            self._ack.fill_(1 if failed else 0)
        g.all_reduce(self._ack, "max", stream=comm)
        if timing:
            a1.record(comm)
        g.synchronize(comm, watch=self._watch, what=f"refit receive of version {version}")
        ph["t_copied"] = time.perf_counter()
        cur.wait_stream(comm)
        if timing and not failed:
            ph["copy_gpu_ms"] = e0.elapsed_time(e1)
            ph["ack_gpu_ms"] = a0.elapsed_time(a1)
            ph["copy_mode"] = self._copier.mode  # type: ignore[union-attr,assignment]
        if failed:
            raise RefitError(f"rank {g.rank}: {failed}")
        return version

    def _recv_cpu(self, tensors: list[torch.Tensor]) -> int:
        g = self.group
        header = torch.zeros(4, dtype=torch.int64)
        g.broadcast(header, self.src, async_op=True).wait(watch=self._watch)  # type: ignore[union-attr]
        version = self._check_header(header)
        views = self._bucket_views()
        pending: tuple | None = None  # (work, bucket number) received but not yet unpacked
        directs: list[tuple] = []  # (work, tmp or None, destination)
        k = 0

        def unpack(p: tuple) -> None:
            work, j = p
            work.wait(watch=self._watch)
            copy_all([tensors[i] for i in self._bucket_idx[j]], views[j])

        for item in self.plan:
            if isinstance(item, Bucket):
                # Bucket k reuses the buffer of bucket k-2, which was unpacked one step ago.
                (work,) = self._xfer(self._wire[k], async_op=True)
                if pending is not None:
                    unpack(pending)
                pending = (work, k)
                k += 1
            else:
                t = tensors[item.index]
                tmp = None if t.is_contiguous() else torch.empty(t.shape, dtype=t.dtype)
                (work,) = self._xfer(t if tmp is None else tmp, async_op=True)
                directs.append((work, tmp, t))
        if pending is not None:
            unpack(pending)
        for work, tmp, t in directs:
            work.wait(watch=self._watch)
            if tmp is not None:
                t.copy_(tmp)
        return version

    def _recv_cuda(self, tensors: list[torch.Tensor]) -> int:
        g = self.group
        cur = torch.cuda.current_stream(g.device)
        comm, unpack = self._side_streams()
        # The tensors may still be read by work on the current stream (e.g. generation).
        comm.wait_stream(cur)
        unpack.wait_stream(cur)
        header = self._header_on(comm, fill=False)
        g.broadcast(header, self.src, stream=comm)
        # One host sync here lets a sender abort (or a layout mismatch) stop us before any bulk.
        g.synchronize(comm, watch=self._watch, what=f"waiting for the refit header from sender rank {self.src}")
        version = self._check_header(header)
        views = self._bucket_views()
        free: list[torch.cuda.Event | None] = [None, None]  # per buffer: unpack of its last bucket done
        k = 0
        for item in self._launches:
            if isinstance(item, Bucket):
                slot = k & 1
                if free[slot] is not None:
                    comm.wait_event(free[slot])
                self._xfer(self._wire[k], stream=comm)
                got = torch.cuda.Event()
                got.record(comm)
                with torch.cuda.stream(unpack):
                    unpack.wait_event(got)
                    copy_all([tensors[i] for i in self._bucket_idx[k]], views[k])
                    done = torch.cuda.Event()
                    done.record(unpack)
                free[slot] = done
                k += 1
                continue
            copies = []  # non-contiguous destinations receive into a temporary first
            with torch.cuda.stream(comm), g.coalesce():
                for i in item:
                    t = tensors[i]
                    if t.is_contiguous():
                        self._xfer(t, stream=comm)
                    else:
                        tmp = torch.empty(t.shape, dtype=t.dtype, device=g.device)
                        self._xfer(tmp, stream=comm)
                        copies.append((tmp, t))
            with torch.cuda.stream(comm):
                for tmp, t in copies:
                    t.copy_(tmp)
        unpack.wait_stream(comm)
        g.synchronize(unpack, watch=self._watch, what=f"refit receive of version {version}")
        cur.wait_stream(unpack)
        return version

