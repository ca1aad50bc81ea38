"""Engine-loss soak: generation engines SIGKILLed from outside at random moments, survived without
a restart (grpo_sync with ``generation.num_engines``; docs/reliability.md, "Losing a generation
engine").

``python benchmarks/soak_engines.py --trials 4 --kills 5 --seed 0``

First one undisturbed reference run; then each trial starts the same run (``--engines`` engines,
``--steps`` steps, ``generation.max_replacements`` = ``--kills``) and, once it trains, SIGKILLs
``--kills`` times one live process of a drawn kind (an engine's generator or its collector,
found by the run's ``SOAK_RUN_TAG``; :mod:`soak_outside`), each once the pool is back at full
strength and has trained a step since, at a random moment 0..``--gap`` s later (so one engine
dies at a time, in whatever phase the run is in). A trial passes when the run:

* exits 0 with every step trained and no resume;
* trains exactly the reference run's steps: per-step reward, loss, grad norm and sample count
  bitwise equal (each response is drawn from its own seed, so a prompt lost or trained twice
  would change them);
* records a loss for every landed kill (``generators_lost_total``; a kill of a replacement that
  had not joined yet is left out of the group instead, and counted apart) and leaks no key.

Writes a table on stdout and JSON (``--out``, default ``benchmarks/results/soak_engines.json``)
after every trial. Exit status 0 when every trial passed.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import soak_outside
from soak import CONFIG_SYNC, REPO, trainer_env

KINDS = {"generator": soak_outside.KINDS["generator"], "collector": soak_outside.KINDS["collector"]}
COMPARED = ("reward", "loss", "grad_norm", "samples")


def _command(out: Path, args: argparse.Namespace, kills: int) -> list[str]:
    return [
        sys.executable,
        "-m",
        "algorithms.grpo_sync",
        "--config",
        str(CONFIG_SYNC),
        f"trainer.steps={args.steps}",
        "trainer.val_every=0",
        "trainer.step_timeout_s=120",
        "trainer.startup_timeout_s=240",
        "checkpoint.every=0",
        "logging.quiet=true",
        "logging.progress=false",
        "logging.plot=false",
        "logging.overwrite=true",  # a soak's directories are its own, run after run
        "grpo.prompts_per_step=6",
        "generation.n=4",
        "data_plane.packing.micro_batch_size=6",
        f"generation.num_engines={args.engines}",
        f"generation.max_replacements={max(kills, 1)}",
        f"logging.output_dir={out}",
    ]


def _rows(out: Path) -> list[dict[str, Any]]:
    path = out / "metrics.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []


def _live(sid: int, tag: str, kind: str) -> list[Any]:
    return [p for p in soak_outside.snapshot(sid, tag) if p.ours and re.search(KINDS[kind], p.cmdline)]


def _full_strength(rows: list[dict[str, Any]], live: int, args: argparse.Namespace) -> bool:
    """Every engine lost so far replaced by one that joined the refit group, and that many
    generator processes up."""
    lost = sum(int(r.get("generators_lost") or 0) for r in rows)
    joined = sum(int(r.get("generators_replaced") or 0) for r in rows)
    return joined >= lost and live >= args.engines


def _run(out: Path, args: argparse.Namespace, kills: int, rng: random.Random) -> dict[str, Any]:
    """One run, SIGKILLing ``kills`` engine processes once it trains."""
    out.mkdir(parents=True, exist_ok=True)
    tag = f"soak-engines-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    t0 = time.time()
    with open(out / "stdout.log", "w") as so, open(out / "stderr.log", "w") as se:
        proc = subprocess.Popen(
            _command(out, args, kills),
            cwd=REPO,
            env={**trainer_env(), soak_outside.TAG_ENV: tag},
            stdout=so,
            stderr=se,
            start_new_session=True,
        )
    sent: list[dict[str, Any]] = []
    while proc.poll() is None and not _rows(out) and time.time() - t0 < args.startup_timeout:
        time.sleep(0.2)
    for _ in range(kills):
        # Paced: the pool back at full strength (every replacement joined: a replacement joins
        # at the first refit after its start-up, generation.replacement_join=ready) and a step
        # trained since, then a random moment: every kill is survivable by design (one engine
        # dies at a time), and lands in whatever phase the run is in.
        while proc.poll() is None and not _full_strength(_rows(out), len(_live(proc.pid, tag, "generator")), args):
            time.sleep(0.2)
        seen = len(_rows(out))
        while proc.poll() is None and len(_rows(out)) <= seen:
            time.sleep(0.1)
        wake = time.time() + rng.uniform(0.0, args.gap)
        while proc.poll() is None and time.time() < wake:
            time.sleep(0.05)
        if proc.poll() is not None:
            break
        kind = rng.choice(sorted(KINDS))
        live = _live(proc.pid, tag, kind)
        if not live:
            continue
        victim = rng.choice(live)
        try:
            os.kill(victim.pid, signal.SIGKILL)
        except ProcessLookupError:
            continue
        sent.append({"kind": kind, "pid": victim.pid, "at_s": time.time() - t0, "step": len(_rows(out))})
    try:
        proc.wait(timeout=args.exit_bound)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    summary_path = out / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    return {"exit": proc.returncode, "wall_s": time.time() - t0, "kills": sent, "summary": summary, "rows": _rows(out)}


def _verdict(run: dict[str, Any], ref: list[dict[str, Any]], steps: int) -> list[str]:
    """What is wrong with a trial's run (empty: it passed)."""
    s, rows, bad = run["summary"], run["rows"], []
    if run["exit"] != 0:
        bad.append(f"exit {run['exit']}: {s.get('error', '')[:200]}")
    if len(rows) != steps or "resumed_from" in s:
        bad.append(f"{len(rows)} of {steps} steps")
    for key in COMPARED:
        if [r.get(key) for r in rows] != [r.get(key) for r in ref]:
            bad.append(f"{key} differs from the undisturbed run")
    if s.get("generators_lost_total", 0) < len(run["kills"]) - s.get("replacements_left_out", 0):
        bad.append(f"{len(run['kills'])} kills landed, {s.get('generators_lost_total')} losses recorded")
    if s.get("keys_leaked_at_exit") != 0:
        bad.append(f"keys leaked at exit: {s.get('keys_leaked_at_exit')}")
    return bad


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--trials", type=int, default=4)
    ap.add_argument("--kills", type=int, default=5, help="SIGKILLs per trial")
    ap.add_argument("--engines", type=int, default=3)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--gap", type=float, default=3.0, help="longest random delay before a kill")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--startup-timeout", type=float, default=300.0)
    ap.add_argument("--exit-bound", type=float, default=600.0, help="seconds a run may take after its kills")
    ap.add_argument("--dir", default=str(REPO / "runs" / "soak_engines"))
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "soak_engines.json"))
    args = ap.parse_args(argv)
    rng = random.Random(args.seed)
    root = Path(args.dir)
    ref = _run(root / "reference", args, 0, rng)
    if ref["exit"] != 0:
        print(f"reference run failed: exit {ref['exit']}", file=sys.stderr)
        return 1
    report: dict[str, Any] = {"args": vars(args), "reference_wall_s": ref["wall_s"], "trials": []}
    print("trial  kills  lost  replaced  requeued  wall s  resumed s (max)  verdict")
    for i in range(args.trials):
        run = _run(root / f"trial{i}", args, args.kills, rng)
        bad = _verdict(run, ref["rows"], args.steps)
        s = run["summary"]
        resumed = [x["resumed_s"] for x in s.get("generator_losses", []) if x.get("resumed_s") is not None]
        trial = {
            "trial": i,
            "exit": run["exit"],
            "wall_s": run["wall_s"],
            "kills": run["kills"],
            "losses": s.get("generator_losses", []),
            "generators_lost_total": s.get("generators_lost_total"),
            "generators_replaced_total": s.get("generators_replaced_total"),
            "groups_requeued_lost_total": s.get("groups_requeued_lost_total"),
            "replacement_first_generation_s": s.get("replacement_first_generation_s"),
            "problems": bad,
        }
        report["trials"].append(trial)
        print(
            f"{i:>5}  {len(run['kills']):>5}  {s.get('generators_lost_total')!s:>4}  "
            f"{s.get('generators_replaced_total')!s:>8}  {s.get('groups_requeued_lost_total')!s:>8}  "
            f"{run['wall_s']:>6.1f}  {max(resumed, default=0.0):>15.2f}  {'ok' if not bad else '; '.join(bad)}",
            flush=True,
        )
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=2))
    trials = report["trials"]
    landed = sum(len(t["kills"]) for t in trials)
    passed = sum(not t["problems"] for t in trials)
    print(
        f"{passed} of {len(trials)} trials passed; {landed} kills landed, every one survived: {passed == len(trials)}"
    )
    return 0 if passed == len(trials) else 1


if __name__ == "__main__":
    sys.exit(main())
