"""Per-row digests of what a put wrote, checked by the gets that read it back.

With ``data_plane.verify_integrity`` the factory wraps the client in :class:`IntegrityCheck`,
which records, at every put, one 8-byte BLAKE2b digest per row and field (over the dtype, the
row's shape and its bytes; a jagged field's row is its own slice) as the tag
``_integrity:<field>`` of the row's key, and recomputes them at every get for the fields
fetched. Being tags, the digests travel with the keys through every backend; a row whose bytes
changed in the store (or on the wire) while its tag did not fails the get with
:class:`~nemo_dataplane.client.DataIntegrityError` naming the key and the field.

A get checks the digests its meta carries; when a meta lacks one or disagrees (it predates a
later put of that field) or only keys were given, the current tags are read once with
``kv_list`` before judging, so a stale meta never raises a false alarm.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from typing import Any, cast

import numpy as np
import torch
from tensordict import TensorDict

from nemo_dataplane.client import DataIntegrityError, Fields
from nemo_dataplane.codec import is_jagged, normalize_fields
from nemo_dataplane.meta import KVBatchMeta
from nemo_dataplane.wrappers.base import ForwardingClient

__all__ = ["TAG_PREFIX", "IntegrityCheck", "mismatches", "row_digests", "tag_name", "with_digests"]

TAG_PREFIX = "_integrity:"


# ------------------------------------------------------------------ digests
def tag_name(field: str) -> str:
    """The tag that holds ``field``'s digest."""
    return TAG_PREFIX + field


def _digest(dtype: str, shape: tuple[int, ...], data: np.ndarray) -> str:
    h = hashlib.blake2b(digest_size=8)
    h.update(f"{dtype}{shape}".encode())
    h.update(data)  # type: ignore[arg-type]  # numpy's stub gives ndarray __buffer__ only for Python >= 3.12
    return h.hexdigest()


def row_digests(t: torch.Tensor) -> list[str]:
    """One hex digest per row of a dense (``t[i]``) or jagged (``[len_i, *rest]``) field."""
    if t.device.type != "cpu":
        t = t.cpu()
    dtype = str(t.dtype).removeprefix("torch.")
    if is_jagged(t):
        values, offsets = t.values().contiguous(), t.offsets().tolist()  # type: ignore[attr-defined]  # torch's stub lacks the NJT accessor
        rest = tuple(values.shape[1:])
        per = values[0].numel() * values.element_size() if values.shape[0] else 0
        flat = values.reshape(-1).view(torch.uint8).numpy()
        return [_digest(dtype, (b - a, *rest), flat[a * per : b * per]) for a, b in zip(offsets[:-1], offsets[1:])]
    t = t.contiguous()
    n, rest = t.shape[0], tuple(t.shape[1:])
    flat = t.reshape(-1).view(torch.uint8).numpy()
    per = flat.size // n if n else 0
    return [_digest(dtype, rest, flat[i * per : (i + 1) * per]) for i in range(n)]


def with_digests(
    columns: Mapping[str, torch.Tensor], tags: Sequence[Mapping[str, Any]] | None, n_rows: int
) -> list[dict[str, Any]]:
    """``tags`` (or empty ones) with each field's row digest added under :func:`tag_name`."""
    out = [dict(t) for t in tags] if tags is not None else [{} for _ in range(n_rows)]
    for name, t in columns.items():
        for row, d in zip(out, row_digests(t)):
            row[tag_name(name)] = d
    return out


def mismatches(
    data: Mapping[str, torch.Tensor], keys: Sequence[str], tags: Sequence[Mapping[str, Any]], fields: Sequence[str]
) -> list[tuple[str, str, str]]:
    """``(key, field, why)`` for every fetched row whose digest differs from, or lacks, its tag."""
    bad = []
    for name in fields:
        tag = tag_name(name)
        for key, row_tags, got in zip(keys, tags, row_digests(data[name])):
            want = row_tags.get(tag)
            if want is None:
                bad.append((key, name, "no digest was recorded at put"))
            elif want != got:
                bad.append((key, name, f"digest {got} != {want} recorded at put"))
    return bad


