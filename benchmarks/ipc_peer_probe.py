"""Which ways of writing into another GPU's CUDA IPC memory work here (2 GPUs; a diagnostic).

    python benchmarks/ipc_peer_probe.py [--json PATH]

Why: on 2x H200 the reshard IPC push faulted (``illegal memory access``) when a torch strided
copy kernel on the sender's GPU wrote into a receiver's tensor on the other GPU, opened with
torch's IPC rebuild; the same pieces as ``cudaMemcpy2DAsync`` were bit-exact
(``exchange_ipc.py`` therefore sends 2D copies across GPUs). The suspected cause: torch opens
an IPC handle in the *owning* GPU's context, so kernels of the writer's GPU have no mapping of
it; ``cudaIpcOpenMemHandle`` called with the writer's GPU current and
``cudaIpcMemLazyEnablePeerAccess`` should give one. This probe checks that, one fresh pair of
processes per way (a fault poisons a CUDA context): a receiver on GPU 0 exports a zeroed
bf16 matrix, a writer on GPU 1 opens it and writes a known pattern into a column block, the
receiver checks every element.

Ways: ``torch-open + copy-engine`` (torch's rebuild, a contiguous row block: ``cudaMemcpy``),
``torch-open + kernel`` (torch's rebuild, a column block: torch's strided copy kernel),
``writer-ctx-open + kernel`` (the handle opened with the writer's GPU current, the lazy peer
flag, the pointer wrapped as a tensor through ``__cuda_array_interface__``, same kernel).
Prints a table, writes JSON; exits 2 without 2 GPUs. Not yet run (written when the device time
was spent); see issue 12's note.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import multiprocessing as mp
import sys
import traceback
from pathlib import Path
from typing import Any

import torch

ROWS, COLS = 1024, 512
WAYS = ("torch-open + copy-engine", "torch-open + kernel", "writer-ctx-open + kernel")
LAZY_ENABLE_PEER_ACCESS = 0x1  # cudaIpcMemLazyEnablePeerAccess


def _pattern() -> torch.Tensor:
    return (torch.arange(ROWS * COLS, dtype=torch.float32).reshape(ROWS, COLS) % 251).to(torch.bfloat16)


def _region(way: str) -> tuple[slice, slice]:
    # A row block is contiguous in a row-major matrix (one memcpy); a column block is strided.
    return (slice(0, ROWS // 2), slice(None)) if "copy-engine" in way else (slice(None), slice(COLS // 4, COLS // 2))


def _cudart() -> ctypes.CDLL:
    """The CUDA runtime torch already loaded (found in this process's mappings)."""
    torch.cuda.init()
    with open("/proc/self/maps") as f:
        for line in f:
            if "libcudart" in line:
                return ctypes.CDLL(line.split()[-1])
    raise RuntimeError("libcudart is not mapped in this process")


class _Handle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_char * 64)]


class _Cai:
    def __init__(self, ptr: int, shape: tuple[int, ...]) -> None:
        self.__cuda_array_interface__ = {"shape": shape, "typestr": "<i2", "data": (ptr, False), "version": 3}


def _receiver(way: str, conn: Any) -> None:
    try:
        from torch.multiprocessing.reductions import reduce_tensor

        torch.cuda.set_device(0)
        dst = torch.zeros(ROWS, COLS, dtype=torch.bfloat16, device="cuda:0")
        torch.cuda.synchronize()
        _, args = reduce_tensor(dst)
        conn.send(args)
        status = conn.recv()  # the writer's result; the mapping must stay alive until then
        want = torch.zeros(ROWS, COLS, dtype=torch.bfloat16)
        want[_region(way)] = _pattern()[_region(way)]
        got = dst.cpu()
        conn.send({"bit_exact": bool(torch.equal(got.view(torch.int16), want.view(torch.int16))),
                   "wrong_elements": int((got.view(torch.int16) != want.view(torch.int16)).sum()), **status})
    except Exception as e:  # noqa: BLE001 - reported to the parent
        conn.send({"receiver_error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-1500:]})


def _writer(way: str, args: tuple, conn: Any) -> None:
    try:
        from torch.multiprocessing.reductions import rebuild_cuda_tensor

        torch.cuda.set_device(1)
        src = _pattern().to("cuda:1")
        if way.startswith("torch-open"):
            view = rebuild_cuda_tensor(*args)
        else:
            # reduce_tensor's args: (cls, size, stride, offset, storage_cls, dtype, device, handle,
            # storage_size_bytes, storage_offset_bytes, ...): open the block with GPU 1 current.
            size, stride, offset, handle, storage_offset = args[1], args[2], args[3], args[7], args[9]
            rt = _cudart()
            rt.cudaIpcOpenMemHandle.argtypes = [ctypes.POINTER(ctypes.c_void_p), _Handle, ctypes.c_uint]
            ptr = ctypes.c_void_p()
            with torch.cuda.device(1):
                err = rt.cudaIpcOpenMemHandle(ctypes.byref(ptr), _Handle(bytes(handle)), LAZY_ENABLE_PEER_ACCESS)
            if err != 0:
                raise RuntimeError(f"cudaIpcOpenMemHandle from GPU 1 returned {err}")
            base = ptr.value + storage_offset + offset * 2
            view = torch.as_tensor(_Cai(base, tuple(size))).view(torch.bfloat16)
            if tuple(view.stride()) != tuple(stride):
                raise RuntimeError(f"wrapped view has strides {view.stride()}, want {stride}")
        region = _region(way)
        view[region].copy_(src[region], non_blocking=True)
        torch.cuda.synchronize(1)
        torch.cuda.synchronize(view.device)
        conn.send({"writer_ok": True, "view_device": str(view.device)})
    except Exception as e:  # noqa: BLE001 - reported to the parent
        conn.send({"writer_ok": False, "writer_error": f"{type(e).__name__}: {str(e)[:300]}"})


def probe(way: str, timeout: float = 60.0) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    r_parent, r_child = ctx.Pipe()
    w_parent, w_child = ctx.Pipe()
    recv = ctx.Process(target=_receiver, args=(way, r_child), daemon=True)
    recv.start()
    out: dict[str, Any] = {"way": way}
    try:
        if not r_parent.poll(timeout):
            return {**out, "error": "receiver did not export in time"}
        args = r_parent.recv()
        if isinstance(args, dict):
            return {**out, **args}
        writer = ctx.Process(target=_writer, args=(way, args, w_child), daemon=True)
        writer.start()
        status = w_parent.recv() if w_parent.poll(timeout) else {"writer_ok": False, "writer_error": "no answer"}
        writer.join(timeout)
        r_parent.send(status)
        return {**out, **(r_parent.recv() if r_parent.poll(timeout) else {"error": "receiver did not check"})}
    finally:
        for p in mp.active_children():
            p.kill()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=str(Path(__file__).parent / "results" / "ipc_peer_probe.json"))
    args = ap.parse_args()
    if torch.cuda.device_count() < 2:
        print("ipc_peer_probe: needs 2 CUDA GPUs", file=sys.stderr)
        return 2
    rows = [probe(w) for w in WAYS]
    print(f"{'way':28} {'writer':>8} {'bit-exact':>10}  detail")
    for r in rows:
        detail = r.get("writer_error") or r.get("receiver_error") or r.get("error") or r.get("view_device", "")
        print(f"{r['way']:28} {str(r.get('writer_ok')):>8} {str(r.get('bit_exact')):>10}  {detail}")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
