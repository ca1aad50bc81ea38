"""Async vs sync GRPO at the same config and seed: throughput against the ideal overlap bound.

    python benchmarks/bench_grpo_async.py [--profile toy|longtail|longtail-mild] [--steps 40]
        [--runs async:1 partial:1 det:1 colocated ...] [--engines hf vllm] [--config FILE] [dotted.key=value ...]

Runs ``grpo_sync`` once, then ``grpo_async`` once per ``--runs`` entry ``variant:staleness``
(``async``: the default async config, free mode; ``partial``: with ``async.partial_rollout=true``;
``det``: ``async.mode=deterministic``; the staleness is ``async.max_staleness``; ``colocated``: ``grpo_sync``
with ``generation.placement=colocated`` over 2 GPUs, policy rank and vLLM engine on each), one after another, each
alone on the machine, from one config (``--config``; default the tiny async config, whose
``async`` section the sync trainer ignores) with the data plane on and every override passed to
every run. ``--profile`` adds the task: ``toy`` (the config's own), ``longtail`` /
``longtail-mild`` (response lengths log-normal with p99/p50 = 20 / 4, up to
``generation.max_new_tokens``).

Per run: samples trained per second of loop time (start-up and the first ``--skip`` steps
excluded), x sync, the **ideal overlap bound** from the sync run's own phases (G = its generation,
T = the rest of its step: ``(G + T) / max(G, T)``), the fraction of that bound reached
(``x sync / bound``), for a ``det`` run its throughput over the free-mode run of the same
staleness (``x free``, when ``async:N`` ran too), the trainer's and the generators' idle ratios,
the staleness histogram of trained groups, the data plane's share of the step (median, ``dp
frac``), groups dropped, the trainer's phase medians and the final reward. Prints a table;
writes ``benchmarks/results/bench_grpo_async.json``.

``--engines hf vllm`` runs the whole plan once per generation engine (``generation.backend``),
one engine after the other: every figure above is per engine (its own sync run and bound), and
each run of a later engine adds ``x <first engine>``, its samples/s over the first engine's run
of the same variant. Without it the config's own engine runs and run names carry no prefix.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from algorithms.step import run_idle_ratios  # noqa: E402  (the trainer's own accounting)

PROFILES: dict[str, list[str]] = {
    "toy": [],
    "longtail": ["task.name=longtail"],
    "longtail-mild": ["task.name=longtail-mild"],
}
# --runs colocated: grpo_sync with a policy rank and a vLLM engine on each of 2 GPUs (vLLM sleeps
# while the trainer works; docs/generation.md "Colocated placement"), against the config's split
# sync run (policy on one GPU, generator on the other): the same 2 GPUs.
COLOCATED = [
    "generation.placement=colocated",
    "trainer.dp_size=2",
    "generation.num_engines=2",
    "policy.dist_backend=nccl",
    "refit.backend=gloo",
    "refit.mode=auto",
]
PHASES = ("wait", "generate", "advantages", "preshard", "logprobs", "train", "release", "refit")


def run(module: str, config: Path, overrides: list[str], out_dir: Path, timeout: float) -> dict[str, Any]:
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
        str(config),
        *overrides,
        f"logging.output_dir={out_dir}",
    ]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"{module} failed:\n{proc.stderr[-4000:]}")
    rows = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return {"rows": rows, "summary": json.loads((out_dir / "summary.json").read_text())}


def summarize(result: dict[str, Any], skip: int) -> dict[str, Any]:
    rows = result["rows"][skip:] or result["rows"]
    t_begin = rows[0]["elapsed_s"] - rows[0]["step_s"]  # the measured steps' start
    loop_s = rows[-1]["elapsed_s"] - t_begin
    stale = collections.Counter(r["staleness_max"] for r in rows if r.get("staleness_max") is not None)
    idle = run_idle_ratios(rows, len(result["summary"].get("generator_versions") or [1]))
    return {
        "steps": len(rows),
        "loop_s": loop_s,
        "samples_per_s": sum(r["samples"] for r in rows) / loop_s,
        "final_reward": statistics.mean(r["reward"] for r in rows[-3:]),
        "trainer_idle_ratio": idle["trainer_idle_ratio"],
        "generator_idle_ratio": idle["generator_idle_ratio"],
        "staleness_max_hist": dict(sorted(stale.items())),
        "groups_dropped_stale": sum(r.get("groups_dropped_stale") or 0 for r in rows),
        "partial_samples": sum(r.get("partial_samples") or 0 for r in rows),
        "response_len": statistics.mean(r["response_len"] for r in rows),
        "step_s_median": statistics.median(r["step_s"] for r in rows),
        # the data plane's share of the trainer's step (algorithms/telemetry.py), median over steps
        "dataplane_step_fraction": statistics.median(r.get("dataplane_step_fraction") or 0.0 for r in rows),
        "phases_median_s": {p: statistics.median(r.get(f"time/{p}") or 0.0 for r in rows) for p in PHASES},
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", choices=sorted(PROFILES), default="toy")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--skip", type=int, default=5, help="first steps left out of every figure (warm-up)")
    ap.add_argument(
        "--runs", nargs="+", default=["async:1", "partial:1"], help="variant:staleness, variant async|partial|det"
    )
    ap.add_argument("--config", default=str(REPO / "examples" / "configs" / "grpo_async_tiny.yaml"))
    ap.add_argument("--engines", nargs="+", default=None, help="generation.backend per pass (default: the config's)")
    ap.add_argument("--timeout", type=float, default=1800)
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
        *PROFILES[args.profile],
        *args.overrides,
    ]
    variants: list[tuple[str, str, list[str]]] = [("sync", "grpo_sync", [])]
    for spec in args.runs:
        if spec == "colocated":
            variants.append(("sync colocated", "grpo_sync", COLOCATED))
            continue
        v, _, s = spec.partition(":")
        if v not in ("async", "partial", "det") or not s.isdigit():
            ap.error(f"--runs {spec!r}: expected async:N, partial:N, det:N or colocated")
        partial = "true" if v == "partial" else "false"
        mode = "deterministic" if v == "det" else "free"
        variants.append(
            (
                f"{v} s={s}",
                "grpo_async",
                [f"async.max_staleness={s}", f"async.partial_rollout={partial}", f"async.mode={mode}"],
            )
        )
    engines: list[str | None] = list(args.engines) if args.engines else [None]
    results: dict[str, dict[str, Any]] = {}
    bounds: dict[str, float] = {}
    t0 = time.time()
    with tempfile.TemporaryDirectory(prefix="bench_async_") as tmp:
        for engine in engines:
            prefix = f"{engine}: " if engine else ""
            pick = [f"generation.backend={engine}"] if engine else []
            for name, module, extra in variants:
                label = prefix + name
                print(f"[bench_grpo_async] {args.profile}: {label} ...", file=sys.stderr, flush=True)
                out = Path(tmp) / label.replace(" ", "_").replace("=", "").replace(":", "")
                cmd = [*common, *pick, *extra]
                results[label] = summarize(run(module, Path(args.config), cmd, out, args.timeout), args.skip)
            base = results[prefix + "sync"]
            g = base["phases_median_s"]["generate"]
            t = base["step_s_median"] - g
            bound = bounds[prefix] = (g + t) / max(g, t) if max(g, t) > 0 else 1.0
            for name, _, _ in variants:
                r = results[prefix + name]
                r["engine"] = engine
                r["x_sync"] = r["samples_per_s"] / base["samples_per_s"]
                r["bound_fraction"] = r["x_sync"] / bound
                free = results.get(prefix + name.replace("det ", "async ")) if name.startswith("det ") else None
                r["x_free"] = r["samples_per_s"] / free["samples_per_s"] if free else None
                first = results[f"{engines[0]}: {name}"] if engine and engine != engines[0] else None
                r["x_first_engine"] = r["samples_per_s"] / first["samples_per_s"] if first else None
    print(
        f"\nbench_grpo_async: profile {args.profile}, {args.steps} steps (first {args.skip} skipped), "
        f"{os.cpu_count()} CPUs, {platform.processor() or platform.machine()}"
    )
    for prefix, bound in bounds.items():
        base = results[prefix + "sync"]
        g = base["phases_median_s"]["generate"]
        print(
            f"{prefix or 'sync '}sync step G={g:.3f}s + T={base['step_s_median'] - g:.3f}s: "
            f"ideal overlap bound (G+T)/max(G,T) = {bound:.2f}x"
        )
    first_name = f"x {engines[0]}" if engines[0] else "x first"
    width = max(12, *(len(n) for n in results))
    print(
        f"{'run':{width}s} {'samples/s':>9s} {'x sync':>7s} {'of bound':>8s} {'x free':>6s} {first_name:>8s} "
        f"{'idle trn':>8s} {'idle gen':>8s} {'stale hist':>14s} {'drop':>5s} {'partial':>7s} {'reward':>6s} "
        f"{'resp len':>8s} {'step_s':>7s} {'dp frac':>7s}  phases"
    )
    for name, r in results.items():
        ph = " ".join(f"{p}={v:.3f}" for p, v in r["phases_median_s"].items() if v)
        x_free = f"{r['x_free']:6.2f}" if r["x_free"] is not None else f"{'-':>6s}"
        x_first = f"{r['x_first_engine']:8.2f}" if r["x_first_engine"] is not None else f"{'-':>8s}"
        print(
            f"{name:{width}s} {r['samples_per_s']:9.1f} {r['x_sync']:7.2f} {r['bound_fraction']:8.2f} {x_free} "
            f"{x_first} {r['trainer_idle_ratio']:8.2f} {r['generator_idle_ratio']:8.2f} "
            f"{str(r['staleness_max_hist']):>14s} {r['groups_dropped_stale']:5d} {r['partial_samples']:7d} "
            f"{r['final_reward']:6.3f} {r['response_len']:8.1f} {r['step_s_median']:7.3f} "
            f"{r['dataplane_step_fraction']:7.3f}  {ph}"
        )
    bound = bounds[next(iter(bounds))]
    out_path = Path(args.out)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(
        json.dumps(
            {
                "args": vars(args),
                "ideal_overlap_bound": bound,
                "ideal_overlap_bound_per_engine": bounds,
                "wall_s": time.time() - t0,
                "results": results,
            },
            indent=2,
        )
    )
    print(f"\nwrote {out_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
