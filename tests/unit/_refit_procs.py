"""Per-rank bodies for the stateless-group and refit tests, each run in a fresh process.

They live in their own module (imported by file-system path, never as ``tests.*``) because a
spawned child re-imports a task's module by name, and pytest's importlib mode gives test
modules names that a child cannot import.
"""

from __future__ import annotations

import contextlib
import faulthandler
import multiprocessing
import multiprocessing.connection
import os
import signal
import socket
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch

from nemo_dataplane.distributed.stateless_group import StatelessProcessGroup
from nemo_dataplane.refit import RefitReceiver, RefitSender

HOST = "127.0.0.1"
HAS_FP8 = hasattr(torch, "float8_e4m3fn")


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


class RemoteTraceback(Exception):
    """The traceback of an exception raised in a rank's process (set as its ``__cause__``)."""

    def __str__(self) -> str:
        return "\n" + str(self.args[0])


class Pool:
    """Starts a fresh process per rank for every ``run_ranks`` call.

    The processes come from a fork server that pre-imports this module (and so torch and
    nemo_dataplane), so a start costs milliseconds instead of a torch import, and each is clean:
    no fork of the pytest process, no state (CUDA contexts, communicators) left by an earlier
    test. No executor queue sits between a test and its ranks: on 2x H200, about one run in ten
    of a ``ProcessPoolExecutor`` lost a submitted task (both workers idle, waiting on an empty
    call queue) and the test hung to its limit.
    """

    def __init__(self, workers: int = 0, preload: tuple[str, ...] = ()) -> None:
        """``workers``: kept for the fixtures' call sites; ``preload``: further modules the fork
        server imports once (a task module that imports more than torch)."""
        self._ctx = multiprocessing.get_context("forkserver")
        self._ctx.set_forkserver_preload([__name__, *preload])
        self._live: list[Any] = []

    def start(self, fn: Callable[..., Any], rank: int, after: float, kw: dict[str, Any]) -> tuple[Any, Any]:
        """(process, connection) running ``fn(rank, **kw)``; its result or exception comes back on the connection."""
        parent, child = self._ctx.Pipe(duplex=False)
        p = self._ctx.Process(target=_rank_main, args=(fn, rank, after, kw, child), daemon=True)
        p.start()
        child.close()
        self._live.append(p)
        return p, parent

    def kill(self, *, dump: bool = False) -> None:
        """Kill the processes still running; ``dump``: first have each print its threads' stacks."""
        live = [p for p in self._live if p.is_alive()]
        if dump and live:
            for p in live:
                with contextlib.suppress(Exception):
                    os.kill(p.pid, signal.SIGUSR1)
            time.sleep(1.0)
        for p in live:
            with contextlib.suppress(Exception):
                p.kill()
        for p in self._live:
            p.join(timeout=5)
        self._live = [p for p in self._live if p.is_alive()]


def _rank_main(fn: Callable[..., Any], rank: int, after: float, kw: dict[str, Any], conn: Any) -> None:
    # A rank that hangs prints every thread's stack before the test gives up on it; SIGUSR1
    # prints them on demand.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    faulthandler.dump_traceback_later(after, exit=False)
    try:
        msg: tuple[bool, Any] = (True, fn(rank, **kw))
    except BaseException as e:  # the rank's own failure is the test's observable
        msg = (False, (e, traceback.format_exc()))
    finally:
        faulthandler.cancel_dump_traceback_later()
    try:
        conn.send(msg)
    except Exception as e:  # an exception or result that does not pickle
        conn.send((False, (RuntimeError(f"rank {rank}: result could not be sent back: {e!r}; {msg[1]!r}"), "")))
    conn.close()


