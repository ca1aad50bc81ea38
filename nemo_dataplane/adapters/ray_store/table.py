"""One partition of the Ray store's index as columns (torch-free, runs inside the index actor).

Slot = row, in insertion order: keys, tags, and per field two int64 numpy arrays (the chunk
holding the row's value, -1 when not stored, and its row within that chunk), plus a boolean
column per claiming task. A put or a read of thousands of keys then costs one dict lookup per key
and a few vector operations, not Python objects per row and field. A cleared row's slot stays
empty until :meth:`Partition.compact` renumbers the live ones (never while a put is in flight).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

import numpy as np


def grow(a: np.ndarray, cap: int, fill: Any) -> np.ndarray:
    """``a`` extended to ``cap`` entries with ``fill``."""
    out = np.full(cap, fill, dtype=a.dtype)
    out[: a.shape[0]] = a
    return out


class Partition:
    """One partition's rows. Slot = row, in insertion order; a cleared row's slot stays empty
    until the partition is compacted."""

    def __init__(self) -> None:
        self.index: dict[str, int] = {}
        self.keys: list[str | None] = []
        self.tags: list[dict[str, Any] | None] = []
        self.cap = 0
        self.live = np.zeros(0, dtype=bool)
        self.cid: dict[str, np.ndarray] = {}  # field -> chunk id per slot (-1: not stored)
        self.pos: dict[str, np.ndarray] = {}  # field -> row within that chunk
        self.claimed: dict[str, np.ndarray] = {}  # task -> claimed per slot
        self.nlive = 0

    @property
    def n(self) -> int:
        return len(self.keys)

    def _reserve(self, n: int) -> None:
        if n <= self.cap:
            return
        cap = max(n, 2 * self.cap, 64)
        self.live = grow(self.live, cap, False)
        for f in self.cid:
            self.cid[f] = grow(self.cid[f], cap, -1)
            self.pos[f] = grow(self.pos[f], cap, 0)
        for t in self.claimed:
            self.claimed[t] = grow(self.claimed[t], cap, False)
        self.cap = cap

    def lookup(self, keys: Sequence[str]) -> np.ndarray:
        get = self.index.get
        return np.fromiter((get(k, -1) for k in keys), dtype=np.int64, count=len(keys))

    def append(self, keys: list[str], tags: list[dict[str, Any]]) -> np.ndarray:
        start = self.n
        self._reserve(start + len(keys))
        self.index.update(zip(keys, range(start, start + len(keys))))
        self.keys.extend(keys)
        self.tags.extend(tags)
        self.live[start : start + len(keys)] = True
        self.nlive += len(keys)
        return np.arange(start, start + len(keys), dtype=np.int64)

    def field(self, name: str) -> tuple[np.ndarray, np.ndarray]:
        if name not in self.cid:
            self.cid[name] = np.full(self.cap, -1, dtype=np.int64)
            self.pos[name] = np.zeros(self.cap, dtype=np.int64)
        return self.cid[name], self.pos[name]

    def set_cells(self, name: str, slots: np.ndarray, cid: int, rows: np.ndarray) -> np.ndarray:
        """Point field ``name`` of ``slots`` at ``rows`` of chunk ``cid``; returns the chunk ids
        the cells pointed to before (-1: none)."""
        c, p = self.field(name)
        old: np.ndarray = c[slots].copy()
        c[slots] = cid
        p[slots] = rows
        return old

    def remove(self, slots: np.ndarray) -> list[np.ndarray]:
        """Empty ``slots`` (their keys, tags, cells and claims); returns, per field, the chunk ids
        their cells pointed to."""
        released = []
        for c in self.cid.values():
            released.append(c[slots].copy())
            c[slots] = -1
        for claimed in self.claimed.values():
            claimed[slots] = False
        self.live[slots] = False
        for s in slots.tolist():
            del self.index[self.keys[s]]
            self.keys[s] = None
            self.tags[s] = None
        self.nlive -= slots.size
        return released

    def task(self, task: str) -> np.ndarray:
        if task not in self.claimed:
            self.claimed[task] = np.zeros(self.cap, dtype=bool)
        return self.claimed[task]

    def produced(self, fields: Sequence[str]) -> np.ndarray:
        """Per slot (up to ``n``): live and every field in ``fields`` stored."""
        ok: np.ndarray = self.live[: self.n].copy()
        for f in fields:
            c = self.cid.get(f)
            if c is None:
                return np.zeros(self.n, dtype=bool)
            ok &= c[: self.n] >= 0
        return ok

    def common_fields(self, slots: np.ndarray) -> list[str]:
        """Fields stored for every slot in ``slots``, in the order they first reached the partition."""
        if slots.size == 0:
            return []
        return [f for f, c in self.cid.items() if bool((c[slots] >= 0).all())]

    def compact(self) -> None:
        keep = np.flatnonzero(self.live[: self.n])
        self.keys = [self.keys[i] for i in keep]
        self.tags = [self.tags[i] for i in keep]
        self.index = {k: i for i, k in enumerate(cast("list[str]", self.keys))}  # live slots only: no None
        cap = max(len(keep), 64)
        self.live = grow(np.ones(len(keep), dtype=bool), cap, False)
        for f in list(self.cid):
            self.cid[f] = grow(self.cid[f][keep], cap, -1)
            self.pos[f] = grow(self.pos[f][keep], cap, 0)
        for t in list(self.claimed):
            self.claimed[t] = grow(self.claimed[t][keep], cap, False)
        self.cap = cap