# ------------------------------------------------------------------ the wrapper
class IntegrityCheck(ForwardingClient):
    """Seals every put's rows with digest tags and checks every get against them (see the
    module docstring); every other call is forwarded unchanged.

    Raises (from gets): :class:`~nemo_dataplane.client.DataIntegrityError` naming partition,
    key and field of the first mismatch (and how many more), also for a row put without digests.
    """

    def _sealed_tags(
        self, keys: Sequence[str], fields: Fields | None, tags: Sequence[Mapping[str, Any]] | None
    ) -> Sequence[Mapping[str, Any]] | None:
        if fields is None:
            return tags
        return with_digests(normalize_fields(fields, len(keys)), tags, len(keys))

    @staticmethod
    def _target(meta_or_keys: KVBatchMeta | Sequence[str], pid: str | None) -> tuple[list[str], Any, str | None]:
        if isinstance(meta_or_keys, KVBatchMeta):
            return list(meta_or_keys.keys), list(meta_or_keys.tags), meta_or_keys.partition_id or pid
        return list(meta_or_keys), None, pid

    @staticmethod
    def _judge(
        out: TensorDict, keys: list[str], tags: Any, fields: Sequence[str], pid: str | None, fresh: KVBatchMeta | None
    ) -> bool:
        """True when every row checks out; raises on a mismatch against fresh tags; False when
        the caller's tags do not settle it (fetch fresh ones and call again)."""
        if fresh is not None:
            by_key = dict(zip(fresh.keys, fresh.tags))
            tags = [by_key.get(k, {}) for k in keys]
        if tags is None:
            return False
        bad = mismatches(out, keys, tags, fields)
        if not bad:
            return True
        if fresh is None:
            return False
        key, name, why = bad[0]
        more = f" (and {len(bad) - 1} more row/field pairs)" if len(bad) > 1 else ""
        raise DataIntegrityError(
            f"integrity check failed in partition {pid!r}: key {key!r}, field {name!r}: {why}{more}"
        )

    # ----------------------------------------------------------------- sync
    def kv_batch_put(
        self,
        keys: Sequence[str],
        partition_id: str,
        fields: Fields | None,
        tags: Sequence[Mapping[str, Any]] | None = None,
    ) -> KVBatchMeta:
        keys = list(keys)
        return self.inner.kv_batch_put(keys, partition_id, fields, self._sealed_tags(keys, fields, tags))

    def kv_batch_get(
        self, meta_or_keys: KVBatchMeta | Sequence[str], select_fields: Sequence[str], partition_id: str | None = None
    ) -> TensorDict:
        out = self.inner.kv_batch_get(meta_or_keys, select_fields, partition_id)
        keys, tags, pid = self._target(meta_or_keys, partition_id)
        if not self._judge(out, keys, tags, select_fields, pid, None):
            # The get above found the partition (a get without one raises).
            self._judge(out, keys, tags, select_fields, pid, self.inner.kv_list(cast(str, pid)))
        return out

    # ---------------------------------------------------------------- async
    async def async_kv_batch_put(
        self,
        keys: Sequence[str],
        partition_id: str,
        fields: Fields | None,
        tags: Sequence[Mapping[str, Any]] | None = None,
    ) -> KVBatchMeta:
        keys = list(keys)
        return await self.inner.async_kv_batch_put(keys, partition_id, fields, self._sealed_tags(keys, fields, tags))

    async def async_kv_batch_get(
        self, meta_or_keys: KVBatchMeta | Sequence[str], select_fields: Sequence[str], partition_id: str | None = None
    ) -> TensorDict:
        out = await self.inner.async_kv_batch_get(meta_or_keys, select_fields, partition_id)
        keys, tags, pid = self._target(meta_or_keys, partition_id)
        if not self._judge(out, keys, tags, select_fields, pid, None):
            fresh = await self.inner.async_kv_list(cast(str, pid))  # found by the get above, as in kv_batch_get
            self._judge(out, keys, tags, select_fields, pid, fresh)
        return out
