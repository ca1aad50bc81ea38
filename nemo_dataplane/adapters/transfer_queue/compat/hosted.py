"""Each op in one request when the controller holds the store's only storage unit (quirk 14).

TransferQueue's own put is four controller/unit round trips (look the keys up, write the rows,
store the tags, mark them produced) and its get two (look up, read), each a ZMQ request decoded
and answered by per-key Python on the controller's request thread; on a small batch those
round trips, not the bytes, are the op. When the controller's process also holds the store's
one unit (``unit_in_controller``), the functions here run the very controller and unit methods
those requests run (``kv_retrieve_meta``, ``storage_data.put_data``, ``set_custom_meta``,
``update_production_status``, ...) inside that process, through one Ray actor call
(the controller's ``nd_put``/``nd_locate``/``nd_clear``), so an op costs one round trip.

They run on the actor's own thread while the controller's ZMQ thread keeps serving every other
client (TransferQueue's own, claims), so both hold the controller's ``nd_lock``
(:class:`~.bootstrap._Controller` takes it around every ZMQ request): each op is atomic against
every other, which the four-request put never was.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

import ray
import torch

from nemo_dataplane.adapters.transfer_queue.compat.common import LAYOUT_TAG
from nemo_dataplane.adapters.transfer_queue.compat.reads import _unit_read
from nemo_dataplane.adapters.transfer_queue.compat.writes import UNIT_GET_TIMEOUT_S, _unit_write, by_index


def merged_tags(
    custom_meta: Sequence[Mapping[str, Any]],
    tag_list: Sequence[Mapping[str, Any]] | None,
    layout: Mapping[str, str],
) -> list[dict[str, Any]]:
    """Each key's stored tags after a put: its old ones, updated by ``tag_list[i]``, with the
    put's fields merged into its :data:`LAYOUT_TAG` entry."""
    out = []
    shared = dict(layout)  # one layout entry for every key that had none (never changed in place)
    for i, cm in enumerate(custom_meta):
        merged = dict(cm)
        if tag_list is not None:
            merged.update(tag_list[i])
        if layout:
            before = cm.get(LAYOUT_TAG)
            merged[LAYOUT_TAG] = {**before, **layout} if before else shared
        out.append(merged)
    return out


@dataclass(frozen=True)
class PutDone:
    """What a one-request put tells its caller."""

    tags: list[dict[str, Any]]  # every key's stored tags, layout entry included
    fields_before: list[str]  # the fields all the keys held before this put


@dataclass(frozen=True)
class Located:
    """A one-request read: where the keys' rows are, or why it cannot be served."""

    global_indexes: list[int]
    tags: list[dict[str, Any]]
    fields: list[str]  # fields every key holds
    missing: list[str]  # keys not in the partition (then nothing else is filled in)
    reply: dict[str, Any] | None  # the unit's ``_unit_read`` answer; None: not stackable

    @property
    def size(self) -> int:
        return len(self.global_indexes)


