"""Per-step time by phase and bytes through the driver: data plane vs legacy, two batch sizes.

    python benchmarks/bench_grpo_step.py [--steps 6] [--warmup 1] [--config examples/configs/grpo_tiny.yaml]
        [--large-prompts 4] [--large-seq 4] [dotted.key=value ...]

Runs the real trainer (``python -m algorithms.grpo_sync``, one subprocess per run, each owning its
Ray cluster) four times: {legacy, data_plane} x {default, large} where "large" multiplies
``grpo.prompts_per_step`` and ``generation.max_new_tokens`` (the sequence length of a randomly
initialised model's responses) by the given factors. Every number is a mean over the steps after
``--warmup`` (median), read from each run's metrics.jsonl; ``worker_io`` is the slowest
rank's time to get its rows and write results back (store fetch + write-back, or splitting the
shipped shard), summed over the log-prob and train phases (it is part of those phases). The legacy
run at the same size is the baseline:
the table reports ``data_plane / legacy`` ratios. Prints a table and writes
``benchmarks/results/bench_grpo_step.json``. Learning is irrelevant here (random init, no
validation, no checkpoints).
"""

from __future__ import annotations

import argparse
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
PHASES = ("generate", "advantages", "preshard", "logprobs", "train", "release", "refit", "worker_io", "worker_compute")


def run_once(config: Path, overrides: list[str], out_dir: Path, timeout: float) -> list[dict[str, Any]]:
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
        "algorithms.grpo_sync",
        "--config",
        str(config),
        *overrides,
        f"logging.output_dir={out_dir}",
    ]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"run failed ({' '.join(overrides)}):\n{proc.stderr[-4000:]}")
    return [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def summarize(rows: list[dict[str, Any]], warmup: int) -> dict[str, float]:
    rows = rows[warmup:]
    # Medians: the machine is shared, and one slow step should not move the table.
    out = {"step_s": statistics.median(r["step_s"] for r in rows)}
    for p in PHASES:
        out[f"time/{p}"] = statistics.median(r.get(f"time/{p}", 0.0) for r in rows)
    for k in ("driver_bytes", "dp_bytes", "tokens", "samples", "response_len", "keys_outstanding"):
        out[k] = statistics.median(float(r.get(k) or 0) for r in rows)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=str(REPO / "examples" / "configs" / "grpo_tiny.yaml"))
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--large-prompts", type=int, default=4)
    ap.add_argument("--large-seq", type=int, default=4)
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "bench_grpo_step.json"))
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    if args.steps <= args.warmup:
        ap.error("--steps must exceed --warmup")

    sys.path.insert(0, str(REPO))
    from algorithms.config import load_config

    base_cfg = load_config(args.config, args.overrides)
    common = [
        f"trainer.steps={args.steps}",
        "trainer.val_every=0",
        "checkpoint.every=0",
        "logging.progress=false",
        "logging.plot=false",
        "logging.quiet=true",
        *args.overrides,
    ]
    sizes = {
        "default": [],
        "large": [
            f"grpo.prompts_per_step={base_cfg.grpo.prompts_per_step * args.large_prompts}",
            f"generation.max_new_tokens={base_cfg.generation.max_new_tokens * args.large_seq}",
        ],
    }
    results: dict[str, dict[str, dict[str, float]]] = {}
    t0 = time.time()
    with tempfile.TemporaryDirectory(prefix="bench_grpo_") as tmp:
        for size, extra in sizes.items():
            results[size] = {}
            for path in ("legacy", "data_plane"):
                flag = "true" if path == "data_plane" else "false"
                out_dir = Path(tmp) / f"{size}_{path}"
                print(f"[bench] {size:8s} {path:10s} ...", file=sys.stderr, flush=True)
                rows = run_once(
                    Path(args.config), [*common, *extra, f"data_plane.enabled={flag}"], out_dir, args.timeout
                )
                results[size][path] = summarize(rows, args.warmup)

    header = (
        f"{'size':8s} {'path':10s} {'samples':>7s} {'resp_len':>8s} {'step_s':>7s} "
        + " ".join(f"{p[:8]:>8s}" for p in PHASES)
        + f" {'driver_B':>10s} {'store_B':>10s}"
    )
    lines = [header, "-" * len(header)]
    ratios: dict[str, dict[str, float | None]] = {}
    for size, by_path in results.items():
        for path, m in by_path.items():
            lines.append(
                f"{size:8s} {path:10s} {m['samples']:7.0f} {m['response_len']:8.2f} {m['step_s']:7.3f} "
                + " ".join(f"{m[f'time/{p}']:8.3f}" for p in PHASES)
                + f" {m['driver_bytes']:10.0f} {m['dp_bytes']:10.0f}"
            )
        dp, lg = by_path["data_plane"], by_path["legacy"]
        ratios[size] = {
            "step_s": dp["step_s"] / lg["step_s"],
            "driver_bytes": dp["driver_bytes"] / lg["driver_bytes"] if lg["driver_bytes"] else None,
            **{f"time/{p}": (dp[f"time/{p}"] / lg[f"time/{p}"] if lg[f"time/{p}"] else None) for p in PHASES},
        }
        r = ratios[size]
        lines.append(
            f"{size:8s} {'dp/legacy':10s} {'':7s} {'':8s} {r['step_s']:7.2f} "
            + " ".join(f"{r[f'time/{p}']:8.2f}" if r[f"time/{p}"] is not None else f"{'-':>8s}" for p in PHASES)
            + f" {r['driver_bytes']:10.4f}"
            if r["driver_bytes"] is not None
            else ""
        )
    table = "\n".join(lines)
    print(table)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "benchmark": "bench_grpo_step",
                "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                "machine": {"platform": platform.platform(), "cpus": os.cpu_count()},
                "args": vars(args),
                "sizes": sizes,
                "results": results,
                "ratios_data_plane_over_legacy": ratios,
                "table": table,
                "wall_s": time.time() - t0,
            },
            indent=2,
        )
    )
    print(f"[bench] wrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