def run_ranks(
    pool: Pool, fn: Callable[..., Any], ranks: list[int], *, limit: float = 60.0, **kw: Any
) -> dict[int, Any]:
    """Run ``fn(rank, **kw)`` for each rank concurrently, each in a fresh process; return rank ->
    result or the exception it raised (with its traceback as ``__cause__``). A rank still
    running after ``limit`` seconds fails the test, after every rank's stacks were printed."""
    started = {r: pool.start(fn, r, max(1.0, limit - 5.0), kw) for r in ranks}
    conns = {conn: r for r, (_, conn) in started.items()}
    out: dict[int, Any] = {}
    deadline = time.monotonic() + limit
    while conns:
        left = deadline - time.monotonic()
        ready = multiprocessing.connection.wait(list(conns), timeout=max(0.0, left))
        if not ready:
            pool.kill(dump=True)
            late = sorted(conns.values())
            raise AssertionError(f"rank {late[0]} of {fn.__name__} still running after {limit}s")
        for conn in ready:
            r = conns.pop(conn)
            try:
                ok, payload = conn.recv()
            except EOFError:
                proc = started[r][0]
                proc.join(timeout=5)
                out[r] = RuntimeError(f"rank {r} of {fn.__name__} died (exit code {proc.exitcode}) without a result")
                continue
            if ok:
                out[r] = payload
            else:
                exc, tb = payload
                exc.__cause__ = RemoteTraceback(tb)
                out[r] = exc
    # Every body has returned (its own cleanup included); interpreter teardown is not worth
    # waiting for.
    pool.kill()
    return out


def _dev(backend: str, rank: int) -> torch.device:
    return torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")


def _group(
    rank: int, world: int, port: int, backend: str, timeout: float = 20.0, *, gpu: int | None = None, **kw: Any
) -> StatelessProcessGroup:
    """Join a group; with nccl, on GPU ``gpu`` (default: the rank's index)."""
    if backend == "nccl":
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
        gpu = rank if gpu is None else gpu
        torch.cuda.set_device(gpu)
        kw["device"] = gpu
    return StatelessProcessGroup(HOST, port, rank, world, backend, timeout, **kw)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """Bit pattern of ``t`` on the CPU, for exact comparison of any dtype (fp8 included)."""
    t = t.detach().contiguous().cpu()
    return t.reshape(-1).view(torch.uint8).clone() if t.dtype != torch.bool else t.to(torch.uint8).reshape(-1)


# ---------------------------------------------------------------- group bodies


def collectives(rank: int, world: int, port: int, backend: str = "gloo") -> dict[str, Any]:
    """Broadcast of several dtypes, all_reduce, ring send/recv, barrier."""
    g = _group(rank, world, port, backend)
    dev = _dev(backend, rank)
    res: dict[str, Any] = {"init_seconds": g.init_seconds}
    gen = torch.Generator().manual_seed(1234)
    payloads = {
        "f32": torch.randn(33, generator=gen),
        "bf16": torch.randn(7, 5, generator=gen).to(torch.bfloat16),
        "i64": torch.randint(-(2**40), 2**40, (9,), generator=gen),
        "bool": torch.rand(11, generator=gen) > 0.5,
    }
    if HAS_FP8:
        payloads["fp8_e4m3"] = torch.randn(6, 4, generator=gen).to(torch.float8_e4m3fn)
        payloads["fp8_e5m2"] = torch.randn(13, generator=gen).to(torch.float8_e5m2)
    for name, ref in payloads.items():
        t = ref.to(dev) if rank == 0 else torch.zeros_like(ref, device=dev)
        g.broadcast(t, src=0)
        g.synchronize()
        res[f"bcast_{name}"] = bool(torch.equal(_bytes(t), _bytes(ref)))
    s = torch.full((5,), float(rank + 1), device=dev)
    g.all_reduce(s, "sum")
    m = torch.full((3,), rank, dtype=torch.int64, device=dev)
    g.all_reduce(m, "max")
    g.synchronize()
    res["sum"] = s.cpu().tolist()
    res["max"] = m.cpu().tolist()
    # Ring: even ranks send first so blocking gloo send/recv cannot deadlock.
    nxt, prv = (rank + 1) % world, (rank - 1) % world
    out = torch.arange(4, device=dev) + 100 * rank
    inbox = torch.zeros(4, dtype=torch.int64, device=dev)
    if rank % 2 == 0:
        g.send(out, nxt)
        g.recv(inbox, prv)
    else:
        g.recv(inbox, prv)
        g.send(out, nxt)
    g.synchronize()
    res["ring"] = inbox.cpu().tolist()
    for _ in range(3):
        g.barrier()
    g.destroy()
    return res


