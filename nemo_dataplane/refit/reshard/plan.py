"""The resharding plan: which sender rank sends which slice of which parameter to which receiver.

``plan_reshard(src_layout, dst_layout)`` is a pure function of the two layouts (``layout.py``)
and the message sizes, so every rank computes the same plan (and its fingerprint) on its own;
plans are cached per process by that fingerprint (docs/refit.md, section 6).

Per parameter, the boxes the receivers hold are intersected with the boxes the senders hold.
Where several senders hold the same box (data-parallel replicas), the receivers of that
parameter are spread over them in turn. A parameter whose rule is unknown on either side
(``ParamLayout.rule is None``) is moved whole from one sender, the first that holds all of
it: slow, never mis-sharded. Every byte a receiver holds arrives exactly once, so the bytes
sent to a receiver equal the bytes of its local tensors.

Per (sender, receiver) pair the pieces become messages, in the receiver layout's parameter
order: a piece of at least ``direct_bytes`` that is contiguous on both sides goes on its own,
straight from the sender's tensor into the receiver's; the others are packed back to back
(largest items first, so every slot is aligned for its dtype, no padding) into buckets of at
most ``bucket_bytes / max(peers of either side)``, a piece larger than that being split along
its outer dims. The k-th messages of all pairs form round k; a rank keeps at most two rounds of
buckets in flight, so its staging memory is at most ``2 * bucket_bytes``.
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import lru_cache

from nemo_dataplane.refit.protocol import RefitMismatchError, clip
from nemo_dataplane.refit.reshard.layout import Box, Layout, Mesh, Placement, param_box

__all__ = [
    "Entry",
    "Message",
    "Piece",
    "ReshardPlan",
    "ReshardPlanError",
    "plan_reshard",
]

_CACHE_SIZE = 8

# A parameter's distinct boxes on one side, each with the ranks holding it (_box_table).
_BoxTable = tuple[tuple[Box, tuple[int, ...]], ...]
# Per distinct receiver box (_covers): (box, its ranks, [(intersection, bytes-less volume,
# sender ranks, their box)], fully covered, bytes-less volume).
_Cover = tuple[Box, tuple[int, ...], tuple[tuple[Box, int, tuple[int, ...], Box], ...], bool, int]


class ReshardPlanError(RefitMismatchError):
    """The two layouts do not fit together (a receiver parameter no sender covers, a shape or
    dtype mismatch, ...); the message names every parameter at fault."""


@dataclass(slots=True)
class Piece:
    """``box`` (full-parameter coordinates) of ``param``, from group rank ``src`` to ``dst``;
    ``src_box`` / ``dst_box``: the boxes the two ranks hold. Treat as read-only."""

    param: str
    src: int
    dst: int
    box: Box
    nbytes: int
    src_box: Box
    dst_box: Box


@dataclass(slots=True)
class Entry:
    """One piece inside a message, in each side's local-tensor coordinates. Treat as read-only."""

    param: str
    src_local: str
    src_region: Box
    dst_local: str
    dst_region: Box
    dtype: str
    itemsize: int
    nbytes: int
    offset: int = -1  # byte offset in the message's bucket; -1: sent on its own (direct)
    contiguous: bool = False  # one contiguous run in both local tensors (row-major)


@dataclass(slots=True)
class Message:
    """What one send/recv carries from ``src`` to ``dst``: one direct entry or a packed bucket.
    Treat as read-only."""

    src: int
    dst: int
    nbytes: int
    direct: bool
    entries: tuple[Entry, ...]


