"""Soak: the async trainer for many steps with a fault injected at a random step, then a restart
with ``checkpoint.resume=latest``, again and again (issue 14, item 5).

``python benchmarks/soak.py --minutes 30`` (the CI-independent long run) or ``--steps 300``.
Each segment is one ``python -m algorithms.grpo_async`` process (tiny model, a small batch,
checkpoint every ``--ckpt-every`` steps) carrying one fault from :mod:`algorithms.faults`, drawn
at random (``--seed``) among :data:`FAULTS`, at a random step ``--min-gap``..``--max-gap`` steps
after the segment's resume point. A fault counts as *survived* when its segment exits 1 with an
error naming the failed component (the kind's pattern below) and the next segment resumes from
the latest checkpoint and trains at least one step past it. When time or steps run out, a last
segment without a fault resumes and finishes (exit 0), which checks the last fault's resume.

Reports (a table on stdout, JSON in ``--out``): faults injected and survived per kind, time
from fault to error per kind (the hook's marker to the trainer's ``summary.json``, shutdown
included), max keys outstanding over every step, at each exit the keys the trainer found in the
store and the keys it found leaked (in no group in flight), both counted before its final clear
(``-1``: the store itself was killed, nothing to count; ``None``: the segment wrote no summary),
keys left after the final exit's clear and store bytes then (0 when no key is left: rows live
only under keys), and whether every handed-out prompt was trained exactly once or is still
pending (``trained_groups.jsonl``).

Exit status: 0 when every fault that fired was survived, the final segment exited 0 and no exit
leaked a key (:func:`soak_ok`); else 1. A leak fails the soak even where the trainer went on.

``--outside-kills N``: no hook in the code; N trials, each one trainer signalled from this process
at a random moment (a policy rank, the generator, a collector, a TransferQueue actor, the driver,
the raylet or the GCS), then checked for a bounded, named exit, orphan processes and a resume
(:mod:`soak_outside`; JSON in ``benchmarks/results/soak_outside.json``).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "examples" / "configs" / "grpo_async_tiny.yaml"
CONFIG_SYNC = REPO / "examples" / "configs" / "grpo_tiny.yaml"
# Victim kinds of --outside-kills (soak_outside.KINDS plus the driver), kept here so --help needs no psutil.
VICTIMS = ("driver", "policy_rank", "generator", "collector", "store_controller", "store_unit", "raylet", "gcs_server")

# kind -> (debug overrides with {step}/{group} placeholders, regex the error must match)
FAULTS: dict[str, tuple[tuple[str, ...], str]] = {
    "reward_raises": (
        ("debug.fail_in=reward", "debug.fail_at_group={group}"),
        r"reward_fn .* raised RuntimeError|raised InjectedFailure on prompt uid",
    ),
    "train_raises": (
        ("debug.fail_in=train", "debug.fail_at_step={step}", "debug.fail_rank=1"),
        r"injected failure at step \d+ on policy rank 1",
    ),
    "sigkill_policy_rank": (
        ("debug.fail_in=train", "debug.fail_at_step={step}", "debug.fail_rank=1", "debug.fail_mode=sigkill"),
        r"policy rank 1 died or was lost",
    ),
    "sigkill_collector": (
        ("debug.fail_in=generate", "debug.fail_at_group={group}", "debug.fail_mode=sigkill"),
        r"collector 0 died or was lost",
    ),
    "sigkill_generator": (
        ("debug.fail_in=generator", "debug.fail_at_step={step}", "debug.fail_mode=sigkill"),
        r"the generator (died or was lost|\(refit receiver\) died or was lost)",
    ),
    "kill_store_controller": (
        ("debug.fail_in=store_controller", "debug.fail_at_step={step}"),
        r"TransferQueue controller '.*' died or was lost",
    ),
    "kill_store_unit": (
        ("debug.fail_in=store_unit", "debug.fail_at_step={step}"),
        r"TransferQueue storage unit '.*' died or was lost",
    ),
    "refit_peer_never_arrives": (
        ("debug.fail_in=refit", "debug.fail_at_step={step}", "debug.fail_mode=hang", "refit.timeout_s=10"),
        r"the generator \(refit rank 1\) never took part",
    ),
}

BASE = (
    "grpo.prompts_per_step=4",
    "generation.n=4",
    "data_plane.packing.micro_batch_size=4",
    "async.groups_per_generation=2",
    "generation.max_new_tokens=2",
    "trainer.val_every=0",
    "trainer.step_timeout_s=120",
    "trainer.startup_timeout_s=240",
    "task.val_size=16",
    "logging.quiet=true",
    "logging.progress=false",
    "logging.plot=false",
    "checkpoint.keep=2",
    # The controller and the storage unit as two processes (by default the controller holds the
    # one unit), so each kind of store process can be the victim.
    "data_plane.transfer_queue.unit_in_controller=false",
)


def exit_keys(summary: dict[str, Any]) -> dict[str, Any]:
    """A segment's exit as its trainer counted the store before the final clear: keys held
    (``in_store``) and keys of no group in flight (``leaked``), then ``left`` after the clear."""
    return {
        "in_store": summary.get("keys_in_store_at_exit"),
        "leaked": summary.get("keys_leaked_at_exit"),
        "left": summary.get("keys_outstanding_at_exit"),
    }


def soak_ok(report: dict[str, Any]) -> bool:
    """Every fault that fired survived, the final segment finished (exit 0, nothing left after its
    clear), and no exit leaked (a count > 0; -1, the store gone, and None, no summary, are not)."""
    return (
        report["faults_survived"] == report["faults_injected"]
        and report["final_exit_code"] == 0
        and report["keys_left_at_final_exit"] == 0
        and not any((k or 0) > 0 for k in report["keys_leaked_at_each_exit"])
    )


def _rows(path: Path) -> list[dict[str, Any]]:
    return [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()] if path.exists() else []


def trainer_env() -> dict[str, str]:
    """The environment of a soak's trainer process."""
    env = dict(
        os.environ,
        OMP_NUM_THREADS="1",
        RAY_DEDUP_LOGS="0",
        RAY_USAGE_STATS_ENABLED="0",
        PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    )
    env.pop("RAY_ADDRESS", None)
    return env


