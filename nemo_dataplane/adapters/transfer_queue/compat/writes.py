"""The write path: rows into the storage units, tags and production notices to the controller
(quirks 3, 5, 10, 11)."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Mapping, Sequence
from typing import Any, cast

import ray
import torch
from tensordict import TensorDict
from transfer_queue.client import AsyncTransferQueueClient, with_controller_socket
from transfer_queue.metadata import BatchMeta, extract_field_schema
from transfer_queue.storage.managers.simple_storage_manager import AsyncSimpleStorageManager
from transfer_queue.utils.zmq_utils import ZMQRequestType

from nemo_dataplane.adapters.chunks import decode, encode, rows_of
from nemo_dataplane.adapters.transfer_queue.compat.mapped import register
from nemo_dataplane.codec import batch_nbytes
from nemo_dataplane.rows import take_rows

UNIT_GET_TIMEOUT_S = 300.0  # a unit's wait for a writer's object (local, or one transfer)
# A put up to this size travels inside its call to the unit (or the controller holding it);
# larger ones are put once into Ray's object store and mapped by the unit (quirk 11), so reads
# can map them too. It is Ray's own default limit for arguments passed inline
# (max_direct_call_object_size): an 8-row put of ~96 KiB takes 4.0 ms inline against 7.7 ms
# through the object store (2-core machine).
INLINE_MAX_BYTES = 100 * 1024
# The SET_CUSTOM_META body entry our controller reads as a production notice (:func:`set_tags`).
PRODUCED = "nd_produced"


# Functions that run inside storage units (_storage_side_split, _unit_write here, _unit_read in
# .reads, _node_of in .bootstrap) travel by reference (pickled as their module path, ~20 us),
# so the units' nodes must be able to import nemo_dataplane, as every worker node already must.
# Shipping them by value instead costs ~1 ms of cloudpickle per call.
def _storage_side_split(
    field_data: dict[str, Any], spec: dict[str, tuple[list[int], tuple[int, ...]]]
) -> dict[str, Any]:
    """Runs inside a storage unit as a ``data_parser``: cut each packed jagged field into rows.

    ``field_data[name]`` arrives as one ``[rows, C]`` tensor holding the flat values (zero-padded
    to a multiple of ``rows``); ``spec[name]`` gives element offsets and the per-token shape.
    Row views share the received buffer, exactly like TransferQueue's own dense rows.
    """
    for name, (offsets, trailing) in spec.items():
        flat = field_data[name].reshape(-1)
        field_data[name] = [flat[offsets[i] : offsets[i + 1]].view(-1, *trailing) for i in range(len(offsets) - 1)]
    return field_data


def _jagged_group(t: torch.Tensor, positions: list[int], n_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat values and int64 row lengths of the rows of jagged ``t`` at ``positions``."""
    values = t.values()
    offsets = t.offsets()  # type: ignore[attr-defined]  # torch's Tensor stub lacks the NJT accessor
    lengths = offsets.diff()
    if len(positions) == n_rows and positions == list(range(n_rows)):
        start = int(offsets[0])
        return values[start : start + int(lengths.sum())], lengths
    idx = torch.tensor(positions, dtype=torch.int64)
    sel_len = lengths[idx]
    starts = offsets[:-1][idx]
    # Element gather index without a per-row loop: each row's start repeated over its length,
    # plus the position inside the row.
    row_base = torch.repeat_interleave(starts - (torch.cumsum(sel_len, 0) - sel_len), sel_len)
    gather = row_base + torch.arange(int(sel_len.sum()), dtype=torch.int64)
    return values.index_select(0, gather), sel_len