@dataclass
class ReshardPlan:
    """Every piece of a resharding refit (identical on every rank) and, computed on first use
    per (sender, receiver) pair, its messages."""

    src_layout: Layout
    dst_layout: Layout
    bucket_bytes: int
    direct_bytes: int
    pieces: list[Piece]
    fallback: tuple[str, ...]  # parameters moved whole from one sender (unknown rule)
    fingerprint: int
    plan_seconds: float = 0.0
    _pairs: dict[tuple[int, int], list[int]] = field(default_factory=dict, repr=False)  # -> piece indices
    _npeers: dict[int, int] = field(default_factory=dict, repr=False)
    _messages: dict[tuple[int, int], list[Message]] = field(default_factory=dict, repr=False)
    _rounds: dict[int, list[list[Message]]] = field(default_factory=dict, repr=False)
    _sides: tuple[_Side, ...] = field(default=(), repr=False)  # (sender's, receiver's) once planned

    @property
    def senders(self) -> tuple[int, ...]:
        return self.src_layout.mesh.ranks

    @property
    def receivers(self) -> tuple[int, ...]:
        return self.dst_layout.mesh.ranks

    @property
    def pairs(self) -> list[tuple[int, int]]:
        """Every (sender, receiver) pair that moves bytes, sorted."""
        return sorted(self._pairs)

    def bytes_to(self, rank: int) -> int:
        """Bytes the plan moves into receiver ``rank``."""
        return sum(p.nbytes for p in self.pieces if p.dst == rank)

    def bytes_from(self, rank: int) -> int:
        """Bytes the plan moves out of sender ``rank``."""
        return sum(p.nbytes for p in self.pieces if p.src == rank)

    def owned_bytes(self, rank: int) -> int:
        """Bytes of the local tensors receiver ``rank`` holds under the receiving layout."""
        return sum(t.nbytes for t in self.dst_layout.local_tensors(rank).values())

    @property
    def total_bytes(self) -> int:
        return sum(p.nbytes for p in self.pieces)

    def messages(self, src: int, dst: int) -> list[Message]:
        """The messages from ``src`` to ``dst`` in the order both sides issue them."""
        got = self._messages.get((src, dst))
        if got is None:
            idx = self._pairs.get((src, dst), [])
            sside, dside = self._sides
            entries = [_entry(self.pieces[i], sside, dside) for i in idx]
            cap = max(256, self.bucket_bytes // max(self._npeers.get(src, 1), self._npeers.get(dst, 1)))
            got = self._messages[(src, dst)] = _cut_messages((src, dst), entries, cap, self.direct_bytes)
        return got

    def rounds(self, rank: int) -> list[list[Message]]:
        """``rank``'s messages by round: round k holds the k-th message of each of its pairs,
        peers in ascending order (a sender's sends, or a receiver's receives)."""
        cached = self._rounds.get(rank)
        if cached is not None:
            return cached
        sender = rank in self.src_layout.mesh.coords
        per_peer = [self.messages(s, d) for s, d in self.pairs if (s if sender else d) == rank]
        n = max((len(ms) for ms in per_peer), default=0)
        out = [[ms[k] for ms in per_peer if k < len(ms)] for k in range(n)]
        self._rounds[rank] = out
        return out

    def describe(self, params: Sequence[str] | None = None) -> str:
        """The pieces as a table (for docs and debugging): param, box, sender -> receiver, bytes."""
        want = set(params) if params is not None else None
        rows = ["param | slice (full coords) | sender -> receiver | bytes"]
        for p in self.pieces:
            if want is None or p.param in want:
                sl = ", ".join(f"{lo}:{hi}" for lo, hi in p.box)
                rows.append(f"{p.param} | [{sl}] | {p.src} -> {p.dst} | {p.nbytes}")
        return "\n".join(rows)


# ---------------------------------------------------------------- boxes


@lru_cache(maxsize=4096)
def _box_table(mesh: Mesh, shape: tuple[int, ...], placements: tuple[Placement, ...]) -> _BoxTable:
    """Distinct boxes of a parameter and the ranks holding each, in mesh order."""
    groups: dict[Box, list[int]] = {}
    for rank in mesh.ranks:
        b = param_box(shape, placements, mesh.sizes, mesh.coords[rank])
        if b is not None:
            groups.setdefault(b, []).append(rank)
    return tuple((b, tuple(rs)) for b, rs in groups.items())


def _volume(box: Box) -> int:
    n = 1
    for lo, hi in box:
        n *= hi - lo
    return n


def _intersect(a: Box, b: Box) -> Box | None:
    out = []
    for (alo, ahi), (blo, bhi) in zip(a, b):
        lo, hi = max(alo, blo), min(ahi, bhi)
        if lo >= hi:
            return None
        out.append((lo, hi))
    return tuple(out)


@lru_cache(maxsize=4096)
def _covers(src_table: _BoxTable, dst_table: _BoxTable) -> tuple[_Cover, ...]:
    """Per distinct receiver box: (box, its ranks, [(intersection, bytes-less volume, sender
    ranks, their boxes)], fully covered)."""
    out: list[_Cover] = []
    for db, dranks in dst_table:
        vol = _volume(db)
        cov: list[tuple[Box, int, tuple[int, ...], Box]] = []
        got = 0
        for sb, sranks in src_table:
            inter = _intersect(db, sb)
            if inter is not None:
                v = _volume(inter)
                cov.append((inter, v, sranks, sb))
                got += v
        out.append((db, dranks, tuple(cov), got == vol, vol))
    return tuple(out)


def _contiguous(region: Box, shape: Sequence[int]) -> bool:
    """Whether ``region`` of a row-major tensor of ``shape`` is one contiguous run: every dim
    before the last one it does not span fully has extent 1."""
    last = -1
    for i in range(len(shape)):
        lo, hi = region[i]
        if hi - lo != shape[i]:
            last = i
    for i in range(last):
        lo, hi = region[i]
        if hi - lo != 1:
            return False
    return True


# ---------------------------------------------------------------- local coordinates


class _Side:
    """Local names, shapes and part offsets of one layout, computed per (param, rank) on demand."""

    def __init__(self, layout: Layout) -> None:
        self.layout = layout
        self.part_of = layout.part_of
        self._fused: dict[tuple[str, int], tuple[tuple[int, ...], dict[str, int]]] = {}
        self._shapes: dict[Box, tuple[int, ...]] = {}

    def local(self, param: str, rank: int, own: Box) -> tuple[str, tuple[int, ...], int, int]:
        """(local name, local shape, fuse dim, offset of this part along it)."""
        fname = self.part_of.get(param)
        if fname is None:
            shape = self._shapes.get(own)
            if shape is None:
                shape = self._shapes[own] = tuple(hi - lo for lo, hi in own)
            return param, shape, 0, 0
        key = (fname, rank)
        got = self._fused.get(key)
        if got is None:
            lt = self.layout.fused_local(fname, rank)
            assert lt is not None  # the rank holds this part, so it holds every part
            got = (lt.shape, {p: off for p, _, off in lt.parts})
            self._fused[key] = got
        return fname, got[0], self.layout.fused[fname].dim, got[1][param]


def _region(box: Box, own: Box, dim: int, off: int) -> Box:
    """``box`` (full-parameter coordinates) in the local tensor of a rank holding ``own``, its
    part starting at ``off`` along the fused ``dim``."""
    out = []
    for i in range(len(box)):
        d = own[i][0] - (off if i == dim else 0)
        out.append((box[i][0] - d, box[i][1] - d))
    return tuple(out)


# ---------------------------------------------------------------- the plan


_cache: OrderedDict[bytes, ReshardPlan] = OrderedDict()
_cache_lock = threading.Lock()


def plan_reshard(
    src: Layout, dst: Layout, *, bucket_bytes: int = 64 << 20, direct_bytes: int | None = None
) -> ReshardPlan:
    """The plan from ``src`` (senders) to ``dst`` (receivers); cached per process.

    Raises ``ReshardPlanError`` naming every parameter at fault: a receiver parameter that no
    sender layout has or covers, a shape or dtype that differs, a sender parameter no receiver
    takes (it would be sent nowhere: likely a naming mismatch), ranks on both sides.
    """
    t0 = time.perf_counter()
    direct = bucket_bytes + 1 if direct_bytes is None else int(direct_bytes)
    key = hashlib.sha256(
        b"|".join([src.to_json(), dst.to_json(), str(bucket_bytes).encode(), str(direct).encode()])
    ).digest()
    with _cache_lock:
        hit = _cache.get(key)
        if hit is not None:
            _cache.move_to_end(key)
            return hit
    plan = _build(src, dst, int(bucket_bytes), direct, int.from_bytes(key[:4], "little") & 0x7FFFFFFF)
    plan.plan_seconds = time.perf_counter() - t0
    with _cache_lock:
        _cache[key] = plan
        while len(_cache) > _CACHE_SIZE:
            _cache.popitem(last=False)
    return plan


def _build(src: Layout, dst: Layout, bucket_bytes: int, direct_bytes: int, fingerprint: int) -> ReshardPlan:
    problems: list[str] = []
    both = set(src.mesh.ranks) & set(dst.mesh.ranks)
    if both:
        raise ReshardPlanError(f"group rank(s) {sorted(both)} are in both the sending and the receiving layout")
    pieces: list[Piece] = []
    pairs: dict[tuple[int, int], list[int]] = {}
    fallback: list[str] = []
    for idx, (name, dp) in enumerate(dst.params.items()):
        sp = src.params.get(name)
        if sp is None:
            problems.append(f"{name}: receiver parameter that no sender layout has (it would go stale)")
            continue
        if sp.shape != dp.shape:
            problems.append(f"{name}: full shape sender {list(sp.shape)} != receiver {list(dp.shape)}")
            continue
        if sp.dtype != dp.dtype:
            problems.append(f"{name}: dtype sender {sp.dtype} != receiver {dp.dtype}")
            continue
        stab = _box_table(src.mesh, sp.shape, sp.placements)
        dtab = _box_table(dst.mesh, dp.shape, dp.placements)
        if not stab:
            problems.append(f"{name}: no sender rank holds it")
            continue
        one = None
        if sp.rule is None or dp.rule is None:
            whole = tuple((0, n) for n in sp.shape)
            one = next((rs[0] for b, rs in stab if b == whole), None)  # the first sender holding all of it
            if one is not None:
                fallback.append(name)
        isz = dp.itemsize
        j = idx  # rotates the replica choice over parameters and receivers
        for db, dranks, cov, full, vol in _covers(stab, dtab):
            if not full:
                problems.append(
                    f"{name}: the senders cover only part of the box "
                    f"{[list(x) for x in db]} that receiver rank {dranks[0]} holds"
                )
                continue
            if vol == 0:
                continue
            if one is not None:
                cov = ((db, vol, (one,), next(b for b, rs in stab if one in rs)),)
            for r in dranks:
                for inter, v, sranks, sb in cov:
                    s = sranks[j % len(sranks)]
                    pairs.setdefault((s, r), []).append(len(pieces))
                    pieces.append(Piece(name, s, r, inter, v * isz, sb, db))
                j += 1
    sent_nowhere = [n for n in src.params if n not in dst.params]
    if sent_nowhere:
        problems.append(f"sender parameter(s) that no receiver layout has: {clip(sent_nowhere)}")
    if problems:
        raise ReshardPlanError(f"resharding plan failed, no weights were moved: {clip(problems)}")
    npeers: dict[int, int] = {}
    for s, r in pairs:
        npeers[s] = npeers.get(s, 0) + 1
        npeers[r] = npeers.get(r, 0) + 1
    return ReshardPlan(
        src,
        dst,
        bucket_bytes,
        direct_bytes,
        pieces,
        tuple(fallback),
        fingerprint,
        _pairs=pairs,
        _npeers=npeers,
        _sides=(_Side(src), _Side(dst)),
    )


def _entry(p: Piece, sside: _Side, dside: _Side) -> Entry:
    sname, sshape, sdim, soff = sside.local(p.param, p.src, p.src_box)
    dname, dshape, ddim, doff = dside.local(p.param, p.dst, p.dst_box)
    sreg, dreg = _region(p.box, p.src_box, sdim, soff), _region(p.box, p.dst_box, ddim, doff)
    pl = sside.layout.params[p.param]
    return Entry(
        p.param,
        sname,
        sreg,
        dname,
        dreg,
        pl.dtype,
        pl.itemsize,
        p.nbytes,
        contiguous=_contiguous(sreg, sshape) and _contiguous(dreg, dshape),
    )


def _split(e: Entry, cap: int) -> list[Entry]:
    """``e`` cut along its outer dims into entries of at most ``cap`` bytes (one element at least)."""
    ext = [hi - lo for lo, hi in e.dst_region]
    d = 0
    while d < len(ext) - 1 and ext[d] == 1:
        d += 1
    row = e.nbytes // max(ext[d], 1)
    if row > cap and d < len(ext) - 1:  # one index along d is still too big: cut each one further
        out: list[Entry] = []
        for i in range(ext[d]):
            out += _split(_sub(e, d, i, i + 1), cap)
        return out
    step = max(1, cap // max(row, 1))
    return [_sub(e, d, a, min(a + step, ext[d])) for a in range(0, ext[d], step)]


def _sub(e: Entry, d: int, a: int, b: int) -> Entry:
    def cut(region: Box) -> Box:
        lo = region[d][0]
        return region[:d] + ((lo + a, lo + b),) + region[d + 1 :]

    sr, dr = cut(e.src_region), cut(e.dst_region)
    n = e.itemsize
    for lo, hi in dr:
        n *= hi - lo
    return Entry(e.param, e.src_local, sr, e.dst_local, dr, e.dtype, e.itemsize, n)


def _cut_messages(pair: tuple[int, int], entries: list[Entry], cap: int, direct_bytes: int) -> list[Message]:
    s, r = pair
    out: list[Message] = []
    cur: list[Entry] = []
    size = 0

    def close() -> None:
        nonlocal cur, size
        if cur:
            # Largest items first: every slot then starts at a multiple of its itemsize.
            cur.sort(key=lambda x: -x.itemsize)
            off = 0
            for x in cur:  # entries are this pair's own objects: placed in place
                x.offset = off
                off += x.nbytes
            out.append(Message(s, r, off, False, tuple(cur)))
        cur, size = [], 0

    for e in entries:
        if e.nbytes >= direct_bytes and e.contiguous:
            out.append(Message(s, r, e.nbytes, True, (e,)))
            continue
        for x in _split(e, cap) if e.nbytes > cap else (e,):
            if size + x.nbytes > cap:
                close()
            cur.append(x)
            size += x.nbytes
    close()
    return out
