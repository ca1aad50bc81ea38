"""Async vs sync GRPO at the same config and seed: throughput, time to a reward, idle, staleness.

    python benchmarks/bench_grpo_async.py [--steps 60] [--threshold 0.9] [--staleness 1 2] [dotted.key=value ...]

Runs ``grpo_sync`` and ``grpo_async`` (once per ``--staleness``) one after another, each alone on
the machine, from the tiny configs with the data plane on, and reports per run: samples trained
per second of loop time (start-up excluded), wall seconds from the first step until the mean
training reward of three consecutive steps first reaches ``--threshold``, the final reward (mean
of the last three steps), the trainer's and the collectors' idle fractions, the staleness
distribution of trained groups, groups dropped as too old, and the mean trained response length
(dropping stale groups must not bias training toward short responses). Ratios are against the
sync run of the same invocation. Prints a table, writes ``benchmarks/results/bench_grpo_async.json``.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]


def run(module: str, config: str, overrides: list[str], out_dir: Path, timeout: float) -> list[dict[str, Any]]:
    env = dict(
        os.environ,
        OMP_NUM_THREADS="1",
        RAY_USAGE_STATS_ENABLED="0",
        PYTHONPATH=os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p),
    )
    env.pop("RAY_ADDRESS", None)
    cmd = [
        sys.executable,
        "-m",
        f"algorithms.{module}",
        "--config",
        str(REPO / "examples" / "configs" / config),
        *overrides,
        f"logging.output_dir={out_dir}",
    ]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"{module} failed:\n{proc.stderr[-4000:]}")
    return [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def summarize(rows: list[dict[str, Any]], threshold: float) -> dict[str, Any]:
    t_begin = rows[0]["elapsed_s"] - rows[0]["step_s"]  # the loop's start (start-up excluded)
    loop_s = rows[-1]["elapsed_s"] - t_begin
    rewards = [r["reward"] for r in rows]
    reach = next(
        (rows[i]["elapsed_s"] - t_begin for i in range(2, len(rows)) if sum(rewards[i - 2 : i + 1]) / 3 >= threshold),
        None,
    )
    stale = collections.Counter(
        s for r in rows for s in ([r["staleness_max"]] if r.get("staleness_max") is not None else [])
    )
    return {
        "steps": len(rows),
        "loop_s": loop_s,
        "samples_per_s": sum(r["samples"] for r in rows) / loop_s,
        "time_to_threshold_s": reach,
        "final_reward": sum(rewards[-3:]) / 3,
        "trainer_idle_frac": sum(r.get("trainer_idle_s") or 0.0 for r in rows) / loop_s,
        "collector_idle_frac": sum(r.get("collector_idle_s") or 0.0 for r in rows) / loop_s,
        "staleness_mean": (sum(r["staleness_mean"] for r in rows) / len(rows))
        if rows[0].get("staleness_mean") is not None
        else 0.0,
        "staleness_max_hist": dict(sorted(stale.items())),
        "groups_dropped_stale": sum(r.get("groups_dropped_stale") or 0 for r in rows),
        "response_len": sum(r["response_len"] for r in rows) / len(rows),
        "step_s_median": sorted(r["step_s"] for r in rows)[len(rows) // 2],
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--threshold", type=float, default=0.9)
    ap.add_argument("--staleness", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--timeout", type=float, default=1200)
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "bench_grpo_async.json"))
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    common = [
        f"trainer.steps={args.steps}",
        "trainer.val_every=0",
        "checkpoint.every=0",
        "logging.progress=false",
        "logging.plot=false",
        "logging.quiet=true",
        "data_plane.enabled=true",
        *args.overrides,
    ]
    plan = [("sync", "grpo_sync", "grpo_tiny.yaml", [])] + [
        (f"async s={s}", "grpo_async", "grpo_async_tiny.yaml", [f"async.max_staleness={s}"]) for s in args.staleness
    ]
    results: dict[str, dict[str, Any]] = {}
    t0 = time.time()
    with tempfile.TemporaryDirectory(prefix="bench_async_") as tmp:
        for name, module, config, extra in plan:
            print(f"[bench_grpo_async] {name} ...", file=sys.stderr, flush=True)
            rows = run(
                module, config, [*common, *extra], Path(tmp) / name.replace(" ", "_").replace("=", ""), args.timeout
            )
            results[name] = summarize(rows, args.threshold)
    base = results["sync"]
    for r in results.values():
        r["throughput_vs_sync"] = r["samples_per_s"] / base["samples_per_s"]
        r["time_to_threshold_vs_sync"] = (
            base["time_to_threshold_s"] / r["time_to_threshold_s"]
            if r["time_to_threshold_s"] and base["time_to_threshold_s"]
            else None
        )
    head = (
        f"{'run':11s} {'samples/s':>9s} {'x sync':>7s} {'t->thr s':>8s} {'x sync':>7s} {'final rw':>8s} "
        f"{'trainer idle':>12s} {'coll idle':>9s} {'stale mean':>10s} {'stale max hist':>16s} {'dropped':>7s} "
        f"{'resp len':>8s} {'step_s':>7s}"
    )
    print(
        f"\nbench_grpo_async: {args.steps} steps, threshold {args.threshold}, {os.cpu_count()} CPUs, "
        f"{platform.processor() or platform.machine()}"
    )
    print(head)

    def fmt(x: float | None, spec: str) -> str:
        return format("-", ">" + spec.split(".")[0]) if x is None else format(x, spec)

    for name, r in results.items():
        print(
            f"{name:11s} {r['samples_per_s']:9.1f} {r['throughput_vs_sync']:7.2f} "
            f"{fmt(r['time_to_threshold_s'], '8.1f')} "
            f"{fmt(r['time_to_threshold_vs_sync'], '7.2f')} {r['final_reward']:8.3f} {r['trainer_idle_frac']:12.2f} "
            f"{r['collector_idle_frac']:9.2f} {r['staleness_mean']:10.2f} {str(r['staleness_max_hist']):>16s} "
            f"{r['groups_dropped_stale']:7d} {r['response_len']:8.2f} {r['step_s_median']:7.3f}"
        )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "wall_s": time.time() - t0, "results": results}, indent=2))
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
