"""Claims on TransferQueue's own bookkeeping (quirks 8-10): the sampler that runs inside the
controller, and the requests that drive it. The adapter half is :mod:`..claims`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from omegaconf import DictConfig
from transfer_queue.client import AsyncTransferQueueClient, with_controller_socket
from transfer_queue.metadata import BatchMeta
from transfer_queue.sampler import SequentialSampler
from transfer_queue.utils.zmq_utils import ZMQRequestType

# The marker base_config records in the controller's config (and claims_unsupported checks); the
# package re-exports the class under this name.
CLAIM_SAMPLER = "nemo_dataplane.adapters.transfer_queue.compat.ClaimSampler"


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
            marked: list[int] = [gi for gi in (mapping.get(k) for k in nd_mark_keys) if gi is not None and gi in ready]
            return marked, marked
        # keys_mapping is a dict: insertion order of keys, and a key cleared and put again is
        # re-inserted at the end, so this is production order regardless of index reuse.
        assert nd_take is not None  # the first check: nd_take or nd_mark_keys is set, and not nd_mark_keys
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
    meta: BatchMeta = await client.async_get_meta(
        data_fields=fields,
        batch_size=min_rows,  # the controller's own gate (polling mode: empty below it)
        partition_id=partition_id,
        mode="fetch",
        task_name=task,
        sampling_config={"nd_take": take, "nd_min": min_rows},
    )
    return meta


async def mark_rows(client: AsyncTransferQueueClient, partition_id: str, task: str, keys: list[str]) -> int:
    """Mark ``keys`` consumed by ``task`` (absent or already consumed ones are skipped); returns
    how many were marked. No fields asked: every unconsumed row passes the controller's scan."""
    meta: BatchMeta = await client.async_get_meta(
        data_fields=[],
        batch_size=1,
        partition_id=partition_id,
        mode="fetch",
        task_name=task,
        sampling_config={"nd_mark_keys": list(keys)},
    )
    return meta.size


@with_controller_socket  # type: ignore[untyped-decorator]  # transfer_queue's decorator is unannotated
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
