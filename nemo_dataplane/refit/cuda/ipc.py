"""Same-host CUDA IPC pieces of the refit's ``transport="ipc"`` (docs/refit.md, section 3).

The sender exports CUDA IPC handles for the storages that hold its tensors (zero copy: no
staging buffer, so no extra pass over HBM); every receiver opens them once and, at each
refit, copies straight from the sender's memory into its own tensors with copy-engine peer
copies. The ``StatelessProcessGroup`` only carries the handshake (host check, handles in its
store, the refit header and an acknowledgement).

Handles are torch's own (``torch.multiprocessing.reductions.reduce_tensor`` /
``rebuild_cuda_tensor``: one ``cudaIpcMemHandle`` per caching-allocator segment, opened once
per receiving process and cached by torch), serialised as JSON rather than pickled so that
nothing in the store is executed.
"""

from __future__ import annotations

import base64
import contextlib
import inspect
import json
import socket
from collections.abc import Sequence
from typing import Any

import torch

from nemo_dataplane.dtypes import check_shape, check_span, dtype_from_name
from nemo_dataplane.refit.copies import copy_all, slot_views
from nemo_dataplane.refit.cuda.copy_engine import CopyPlan, Pair, PeerCopier, Run, _cudart

__all__ = [
    "PeerCopier",
    "PeerMapping",
    "PushSource",
    "PushTargets",
    "export_tensors",
    "exporter_device",
    "host_record",
    "ipc_problems",
    "open_tensors",
    "probe",
    "signature",
]


def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def _uuid(index: int) -> str:
    try:
        return str(torch.cuda.get_device_properties(index).uuid)
    except Exception:
        return ""


def host_record(device: torch.device | None) -> dict[str, Any]:
    """What a rank tells the others so they can decide whether CUDA IPC can work between them."""
    rec: dict[str, Any] = {"host": socket.gethostname(), "boot_id": _boot_id(), "cuda": False}
    if device is not None and device.type == "cuda" and torch.cuda.is_available():
        rec.update(
            cuda=True,
            device=device.index,
            uuid=_uuid(device.index),
            visible=[_uuid(i) for i in range(torch.cuda.device_count())],
        )
    return rec


def ipc_problems(records: dict[int, dict[str, Any]], src: int, push: bool = False) -> list[str]:
    """Why CUDA IPC from rank ``src`` to every other rank cannot work (empty: it can).

    ``push``: the sender opens the receivers' memory, so it must see their GPUs too.
    """
    me = records[src]
    out: list[str] = []
    if not me.get("cuda"):
        out.append(f"sender rank {src} is not on a CUDA device")
    for r, rec in sorted(records.items()):
        if r == src:
            continue
        if (rec.get("host"), rec.get("boot_id")) != (me.get("host"), me.get("boot_id")):
            out.append(f"rank {r} runs on host {rec.get('host')!r}, the sender rank {src} on {me.get('host')!r}")
        elif not rec.get("cuda"):
            out.append(f"rank {r} is not on a CUDA device")
        elif me.get("uuid") and me["uuid"] not in rec.get("visible", []):
            out.append(f"rank {r} cannot see the sender's GPU {me['uuid']} (CUDA_VISIBLE_DEVICES?)")
        elif push and rec.get("uuid") and rec["uuid"] not in me.get("visible", []):
            out.append(f"the sender rank {src} cannot see rank {r}'s GPU {rec['uuid']} (CUDA_VISIBLE_DEVICES?)")
    return out


def local_index_of(uuid: str, fallback: int) -> int:
    """This process's CUDA index of the GPU with ``uuid`` (``fallback`` if uuids are unknown)."""
    if not uuid:
        return fallback
    for i in range(torch.cuda.device_count()):
        if _uuid(i) == uuid:
            return i
    raise RuntimeError(f"GPU {uuid} is not visible to this process")


# ---------------------------------------------------------------- handles

_TYPES = {
    "Tensor": torch.Tensor,
    "TypedStorage": torch.storage.TypedStorage,
    "UntypedStorage": torch.UntypedStorage,
    "Parameter": torch.nn.Parameter,
}