def join_then_idle(
    rank: int, world: int, port: int, timeout: float, backend: str = "gloo", skip: str = ""
) -> dict[str, Any]:
    """Join a group; then rank 0 waits on rank 1, which stays silent for ``skip`` ("barrier": a
    barrier, "send": a recv on rank 0, "bcast": a broadcast from rank 1)."""
    t0 = time.monotonic()
    try:
        g = _group(rank, world, port, backend, timeout)
    except Exception as e:
        return {"error": type(e).__name__, "msg": str(e), "elapsed": time.monotonic() - t0}
    try:
        if not (skip == "barrier" and rank != 0):
            t0 = time.monotonic()
            g.barrier()
        if rank == 0 and skip == "send":
            t0 = time.monotonic()
            g.recv(torch.zeros(3, device=g.device), 1)
            g.synchronize()
        if rank == 0 and skip == "bcast":
            # A collective whose data must come from the silent rank: cannot complete locally.
            t0 = time.monotonic()
            g.broadcast(torch.zeros(1 << 20, device=g.device), src=1)
            g.synchronize()
        return {"error": None}
    except Exception as e:
        return {"error": type(e).__name__, "msg": str(e), "elapsed": time.monotonic() - t0}
    finally:
        if skip and rank != 0:
            # Let the peer's bounded wait expire before our group (and the store) go away.
            time.sleep(timeout + 1.0)
        if skip and backend == "nccl":
            g._abort()  # the peer aborted its side; a collective destroy could wait on it
        else:
            g.destroy()


def wait_until_aborted(rank: int, world: int, port: int, stage: str, secret: str) -> dict[str, Any]:
    """Wait on a peer that never comes, until an abort is posted from outside (timeouts 120 s).
    ``stage``: "rendezvous" (``world`` counts a rank that never joins) or "barrier" (every rank
    joins; rank 1 never enters the barrier and leaves once it sees the abort)."""
    from nemo_dataplane.distributed.abort import posted_abort

    t0 = time.monotonic()
    try:
        g = _group(rank, world, port, "gloo", 120.0, secret=secret)
        if stage == "barrier" and rank == 1:
            while posted_abort(g.store, g.prefix) is None:
                time.sleep(0.01)
            return {"error": None, "elapsed": time.monotonic() - t0}
        t0 = time.monotonic()
        g.barrier()
        return {"error": None, "elapsed": time.monotonic() - t0}
    except Exception as e:
        return {"error": type(e).__name__, "msg": str(e), "elapsed": time.monotonic() - t0}


def collective_until_aborted(rank: int, world: int, port: int, secret: str, flags: str) -> dict[str, Any]:
    """Ranks 0 and 1 enter a gloo all_reduce that rank 2 (alive, in the group) never enters, until
    an abort is posted from outside (timeouts 120 s); each then leaves the group
    (``destroy(abort=True)``) with the all_reduce still pending in gloo, and marks ``flags/r``.
    Rank 2 stays alive until both marks are there (so gloo's op stays pending throughout)."""
    from pathlib import Path

    from nemo_dataplane.distributed.abort import posted_abort

    g = _group(rank, world, port, "gloo", 120.0, secret=secret)
    if rank == 2:
        while posted_abort(g.store, g.prefix) is None:
            time.sleep(0.01)
        deadline = time.monotonic() + 60
        while not all((Path(flags) / str(r)).exists() for r in (0, 1)) and time.monotonic() < deadline:
            time.sleep(0.05)
        return {"error": None}
    t0 = time.monotonic()
    out: dict[str, Any] = {"error": None}
    try:
        g.all_reduce(torch.ones(4))
    except Exception as e:
        out.update(error=type(e).__name__, msg=str(e))
    out["elapsed"] = time.monotonic() - t0
    t1 = time.monotonic()
    g.destroy(abort=True)
    out["destroy_s"] = time.monotonic() - t1
    (Path(flags) / str(rank)).write_text("done")
    return out


