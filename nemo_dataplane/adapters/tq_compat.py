"""Every workaround for a TransferQueue 0.1.11 quirk, in one place.

The adapter (:mod:`nemo_dataplane.adapters.transfer_queue`) talks to TransferQueue only through
this module. Nothing here patches the dependency: each function calls a TransferQueue API (public
or, where the public one misbehaves, the internal one it wraps) in a way that sidesteps one of
the behaviours below, each seen on a 2-CPU machine:

1. ``tq.init()`` asks Ray for 3 CPUs (controller + 2 storage units, ``num_cpus=1`` each) and then
   blocks forever on a 2-CPU cluster -> :func:`create_controller` / :func:`create_storage_units`
   size the actors with fractional CPUs and every wait has a timeout.
2. ``interface.py`` keeps the client, controller and storage in module globals that go stale
   after ``ray.shutdown()``, and its ``close()`` kills the shared controller from any process ->
   the adapter owns its own client (:func:`make_client`) and actor handles.
3. ``TransferQueueClient.async_put``/``async_get_data`` wrap every call in
   ``limit_pytorch_auto_parallel_threads``, which sets ``torch.set_num_threads`` and restores it
   to the value seen at *import* time, warning on every op when ``TQ_NUM_THREADS`` exceeds the
   core count -> :func:`put_rows`/:func:`get_rows` drive the storage manager directly and
   :func:`preserve_torch_threads` restores the caller's setting regardless.
4. A get rebuilds every non-scalar field as a jagged nested tensor with
   ``torch.nested.as_nested_tensor`` (one copy plus per-row work) -> :func:`get_rows` returns
   the decoded per-row views so the adapter assembles each field once, in C, with
   ``torch.stack``/``torch.cat``.
5. A jagged field is sent as one ZMQ frame *per row* and its schema is built with a Python loop
   over ``unbind()`` -> :func:`put_rows` sends it as one flat buffer per storage unit and lets a
   tiny ``data_parser`` (run inside the storage unit, a documented SimpleStorage hook) cut it into
   per-row views there, so the store holds exactly the rows TransferQueue's own clients expect.
6. Missing keys / unknown fields are dropped with only a log warning, and per-op log lines are
   noisy -> the adapter checks itself; :func:`quiet_logs` and the actors' ``runtime_env`` mute
   TransferQueue's loggers.
7. A get reply carries one ZMQ frame per row per field (769 frames for a 256-sample batch of three
   fields), encoded and decoded row by row; that, not the bytes, is where a read's time goes ->
   :func:`read_columns` asks each storage unit (via Ray's documented ``__ray_call__``) to run the
   very ``storage_data.get_data`` call its ZMQ handler runs, stack the rows into one buffer per
   field there, and hand that back through the Ray object store. Read-only: writes keep going
   through TransferQueue's ZMQ protocol, so the unit's own threads never race a foreign writer.
   Stores whose units cannot be found by name (created by ``tq.init()``) use :func:`get_rows`.
8. Claims (task-mediated consumption) use TransferQueue's own bookkeeping: a ``fetch`` GET_META
   scans production/consumption, samples and marks consumed in one controller request, so
   concurrent claimers never share a row. But (a) with ``polling_mode=False`` (TQ's default) a
   fetch that finds too few rows sleeps 5 s *inside the controller's only request thread* and
   then errors, stalling every other client; (b) fetch needs ``batch_size`` ready rows, so it
   cannot take "what is there" at a deadline; (c) the sampler orders by global index, which TQ
   reuses across partitions after clears, not by production; (d) there is no request that marks
   chosen rows consumed. -> :func:`create_controller` starts the controller with
   ``polling_mode=True`` and :class:`ClaimSampler`, which takes up to ``nd_take`` keyed rows in
   key-insertion order once ``nd_min`` are ready, or marks exactly ``nd_mark_keys``
   (:func:`claim_rows`, :func:`mark_rows`). Stores made elsewhere (``tq.init()``) lack both:
   :func:`claims_unsupported` says why.
9. A fetch returns global indexes, not keys, and ``kv_retrieve_keys`` raises when a partition
   vanished meanwhile -> :func:`keys_of` maps indexes to keys, ``None`` for rows cleared since.
10. TransferQueue's own ``put`` marks rows produced before it writes their tags, so a claimer can
   see a row without its tags -> :func:`put_rows` only writes rows; the adapter calls
   :func:`mark_produced` after the tags are stored.
"""

