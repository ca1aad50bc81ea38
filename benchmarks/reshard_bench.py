"""``bench_refit.py --reshard``: resharding refit vs a full broadcast of the same model.

Scenarios (Llama-shaped bf16 model of ``--params`` parameters, ``llama_shapes``; generator
layouts fuse q/k/v and gate/up as vLLM does):

* ``TP=2 -> TP=1``: trainer ranks 0 and 1 (GPU 0 and 1) hold half of every sharded tensor;
  the generator, rank 2, shares GPU 0 with trainer rank 0. Half the bytes must cross NVLink
  (from GPU 1), the other half is a copy within GPU 0.
* ``TP=2 -> TP=2``: trainer ranks 0, 1 and generator ranks 2, 3 (GPU 0, 1, 0, 1): every
  generator rank's shard is on its own GPU already; a full broadcast would send each
  generator the whole model.

Rows per scenario: the reshard (GPU: ``transport="ipc"``, copy-engine copies, gloo control
group; CPU: ``transport="p2p"`` over gloo; GPU also with the other order of issuing the
copies, and with the done signal on the host, store or gloo control: the earlier ways) and
the full broadcast that refit does today
(``RefitSender`` on the trainer rank holding the whole model, GPU 1, to every generator rank;
on GPU only where no two of its ranks share a GPU, which NCCL refuses). Time: from the
senders' first call until the last generator rank's weights are usable (its call returned
and its current stream, which ``done="event"`` orders after the copies, synchronised), same
host clock, after a barrier;
median of ``--iters`` after ``--warmup``; ``last in``: the same refits timed from the last
rank's call instead (the ranks leave the barrier up to ~0.5 ms apart: the refit's own cost once
every rank called it). Bytes: what each generator rank received, and
what crossed between devices. Ceiling (GPU): ``dst.copy_(src)`` of the bytes that must cross
GPU 1 -> GPU 0; also with the within-GPU copies run at the same time. Correctness: checksums
of every generator tensor against its expected values after the last refit.

Plan: the plan of a 1,002-parameter Llama-3-8B-shaped model, trainer PP=2 x DP=2 x TP=2 ->
generator DP=2 x TP=4 (16 ranks; nothing transferred), computed from scratch (caches
cleared): all pieces, then one sender's and one receiver's messages; median (and best) of 9,
against the 50 ms target.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from reshard_phases import copies_only, phase_table, print_copies, print_phase_table  # noqa: E402

from nemo_dataplane.distributed import StatelessProcessGroup  # noqa: E402
from nemo_dataplane.refit import RefitReceiver, RefitSender  # noqa: E402
from nemo_dataplane.refit.reshard import ReshardReceiver, ReshardSender  # noqa: E402
from nemo_dataplane.refit.reshard import plan as _reshard  # noqa: E402
from nemo_dataplane.refit.reshard.layout import Layout, Mesh  # noqa: E402
from nemo_dataplane.refit.reshard.rules import DEFAULT_FUSIONS, build_layout, layer_stages  # noqa: E402

HOST = "127.0.0.1"
PLAN_TARGET_MS = 50.0
RATIO_TARGET = 1.1

# name -> (trainer tp, generator tp, GPU of each rank: trainers first)
SCENARIOS: dict[str, tuple[int, int, tuple[int, ...]]] = {
    "TP=2 -> TP=1": (2, 1, (0, 1, 0)),
    "TP=2 -> TP=2": (2, 2, (0, 1, 0, 1)),
}


def _placed(sc: tuple[int, int, tuple[int, ...]]) -> tuple[int, int, tuple[int, ...]]:
    """A scenario with its ranks on the GPUs there are (all on GPU 0 on a one-GPU machine)."""
    tp_train, tp_gen, gpus = sc
    if torch.cuda.is_available() and torch.cuda.device_count() < 2:
        gpus = tuple(0 for _ in gpus)
    return tp_train, tp_gen, gpus


def layouts(shapes: list[tuple[str, tuple[int, ...]]], tp_train: int, tp_gen: int) -> tuple[Layout, Layout]:
    params = {n: (s, torch.bfloat16) for n, s in shapes}
    src = build_layout(Mesh.of(range(tp_train), tp=tp_train), params)
    dst = build_layout(Mesh.of(range(tp_train, tp_train + tp_gen), tp=tp_gen), params, fusions=DEFAULT_FUSIONS)
    return src, dst


def _full(i: int, shape: tuple[int, ...], dev: torch.device) -> torch.Tensor:
    gen = torch.Generator(device=dev).manual_seed(1000 + i)
    return torch.randn(shape, generator=gen, device=dev, dtype=torch.float32).to(torch.bfloat16)


def local_values(layout: Layout, rank: int, dev: torch.device) -> dict[str, torch.Tensor]:
    """``rank``'s local tensors with the model's values (each full parameter made once, sliced)."""
    index = {n: i for i, n in enumerate(layout.params)}
    out = {}
    for name, lt in layout.local_tensors(rank).items():
        parts = []
        for param, box, _ in lt.parts:
            full = _full(index[param], layout.params[param].shape, dev)
            parts.append(full[tuple(slice(a, b) for a, b in box)].clone())
            del full
        out[name] = parts[0] if len(parts) == 1 else torch.cat(parts, lt.fuse_dim)
    return out


def _checksum(tensors: dict[str, torch.Tensor]) -> list[int]:
    return [int(t.view(torch.int16).to(torch.int64).sum()) for t in tensors.values()]


def worker(rank: int, port: int, args: argparse.Namespace, scenario: str, queue: Any) -> None:
    try:
        queue.put((rank, _worker(rank, port, args, scenario)))
    except BaseException as e:  # report instead of leaving the parent waiting
        import traceback

        queue.put((rank, {"error": "".join(traceback.format_exception(e))}))


def _worker(rank: int, port: int, args: argparse.Namespace, scenario: str) -> dict[str, Any]:
    from bench_refit import llama_shapes

    tp_train, tp_gen, gpus = _placed(SCENARIOS[scenario])
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
        expected = _checksum(tensors)
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
    timed(
        name,
        (lambda i: ep.send_weights(i)) if sender else (lambda i: ep.receive_weights()),
        True,
        ep,
        {} if sender else tensors,
        lambda: _checksum(tensors) == expected,
    )
    if cuda and ep.transport == "ipc":

        def again(label: str) -> None:
            timed(
                label,
                (lambda i: ep.send_weights(i)) if sender else (lambda i: ep.receive_weights()),
                True,
                ep,
                {} if sender else tensors,
                lambda: _checksum(tensors) == expected,
            )
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
                lambda: _checksum(tensors) == expected,
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
        full = {n: _full(i, s, dev) for i, (n, s) in enumerate(shapes)}
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
        return out, lambda: _checksum(tensors) == expected
    dev = next(iter(tensors.values())).device
    scratch = {n: torch.zeros(p.shape, dtype=torch.bfloat16, device=dev) for n, p in layout.params.items()}

    def check() -> bool:
        mine = {}
        for name, lt in lts.items():
            parts = [scratch[p][tuple(slice(a, b) for a, b in box)] for p, box, _ in lt.parts]
            mine[name] = parts[0] if len(parts) == 1 else torch.cat(parts, lt.fuse_dim)
        return _checksum(mine) == expected

    return scratch, check


def run_scenario(args: argparse.Namespace, scenario: str, limit_s: float) -> dict[str, Any]:
    tp_train, tp_gen, _ = SCENARIOS[scenario]
    world = tp_train + tp_gen
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    from bench_refit import free_port

    port = free_port()
    procs = [ctx.Process(target=worker, args=(r, port, args, scenario, queue)) for r in range(world)]
    for p in procs:
        p.start()
    results: dict[int, dict[str, Any]] = {}
    deadline = time.monotonic() + limit_s
    try:
        while len(results) < world:
            try:
                r, res = queue.get(timeout=max(1.0, deadline - time.monotonic()))
            except Exception:
                raise RuntimeError(f"{scenario}: workers did not report within {limit_s:g}s") from None
            if "error" in res:  # the others would only wait for it to time out
                raise RuntimeError(f"{scenario}: rank {r} failed:\n{res['error']}")
            results[r] = res
    finally:
        for p in procs:
            p.join(timeout=30 if len(results) == world else 0.1)
            if p.is_alive():
                p.kill()
    return results[0]


def ceilings(nbytes_cross: int, nbytes_local: int, device: str, iters: int) -> dict[str, float]:
    """GPU: peer copy GPU 1 -> GPU 0 of the crossing bytes, alone and beside the within-GPU
    copies; CPU: one memcpy of all of them."""

    def timeit(fn: Any) -> float:
        ts = []
        for i in range(iters + 2):
            if device == "cuda":
                for g in range(min(2, torch.cuda.device_count())):
                    torch.cuda.synchronize(g)
            t0 = time.perf_counter()
            fn()
            if device == "cuda":
                for g in range(min(2, torch.cuda.device_count())):
                    torch.cuda.synchronize(g)
            if i >= 2:
                ts.append(time.perf_counter() - t0)
        return statistics.median(ts) * 1e3

    out: dict[str, float] = {}
    if device != "cuda":
        a = torch.empty(nbytes_cross + nbytes_local, dtype=torch.uint8)
        b = torch.empty_like(a)
        out["memcpy_ms"] = timeit(lambda: b.copy_(a))
        return out
    if nbytes_cross:
        s1 = torch.empty(nbytes_cross, dtype=torch.uint8, device="cuda:1")
        d0 = torch.empty(nbytes_cross, dtype=torch.uint8, device="cuda:0")
        out["peer_copy_ms"] = timeit(lambda: d0.copy_(s1, non_blocking=True))
    if nbytes_local:
        one = torch.cuda.device_count() < 2
        per_gpu = nbytes_local if nbytes_cross or one else nbytes_local // 2
        l0 = torch.empty(per_gpu, dtype=torch.uint8, device="cuda:0")
        m0 = torch.empty_like(l0)
        l1 = torch.empty(0 if one else per_gpu, dtype=torch.uint8, device="cuda:1" if not one else "cuda:0")
        m1 = torch.empty_like(l1)
        side = torch.cuda.Stream(0)

        def both() -> None:
            if nbytes_cross:
                with torch.cuda.stream(side):
                    m0.copy_(l0, non_blocking=True)
                d0.copy_(s1, non_blocking=True)
            else:  # the within-GPU halves, on both GPUs at once
                m0.copy_(l0, non_blocking=True)
                with torch.cuda.device(m1.device):
                    m1.copy_(l1, non_blocking=True)

        out["with_local_copies_ms"] = timeit(both)
    torch.cuda.empty_cache()
    return out


def plan_timing(reps: int = 9) -> dict[str, Any]:
    """Plan of a 1,002-parameter Llama-3-8B-shaped model, PP2xDP2xTP2 -> DP2xTP4, from scratch."""
    h, kv, inter, vocab, layers = 4096, 1024, 14336, 128256, 111
    params: dict[str, tuple[tuple[int, ...], torch.dtype]] = {"model.embed_tokens.weight": ((vocab, h), torch.bfloat16)}
    for i in range(layers):
        p = f"model.layers.{i}."
        for n, s in (
            ("input_layernorm.weight", (h,)),
            ("self_attn.q_proj.weight", (h, h)),
            ("self_attn.k_proj.weight", (kv, h)),
            ("self_attn.v_proj.weight", (kv, h)),
            ("self_attn.o_proj.weight", (h, h)),
            ("post_attention_layernorm.weight", (h,)),
            ("mlp.gate_proj.weight", (inter, h)),
            ("mlp.up_proj.weight", (inter, h)),
            ("mlp.down_proj.weight", (h, inter)),
        ):
            params[p + n] = (s, torch.bfloat16)
    params["model.norm.weight"] = ((h,), torch.bfloat16)
    params["lm_head.weight"] = ((vocab, h), torch.bfloat16)
    src = build_layout(Mesh.of(range(8), pp=2, dp=2, tp=2), params, stage_of=layer_stages(layers, 2))
    dst = build_layout(Mesh.of(range(8, 16), dp=2, tp=4), params, fusions=DEFAULT_FUSIONS)
    plan_ms, msg_ms = [], []
    for _ in range(reps):
        _reshard._cache.clear()
        _reshard._box_table.cache_clear()
        _reshard._covers.cache_clear()
        t0 = time.perf_counter()
        plan = _reshard.plan_reshard(src, dst, bucket_bytes=1 << 30)
        t1 = time.perf_counter()
        plan.rounds(0)
        plan.rounds(8)
        t2 = time.perf_counter()
        plan_ms.append((t1 - t0) * 1e3)
        msg_ms.append((t2 - t1) * 1e3)
    totals = [a + b for a, b in zip(plan_ms, msg_ms)]
    return {
        "params": len(params),
        "pieces": len(plan.pieces),
        "plan_ms": statistics.median(plan_ms),
        "messages_ms": statistics.median(msg_ms),
        "total_ms": statistics.median(totals),
        "best_total_ms": min(totals),
        "reps": reps,
    }


def main(args: argparse.Namespace) -> None:
    from bench_refit import llama_shapes

    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    shapes = llama_shapes(args.params)
    nbytes = sum(math.prod(s) for _, s in shapes) * 2
    print(
        f"[bench_refit --reshard] {args.device}: {len(shapes)} tensors, {nbytes / 2 / 1e9:.3f} B params, "
        f"{nbytes / 1e9:.2f} GB bf16; torch {torch.__version__}",
        flush=True,
    )
    pt = plan_timing()
    print(
        f"plan: {pt['params']} params, PP2xDP2xTP2 -> DP2xTP4 (16 ranks), {pt['pieces']} pieces: "
        f"{pt['plan_ms']:.1f} ms all pieces + {pt['messages_ms']:.1f} ms one sender's and one receiver's "
        f"messages = {pt['total_ms']:.1f} ms median of {pt['reps']}, best {pt['best_total_ms']:.1f} ms "
        f"(target < {PLAN_TARGET_MS:.0f} ms)",
        flush=True,
    )
    summary: dict[str, Any] = {
        "device": args.device,
        "torch": torch.__version__,
        "n_tensors": len(shapes),
        "nbytes": nbytes,
        "plan": pt,
        "scenarios": {},
    }
    if args.device == "cuda":
        summary["gpu"] = torch.cuda.get_device_name(0)
    if args.device == "cuda" and torch.cuda.device_count() < 2:
        print(
            "ONE GPU: every rank on GPU 0 (nothing crosses NVLink; the ceiling is the within-GPU copy of all bytes)",
            flush=True,
        )
    for scenario, (tp_train, tp_gen, gpus) in ((k, _placed(v)) for k, v in SCENARIOS.items()):
        src, dst = layouts(shapes, tp_train, tp_gen)
        plan = _reshard.plan_reshard(src, dst, bucket_bytes=args.bucket_bytes)  # bytes only: any options do
        cross = sum(p.nbytes for p in plan.pieces if gpus[p.src] != gpus[p.dst])
        local = plan.total_bytes - cross
        ceil = ceilings(cross, local, args.device, args.iters)
        t0 = time.monotonic()
        try:
            res = run_scenario(args, scenario, args.limit)
        except RuntimeError as e:
            print(f"\n== {scenario}: FAILED\n{e}", flush=True)
            summary["scenarios"][scenario] = {"error": str(e)[-4000:]}
            continue
        rows = res["rows"]
        # a few replicated norms may cross GPUs (the plan knows no devices): not a ceiling
        major = cross >= 0.01 * plan.total_bytes
        base = (
            (ceil.get("peer_copy_ms") if major else None) or ceil.get("with_local_copies_ms") or ceil.get("memcpy_ms")
        )
        both = ceil.get("with_local_copies_ms") if major else None
        for v in rows.values():
            v["ratio_vs_ceiling"] = v["median_ms"] / base
            v["ratio_after_last_in"] = v["after_last_in_ms"] / base
            if both:
                v["ratio_vs_all_copies"] = v["median_ms"] / both
        summary["scenarios"][scenario] = {
            "rows": rows,
            "ceilings_ms": ceil,
            "cross_device_bytes": cross,
            "copies_only": res.get("copies_only"),
            "within_device_bytes": local,
            "prepare_s": res["prepare_s"],
            "broadcast_skipped": res.get("broadcast_skipped"),
        }
        where = f"; {cross / 1e9:.2f} GB cross GPUs, {local / 1e9:.2f} GB stay on one" if args.device == "cuda" else ""
        print(
            f"\n== {scenario} ({time.monotonic() - t0:.1f} s): generator ranks receive "
            f"{[plan.bytes_to(r) for r in dst.mesh.ranks]} bytes "
            f"(own {[plan.owned_bytes(r) for r in dst.mesh.ranks]})"
            f"{where}; prepare {res['prepare_s']:.2f} s"
        )
        print("   ceilings: " + ", ".join(f"{k} {v:.2f}" for k, v in ceil.items()))
        w = max(len(k) for k in rows)
        print(
            f"   {'method':<{w}}  {'median ms':>10}  {'best ms':>9}  {'x ceiling':>9}  {'x all copies':>12}  "
            f"{'last in ms':>10}  {'x ceiling':>9}  correct  {'GB per generator':>16}  transport"
        )
        for k, v in rows.items():
            gb = "/".join(f"{x / 1e9:.2f}" for x in v["received_per_generator"] if x is not None)
            allc = f"{v['ratio_vs_all_copies']:.3f}" if "ratio_vs_all_copies" in v else "-"
            print(
                f"   {k:<{w}}  {v['median_ms']:>10.2f}  {v['best_ms']:>9.2f}  {v['ratio_vs_ceiling']:>9.3f}  "
                f"{allc:>12}  {v['after_last_in_ms']:>10.2f}  {v['ratio_after_last_in']:>9.3f}  "
                f"{str(v['correct']):<7}  {gb:>16}  {v.get('transport', '-')}"
                + (f"  ({', '.join(v['copies'])})" if v.get("copies") else "")
            )
        for k, v in rows.items():
            for r, ph in enumerate(v.get("sender_phases") or []):
                if ph:
                    print(
                        f"   {k}, sender rank {r} copies (GPU time): contiguous "
                        f"{ph['contiguous_bytes'] / 1e9:.2f} GB in {ph['contiguous_ms']:.2f} ms, pitched "
                        f"{ph['pitched_bytes'] / 1e9:.2f} GB in {ph['pitched_ms']:.2f} ms"
                    )
        roles = {r: f"{'sender' if r < tp_train else 'receiver'} {r}" for r in range(tp_train + tp_gen)}
        for k, v in rows.items():
            if v.get("phases"):
                print_phase_table(k, {int(r): t for r, t in v["phases"].items()}, roles)
        if res.get("copies_only"):
            print_copies(res["copies_only"], base)
        if res.get("broadcast_skipped"):
            print(
                f"   full broadcast not timed: {res['broadcast_skipped']}; it would move "
                f"{nbytes * tp_gen / 1e9:.2f} GB ({nbytes / 1e9:.2f} GB per generator rank)"
            )
    targets = {"plan_ms<50": pt["total_ms"] < PLAN_TARGET_MS}
    if args.device == "cuda":
        r = summary["scenarios"]["TP=2 -> TP=1"].get("rows", {}).get("reshard (ipc)")
        targets["tp2->tp1_within_1.1x_peer_copy"] = r is not None and r["ratio_vs_ceiling"] <= RATIO_TARGET
        # The same refits timed from the last rank's call instead of the first's (``last in``):
        # what the refit costs once every rank called it, without the ranks' own entry skew.
        targets["tp2->tp1_within_1.1x_peer_copy_after_last_rank_in"] = (
            r is not None and r["ratio_after_last_in"] <= RATIO_TARGET
        )
    summary["targets"] = targets
    print(f"\ntargets: {targets}")
    out = args.out or REPO / "benchmarks" / "results" / f"bench_reshard_{args.device}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(summary, indent=2))
    print(f"JSON: {out}")