def two_groups(rank: int, ports: tuple[int, int], backend: str = "gloo") -> dict[str, Any]:
    """Three groups in each of two processes: A, B sharing A's store, C with swapped ranks."""
    a = _group(rank, 2, ports[0], backend, group_name="a", gpu=rank)
    b = _group(rank, 2, ports[0], backend, group_name="b", gpu=rank, store=a.store)
    c = _group(1 - rank, 2, ports[1], backend, group_name="c", gpu=rank)
    dev = a.device
    res = {}
    for name, g in (("a", a), ("b", b), ("c", c)):
        val = {"a": 11, "b": 22, "c": 33}[name]
        t = torch.full((4,), val if g.rank == 0 else -1, dtype=torch.int32, device=dev)
        g.broadcast(t, 0)
        g.synchronize()
        res[name] = (g.rank, t.cpu().tolist())
    # Refit in both directions over two groups of the same process.
    tensors = {"w": torch.arange(12, dtype=torch.float32, device=dev).reshape(3, 4) * (rank + 1)}
    if a.rank == 0:
        snd = RefitSender(a, tensors, bucket_bytes=1024)
        snd.prepare_refit_info()
        snd.send_weights(5)
        dst = {"w": torch.zeros(3, 4, device=dev)}
        rcv = RefitReceiver(c, dst)
        rcv.prepare_refit_info()
        res["got"] = (rcv.receive_weights(), dst["w"].cpu().tolist())
    else:
        dst = {"w": torch.zeros(3, 4, device=dev)}
        rcv = RefitReceiver(a, dst)
        rcv.prepare_refit_info()
        got = (rcv.receive_weights(), dst["w"].cpu().tolist())
        snd = RefitSender(c, tensors, bucket_bytes=1024)
        snd.prepare_refit_info()
        snd.send_weights(6)
        res["got"] = got
    for g in (c, b, a):
        g.destroy()
    return res


# ---------------------------------------------------------------- refit bodies


def model_tensors(seed: int, dev: torch.device, *, big_numel: int = 3000) -> dict[str, torch.Tensor]:
    """A small model's worth of tensors covering every path of the refit plan."""
    gen = torch.Generator().manual_seed(seed)
    t: dict[str, torch.Tensor] = {
        "embed.weight": torch.randn(40, 16, generator=gen).to(torch.bfloat16),
        "layers.0.attn.qkv": torch.randn(48, 16, generator=gen).to(torch.bfloat16),
        "layers.0.mlp.up": torch.randn(16, 24, generator=gen),  # fp32
        "layers.0.norm": torch.randn(16, generator=gen).to(torch.float16),
        "layers.0.scale": torch.randn((), generator=gen),  # 0-dim
        "layers.0.empty": torch.zeros(0, 5),
        "buffers.positions": torch.randint(-(2**50), 2**50, (17,), generator=gen),
        "buffers.mask": torch.rand(3, 7, generator=gen) > 0.3,
        "buffers.i8": torch.randint(-128, 127, (21,), generator=gen, dtype=torch.int8),
        "lm_head.big": torch.randn(big_numel, generator=gen),  # larger than a test bucket
    }
    if HAS_FP8:
        t["layers.0.mlp.down_fp8"] = torch.randn(24, 16, generator=gen).to(torch.float8_e4m3fn)
        t["layers.0.mlp.down_scale_fp8"] = torch.randn(5, generator=gen).to(torch.float8_e5m2)
    return {k: v.to(dev) for k, v in t.items()}


def _noncontig(t: torch.Tensor) -> torch.Tensor:
    """Same values, transposed storage: a non-contiguous view."""
    return t.t().contiguous().t() if t.dim() == 2 else t