from __future__ import annotations

import asyncio
import bisect
import functools
import logging
import operator
import os
import threading
import weakref
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from importlib import resources
from typing import Any

import numpy as np
import ray
import torch
from omegaconf import DictConfig, OmegaConf
from tensordict import TensorDict
from transfer_queue.client import AsyncTransferQueueClient, with_controller_socket
from transfer_queue.controller import TransferQueueController
from transfer_queue.metadata import BatchMeta, extract_field_schema
from transfer_queue.sampler import SequentialSampler
from transfer_queue.storage import SimpleStorageUnit, StorageKeyNotFoundError
from transfer_queue.storage.managers.simple_storage_manager import AsyncSimpleStorageManager
from transfer_queue.utils.zmq_utils import ZMQRequestType

from nemo_dataplane.adapters.chunks import assemble, decode, encode, rows_of
from nemo_dataplane.adapters.locate import where_of
from nemo_dataplane.dtypes import check_lengths, view_bytes
from nemo_dataplane.rows import take_rows

__all__ = [
    "LAYOUT_TAG",
    "BatchMeta",
    "ClaimSampler",
    "StorageKeyNotFoundError",
    "base_config",
    "claim_rows",
    "claims_unsupported",
    "create_controller",
    "create_storage_units",
    "get_rows",
    "keys_of",
    "make_client",
    "mark_produced",
    "mark_rows",
    "public_tags",
    "preserve_torch_threads",
    "put_rows",
    "quiet_logs",
    "read_columns",
    "unit_handles",
    "server_info",
    "set_tags",
    "storage_units_of",
]

BACKEND = "SimpleStorage"
# Reserved per-key tag recording how each field was put (quirk 4); never shown to callers.
LAYOUT_TAG = "__nd_layout__"


def public_tags(custom_meta: Mapping[str, Any]) -> dict[str, Any]:
    """A key's tags without the adapter's reserved :data:`LAYOUT_TAG`."""
    return {k: v for k, v in custom_meta.items() if k != LAYOUT_TAG}


# Environment for the actors we create: no per-op thread warnings (quirk 3 inside the storage
# unit, where TQ_NUM_THREADS=8 > cores triggers a warning per request) and, when quiet, no logs.
def actor_env(quiet: bool) -> dict[str, str]:
    env = {"TQ_NUM_THREADS": "1"}
    if quiet:
        env["TQ_LOGGING_LEVEL"] = "ERROR"
    return env


def quiet_logs(level: int = logging.ERROR) -> None:
    """Raise every ``transfer_queue.*`` logger in this process to ``level``.

    TransferQueue sets a level on each module logger at import time, so the parent logger's
    level alone would not reach them.
    """
    for name in list(logging.Logger.manager.loggerDict):
        if name == "transfer_queue" or name.startswith("transfer_queue."):
            logging.getLogger(name).setLevel(level)


@contextmanager
def preserve_torch_threads() -> Iterator[None]:
    """Restore ``torch.get_num_threads()`` of the calling thread on exit (quirk 3)."""
    before = torch.get_num_threads()
    try:
        yield
    finally:
        if torch.get_num_threads() != before:
            torch.set_num_threads(before)


