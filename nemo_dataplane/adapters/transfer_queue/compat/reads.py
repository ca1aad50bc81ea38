"""The read path: rows out of the storage units, mapped from the writers' objects where they can
be, else stacked by the units, else TransferQueue's per-row protocol (quirks 4, 7, 11)."""

from __future__ import annotations

import asyncio
import operator
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

import numpy as np
import ray
import torch
from transfer_queue.client import AsyncTransferQueueClient
from transfer_queue.metadata import BatchMeta
from transfer_queue.storage import StorageKeyNotFoundError
from transfer_queue.storage.managers.simple_storage_manager import AsyncSimpleStorageManager

from nemo_dataplane.adapters.chunks import assemble, decode
from nemo_dataplane.adapters.locate import where_of
from nemo_dataplane.adapters.steps import Steps
from nemo_dataplane.adapters.transfer_queue.compat.mapped import locate
from nemo_dataplane.dtypes import check_lengths, view_bytes


async def get_rows(
    client: AsyncTransferQueueClient, meta: BatchMeta, fields: Sequence[str]
) -> dict[str, list[torch.Tensor]]:
    """Per-row tensors of ``fields`` in ``meta.global_indexes`` order (quirk 4: no nested copy).

    Raises:
        StorageKeyNotFoundError: a key was cleared between lookup and read.
    """
    sm = cast(AsyncSimpleStorageManager, client.storage_manager)  # our stores' backend is SimpleStorage
    routing = sm._group_by_hash(meta.global_indexes)
    groups = list(routing.items())
    results = await asyncio.gather(
        *(sm._get_from_single_storage_unit(g.global_indexes, list(fields), target_storage_unit=su) for su, g in groups)
    )
    if len(groups) == 1:
        return {f: list(results[0][1][f]) for f in fields}
    order = [p for _, g in groups for p in g.batch_positions]
    inverse = [0] * len(order)
    for i, p in enumerate(order):
        inverse[p] = i
    pick = operator.itemgetter(*inverse)
    out: dict[str, list[torch.Tensor]] = {}
    for f in fields:
        concat = [row for _, (_, su_data) in zip(groups, results) for row in su_data[f]]
        picked = pick(concat)
        out[f] = list(picked) if len(inverse) > 1 else [picked]
    return out


@dataclass
class Column:
    """One field for a batch of rows: ``lengths is None`` -> ``values`` is ``[rows, *row_shape]``
    (all rows had one shape); else ``values`` is the rows concatenated on dim 0, ``lengths`` their
    sizes (int64)."""

    values: torch.Tensor
    lengths: torch.Tensor | None = None

    @property
    def rows(self) -> int:
        return self.values.shape[0] if self.lengths is None else self.lengths.numel()

    def ragged(self) -> Column:
        if self.lengths is not None:
            return self
        if self.values.dim() < 2:
            raise ValueError("scalar rows cannot form a jagged tensor")
        n, length = self.values.shape[0], self.values.shape[1]
        return Column(
            self.values.reshape(n * length, *self.values.shape[2:]), torch.full((n,), length, dtype=torch.int64)
        )


def column_from_rows(rows: Sequence[torch.Tensor]) -> Column:
    """Stack rows of one shape, else concatenate them (fallback path; one C call either way).

    Raises:
        TypeError: a row is not a tensor (written by a foreign client).  ValueError: rows differ
            in more than their first dimension.
    """
    if not all(isinstance(r, torch.Tensor) for r in rows):
        kinds = sorted({type(r).__name__ for r in rows})
        raise TypeError(f"rows are not all tensors ({kinds}); this client reads tensor fields only")
    first = rows[0].shape
    if all(r.shape == first for r in rows):
        return Column(torch.stack(list(rows), 0))
    try:
        return Column(torch.cat(list(rows), 0), torch.tensor([r.shape[0] for r in rows], dtype=torch.int64))
    except RuntimeError:
        raise ValueError(f"rows cannot form one tensor (shapes {[tuple(r.shape) for r in rows[:5]]})") from None