def _step_in_place(src: dict[str, torch.Tensor], i: int, dev: torch.device) -> None:
    """Refit ``i``'s values (``model_tensors(i)``) written into ``src`` in place, as an optimizer
    step would; refit 0 keeps the initial values."""
    if i:
        fresh = model_tensors(i, dev)
        for k in src:
            src[k].copy_(fresh[k])


def refit_roundtrip(
    rank: int,
    world: int,
    port: int,
    backend: str = "gloo",
    bucket_bytes: int = 4096,
    direct_bytes: int | None = None,
    versions: tuple[int, ...] = (7, 8),
    transport: str = "auto",
    defaults: bool = False,
) -> dict[str, Any]:
    """Refit ``model_tensors`` twice (different values, versions); receivers return bit patterns."""
    g = _group(rank, world, port, backend)
    dev = g.device
    if rank == 0:
        src = model_tensors(0, dev)
        # Non-contiguous sender tensors exercise packing from strided views.
        src = {k: (_noncontig(v) if k in ("layers.0.attn.qkv", "layers.0.mlp.up") else v) for k, v in src.items()}
        if defaults:  # RefitSender's own defaults for this backend
            snd = RefitSender(g, lambda: src)
        else:
            snd = RefitSender(g, lambda: src, bucket_bytes=bucket_bytes, direct_bytes=direct_bytes, transport=transport)
        info = snd.prepare_refit_info()
        for i, v in enumerate(versions):
            _step_in_place(src, i, dev)
            snd.send_weights(v)
        g.barrier()
        g.destroy()
        return {"n_tensors": len(info.tensors), "transport": info.transport, "direct_bytes": info.direct_bytes}
    dst = {k: torch.zeros_like(v) for k, v in model_tensors(0, dev).items()}
    dst["layers.0.mlp.up"] = _noncontig(dst["layers.0.mlp.up"])  # receive into a strided view
    dst["lm_head.big"] = torch.zeros(2 * dst["lm_head.big"].numel(), device=dev)[::2]  # strided, direct
    rcv = RefitReceiver(g, list(dst.items()))  # pairs, not a dict
    rcv.prepare_refit_info()
    got = []
    for i in range(len(versions)):
        v = rcv.receive_weights()
        want = model_tensors(i, torch.device("cpu"))
        wrong = [k for k in want if not torch.equal(_bytes(dst[k]), _bytes(want[k]))]
        got.append({"version": v, "attr_version": rcv.version, "wrong": wrong})
    g.barrier()
    g.destroy()
    return {"refits": got, "transport": rcv.info.transport}


def refit_mismatch(
    rank: int, world: int, port: int, bad_ranks: tuple[int, ...] = (1,), backend: str = "gloo", transport: str = "auto"
) -> dict[str, Any]:
    """Receivers in ``bad_ranks`` hold a layout that differs in name, shape and dtype."""
    g = _group(rank, world, port, backend)
    dev = g.device
    base = {
        "a": torch.ones(4, 4, device=dev),
        "b": torch.ones(8, dtype=torch.bfloat16, device=dev),
        "c": torch.ones(3, device=dev),
    }
    if rank == 0:
        tensors = base
    else:
        tensors = {k: torch.zeros_like(v) for k, v in base.items()}
        if rank in bad_ranks:
            tensors = {
                "a": torch.zeros(4, 5, device=dev),  # shape
                "b": torch.zeros(8, dtype=torch.float32, device=dev),  # dtype
                "extra": torch.zeros(2, device=dev),
            }  # "c" missing, "extra" unexpected
    try:
        ep = RefitSender(g, tensors, bucket_bytes=1024, transport=transport) if rank == 0 else RefitReceiver(g, tensors)
        ep.prepare_refit_info()
        out = {"error": None}
    except Exception as e:
        out = {"error": type(e).__name__, "msg": str(e)}
    if rank != 0:
        out["untouched"] = all(bool((t == 0).all()) for t in tensors.values())
    g.destroy()
    return out


