"""`GpuResidentClient`: rollout fields made on a GPU stay there; the store carries a handle.

A put of a field named in ``fields`` whose tensor is on a CUDA device, in a cluster of one node,
stores no bytes of it: the store gets, under ``<name>@cuda``, one small record per row (uint8,
jagged): the CUDA IPC handle of the put's tensor (torch's own handle, JSON-encoded, so nothing is
executed on read) and where the row lies in it. The putting process keeps that tensor alive until
every key of the put has left the store (looked up at its later puts and clears, and at
:meth:`close`). A reader opens the handle and copies the rows it asked for into its own memory
on its current CUDA device: one peer copy per put it reads from, no host hop; the rows come back
bit-identical, with the dtype, shape and layout they were put with.

Everything else takes the inner store's path unchanged: fields not named, CPU tensors, and, in a
cluster of more than one node (CUDA IPC does not cross hosts), named CUDA fields too, copied to
the host first. The factory wraps a client in this when ``data_plane.gpu_fields`` names a field.

Limits: a read of rows put by both paths in one call raises ``KeyError`` naming the field; a key
overwritten by a later put keeps the earlier put's tensor alive until the key is cleared, and one
re-put by the other path keeps both stored forms (a read by keys prefers the GPU one): put a key
by one path.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from tensordict import TensorDict

from nemo_dataplane.client import DataPlaneClient, Fields
from nemo_dataplane.codec import is_jagged, jagged_from_rows, jagged_rows, join_rows
from nemo_dataplane.meta import KVBatchMeta
from nemo_dataplane.wrappers.base import ForwardingClient

__all__ = ["SUFFIX", "GpuResidentClient"]

SUFFIX = "@cuda"  # the stored name of a field whose rows stay on the GPU


@dataclass
class _Held:
    partition_id: str
    keys: frozenset[str]
    tensors: list[torch.Tensor]


def _rows_of_records(records: torch.Tensor) -> list[dict[str, Any]]:
    return [json.loads(r.cpu().numpy().tobytes()) for r in jagged_rows(records)]


def _records(rows: list[bytes]) -> torch.Tensor:
    return jagged_from_rows([torch.frombuffer(bytearray(r), dtype=torch.uint8) for r in rows])


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
        self._release_cleared()
        out: dict[str, torch.Tensor] = {n: t for n, t in dict(fields or {}).items() if n not in gpu}
        if not self.single_node:  # CUDA IPC does not cross hosts: the host path
            out.update({n: t.cpu() for n, t in gpu.items()})
            return self.inner.kv_batch_put(keys, partition_id, out, tags)
        kept: list[torch.Tensor] = []
        for name, t in gpu.items():
            out[name + SUFFIX], flat = self._handles(name, t, len(keys))
            kept.append(flat)
        meta = self.inner.kv_batch_put(keys, partition_id, out, tags)
        with self._lock:
            self._held.append(_Held(partition_id, frozenset(keys), kept))
        return meta

    def _handles(self, name: str, t: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One record per row of ``t`` (CUDA) and the flat tensor they point into."""
        from nemo_dataplane.refit.cuda.ipc import export_tensors

        if is_jagged(t):
            flat = t.values().detach().contiguous()
            offsets = t.offsets().tolist()  # type: ignore[attr-defined]  # torch's stub lacks the NJT accessor
            if len(offsets) - 1 != n:
                raise ValueError(f"field {name!r} has {len(offsets) - 1} rows for {n} keys")
            inner_shape = list(flat.shape[1:])
            per = int(torch.Size(inner_shape).numel())
            spans = [(offsets[i] * per, (offsets[i + 1] - offsets[i]) * per) for i in range(n)]
            shapes = [[offsets[i + 1] - offsets[i], *inner_shape] for i in range(n)]
        else:
            if t.shape[0] != n:
                raise ValueError(f"field {name!r} has {t.shape[0]} rows for {n} keys")
            flat = t.detach().contiguous()
            per = int(torch.Size(flat.shape[1:]).numel())
            spans = [(i * per, per) for i in range(n)]
            shapes = [list(flat.shape[1:])] * n
        flat = flat.reshape(-1)
        blob = export_tensors([flat], flat.device).decode()
        # The handle carries the dtype; a record adds only where its row lies and its shape.
        head = {"blob": blob, "jagged": is_jagged(t)}
        rows = [json.dumps({**head, "start": s, "len": m, "shape": sh}).encode() for (s, m), sh in zip(spans, shapes)]
        return _records(rows), flat

    def _release_cleared(self) -> None:
        """Drop the tensors of puts none of whose keys is in the store any more."""
        with self._lock:
            held = list(self._held)
        if not held:
            return
        listed: dict[str, set[str]] = {}
        for h in held:
            if h.partition_id not in listed:
                listed[h.partition_id] = set(self.inner.kv_list(h.partition_id).keys)
        with self._lock:
            self._held = [h for h in self._held if h.keys & listed.get(h.partition_id, set(h.keys))]

    def held_puts(self) -> int:
        """Puts whose GPU tensors this client still keeps alive for readers."""
        with self._lock:
            return len(self._held)

    def kv_clear(self, keys: Sequence[str] | None, partition_id: str) -> None:
        self.inner.kv_clear(keys, partition_id)
        self._release_cleared()

    def close(self) -> None:
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
        from nemo_dataplane.refit.cuda.ipc import open_tensors

        if not torch.cuda.is_available():
            raise RuntimeError(f"field {name!r} is held on a GPU (put with gpu_fields) and this process has no GPU")
        rows = _rows_of_records(records)
        here = torch.device("cuda", torch.cuda.current_device())
        # One peer copy per put read from: the span its rows cover.
        spans: dict[str, tuple[int, int]] = {}
        for r in rows:
            lo, hi = spans.get(r["blob"], (r["start"], r["start"]))
            spans[r["blob"]] = (min(lo, r["start"]), max(hi, r["start"] + r["len"]))
        local: dict[str, torch.Tensor] = {}
        for blob, (lo, hi) in spans.items():
            (src,) = open_tensors(blob.encode())
            assert src is not None
            local[blob] = src[lo:hi].to(here)
        jagged = bool(rows[0]["jagged"])
        if len(local) == 1 and all(a["start"] + a["len"] == b["start"] for a, b in zip(rows, rows[1:])):
            # The rows are the copied span, in order (a whole put read back): use it as it is.
            (span,) = local.values()
            if not jagged:
                return span.view(len(rows), *rows[0]["shape"])
            inner_shape = rows[0]["shape"][1:]
            lengths = torch.tensor([r["shape"][0] for r in rows], dtype=torch.int64)
            offsets = torch.zeros(len(rows) + 1, dtype=torch.int64)
            torch.cumsum(lengths, 0, out=offsets[1:])
            return torch.nested.nested_tensor_from_jagged(span.view(-1, *inner_shape), offsets.to(here))
        parts = []
        for r in rows:
            at = r["start"] - spans[r["blob"]][0]
            parts.append(local[r["blob"]][at : at + r["len"]].view(r["shape"]))
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
