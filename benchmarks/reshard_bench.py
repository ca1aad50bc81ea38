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

from refit_model import SCENARIOS, layouts, llama_shapes, placed, run_ranks  # noqa: E402
from reshard_phases import print_copies, print_phase_table  # noqa: E402
from reshard_ranks import reshard_rank  # noqa: E402

from nemo_dataplane.refit.reshard import plan as _reshard  # noqa: E402
from nemo_dataplane.refit.reshard.layout import Mesh  # noqa: E402
from nemo_dataplane.refit.reshard.rules import DEFAULT_FUSIONS, build_layout, layer_stages  # noqa: E402

PLAN_TARGET_MS = 50.0
RATIO_TARGET = 1.1


def run_scenario(args: argparse.Namespace, scenario: str, limit_s: float) -> dict[str, Any]:
    """Rank 0's results of one scenario, its ranks each in a fresh process."""
    tp_train, tp_gen, _ = SCENARIOS[scenario]
    return run_ranks(reshard_rank, tp_train + tp_gen, (args, scenario), limit_s=limit_s, label=scenario)[0]


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
    for scenario, (tp_train, tp_gen, gpus) in ((k, placed(v)) for k, v in SCENARIOS.items()):
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