def put(
    controller: Any,
    partition_id: str,
    keys: list[str],
    tag_list: list[dict[str, Any]] | None,
    layout: dict[str, str],
    schema: dict[str, dict[str, Any]],
    chunk: list[Any],
) -> PutDone:
    """Runs inside the controller (``nd_put``): create or find ``keys``, store the rows of
    ``chunk`` (see :func:`~.writes._unit_write`; empty: tags only), their tags and their
    production, in that order (quirk 10) and atomically. Keys this put created are removed
    again if any step fails."""
    if chunk and isinstance(chunk[0], ray.ObjectRef):
        # Bring the rows to this node before taking the lock, which every client waits on.
        ray.wait([chunk[0]], fetch_local=True, timeout=UNIT_GET_TIMEOUT_S)
    with controller.nd_lock:
        part, gis = _slots(controller, partition_id, keys)
        if part is None or None in gis:
            # TransferQueue's own allocation, for the new keys only.
            new = [k for k, gi in zip(keys, gis) if gi is None]
            controller.kv_retrieve_meta(keys=new, partition_id=partition_id, create=True)
            part, gis = _slots(controller, partition_id, keys)
            if part is None or None in gis:
                raise RuntimeError(f"TransferQueue made no slot for some of {len(keys)} keys")
        ids = cast("list[int]", gis)
        old = [part.custom_meta.get(gi, {}) for gi in ids]
        fields_before = _held_by_all(part, ids)
        tags = merged_tags(old, tag_list, layout)
        # Keys with no tags yet were created here (every put of ours leaves a tag).
        fresh = [gi for gi, cm in zip(ids, old) if not cm]
        try:
            if chunk:
                _unit_write(controller.nd_unit, ids, None, chunk)
            controller.set_custom_meta({partition_id: dict(zip(ids, tags))})
            if schema and not controller.update_production_status(partition_id, ids, by_index(schema, ids)):
                raise RuntimeError(f"TransferQueue could not record production in partition {partition_id!r}")
        except BaseException:
            if fresh:
                _drop(controller, partition_id, fresh)
            raise
        return PutDone(tags, fields_before)


def locate_rows(controller: Any, partition_id: str, keys: list[str], fields: list[str]) -> Located:
    """Runs inside the controller: the keys' slots, tags and stored fields, and where the
    unit holds ``fields`` of their rows (only when every key exists and holds every field)."""
    with controller.nd_lock:
        part, gis = _slots(controller, partition_id, keys)
        if part is None or None in gis:
            return Located([], [], [], [k for k, gi in zip(keys, gis) if gi is None], None)
        ids = cast("list[int]", gis)
        stored = _held_by_all(part, ids)
        reply = _unit_read(controller.nd_unit, ids, fields) if set(fields) <= set(stored) else None
        return Located(ids, [part.custom_meta.get(gi, {}) for gi in ids], stored, [], reply)


def clear(controller: Any, partition_id: str, keys: list[str] | None) -> None:
    """Runs inside the controller: remove ``keys`` (``None``: the whole partition) and their rows."""
    with controller.nd_lock:
        if keys is None:
            if controller._get_partition(partition_id) is None:
                return
            gis = list(controller.index_manager.get_indexes_for_partition(partition_id))
            controller.mark_clearing(gis, [partition_id] * len(gis))
            controller.nd_unit.storage_data.clear(gis)
            controller.clear_partition(partition_id)
            return
        _, gis = _slots(controller, partition_id, keys)
        present = [gi for gi in gis if gi is not None]
        if present:
            _drop(controller, partition_id, present)


def _slots(controller: Any, partition_id: str, keys: list[str]) -> tuple[Any, list[int | None]]:
    """The partition (``None``: none) and each key's global index (``None``: not there): the
    lookup TransferQueue's ``kv_retrieve_meta`` starts with, without the ``BatchMeta`` it then
    builds (per-key Python that cost more than the rest of a get)."""
    part = controller._get_partition(partition_id)
    return part, ([None] * len(keys) if part is None else part.kv_retrieve_indexes(keys))


def _held_by_all(part: Any, gis: list[int]) -> list[str]:
    """The fields every row of ``gis`` is produced for, in the partition's field order (what
    ``kv_retrieve_meta`` reports as the rows' fields)."""
    status = part.production_status
    if not gis or status is None:
        return []
    complete = status[torch.as_tensor(gis, dtype=torch.long)].sum(dim=0) == len(gis)
    return [name for name, col in part.field_name_mapping.items() if col < complete.numel() and bool(complete[col])]


def _drop(controller: Any, partition_id: str, gis: list[int]) -> None:
    """What TransferQueue's ``clear_samples`` does, in its order: hide, free the rows, forget."""
    pids = [partition_id] * len(gis)
    controller.mark_clearing(gis, pids)
    controller.nd_unit.storage_data.clear(gis)
    controller.clear_meta(gis, pids)
