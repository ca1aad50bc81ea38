"""The ranks of a ``reshard_bench.py`` scenario (the resharding refit, its variants and today's
full broadcast), each run in a fresh process by ``refit_model.run_ranks``."""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from typing import Any

import torch
from refit_model import HOST, SCENARIOS, checksum, full_value, layouts, llama_shapes, local_values, placed
from reshard_phases import copies_only, phase_table

from nemo_dataplane.distributed import StatelessProcessGroup
from nemo_dataplane.refit import RefitReceiver, RefitSender
from nemo_dataplane.refit.reshard import ReshardReceiver, ReshardSender
from nemo_dataplane.refit.reshard.layout import Layout


def reshard_rank(rank: int, port: int, args: argparse.Namespace, scenario: str) -> dict[str, Any]:
    """One rank of a ``reshard_bench.py`` scenario (trainer ranks first, then the generator's):
    times the reshard, its variants and the full broadcast; rank 0 returns the rows."""
    tp_train, tp_gen, gpus = placed(SCENARIOS[scenario])
    world = tp_train + tp_gen
    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.set_device(gpus[rank])
        dev = torch.device("cuda", gpus[rank])
    else:
        dev = torch.device("cpu")
    shapes = llama_shapes(args.params)
    src, dst = layouts(shapes, tp_train, tp_gen)
    sender = rank < tp_train
    layout = src if sender else dst
    ctl = StatelessProcessGroup(HOST, port, rank, world, "gloo", timeout=120, group_name="ctl")
    tensors = local_values(layout, rank, dev)
    if not sender:
        expected = checksum(tensors)
    out: dict[str, Any] = {"rows": {}}
    tiny = torch.zeros(1)

    def sync() -> None:
        # gloo all_reduce: every rank leaves within ~0.1 ms of the others (a store barrier polls)
        if cuda:
            torch.cuda.synchronize(dev)
        ctl.all_reduce(tiny)

    def timed(name: str, run: Any, participates: bool, ep: Any, targets: dict[str, torch.Tensor], correct: Any) -> None:
        times, after_last = [], []
        if ep is not None and hasattr(ep, "timings"):
            ep.timings = []  # host phase marks of each refit (opt-in)
        for i in range(args.warmup + args.iters):
            for t in targets.values():
                t.zero_()
            sync()
            t0 = time.perf_counter()
            if participates:
                run(i)
                if cuda and not sender:
                    # done="event" returns before the copies land: the weights are usable once
                    # the receiver's current stream gets past its waits (every row ends here).
                    torch.cuda.current_stream(dev).synchronize()
            t1 = time.perf_counter()
            if participates and not sender and getattr(ep, "timings", None):
                ep.timings[-1]["usable"] = t1
            if cuda:
                torch.cuda.synchronize(dev)
            # every rank posts (start, end); rank 0 reads them all
            ctl.store.set(f"bench/{name}/{i}/{rank}", json.dumps([t0, t1, participates]).encode())
            if rank == 0:
                ctl.wait_for_ranks(lambda r: f"bench/{name}/{i}/{r}", range(world), f"{name} timing")
                marks = [json.loads(ctl.store.get(f"bench/{name}/{i}/{r}")) for r in range(world)]
                start = min(m[0] for m in marks if m[2])
                last_in = max(m[0] for m in marks if m[2])  # the ranks leave sync() up to ~0.5 ms apart
                end = max(m[1] for r, m in enumerate(marks) if m[2] and r >= tp_train)
                if i >= args.warmup:
                    times.append(end - start)
                    after_last.append(end - last_in)
        row: dict[str, Any] = {}
        if ep is not None and getattr(ep, "timings", None) is not None:
            row["timings"] = ep.timings[args.warmup :]
            ep.timings = None
        if not sender:
            row["correct"] = correct()
            row["received"] = getattr(ep, "bytes_moved", None)
        elif getattr(ep, "_push", None) is not None:
            row["copies"] = ep._push.copies_used
            row["phases"] = ep._push.phases()  # the last timed refit's copies, split by kind
        ctl.store.set(f"bench/{name}/row/{rank}", json.dumps(row).encode())
        if rank == 0:
            ctl.wait_for_ranks(lambda r: f"bench/{name}/row/{r}", range(world), f"{name} results")
            allrows = [json.loads(ctl.store.get(f"bench/{name}/row/{r}")) for r in range(world)]
            rows = allrows[tp_train:]
            out["rows"][name] = {
                "median_ms": statistics.median(times) * 1e3,
                "best_ms": min(times) * 1e3,
                "after_last_in_ms": statistics.median(after_last) * 1e3,
                "correct": all(r["correct"] for r in rows),
                "received_per_generator": [r["received"] for r in rows],
            }
            if all("timings" in r for r in allrows):
                out["rows"][name]["phases"] = phase_table({r: x["timings"] for r, x in enumerate(allrows)})
            copies = {r.get("copies") for r in allrows[:tp_train]} - {None}
            if copies:
                out["rows"][name]["copies"] = sorted(copies)
                out["rows"][name]["sender_phases"] = [r.get("phases") for r in allrows[:tp_train]]
        sync()

    # -- the reshard
    transport = "ipc" if cuda else "p2p"
    if sender:
        ep: Any = ReshardSender(
            ctl, tensors, src, args.bucket_bytes, direct_bytes=args.direct_bytes, transport=transport, device=dev
        )
    else:
        ep = ReshardReceiver(ctl, tensors, dst, device=dev)
    t0 = time.perf_counter()
    plan = ep.prepare_refit_info()
    out["prepare_s"] = time.perf_counter() - t0
    if getattr(ep, "_push", None) is not None:
        ep._push.timing = True
    name = f"reshard ({transport})"

    def refits(label: str) -> None:
        timed(
            label,
            (lambda i: ep.send_weights(i)) if sender else (lambda i: ep.receive_weights()),
            True,
            ep,
            {} if sender else tensors,
            lambda: checksum(tensors) == expected,
        )

    refits(name)
    if cuda and ep.transport == "ipc":

        def again(label: str) -> None:
            refits(label)
            if rank == 0:
                out["rows"][label]["transport"] = ep.transport

        # The other order of issuing the two kinds of copies (IpcPush.order).
        first = ep._push.order
        if sender:
            ep._push.order = "strided_first" if first == "batched_first" else "batched_first"
        again(
            f"reshard ({transport}, {'strided kernels' if first == 'batched_first' else 'batched copies'} issued first)"
        )
        if sender:
            ep._push.order = first
        # The done signal on the host (ipc_done="host"): a done exchange after the copies.
        done = ep.done
        ep.done = "host"
        if done != "host":  # already timed above if the endpoints were configured with it
            again(f"reshard ({transport}, done on the host)")
        # ... with control over the group's gloo all_reduce instead of the store (earlier still).
        ep.control = "gloo"
        again(f"reshard ({transport}, done on the host, control as gloo all_reduce)")
        ep.control = "store"
        ep.done = done
        if rank == 0:  # what the placement chose (reshard/ipc_control.py, reshard/ipc_push.py module docs)
            out["ipc_modes"] = {"done": done, "pitched": ep._push.pitched, "cross_gpu": ep._push.cross_gpu}
        if (tp_train, tp_gen) == (2, 1):
            # The same copies with no control, from 1 or 2 processes (reshard_phases.py).
            res = copies_only(
                rank,
                world,
                tp_train,
                ctl,
                ep,
                src,
                tensors,
                dev,
                args.warmup,
                args.iters,
                sync,
                lambda: checksum(tensors) == expected,
            )
            if rank == 0:
                out["copies_only"] = res
    if rank == 0:
        out["rows"][name]["transport"] = ep.transport
        out["plan"] = {
            "pieces": len(plan.pieces),
            "plan_ms": plan.plan_seconds * 1e3,
            "bytes_to": {r: plan.bytes_to(r) for r in dst.mesh.ranks},
            "cross_device_bytes": sum(p.nbytes for p in plan.pieces if gpus[p.src] != gpus[p.dst]),
        }
    sync()
    ep.close()
    sync()
    ep = None  # the closures above hold it: drop the endpoint's tensors before the broadcast baseline

    # -- today's full broadcast from the trainer rank on GPU 1 (it holds the whole model)
    bsrc = tp_train - 1
    bgroup = [bsrc, *range(tp_train, world)]
    devs = [gpus[r] for r in bgroup]
    if cuda and len(set(devs)) < len(devs):
        out["broadcast_skipped"] = f"ranks {bgroup} share a GPU ({devs}); NCCL refuses that"
        ctl.barrier()
        ctl.destroy()
        return out
    name = "full broadcast (RefitSender)" if not cuda else "full broadcast (RefitSender, NCCL per-tensor)"
    g = None
    if rank in bgroup:
        g = StatelessProcessGroup(
            HOST,
            port,
            bgroup.index(rank),
            len(bgroup),
            "nccl" if cuda else "gloo",
            timeout=120,
            device=gpus[rank] if cuda else None,
            group_name="bcast",
            store=ctl.store,
        )
    full = None
    if rank == bsrc:
        full = {n: full_value(i, s, dev) for i, (n, s) in enumerate(shapes)}
    ep2: Any = None
    targets: dict[str, torch.Tensor] = {}
    check: Any = None
    if g is not None and rank == bsrc:
        kw: dict[str, Any] = (
            {"bucket_bytes": args.bucket_bytes} if not cuda else {"direct_bytes": 0, "transport": "broadcast"}
        )
        ep2 = RefitSender(g, full, **kw)
    elif g is not None:
        targets, check = broadcast_targets(dst, rank, tensors, expected)
        ep2 = RefitReceiver(g, targets, src=0)
    if ep2 is not None:
        ep2.prepare_refit_info()
    timed(
        name,
        (lambda i: ep2.send_weights(i)) if rank == bsrc else (lambda i: ep2.receive_weights()),
        ep2 is not None,
        None,
        targets,
        check,
    )
    if rank == 0:
        out["rows"][name]["transport"] = "broadcast"
        out["rows"][name]["received_per_generator"] = [sum(math.prod(s) * 2 for _, s in shapes)] * tp_gen
    sync()
    if ep2 is not None:
        ep2.close()
    if g is not None:
        g.destroy()
    ctl.barrier()
    ctl.destroy()
    return out