def _enc(v: Any) -> Any:
    if isinstance(v, type):
        if v.__name__ not in _TYPES:
            raise TypeError(f"cannot export a handle argument of type {v.__name__}")
        return {"type": v.__name__}
    if isinstance(v, torch.dtype):
        return {"dtype": str(v).removeprefix("torch.")}
    if isinstance(v, (bytes, bytearray)):
        return {"b64": base64.b64encode(bytes(v)).decode()}
    if isinstance(v, torch.device):
        return v.index
    if isinstance(v, (tuple, list, torch.Size)):
        return {"seq": [_enc(x) for x in v]}
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    raise TypeError(f"cannot export a handle argument {v!r} ({type(v).__name__})")


def _dec(v: Any) -> Any:
    if isinstance(v, dict):
        if "type" in v:
            return _TYPES[v["type"]]
        if "dtype" in v:
            return dtype_from_name(v["dtype"], "CUDA IPC handle record dtype")
        if "b64" in v:
            return base64.b64decode(v["b64"])
        if "seq" in v:
            return tuple(_dec(x) for x in v["seq"])
    return v


def _check_view(kw: dict[str, Any]) -> None:
    """Refuse a handle record whose view (size, stride, offset, dtype) reaches outside the
    storage it names; the error names the field."""
    where = "CUDA IPC handle record"
    for name in ("tensor_size", "tensor_stride", "tensor_offset", "dtype", "storage_size_bytes"):
        if name not in kw:
            raise ValueError(f"{where}: missing field {name!r}")
    size = check_shape(kw["tensor_size"], f"{where} tensor_size")
    stride = check_shape(kw["tensor_stride"], f"{where} tensor_stride")
    if len(stride) != len(size):
        raise ValueError(f"{where} tensor_stride: {len(stride)} dims for a {len(size)}-dim tensor_size")
    if not isinstance(kw["dtype"], torch.dtype):
        raise ValueError(f"{where} dtype: {kw['dtype']!r} is not a dtype")
    last = 0 if 0 in size else sum((n - 1) * s for n, s in zip(size, stride)) + 1
    item = kw["dtype"].itemsize
    offset = kw["tensor_offset"]
    if not isinstance(offset, int) or offset < 0:
        raise ValueError(f"{where} tensor_offset: must be a non-negative int, got {offset!r}")
    check_span(offset * item, last * item if last else 0, int(kw["storage_size_bytes"]), f"{where} tensor view")


def _rebuild_params() -> list[str]:
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    return list(inspect.signature(rebuild_cuda_tensor).parameters)


def export_tensors(tensors: Sequence[torch.Tensor | None], device: torch.device) -> bytes:
    """CUDA IPC handles (JSON) for ``tensors``; ``None`` entries (empty tensors) stay ``None``."""
    from torch.multiprocessing.reductions import reduce_tensor

    names = _rebuild_params()
    items: list[Any] = []
    for t in tensors:
        if t is None:
            items.append(None)
            continue
        _, args = reduce_tensor(t.detach())  # type: ignore[no-untyped-call]  # torch: unannotated
        items.append({n: _enc(a) for n, a in zip(names, args)})
    return json.dumps({"uuid": _uuid(device.index), "device": device.index, "tensors": items}).encode()


def exporter_device(blob: bytes) -> int:
    """This process's CUDA index of the GPU whose memory ``blob`` (``export_tensors``) names."""
    d = json.loads(blob)
    if "error" in d:
        raise RuntimeError(f"the exporting rank could not export its tensors: {d['error']}")
    return local_index_of(d.get("uuid", ""), int(d["device"]))


