"""In-process reference backend: the executable specification of the client contract.

It keeps rows in Python dicts behind one lock. It is what unit tests run against and what
every other adapter is compared with by the conformance suite; it is not shared across
processes (use the TransferQueue adapter for that).
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from tensordict import TensorDict

from nemo_dataplane.client import (
    DataPlaneClient,
    Fields,
    check_keys,
    check_partition,
    check_select_fields,
    check_tags,
    resolve_get_target,
)
from nemo_dataplane.codec import is_jagged, join_rows, make_batch, normalize_fields, split_rows
from nemo_dataplane.meta import KVBatchMeta


@dataclass
class _Row:
    tags: dict[str, Any] = field(default_factory=dict)
    # field name -> (the sample's tensor, whether it was put as part of a jagged tensor)
    values: dict[str, tuple[torch.Tensor, bool]] = field(default_factory=dict)


class InMemoryClient(DataPlaneClient):
    """Dict-backed :class:`DataPlaneClient`; thread-safe; copies on the way in."""

    def __init__(self) -> None:
        self._partitions: dict[str, dict[str, _Row]] = {}
        self._lock = threading.Lock()
        self._closed = False

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("InMemoryClient is closed")

    def kv_batch_put(
        self,
        keys: Sequence[str],
        partition_id: str,
        fields: Fields | None,
        tags: Sequence[Mapping[str, Any]] | None = None,
    ) -> KVBatchMeta:
        self._check_open()
        keys = check_keys(keys)
        partition_id = check_partition(partition_id)
        tag_list = check_tags(tags, len(keys))
        columns = normalize_fields(fields, len(keys))
        if not columns and tag_list is None:
            raise ValueError("kv_batch_put needs fields or tags (got neither)")
        # Split and copy before taking the lock: a failed validation leaves the store untouched.
        per_field_rows = {
            name: ([r.clone() for r in split_rows(t.detach())], is_jagged(t)) for name, t in columns.items()
        }
        with self._lock:
            part = self._partitions.setdefault(partition_id, {})
            for i, key in enumerate(keys):
                row = part.setdefault(key, _Row())
                if tag_list is not None:
                    row.tags.update(tag_list[i])
                for name, (rows, jagged) in per_field_rows.items():
                    row.values[name] = (rows[i], jagged)
            out_rows = [part[k] for k in keys]
            return KVBatchMeta(
                keys=keys,
                tags=[r.tags for r in out_rows],
                partition_id=partition_id,
                fields=_common_fields(out_rows),
            )

    def kv_batch_get(
        self,
        meta_or_keys: KVBatchMeta | Sequence[str],
        select_fields: Sequence[str],
        partition_id: str | None = None,
    ) -> TensorDict:
        self._check_open()
        keys, partition_id = resolve_get_target(meta_or_keys, partition_id)
        names = check_select_fields(select_fields)
        with self._lock:
            part = self._partitions.get(partition_id, {})
            missing = [k for k in keys if k not in part]
            if missing:
                raise KeyError(
                    f"{len(missing)} key(s) not in partition {partition_id!r}: {missing[:10]}"
                )
            rows = [part[k] for k in keys]
            for name in names:
                lacking = [k for k, r in zip(keys, rows) if name not in r.values]
                if lacking:
                    raise KeyError(
                        f"field {name!r} is not stored for {len(lacking)} key(s) in partition "
                        f"{partition_id!r}, e.g. {lacking[:5]}"
                    )
            if not keys:
                return TensorDict({}, batch_size=[0])
            columns = {
                name: join_rows(
                    name,
                    [r.values[name][0] for r in rows],
                    any(r.values[name][1] for r in rows),
                )
                for name in names
            }
        return make_batch(columns, len(keys))

    def kv_clear(self, keys: Sequence[str] | None, partition_id: str) -> None:
        self._check_open()
        partition_id = check_partition(partition_id)
        with self._lock:
            if keys is None:
                self._partitions.pop(partition_id, None)
                return
            part = self._partitions.get(partition_id)
            if part is None:
                return
            for k in check_keys(keys, allow_empty=True):
                part.pop(k, None)
            if not part:
                del self._partitions[partition_id]

    def kv_list(self, partition_id: str) -> KVBatchMeta:
        self._check_open()
        partition_id = check_partition(partition_id)
        with self._lock:
            part = self._partitions.get(partition_id, {})
            rows = list(part.values())
            return KVBatchMeta(
                keys=list(part.keys()),
                tags=[r.tags for r in rows],
                partition_id=partition_id,
                fields=_common_fields(rows),
            )

    def partitions(self) -> list[str]:
        """Names of the partitions holding at least one key (for tests and debugging)."""
        with self._lock:
            return [p for p, rows in self._partitions.items() if rows]

    def close(self) -> None:
        with self._lock:
            self._partitions.clear()
            self._closed = True


def _common_fields(rows: Sequence[_Row]) -> list[str]:
    """Fields stored on every row, in the first row's order."""
    if not rows:
        return []
    common = [f for f in rows[0].values]
    for r in rows[1:]:
        common = [f for f in common if f in r.values]
    return common