def broadcast_targets(
    layout: Layout, rank: int, tensors: dict[str, torch.Tensor], expected: list[int]
) -> tuple[dict[str, torch.Tensor], Any]:
    """Where a full broadcast lands on a generator rank, and a check of the result.

    A rank holding whole parameters (TP=1) receives into views of its (fused) tensors. A rank
    holding shards needs the whole model in scratch tensors first, as today's refit does (its
    slicing afterwards is not timed); the check compares the slices it owns."""
    lts = layout.local_tensors(rank)
    whole = all(box == tuple((0, n) for n in layout.params[p].shape) for lt in lts.values() for p, box, _ in lt.parts)
    if whole:
        out = {}
        for name, lt in lts.items():
            for param, box, off in lt.parts:
                out[param] = tensors[name].narrow(lt.fuse_dim, off, box[lt.fuse_dim][1] - box[lt.fuse_dim][0])
        return out, lambda: checksum(tensors) == expected
    dev = next(iter(tensors.values())).device
    scratch = {n: torch.zeros(p.shape, dtype=torch.bfloat16, device=dev) for n, p in layout.params.items()}

    def check() -> bool:
        mine = {}
        for name, lt in lts.items():
            parts = [scratch[p][tuple(slice(a, b) for a, b in box)] for p, box, _ in lt.parts]
            mine[name] = parts[0] if len(parts) == 1 else torch.cat(parts, lt.fuse_dim)
        return checksum(mine) == expected

    return scratch, check
