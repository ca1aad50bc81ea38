"""`GpuResidentClient`: rollout fields made on a GPU stay there; the store carries a handle.

A put of a field named in ``fields`` whose tensor is on a CUDA device, in a cluster of one node,
stores no bytes of it: the store gets, under ``<name>@cuda``, one fixed-size record per row (a
dense int64 row of ``RECORD_WIDTH``, so the store keeps no per-row shapes): where the row lies in
the put's tensor, its shape, and the CUDA IPC handle of that tensor (torch's own handle in a
compact binary form, ``refit.cuda.compact``: nothing is executed on read). Records
are built and parsed with tensor ops, not per row. The putting process keeps that tensor alive
until every key of the put has left the store: keys it clears itself are let go at once; keys
cleared by other clients are found by a listing of the partition that each put starts in a
background thread (so a put never waits for it), or on demand by :meth:`release_cleared`;
:meth:`close` lets everything go. A reader opens the handle and copies the rows it asked for
into its own memory on its current CUDA device: one peer copy per put it reads from, no host
hop; the rows come back bit-identical, with the dtype, shape and layout they were put with.

Everything else takes the inner store's path unchanged: fields not named, CPU tensors, and, in a
cluster of more than one node (CUDA IPC does not cross hosts), named CUDA fields too, copied to
the host first. The factory wraps a client in this when ``data_plane.gpu_fields`` names a field.

Limits: rows have at most ``MAX_ROW_DIMS`` dimensions; a read of rows put by both paths in one
call raises ``KeyError`` naming the field; a key overwritten by a later put keeps the earlier put's
tensor alive until the key is cleared, and one re-put by the other path keeps both stored forms (a
read by keys prefers the GPU one): put a key by one path.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from tensordict import TensorDict

from nemo_dataplane.client import DataPlaneClient, Fields
from nemo_dataplane.codec import is_jagged, join_rows
from nemo_dataplane.meta import KVBatchMeta
from nemo_dataplane.wrappers.base import ForwardingClient

__all__ = ["MAX_ROW_DIMS", "RECORD_WIDTH", "SUFFIX", "GpuResidentClient"]

SUFFIX = "@cuda"  # the stored name of a field whose rows stay on the GPU

# A record (int64): start and length of the row in the put's flat tensor (elements), jagged flag,
# the row's number of dimensions and its shape, then the handle's length in bytes and the handle
# in its compact binary form (``export_compact``, ~280 bytes), zero-padded. The width is fixed so
# rows of different puts read together stay one dense field; at 368 bytes a row, a put of 256
# rows (92 KiB of records) still rides inside the store's call (the TransferQueue adapter's
# inline limit is 100 KiB); 2128-byte records of the handle's JSON (532 KiB) did not, and put +
# get of their 256 rows took ~5 ms longer (12.6 + 7.5 ms against 9.0 + 6.0 ms, 2 shared cores).
_GEOM = 10
MAX_ROW_DIMS = _GEOM - 5
_HANDLE_BYTES = 288
RECORD_WIDTH = _GEOM + _HANDLE_BYTES // 8

log = logging.getLogger(__name__)


@dataclass
class _Held:
    partition_id: str
    keys: set[str]  # the put's keys not yet seen cleared
    tensors: list[torch.Tensor]


def _records(
    name: str, blob: bytes, starts: torch.Tensor, lengths: torch.Tensor, shapes: torch.Tensor, jagged: bool
) -> torch.Tensor:
    """The ``[n, RECORD_WIDTH]`` records of ``n`` rows of one put (CPU int64 inputs)."""
    if len(blob) > _HANDLE_BYTES:
        raise RuntimeError(
            f"field {name!r}: its CUDA IPC handle takes {len(blob)} bytes, more than a record's {_HANDLE_BYTES}"
        )
    n, ndim = shapes.shape
    if ndim > MAX_ROW_DIMS:
        raise ValueError(f"field {name!r} has rows of {ndim} dimensions; a GPU-resident row has at most {MAX_ROW_DIMS}")
    rec = torch.zeros(n, RECORD_WIDTH, dtype=torch.int64)
    rec[:, 0], rec[:, 1], rec[:, 2], rec[:, 3] = starts, lengths, int(jagged), ndim
    rec[:, 4 : 4 + ndim] = shapes
    rec[:, _GEOM - 1] = len(blob)
    padded = bytearray(blob.ljust(_HANDLE_BYTES, b"\0"))
    rec[:, _GEOM:] = torch.frombuffer(padded, dtype=torch.uint8).view(torch.int64)
    return rec


@dataclass
class _Rows:
    """Parsed records: the handle of each put read from and, per row, which one, where and what shape."""

    blobs: list[bytes]
    group: torch.Tensor  # [n] index into blobs
    starts: torch.Tensor  # [n] first element of the row in its put's flat tensor
    sizes: torch.Tensor  # [n] elements
    shapes: torch.Tensor  # [n, ndim]
    jagged: bool


def _parse(name: str, records: torch.Tensor) -> _Rows:
    """Inverse of :func:`_records` for rows of any puts, in any order."""
    rec = records.cpu()
    if rec.dim() != 2 or rec.shape[1] != RECORD_WIDTH or rec.dtype != torch.int64:
        raise ValueError(
            f"field {name!r}: {name + SUFFIX!r} holds {tuple(rec.shape)} {rec.dtype}, not GPU-resident records"
        )
    flags, ndims = rec[:, 2], rec[:, 3]
    if bool((flags != flags[0]).any()) or bool((ndims != ndims[0]).any()):
        raise ValueError(f"field {name!r}: rows put as jagged and as dense, or of different ranks, read together")
    handles = rec[:, _GEOM - 1 :]  # the length, then the bytes
    if bool((handles == handles[0]).all()):
        uniq, group = handles[:1], torch.zeros(rec.shape[0], dtype=torch.int64)
    else:
        uniq, group = torch.unique(handles, dim=0, return_inverse=True)
    blobs = []
    for u in uniq:
        size = int(u[0])
        if not 0 < size <= _HANDLE_BYTES:
            raise ValueError(f"field {name!r}: a record names a handle of {size} bytes (at most {_HANDLE_BYTES})")
        blobs.append(u[1:].numpy().tobytes()[:size])
    return _Rows(blobs, group, rec[:, 0], rec[:, 1], rec[:, 4 : 4 + int(ndims[0])], bool(flags[0]))


class GpuResidentClient(ForwardingClient):
    """CUDA tensors of ``fields`` are put as handles to the putter's GPU memory (module docstring).

    Args:
        inner: the store.
        fields: the field names that may stay on the GPU.
        single_node: whether every reader shares this process's host (else named CUDA fields are
            copied to the host and put as usual).
    """

    def __init__(self, inner: DataPlaneClient, fields: Sequence[str], single_node: bool = True) -> None:
        super().__init__(inner)
        self.fields = frozenset(fields)
        self.single_node = single_node
        self._held: list[_Held] = []
        self._lock = threading.Lock()
        self._releaser: threading.Thread | None = None

    # ------------------------------------------------------------------ put
    def kv_batch_put(
        self,
        keys: Sequence[str],
        partition_id: str,
        fields: Fields | None,
        tags: Sequence[Mapping[str, Any]] | None = None,
    ) -> KVBatchMeta:
        gpu = {n: t for n, t in dict(fields or {}).items() if n in self.fields and t.is_cuda}
        if not gpu:
            return self.inner.kv_batch_put(keys, partition_id, fields, tags)
        out: dict[str, torch.Tensor] = {n: t for n, t in dict(fields or {}).items() if n not in gpu}
        if not self.single_node:  # CUDA IPC does not cross hosts: the host path
            out.update({n: t.cpu() for n, t in gpu.items()})
            return self.inner.kv_batch_put(keys, partition_id, out, tags)
        self._start_release()
        kept: list[torch.Tensor] = []
        for name, t in gpu.items():
            out[name + SUFFIX], flat = self._handles(name, t, len(keys))
            kept.append(flat)
        meta = self.inner.kv_batch_put(keys, partition_id, out, tags)
        with self._lock:
            self._held.append(_Held(partition_id, set(keys), kept))
        return meta

    def _handles(self, name: str, t: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The records of ``t``'s rows (CUDA) and the flat tensor they point into."""
        from nemo_dataplane.refit.cuda.compact import export_compact

        if is_jagged(t):
            flat = t.values().detach().contiguous()
            offsets = t.offsets().cpu()  # type: ignore[attr-defined]  # torch's stub lacks the NJT accessor
            if len(offsets) - 1 != n:
                raise ValueError(f"field {name!r} has {len(offsets) - 1} rows for {n} keys")
            per = int(torch.Size(flat.shape[1:]).numel())
            lengths = offsets.diff()
            inner = torch.tensor(flat.shape[1:], dtype=torch.int64).expand(n, -1)
            shapes = torch.cat([lengths[:, None], inner], dim=1)
            starts, sizes = offsets[:-1] * per, lengths * per
        else:
            if t.shape[0] != n:
                raise ValueError(f"field {name!r} has {t.shape[0]} rows for {n} keys")
            flat = t.detach().contiguous()
            per = int(torch.Size(flat.shape[1:]).numel())
            shapes = torch.tensor(flat.shape[1:], dtype=torch.int64).expand(n, -1)
            starts, sizes = torch.arange(n, dtype=torch.int64) * per, torch.full((n,), per, dtype=torch.int64)
        flat = flat.reshape(-1)
        blob = export_compact(flat)
        return _records(name, blob, starts, sizes, shapes, is_jagged(t)), flat

    # ------------------------------------------------------------------ release
    def release_cleared(self) -> int:
        """Let go of the tensors of puts none of whose keys is in the store any more (one listing
        per partition held); returns how many puts were let go."""
        with self._lock:
            held = list(self._held)
        listed: dict[str, set[str]] = {}
        for h in held:
            if h.partition_id not in listed:
                listed[h.partition_id] = set(self.inner.kv_list(h.partition_id).keys)
        gone = {id(h) for h in held if not h.keys & listed[h.partition_id]}
        with self._lock:
            self._held = [h for h in self._held if id(h) not in gone]
        return len(gone)

    def _start_release(self) -> None:
        """Run :meth:`release_cleared` in a background thread unless one is running."""
        with self._lock:
            if not self._held or (self._releaser is not None and self._releaser.is_alive()):
                return
            self._releaser = threading.Thread(target=self._release_quietly, name="nd-gpu-release", daemon=True)
            self._releaser.start()

    def _release_quietly(self) -> None:
        try:
            self.release_cleared()
        except Exception:  # noqa: BLE001 - the next put or clear tries again; nothing is lost meanwhile
            log.debug("listing the store to release GPU-resident puts failed", exc_info=True)

    def held_puts(self) -> int:
        """Puts whose GPU tensors this client still keeps alive for readers."""
        with self._lock:
            return len(self._held)

    def kv_clear(self, keys: Sequence[str] | None, partition_id: str) -> None:
        self.inner.kv_clear(keys, partition_id)
        cleared = None if keys is None else set(keys)
        with self._lock:
            for h in self._held:
                if h.partition_id == partition_id:
                    h.keys = set() if cleared is None else h.keys - cleared
            self._held = [h for h in self._held if h.keys]

    def close(self) -> None:
        with self._lock:
            releaser, self._releaser = self._releaser, None
        if releaser is not None:
            releaser.join()
        with self._lock:
            self._held = []
        self.inner.close()

    # ------------------------------------------------------------------ get
    def kv_batch_get(
        self, meta_or_keys: KVBatchMeta | Sequence[str], select_fields: Sequence[str], partition_id: str | None = None
    ) -> TensorDict:
        names = list(select_fields)
        n_keys = len(meta_or_keys.keys) if isinstance(meta_or_keys, KVBatchMeta) else len(meta_or_keys)
        if n_keys == 0 or not any(n in self.fields for n in names):
            return self.inner.kv_batch_get(meta_or_keys, names, partition_id)
        known = meta_or_keys.fields if isinstance(meta_or_keys, KVBatchMeta) else None
        stored = set(known) if known is not None else None

        def on_gpu(n: str) -> bool:
            return n in self.fields and (stored is None or n + SUFFIX in stored)

        asked = [n + SUFFIX if on_gpu(n) else n for n in names]
        try:
            got = self.inner.kv_batch_get(meta_or_keys, asked, partition_id)
        except KeyError as e:
            if stored is not None or asked == names or not any(a.endswith(SUFFIX) and a in str(e) for a in asked):
                raise
            return self.inner.kv_batch_get(meta_or_keys, names, partition_id)  # put by the host path
        out = {}
        for n, a in zip(names, asked):
            out[n] = self._open(n, got[a]) if a != n else got[a]
        return TensorDict(out, batch_size=got.batch_size)

    def _open(self, name: str, records: torch.Tensor) -> torch.Tensor:
        """The rows ``records`` point at, copied onto this process's current CUDA device."""
        from nemo_dataplane.refit.cuda.compact import open_compact

        if not torch.cuda.is_available():
            raise RuntimeError(f"field {name!r} is held on a GPU (put with gpu_fields) and this process has no GPU")
        r = _parse(name, records)
        n, starts, sizes, shapes, jagged = len(r.starts), r.starts, r.sizes, r.shapes, r.jagged
        here = torch.device("cuda", torch.cuda.current_device())
        ends = starts + sizes
        # One peer copy per put read from: the span its rows cover.
        local: list[tuple[int, torch.Tensor]] = []
        for g, blob in enumerate(r.blobs):
            mine = r.group == g
            lo, hi = int(starts[mine].min()), int(ends[mine].max())
            src = open_compact(blob)
            local.append((lo, src[lo:hi].to(here)))
        if len(local) == 1 and bool((starts[1:] == ends[:-1]).all()):
            # The rows are the copied span, in order (a whole put read back): use it as it is.
            span = local[0][1]
            if not jagged:
                return span.view(n, *shapes[0].tolist())
            offsets = torch.zeros(n + 1, dtype=torch.int64)
            torch.cumsum(shapes[:, 0], 0, out=offsets[1:])
            return torch.nested.nested_tensor_from_jagged(span.view(-1, *shapes[0, 1:].tolist()), offsets.to(here))
        parts = []
        for g, s, m, shape in zip(r.group.tolist(), starts.tolist(), sizes.tolist(), shapes.tolist()):
            lo, span = local[g]
            parts.append(span[s - lo : s - lo + m].view(shape))
        return join_rows(name, parts, jagged)

    # ------------------------------------------------------------------ async twins
    async def async_kv_batch_put(
        self,
        keys: Sequence[str],
        partition_id: str,
        fields: Fields | None,
        tags: Sequence[Mapping[str, Any]] | None = None,
    ) -> KVBatchMeta:
        return await asyncio.to_thread(self.kv_batch_put, keys, partition_id, fields, tags)

    async def async_kv_batch_get(
        self, meta_or_keys: KVBatchMeta | Sequence[str], select_fields: Sequence[str], partition_id: str | None = None
    ) -> TensorDict:
        return await asyncio.to_thread(self.kv_batch_get, meta_or_keys, select_fields, partition_id)

    async def async_kv_clear(self, keys: Sequence[str] | None, partition_id: str) -> None:
        await asyncio.to_thread(self.kv_clear, keys, partition_id)
