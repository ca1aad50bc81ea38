"""Every get checks that each row it returns is the row of the key asked for.

With ``data_plane.verify_rows`` (default on) the factory wraps the client in
:class:`RowIdentityCheck`. Each put stores one more field, :data:`ROW_ID` (``int64``, 8 bytes per
row): a 64-bit BLAKE2b hash of the row's partition and key. Each get reads it back with the
fields asked for and compares it with the hashes of the keys asked for; on a mismatch it raises
:class:`~nemo_dataplane.client.RowIdentityError` naming the keys whose rows came back wrong (and
whose rows they got), so rows a store rotated, swapped, duplicated or took from another key or
partition never reach training. The field is hidden from callers: gets return only the fields
asked for, and ``meta.fields`` of puts, lists and claims never list it.

It checks *which* row came back, not its bytes: a store that corrupts one field of the right row
passes (``data_plane.verify_integrity``'s per-field digests catch that, at a higher cost). A row
put by a client without this wrapper has no :data:`ROW_ID`; a get of it is refused naming the
keys, since nothing could be checked.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
from tensordict import TensorDict

from nemo_dataplane.client import (
    Fields,
    RowIdentityError,
    check_put_args,
    check_select_fields,
    resolve_get_target,
)
from nemo_dataplane.meta import KVBatchMeta
from nemo_dataplane.wrappers.base import ForwardingClient

__all__ = ["ROW_ID", "RowIdentityCheck", "row_ids"]

ROW_ID = "_row_id"  # the hidden field; a caller's field of this name is refused at put


def row_ids(partition_id: str, keys: Sequence[str]) -> torch.Tensor:
    """``int64 [len(keys)]``: each key's identity in ``partition_id`` (stable across processes:
    BLAKE2b of the partition and the key, 8 bytes little-endian)."""
    head = hashlib.blake2b(partition_id.encode() + b"\x00", digest_size=8)
    digests = []
    for k in keys:
        h = head.copy()  # the partition's prefix hashed once per call
        h.update(k.encode())
        digests.append(h.digest())
    return torch.from_numpy(np.frombuffer(b"".join(digests), dtype="<i8").copy())


def _public(meta: KVBatchMeta) -> KVBatchMeta:
    if meta.fields is None or ROW_ID not in meta.fields:
        return meta
    return meta.replace_fields([f for f in meta.fields if f != ROW_ID])


class RowIdentityCheck(ForwardingClient):
    """Adds :data:`ROW_ID` to every put's fields and checks it at every get (see the module
    docstring); hides it from what callers see; forwards everything else.

    Raises:
        ValueError (put): a field named :data:`ROW_ID`.
        RowIdentityError (get): rows that belong to other keys, or rows without an identity
            (put by a client without this wrapper); names the keys.
    """

    # ------------------------------------------------------------ helpers
    @staticmethod
    def _sealed(
        keys: Sequence[str], partition_id: str, fields: Fields | None, tags: Sequence[Mapping[str, Any]] | None
    ) -> tuple[list[str], str, dict[str, torch.Tensor] | None, list[dict[str, Any]] | None]:
        """The put's arguments, checked as every backend checks them, with :data:`ROW_ID` added."""
        keys, partition_id, columns, tag_list = check_put_args(keys, partition_id, fields, tags)
        if not columns:
            return keys, partition_id, None, tag_list  # a tags-only put: no row data to identify
        if ROW_ID in columns:
            raise ValueError(f"field {ROW_ID!r} is reserved for the row identity check (data_plane.verify_rows)")
        columns[ROW_ID] = row_ids(partition_id, keys)
        return keys, partition_id, columns, tag_list

    @staticmethod
    def _asked(select_fields: Sequence[str]) -> list[str]:
        names = check_select_fields(select_fields)
        if ROW_ID in names:
            raise ValueError(f"field {ROW_ID!r} is the row identity check's own (data_plane.verify_rows)")
        return [*names, ROW_ID]  # last: a missing caller's field is reported before it

    @staticmethod
    def _checked(out: TensorDict, keys: list[str], partition_id: str) -> TensorDict:
        """``out`` without :data:`ROW_ID` after comparing it with ``keys``' identities."""
        if not keys:
            return out
        got = out.get(ROW_ID)
        want = row_ids(partition_id, keys)
        wrong = torch.nonzero(got != want).flatten().tolist() if got.shape == want.shape else list(range(len(keys)))
        if wrong:
            owner = dict(zip(want.tolist(), keys))
            got_list = got.reshape(-1).tolist() if got.shape == want.shape else []
            examples = []
            for i in wrong[:5]:
                other = owner.get(got_list[i]) if got_list else None
                whose = f"the row of {other!r}" if other else "a row of no key asked for"
                examples.append(f"{keys[i]!r} got {whose}")
            raise RowIdentityError(
                f"row identity check failed in partition {partition_id!r}: {len(wrong)} of {len(keys)} rows came "
                f"back for another key (the store misplaced rows): {'; '.join(examples)}"
                + (f"; and {len(wrong) - 5} more" if len(wrong) > 5 else "")
            )
        del out[ROW_ID]
        return out

    @staticmethod
    def _missing_ids(e: KeyError, partition_id: str) -> RowIdentityError | None:
        """The error for rows stored without an identity, when ``e`` is the store saying so."""
        if ROW_ID not in str(e):
            return None
        return RowIdentityError(
            f"row identity check: rows of partition {partition_id!r} have no {ROW_ID!r} field, so nothing "
            "can tell whether they are the keys' own (they were put by a client without "
            f"data_plane.verify_rows: set it alike in every process of the run); the store said: {e}"
        )

    # ----------------------------------------------------------------- sync
    def kv_batch_put(
        self,
        keys: Sequence[str],
        partition_id: str,
        fields: Fields | None,
        tags: Sequence[Mapping[str, Any]] | None = None,
    ) -> KVBatchMeta:
        return _public(self.inner.kv_batch_put(*self._sealed(keys, partition_id, fields, tags)))

    def kv_batch_get(
        self, meta_or_keys: KVBatchMeta | Sequence[str], select_fields: Sequence[str], partition_id: str | None = None
    ) -> TensorDict:
        keys, pid = resolve_get_target(meta_or_keys, partition_id)
        try:
            out = self.inner.kv_batch_get(meta_or_keys, self._asked(select_fields), partition_id)
        except KeyError as e:
            if (err := self._missing_ids(e, pid)) is not None:
                raise err from e
            raise
        return self._checked(out, keys, pid)

    def kv_list(self, partition_id: str) -> KVBatchMeta:
        return _public(self.inner.kv_list(partition_id))

    def kv_claim(
        self, partition_id: str, task: str, fields: Sequence[str], batch_size: int, timeout_s: float
    ) -> KVBatchMeta:
        return _public(self.inner.kv_claim(partition_id, task, fields, batch_size, timeout_s))

    # ---------------------------------------------------------------- async
    async def async_kv_batch_put(
        self,
        keys: Sequence[str],
        partition_id: str,
        fields: Fields | None,
        tags: Sequence[Mapping[str, Any]] | None = None,
    ) -> KVBatchMeta:
        return _public(await self.inner.async_kv_batch_put(*self._sealed(keys, partition_id, fields, tags)))

    async def async_kv_batch_get(
        self, meta_or_keys: KVBatchMeta | Sequence[str], select_fields: Sequence[str], partition_id: str | None = None
    ) -> TensorDict:
        keys, pid = resolve_get_target(meta_or_keys, partition_id)
        try:
            out = await self.inner.async_kv_batch_get(meta_or_keys, self._asked(select_fields), partition_id)
        except KeyError as e:
            if (err := self._missing_ids(e, pid)) is not None:
                raise err from e
            raise
        return self._checked(out, keys, pid)

    async def async_kv_list(self, partition_id: str) -> KVBatchMeta:
        return _public(await self.inner.async_kv_list(partition_id))

    async def async_kv_claim(
        self, partition_id: str, task: str, fields: Sequence[str], batch_size: int, timeout_s: float
    ) -> KVBatchMeta:
        return _public(await self.inner.async_kv_claim(partition_id, task, fields, batch_size, timeout_s))
