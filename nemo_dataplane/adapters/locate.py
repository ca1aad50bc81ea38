"""Where a read's rows live, in a compact form (torch-free: the Ray store's index uses it).

Rows are located by ``(chunk, row)`` per key; :func:`where_of` turns the two arrays into
``("runs", [(chunk, first row, count), ...])`` when they form few contiguous runs (a read of
whole puts in order: a handful of slices) or keeps ``("rows", chunks, rows)`` otherwise.
:func:`nemo_dataplane.adapters.chunks.assemble` reads either.
"""

from __future__ import annotations

from typing import Any

import numpy as np

MAX_RUNS = 8  # more runs than this: per-row arrays, gathered in one call per chunk


def where_of(chunks: np.ndarray, rows: np.ndarray) -> tuple[Any, ...]:
    """The compact location of keys whose rows are ``rows[i]`` of chunk ``chunks[i]``."""
    n = len(chunks)
    if n == 0:
        return ("runs", [])
    starts = np.flatnonzero(np.r_[True, (chunks[1:] != chunks[:-1]) | (rows[1:] != rows[:-1] + 1)])
    if starts.size <= MAX_RUNS:
        counts = np.diff(np.r_[starts, n])
        return ("runs", list(zip(chunks[starts].tolist(), rows[starts].tolist(), counts.tolist())))
    return ("rows", chunks, rows)