# ------------------------------------------------------------------ bootstrap
def base_config(num_storage_units: int) -> DictConfig:
    """TransferQueue's default config with ``num_storage_units`` SimpleStorage units.

    The shape matches what ``tq.init()`` stores in the controller, so TransferQueue's own
    clients (``tq.init()`` in another process) can attach to a store we created.
    """
    conf = OmegaConf.create({}, flags={"allow_objects": True})
    conf = OmegaConf.merge(conf, OmegaConf.load(resources.files("transfer_queue") / "config.yaml"))
    conf.backend.storage_backend = BACKEND
    conf.backend[BACKEND].num_data_storage_units = int(num_storage_units)
    # What create_controller starts, recorded so attaching clients know claims work (quirk 8).
    conf.controller.sampler = CLAIM_SAMPLER
    conf.controller.polling_mode = True
    return conf


def create_controller(name: str, namespace: str, num_cpus: float, quiet: bool) -> Any:
    """Start the named controller actor with ``num_cpus`` (TQ hard-codes 1, quirk 1), in polling
    mode with :class:`ClaimSampler` (quirk 8)."""
    return TransferQueueController.options(  # type: ignore[attr-defined]
        name=name,
        namespace=namespace,
        num_cpus=num_cpus,
        runtime_env={"env_vars": actor_env(quiet)},
    ).remote(sampler=ClaimSampler(), polling_mode=True)


def create_storage_units(
    conf: DictConfig, name_prefix: str, namespace: str, num_cpus: float, quiet: bool,
    node_ids: Sequence[str] | None = None,
) -> dict[str, Any]:
    """Start ``conf``'s SimpleStorage units with fractional CPUs; returns ``{name: handle}``.

    With ``node_ids``, unit ``i`` is pinned to node ``node_ids[i % len(node_ids)]``.
    """
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    unit_conf = dict(OmegaConf.to_container(conf.backend[BACKEND], resolve=True))  # type: ignore[arg-type]
    unit_conf["_run_id"] = os.urandom(8).hex()
    handles: dict[str, Any] = {}
    for rank in range(int(unit_conf["num_data_storage_units"])):
        name = f"{name_prefix}.StorageUnit#{rank}"
        where = (
            {"scheduling_strategy": NodeAffinitySchedulingStrategy(node_ids[rank % len(node_ids)], soft=False)}
            if node_ids
            else {}
        )
        handles[name] = SimpleStorageUnit.options(  # type: ignore[attr-defined]
            name=name,
            namespace=namespace,
            num_cpus=num_cpus,
            runtime_env={"env_vars": actor_env(quiet)},
            **where,
        ).remote(config=unit_conf)
    return handles


def server_info(handle: Any, timeout_s: float) -> Any:
    """The actor's ZMQ endpoints; raises ``ray.exceptions.GetTimeoutError`` after ``timeout_s``."""
    return ray.get(handle.get_zmq_server_info.remote(), timeout=timeout_s)


def storage_units_of(conf: DictConfig) -> int:
    return int(conf.backend[BACKEND].num_data_storage_units)


def make_client(conf: DictConfig, client_id: str) -> AsyncTransferQueueClient:
    """A client of our own (quirk 2): not ``interface._TQ_CLIENT``, so no stale globals."""
    client = AsyncTransferQueueClient(client_id=client_id, controller_info=conf.controller.zmq_info)
    client.initialize_storage_manager(manager_type=BACKEND, config=conf.backend[BACKEND])
    return client


# ------------------------------------------------------------------ data path
# _storage_side_split and _unit_read run inside storage units and travel by reference (pickled
# as "nemo_dataplane.adapters.tq_compat.<name>", ~20 us), so the units' nodes must be able to
# import nemo_dataplane, as every worker node already must. Shipping them by value instead
# costs ~1 ms of cloudpickle per call.
def _storage_side_split(field_data: dict[str, Any], spec: dict[str, tuple[list[int], tuple[int, ...]]]) -> dict:
    """Runs inside a storage unit as a ``data_parser``: cut each packed jagged field into rows.

    ``field_data[name]`` arrives as one ``[rows, C]`` tensor holding the flat values (zero-padded
    to a multiple of ``rows``); ``spec[name]`` gives element offsets and the per-token shape.
    Row views share the received buffer, exactly like TransferQueue's own dense rows.
    """
    for name, (offsets, trailing) in spec.items():
        flat = field_data[name].reshape(-1)
        field_data[name] = [
            flat[offsets[i] : offsets[i + 1]].view(-1, *trailing) for i in range(len(offsets) - 1)
        ]
    return field_data




