"""One CUDA tensor's IPC handle in a compact binary form, for stores that keep a handle per row
(``nemo_dataplane.wrappers.gpu_resident``): torch's own handle (``reduce_tensor`` /
``rebuild_cuda_tensor``), ~280 bytes where :func:`~.ipc.export_tensors`' JSON takes ~730.
Nothing in it is executed on read, and a view reaching outside its storage is refused.
"""

from __future__ import annotations

import struct
import uuid
from typing import Any

import torch

from nemo_dataplane.dtypes import dtype_from_name
from nemo_dataplane.refit.cuda.ipc import _TYPES, _check_view, _rebuild_params, _uuid

__all__ = ["export_compact", "open_compact"]

# Layout: version, the GPU's uuid (16 bytes, zeros: unknown), its index, then
# rebuild_cuda_tensor's arguments in order, each one tag byte and its value.
_COMPACT_VERSION = 1
_TYPE_CODES = list(_TYPES)


def _pack(v: Any, out: bytearray) -> None:
    if v is None or isinstance(v, bool):
        out += {None: b"N", True: b"T", False: b"F"}[v]
    elif isinstance(v, type):
        if v.__name__ not in _TYPES:
            raise TypeError(f"cannot export a handle argument of type {v.__name__}")
        out += b"t" + bytes([_TYPE_CODES.index(v.__name__)])
    elif isinstance(v, torch.dtype):
        name = str(v).removeprefix("torch.").encode()
        out += b"d" + bytes([len(name)]) + name
    elif isinstance(v, (bytes, bytearray)):
        out += b"b" + struct.pack("<H", len(v)) + bytes(v)
    elif isinstance(v, torch.device):
        out += b"D" + struct.pack("<h", -1 if v.index is None else v.index)
    elif isinstance(v, int):
        out += b"i" + struct.pack("<q", v)
    elif isinstance(v, (tuple, list, torch.Size)):
        out += b"s" + bytes([len(v)])
        for x in v:
            _pack(x, out)
    else:
        raise TypeError(f"cannot export a handle argument {v!r} ({type(v).__name__})")


def _unpack(blob: bytes, at: int) -> tuple[Any, int]:
    tag, at = blob[at : at + 1], at + 1
    if tag in (b"N", b"T", b"F"):
        return {b"N": None, b"T": True, b"F": False}[tag], at
    if tag == b"t":
        return _TYPES[_TYPE_CODES[blob[at]]], at + 1
    if tag == b"d":
        n = blob[at]
        return dtype_from_name(blob[at + 1 : at + 1 + n].decode(), "CUDA IPC handle record dtype"), at + 1 + n
    if tag == b"b":
        (n,) = struct.unpack_from("<H", blob, at)
        return bytes(blob[at + 2 : at + 2 + n]), at + 2 + n
    if tag == b"D":
        return struct.unpack_from("<h", blob, at)[0], at + 2
    if tag == b"i":
        return struct.unpack_from("<q", blob, at)[0], at + 8
    if tag == b"s":
        items, at = [], at + 1
        for _ in range(blob[at - 1]):
            x, at = _unpack(blob, at)
            items.append(x)
        return tuple(items), at
    raise ValueError(f"CUDA IPC handle record: unknown tag {tag!r} at byte {at - 1}")


def _uuid_bytes(index: int) -> bytes:
    try:
        return uuid.UUID(_uuid(index).removeprefix("GPU-")).bytes
    except ValueError:
        return bytes(16)


def export_compact(tensor: torch.Tensor) -> bytes:
    """One CUDA tensor's IPC handle in the compact binary form (:func:`open_compact`)."""
    from torch.multiprocessing.reductions import reduce_tensor

    _, args = reduce_tensor(tensor.detach())  # type: ignore[no-untyped-call]  # torch: unannotated
    index = tensor.device.index if tensor.device.index is not None else torch.cuda.current_device()
    gpu = _uuid_bytes(index)
    out = bytearray(struct.pack("<B16sB", _COMPACT_VERSION, gpu, index))
    params = _rebuild_params()
    if len(args) != len(params):
        raise RuntimeError(f"torch's reduce_tensor gave {len(args)} arguments for {len(params)} parameters")
    for a in args:
        _pack(a, out)
    return bytes(out)


def open_compact(blob: bytes) -> torch.Tensor:
    """The tensor :func:`export_compact` exported: a view of the exporter's memory.

    Raises:
        ValueError: a malformed record, or a view reaching outside the storage it names.
    """
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    if len(blob) < 18 or blob[0] != _COMPACT_VERSION:
        raise ValueError(f"CUDA IPC handle record: not a compact handle (version {blob[:1]!r}, {len(blob)} bytes)")
    gpu, index = blob[1:17], blob[17]
    dev = index
    if any(gpu):
        found = [i for i in range(torch.cuda.device_count()) if _uuid_bytes(i) == gpu]
        if not found:
            raise RuntimeError(f"GPU {uuid.UUID(bytes=gpu)} is not visible to this process")
        dev = found[0]
    at, kw = 18, {}
    for name in _rebuild_params():
        kw[name], at = _unpack(blob, at)
    kw["storage_device"] = dev
    kw["requires_grad"] = False
    _check_view(kw)
    kw["tensor_size"] = torch.Size(kw["tensor_size"])
    with torch.cuda.device(dev):
        return rebuild_cuda_tensor(**kw)  # type: ignore[no-any-return, no-untyped-call]  # torch: unannotated