def open_tensors(blob: bytes, mapping: PeerMapping | None = None) -> list[torch.Tensor | None]:
    """Open handles made by ``export_tensors``: views of the exporter's memory. By default
    torch opens them (``rebuild_cuda_tensor``), in the context of the exporter's GPU, so the
    views are on that GPU. With ``mapping`` they are opened in the context of
    ``mapping.device`` instead (views on that device: its kernels can write them; see
    ``PeerMapping``)."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    d = json.loads(blob)
    dev = exporter_device(blob)
    out: list[torch.Tensor | None] = []
    for item in d["tensors"]:
        if item is None:
            out.append(None)
            continue
        kw = {n: _dec(v) for n, v in item.items()}
        kw["storage_device"] = dev
        kw["requires_grad"] = False
        _check_view(kw)
        kw["tensor_size"] = torch.Size(kw["tensor_size"])
        if mapping is not None:
            out.append(mapping.view(kw))
            continue
        with torch.cuda.device(dev):
            out.append(rebuild_cuda_tensor(**kw))  # type: ignore[no-untyped-call]  # torch: unannotated
    return out


class _ArrayInterface:
    def __init__(self, ptr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False), "version": 3}


class PeerMapping:
    """Another process's CUDA memory mapped into the context of *our* GPU ``device``.

    Why: torch opens a handle in the context of the memory's own GPU, and a kernel of another
    GPU writing through such a view faults (illegal address); the same memory opened with
    ``device`` current and ``cudaIpcMemLazyEnablePeerAccess`` (cuda-bindings) takes torch's
    strided copy kernel bit-exact (``benchmarks/ipc_peer_probe.py`` shows both). Each caching-
    allocator block (one handle) is opened once per mapping and closed by ``close()``; the views
    do not own their memory (torch's IPC refcounts do not cover them), so the exporter must keep
    the tensors alive: a receiver whose tensors moved aborts the refit (``IpcPush.moved``).
    Only torch's ``cudaMalloc`` handles are understood; anything else raises, and the caller
    falls back to torch's open."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._rt = _cudart()
        if self._rt is None or not hasattr(self._rt, "cudaIpcOpenMemHandle"):
            raise RuntimeError("cuda-bindings are not installed")
        self._opened: dict[bytes, int] = {}

    @staticmethod
    def _mem_handle(raw: bytes) -> bytes:
        # torch's handle: version byte, kind byte ('c': cudaMalloc), the 64-byte cudaIpcMemHandle_t.
        if len(raw) == 64:
            return raw
        if len(raw) == 66 and raw[1:2] == b"c":
            return raw[2:]
        raise RuntimeError(f"unsupported torch CUDA IPC handle ({len(raw)} bytes, kind {raw[1:2]!r})")

    def _base(self, raw: bytes) -> int:
        h = self._mem_handle(raw)
        if h not in self._opened:
            rt = self._rt
            mh = rt.cudaIpcMemHandle_t()
            mh.reserved = h
            with torch.cuda.device(self.device):
                err, ptr = rt.cudaIpcOpenMemHandle(mh, rt.cudaIpcMemLazyEnablePeerAccess)
            if err != rt.cudaError_t.cudaSuccess:
                raise RuntimeError(f"cudaIpcOpenMemHandle on GPU {self.device.index}: {err}")
            self._opened[h] = int(ptr)
        return self._opened[h]

    def view(self, kw: dict[str, Any]) -> torch.Tensor:
        """The tensor a checked ``rebuild_cuda_tensor`` record names, on ``device``."""
        dtype: torch.dtype = kw["dtype"]
        start = self._base(kw["storage_handle"]) + int(kw["storage_offset_bytes"])
        nbytes = int(kw["storage_size_bytes"])
        flat = torch.as_tensor(_ArrayInterface(start, nbytes))  # no device=: that could copy
        if flat.device != self.device or flat.data_ptr() != start:
            raise RuntimeError(
                f"mapped memory shows as {flat.device} at {flat.data_ptr():#x}, not {self.device} at {start:#x}"
            )
        return (
            flat[: nbytes - nbytes % dtype.itemsize]
            .view(dtype)
            .as_strided(kw["tensor_size"], kw["tensor_stride"], kw["tensor_offset"])
        )

    def close(self) -> None:
        """Unmap every block (after the last use of the views; errors ignored)."""
        opened, self._opened = self._opened, {}
        for ptr in opened.values():
            with contextlib.suppress(Exception), torch.cuda.device(self.device):
                self._rt.cudaIpcCloseMemHandle(ptr)


# ---------------------------------------------------------------- push (the sender writes)


Signature = list[tuple[int, tuple[int, ...]]]  # per tensor: (data pointer, strides)


def signature(tensors: Sequence[torch.Tensor]) -> Signature:
    """Where each tensor's data lives; a change means its storage moved."""
    return [(t.data_ptr(), t.stride()) for t in tensors]


class PushTargets:
    """Receiver side of ``ipc_direction="push"``: the memory it lets the sender write into.

    Contiguous tensors are exported as they are. Each non-contiguous one gets a slot in one
    staging buffer instead (so the sender only ever issues plain copies), copied into the tensor
    by ``scatter()`` once a refit has landed. Everything exported stays referenced here, so its
    memory cannot be reused while the sender may still write into it.
    """

    def __init__(self, tensors: Sequence[torch.Tensor], device: torch.device) -> None:
        self.tensors = list(tensors)
        self.signature = signature(self.tensors)
        self.device = device
        strided = [i for i, t in enumerate(self.tensors) if t.numel() and not t.is_contiguous()]
        staging = slot_views([self.tensors[i] for i in strided], device) if strided else []
        self.exported: list[torch.Tensor | None] = [t if t.numel() else None for t in self.tensors]
        for i, slot in zip(strided, staging):
            self.exported[i] = slot
        self._scatter = ([self.tensors[i] for i in strided], staging)

    def blob(self) -> bytes:
        return export_tensors(self.exported, self.device)

    def moved(self, tensors: Sequence[torch.Tensor]) -> list[int]:
        """Indices of ``tensors`` that no longer live where they were exported."""
        return [i for i, (a, b) in enumerate(zip(signature(tensors), self.signature)) if a != b]

    @property
    def needs_scatter(self) -> bool:
        return bool(self._scatter[0])

    def scatter(self) -> None:
        """Staged values into the non-contiguous tensors, on the current stream."""
        copy_all(*self._scatter)


class PushSource:
    """Sender side of ``ipc_direction="push"``: every receiver's exported tensors and the copy plan.

    The receivers' handles are opened once. Non-contiguous sources are gathered into one
    scratch buffer on the sender's GPU first, so every copy into another process's memory is a
    plain copy-engine copy (runs adjacent in memory on both sides merged). The plan is rebuilt
    only when the sender's tensors move.
    """

    def __init__(self, blobs: dict[int, bytes], device: torch.device, copier: PeerCopier) -> None:
        self.device = device
        self.copier = copier
        self.dsts: dict[int, list[torch.Tensor | None]] = {}
        for r, blob in blobs.items():
            try:
                views = open_tensors(blob)
            except Exception as e:
                raise RuntimeError(f"rank {r}: {e}") from e
            probe(views, device)
            self.dsts[r] = views
        self._key: Signature | None = None
        self._plan: CopyPlan = ([], [])
        # The tensors the current plan reads, kept alive so that issuing it before checking
        # them (see RefitSender) never reads freed memory.
        self._sources: list[torch.Tensor] = []
        self._gather: tuple[list[torch.Tensor], list[torch.Tensor]] = ([], [])

    @property
    def current(self) -> CopyPlan:
        """The plan last built (for the tensors ``plan()`` last saw)."""
        return self._plan

    def plan(self, tensors: Sequence[torch.Tensor], stream: torch.cuda.Stream) -> CopyPlan | None:
        """(raw runs, pairs for ``copy_``) writing ``tensors`` into every receiver; None if the
        current plan already is for them (same storage and strides)."""
        key = signature(tensors)
        if key == self._key:
            return None
        strided = [t for t in tensors if t.numel() and not t.is_contiguous()]
        # Allocated on the copy stream: a scratch buffer dropped here is reused by the
        # allocator only after the copies already queued on that stream read it.
        with torch.cuda.stream(stream):
            scratch = iter(slot_views(strided, self.device)) if strided else iter(())
        srcs = [t if (not t.numel() or t.is_contiguous()) else next(scratch) for t in tensors]
        runs: list[Run] = []
        slow: list[Pair] = []
        for views in self.dsts.values():
            pairs = [(d, s) for d, s in zip(views, srcs) if d is not None]
            rr, sl = self.copier.plan([d for d, _ in pairs], [s for _, s in pairs])
            runs += rr
            slow += sl
        self._gather = ([s for t, s in zip(tensors, srcs) if s is not t], strided)
        self._key, self._plan, self._sources = key, (runs, slow), list(tensors)
        return self._plan

    @property
    def needs_gather(self) -> bool:
        return bool(self._gather[0])

    def gather(self) -> None:
        """Non-contiguous sources into their scratch slots, on the current stream."""
        copy_all(*self._gather)


def probe(views: Sequence[torch.Tensor | None], device: torch.device) -> None:
    """Copy one element of the first mapped view to ``device`` and back to a new tensor on the
    view's GPU (never into the mapped memory): proves the mapping works and lets torch enable
    peer access both ways before the first refit."""
    for v in views:
        if v is None:
            continue
        x = v if v.dim() == 0 else v[(0,) * v.dim()]
        here = torch.empty((), dtype=v.dtype, device=device)
        here.copy_(x)
        torch.empty((), dtype=v.dtype, device=v.device).copy_(here)
        torch.cuda.synchronize(device)
        torch.cuda.synchronize(v.device)
        return