def _jagged_group(t: torch.Tensor, positions: list[int], n_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat values and int64 row lengths of the rows of jagged ``t`` at ``positions``."""
    values = t.values()
    offsets = t.offsets()
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
        schema[name] = _jagged_schema(t.dtype, t.offsets().diff(), tuple(t.values().shape[1:]))
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
    view per row. Otherwise TransferQueue's ZMQ protocol, equivalent to ``client.async_put`` minus
    its thread juggling (quirk 3) and per-row frames for jagged fields (quirk 5).

    The rows are not yet produced: pass the returned field schema (the one TransferQueue would
    record) to :func:`mark_produced` once the keys' tags are stored (quirk 10).
    """
    sm: AsyncSimpleStorageManager = client.storage_manager  # type: ignore[assignment]
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


# ----------------------------------------------------- object-store data path (quirk 11)
# A unit's rows are views of a Ray object the writer put (mapped from shared memory in the
# unit's process: the writer's one copy is the only one). TransferQueue's own clients read them
# through the unit as usual. Inside each unit process, _CHUNKS records the address range of
# every field buffer mapped this way, so our reads can tell from a row's address which object
# and row it is and map the object themselves instead of having the unit stack and re-send the
# rows; no per-row bookkeeping. A record is dropped when its buffer is freed, i.e. when the last
# row viewing it is gone (TransferQueue cleared or replaced them all).
UNIT_GET_TIMEOUT_S = 300.0  # a unit's wait for a writer's object (local, or one transfer)


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


def _register(ref: Any, values: torch.Tensor, offsets: torch.Tensor | None, buf: np.ndarray) -> None:
    item = values.element_size()
    per_row = item
    for d in values.shape[1:]:
        per_row *= d
    start = values.data_ptr()
    m = _Mapped(ref, start, start + values.numel() * item, per_row, per_row,
                None if offsets is None else offsets.numpy().astype(np.int64))
    with _CHUNKS_LOCK:
        bisect.insort(_CHUNKS, (start, m), key=operator.itemgetter(0))
    weakref.finalize(buf, _unregister, m)


def _unregister(m: _Mapped) -> None:
    with _CHUNKS_LOCK:
        for i, (_, other) in enumerate(_CHUNKS):
            if other is m:
                del _CHUNKS[i]
                break


def put_chunk(columns: Mapping[str, torch.Tensor]) -> Any:
    """``ray.put`` of ``columns`` as one chunk (see :mod:`.chunks`): the writer's only copy."""
    return ray.put({name: encode(t) for name, t in columns.items()})


def _unit_write(unit: Any, global_indexes: list[int], positions: list[int] | None, chunk: list[Any]) -> None:
    """Runs inside a SimpleStorageUnit (``__ray_call__``): map ``chunk[0]`` and store rows
    ``positions`` (all, in order, for ``None``) of every field as one view each.

    ``storage_data.put_data`` is what the unit's own PUT handler calls; it is a series of
    single dict stores, each atomic under the GIL, like the handler's own.
    """
    ref = chunk[0]
    data = ray.get(ref, timeout=UNIT_GET_TIMEOUT_S)
    field_rows: dict[str, list[torch.Tensor]] = {}
    for name, enc in data.items():
        values, offsets = decode(enc)
        if values.numel():
            _register(ref, values, offsets, enc[2])
        rows = rows_of((values, offsets))
        field_rows[name] = rows if positions is None else [rows[i] for i in positions]
    unit.storage_data.put_data(field_rows, global_indexes)


def unit_nodes(units: Mapping[str, Any], timeout_s: float) -> dict[str, str]:
    """Unit id -> the Ray node it runs on."""
    ids = list(units)
    nodes = ray.get([units[u].__ray_call__.remote(_node_of) for u in ids], timeout=timeout_s)
    return dict(zip(ids, nodes))


def _node_of(actor: Any) -> str:
    return ray.get_runtime_context().get_node_id()


async def _write_through_objects(
    units: Mapping[str, Any], routing: Mapping[str, Any], n: int, columns: Mapping[str, torch.Tensor], chunk: Any
) -> None:
    calls = []
    for su, group in routing.items():
        positions = group.batch_positions
        whole = len(positions) == n and positions == list(range(n))
        if chunk is not None:
            calls.append(units[su].__ray_call__.remote(_unit_write, group.global_indexes, None if whole else positions, [chunk]))
            continue
        # A unit elsewhere gets only its own rows (one gather here instead of a whole transfer).
        part = {name: _take_positions(t, positions) for name, t in columns.items()} if not whole else columns
        calls.append(units[su].__ray_call__.remote(_unit_write, group.global_indexes, None, [put_chunk(part)]))
    await asyncio.gather(*calls)


def _take_positions(t: torch.Tensor, positions: list[int]) -> torch.Tensor:
    if t.is_nested:
        return take_rows(t.values(), t.offsets(), positions, copy=False)
    return take_rows(t, None, positions, copy=False)


async def mark_produced(client: AsyncTransferQueueClient, meta: BatchMeta, schema: dict[str, dict[str, Any]]) -> None:
    """Tell the controller ``meta``'s rows now hold the fields of ``schema`` (from :func:`put_rows`)."""
    sm: AsyncSimpleStorageManager = client.storage_manager  # type: ignore[assignment]
    # Schema rows must follow meta.global_indexes order, which is the column order of the put.
    await sm.notify_data_update(meta.partition_ids[0], meta.global_indexes, schema)


@with_controller_socket
async def set_tags(
    client: AsyncTransferQueueClient,
    partition_id: str,
    global_indexes: Sequence[int],
    tags: Sequence[dict[str, Any]],
    socket: Any = None,
) -> None:
    """Store per-key tags (TransferQueue's ``custom_meta``), replacing each key's dict.

    The same SET_CUSTOM_META request ``client.async_set_custom_meta`` sends, minus its two
    deep copies of every key's tags and a ``BatchMeta`` rebuild per partition, which cost more
    than the request itself for a 1024-key batch.
    """
    await client._request_controller(
        socket=socket,
        request_type=ZMQRequestType.SET_CUSTOM_META,
        response_type=ZMQRequestType.SET_CUSTOM_META_RESPONSE,
        body={"partition_custom_meta": {partition_id: dict(zip(global_indexes, tags))}},
    )


async def get_rows(client: AsyncTransferQueueClient, meta: BatchMeta, fields: Sequence[str]) -> dict[str, list[torch.Tensor]]:
    """Per-row tensors of ``fields`` in ``meta.global_indexes`` order (quirk 4: no nested copy).

    Raises:
        StorageKeyNotFoundError: a key was cleared between lookup and read.
    """
    sm: AsyncSimpleStorageManager = client.storage_manager  # type: ignore[assignment]
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
        return Column(self.values.reshape(n * length, *self.values.shape[2:]), torch.full((n,), length, dtype=torch.int64))


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
        located = None if stack else _locate(rows)
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
        out[f] = ("stack", t.reshape(-1).view(torch.uint8).numpy(), str(t.dtype).replace("torch.", ""), tuple(t.shape), lengths)
    return out


def _locate(rows: Sequence[Any]) -> tuple[list[Any], np.ndarray, np.ndarray] | None:
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


async def read_columns(
    client: AsyncTransferQueueClient, units: Mapping[str, Any], meta: BatchMeta, fields: Sequence[str]
) -> dict[str, Column | torch.Tensor] | None:
    """Each field of ``meta``'s rows, in ``meta.global_indexes`` order.

    A field whose rows are all views we stored (quirk 11) comes back as the finished tensor, in
    the layout it was put with: this process maps the writers' objects and copies the rows out
    once. Any other field comes back as a :class:`Column` the units stacked (rows written by
    TransferQueue's own clients, or objects whose writer died: the unit still holds the rows).
    ``units`` maps storage-unit id (TransferQueue's routing key) to its actor handle. Returns
    ``None`` when some unit holds data it cannot stack (then use :func:`get_rows`).

    Raises:
        StorageKeyNotFoundError: a key was cleared between lookup and read.
    """
    sm: AsyncSimpleStorageManager = client.storage_manager  # type: ignore[assignment]
    groups = list(sm._group_by_hash(meta.global_indexes).items())
    if any(su not in units for su, _ in groups):
        return None
    replies = await _unit_reads(units, groups, list(fields), stack=False)
    if replies is None:
        return None
    out: dict[str, Column | torch.Tensor] = {}
    direct = [f for f in fields if all(r[f][0] == "chunks" for r in replies)]
    if direct:
        try:
            out.update(await _assemble_from_objects(direct, groups, replies, meta.size))
        except (ray.exceptions.OwnerDiedError, ray.exceptions.ObjectLostError):
            direct = []  # a writer died: its rows live on in the units, read them from there
    rest = [f for f in fields if f not in out]
    if rest:
        if direct or any(r[f][0] == "chunks" for r in replies for f in rest):
            replies = await _unit_reads(units, groups, rest, stack=True)
            if replies is None:
                return None
        out.update(_merge_stacked(rest, groups, replies))
    return out


async def _unit_reads(units: Mapping[str, Any], groups: list[Any], fields: list[str], stack: bool) -> list[Any] | None:
    refs = [units[su].__ray_call__.remote(_unit_read, g.global_indexes, fields, stack) for su, g in groups]
    try:
        replies = await asyncio.gather(*refs)
    except ray.exceptions.RayTaskError as e:
        if isinstance(e, KeyError) or isinstance(getattr(e, "cause", None), KeyError):
            raise StorageKeyNotFoundError(str(getattr(e, "cause", e))) from None
        raise
    return None if any(r is None for r in replies) else replies


async def _assemble_from_objects(
    fields: list[str], groups: list[Any], replies: list[Any], n: int
) -> dict[str, torch.Tensor]:
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
    objs = await asyncio.gather(*refs)
    return {
        f: assemble(f, where_of(*located[f]), lambda c, name: decode(objs[c][name]), copy=True) for f in fields
    }


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
                merged = Column(torch.cat([c.values for c in rag], 0), torch.cat([c.lengths for c in rag]))  # type: ignore[misc]
            except RuntimeError:
                raise ValueError(f"field {f!r}: rows cannot form one tensor") from None
        positions = torch.tensor([p for _, g in groups for p in g.batch_positions], dtype=torch.int64)
        out[f] = _permute(merged, torch.argsort(positions))
    return out


# ------------------------------------------------------------------ claims
CLAIM_SAMPLER = "nemo_dataplane.adapters.tq_compat.ClaimSampler"


class ClaimSampler(SequentialSampler):
    """Runs inside the controller (quirk 8); TransferQueue's own fetches get SequentialSampler's
    behaviour unchanged. Our requests pass, through ``sampling_config``:

    * ``nd_take`` / ``nd_min``: claim up to ``nd_take`` ready rows that have a key, oldest key
      first, if at least ``nd_min`` are ready, else none (keyless rows, written by TQ's non-KV
      API, are never claimed);
    * ``nd_mark_keys``: mark exactly those keys consumed (the ones not consumed yet).

    The controller marks whatever this returns as consumed by the task, within the same request.
    """

    def sample(
        self,
        ready_indexes: list[int],
        batch_size: int,
        *args: Any,
        partition: Any = None,
        nd_take: int | None = None,
        nd_min: int = 1,
        nd_mark_keys: Sequence[str] | None = None,
        **kwargs: Any,
    ) -> tuple[list[int], list[int]]:
        if partition is None or (nd_take is None and nd_mark_keys is None):
            return super().sample(ready_indexes, batch_size, *args, partition=partition, **kwargs)
        ready = set(ready_indexes)
        if nd_mark_keys is not None:
            mapping = partition.keys_mapping
            picked = [gi for gi in (mapping.get(k) for k in nd_mark_keys) if gi is not None and gi in ready]
            return picked, picked
        # keys_mapping is a dict: insertion order of keys, and a key cleared and put again is
        # re-inserted at the end, so this is production order regardless of index reuse.
        picked: list[int] = []
        for gi in partition.keys_mapping.values():
            if gi in ready:
                picked.append(gi)
                if len(picked) >= nd_take:
                    break
        if len(picked) < max(nd_min, 1):
            return [], []
        return picked, picked


def claims_unsupported(conf: DictConfig) -> str | None:
    """Why claims cannot run on the store described by ``conf`` (``None``: they can)."""
    ctrl = conf.get("controller", {}) or {}
    sampler, polling = ctrl.get("sampler"), ctrl.get("polling_mode")
    if sampler == CLAIM_SAMPLER and polling is True:
        return None
    return (
        f"this TransferQueue controller was not started by nemo_dataplane (sampler={sampler!r}, "
        f"polling_mode={polling!r}; e.g. by transfer_queue.init()); claims need polling_mode=True and "
        f"{CLAIM_SAMPLER}: create the store with TransferQueueClient(bootstrap=True or 'auto')"
    )


async def claim_rows(
    client: AsyncTransferQueueClient, partition_id: str, task: str, fields: list[str], take: int, min_rows: int
) -> BatchMeta:
    """Claim up to ``take`` produced, unclaimed rows for ``task`` if ``min_rows`` are ready: one
    fetch request, so the controller picks and marks them atomically. Empty when too few."""
    return await client.async_get_meta(
        data_fields=fields,
        batch_size=min_rows,  # the controller's own gate (polling mode: empty below it)
        partition_id=partition_id,
        mode="fetch",
        task_name=task,
        sampling_config={"nd_take": take, "nd_min": min_rows},
    )


async def mark_rows(client: AsyncTransferQueueClient, partition_id: str, task: str, keys: list[str]) -> int:
    """Mark ``keys`` consumed by ``task`` (absent or already consumed ones are skipped); returns
    how many were marked. No fields asked: every unconsumed row passes the controller's scan."""
    meta = await client.async_get_meta(
        data_fields=[],
        batch_size=1,
        partition_id=partition_id,
        mode="fetch",
        task_name=task,
        sampling_config={"nd_mark_keys": list(keys)},
    )
    return meta.size


@with_controller_socket
async def keys_of(
    client: AsyncTransferQueueClient, partition_id: str, global_indexes: list[int], socket: Any = None
) -> list[str | None]:
    """The key of each global index, ``None`` where the row was cleared meanwhile (quirk 9)."""
    response = await client._request_controller(
        socket=socket,
        request_type=ZMQRequestType.KV_RETRIEVE_KEYS,
        response_type=ZMQRequestType.KV_RETRIEVE_KEYS_RESPONSE,
        body={"global_indexes": list(global_indexes), "partition_id": partition_id},
    )
    keys = response.body.get("keys") or []
    return list(keys) if len(keys) == len(global_indexes) else [None] * len(global_indexes)


def unit_handles(conf: DictConfig, namespace: str) -> dict[str, Any]:
    """Storage-unit id -> actor handle for stores whose units are named actors in ``namespace``
    (ours are); empty when they cannot all be found (e.g. a store made by ``tq.init()``)."""
    out: dict[str, Any] = {}
    for name, info in dict(conf.backend[BACKEND].zmq_info).items():
        try:
            out[info.id] = ray.get_actor(name, namespace=namespace)
        except ValueError:
            return {}
    return out


def loop_thread(name: str) -> tuple[asyncio.AbstractEventLoop, threading.Thread]:
    """A private event loop running in a daemon thread (the sync API's home)."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name=name, daemon=True)
    thread.start()
    return loop, thread