def _pack_jagged(values: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, list[int], tuple[int, ...]]:
    """``values`` as one ``[rows, C]`` tensor plus element offsets and per-token shape."""
    rows = lengths.numel()
    trailing = tuple(values.shape[1:])
    per_token = 1
    for d in trailing:
        per_token *= d
    flat = values.contiguous().reshape(-1)
    cols = -(-flat.numel() // rows) if rows else 0
    pad = rows * cols - flat.numel()
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    offsets = [0]
    offsets += (torch.cumsum(lengths, 0) * per_token).tolist()
    return flat.view(rows, cols), offsets, trailing


def _jagged_schema(t_dtype: torch.dtype, lengths: torch.Tensor, trailing: tuple[int, ...]) -> dict[str, Any]:
    shapes = [(n, *trailing) for n in lengths.tolist()]
    return {
        "dtype": t_dtype,
        "shape": None,
        "is_nested": True,
        "is_non_tensor": False,
        "per_sample_shapes": shapes,
    }


def field_schema(n: int, columns: Mapping[str, torch.Tensor], jagged: set[str]) -> dict[str, dict[str, Any]]:
    """The field schema TransferQueue's own put records for ``columns`` (``n`` rows)."""
    dense = {k: v for k, v in columns.items() if k not in jagged}
    schema: dict[str, dict[str, Any]] = {}
    if dense:
        schema.update(extract_field_schema(TensorDict(dense, batch_size=[n])))
    for name in jagged:
        t = columns[name]
        offsets = t.offsets()  # type: ignore[attr-defined]  # torch's Tensor stub lacks the NJT accessor
        schema[name] = _jagged_schema(t.dtype, offsets.diff(), tuple(t.values().shape[1:]))
    return schema


async def put_rows(
    client: AsyncTransferQueueClient,
    meta: BatchMeta,
    columns: Mapping[str, torch.Tensor],
    jagged: set[str],
    units: Mapping[str, Any] | None = None,
    chunk: Any = None,
) -> dict[str, dict[str, Any]]:
    """Write ``columns`` (row ``i`` -> ``meta.global_indexes[i]``) to the storage units.

    With ``units`` (unit id -> actor handle, see :func:`unit_handles`) rows go through Ray's
    object store (quirk 11): one ``ray.put`` per unit's rows (or ``chunk``, from
    :func:`put_chunk`, shared by units on this node), which the unit maps and stores as one
    view per row; a small put (:func:`rides_inline`; ``chunk`` from :func:`chunk_of`) travels
    inside the unit's call instead. Otherwise TransferQueue's ZMQ protocol, equivalent to ``client.async_put`` minus
    its thread juggling (quirk 3) and per-row frames for jagged fields (quirk 5).

    The rows are not yet produced: pass the returned field schema (the one TransferQueue would
    record) to :func:`mark_produced` once the keys' tags are stored (quirk 10).
    """
    sm = cast(AsyncSimpleStorageManager, client.storage_manager)  # our stores' backend is SimpleStorage
    n = meta.size
    routing = sm._group_by_hash(meta.global_indexes)
    if units and all(su in units for su in routing):
        await _write_through_objects(units, routing, n, columns, chunk)
        return field_schema(n, columns, jagged)
    dense = {k: v for k, v in columns.items() if k not in jagged}
    tasks = []
    for su_id, group in routing.items():
        pos = group.batch_positions
        data: dict[str, Any] = {k: sm._select_by_positions(v, pos) for k, v in dense.items()}
        spec: dict[str, tuple[list[int], tuple[int, ...]]] = {}
        for name in jagged:
            values, lengths = _jagged_group(columns[name], pos, n)
            data[name], offsets, trailing = _pack_jagged(values, lengths)
            spec[name] = (offsets, trailing)
        parser = functools.partial(_storage_side_split, spec=spec) if spec else None
        tasks.append(
            sm._put_to_single_storage_unit(group.global_indexes, data, target_storage_unit=su_id, data_parser=parser)
        )
    await asyncio.gather(*tasks)
    return field_schema(n, columns, jagged)


def rides_inline(columns: Mapping[str, torch.Tensor]) -> bool:
    """Whether a put of ``columns`` travels inside its call (:data:`INLINE_MAX_BYTES`) rather
    than through one ``ray.put`` (:func:`put_chunk`)."""
    return batch_nbytes(dict(columns)) <= INLINE_MAX_BYTES


def chunk_of(columns: Mapping[str, torch.Tensor]) -> dict[str, Any]:
    """``columns`` as one chunk (see :mod:`.chunks`); views, no copy."""
    return {name: encode(t) for name, t in columns.items()}


def put_chunk(columns: Mapping[str, torch.Tensor]) -> Any:
    """``ray.put`` of ``columns`` as one chunk: the writer's only copy."""
    return ray.put(chunk_of(columns))


def _unit_write(unit: Any, global_indexes: list[int], positions: list[int] | None, chunk: list[Any]) -> None:
    """Runs inside a SimpleStorageUnit (``__ray_call__``): map ``chunk[0]`` (a ref from
    :func:`put_chunk`, or the chunk itself when it came inline) and store rows ``positions``
    (all, in order, for ``None``) of every field as one view each.

    ``storage_data.put_data`` is what the unit's own PUT handler calls; it is a series of
    single dict stores, each atomic under the GIL, like the handler's own.
    """
    ref = chunk[0]
    mapped = isinstance(ref, ray.ObjectRef)
    data = ray.get(ref, timeout=UNIT_GET_TIMEOUT_S) if mapped else ref
    field_rows: dict[str, list[torch.Tensor]] = {}
    for name, enc in data.items():
        values, offsets = decode(enc)
        if mapped and values.numel():
            register(ref, values, offsets, enc[2])
        rows = rows_of((values, offsets))
        field_rows[name] = rows if positions is None else [rows[i] for i in positions]
    unit.storage_data.put_data(field_rows, global_indexes)


async def _write_through_objects(
    units: Mapping[str, Any], routing: Mapping[str, Any], n: int, columns: Mapping[str, torch.Tensor], chunk: Any
) -> None:
    calls = []
    for su, group in routing.items():
        positions = group.batch_positions
        whole = len(positions) == n and positions == list(range(n))
        if chunk is not None:
            calls.append(
                units[su].__ray_call__.remote(_unit_write, group.global_indexes, None if whole else positions, [chunk])
            )
            continue
        # A unit elsewhere gets only its own rows (one gather here instead of a whole transfer).
        part = {name: _take_positions(t, positions) for name, t in columns.items()} if not whole else columns
        packed = chunk_of(part) if rides_inline(part) else put_chunk(part)
        calls.append(units[su].__ray_call__.remote(_unit_write, group.global_indexes, None, [packed]))
    await asyncio.gather(*calls)


def _take_positions(t: torch.Tensor, positions: list[int]) -> torch.Tensor:
    if t.is_nested:
        return take_rows(t.values(), t.offsets(), positions, copy=False)  # type: ignore[attr-defined]  # NJT
    return take_rows(t, None, positions, copy=False)


async def mark_produced(client: AsyncTransferQueueClient, meta: BatchMeta, schema: dict[str, dict[str, Any]]) -> None:
    """Tell the controller ``meta``'s rows now hold the fields of ``schema`` (from :func:`put_rows`)."""
    sm = cast(AsyncSimpleStorageManager, client.storage_manager)  # our stores' backend is SimpleStorage
    # Schema rows must follow meta.global_indexes order, which is the column order of the put.
    await sm.notify_data_update(meta.partition_ids[0], meta.global_indexes, schema)


@with_controller_socket  # type: ignore[untyped-decorator]  # transfer_queue's decorator is unannotated
async def set_tags(
    client: AsyncTransferQueueClient,
    partition_id: str,
    global_indexes: Sequence[int],
    tags: Sequence[dict[str, Any]],
    produced: dict[str, dict[str, Any]] | None = None,
    socket: Any = None,
) -> None:
    """Store per-key tags (TransferQueue's ``custom_meta``), replacing each key's dict.

    The same SET_CUSTOM_META request ``client.async_set_custom_meta`` sends, minus its two
    deep copies of every key's tags and a ``BatchMeta`` rebuild per partition, which cost more
    than the request itself for a 1024-key batch. With ``produced`` (a field schema from
    :func:`put_rows`; only for a controller of ours, :class:`~.bootstrap._Controller`), the
    same request then marks the rows produced for its fields: what :func:`mark_produced` does,
    after the tags are stored (quirk 10), in one round trip.
    """
    body: dict[str, Any] = {"partition_custom_meta": {partition_id: dict(zip(global_indexes, tags))}}
    if produced:
        gis = list(global_indexes)
        body[PRODUCED] = {"partition_id": partition_id, "global_indexes": gis, "field_schema": by_index(produced, gis)}
    await client._request_controller(
        socket=socket,
        request_type=ZMQRequestType.SET_CUSTOM_META,
        response_type=ZMQRequestType.SET_CUSTOM_META_RESPONSE,
        body=body,
    )


def by_index(schema: dict[str, dict[str, Any]], gis: list[int]) -> dict[str, dict[str, Any]]:
    """``schema`` with per-row shapes keyed by global index, as the controller stores them
    (TransferQueue's storage manager does this before its NOTIFY_DATA_UPDATE request)."""
    out = {}
    for name, field in schema.items():
        shapes = field.get("per_sample_shapes")
        out[name] = {**field, "per_sample_shapes": dict(zip(gis, shapes))} if isinstance(shapes, list) else field
    return out