def _segment(
    out: Path,
    steps: int,
    ckpt_every: int,
    overrides: tuple[str, ...],
    resume: bool,
    timeout: float,
    module: str = "grpo_async",
) -> dict[str, Any]:
    marker = out / "fault_marker"
    marker.unlink(missing_ok=True)
    (out / "summary.json").unlink(missing_ok=True)
    cmd = [
        sys.executable,
        "-m",
        f"algorithms.{module}",
        "--config",
        str(CONFIG if module == "grpo_async" else CONFIG_SYNC),
        *(o for o in BASE if module == "grpo_async" or not o.startswith("async.")),
        f"trainer.steps={steps}",
        f"checkpoint.every={ckpt_every}",
        f"logging.output_dir={out}",
        f"debug.fault_marker={marker}",
        # Segments resume with a growing trainer.steps; a segment before any checkpoint starts
        # over in the same directory.
        *(
            ("checkpoint.resume=latest", "checkpoint.allow_config_change=true")
            if resume
            else ("logging.overwrite=true",)
        ),
        *overrides,
    ]
    t0 = time.time()
    try:
        proc = subprocess.run(cmd, cwd=REPO, env=trainer_env(), capture_output=True, text=True, timeout=timeout)
        code, stderr = proc.returncode, proc.stderr
    except subprocess.TimeoutExpired as e:
        code, stderr = -1, f"segment timed out after {timeout}s: {(e.stderr or b'')[-2000:]!r}"
    summary = json.loads((out / "summary.json").read_text()) if (out / "summary.json").exists() else {}
    fault_t = float(marker.read_text()) if marker.exists() else None
    end_t = (out / "summary.json").stat().st_mtime if (out / "summary.json").exists() else None
    return {
        "code": code,
        "stderr": stderr,
        "summary": summary,
        "wall_s": time.time() - t0,
        "time_to_error_s": (end_t - fault_t) if fault_t is not None and end_t is not None else None,
    }


def _newest_group(out: Path) -> int:
    groups = [g for r in _rows(out / "trained_groups.jsonl") for g in r["groups"]]
    return max(groups, default=-1)


def _latest_step(out: Path) -> int:
    done = sorted(int(p.name.split("_")[1]) for p in (out / "checkpoints").glob("step_*") if (p / "COMPLETE").exists())
    return done[-1] if done else 0


