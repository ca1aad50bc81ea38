"""grpo_sync with the Megatron-core policy at TP=1 and TP=2 against the torch worker (GPU only).

    python benchmarks/bench_megatron.py [--steps 15] [--layout auto|one-gpu|two-gpu|separate] [--no-resume]
        [--json PATH] [dotted.key=value ...]

Runs the real trainer (``python -m algorithms.grpo_sync``, one subprocess each, data plane on)
three times on the toy task with the same seeds: ``torch`` (the baseline, TP=1), ``megatron``
TP=1 and ``megatron`` TP=2 (two policy ranks, one replica: the TP leader fetches each meta and
broadcasts it; the refit is the resharding one, both TP ranks sending their shards into the HF
generator's TP=1 layout). Every run uses the same refit path (``refit.mode=reshard``, CUDA IPC
copies, gloo for control), so step and refit times compare like for like.

Layouts: ``one-gpu`` puts everything on one GPU (the policy ranks' collectives over gloo: NCCL
refuses two ranks on one device; the generator shares the GPU); ``two-gpu`` gives each TP rank
most of a GPU (NCCL collectives) and the generator the rest of one; ``separate`` gives each TP
rank a GPU and the generator another (3 GPUs at TP=2). ``auto``: ``separate`` with 3 or more
GPUs, ``two-gpu`` with 2, else ``one-gpu``. Every layout refits over CUDA IPC, across GPUs where
they differ (the trainer then lets the actors see every GPU: ``algorithms/workers/gpus.py``).

Unless ``--no-resume``, the TP=2 run checkpoints at step 8 (one file per TP rank) and a second run
resumes from it: its losses must equal the uninterrupted run's tail bitwise.

Prints a table (medians over the steps after the first) and writes JSON
(default ``benchmarks/results/bench_megatron.json``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_grpo_step import REPO, run_once  # noqa: E402

KEYS = ("step_s", "time/refit", "time/logprobs", "time/train", "time/generate", "time/worker_compute", "time/worker_io")


def layout_overrides(layout: str, tp: int) -> list[str]:
    common = [
        "policy.device=cuda",
        "generation.device=cuda",
        "refit.mode=reshard",
        "refit.transport=ipc",
        "refit.backend=gloo",
    ]
    if layout == "one-gpu":
        return common + ["policy.dist_backend=gloo", "generation.num_gpus=0.5", f"policy.gpus_per_rank={0.5 / tp:g}"]
    if layout == "separate":
        return common + [
            "policy.dist_backend=nccl" if tp > 1 else "policy.dist_backend=gloo",
            "generation.num_gpus=1",
            "policy.gpus_per_rank=1",
        ]
    return common + [
        "policy.dist_backend=nccl" if tp > 1 else "policy.dist_backend=gloo",
        "generation.num_gpus=0.25",
        "policy.gpus_per_rank=0.75",
    ]


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    tail = rows[1:] or rows
    out: dict[str, Any] = {k: statistics.median(float(r.get(k) or 0.0) for r in tail) for k in KEYS}
    rewards = [float(r["reward"]) for r in rows]
    out["reward_first3"] = statistics.fmean(rewards[:3])
    out["reward_last3"] = statistics.fmean(rewards[-3:])
    out["rewards"] = [round(x, 4) for x in rewards]
    out["losses"] = [r["loss"] for r in rows]
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=str(REPO / "examples" / "configs" / "grpo_tiny.yaml"))
    ap.add_argument("--steps", type=int, default=15)
    ap.add_argument("--layout", choices=("auto", "one-gpu", "two-gpu", "separate"), default="auto")
    ap.add_argument("--no-resume", action="store_true")
    ap.add_argument(
        "--runs",
        default="torch tp1,megatron tp1,megatron tp2",
        help="comma-separated subset of the runs (the torch run is the baseline and always included)",
    )
    ap.add_argument("--timeout", type=float, default=300.0)
    ap.add_argument("--json", default=str(REPO / "benchmarks" / "results" / "bench_megatron.json"))
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()

    import torch

    gpus = torch.cuda.device_count()
    if gpus == 0:
        print("bench_megatron: needs a CUDA device", file=sys.stderr)
        return 2
    layout = (
        args.layout if args.layout != "auto" else ("separate" if gpus >= 3 else "two-gpu" if gpus == 2 else "one-gpu")
    )
    base = [
        "trainer.dp_size=1",
        f"trainer.steps={args.steps}",
        "trainer.val_every=0",
        "logging.quiet=true",
        "data_plane.enabled=true",
        *args.overrides,
    ]
    every = {"torch tp1": ("torch", 1), "megatron tp1": ("megatron", 1), "megatron tp2": ("megatron", 2)}
    wanted = {"torch tp1", *(x.strip() for x in args.runs.split(",") if x.strip())}
    if unknown := sorted(wanted - set(every)):
        ap.error(f"--runs: unknown run(s) {unknown}; expected some of {sorted(every)}")
    runs = {k: v for k, v in every.items() if k in wanted}
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, (backend, tp) in runs.items():
            extra = [f"policy.backend={backend}", f"policy.tensor_parallel_size={tp}", *layout_overrides(layout, tp)]
            if name == "megatron tp2" and not args.no_resume:
                extra.append("checkpoint.every=8")
            out_dir = Path(tmp) / name.replace(" ", "_")
            print(f"=== {name}: {' '.join(extra)}", flush=True)
            rows = run_once(Path(args.config), base + extra, out_dir, args.timeout)
            results[name] = summarize(rows)
            results[name]["summary"] = json.loads((out_dir / "summary.json").read_text()).get("policy_layout")
            if name == "megatron tp2" and not args.no_resume:
                ckpt = out_dir / "checkpoints" / "step_000008"
                files = sorted(p.name for p in ckpt.glob("policy*.pt"))
                resumed = run_once(
                    Path(args.config),
                    base + extra[:-1] + [f"checkpoint.resume={ckpt}"],
                    Path(tmp) / "resumed",
                    args.timeout,
                )
                tail = [r for r in rows if r["step"] >= 8]
                same = [r["loss"] for r in resumed] == [r["loss"] for r in tail] and [r["reward"] for r in resumed] == [
                    r["reward"] for r in tail
                ]
                results["tp2_resume"] = {
                    "policy_files": files,
                    "steps": [r["step"] for r in resumed],
                    "bitwise_equal_tail": same,
                }
    base_step = results["torch tp1"]["step_s"]
    print(f"\nlayout {layout}, {gpus} GPU(s), {args.steps} steps, medians over steps 1..{args.steps - 1}")
    print(
        f"{'run':14} {'reward 3->3':>14} {'step_s':>8} {'vs torch':>8} {'refit ms':>9} {'logprobs':>9} {'train':>8} "
        f"{'compute':>8} {'io':>7}"
    )
    for name in runs:
        r = results[name]
        print(
            f"{name:14} {r['reward_first3']:6.3f}->{r['reward_last3']:6.3f} {r['step_s']:8.4f} "
            f"{r['step_s'] / base_step:8.2f} {1e3 * r['time/refit']:9.2f} {r['time/logprobs']:9.4f} "
            f"{r['time/train']:8.4f} {r['time/worker_compute']:8.4f} {r['time/worker_io']:7.4f}"
        )
    for name in runs:
        print(f"{name} rewards {results[name]['rewards']}")
    if "tp2_resume" in results:
        print(f"tp2 resume from step 8: {results['tp2_resume']}")
    results["layout"], results["gpus"] = layout, gpus
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
