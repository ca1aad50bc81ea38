"""How named parameters are split over a device mesh, as wire-safe JSON (docs/refit.md, section 6).

A ``Layout`` describes one side of a resharding refit (the trainer's or the generator's):

* ``mesh``: named dimensions (``("pp", 2), ("dp", 2), ("tp", 2)``) and the group rank at each
  coordinate, row-major;
* ``params``: per parameter, under its Hugging Face name, the *full* shape, the dtype and one
  placement per mesh dimension: ``Shard(d)`` (split along tensor dim ``d`` in
  ``torch.chunk`` fashion, nested in mesh-dimension order like DTensor), ``Replicate`` (every
  index holds the same data) or ``Only(k)`` (only index ``k`` holds it: a pipeline stage, a
  rank that gathered the whole tensor); ``rule`` names the sharding rule that produced it, and
  ``None`` marks a parameter whose rule is not known: it must then be held whole wherever it is
  held, and it is moved whole from one sender (``reshard.py``);
* ``fused``: local tensors assembled from several parameters' local shards concatenated along
  one dim, on every rank that holds them (q/k/v -> qkv, gate/up -> gate_up).

The local tensors of a rank are then fully determined: ``local_tensors(rank)``. The helpers of
:mod:`.rules` (``build_layout``, ``DEFAULT_RULES``, ``layer_stages``, ``fuse``) build layouts
for the common rules: column-parallel, row-parallel, vocab-parallel, replicated, MoE experts.
"""

from __future__ import annotations

import json
import re
import zlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from nemo_dataplane.dtypes import check_shape, dtype_from_name
from nemo_dataplane.errors import NemoDataplaneError

__all__ = [
    "Fused",
    "Layout",
    "LayoutError",
    "LocalTensor",
    "Mesh",
    "Only",
    "ParamLayout",
    "Placement",
    "Replicate",
    "Shard",
    "parse_placement",
]

Box = tuple[tuple[int, int], ...]  # per tensor dim: [start, stop)


class LayoutError(NemoDataplaneError, ValueError):
    """A layout is malformed or does not fit its parameters; the message names the field."""


@dataclass(frozen=True)
class Shard:
    """Split along tensor dim ``dim`` over a mesh dimension (``torch.chunk`` sizes)."""

    dim: int

    def __str__(self) -> str:
        return f"Shard({self.dim})"


@dataclass(frozen=True)
class Replicate:
    """Every index of the mesh dimension holds the same data."""

    def __str__(self) -> str:
        return "Replicate"


@dataclass(frozen=True)
class Only:
    """Only index ``index`` of the mesh dimension holds the parameter (e.g. its pipeline stage)."""

    index: int

    def __str__(self) -> str:
        return f"Only({self.index})"


Placement = Shard | Replicate | Only
_PLACEMENT_RE = re.compile(r"^(Shard|Only)\((\d+)\)$")


def parse_placement(text: str) -> Placement:
    """``"Shard(0)"``, ``"Replicate"`` or ``"Only(1)"`` back to a placement."""
    if text == "Replicate":
        return Replicate()
    m = _PLACEMENT_RE.match(text)
    if m is None:
        raise LayoutError(f"placement {text!r} is not Shard(d), Replicate or Only(k)")
    return Shard(int(m[2])) if m[1] == "Shard" else Only(int(m[2]))


@dataclass(frozen=True)
class Mesh:
    """Named dimensions and the group rank at each coordinate (row-major, last dim fastest)."""

    dims: tuple[str, ...]
    sizes: tuple[int, ...]
    ranks: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.dims) != len(self.sizes):
            raise LayoutError(f"mesh: {len(self.dims)} dims {list(self.dims)} but {len(self.sizes)} sizes")
        if len(set(self.dims)) != len(self.dims):
            raise LayoutError(f"mesh: repeated dim name in {list(self.dims)}")
        if any(s < 1 for s in self.sizes):
            raise LayoutError(f"mesh: sizes must be >= 1, got {list(self.sizes)}")
        n = 1
        for s in self.sizes:
            n *= s
        if len(self.ranks) != n:
            raise LayoutError(f"mesh: sizes {list(self.sizes)} need {n} ranks, got {len(self.ranks)}")
        if len(set(self.ranks)) != n:
            raise LayoutError(f"mesh: a group rank appears twice in {list(self.ranks)}")

    @classmethod
    def of(cls, ranks: Iterable[int], **dims: int) -> Mesh:
        """``Mesh.of(range(4), dp=2, tp=2)``: dims in keyword order, ranks row-major."""
        return cls(tuple(dims), tuple(dims.values()), tuple(int(r) for r in ranks))

    @cached_property
    def coords(self) -> dict[int, tuple[int, ...]]:
        """Group rank -> its coordinate."""
        out: dict[int, tuple[int, ...]] = {}
        for i, r in enumerate(self.ranks):
            c = []
            for s in reversed(self.sizes):
                c.append(i % s)
                i //= s
            out[r] = tuple(reversed(c))
        return out

    def size(self, dim: str) -> int:
        return self.sizes[self.dims.index(dim)] if dim in self.dims else 1


