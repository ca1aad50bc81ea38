"""Which ways of writing into another GPU's CUDA IPC memory work here (2 GPUs; a diagnostic).

    python benchmarks/ipc_peer_probe.py [--json PATH]

Why: on 2x H200 the reshard IPC push faulted (``illegal memory access``) when a torch strided
copy kernel on the sender's GPU wrote into a receiver's tensor on the other GPU, opened with
torch's IPC rebuild; the same pieces as ``cudaMemcpy2DAsync`` were bit-exact
(``refit/reshard/ipc_push.py`` therefore sends 2D copies where torch opened the memory). The
suspected cause: torch opens an IPC handle in the *owning* GPU's context, so kernels of the
writer's GPU have no mapping of it; ``cudaIpcOpenMemHandle`` called with the writer's GPU current and
``cudaIpcMemLazyEnablePeerAccess`` should give one. This probe checks that, one fresh pair of
processes per way (a fault poisons a CUDA context): a receiver on GPU 0 exports a zeroed
bf16 matrix, a writer on GPU 1 opens it and writes a known pattern into a column block, the
receiver checks every element.

Ways: ``torch-open + copy-engine`` (torch's rebuild, a contiguous row block: ``cudaMemcpy``),
``torch-open + kernel`` (torch's rebuild, a column block: torch's strided copy kernel),
``writer-ctx-open + kernel`` (the handle opened with the writer's GPU current, the lazy peer
flag, the pointer wrapped as a tensor through ``__cuda_array_interface__``, same kernel).
``writer-ctx-open (bindings) + kernel``: the same open through cuda-bindings (what
``nemo_dataplane.refit.cuda.ipc.PeerMapping`` does). Prints a table, writes JSON; exits 2 without 2
GPUs. Session 7, 2x H200: the copy-engine write and the bindings open + kernel are bit-exact;
torch's open + kernel faults; the ctypes open is refused (``cudaErrorInvalidValue``, also with
the owner's GPU current: the ctypes call, not the context; torch's handle is 66 bytes, version
and kind before the 64-byte ``cudaIpcMemHandle_t``).

``--rates``: how fast each *route* of a cross-GPU IPC copy runs, since copies work but the
reshard's cross-GPU pushes ran at ~300 GB/s against ~395 for a peer copy. A process on GPU 1
holds the source, one on GPU 0 the destination (each opens the other's buffer with torch); a
1 GiB contiguous copy and a 0.5 GiB column block (``cudaMemcpy2DAsync``) go

* ``push, writer's GPU``: the source's process, on a stream of GPU 1 (what the reshard does);
* ``push, owner's GPU``: the source's process, on a stream of GPU 0 (where torch opened the view);
* ``pull, source's GPU`` / ``pull, reader's GPU``: the destination's process, its stream on GPU 1 / 0;
* ``peer copy``: one process, plain allocations on both GPUs, peer access on (the ceiling).

Each route runs first as opened, then again after both processes enabled peer access (a tiny
torch copy across GPUs each way), since session 7 found the routes at 38 GB/s without it.
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
WAYS = (
    "torch-open + copy-engine",
    "torch-open + kernel",
    "writer-ctx-open + kernel",
    "writer-ctx-open (bindings) + kernel",
)
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
        conn.send(
            {
                "bit_exact": bool(torch.equal(got.view(torch.int16), want.view(torch.int16))),
                "wrong_elements": int((got.view(torch.int16) != want.view(torch.int16)).sum()),
                **status,
            }
        )
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
            raw = bytes(handle)  # torch prefixes the 64-byte cudaIpcMemHandle_t: version, kind ('c')
            if way.startswith("writer-ctx-open (bindings)"):
                from cuda.bindings import runtime as cbr  # type: ignore[import-not-found]

                h = cbr.cudaIpcMemHandle_t()
                h.reserved = raw[-64:]
                with torch.cuda.device(1):
                    err, addr = cbr.cudaIpcOpenMemHandle(h, cbr.cudaIpcMemLazyEnablePeerAccess)
                if err != cbr.cudaError_t.cudaSuccess:
                    raise RuntimeError(f"cuda-bindings cudaIpcOpenMemHandle from GPU 1: {err}")
                ptr_value = int(addr)
            else:
                ptr = ctypes.c_void_p()
                with torch.cuda.device(1):
                    err = rt.cudaIpcOpenMemHandle(ctypes.byref(ptr), _Handle(raw[-64:]), LAZY_ENABLE_PEER_ACCESS)
                if err != 0:
                    raise RuntimeError(
                        f"cudaIpcOpenMemHandle from GPU 1 returned {err}; "
                        f"handle {len(raw)} bytes, starts {raw[:4].hex()}"
                    )
                ptr_value = ptr.value
            base = ptr_value + storage_offset + offset * 2
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


RATE_BYTES = 1 << 30
ROW_BYTES = 16384  # a bf16 row of 8192: the column block is half of every row
ROUTES = ("push, writer's GPU", "push, owner's GPU", "pull, source's GPU", "pull, reader's GPU", "peer copy")


def _time_route(rt: ctypes.CDLL, stream: torch.cuda.Stream, dst: int, src: int, iters: int = 10) -> dict[str, float]:
    """Median ms of the 1 GiB contiguous copy and of the 0.5 GiB column block, each issued on
    ``stream`` and waited for on the host."""
    import statistics
    import time

    rt.cudaMemcpyAsync.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
    rt.cudaMemcpy2DAsync.argtypes = [
        ctypes.c_void_p,
        ctypes.c_size_t,
        ctypes.c_void_p,
        ctypes.c_size_t,
        ctypes.c_size_t,
        ctypes.c_size_t,
        ctypes.c_int,
        ctypes.c_void_p,
    ]
    h = ctypes.c_void_p(stream.cuda_stream)
    rows = RATE_BYTES // ROW_BYTES
    out: dict[str, float] = {}
    for name, fn in (
        ("flat", lambda: rt.cudaMemcpyAsync(dst, src, RATE_BYTES, 4, h)),
        ("column", lambda: rt.cudaMemcpy2DAsync(dst, ROW_BYTES, src, ROW_BYTES, ROW_BYTES // 2, rows, 4, h)),
    ):
        ts = []
        for i in range(iters + 2):
            t0 = time.perf_counter()
            err = fn()
            if err != 0:
                raise RuntimeError(f"{name} copy returned {err}")
            stream.synchronize()
            if i >= 2:
                ts.append(time.perf_counter() - t0)
        ms = statistics.median(ts) * 1e3
        moved = RATE_BYTES if name == "flat" else RATE_BYTES // 2
        out[f"{name}_ms"] = ms
        out[f"{name}_GBps"] = moved / ms / 1e6
    return out


PIECES = (
    (16 << 20, 1, 0),
    (16 << 20, 4, 0),
    (16 << 20, 0, 0),
    (2 << 20, 1, 0),
    (2 << 20, 4, 0),
    (2 << 20, 0, 0),
    (16 << 20, 1, 2432),
    (16 << 20, 4, 2432),
)  # 0 streams: batched calls


def _pieces(
    rt: ctypes.CDLL, dst: torch.Tensor, src: torch.Tensor, size: int, streams: int, width: int, iters: int = 10
) -> dict[str, float]:
    """1 GiB as pieces of ``size`` bytes (``width`` > 0: each piece a column block of rows
    ``width`` bytes wide in rows of ``2 * width``, as a row-parallel weight's half), issued
    round-robin on ``streams`` streams of the writer's GPU (0: flat pieces as the library's
    batched calls, ``PeerCopier``, on one stream); median ms of the whole and GB/s."""
    import statistics
    import time

    rt.cudaMemcpyAsync.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
    rt.cudaMemcpy2DAsync.argtypes = [
        ctypes.c_void_p,
        ctypes.c_size_t,
        ctypes.c_void_p,
        ctypes.c_size_t,
        ctypes.c_size_t,
        ctypes.c_size_t,
        ctypes.c_int,
        ctypes.c_void_p,
    ]
    ss = [torch.cuda.Stream(src.device) for _ in range(max(1, streams))]
    hs = [ctypes.c_void_p(x.cuda_stream) for x in ss]
    n = RATE_BYTES // size
    d0, s0 = dst.data_ptr(), src.data_ptr()
    moved = RATE_BYTES if not width else RATE_BYTES // 2
    copier = None
    if streams == 0:
        from nemo_dataplane.refit.cuda.ipc import PeerCopier

        copier = PeerCopier()
        runs = [[d0 + k * size, s0 + k * size, size, []] for k in range(n)]
    ts = []
    for i in range(iters + 2):
        t0 = time.perf_counter()
        if copier is not None:
            copier.issue(runs, [], ss[0], ss)
            if copier.mode != "batch":
                raise RuntimeError(f"no batched copies here: {copier.batch_error or copier.raw_error}")
        for k in range(n if copier is None else 0):
            h = hs[k % streams]
            off = k * size
            err = (
                rt.cudaMemcpyAsync(d0 + off, s0 + off, size, 4, h)
                if not width
                else rt.cudaMemcpy2DAsync(d0 + off, 2 * width, s0 + off, 2 * width, width, size // (2 * width), 4, h)
            )
            if err != 0:
                raise RuntimeError(f"piece copy returned {err}")
        for x in ss:
            x.synchronize()
        if i >= 2:
            ts.append(time.perf_counter() - t0)
    ms = statistics.median(ts) * 1e3
    return {"ms": ms, "GBps": moved / ms / 1e6}


def _rate_proc(gpu: int, conn: Any) -> None:
    """Owns a 1 GiB buffer on ``gpu`` (GPU 1: the source, random bytes; GPU 0: the destination),
    exports it, opens the other one, and times the routes it is asked for."""
    try:
        from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor

        torch.cuda.set_device(gpu)
        rt = _cudart()
        mine = (
            torch.randint(0, 255, (RATE_BYTES,), dtype=torch.uint8, device=f"cuda:{gpu}")
            if gpu == 1
            else torch.zeros(RATE_BYTES, dtype=torch.uint8, device=f"cuda:{gpu}")
        )
        torch.cuda.synchronize()
        conn.send(reduce_tensor(mine)[1])
        other = rebuild_cuda_tensor(*conn.recv())
        while True:
            route = conn.recv()
            if route is None:
                break
            if route == "enable peer access":
                there = torch.empty(1, dtype=torch.uint8, device=f"cuda:{1 - gpu}")
                there.copy_(mine[:1])  # torch's cross-GPU copies enable peer access (both ways here)
                mine[:1].copy_(there)
                torch.cuda.synchronize()
                conn.send({})
                continue
            if isinstance(route, tuple):  # ("pieces", size, streams, column_width): push, writer's GPU
                try:
                    conn.send(_pieces(rt, other, mine, *route[1:]))
                except Exception as e:  # noqa: BLE001 - reported to the parent
                    conn.send({"error": f"{type(e).__name__}: {str(e)[:300]}"})
                continue
            route = route.split(" (")[0]
            try:
                if route == "peer copy":
                    there = torch.empty(RATE_BYTES, dtype=torch.uint8, device=f"cuda:{1 - gpu}")
                    dst, src = (there, mine) if gpu == 1 else (mine, there)
                    there[:1].copy_(mine[:1])  # torch enables peer access both ways, as for its copies
                    mine[:1].copy_(there[:1])
                    stream = torch.cuda.Stream(1)
                else:
                    dst, src = (other, mine) if route.startswith("push") else (mine, other)
                    on = 1 if route.endswith(("writer's GPU", "source's GPU")) else 0
                    stream = torch.cuda.Stream(on)
                dst.zero_()
                torch.cuda.synchronize(dst.device)
                res = _time_route(rt, stream, dst.data_ptr(), src.data_ptr())
                torch.cuda.synchronize(dst.device)
                res["bit_exact"] = bool(torch.equal(dst.cpu(), src.cpu()))
                conn.send(res)
            except Exception as e:  # noqa: BLE001 - reported to the parent
                conn.send({"error": f"{type(e).__name__}: {str(e)[:300]}"})
    except Exception as e:  # noqa: BLE001 - reported to the parent
        conn.send({"error": f"{type(e).__name__}: {str(e)[:300]}", "trace": traceback.format_exc()[-1500:]})


def rates(timeout: float = 120.0) -> list[dict[str, Any]]:
    ctx = mp.get_context("spawn")
    pipes = [ctx.Pipe() for _ in range(2)]
    procs = [ctx.Process(target=_rate_proc, args=(g, pipes[g][1]), daemon=True) for g in range(2)]
    for p in procs:
        p.start()
    rows: list[dict[str, Any]] = []
    try:
        handles = [pipes[g][0].recv() if pipes[g][0].poll(timeout) else None for g in range(2)]
        if any(h is None or isinstance(h, dict) for h in handles):
            return [{"route": "setup", "error": str(handles)}]
        pipes[0][0].send(handles[1])
        pipes[1][0].send(handles[0])
        for route in (
            [r for r in ROUTES if r != "peer copy"] + ["enable peer access"] + [f"{r} (peer on)" for r in ROUTES]
        ):
            for g in (0, 1) if route == "enable peer access" else (1 if route.startswith(("push", "peer")) else 0,):
                pipes[g][0].send(route)
                res = pipes[g][0].recv() if pipes[g][0].poll(timeout) else {"error": "no answer"}
            if route != "enable peer access":
                rows.append({"route": route, **res})
        for size, streams, width in PIECES:
            pipes[1][0].send(("pieces", size, streams, width))
            res = pipes[1][0].recv() if pipes[1][0].poll(timeout) else {"error": "no answer"}
            kind = f"column {width} B of {2 * width}" if width else "flat"
            how = f"{streams} stream(s)" if streams else "batched"
            rows.append({"route": f"pieces {size >> 20} MiB {kind}, {how}", **res})
        for g in range(2):
            pipes[g][0].send(None)
        return rows
    finally:
        for p in procs:
            p.join(5)
            if p.is_alive():
                p.kill()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=str(Path(__file__).parent / "results" / "ipc_peer_probe.json"))
    ap.add_argument("--rates", action="store_true", help="time the routes of a cross-GPU IPC copy instead")
    args = ap.parse_args()
    if torch.cuda.device_count() < 2:
        print("ipc_peer_probe: needs 2 CUDA GPUs", file=sys.stderr)
        return 2
    if args.rates:
        rows = rates()
        print(f"{'route':32} {'1 GiB flat ms':>14} {'GB/s':>7} {'0.5 GiB column ms':>18} {'GB/s':>7}  exact")
        for r in rows:
            if "error" in r:
                print(f"{r['route']:32} {r['error']}")
                continue
            if "GBps" in r:
                print(f"{r['route']:44} {r['ms']:8.3f} ms {r['GBps']:7.1f} GB/s")
                continue
            print(
                f"{r['route']:32} {r['flat_ms']:14.3f} {r['flat_GBps']:7.1f} {r['column_ms']:18.3f} "
                f"{r['column_GBps']:7.1f}  {r['bit_exact']}"
            )
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(rows, indent=1))
        return 0
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
