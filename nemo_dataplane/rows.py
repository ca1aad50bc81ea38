"""Row helpers over ``TensorDict`` batches, shared by every layer that cuts batches.

:func:`select_rows` (the driver's fan-out, the legacy transport) and :func:`split_microbatches`
(the worker's fetch, the legacy transport) live here, below both the driver and the worker
layers, so the data-plane path and the legacy baseline cut batches with the same code and can be
compared byte for byte.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, cast

import torch
from tensordict import TensorDict

__all__ = ["concat_rows", "select_rows", "split_microbatches", "take_rows"]


# Jagged fields are taken apart into (values, offsets) once per call: every NJT accessor and
# constructor goes through torch's Python dispatch (~0.5 ms each), which dominated cutting a
# shard into dozens of micro-batches when done per micro-batch.
_Column = tuple[torch.Tensor, torch.Tensor | None]  # (dense tensor | jagged values, offsets | None)


def _columns(batch: TensorDict, what: str) -> dict[str, _Column]:
    out: dict[str, _Column] = {}
    for name, value in batch.items():
        if isinstance(value, TensorDict):
            raise TypeError(f"{what}: field {name!r} is a nested TensorDict; flatten it into named tensors")
        t = cast(torch.Tensor, value)  # a field's value: a tensor (a nested TensorDict raised above)
        if getattr(t, "is_nested", False) and t.layout == torch.jagged:
            out[name] = (t.values(), t.offsets())  # type: ignore[attr-defined]  # torch's stub lacks the NJT accessor
        else:
            out[name] = (t, None)
    return out


def _rows(columns: Mapping[str, _Column], index: list[int], *, copy: bool) -> TensorDict:
    """Rows ``index`` of every column (see :func:`take_rows`)."""
    start = _run_start(index)
    out = {name: _take(t, offsets, index, start, copy) for name, (t, offsets) in columns.items()}
    return TensorDict(out, batch_size=[len(index)])


def _run_start(index: Sequence[int] | torch.Tensor) -> int | None:
    """The first row when ``index`` is a contiguous ascending run, else ``None``."""
    n = len(index)
    if n == 0:
        return None
    if isinstance(index, range):
        return index.start if index.step == 1 else None
    if isinstance(index, torch.Tensor):
        first = int(index[0])
        if int(index[-1]) - first != n - 1:
            return None
        return first if n == 1 or bool((index.diff() == 1).all()) else None
    first = int(index[0])
    if int(index[-1]) - first != n - 1:
        return None
    return first if list(index) == list(range(first, first + n)) else None


def _take(
    t: torch.Tensor, offsets: torch.Tensor | None, index: Sequence[int] | torch.Tensor, start: int | None, copy: bool
) -> torch.Tensor:
    """A contiguous ascending run is sliced (a view of the source, or a clone with ``copy``);
    anything else is gathered (always a fresh tensor)."""
    n = len(index)
    if offsets is None:
        if start is not None:
            part = t[start : start + n]
            return part.clone() if copy else part
        return t.index_select(0, _index(index, t.device))
    if start is not None:
        off = offsets[start : start + n + 1] - offsets[start]
        values = t[int(offsets[start]) : int(offsets[start + n])]
        return torch.nested.nested_tensor_from_jagged(values.clone() if copy else values, offsets=off)
    if n == 0:
        return torch.nested.nested_tensor_from_jagged(t[:0], offsets=torch.zeros(1, dtype=offsets.dtype))
    return _gather_jagged(t, offsets, _index(index, offsets.device))


def take_rows(
    values: torch.Tensor, offsets: torch.Tensor | None, index: Sequence[int] | torch.Tensor, *, copy: bool
) -> torch.Tensor:
    """Rows ``index`` of one stored column: dense ``values`` (``offsets is None``, row ``i`` is
    ``values[i]``) or the flat values of a jagged column (row ``i`` is
    ``values[offsets[i]:offsets[i + 1]]``, returned as a jagged nested tensor).

    A contiguous ascending run of rows (e.g. a ``range``) is a view of ``values`` unless
    ``copy``; any other index (a sequence or an int64 tensor) gathers into a fresh tensor in one
    vectorized call (no per-row Python work).
    """
    return _take(values, offsets, index, _run_start(index), copy)


def concat_rows(name: str, parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """Blocks of rows of one field, joined along dim 0 into one new tensor.

    The result is jagged when any block is (a dense block's rows then become jagged rows of
    length ``shape[1]``), else dense.

    Raises:
        TypeError: blocks disagree in dtype (names the field).
        ValueError: dense blocks disagree in row shape, or jagged blocks in per-token shape.
    """
    if not parts:
        raise ValueError(f"field {name!r}: no rows to join")
    dtypes = {p.dtype for p in parts}
    if len(dtypes) > 1:
        raise TypeError(f"field {name!r}: rows were stored with different dtypes {sorted(map(str, dtypes))}")
    if not any(getattr(p, "is_nested", False) for p in parts):
        shapes = {tuple(p.shape[1:]) for p in parts}
        if len(shapes) > 1:
            raise ValueError(
                f"field {name!r}: rows have different shapes {sorted(shapes)[:5]}; put it as a jagged nested tensor"
            )
        return torch.cat(list(parts), 0)
    values, lengths = [], []
    for p in parts:
        if getattr(p, "is_nested", False):
            off = p.offsets()  # type: ignore[attr-defined]  # torch's stub lacks the NJT accessor
            values.append(p.values()[int(off[0]) : int(off[-1])])
            lengths.append(off.diff())
        else:
            if p.dim() < 2:
                raise ValueError(f"field {name!r}: scalar rows cannot join jagged rows")
            values.append(p.reshape(p.shape[0] * p.shape[1], *p.shape[2:]))
            lengths.append(torch.full((p.shape[0],), p.shape[1], dtype=torch.int64))
    trailing = {tuple(v.shape[1:]) for v in values}
    if len(trailing) > 1:
        raise ValueError(f"field {name!r}: jagged rows disagree in per-token shape {sorted(trailing)[:5]}")
    all_lengths = torch.cat(lengths)
    offsets = torch.zeros(all_lengths.numel() + 1, dtype=torch.int64)
    torch.cumsum(all_lengths, 0, out=offsets[1:])
    return torch.nested.nested_tensor_from_jagged(torch.cat(values, 0), offsets=offsets)


def _index(index: Sequence[int] | torch.Tensor, device: torch.device) -> torch.Tensor:
    if isinstance(index, torch.Tensor):
        return index.to(device=device, dtype=torch.int64)
    return torch.tensor(list(index), dtype=torch.int64, device=device)


def _gather_jagged(values: torch.Tensor, offsets: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    starts, stops = offsets[index], offsets[index + 1]
    lengths = stops - starts
    new_offsets = torch.zeros(len(index) + 1, dtype=offsets.dtype, device=offsets.device)
    torch.cumsum(lengths, 0, out=new_offsets[1:])
    total = int(new_offsets[-1])
    # One vectorized gather instead of a Python loop of per-row slices: element j of the output
    # comes from values[starts[row(j)] + (j - new_offsets[row(j)])].
    shift = torch.repeat_interleave(starts - new_offsets[:-1], lengths, output_size=total)
    gather = torch.arange(total, dtype=offsets.dtype, device=offsets.device) + shift
    return torch.nested.nested_tensor_from_jagged(values.index_select(0, gather), offsets=new_offsets)


def _check_indices(index: list[int], n: int, what: str) -> None:
    bad = [i for i in index if not 0 <= i < n]
    if bad:
        raise IndexError(f"{what}: indices {bad[:5]} out of range for a batch of {n} rows")


def select_rows(batch: TensorDict, indices: Sequence[int]) -> TensorDict:
    """A new ``TensorDict`` of ``batch``'s rows at ``indices`` (in that order), every field kept.

    Jagged fields stay jagged. The result never shares memory with ``batch``: a view would
    pickle (``ray.put``) the whole source storage along with its rows.

    Raises:
        IndexError: an index out of range.  TypeError: a nested ``TensorDict`` field.
    """
    n = batch.batch_size[0] if batch.batch_dims else 0
    index = [int(i) for i in indices]
    _check_indices(index, n, "select_rows")
    return _rows(_columns(batch, "select_rows"), index, copy=True)


def split_microbatches(data: TensorDict, plan_dict: Mapping[str, Any] | None) -> list[TensorDict]:
    """Cut a rank's rows into the driver's micro-batches (``plan_dict["microbatches"]``, positions
    within the shard); without a plan, the whole shard is one micro-batch.

    The driver's plans list each micro-batch as a contiguous run of the shard, so micro-batches
    are views of ``data`` (no copy); ``.clone()`` one before shipping it to another process, or
    its pickle carries all of ``data``.

    Raises:
        ValueError: the plan's positions do not partition ``data``'s rows.
    """
    if not plan_dict or "microbatches" not in plan_dict:
        return [data]
    mbs = [[int(p) for p in mb] for mb in plan_dict["microbatches"]]
    n = data.batch_size[0] if data.batch_dims else 0
    flat = sorted(p for mb in mbs for p in mb)
    if flat != list(range(n)) or any(not mb for mb in mbs):
        raise ValueError(
            f"packing plan does not match the fetched rows: its micro-batches cover positions "
            f"{flat[:10]}{'...' if len(flat) > 10 else ''} but {n} rows arrived"
        )
    columns = _columns(data, "split_microbatches")
    return [_rows(columns, mb, copy=False) for mb in mbs]