@dataclass(frozen=True)
class ParamLayout:
    """One parameter: full shape, dtype, a placement per mesh dim, and the rule behind them."""

    shape: tuple[int, ...]
    dtype: str
    placements: tuple[Placement, ...]
    rule: str | None = None

    @property
    def itemsize(self) -> int:
        return _itemsize(self.dtype)


@dataclass(frozen=True)
class Fused:
    """A local tensor made of several parameters' local shards concatenated along ``dim``."""

    dim: int
    parts: tuple[str, ...]


@dataclass(frozen=True)
class LocalTensor:
    """What one rank holds under one local name: its shape and, per parameter part, the box
    of the full parameter it holds and where that box starts along the fused dim."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    parts: tuple[tuple[str, Box, int], ...]  # (param, box in param coords, offset along fuse dim)
    fuse_dim: int = 0

    @property
    def nbytes(self) -> int:
        n = _itemsize(self.dtype)
        for s in self.shape:
            n *= s
        return n


def _itemsize(dtype: str) -> int:
    return dtype_from_name(dtype, "layout", LayoutError).itemsize


def chunk(lo: int, hi: int, parts: int, index: int) -> tuple[int, int]:
    """``torch.chunk``'s ``index``-th of ``parts`` pieces of ``[lo, hi)`` (possibly empty)."""
    n = hi - lo
    step = -(-n // parts) if n else 0
    a = min(index * step, n)
    return lo + a, lo + min(a + step, n)


@dataclass(frozen=True)
class Layout:
    """One side's parameters over its mesh. Immutable; ``to_json``/``from_json`` round-trip."""

    mesh: Mesh
    params: Mapping[str, ParamLayout]
    fused: Mapping[str, Fused] = field(default_factory=dict)

    def __post_init__(self) -> None:
        nd = len(self.mesh.dims)
        for name, p in self.params.items():
            if len(p.placements) != nd:
                raise LayoutError(
                    f"param {name!r}: {len(p.placements)} placements for a mesh of {nd} dims {list(self.mesh.dims)}"
                )
            _itemsize(p.dtype)
            for m, pl in enumerate(p.placements):
                if isinstance(pl, Shard) and not 0 <= pl.dim < len(p.shape):
                    raise LayoutError(
                        f"param {name!r}: {pl} on mesh dim {self.mesh.dims[m]!r} but the "
                        f"parameter has {len(p.shape)} dims"
                    )
                if isinstance(pl, Only) and not 0 <= pl.index < self.mesh.sizes[m]:
                    raise LayoutError(
                        f"param {name!r}: {pl} but mesh dim {self.mesh.dims[m]!r} has size {self.mesh.sizes[m]}"
                    )
                if p.rule is None and isinstance(pl, Shard):
                    raise LayoutError(
                        f"param {name!r}: its rule is unknown (rule=None), so it must be held "
                        f"whole (Replicate/Only), not {pl} on {self.mesh.dims[m]!r}"
                    )
        owner: dict[str, str] = {}
        for local, f in self.fused.items():
            if local in self.params:
                raise LayoutError(f"fused {local!r}: the name is also a parameter")
            if len(f.parts) < 1:
                raise LayoutError(f"fused {local!r}: no parts")
            for part in f.parts:
                q = self.params.get(part)
                if q is None:
                    raise LayoutError(f"fused {local!r}: part {part!r} is not a parameter of this layout")
                if part in owner:
                    raise LayoutError(f"fused {local!r}: part {part!r} already belongs to {owner[part]!r}")
                owner[part] = local
                first = self.params[f.parts[0]]
                if q.dtype != first.dtype or len(q.shape) != len(first.shape) or not 0 <= f.dim < len(q.shape):
                    raise LayoutError(
                        f"fused {local!r}: part {part!r} ({q.dtype}, {len(q.shape)} dims) cannot be "
                        f"concatenated with {f.parts[0]!r} along dim {f.dim}"
                    )
                if _holding(q.placements) != _holding(first.placements):
                    raise LayoutError(f"fused {local!r}: part {part!r} is held by other ranks than {f.parts[0]!r}")

    # -- the wire format

    def to_dict(self) -> dict[str, Any]:
        return {
            "mesh": {"dims": list(self.mesh.dims), "sizes": list(self.mesh.sizes), "ranks": list(self.mesh.ranks)},
            "params": {
                n: {
                    "shape": list(p.shape),
                    "dtype": p.dtype,
                    "placements": [str(x) for x in p.placements],
                    "rule": p.rule,
                }
                for n, p in self.params.items()
            },
            "fused": {n: {"dim": f.dim, "parts": list(f.parts)} for n, f in self.fused.items()},
        }

    @cached_property
    def _json(self) -> bytes:
        return json.dumps(self.to_dict(), separators=(",", ":")).encode()

    def to_json(self) -> bytes:
        """The JSON form (computed once per layout: layouts are immutable)."""
        return self._json

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Layout:
        try:
            m = d["mesh"]
            mesh = Mesh(tuple(m["dims"]), tuple(int(s) for s in m["sizes"]), tuple(int(r) for r in m["ranks"]))
            params = {}
            for n, p in d["params"].items():
                dtype_from_name(p["dtype"], f"layout param {n!r} dtype", LayoutError)
                params[n] = ParamLayout(
                    check_shape(p["shape"], f"layout param {n!r} shape", LayoutError),
                    p["dtype"],
                    tuple(parse_placement(x) for x in p["placements"]),
                    p.get("rule"),
                )
            fused = {n: Fused(int(f["dim"]), tuple(f["parts"])) for n, f in d.get("fused", {}).items()}
        except (KeyError, TypeError, AttributeError) as e:
            raise LayoutError(f"malformed layout: missing or wrong field {e}") from e
        return cls(mesh, params, fused)

    @classmethod
    def from_json(cls, data: bytes | str) -> Layout:
        return cls.from_dict(json.loads(data))

    @cached_property
    def fingerprint(self) -> int:
        """A 31-bit checksum of the JSON form."""
        return zlib.crc32(self.to_json()) & 0x7FFFFFFF

    # -- what a rank holds

    def box(self, name: str, rank: int) -> Box | None:
        """The box of parameter ``name`` that group rank ``rank`` holds (None: none of it)."""
        p = self.params[name]
        return param_box(p.shape, p.placements, self.mesh.sizes, self.mesh.coords[rank])

    @cached_property
    def part_of(self) -> dict[str, str]:
        """Parameter -> the fused local tensor it is a part of."""
        return {part: local for local, f in self.fused.items() for part in f.parts}

    def local_tensors(self, rank: int) -> dict[str, LocalTensor]:
        """Every local tensor ``rank`` holds, in parameter order (a fused one where its first
        part comes)."""
        if rank not in self.mesh.coords:
            raise LayoutError(f"rank {rank} is not in this layout's mesh (ranks {list(self.mesh.ranks)})")
        out: dict[str, LocalTensor] = {}
        part_of = self.part_of
        for name, p in self.params.items():
            local = part_of.get(name)
            if local is not None:
                if local not in out:
                    lt = self.fused_local(local, rank)
                    if lt is not None:
                        out[local] = lt
                continue
            b = self.box(name, rank)
            if b is not None:
                out[name] = LocalTensor(name, tuple(hi - lo for lo, hi in b), p.dtype, ((name, b, 0),))
        return out

    def fused_local(self, local: str, rank: int) -> LocalTensor | None:
        """The fused local tensor ``local`` on ``rank`` (None if it holds none of it)."""
        f = self.fused[local]
        parts = []
        off = 0
        shape: list[int] | None = None
        for part in f.parts:
            b = self.box(part, rank)
            if b is None:
                return None
            ext = [hi - lo for lo, hi in b]
            if shape is None:
                shape = ext
            elif [e for i, e in enumerate(ext) if i != f.dim] != [e for i, e in enumerate(shape) if i != f.dim]:
                raise LayoutError(
                    f"fused {local!r} on rank {rank}: part {part!r} holds {ext}, which does not "
                    f"concatenate with {shape} along dim {f.dim}"
                )
            parts.append((part, b, off))
            off += ext[f.dim]
        assert shape is not None
        shape[f.dim] = off
        return LocalTensor(local, tuple(shape), self.params[f.parts[0]].dtype, tuple(parts), f.dim)


def _holding(placements: Sequence[Placement]) -> tuple[Only | None, ...]:
    return tuple(pl if isinstance(pl, Only) else None for pl in placements)


def param_box(
    shape: Sequence[int], placements: Sequence[Placement], sizes: Sequence[int], coord: Sequence[int]
) -> Box | None:
    """The box held at mesh coordinate ``coord`` (None where an ``Only`` excludes it)."""
    box = [(0, n) for n in shape]
    for m, pl in enumerate(placements):
        if isinstance(pl, Shard):
            lo, hi = box[pl.dim]
            box[pl.dim] = chunk(lo, hi, sizes[m], coord[m])
        elif isinstance(pl, Only) and coord[m] != pl.index:
            return None
    return tuple(box)
