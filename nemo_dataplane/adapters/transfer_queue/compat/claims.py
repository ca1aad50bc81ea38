"""Claims on TransferQueue's own bookkeeping (quirks 8-10): the sampler that runs inside the
controller, the claim that waits inside it, and the requests that drive them. The adapter half
is :mod:`..claims`."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from omegaconf import DictConfig
from transfer_queue.client import AsyncTransferQueueClient
from transfer_queue.metadata import BatchMeta
from transfer_queue.sampler import SequentialSampler

from nemo_dataplane.adapters.transfer_queue.compat.common import public_tags

# The marker base_config records in the controller's config (and claims_unsupported checks); the
# package re-exports the class under this name.
CLAIM_SAMPLER = "nemo_dataplane.adapters.transfer_queue.compat.ClaimSampler"
# The controller's Ray concurrency group where claims wait (:func:`ask_claim`): up to
# WAIT_THREADS claims wait at once; more queue behind them (each still bounded by its caller).
WAIT_GROUP = "nd_claims"
WAIT_THREADS = 32


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


def ask_claim(
    controller: Any,
    partition_id: str,
    task: str,
    fields: list[str],
    take: int,
    until: float,
    give_up: float,
    claim_id: str,
) -> Any:
    """Ask ``controller`` (the actor handle) for a claim: a ref to :func:`wait_claim`'s answer.

    ``until``: the claim's deadline, ``give_up``: when its caller stops waiting for the answer
    (both epochs, as ``time.time()``); ``claim_id``: what :func:`cancel_claim` names it by. It
    runs on one of the controller's :data:`WAIT_THREADS` claim threads, never on the thread its
    other Ray calls (:mod:`.hosted`'s ops) run on.
    """
    return controller.__ray_call__.options(concurrency_group=WAIT_GROUP).remote(
        wait_claim, partition_id, task, list(fields), take, until, give_up, claim_id
    )


def cancel_claim(controller: Any, claim_id: str, give_up: float) -> Any:
    """Tell ``controller`` that nobody waits for claim ``claim_id`` any more (its caller was
    cancelled): if it is still waiting, or has not started, it returns without claiming. A ref
    (fire and forget). A claim that has already picked its rows keeps them."""
    return controller.__ray_call__.remote(_cancel, claim_id, give_up)


def _cancel(controller: Any, claim_id: str, give_up: float) -> None:
    with controller.nd_produced:
        now = time.time()
        # Kept until the claim's own give_up (a claim that never starts is refused by then).
        for old in [c for c, until in controller.nd_cancelled.items() if until < now]:
            del controller.nd_cancelled[old]
        controller.nd_cancelled[claim_id] = give_up
        controller.nd_produced.notify_all()


def wait_claim(
    controller: Any,
    partition_id: str,
    task: str,
    fields: list[str],
    take: int,
    until: float,
    give_up: float,
    claim_id: str,
) -> tuple[list[str], list[dict[str, Any]]]:
    """Runs inside the controller (:func:`ask_claim`): the keys and public tags of up to ``take``
    produced rows of ``fields`` that ``task`` has not consumed, claimed (marked consumed) as soon
    as ``take`` are there, else at ``until`` whatever is there (none: empty lists).

    No polling: between scans it sleeps on the controller's ``nd_produced`` condition, which the
    controller notifies whenever production or consumption changes (:class:`~.bootstrap._Controller`).
    Each scan, pick and key lookup is one step under ``nd_lock``, the lock every ZMQ request
    and every op of :mod:`.hosted` holds, so concurrent claimers never share a row and a claimed
    row cannot be cleared before its key is read (quirk 9). A call that starts after
    ``give_up`` (it queued behind other waiting claims until its caller stopped waiting), or
    whose caller cancelled it (:func:`cancel_claim`), claims nothing: nobody would receive the rows.
    """
    if time.time() >= give_up:
        return [], []
    deadline = time.monotonic() + max(0.0, until - time.time())
    cond = controller.nd_produced
    with cond:
        controller.nd_claims["waiting"] += 1
        try:
            while True:
                if controller.nd_cancelled.pop(claim_id, None) is not None:
                    return [], []
                final = time.monotonic() >= deadline
                # Before the deadline only a full batch is taken; at it, whatever is ready.
                need = 1 if final else take
                controller.nd_claims["scans"] += 1
                meta = controller.get_metadata(
                    data_fields=fields,
                    partition_id=partition_id,
                    mode="fetch",
                    task_name=task,
                    batch_size=need,  # the controller's own gate (polling mode: empty below it)
                    sampling_config={"nd_take": take, "nd_min": need},
                )
                if meta.size or final:
                    break
                cond.wait(max(deadline - time.monotonic(), 0.0))
        finally:
            controller.nd_claims["waiting"] -= 1
        if not meta.size:
            return [], []
        # ClaimSampler picks keyed rows only, and nothing changed since: every key is there.
        keys = controller._get_partition(partition_id).kv_retrieve_keys(meta.global_indexes)
        return list(keys), [public_tags(cm) for cm in meta.custom_meta]


def ask_claim_stats(controller: Any) -> Any:
    """Ask ``controller`` how many claims wait in it now and how many scans claims made so far
    (a ref to ``{"waiting": n, "scans": n}``)."""
    return controller.__ray_call__.options(concurrency_group=WAIT_GROUP).remote(_claim_stats)


def _claim_stats(controller: Any) -> dict[str, int]:
    with controller.nd_lock:
        return dict(controller.nd_claims)


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
