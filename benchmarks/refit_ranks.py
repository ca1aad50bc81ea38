"""The two ranks of ``bench_refit.py`` (packed, per-tensor and CUDA IPC refit against the
group's and ``torch.distributed``'s own broadcasts), each run in a fresh process by
``refit_model.run_ranks``."""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import time
from typing import Any

import torch
from refit_model import HOST, checksum, llama_shapes, summarize

from nemo_dataplane.distributed.stateless_group import StatelessProcessGroup
from nemo_dataplane.refit import RefitReceiver, RefitSender
from nemo_dataplane.refit.cuda.ipc import PeerCopier

FIRST_CALL_BYTES = PeerCopier.FIRST_CALL_BYTES


def refit_rank(rank: int, port: int, args: argparse.Namespace) -> dict[str, Any]:
    """One rank of ``bench_refit.py``'s two (0: the trainer, sender; 1: the generator, receiver):
    times every refit mode and the group's own baselines; rank 0 returns the results."""
    cuda = args.device == "cuda"
    backend = "nccl" if cuda else "gloo"
    if cuda:
        torch.cuda.set_device(rank)
        torch.cuda.init()
    dev = torch.device("cuda", rank) if cuda else torch.device("cpu")
    out: dict[str, Any] = {}

    def group(name: str, store: Any = None) -> StatelessProcessGroup:
        return StatelessProcessGroup(
            HOST,
            port,
            rank,
            2,
            backend,
            timeout=120,
            device=rank if cuda else None,
            group_name=name,
            store=store,
            nccl_config=args.nccl_config,
        )

    t0 = time.perf_counter()
    g = group("bench")
    out["init_cold_s"] = time.perf_counter() - t0  # includes waiting for the peer process to start
    g.barrier()
    out["init_warm_s"] = float("nan")
    if not args.matrix:
        t0 = time.perf_counter()
        g2 = group("bench-warm", store=g.store)
        out["init_warm_s"] = time.perf_counter() - t0
        g2.destroy()

    shapes = llama_shapes(args.params)
    gen = torch.Generator(device=dev).manual_seed(0)
    if rank == 0:
        tensors = {
            n: torch.randn(s, generator=gen, device=dev, dtype=torch.float32).to(torch.bfloat16) for n, s in shapes
        }
    else:
        tensors = {n: torch.zeros(s, device=dev, dtype=torch.bfloat16) for n, s in shapes}
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    out.update(n_tensors=len(tensors), n_params=sum(t.numel() for t in tensors.values()), nbytes=nbytes)
    tiny = torch.zeros(1, device=dev)

    def sync_point() -> None:
        # A device-level barrier: both hosts leave it within ~0.1 ms of each other.
        g.all_reduce(tiny)
        g.synchronize()

    def timed(name: str, run_send: Any, run_recv: Any, nbytes_moved: int, ep: Any = None) -> None:
        times = []
        phases: list[dict[str, float]] = []
        for i in range(args.warmup + args.iters):
            sync_point()
            t_start = time.perf_counter()
            if rank == 0:
                run_send(i)
            else:
                run_recv(i)
                t_end = time.perf_counter()
            if rank == 0:
                sph = dict(getattr(ep, "ipc_phases", {}) or {})
                pushed = "copy_gpu_ms" in sph and i >= args.warmup
                if pushed:
                    phases.append(
                        {
                            "gate_host": (sph["t_gate"] - sph["t_enter"]) * 1e3,
                            "issue_host": (sph["t_issued"] - sph["t_enter"]) * 1e3,
                            "copy_gpu": sph["copy_gpu_ms"],
                        }
                    )
                    out.setdefault("copy_mode", {})[name] = sph.get("copy_mode")
                key = f"bench/{name}/{i}"
                if ep is not None and "t_header_sent" in getattr(ep, "ipc_phases", {}):
                    g.store.set(key + "/hs", repr(ep.ipc_phases["t_header_sent"]).encode())
                g.store.set(key + "/t0", repr(t_start).encode())
                g.wait_for_ranks(lambda r: key + "/t1", [1], f"{name} timing")
                t_end = float(g.store.get(key + "/t1"))
                if i >= args.warmup:
                    times.append(t_end - t_start)
                    if pushed:
                        p = phases[-1]
                        p["total"] = (t_end - t_start) * 1e3
                        p["rest"] = p["total"] - p["issue_host"] - p["copy_gpu"]
            else:
                key = f"bench/{name}/{i}"
                g.store.set(key + "/t1", repr(t_end).encode())
                ph = dict(getattr(ep, "ipc_phases", {}) or {})
                if i >= args.warmup and "copy_gpu_ms" in ph:
                    # Phases of this refit, in ms from the sender's call (same host: one clock).
                    g.wait_for_ranks(lambda r: key + "/t0", [0], f"{name} timing")
                    t0 = float(g.store.get(key + "/t0"))
                    hs = float(g.store.get(key + "/hs")) if g.store.check([key + "/hs"]) else float("nan")
                    total = (t_end - t0) * 1e3
                    header = (ph["t_header"] - t0) * 1e3
                    phases.append(
                        {
                            "sender_to_header_sent": (hs - t0) * 1e3,
                            "header_on_receiver_host": header,
                            "issue_host": (ph["t_issued"] - ph["t_header"]) * 1e3,
                            "copy_gpu": ph["copy_gpu_ms"],
                            "ack_gpu": ph["ack_gpu_ms"],
                            "rest": total - header - ph["copy_gpu_ms"],
                            "total": total,
                        }
                    )
                    out.setdefault("copy_mode", {})[name] = ph.get("copy_mode")
        if rank == 0:
            out.setdefault("results", {})[name] = summarize(times, nbytes_moved)
            if phases:
                out.setdefault("push_phases", {})[name] = {
                    k: statistics.median(p[k] for p in phases) for k in phases[0]
                }
        elif phases:
            out.setdefault("phases", {})[name] = {k: statistics.median(p[k] for p in phases) for k in phases[0]}

    def reset_receiver() -> None:
        if rank == 1:
            for t in tensors.values():
                t.zero_()

    def verify(name: str) -> None:
        # Bit-exactness of what the receiver holds after the last timed refit.
        if cuda:
            torch.cuda.synchronize(dev)
        sums = checksum(tensors)
        key = f"bench/{name}/checksum"
        if rank == 1:
            g.store.set(key, json.dumps(sums).encode())
        else:
            g.wait_for_ranks(lambda r: key, [1], "checksum")
            out["results"][name]["correct"] = json.loads(g.store.get(key)) == sums

    default_bucket = (1 << 30) if cuda else (64 << 20)
    modes = [
        (
            f"refit packed ({default_bucket >> 20} MiB buckets)",
            dict(bucket_bytes=default_bucket, transport="broadcast"),
        ),
        (
            "refit packed (256 MiB buckets)" if cuda else "refit packed (16 MiB buckets)",
            dict(bucket_bytes=(256 << 20) if cuda else (16 << 20), transport="broadcast"),
        ),
        ("refit per-tensor", dict(bucket_bytes=default_bucket, direct_bytes=0, transport="broadcast")),
        ("refit per-tensor, p2p send/recv", dict(bucket_bytes=default_bucket, direct_bytes=0, transport="p2p")),
    ]
    if cuda:
        modes += [
            ("refit packed (256 MiB buckets), p2p send/recv", dict(bucket_bytes=256 << 20, transport="p2p")),
            ("refit defaults (RefitSender(group, tensors))", dict()),
            ("refit ipc push (sender writes into the receiver's tensors)", dict(transport="ipc", ipc_direction="push")),
            (
                "refit ipc push, all copies in one batched call",
                dict(transport="ipc", ipc_direction="push", _first_call_bytes=1 << 62),
            ),
            ("refit ipc push, one cudaMemcpyAsync per run", dict(transport="ipc", ipc_direction="push", _batch=False)),
            ("refit ipc pull (receiver copies, on the sender's GPU)", dict(transport="ipc", ipc_direction="pull")),
            (
                "refit ipc pull (receiver copies, on its own GPU)",
                dict(transport="ipc", ipc_direction="pull", ipc_copy_on="dst"),
            ),
        ]
    if cuda and args.matrix:
        modes = [m for m in modes if m[0] in ("refit per-tensor", "refit per-tensor, p2p send/recv")]
    elif cuda and args.ipc_only:
        modes = [m for m in modes if "ipc" in m[0] or "defaults" in m[0] or m[0] == "refit per-tensor"]
    elif cuda:
        modes += [
            (
                "refit per-tensor (64 MiB NCCL groups)",
                dict(bucket_bytes=default_bucket, direct_bytes=0, group_bytes=64 << 20, transport="broadcast"),
            ),
            (
                "refit per-tensor (1 GiB NCCL groups)",
                dict(bucket_bytes=default_bucket, direct_bytes=0, group_bytes=1 << 30, transport="broadcast"),
            ),
            (
                "refit hybrid (>=16 MiB direct, rest in 64 MiB buckets)",
                dict(bucket_bytes=64 << 20, direct_bytes=16 << 20, transport="broadcast"),
            ),
        ]
    for name, kw in modes:
        reset_receiver()
        kw = dict(kw)
        batch = kw.pop("_batch", True)  # the copier's batched call (made by prepare_refit_info())
        PeerCopier.FIRST_CALL_BYTES = kw.pop("_first_call_bytes", FIRST_CALL_BYTES)
        if rank == 0:
            ep = RefitSender(g, tensors, channel=name, **kw)
            ep.ipc_timing = True  # push: CUDA events around the sender's copies
        else:
            ep = RefitReceiver(g, tensors, src=0, channel=name)
            ep.ipc_timing = True  # CUDA events around the copies and the ack (ipc only)
        ep.prepare_refit_info()
        if ep._copier is not None:
            ep._copier.batch = ep._copier.batch and batch
        versions: list[int] = []
        timed(
            name,
            lambda i, ep=ep: ep.send_weights(i),
            lambda i, ep=ep: versions.append(ep.receive_weights()),
            nbytes,
            ep=ep,
        )
        if rank == 1:
            assert versions == list(range(args.warmup + args.iters)), versions
        verify(name)
        if rank == 0:
            out["results"][name]["transport"] = ep.transport
        g.barrier()  # receivers drop their handles before the sender frees the exported ones
        ep.close()
        g.barrier()
        del ep

    # Raw nccl4py / gloo broadcast of one flat buffer: what the group itself can do.
    flat = torch.empty(nbytes, dtype=torch.uint8, device=dev)

    def flat_bcast(_: int) -> None:
        g.broadcast(flat, 0)
        g.synchronize()

    timed(f"group broadcast, one flat buffer ({backend})", flat_bcast, flat_bcast, nbytes)

    def flat_send(_: int) -> None:
        g.send(flat, 1)
        g.synchronize()

    def flat_recv(_: int) -> None:
        g.recv(flat, 0)
        g.synchronize()

    timed(f"group send/recv, one flat buffer ({backend})", flat_send, flat_recv, nbytes)
    del flat
    if args.quick or args.matrix:
        g.barrier()
        g.destroy()
        return out

    # torch.distributed in its own world (on a prefix of the same store).
    import torch.distributed as dist

    dist.init_process_group(
        backend,
        store=dist.PrefixStore("bench-dist", g.store),
        rank=rank,
        world_size=2,
        timeout=datetime.timedelta(seconds=120),
        **({"device_id": dev} if cuda else {}),
    )
    dist.barrier()

    def dist_per_tensor(_: int) -> None:
        for t in tensors.values():
            dist.broadcast(t, 0)
        if cuda:
            torch.cuda.synchronize(dev)

    reset_receiver()
    timed(f"torch.distributed broadcast per tensor ({backend})", dist_per_tensor, dist_per_tensor, nbytes)
    verify(f"torch.distributed broadcast per tensor ({backend})")
    flat = torch.empty(nbytes, dtype=torch.uint8, device=dev)

    def dist_flat(_: int) -> None:
        dist.broadcast(flat, 0)
        if cuda:
            torch.cuda.synchronize(dev)

    timed(f"torch.distributed broadcast, one flat buffer ({backend})", dist_flat, dist_flat, nbytes)
    dist.destroy_process_group()
    g.barrier()
    g.destroy()
    return out
