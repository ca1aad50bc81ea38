"""Refit benchmark: packed vs per-tensor refit against a raw-copy ceiling and torch.distributed.

GPU (2 GPUs, default):  python benchmarks/bench_refit.py
CPU (gloo, small):      python benchmarks/bench_refit.py --device cpu --params 50e6
Resharding refit:       python benchmarks/bench_refit.py --reshard [--device cpu --params 20e6]
                        (TP=2 -> TP=1 and TP=2 -> TP=2 vs a full broadcast, plus the plan time of
                        a 1,000-parameter model; benchmarks/reshard_bench.py)

A llama-shaped parameter set (~150 tensors, bf16) lives on the trainer process (rank 0, GPU 0)
and is refit into a generator process (rank 1, GPU 1). Metric: wall time from the sender's
first call to the moment the receiver's last parameter is updated (packing and unpacking
included), taken on the shared monotonic clock of one host after both ranks left a device-level
barrier. Ceiling: one ``dst.copy_(src)`` of the same bytes, cuda:0 -> cuda:1 (CPU: a memcpy).
Prints a table and writes JSON to benchmarks/results/bench_refit_<device>.json.

GPU rows include ``transport="ipc"`` (CUDA IPC handles + copy-engine peer copies: ``push``, the
sender writes into the receiver's tensors, the default on one host; ``pull``, the receiver copies
out of the sender's) and the defaults; ``--ipc-only`` runs just those, per-tensor broadcast and
the flat baselines. The last column says which transport each refit row used. Phase tables
break the ipc rows' time down (push: on the sender; pull: on the receiver).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from refit_model import llama_shapes, run_ranks, summarize  # noqa: E402
from refit_ranks import refit_rank  # noqa: E402

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")


def peer_copy_ceiling(nbytes: int, device: str, iters: int) -> dict[str, float]:
    if device == "cuda":
        src = torch.empty(nbytes, dtype=torch.uint8, device="cuda:0")
        dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda:1")
    else:
        src = torch.empty(nbytes, dtype=torch.uint8)
        dst = torch.empty(nbytes, dtype=torch.uint8)
    src.fill_(7)
    times = []
    for i in range(iters + 2):
        if device == "cuda":
            torch.cuda.synchronize(0)
            torch.cuda.synchronize(1)
        t0 = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        if device == "cuda":
            torch.cuda.synchronize(1)
            torch.cuda.synchronize(0)
        if i >= 2:
            times.append(time.perf_counter() - t0)
    ok = bool((dst[:: max(1, nbytes // 4096)] == 7).all())
    del src, dst
    if device == "cuda":
        torch.cuda.empty_cache()
    return {**summarize(times, nbytes), "correct": ok}


# NCCL settings tried by --matrix (docs/refit.md, section 5). Each runs in fresh processes:
# NCCL reads its environment once per process. NCCL_NVLS_ENABLE=0 stays set throughout.
MATRIX: list[tuple[str, dict[str, str], dict[str, int]]] = [
    ("baseline", {}, {}),
    ("P2P_USE_CUDA_MEMCPY=1", {"NCCL_P2P_USE_CUDA_MEMCPY": "1"}, {}),
    ("P2P_USE_CUDA_MEMCPY=1 BUFFSIZE=64M", {"NCCL_P2P_USE_CUDA_MEMCPY": "1", "NCCL_BUFFSIZE": str(64 << 20)}, {}),
    ("PROTO=Simple", {"NCCL_PROTO": "Simple"}, {}),
    ("PROTO=Simple BUFFSIZE=16M", {"NCCL_PROTO": "Simple", "NCCL_BUFFSIZE": str(16 << 20)}, {}),
    ("P2P_NVL_CHUNKSIZE=2M BUFFSIZE=16M", {"NCCL_P2P_NVL_CHUNKSIZE": str(2 << 20), "NCCL_BUFFSIZE": str(16 << 20)}, {}),
    ("P2P_READ_ENABLE=1", {"NCCL_P2P_READ_ENABLE": "1"}, {}),
    ("NTHREADS=512", {"NCCL_NTHREADS": "512"}, {}),
    (
        "P2P channels 32 (MIN/MAX_P2P_NCHANNELS, NCHANNELS_PER_NET_PEER)",
        {"NCCL_MIN_P2P_NCHANNELS": "32", "NCCL_MAX_P2P_NCHANNELS": "32", "NCCL_NCHANNELS_PER_NET_PEER": "32"},
        {},
    ),
    ("cta_policy=ZERO (config)", {}, {"cta_policy": 2}),
]


def run_matrix(args: argparse.Namespace, ceiling: dict[str, Any], ceiling_name: str) -> None:
    ceil_ms = ceiling["median_ms"]
    print(f"{ceiling_name}: {ceil_ms:.2f} ms, {ceiling['gbps_median']:.1f} GB/s", flush=True)
    base_cfg = dict(args.nccl_config)
    rows: dict[str, Any] = {}
    for name, env, cfg in MATRIX:
        args.nccl_config = {**base_cfg, **cfg}
        t0 = time.monotonic()
        try:
            res = run_ranks(refit_rank, 2, (args,), limit_s=30, env=env, label=name)[0]["results"]
        except RuntimeError as e:
            last = str(e).strip().splitlines()[-1][:300]
            print(f"\n== {name}: FAILED ({last})", flush=True)
            rows[name] = {"env": env, "nccl_config": cfg, "error": str(e)[-2000:]}
            continue
        print(f"\n== {name}  ({time.monotonic() - t0:.1f} s)", flush=True)
        for k, v in res.items():
            v["ratio_vs_ceiling"] = ceil_ms / v["median_ms"]
            print(
                f"   {k:<44} {v['median_ms']:>7.2f} ms {v['best_ms']:>7.2f} best {v['gbps_median']:>6.1f} GB/s "
                f"{v['ratio_vs_ceiling']:>6.1%}  {v.get('correct', '-')}",
                flush=True,
            )
        rows[name] = {"env": env, "nccl_config": cfg, "results": res}
    args.nccl_config = base_cfg
    best = (None, None, 0.0)
    for name, row in rows.items():
        for k, v in row.get("results", {}).items():
            if k.startswith("refit") and v.get("correct", True) and v["ratio_vs_ceiling"] > best[2]:
                best = (name, k, v["ratio_vs_ceiling"])
    print(f"\nbest refit: {best[1]} with {best[0]}: {best[2]:.1%} of the ceiling", flush=True)
    out = args.out or REPO / "benchmarks" / "results" / "bench_refit_matrix.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"ceiling": ceiling, "best": best, "rows": rows}, indent=2))
    if best[0] is not None:
        env_file = out.with_suffix(".env")
        env_file.write_text("".join(f"export {k}={v}\n" for k, v in rows[best[0]]["env"].items()))
        print(f"best env: {env_file}", flush=True)
    print(f"JSON: {out}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--params", type=float, default=None, help="parameter count (default 2e9 GPU, 50e6 CPU)")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--quick", action="store_true", help="skip the torch.distributed baselines")
    ap.add_argument("--nccl-config", default="", help="NCCLConfig fields for the refit group, e.g. min_ctas=32")
    ap.add_argument(
        "--ipc-only",
        action="store_true",
        help="GPU: only the CUDA IPC rows, the defaults and per-tensor broadcast (plus flat baselines)",
    )
    ap.add_argument(
        "--reshard",
        action="store_true",
        help="resharding refit (benchmarks/reshard_bench.py): TP=2 -> TP=1 / TP=2 vs a full broadcast",
    )
    ap.add_argument(
        "--bucket-bytes", type=int, default=None, help="--reshard: staging per round (default: 1 GiB GPU, 64 MiB CPU)"
    )
    ap.add_argument(
        "--direct-bytes",
        type=int,
        default=None,
        help="--reshard: contiguous pieces at least this large go unpacked (default: ReshardSender's)",
    )
    ap.add_argument("--limit", type=float, default=400.0, help="--reshard: seconds per scenario")
    ap.add_argument(
        "--matrix",
        action="store_true",
        help="GPU: run the NCCL settings matrix (flat and per-tensor, broadcast and p2p) and exit",
    )
    args = ap.parse_args()
    args.nccl_config = {k: int(v) for k, v in (kv.split("=") for kv in args.nccl_config.split(",") if kv)}
    if args.params is None:
        args.params = 2e9 if args.device == "cuda" else (20e6 if args.reshard else 50e6)
    if args.matrix:
        args.iters = min(args.iters, 6)
    if args.device == "cuda" and torch.cuda.device_count() < (1 if args.reshard else 2):
        sys.exit("--device cuda needs 2 GPUs; use --device cpu --params 50e6")
    if args.reshard:
        import reshard_bench

        if args.bucket_bytes is None:
            args.bucket_bytes = (1 << 30) if args.device == "cuda" else (64 << 20)
        reshard_bench.main(args)
        return
    shapes = llama_shapes(args.params)
    nbytes = sum(math.prod(s) for _, s in shapes) * 2
    print(
        f"[bench_refit] {args.device}: {len(shapes)} tensors, {nbytes / 2 / 1e9:.3f} B params, "
        f"{nbytes / 1e9:.2f} GB bf16; torch {torch.__version__}",
        flush=True,
    )

    ceiling = peer_copy_ceiling(nbytes, args.device, args.iters)
    ceiling_name = "peer copy cuda:0->cuda:1 (ceiling)" if args.device == "cuda" else "memcpy (ceiling)"

    if args.matrix:
        run_matrix(args, ceiling, ceiling_name)
        return
    try:
        results = run_ranks(refit_rank, 2, (args,), limit_s=540, label="bench_refit")
    except RuntimeError as e:
        sys.exit(f"[bench_refit] {e}")

    r0 = results[0]
    rows = {ceiling_name: ceiling, **r0["results"]}
    ceil_ms = ceiling["median_ms"]
    for v in rows.values():
        v["ratio_vs_ceiling"] = ceil_ms / v["median_ms"]
    refit_rows = {k: v for k, v in rows.items() if k.startswith("refit")}
    best_name = max(refit_rows, key=lambda k: refit_rows[k]["ratio_vs_ceiling"])
    summary = {
        "device": args.device,
        "gpu": torch.cuda.get_device_name(0) if args.device == "cuda" else None,
        "torch": torch.__version__,
        "nccl_config": args.nccl_config,
        "n_tensors": r0["n_tensors"],
        "n_params": r0["n_params"],
        "nbytes": r0["nbytes"],
        "group_init_cold_s": max(results[0]["init_cold_s"], results[1]["init_cold_s"]),
        "group_init_warm_s": max(results[0]["init_warm_s"], results[1]["init_warm_s"]),
        "best_refit": best_name,
        "best_refit_ratio_vs_ceiling": refit_rows[best_name]["ratio_vs_ceiling"],
        "targets": {
            "ratio_vs_ceiling>=0.95": refit_rows[best_name]["ratio_vs_ceiling"] >= 0.95,
            "group_init_warm_s<1": max(results[0]["init_warm_s"], results[1]["init_warm_s"]) < 1.0,
        },
        "results": rows,
    }

    w = max(len(k) for k in rows)
    print(f"\n{'method':<{w}}  {'median ms':>10}  {'best ms':>9}  {'GB/s':>7}  {'vs ceiling':>10}  correct  transport")
    for k, v in rows.items():
        print(
            f"{k:<{w}}  {v['median_ms']:>10.2f}  {v['best_ms']:>9.2f}  {v['gbps_median']:>7.1f}  "
            f"{v['ratio_vs_ceiling']:>9.1%}  {str(v.get('correct', '-')):<7}  {v.get('transport', '-')}"
        )
    phases = results[1].get("phases", {})
    if phases:
        modes_used = results[1].get("copy_mode", {})
        cols = list(next(iter(phases.values())))
        print("\nipc phases (receiver; median ms from the sender's call; copy_gpu/ack_gpu: CUDA events)")
        print(f"{'method':<{w}}  " + "  ".join(f"{c:>12.12}" for c in cols) + "  copies")
        for k, v in phases.items():
            print(f"{k:<{w}}  " + "  ".join(f"{v[c]:>12.3f}" for c in cols) + f"  {modes_used.get(k)}")
        summary["ipc_phases_ms"] = phases
        summary["ipc_copy_mode"] = modes_used
    push_phases = results[0].get("push_phases", {})
    if push_phases:
        modes_used = results[0].get("copy_mode", {})
        cols = ["gate_host", "issue_host", "copy_gpu", "rest", "total"]
        print(
            "\nipc push phases (sender; median ms from its call; copy_gpu: CUDA events; rest: the gate, "
            "the header and the receiver's poll)"
        )
        print(f"{'method':<{w}}  " + "  ".join(f"{c:>12}" for c in cols) + "  copies")
        for k, v in push_phases.items():
            print(f"{k:<{w}}  " + "  ".join(f"{v[c]:>12.3f}" for c in cols) + f"  {modes_used.get(k)}")
        summary["ipc_push_phases_ms"] = push_phases
    print(
        f"\ngroup init: cold {summary['group_init_cold_s']:.3f} s (includes peer process start), "
        f"warm {summary['group_init_warm_s']:.3f} s"
    )
    print(
        f"best refit: {best_name}: {summary['best_refit_ratio_vs_ceiling']:.1%} of the ceiling; "
        f"targets: {summary['targets']}"
    )
    tag = "".join(f"_{k}{v}" for k, v in args.nccl_config.items())
    out = args.out or REPO / "benchmarks" / "results" / f"bench_refit_{args.device}{tag}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(summary, indent=2))
    print(f"JSON: {out}")


if __name__ == "__main__":
    main()
