"""`fan_out_per_rank_metas`: turn one planned batch into one `KVBatchMeta` per DP rank.

Each rank's meta names that rank's keys (in the rank's local order) and carries its packing plan
in ``extra_info``, so the worker fetches exactly its share and re-attaches the driver's plan
instead of re-packing locally.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Coroutine
from typing import Any, TypeVar, cast

import torch
from tensordict import TensorDict

from nemo_dataplane.client import DataPlaneClient, add_error_note, check_partition
from nemo_dataplane.driver.planner import Preshards
from nemo_dataplane.meta import KVBatchMeta
from nemo_dataplane.rows import select_rows
from nemo_dataplane.timeouts import check_timeout

__all__ = ["async_fan_out_per_rank_metas", "fan_out_per_rank_metas", "rank_extra_info", "run_sync"]

T = TypeVar("T")


def rank_extra_info(preshards: Preshards, rank: int) -> dict[str, Any]:
    """The ``extra_info`` entries fan-out puts on rank ``rank``'s meta
    (:meth:`Preshards.rank_extra_info`)."""
    return preshards.rank_extra_info(rank)


async def async_fan_out_per_rank_metas(
    client: DataPlaneClient | None,
    preshards: Preshards,
    source: KVBatchMeta | TensorDict,
    *,
    partition_id: str,
    key_prefix: str,
    timeout_s: float = 300.0,
) -> list[KVBatchMeta]:
    """One ``KVBatchMeta`` per DP rank, rows in the rank's local order.

    * ``KVBatchMeta`` source: re-sliced, no I/O; keys, tags and ``fields`` are kept (``client``
      may be ``None``; ``key_prefix`` is unused). ``partition_id`` must match the source's.
    * ``TensorDict`` source: every tensor field (non-tensor entries are not stored) is written
      under keys ``f"{key_prefix}/{i}"`` (``i`` = row in the caller's order) with tags
      ``{"seq_len": ...}``, all ranks' puts in one ``asyncio.gather``. Puts upsert, so ``key_prefix``
      must be unique per fan-out (e.g.
      ``f"step{n}/train"``) for concurrent fan-outs not to collide. If any put fails or the
      ``timeout_s`` passes, every key this call wrote is cleared before the error propagates
      (a put still stuck in the store after the timeout cannot be cancelled and may land later;
      clearing the step's partition covers that).

    ``extra_info`` gains ``packing`` (:meth:`Preshards.rank_plan`), ``global_forward_pad_seqlen``,
    ``dp_rank`` and ``dp_world`` (a meta source's other ``extra_info`` entries are kept).

    Raises:
        ValueError: the source's row count differs from the plan's, or partitions disagree.
        TypeError: a source of another type.
    """
    partition_id = check_partition(partition_id)
    n = preshards.num_samples
    if isinstance(source, KVBatchMeta):
        if len(source) != n:
            raise ValueError(f"fan-out: the meta has {len(source)} keys but the plan covers {n} samples")
        if source.partition_id is not None and source.partition_id != partition_id:
            raise ValueError(
                f"fan-out: partition_id={partition_id!r} but the meta's keys live in {source.partition_id!r}; "
                "a meta source is re-sliced without I/O, so it cannot move partitions"
            )
        out: list[KVBatchMeta] = []
        for r in range(preshards.dp_world):
            part = source.subset(preshards.rank_indices[r])
            out.append(
                KVBatchMeta(
                    keys=part.keys,
                    tags=part.tags,
                    partition_id=partition_id,
                    fields=part.fields,
                    extra_info={**(part.extra_info or {}), **rank_extra_info(preshards, r)},
                )
            )
        return out
    if not isinstance(source, TensorDict):
        raise TypeError(f"fan-out source must be a KVBatchMeta or a TensorDict, got {type(source).__name__}")
    if client is None:
        raise ValueError("fan-out of a TensorDict writes to the store: pass a client")
    rows = source.batch_size[0] if source.batch_dims else 0
    if rows != n:
        raise ValueError(f"fan-out: the batch has {rows} rows but the plan covers {n} samples")
    if not isinstance(key_prefix, str) or not key_prefix:
        raise ValueError(f"fan-out: key_prefix must be a non-empty str, got {key_prefix!r}")
    timeout_s = check_timeout(timeout_s, "fan-out: timeout_s", allow_zero=False)  # every wait is bounded
    tensor_fields: dict[str, torch.Tensor] = {}
    for name, value in source.items():
        if isinstance(value, TensorDict):
            raise TypeError(f"fan-out: field {name!r} is a nested TensorDict; flatten it into named tensors")
        if isinstance(value, torch.Tensor):
            tensor_fields[name] = value
    if not tensor_fields:
        raise ValueError("fan-out: the batch has no tensor fields to write")
    batch = TensorDict(tensor_fields, batch_size=[n])

    all_keys = [f"{key_prefix}/{i}" for i in range(n)]
    seq_lens = preshards.seq_lens or (None,) * n

    async def put_rank(r: int) -> KVBatchMeta:
        idx = preshards.rank_indices[r]
        shard = select_rows(batch, idx)
        tags = [{"seq_len": seq_lens[i]} if seq_lens[i] is not None else {} for i in idx]
        meta = await client.async_kv_batch_put([all_keys[i] for i in idx], partition_id, shard, tags)
        return meta.with_extra_info(**rank_extra_info(preshards, r))

    gathered = asyncio.gather(*(put_rank(r) for r in range(preshards.dp_world)), return_exceptions=True)
    try:
        results = await asyncio.wait_for(gathered, timeout_s)
    except asyncio.TimeoutError:
        error: BaseException = TimeoutError(
            f"fan-out of {n} samples to {preshards.dp_world} ranks under {key_prefix!r} did not finish in {timeout_s}s"
        )
        await _cleanup(client, all_keys, partition_id, error)
        raise error from None
    errors = [e for e in results if isinstance(e, BaseException)]
    if errors:
        await _cleanup(client, all_keys, partition_id, errors[0])
        raise errors[0]
    return cast("list[KVBatchMeta]", list(results))  # no errors: every result is a meta


async def _cleanup(client: DataPlaneClient, keys: list[str], partition_id: str, error: BaseException) -> None:
    """Clear ``keys`` (bounded by 60 s). A failed clear must not mask ``error``, the fan-out's own
    failure: it is recorded as a note on ``error``, naming the partition and key prefix."""
    try:
        await asyncio.wait_for(client.async_kv_clear(keys, partition_id), 60)
    except Exception as e:  # noqa: BLE001
        note = (
            f"clearing the {len(keys)} fan-out keys (e.g. {keys[:1]}) of partition {partition_id!r} "
            f"also failed: {type(e).__name__}: {e}"
        )
        add_error_note(error, note)


def fan_out_per_rank_metas(
    client: DataPlaneClient | None,
    preshards: Preshards,
    source: KVBatchMeta | TensorDict,
    *,
    partition_id: str,
    key_prefix: str,
    timeout_s: float = 300.0,
) -> list[KVBatchMeta]:
    """Sync twin of :func:`async_fan_out_per_rank_metas` (runs it on an event loop)."""
    return run_sync(
        async_fan_out_per_rank_metas(
            client, preshards, source, partition_id=partition_id, key_prefix=key_prefix, timeout_s=timeout_s
        )
    )


def run_sync(coro: Coroutine[Any, Any, T]) -> T:
    """Run ``coro`` to completion from sync code, also when this thread already runs a loop
    (e.g. inside an async Ray actor), where ``asyncio.run`` would refuse."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(asyncio.run, coro).result()
