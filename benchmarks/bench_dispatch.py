"""Per-step dispatch overhead and whole-step time: actor calls vs one Ray Compiled Graph.

    PYTHONPATH=$PWD python3 benchmarks/bench_dispatch.py [--ranks 1 2 4 8] [--calls 200] [--steps 6]
        [--idle-teardown-s 6] [--config examples/configs/grpo_tiny.yaml] [--no-step] [dotted.key=value ...]

Part 1, dispatch overhead: for each rank count, no-op actors (``get_logprobs``/``train``/
``step_call`` return a small dict at once) driven through the trainer's own dispatchers
(:mod:`algorithms.dispatch`), each call carrying a per-rank ``KVBatchMeta`` of 32 keys, as the
trainer's calls do. A call is timed from the driver's dispatch to every rank's result in hand;
``--calls`` calls per mode after a warm-up, median reported, and ``per_rank_us`` = median / ranks.
The ratio is compiled_graph / actors in the same run. While a graph is compiled its idle actors
poll: ``idle_cpu_pct`` is the mean CPU% of one actor process over 3 s with no call in flight
(psutil when installed, else /proc): with plain actors, with the graph compiled, and once the
graph's idle teardown (``--idle-teardown-s``, the trainer's ``trainer.dispatch_idle_teardown_s``)
has torn it down; ``recompile_ms`` is the first call after that teardown (it recompiles the
graph), ``recompile_s`` the compile alone. An idle period of ``T`` seconds then costs each rank
about ``min(T, idle_teardown_s) * idle_cpu_pct_graph / 100`` CPU-seconds instead of
``T * idle_cpu_pct_graph / 100``.

Part 2, whole step: the sync trainer (``python -m algorithms.grpo_sync``, one subprocess per mode,
each owning its Ray cluster) with ``trainer.dispatch=actors`` and ``compiled_graph``; medians of
``step_s`` and the ``logprobs``/``train`` phases over the steps after the first two (the warm-up
step and the step that compiles the graph).

Prints a table and writes ``benchmarks/results/bench_dispatch.json``. Needs ray and torch only.
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
sys.path.insert(0, str(REPO))
PHASES = ("logprobs", "train", "refit", "generate")


class NoOpRank:
    """A policy rank whose per-step calls return at once (the dispatch cost is all that is left)."""

    def __init__(self, rank: int) -> None:
        self.rank = rank

    def get_logprobs(self, batch: Any, step: int, *, with_reference: bool = False) -> dict[str, Any]:
        return {"rank": self.rank, "step": step, "n": len(batch), "dp_bytes": 0, "io_s": 0.0, "compute_s": 0.0}

    def train(self, batch: Any, step: int, *, behaviour: bool = False) -> dict[str, Any]:
        return {"rank": self.rank, "step": step, "n": len(batch), "dp_bytes": 0, "io_s": 0.0, "compute_s": 0.0}

    def step_call(self, kind: str, batch: Any, step: int, flag: bool) -> dict[str, Any]:
        return self.train(batch, step, behaviour=flag) if kind == "train" else self.get_logprobs(batch, step)

    def pid(self) -> int:
        return os.getpid()


def _cpu_seconds(pid: int) -> float:
    try:
        import psutil

        t = psutil.Process(pid).cpu_times()
        return t.user + t.system
    except ImportError:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def idle_cpu_pct(pids: list[int], seconds: float = 3.0) -> float:
    """Mean CPU% of the processes ``pids`` over ``seconds`` (nothing dispatched meanwhile)."""
    before = [_cpu_seconds(p) for p in pids]
    time.sleep(seconds)
    after = [_cpu_seconds(p) for p in pids]
    return 100.0 * statistics.mean(a - b for a, b in zip(after, before)) / seconds


def bench_overhead(ranks: int, calls: int, idle_teardown_s: float) -> dict[str, Any]:
    import ray

    from algorithms.dispatch import ActorDispatch, CompiledGraphDispatch
    from nemo_dataplane.meta import KVBatchMeta

    cls = ray.remote(num_cpus=0)(NoOpRank)
    actors = [cls.remote(r) for r in range(ranks)]
    pids = ray.get([a.pid.remote() for a in actors], timeout=120)
    inputs = [
        KVBatchMeta(
            keys=tuple(f"r{r}k{i}" for i in range(32)),
            tags=tuple({"seq_len": 40} for _ in range(32)),
            partition_id="rollouts",
            fields=("input_ids", "prompt_len"),
            extra_info={"packing": {"microbatches": [list(range(16)), list(range(16, 32))]}},
        )
        for r in range(ranks)
    ]
    out: dict[str, Any] = {"ranks": ranks}
    graph = CompiledGraphDispatch(actors, warmup_calls=0, idle_teardown_s=idle_teardown_s)
    try:
        out["idle_cpu_pct_actors"] = idle_cpu_pct(pids)
        for name, d in (("actors", ActorDispatch(actors)), ("compiled_graph", graph)):
            for i in range(20):  # warm-up (and the graph's compile, on its first call)
                d.call("train" if i % 2 else "logprobs", inputs, i, False, 60.0, "warm-up")
            times = []
            for i in range(calls):
                t0 = time.perf_counter()
                res = d.call("train" if i % 2 else "logprobs", inputs, i, False, 60.0, "bench")
                times.append(time.perf_counter() - t0)
                assert [r["rank"] for r in res] == list(range(ranks)) and res[0]["step"] == i
            out[f"{name}_us"] = 1e6 * statistics.median(times)
            out[f"{name}_per_rank_us"] = out[f"{name}_us"] / ranks
        if graph.fallback_reason is not None or graph.graph_calls < calls:
            raise RuntimeError(f"the compiled graph did not serve: {graph.fallback_reason}")
        out["compile_s"] = graph.compile_s
        out["idle_cpu_pct_graph"] = idle_cpu_pct(pids)
        if graph.idle_teardowns:
            raise RuntimeError(f"--idle-teardown-s {idle_teardown_s} ended before the graph's idle probe: raise it")
        deadline = time.monotonic() + idle_teardown_s + 60
        while graph.active and time.monotonic() < deadline:
            time.sleep(0.05)
        if graph.active:
            raise RuntimeError(f"the graph was not torn down within {idle_teardown_s}s + 60s idle")
        time.sleep(0.5)  # the teardown thread ends the loops within milliseconds
        out["idle_cpu_pct_torn_down"] = idle_cpu_pct(pids)
        t0 = time.perf_counter()
        res = graph.call("logprobs", inputs, calls, False, 60.0, "recompile")
        out["recompile_ms"] = 1e3 * (time.perf_counter() - t0)
        assert [r["rank"] for r in res] == list(range(ranks)) and res[0]["step"] == calls
        if graph.recompiles != 1 or graph.fallback_reason is not None:
            raise RuntimeError(f"the graph did not recompile: {graph.report()}")
        out["recompile_s"] = graph.recompile_s
        out["ratio"] = out["compiled_graph_us"] / out["actors_us"]
    finally:
        graph.close()
        for a in actors:
            ray.kill(a, no_restart=True)
    return out


def run_trainer(config: str, overrides: list[str], out_dir: Path, timeout: float) -> list[dict[str, Any]]:
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
        config,
        *overrides,
        f"logging.output_dir={out_dir}",
    ]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"run failed ({' '.join(overrides)}):\n{proc.stderr[-4000:]}")
    summary = json.loads((out_dir / "summary.json").read_text())
    if summary.get("dispatch", {}).get("fallback"):
        raise RuntimeError(f"compiled graph fell back: {summary['dispatch']['fallback']}")
    return [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def bench_step(config: str, steps: int, overrides: list[str], timeout: float) -> dict[str, Any]:
    base = [
        f"trainer.steps={steps}",
        "trainer.val_every=0",
        "checkpoint.every=0",
        "logging.progress=false",
        "logging.plot=false",
        "logging.quiet=true",
        *overrides,
    ]
    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for mode in ("actors", "compiled_graph"):
            rows = run_trainer(config, [*base, f"trainer.dispatch={mode}"], Path(tmp) / mode, timeout)[2:]
            out[mode] = {
                "step_s": statistics.median(r["step_s"] for r in rows),
                "steps": len(rows),
                **{f"time/{p}": statistics.median(r.get(f"time/{p}", 0.0) for r in rows) for p in PHASES},
            }
    out["ratio_step_s"] = out["compiled_graph"]["step_s"] / out["actors"]["step_s"]
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--steps", type=int, default=6, help="trainer steps per mode (the first two are not counted)")
    ap.add_argument("--config", default=str(REPO / "examples" / "configs" / "grpo_tiny.yaml"))
    ap.add_argument(
        "--idle-teardown-s",
        type=float,
        default=6.0,
        help="the graph's idle teardown in part 1 (> 3 s: the graph's idle probe runs before it)",
    )
    ap.add_argument("--no-step", action="store_true", help="skip part 2 (the trainer runs)")
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "bench_dispatch.json"))
    ap.add_argument("overrides", nargs="*", help="dotted.key=value for the trainer runs")
    args = ap.parse_args()

    import ray

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    # Workers of a local cluster inherit this environment. A runtime_env PYTHONPATH would replace
    # the driver's instead (on a machine whose packages come from PYTHONPATH, the workers could
    # then not import Ray itself and never start).
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    os.environ["OMP_NUM_THREADS"] = "1"
    ray.init(
        address="local",
        num_cpus=max(args.ranks) + 2,
        include_dashboard=False,
        logging_level="ERROR",
        log_to_driver=False,
    )
    try:
        overhead = [bench_overhead(n, args.calls, args.idle_teardown_s) for n in args.ranks]
    finally:
        ray.shutdown()

    print(f"dispatch overhead, no-op ranks, median of {args.calls} calls ({os.cpu_count()} CPUs, {platform.node()})")
    print(
        f"{'ranks':>5} {'actors us':>10} {'graph us':>10} {'graph/actors':>12} {'actors us/rank':>14} "
        f"{'graph us/rank':>13} {'idle cpu% actors':>16} {'idle cpu% graph':>15} {'idle cpu% torn down':>19} "
        f"{'recompile ms':>12}"
    )
    for o in overhead:
        print(
            f"{o['ranks']:>5} {o['actors_us']:>10.0f} {o['compiled_graph_us']:>10.0f} {o['ratio']:>12.2f} "
            f"{o['actors_per_rank_us']:>14.0f} {o['compiled_graph_per_rank_us']:>13.0f} "
            f"{o['idle_cpu_pct_actors']:>16.1f} {o['idle_cpu_pct_graph']:>15.1f} "
            f"{o['idle_cpu_pct_torn_down']:>19.1f} {o['recompile_ms']:>12.0f}"
        )
    print(
        f"idle cpu% torn down: {args.idle_teardown_s}s after the last call the idle teardown ended the graph; "
        "recompile ms: the next call, recompiling it"
    )
    step = None if args.no_step else bench_step(args.config, args.steps, args.overrides, args.timeout)
    if step is not None:
        print(
            f"\nwhole step, sync trainer, {args.config} {' '.join(args.overrides)}, "
            f"median over steps 2..{args.steps - 1}"
        )
        print(f"{'dispatch':>15} {'step_s':>8} " + " ".join(f"{p:>9}" for p in PHASES))
        for mode in ("actors", "compiled_graph"):
            s = step[mode]
            print(f"{mode:>15} {s['step_s']:>8.3f} " + " ".join(f"{s[f'time/{p}']:>9.3f}" for p in PHASES))
        print(f"compiled_graph / actors step_s: {step['ratio_step_s']:.3f}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "overhead": overhead,
                "step": step,
                "calls": args.calls,
                "cpus": os.cpu_count(),
                "idle_teardown_s": args.idle_teardown_s,
                "host": platform.node(),
                "ray": ray.__version__,
            },
            indent=2,
        )
    )
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