def _lossless(out: Path, summary: dict[str, Any]) -> bool:
    handouts = [h for r in _rows(out / "trained_groups.jsonl") for h in r["handouts"]]
    pending = summary.get("prompts_in_flight_at_exit", [])
    return len(handouts) == len(set(handouts)) and sorted(handouts + pending) == list(
        range(summary.get("prompts_handed_out", -1))
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, default=None, help="stop injecting after this long (then finish)")
    ap.add_argument("--steps", type=int, default=None, help="total steps (default 300; unbounded with --minutes)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--min-gap", type=int, default=3, help="fewest steps between a resume and the next fault")
    ap.add_argument("--max-gap", type=int, default=15)
    ap.add_argument("--ckpt-every", type=int, default=2)
    ap.add_argument("--faults", nargs="+", default=sorted(FAULTS), choices=sorted(FAULTS))
    ap.add_argument("--segment-timeout", type=float, default=600)
    ap.add_argument("--dir", default=None, help="runs/soak (runs/soak_outside with --outside-kills)")
    ap.add_argument("--out", default=None, help="benchmarks/results/soak.json (soak_outside.json)")
    out_side = ap.add_argument_group("outside kills (benchmarks/soak_outside.py)")
    out_side.add_argument("--outside-kills", type=int, default=0, metavar="N", help="run N outside-kill trials")
    out_side.add_argument("--trainer", default="grpo_async", choices=["grpo_async", "grpo_sync"])
    out_side.add_argument(
        "--trial-steps",
        type=int,
        default=100_000,
        help="trainer.steps of each trial: more than it trains before its signal, so the signal lands",
    )
    out_side.add_argument(
        "--victims", nargs="+", default=list(VICTIMS), choices=list(VICTIMS), help="kinds to draw victims from"
    )
    out_side.add_argument(
        "--signal-weights",
        nargs="+",
        default=["SIGKILL=0.6", "SIGTERM=0.2", "SIGINT=0.2"],
        help="NAME=weight for SIGKILL, SIGTERM, SIGINT",
    )
    out_side.add_argument("--startup-frac", type=float, default=0.25, help="share of trials signalled in start-up")
    out_side.add_argument(
        "--startup-window", type=float, default=10.0, help="start-up kill: 0..this s after the victim's kind is up"
    )
    out_side.add_argument("--kill-window", type=float, default=15.0, help="0..this s after the first step")
    out_side.add_argument("--startup-timeout", type=float, default=400.0, help="wait this long for a first step")
    out_side.add_argument("--exit-bound", type=float, default=120.0, help="the run must end this long after the signal")
    out_side.add_argument("--grace", type=float, default=60.0, help="the run's processes must be gone this long after")
    out_side.add_argument(
        "--linger", type=float, default=150.0, help="watch orphans this long after the exit before killing them"
    )
    out_side.add_argument("--resume", action=argparse.BooleanOptionalAction, default=True)
    out_side.add_argument(
        "--engines",
        type=int,
        default=1,
        help="engines per trial (generation.num_engines / async.num_collectors); >= 2: a generator or "
        "collector signalled must be survived without a restart",
    )
    args = ap.parse_args(argv)
    name = "soak_outside" if args.outside_kills else "soak"
    args.dir = args.dir or str(REPO / "runs" / name)
    args.out = args.out or str(REPO / "benchmarks" / "results" / f"{name}.json")
    if args.outside_kills:
        import soak_outside

        return soak_outside.main(args)
    steps = args.steps if args.steps is not None else (10**6 if args.minutes else 300)
    deadline = time.time() + args.minutes * 60 if args.minutes else float("inf")
    rng = random.Random(args.seed)
    out = Path(args.dir)
    if out.exists():
        import shutil

        shutil.rmtree(out)
    out.mkdir(parents=True)
    G = 4
    t_start = time.time()
    events: list[dict[str, Any]] = []
    exits: list[dict[str, Any]] = []
    done, resume = 0, False
    final: dict[str, Any] = {}
    while True:
        last = time.time() >= deadline or done >= steps - args.max_gap
        if last:
            res = _segment(out, min(steps, done + 5), args.ckpt_every, (), resume, args.segment_timeout)
            final = res
            ok = res["code"] == 0
            if events and events[-1]["survived"] is None:
                events[-1]["survived"] = events[-1]["named"] and ok
            exits.append(exit_keys(res["summary"]))
            break
        kind = rng.choice(args.faults)
        at = done + rng.randint(args.min_gap, args.max_gap)
        keys, pattern = FAULTS[kind]
        # Group ids grow by G per step from the newest one trained, plus retries and regenerations
        # (which run the counter ahead of step * G): a group-keyed fault lands at or after `at`.
        group = _newest_group(out) + 1 + (at - done) * G + rng.randrange(G)
        overrides = tuple(k.format(step=at, group=group) for k in keys)
        # A fault that never fires (its group was handed out before the segment began) must not
        # leave the segment running until --segment-timeout: it ends a few gaps later instead.
        seg_steps = min(steps, at + 2 * args.max_gap)
        res = _segment(out, seg_steps, args.ckpt_every, overrides, resume, args.segment_timeout)
        rows = _rows(out / "metrics.jsonl")
        resumed_to = _latest_step(out)
        if events and events[-1]["survived"] is None:  # this segment is the previous fault's resume
            prev = events[-1]
            prev["survived"] = prev["named"] and any(r["step"] >= prev["resume_from"] for r in rows)
        named = res["code"] == 1 and re.search(pattern, res["stderr"]) is not None
        ev = {
            "kind": kind,
            "at_step": at,
            "exit": res["code"],
            "named": named,
            "time_to_error_s": res["time_to_error_s"],
            "keys_at_exit": exit_keys(res["summary"]),
            "steps_logged": len(rows),
            "resume_from": resumed_to,
            "survived": None,
            "wall_s": round(res["wall_s"], 1),
        }
        if not named:
            ev["stderr_tail"] = res["stderr"][-1500:]
        if res["code"] == 0:  # the fault never fired (e.g. a group id not reached): the run finished
            ev["survived"] = None
            ev["note"] = "fault did not fire before the run finished"
        events.append(ev)
        exits.append(ev["keys_at_exit"])
        print(
            f"[{time.time() - t_start:7.1f}s] {kind:26s} at step {at:4d}: exit {res['code']}, named={named}, "
            f"time to error {ev['time_to_error_s'] and round(ev['time_to_error_s'], 2)} s, keys at exit "
            f"{ev['keys_at_exit']}, resume from {resumed_to}",
            flush=True,
        )
        done, resume = resumed_to, True
    rows = _rows(out / "metrics.jsonl")
    fsum = final.get("summary", {})
    per_kind: dict[str, dict[str, Any]] = {}
    fired = [ev for ev in events if not ev.get("note")]
    for ev in fired:
        k = per_kind.setdefault(ev["kind"], {"injected": 0, "survived": 0, "times": []})
        k["injected"] += 1
        k["survived"] += bool(ev["survived"])
        if ev["time_to_error_s"] is not None:
            k["times"].append(round(ev["time_to_error_s"], 2))
    report = {
        "args": vars(args),
        "wall_s": round(time.time() - t_start, 1),
        "steps_trained": len(rows),
        "faults_injected": len(fired),
        "faults_not_fired": len(events) - len(fired),
        "faults_survived": sum(bool(e["survived"]) for e in fired),
        "per_kind": per_kind,
        "max_keys_outstanding": max((r["keys_outstanding"] for r in rows), default=0),
        "keys_outstanding_bound": fsum.get("keys_outstanding_bound"),
        "keys_in_store_at_each_exit": [e["in_store"] for e in exits],
        "keys_leaked_at_each_exit": [e["leaked"] for e in exits],
        "final_exit_code": final.get("code"),
        "keys_leaked_at_final_exit": fsum.get("keys_leaked_at_exit"),
        "keys_left_at_final_exit": fsum.get("keys_outstanding_at_exit"),
        "store_bytes_at_final_exit": 0 if fsum.get("keys_outstanding_at_exit") == 0 else None,
        "every_prompt_trained_once_or_pending": _lossless(out, fsum) if fsum else None,
        "events": events,
    }
    print(
        f"\nsoak: {report['steps_trained']} steps, {report['faults_injected']} faults injected, "
        f"{report['faults_survived']} survived ({report['faults_not_fired']} drawn but never fired), "
        f"{report['wall_s']} s"
    )
    print(f"{'fault':26s} {'injected':>8s} {'survived':>8s} {'time to error s (each)':s}")
    for kind, k in sorted(per_kind.items()):
        print(f"{kind:26s} {k['injected']:8d} {k['survived']:8d} {k['times']}")
    print(
        f"max keys outstanding {report['max_keys_outstanding']} (bound {report['keys_outstanding_bound']}); keys in "
        f"the store / leaked at each exit (before its clear) {report['keys_in_store_at_each_exit']} / "
        f"{report['keys_leaked_at_each_exit']}; final exit {report['final_exit_code']}, keys left after its clear "
        f"{report['keys_left_at_final_exit']}, store bytes {report['store_bytes_at_final_exit']}; "
        "every prompt trained once or pending: "
        f"{report['every_prompt_trained_once_or_pending']}"
    )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(f"wrote {args.out}")
    return 0 if soak_ok(report) else 1


if __name__ == "__main__":
    sys.exit(main())
