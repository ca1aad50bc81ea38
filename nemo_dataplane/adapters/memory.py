"""In-process reference backend: the executable specification of the client contract.

It keeps rows in Python dicts behind one lock. It is what unit tests run against and what
every other adapter is compared with by the conformance suite; it is not shared across
processes (use the TransferQueue adapter for that).

Claims: per ``(partition, task)`` a set of claimed keys, under the same lock. A waiting
``kv_claim`` sleeps on a condition of that lock that every put notifies. Clearing a key drops it
from every claimed set (so a key cleared and put again is a new, claimable row); upserting a
claimed key leaves it claimed.

Capacity: like every backend, keys are bounded by ``data_plane.max_rows`` (the factory's
``CapacityGuard``). ``max_bytes`` (``data_plane.backend_kwargs``) additionally bounds the bytes
of the tensors held, every partition together, counted exactly at each put and clear: a put that
would leave more raises :class:`~nemo_dataplane.client.StoreFullError` and writes nothing.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from tensordict import TensorDict

from nemo_dataplane.client import (
    ClaimStatus,
    DataPlaneClient,
    DataPlaneError,
    Fields,
    StoreFullError,
    check_claim_args,
    check_keys,
    check_partition,
    check_put_args,
    check_select_fields,
    check_task,
    resolve_get_target,
)
from nemo_dataplane.codec import is_jagged, join_rows, make_batch, split_rows
from nemo_dataplane.meta import KVBatchMeta


@dataclass
class _Row:
    tags: dict[str, Any] = field(default_factory=dict)
    # field name -> (the sample's tensor, whether it was put as part of a jagged tensor)
    values: dict[str, tuple[torch.Tensor, bool]] = field(default_factory=dict)


def _nbytes(row: _Row) -> int:
    return sum(_tensor_bytes(t) for t, _ in row.values.values())


def _tensor_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class InMemoryClient(DataPlaneClient):
    """Dict-backed :class:`DataPlaneClient`; thread-safe; copies on the way in.

    Args:
        max_bytes: bound on the bytes of stored tensors, all partitions together (tags are not
            counted); ``None``: unbounded. Replacing a field counts its new size minus its old.

    Raises:
        ValueError: ``max_bytes`` is not an int >= 1 or ``None``.
    """

    def __init__(self, max_bytes: int | None = None) -> None:
        if max_bytes is not None and (isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 1):
            raise ValueError(f"InMemoryClient: max_bytes must be an int >= 1 (or None: unbounded), got {max_bytes!r}")
        self.max_bytes = max_bytes
        self._bytes = 0  # bytes of every stored tensor; changed only under the lock
        self._partitions: dict[str, dict[str, _Row]] = {}
        # partition -> task -> keys claimed (or marked consumed), only keys still stored
        self._claims: dict[str, dict[str, set[str]]] = {}
        self._lock = threading.Lock()
        self._stored = threading.Condition(self._lock)  # notified by every put and by close
        self._closed = False

    def _check_open(self) -> None:
        if self._closed:
            raise DataPlaneError("InMemoryClient is closed")

    def kv_batch_put(
        self,
        keys: Sequence[str],
        partition_id: str,
        fields: Fields | None,
        tags: Sequence[Mapping[str, Any]] | None = None,
    ) -> KVBatchMeta:
        self._check_open()
        keys, partition_id, columns, tag_list = check_put_args(keys, partition_id, fields, tags)
        # Split and copy before taking the lock: a failed validation leaves the store untouched.
        per_field_rows = {
            name: ([r.clone() for r in split_rows(t.detach())], is_jagged(t)) for name, t in columns.items()
        }
        with self._lock:
            grow = self._growth(partition_id, keys, per_field_rows)
            if self.max_bytes is not None and grow > 0 and self._bytes + grow > self.max_bytes:
                raise StoreFullError(
                    f"store full: InMemoryClient max_bytes={self.max_bytes} reached ({self._bytes} bytes held, a "
                    f"put of {len(keys)} keys to partition {partition_id!r} would make {self._bytes + grow}); "
                    "nothing was written"
                )
            self._bytes += grow
            part = self._partitions.setdefault(partition_id, {})
            for i, key in enumerate(keys):
                row = part.setdefault(key, _Row())
                if tag_list is not None:
                    row.tags.update(tag_list[i])
                for name, (rows, jagged) in per_field_rows.items():
                    row.values[name] = (rows[i], jagged)
            self._stored.notify_all()
            out_rows = [part[k] for k in keys]
            return KVBatchMeta(
                keys=tuple(keys),
                tags=tuple([r.tags for r in out_rows]),
                partition_id=partition_id,
                fields=tuple(_common_fields(out_rows)),
            )

    def _growth(
        self, partition_id: str, keys: Sequence[str], per_field_rows: Mapping[str, tuple[list[torch.Tensor], bool]]
    ) -> int:
        """Bytes a put adds: its tensors minus those of the fields it replaces (caller holds the lock)."""
        part = self._partitions.get(partition_id, {})
        grow = 0
        for i, key in enumerate(keys):
            old = part.get(key)
            for name, (rows, _) in per_field_rows.items():
                grow += _tensor_bytes(rows[i])
                if old is not None and name in old.values:
                    grow -= _tensor_bytes(old.values[name][0])
        return grow

    def bytes_stored(self) -> int:
        """Bytes of every tensor held, all partitions together (what ``max_bytes`` bounds)."""
        with self._lock:
            return self._bytes

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
                raise KeyError(f"{len(missing)} key(s) not in partition {partition_id!r}: {missing[:10]}")
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
        key_list = None if keys is None else check_keys(keys, allow_empty=True)
        with self._lock:
            if key_list is None:
                dropped = self._partitions.pop(partition_id, {})
                self._bytes -= sum(_nbytes(r) for r in dropped.values())
                self._claims.pop(partition_id, None)
                return
            part = self._partitions.get(partition_id)
            if part is None:
                return
            for k in key_list:
                row = part.pop(k, None)
                if row is not None:
                    self._bytes -= _nbytes(row)
            for claimed in self._claims.get(partition_id, {}).values():
                claimed.difference_update(key_list)
            if not part:
                del self._partitions[partition_id]
                self._claims.pop(partition_id, None)

    def kv_list(self, partition_id: str) -> KVBatchMeta:
        self._check_open()
        partition_id = check_partition(partition_id)
        with self._lock:
            part = self._partitions.get(partition_id, {})
            rows = list(part.values())
            return KVBatchMeta(
                keys=tuple(part.keys()),
                tags=tuple([r.tags for r in rows]),
                partition_id=partition_id,
                fields=tuple(_common_fields(rows)),
            )

    def kv_partitions(self) -> list[str]:
        self._check_open()
        with self._lock:
            return [p for p, rows in self._partitions.items() if rows]

    # ------------------------------------------------------------ claims
    def _claimable(self, partition_id: str, task: str, names: list[str], limit: int) -> list[str]:
        """Up to ``limit`` keys, oldest first, with every field in ``names`` and not claimed by
        ``task`` (caller holds the lock)."""
        claimed = self._claims.get(partition_id, {}).get(task, set())
        out: list[str] = []
        for key, row in self._partitions.get(partition_id, {}).items():
            if key not in claimed and all(n in row.values for n in names):
                out.append(key)
                if len(out) == limit:
                    break
        return out

    def kv_claim(
        self,
        partition_id: str,
        task: str,
        fields: Sequence[str],
        batch_size: int,
        timeout_s: float,
    ) -> KVBatchMeta:
        self._check_open()
        task, names, batch_size, timeout_s = check_claim_args(task, fields, batch_size, timeout_s)
        partition_id = check_partition(partition_id)
        deadline = time.monotonic() + timeout_s
        with self._stored:
            while True:
                self._check_open()
                ready = self._claimable(partition_id, task, names, batch_size)
                left = deadline - time.monotonic()
                if len(ready) >= batch_size or left <= 0:
                    break
                self._stored.wait(left)
            if not ready:
                return KVBatchMeta(keys=(), tags=(), partition_id=partition_id, fields=tuple(names))
            self._claims.setdefault(partition_id, {}).setdefault(task, set()).update(ready)
            rows = [self._partitions[partition_id][k] for k in ready]
            return KVBatchMeta(
                keys=tuple(ready),
                tags=tuple([r.tags for r in rows]),
                partition_id=partition_id,
                fields=tuple(_common_fields(rows)),
            )

    def kv_mark_consumed(self, keys: Sequence[str], partition_id: str, task: str) -> None:
        self._check_open()
        key_list = check_keys(keys, allow_empty=True)
        partition_id = check_partition(partition_id)
        task = check_task(task)
        with self._lock:
            part = self._partitions.get(partition_id)
            present = [k for k in key_list if part is not None and k in part]
            if present:
                self._claims.setdefault(partition_id, {}).setdefault(task, set()).update(present)

    def kv_claim_status(self, partition_id: str, task: str, fields: Sequence[str]) -> ClaimStatus:
        self._check_open()
        partition_id = check_partition(partition_id)
        task = check_task(task)
        names = check_select_fields(fields)
        with self._lock:
            part = self._partitions.get(partition_id, {})
            claimed = self._claims.get(partition_id, {}).get(task, set())
            produced = [k for k, r in part.items() if all(n in r.values for n in names)]
            return ClaimStatus(
                partition_id=partition_id,
                task=task,
                rows=len(part),
                produced=len(produced),
                claimed=len(claimed),
                claimable=sum(1 for k in produced if k not in claimed),
            )

    def close(self) -> None:
        with self._lock:
            self._partitions.clear()
            self._claims.clear()
            self._bytes = 0
            self._closed = True
            self._stored.notify_all()  # waiting claimers wake up and see the client closed


def _common_fields(rows: Sequence[_Row]) -> list[str]:
    """Fields stored on every row, in the first row's order."""
    if not rows:
        return []
    common = [f for f in rows[0].values]
    for r in rows[1:]:
        common = [f for f in common if f in r.values]
    return common