def refit_sender_abort(rank: int, world: int, port: int, backend: str = "gloo", **sender_kw: Any) -> dict[str, Any]:
    """The sender's tensor changes shape after prepare: it must abort and receivers must hear
    why; then, with the layout restored, the next refit on the same group must work."""
    g = _group(rank, world, port, backend, timeout=10.0)
    dev = g.device
    holder = {"w": torch.ones(6, device=dev)}
    dst = {"w": torch.zeros(6, device=dev)}
    ep = RefitSender(g, lambda: holder, bucket_bytes=1024, **sender_kw) if rank == 0 else RefitReceiver(g, dst)
    ep.prepare_refit_info()
    try:
        if rank == 0:
            holder["w"] = torch.ones(7, device=dev)
            ep.send_weights(3)
        else:
            ep.receive_weights()
        out: dict[str, Any] = {"error": None}
    except Exception as e:
        out = {"error": type(e).__name__, "msg": str(e)}
    holder["w"] = torch.full((6,), 5.0, device=dev)
    if rank == 0:
        ep.send_weights(4)
    else:
        out["next_version"] = ep.receive_weights()
        out["next_values"] = dst["w"].cpu().tolist()
    g.destroy()
    return out


def refit_missing_receiver(rank: int, world: int, port: int, timeout: float, backend: str = "gloo") -> dict[str, Any]:
    """The last rank joins the group but never takes part in the refit handshake."""
    g = _group(rank, world, port, backend, timeout=timeout)
    t0 = time.monotonic()
    try:
        if rank == world - 1:
            time.sleep(timeout + 1.0)  # keep the group (and its store entry) alive, do nothing
            return {"error": None}
        tensors = {"w": torch.ones(4, device=g.device)}
        ep = RefitSender(g, tensors) if rank == 0 else RefitReceiver(g, tensors)
        ep.prepare_refit_info()
        return {"error": None}
    except Exception as e:
        return {"error": type(e).__name__, "msg": str(e), "elapsed": time.monotonic() - t0}
    finally:
        g.destroy()


def format_exc(e: BaseException) -> str:
    return "".join(traceback.format_exception(e))


def _listening_addresses() -> list[str]:
    """The addresses this process's listening TCP sockets are bound to (from /proc: no psutil)."""
    import ipaddress

    mine = set()
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            link = os.readlink(f"/proc/self/fd/{fd}")
            if link.startswith("socket:["):
                mine.add(link[8:-1])
    out = []
    for table, v6 in (("/proc/net/tcp", False), ("/proc/net/tcp6", True)):
        with contextlib.suppress(OSError), open(table) as f:
            for line in list(f)[1:]:
                cols = line.split()
                if cols[3] != "0A" or cols[9] not in mine:  # 0A: LISTEN
                    continue
                raw = bytes.fromhex(cols[1].split(":")[0])
                # /proc prints the address as 32-bit words in host (little-endian) order.
                words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
                out.append(str(ipaddress.IPv6Address(words) if v6 else ipaddress.IPv4Address(words)))
    return out


def routable_interface() -> str | None:
    """A non-loopback interface of this host, if it has one (to point the collectives' interface
    variables away from loopback)."""
    names = [n for _, n in socket.if_nameindex() if n not in ("lo", "lo0")]
    return names[0] if names else None


def listeners(rank: int, world: int, port: int, backend: str = "gloo", interface: str | None = None) -> list[str]:
    """Join a group hosted on loopback with ``GLOO_SOCKET_IFNAME`` / ``NCCL_SOCKET_IFNAME`` set to
    ``interface`` (a routable one) and return where this rank's sockets listen once it is up."""
    if interface:
        os.environ["GLOO_SOCKET_IFNAME"] = os.environ["NCCL_SOCKET_IFNAME"] = interface
    g = _group(rank, world, port, backend)
    try:
        found = _listening_addresses()
        g.barrier()
        return found
    finally:
        g.destroy()
