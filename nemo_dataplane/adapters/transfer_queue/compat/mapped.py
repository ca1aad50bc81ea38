"""Which Ray object a stored row is a view of, found from the row's address (quirk 11).

A unit's rows are views of a Ray object the writer put (mapped from shared memory in the
unit's process: the writer's one copy is the only one). TransferQueue's own clients read them
through the unit as usual. Inside each unit process, a table records the address range of
every field buffer mapped this way, so our reads can tell from a row's address which object
and row it is and map the object themselves instead of having the unit stack and re-send the
rows; no per-row bookkeeping. A record is dropped when its buffer is freed, i.e. when the last
row viewing it is gone (TransferQueue cleared or replaced them all).
"""

from __future__ import annotations

import bisect
import operator
import threading
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch


@dataclass(eq=False)
class _Mapped:
    ref: Any  # the writer's object (held: it stays readable while rows view it)
    start: int  # address of the field's values
    end: int
    row_bytes: int  # dense: bytes per row
    token_bytes: int  # jagged: bytes per element of dim 0
    offsets: np.ndarray | None  # jagged: element offsets of the rows


_CHUNKS: list[tuple[int, _Mapped]] = []  # sorted by start address
_CHUNKS_LOCK = threading.Lock()  # writes run on the actor thread, frees on whichever drops a row


def register(ref: Any, values: torch.Tensor, offsets: torch.Tensor | None, buf: np.ndarray) -> None:
    """Record that ``values`` (jagged: with element ``offsets``) of object ``ref`` live in ``buf``,
    until ``buf`` is freed."""
    item = values.element_size()
    per_row = item
    for d in values.shape[1:]:
        per_row *= d
    start = values.data_ptr()
    m = _Mapped(
        ref,
        start,
        start + values.numel() * item,
        per_row,
        per_row,
        None if offsets is None else offsets.numpy().astype(np.int64),
    )
    with _CHUNKS_LOCK:
        bisect.insort(_CHUNKS, (start, m), key=operator.itemgetter(0))
    weakref.finalize(buf, _unregister, m)


def _unregister(m: _Mapped) -> None:
    with _CHUNKS_LOCK:
        for i, (_, other) in enumerate(_CHUNKS):
            if other is m:
                del _CHUNKS[i]
                break


def locate(rows: Sequence[Any]) -> tuple[list[Any], np.ndarray, np.ndarray] | None:
    """``(object refs, chunk per row, row per row)`` when every row is a view we stored."""
    if not all(isinstance(r, torch.Tensor) for r in rows):
        return None
    with _CHUNKS_LOCK:
        table = list(_CHUNKS)
    if not table:
        return None
    ptrs = np.fromiter((r.data_ptr() for r in rows), dtype=np.int64, count=len(rows))
    starts = np.array([s for s, _ in table], dtype=np.int64)
    which = np.searchsorted(starts, ptrs, side="right") - 1
    if (which < 0).any():
        return None
    used = np.unique(which)
    refs = []
    chunks = np.empty(len(rows), dtype=np.int64)
    positions = np.empty(len(rows), dtype=np.int64)
    for c, w in enumerate(used.tolist()):
        m = table[w][1]
        sel = np.flatnonzero(which == w)
        rel = ptrs[sel] - m.start
        if (ptrs[sel] > m.end).any():
            return None
        if m.offsets is None:
            pos = rel // m.row_bytes if m.row_bytes else np.zeros(len(sel), dtype=np.int64)
        else:
            elem = rel // m.token_bytes if m.token_bytes else np.zeros(len(sel), dtype=np.int64)
            lengths = np.fromiter((rows[i].shape[0] for i in sel.tolist()), dtype=np.int64, count=len(sel))
            # An empty row shares its address with the next row: any empty row there reads the same.
            pos = np.where(
                lengths > 0,
                np.searchsorted(m.offsets, elem, side="right") - 1,
                np.searchsorted(m.offsets, elem, side="left"),
            )
            pos = np.minimum(pos, len(m.offsets) - 2)
        refs.append(m.ref)
        chunks[sel], positions[sel] = c, pos
    return refs, chunks, positions