def _unit_read(unit: Any, global_indexes: list[int], fields: list[str], stack: bool = False) -> dict[str, Any] | None:
    """Runs inside a SimpleStorageUnit (``__ray_call__``): where each field's rows are.

    Uses the unit's own ``storage_data.get_data`` (what its ZMQ GET handler calls, SSD offload
    included). Per field: ``("chunks", object refs, chunk per row, row per row)`` when every row
    is a view we stored (quirk 11; nothing is copied here), else (or with ``stack``)
    ``("stack", bytes, dtype, shape, lengths)``: the rows stacked into one buffer, raw bytes as
    numpy so Ray hands them over out of band. ``None`` when a field holds something other than
    tensors of one trailing shape (the caller then falls back to TransferQueue's protocol).
    """
    data = unit.storage_data.get_data(fields, global_indexes)
    out: dict[str, Any] = {}
    for f in fields:
        rows = data[f]
        located = None if stack else locate(rows)
        if located is not None:
            out[f] = ("chunks", *located)
            continue
        if not all(isinstance(r, torch.Tensor) for r in rows):
            return None
        first = rows[0].shape
        if all(r.shape == first for r in rows):
            t = torch.stack(rows, 0)
            lengths = None
        else:
            try:
                t = torch.cat(rows, 0)
            except RuntimeError:
                return None
            lengths = [r.shape[0] for r in rows]
        out[f] = (
            "stack",
            t.reshape(-1).view(torch.uint8).numpy(),
            str(t.dtype).replace("torch.", ""),
            tuple(t.shape),
            lengths,
        )
    return out


def _decode_unit_column(raw: Any, name: str) -> Column:
    _, buf, dtype, shape, lengths = raw
    # Ray maps the reply read-only from its object store: one copy makes it ours.
    data = torch.from_numpy(buf.copy() if not buf.flags.writeable else buf)
    values = view_bytes(data, dtype, shape, f"storage unit column {name!r}")
    if lengths is None:
        return Column(values)
    check_lengths(lengths, values.shape[0] if values.dim() else -1, f"storage unit column {name!r}")
    return Column(values, torch.tensor(lengths, dtype=torch.int64))


def _permute(col: Column, order: torch.Tensor) -> Column:
    """Rows of ``col`` in ``order`` without a per-row loop."""
    if col.lengths is None:
        return Column(col.values.index_select(0, order))
    starts = torch.cumsum(col.lengths, 0) - col.lengths
    sel_len = col.lengths[order]
    row_base = torch.repeat_interleave(starts[order] - (torch.cumsum(sel_len, 0) - sel_len), sel_len)
    gather = row_base + torch.arange(int(sel_len.sum()), dtype=torch.int64)
    return Column(col.values.index_select(0, gather), sel_len)


