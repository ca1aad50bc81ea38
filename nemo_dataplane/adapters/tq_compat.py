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
"""

from __future__ import annotations

import asyncio
import builtins
import functools
import logging
import operator
import os
import threading
import types
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from importlib import resources
from typing import Any

import ray
import torch
from omegaconf import DictConfig, OmegaConf
from tensordict import TensorDict
from transfer_queue.client import AsyncTransferQueueClient
from transfer_queue.controller import TransferQueueController
from transfer_queue.metadata import BatchMeta, extract_field_schema
from transfer_queue.sampler import SequentialSampler
from transfer_queue.storage import SimpleStorageUnit, StorageKeyNotFoundError
from transfer_queue.storage.managers.simple_storage_manager import AsyncSimpleStorageManager

__all__ = [
    "BatchMeta",
    "StorageKeyNotFoundError",
    "base_config",
    "create_controller",
    "create_storage_units",
    "get_rows",
    "make_client",
    "preserve_torch_threads",
    "put_rows",
    "quiet_logs",
    "server_info",
    "storage_units_of",
]

BACKEND = "SimpleStorage"

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
    return conf


def create_controller(name: str, namespace: str, num_cpus: float, quiet: bool) -> Any:
    """Start the named controller actor with ``num_cpus`` (TQ hard-codes 1, quirk 1)."""
    return TransferQueueController.options(  # type: ignore[attr-defined]
        name=name,
        namespace=namespace,
        num_cpus=num_cpus,
        runtime_env={"env_vars": actor_env(quiet)},
    ).remote(sampler=SequentialSampler(), polling_mode=False)


def create_storage_units(
    conf: DictConfig, name_prefix: str, namespace: str, num_cpus: float, quiet: bool
) -> dict[str, Any]:
    """Start ``conf``'s SimpleStorage units with fractional CPUs; returns ``{name: handle}``."""
    unit_conf = dict(OmegaConf.to_container(conf.backend[BACKEND], resolve=True))  # type: ignore[arg-type]
    unit_conf["_run_id"] = os.urandom(8).hex()
    handles: dict[str, Any] = {}
    for rank in range(int(unit_conf["num_data_storage_units"])):
        name = f"{name_prefix}.StorageUnit#{rank}"
        handles[name] = SimpleStorageUnit.options(  # type: ignore[attr-defined]
            name=name,
            namespace=namespace,
            num_cpus=num_cpus,
            runtime_env={"env_vars": actor_env(quiet)},
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


def _by_value(fn: types.FunctionType) -> types.FunctionType:
    """A copy of ``fn`` that cloudpickle ships by value (storage units need not import us)."""
    clone = types.FunctionType(fn.__code__, {"__builtins__": builtins}, fn.__name__, fn.__defaults__)
    clone.__module__ = "__main__"
    clone.__qualname__ = fn.__name__
    return clone


_SPLIT_BY_VALUE = _by_value(_storage_side_split)  # type: ignore[arg-type]


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


async def put_rows(
    client: AsyncTransferQueueClient,
    meta: BatchMeta,
    columns: Mapping[str, torch.Tensor],
    jagged: set[str],
) -> None:
    """Write ``columns`` (row ``i`` -> ``meta.global_indexes[i]``) and mark them produced.

    Equivalent to ``client.async_put`` minus its thread juggling (quirk 3) and per-row frames for
    jagged fields (quirk 5); the controller gets the same field schema TransferQueue would record.
    """
    sm: AsyncSimpleStorageManager = client.storage_manager  # type: ignore[assignment]
    n = meta.size
    routing = sm._group_by_hash(meta.global_indexes)
    dense = {k: v for k, v in columns.items() if k not in jagged}
    schema: dict[str, dict[str, Any]] = {}
    if dense:
        schema.update(extract_field_schema(TensorDict(dense, batch_size=[n])))
    tasks = []
    for su_id, group in routing.items():
        pos = group.batch_positions
        data: dict[str, Any] = {k: sm._select_by_positions(v, pos) for k, v in dense.items()}
        spec: dict[str, tuple[list[int], tuple[int, ...]]] = {}
        for name in jagged:
            values, lengths = _jagged_group(columns[name], pos, n)
            data[name], offsets, trailing = _pack_jagged(values, lengths)
            spec[name] = (offsets, trailing)
        parser = functools.partial(_SPLIT_BY_VALUE, spec=spec) if spec else None
        tasks.append(
            sm._put_to_single_storage_unit(group.global_indexes, data, target_storage_unit=su_id, data_parser=parser)
        )
    await asyncio.gather(*tasks)
    for name in jagged:
        t = columns[name]
        schema[name] = _jagged_schema(t.dtype, t.offsets().diff(), tuple(t.values().shape[1:]))
    # Schema rows must follow meta.global_indexes order, which is the column order here.
    await sm.notify_data_update(meta.partition_ids[0], meta.global_indexes, schema)


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


def loop_thread(name: str) -> tuple[asyncio.AbstractEventLoop, threading.Thread]:
    """A private event loop running in a daemon thread (the sync API's home)."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name=name, daemon=True)
    thread.start()
    return loop, thread