def read_columns(
    client: AsyncTransferQueueClient,
    units: Mapping[str, Any],
    meta: Any,
    fields: Sequence[str],
    first: list[Any] | None = None,
) -> Steps[dict[str, Column | torch.Tensor] | None]:
    """Each field of ``meta``'s rows, in ``meta.global_indexes`` order (an op body of Ray waits
    only: :mod:`~nemo_dataplane.adapters.steps`).

    A field whose rows are all views we stored (quirk 11) comes back as the finished tensor, in
    the layout it was put with: this process maps the writers' objects and copies the rows out
    once. Any other field comes back as a :class:`Column` the units stacked (rows written by
    TransferQueue's own clients, or objects whose writer died: the unit still holds the rows).
    ``units`` maps storage-unit id (TransferQueue's routing key) to its actor handle. ``meta``
    needs ``global_indexes`` and ``size`` (a ``BatchMeta`` or a :class:`~.hosted.Located`);
    ``first``: the units' :func:`_unit_read` replies, one per unit in routing order, when the
    caller has them already (quirk 14). Returns ``None`` when some unit holds data it cannot
    stack (then use :func:`get_rows`).

    Raises:
        StorageKeyNotFoundError: a key was cleared between lookup and read.
    """
    sm = cast(AsyncSimpleStorageManager, client.storage_manager)  # our stores' backend is SimpleStorage
    groups = list(sm._group_by_hash(meta.global_indexes).items())
    if any(su not in units for su, _ in groups):
        return None
    if first is not None and len(first) != len(groups):
        raise ValueError(f"{len(first)} unit replies for {len(groups)} units")
    replies = first if first is not None else (yield from _unit_reads(units, groups, list(fields), stack=False))
    if replies is None:
        return None
    out: dict[str, Column | torch.Tensor] = {}
    direct = [f for f in fields if all(r[f][0] == "chunks" for r in replies)]
    if direct:
        try:
            out.update((yield from _assemble_from_objects(direct, groups, replies, meta.size)))
        except (ray.exceptions.OwnerDiedError, ray.exceptions.ObjectLostError):
            direct = []  # a writer died: its rows live on in the units, read them from there
    rest = [f for f in fields if f not in out]
    if rest:
        if direct or any(r[f][0] == "chunks" for r in replies for f in rest):
            replies = yield from _unit_reads(units, groups, rest, stack=True)
            if replies is None:
                return None
        out.update(_merge_stacked(rest, groups, replies))
    return out


def _unit_reads(units: Mapping[str, Any], groups: list[Any], fields: list[str], stack: bool) -> Steps[list[Any] | None]:
    refs = [units[su].__ray_call__.remote(_unit_read, g.global_indexes, fields, stack) for su, g in groups]
    try:
        replies = yield refs
    except ray.exceptions.RayTaskError as e:
        if isinstance(e, KeyError) or isinstance(getattr(e, "cause", None), KeyError):
            raise StorageKeyNotFoundError(str(getattr(e, "cause", e))) from None
        raise
    return None if any(r is None for r in replies) else replies


def _assemble_from_objects(
    fields: list[str], groups: list[Any], replies: list[Any], n: int
) -> Steps[dict[str, torch.Tensor]]:
    refs: list[Any] = []
    index: dict[bytes, int] = {}
    located = {f: (np.empty(n, dtype=np.int64), np.empty(n, dtype=np.int64)) for f in fields}
    for (_, group), reply in zip(groups, replies):
        at = np.asarray(group.batch_positions, dtype=np.int64)
        for f in fields:
            _, unit_refs, chunks, rows = reply[f]
            remap = np.empty(len(unit_refs), dtype=np.int64)
            for j, r in enumerate(unit_refs):
                key = r.binary()
                if key not in index:  # units on one node may share one chunk
                    index[key] = len(refs)
                    refs.append(r)
                remap[j] = index[key]
            located[f][0][at] = remap[chunks]
            located[f][1][at] = rows
    objs = yield refs
    return {f: assemble(f, where_of(*located[f]), lambda c, name: decode(objs[c][name]), copy=True) for f in fields}


def _merge_stacked(fields: list[str], groups: list[Any], replies: list[Any]) -> dict[str, Column]:
    out: dict[str, Column] = {}
    for f in fields:
        cols = [_decode_unit_column(r[f], f) for r in replies]
        if len(cols) == 1:
            out[f] = cols[0]
            continue
        if all(c.lengths is None for c in cols) and len({tuple(c.values.shape[1:]) for c in cols}) == 1:
            merged = Column(torch.cat([c.values for c in cols], 0))
        else:
            rag = [c.ragged() for c in cols]
            try:
                lengths = cast("list[torch.Tensor]", [c.lengths for c in rag])  # ragged(): none is None
                merged = Column(torch.cat([c.values for c in rag], 0), torch.cat(lengths))
            except RuntimeError:
                raise ValueError(f"field {f!r}: rows cannot form one tensor") from None
        positions = torch.tensor([p for _, g in groups for p in g.batch_positions], dtype=torch.int64)
        out[f] = _permute(merged, torch.argsort(positions))
    return out
