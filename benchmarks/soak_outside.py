"""Outside kills (issue 25, item 6): signals sent from another process at random moments, no hook
in the trainer's code. Run through ``python benchmarks/soak.py --outside-kills N`` (see there).

Each trial starts one trainer (``--trainer grpo_async`` or ``grpo_sync``, the soak's tiny config,
checkpoint every ``--ckpt-every`` steps, ``--trial-steps`` steps: more than it can train before
its signal, so the signal always lands on a running run) in a session of its own, waits a random
time (a share ``--startup-frac`` of the trials during start-up, 0..``--startup-window`` s after a
process of the drawn kind is up (the driver: its raylet); the rest 0..``--kill-window`` s after
``metrics.jsonl`` has its first line), then lists the run's
processes with psutil (its session, or its ``SOAK_RUN_TAG`` environment variable: Ray's workers
change their process group but keep both) and sends a signal (SIGKILL, SIGTERM or SIGINT, drawn
with ``--signal-weights``) to one process of a drawn kind (:data:`KINDS`; when no process of that
kind exists yet, one of the kinds present). A trial whose signal did not land (the run ended
first, or its victim was gone) is *not tried*, counted apart, and fails the soak. Then it checks:

* the driver exits within ``--exit-bound`` s. Driver alive after the signal: exit 1 with an error
  naming the lost component (:data:`NAMES`); or, when the signalled process is still alive after
  the bound (it survived the signal: the raylet ignores SIGINT), the soak stops the run with a
  Ctrl-C, which must end it with 130 (recorded apart). Driver signalled: 130 for SIGINT, 143 for
  SIGTERM (the trainer's own shutdown, then its exit), -9 for SIGKILL.
* no orphan: every process of the run listed at kill time, and any process started later with the
  run's session or tag, is gone (or a zombie) within ``--grace`` s of the driver's exit. Orphans
  are recorded (pid, kind, command line), then SIGKILLed so the next trial starts clean. Ray
  processes that appear during a trial outside the run (other jobs on the machine) are listed as
  ``foreign``, not counted.
* optionally (``--resume``), a run with ``checkpoint.resume=latest`` trains at least one step past
  the latest checkpoint (none yet: ``n/a``).
* with ``--engines N`` (N >= 2: ``generation.num_engines`` or ``async.num_collectors``), a
  signalled generator or collector must not end the run: within ``--exit-bound`` it trains
  :data:`TRAIN_ON_STEPS` more steps and a replacement joins, without a restart (the lost engine
  dropped, its groups requeued), then the soak ends it with a Ctrl-C (exit 130);
  ``summary.json``'s engines lost and replaced are recorded. No resume for these trials.

Writes a table on stdout and JSON (``--out``) after every trial, so a time-bounded
(``--minutes``) or interrupted run still leaves its trials.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

TAG_ENV = "SOAK_RUN_TAG"

# Victim kinds (besides "driver": the trainer's own pid) -> regex on the command line.
KINDS: dict[str, str] = {
    "policy_rank": r"^ray::PolicyWorker\b",
    "generator": r"^ray::GeneratorWorker\b",
    "collector": r"^ray::RolloutCollector\b",
    "store_controller": r"^ray::_Controller\b",
    "store_unit": r"^ray::_StorageUnit\b",
    "raylet": r"(^|/)raylet/raylet(\s|$)",
    "gcs_server": r"(^|/)gcs_server(\s|$)",
}
VICTIMS = ("driver", *KINDS)
# Anything else of Ray's (agents, monitors, idle workers): recorded, never drawn.
RAY_LIKE = r"^ray::|/ray/(core/src|_private|dashboard|autoscaler)/|(^|/)(raylet|gcs_server)(\s|$)"

# Victim kind -> what the driver's error must name when it survives. The node's own processes
# take every worker with them: any component named as lost will do.
LOST = r"died or was lost"
NAMES: dict[str, str] = {
    "policy_rank": r"policy rank \d+ died or was lost",
    "generator": r"the generator( \(refit receiver\))? died or was lost|the generator \(refit rank \d+\) never",
    "collector": r"collector \d+ died or was lost",
    "store_controller": r"TransferQueue controller '.*' died or was lost",
    "store_unit": r"TransferQueue storage unit '.*' died or was lost",
    "raylet": rf"{LOST}|raylet\b.*\bdead",
    "gcs_server": rf"{LOST}|GCS|gcs",
}
SIGNALS: dict[str, int] = {"SIGKILL": signal.SIGKILL, "SIGTERM": signal.SIGTERM, "SIGINT": signal.SIGINT}
# With several engines (--engines), losing one engine's process must not end the run: it trains
# on, at least this many steps after the signal, within --exit-bound (docs/reliability.md).
ENGINE_KINDS = ("generator", "collector")
TRAIN_ON_STEPS = 3


@dataclass(frozen=True)
class Proc:
    """One process as seen at a snapshot."""

    pid: int
    ppid: int
    create_time: float
    status: str
    cmdline: str
    ours: bool  # in the run's session or carrying its tag

    @property
    def key(self) -> tuple[int, float]:
        """pid and start time: the same process, not a recycled pid."""
        return (self.pid, round(self.create_time, 2))


@dataclass(frozen=True)
class TrialPlan:
    """What a trial will do, drawn up front from the seed."""

    phase: str  # "startup" (s after launch) or "training" (s after the first metrics line)
    delay_s: float
    kind: str
    signal: str


def plan_trials(
    seed: int,
    n: int,
    kinds: Sequence[str],
    signal_weights: dict[str, float],
    startup_frac: float,
    startup_window: float,
    kill_window: float,
) -> list[TrialPlan]:
    """Draw ``n`` trials: phase, delay, victim kind and signal (reproducible from ``seed``)."""
    rng = random.Random(seed)
    names = sorted(signal_weights)
    plans = []
    for _ in range(n):
        startup = rng.random() < startup_frac
        delay = rng.uniform(0, startup_window if startup else kill_window)
        sig = rng.choices(names, weights=[signal_weights[s] for s in names])[0]
        plans.append(TrialPlan("startup" if startup else "training", round(delay, 2), rng.choice(list(kinds)), sig))
    return plans


def kind_of(p: Proc, driver_pid: int) -> str | None:
    """The victim kind of a process, ``"ray_other"`` for Ray's other processes, else None."""
    if p.pid == driver_pid:
        return "driver"
    for kind, pattern in KINDS.items():
        if re.search(pattern, p.cmdline):
            return kind
    return "ray_other" if re.search(RAY_LIKE, p.cmdline) else None


def choose_victim(
    rng: random.Random, procs: Iterable[Proc], driver_pid: int, want: str, allowed: Sequence[str]
) -> tuple[str, Proc] | None:
    """A live process of the run of kind ``want``; if none is up, one of a kind in ``allowed`` that is
    (kinds drawn evenly, then a process of it). None when the run has no such process."""
    by_kind: dict[str, list[Proc]] = {}
    for p in procs:
        kind = kind_of(p, driver_pid)
        if kind is not None and p.ours and p.status != "zombie" and kind in allowed:
            by_kind.setdefault(kind, []).append(p)
    if not by_kind:
        return None
    kind = want if want in by_kind else rng.choice(sorted(by_kind))
    return kind, rng.choice(sorted(by_kind[kind], key=lambda p: p.pid))


def orphans(recorded: Iterable[Proc], live: Iterable[Proc]) -> list[Proc]:
    """Processes still running (not zombies) that belong to the run: those of ``recorded`` (the tree
    at kill time) alive with the same start time, and any live process of the run's own."""
    live = [p for p in live if p.status != "zombie"]
    keys = {p.key for p in recorded}
    return sorted((p for p in live if p.key in keys or p.ours), key=lambda p: p.pid)


def foreign_ray(before: Iterable[Proc], live: Iterable[Proc]) -> list[Proc]:
    """Ray processes started since ``before`` that are not the run's (other jobs on the machine)."""
    keys = {p.key for p in before}
    return [p for p in live if not p.ours and p.key not in keys and re.search(RAY_LIKE, p.cmdline)]


# The driver's exit status for each signal it receives itself: SIGKILL ends it at once, SIGINT and
# SIGTERM after the trainer's shutdown (algorithms/trainer.py: 130, 143).
DRIVER_EXIT: dict[str, int] = {"SIGKILL": -signal.SIGKILL, "SIGTERM": 143, "SIGINT": 130}
NOT_TRIED = "not tried"


def verdict(
    victim: str | None,
    sig: str,
    code: int | None,
    error: str,
    survived: bool,
    resumed: bool | None,
    not_tried: str = "",
    trained_on: int | None = None,
    replaced: int | None = None,
) -> str:
    """A trial's outcome (``ok...``, ``not tried: ...`` or why not), orphans aside; ``error`` is
    the driver's error line, ``survived``: the signalled process outlived ``--exit-bound`` and the
    soak stopped the run with a Ctrl-C (``code`` is that exit). ``trained_on``: for an engine's
    process signalled in a run of several engines (which must go on without a restart), the steps
    it trained after the signal before the soak's Ctrl-C ended it (``None``: not such a trial), and
    ``replaced``: the engines that replaced a lost one meanwhile (``summary.json``)."""
    if not_tried:
        return f"{NOT_TRIED}: {not_tried}"
    if code is None:
        return "no exit within the bound"
    if trained_on is not None:
        if trained_on < TRAIN_ON_STEPS or code != 130:
            return f"the run did not train on after losing an engine ({trained_on} steps after the signal, exit {code})"
        if not replaced:
            return f"trained on {trained_on} steps after the signal, but no replacement joined within the bound"
        return (
            f"ok (trained on {trained_on} steps after the signal and a replacement joined, no restart; "
            "the soak's Ctrl-C ended it)"
        )
    if resumed is False:
        return "resume failed"
    if victim == "driver":
        want = DRIVER_EXIT[sig]
        return "ok" if code == want else f"driver exit {code} (expected {want})"
    if survived:
        if code == 130:
            return "ok (the process survived the signal; the soak's Ctrl-C ended the run)"
        return f"the process survived the signal, and the soak's Ctrl-C ended the run with exit {code}, not 130"
    if code == 1:
        return "ok" if victim is not None and re.search(NAMES[victim], error) else "error does not name the component"
    return f"exit {code}"


# ------------------------------------------------------------------ the impure side


def snapshot(sid: int | None, tag: str | None) -> list[Proc]:
    """Every process on the machine that is Ray's or the run's (``sid``/``tag``)."""
    import psutil

    out = []
    for p in psutil.process_iter(["pid", "ppid", "create_time", "status", "cmdline"]):
        try:
            cmd = " ".join(p.info["cmdline"] or []).strip()
            ours = False
            if sid is not None:
                try:
                    ours = os.getsid(p.pid) == sid
                except OSError:
                    pass
                if not ours and tag and ("python" in cmd or re.search(RAY_LIKE, cmd)):
                    ours = p.environ().get(TAG_ENV) == tag
            if ours or re.search(RAY_LIKE, cmd):
                out.append(Proc(p.pid, p.info["ppid"], p.info["create_time"], p.info["status"], cmd, ours))
        except (psutil.Error, OSError):
            continue
    return out


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)  # as under a terminal, whatever our parent ignored


def _still_alive(p: Proc) -> bool:
    """Whether the process ``p`` (same pid and start time) still runs (a zombie has exited)."""
    import psutil

    try:
        q = psutil.Process(p.pid)
        return round(q.create_time(), 2) == p.key[1] and q.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _stop(proc: subprocess.Popen[Any], sid: int, bound: float) -> int | None:
    """End a running trial's run with a Ctrl-C to its driver (its own exit), SIGKILLing its session
    when it does not end within ``bound``; the driver's exit status (None: it had to be killed)."""
    if proc.poll() is None:
        try:
            os.kill(proc.pid, signal.SIGINT)
            proc.wait(timeout=bound)
        except subprocess.TimeoutExpired:
            os.killpg(sid, signal.SIGKILL)
            proc.wait()
            return None
        except ProcessLookupError:
            proc.wait()
    return proc.returncode


def _metric_lines(out: Path) -> int:
    try:
        return sum(1 for ln in (out / "metrics.jsonl").read_text().splitlines() if ln.strip())
    except OSError:
        return 0


def _error_line(stderr: str) -> str:
    lines = [ln for ln in stderr.splitlines() if ln.strip()]
    errs = [ln for ln in lines if re.search(r"^grpo_\w+: error: ", ln)]
    ray_errs = [ln for ln in lines if re.search(r"\b(dead|died|lost)\b", ln)]  # Ray's own, the driver's error unsaid
    return (errs or ray_errs[:1] or lines or [""])[-1][:400]


@dataclass
class Trial:
    """One trial's record (the JSON row)."""

    index: int
    plan: dict[str, Any]
    victim_kind: str | None = None
    victim_pid: int | None = None
    victim_cmdline: str = ""
    signal: str = ""
    moment_s: float | None = None  # after the launch
    moment_step: int | None = None  # metrics lines at the kill
    not_tried: str = ""  # why the signal did not land (the run ended first, the victim was gone)
    survived: bool = False  # the victim outlived --exit-bound; the soak stopped the run with a Ctrl-C
    exit_code: int | None = None
    error_line: str = ""
    seconds_to_exit: float | None = None  # from the signal
    tree_at_kill: list[dict[str, Any]] = field(default_factory=list)
    seconds_to_clean: float | None = None  # from the driver's exit until no process of the run is left
    orphans: list[dict[str, Any]] = field(default_factory=list)
    foreign_ray: int = 0
    resume_from: int | None = None
    resumed_ok: bool | None = None
    trained_on: int | None = None  # an engine's process in a run of several: steps trained after the signal
    engines_lost: int | None = None  # summary.json's generators_lost_total, for such a trial
    engines_replaced: int | None = None
    verdict: str = ""
    wall_s: float = 0.0


def run_trial(
    index: int,
    plan: TrialPlan,
    rng: random.Random,
    out: Path,
    cmd: list[str],
    env: dict[str, str],
    allowed: Sequence[str],
    args: Any,
) -> Trial:
    """Launch, signal, wait, look for orphans (and SIGKILL them), optionally resume."""
    trial = Trial(index, asdict(plan))
    t0 = time.time()
    tag = f"soak-{os.getpid()}-{index}-{uuid.uuid4().hex[:8]}"
    before = snapshot(None, None)
    with open(out / "stdout.log", "w") as so, open(out / "stderr.log", "w") as se:
        proc = subprocess.Popen(
            cmd,
            cwd=Path(__file__).resolve().parents[1],
            env={**env, TAG_ENV: tag},
            stdout=so,
            stderr=se,
            start_new_session=True,
            preexec_fn=_default_sigint,
        )
    sid = proc.pid  # start_new_session: the driver leads its own session
    # ---- the moment
    start = time.time()
    # training: from the first metrics line; start-up: from when the drawn kind's process is up
    # (the driver's: its raylet), or training began, whichever comes first
    anchor = KINDS["raylet"] if plan.kind == "driver" else KINDS.get(plan.kind, "$^")
    while proc.poll() is None and time.time() - start < args.startup_timeout and _metric_lines(out) < 1:
        if plan.phase == "startup" and any(p.ours and re.search(anchor, p.cmdline) for p in snapshot(sid, tag)):
            break
        time.sleep(0.5)
    wake = time.time() + plan.delay_s
    while proc.poll() is None and time.time() < wake:
        time.sleep(0.05)
    recorded: list[Proc] = []
    t_kill = None
    victim: Proc | None = None
    if proc.poll() is None:
        recorded = [p for p in snapshot(sid, tag) if p.ours]
        trial.tree_at_kill = [
            {"pid": p.pid, "kind": kind_of(p, proc.pid), "cmdline": p.cmdline[:200]} for p in recorded
        ]
        pick = choose_victim(rng, recorded, proc.pid, plan.kind, allowed)
        if pick is None:
            trial.not_tried = "no process of an allowed kind was up"
        else:
            kind, victim = pick
            trial.moment_step = _metric_lines(out)
            trial.victim_kind, trial.victim_pid, trial.victim_cmdline = kind, victim.pid, victim.cmdline[:200]
            trial.signal = plan.signal
            try:
                os.kill(victim.pid, SIGNALS[plan.signal])
                t_kill = time.time()
                trial.moment_s = round(t_kill - t0, 2)
            except ProcessLookupError:
                trial.not_tried = f"the {kind} (pid {victim.pid}) was gone at the signal"
    else:
        trial.not_tried = f"the run ended before its moment (exit {proc.returncode}), after {_metric_lines(out)} steps"
    # ---- the exit
    survivable = getattr(args, "engines", 1) > 1 and trial.victim_kind in ENGINE_KINDS
    if t_kill is None:  # not tried: end the run the way a user would, then clean up as for any trial
        trial.exit_code = _stop(proc, sid, args.exit_bound)
    elif survivable:
        # It must train on: wait for steps after the signal, then end it the way a user would.
        from soak import _rows

        at = trial.moment_step or 0
        while proc.poll() is None and time.time() - t_kill < args.exit_bound:
            after = _rows(out / "metrics.jsonl")[at:]
            if len(after) >= TRAIN_ON_STEPS and any(r.get("generators_replaced", 0) for r in after):
                break
            time.sleep(0.5)
        trial.trained_on = _metric_lines(out) - at
        trial.exit_code = _stop(proc, sid, args.exit_bound) if proc.poll() is None else proc.returncode
        try:
            summary = json.loads((out / "summary.json").read_text())
            trial.engines_lost = summary.get("generators_lost_total")
            trial.engines_replaced = summary.get("generators_replaced_total")
        except (OSError, ValueError):
            pass
    else:
        try:
            proc.wait(timeout=args.exit_bound)
            trial.exit_code = proc.returncode
        except subprocess.TimeoutExpired:
            if victim is not None and trial.victim_kind != "driver" and _still_alive(victim):
                trial.survived = True  # e.g. the raylet ignores SIGINT: the run goes on, as it should
                trial.exit_code = _stop(proc, sid, args.exit_bound)
            else:
                trial.exit_code = None
                os.killpg(sid, signal.SIGKILL)
                proc.wait()
    t_exit = time.time()
    if t_kill is not None:
        trial.seconds_to_exit = round(t_exit - t_kill, 2)
    stderr = (out / "stderr.log").read_text(errors="replace")
    trial.error_line = _error_line(stderr)
    # ---- orphans: the run's processes must go within the grace
    left = orphans(recorded, snapshot(sid, tag))
    while left and time.time() - t_exit < args.grace:
        time.sleep(0.5)
        left = orphans(recorded, snapshot(sid, tag))
    trial.foreign_ray = len(foreign_ray(before, snapshot(sid, tag)))
    if not left:
        trial.seconds_to_clean = round(time.time() - t_exit, 2)
    else:  # orphans: recorded, watched until --linger (do they leave by themselves?), then SIGKILLed
        trial.orphans = [
            {"pid": p.pid, "kind": kind_of(p, proc.pid), "cmdline": p.cmdline[:300], "ppid": p.ppid} for p in left
        ]
        gone: dict[tuple[int, float], float] = {}
        while len(gone) < len(left) and time.time() - t_exit < args.linger:
            time.sleep(0.5)
            still = {p.key for p in orphans(left, snapshot(sid, tag))}
            gone.update(
                {p.key: round(time.time() - t_exit, 1) for p in left if p.key not in still and p.key not in gone}
            )
        for o, p in zip(trial.orphans, left):
            o["left_by_itself_after_s"] = gone.get(p.key)
            if p.key not in gone:  # clean up after recording, so the next trial starts clean
                try:
                    os.kill(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
    # ---- resume
    if args.resume and trial.exit_code not in (0, None) and t_kill is not None and not survivable:
        from soak import _latest_step, _rows, _segment

        latest = _latest_step(out)
        if (out / "checkpoints").exists() and any((out / "checkpoints").glob("step_*/COMPLETE")):
            trial.resume_from = latest
            res = _segment(out, latest + 2, args.ckpt_every, (), True, args.segment_timeout, module=args.trainer)
            rows = _rows(out / "metrics.jsonl")
            trial.resumed_ok = res["code"] == 0 and any(r["step"] >= latest for r in rows)
            if not trial.resumed_ok:
                trial.error_line += f" | resume: exit {res['code']}: {_error_line(res['stderr'])}"
    trial.verdict = verdict(
        trial.victim_kind,
        trial.signal,
        trial.exit_code,
        trial.error_line,
        trial.survived,
        trial.resumed_ok,
        trial.not_tried,
        trial.trained_on if survivable and t_kill is not None else None,
        trial.engines_replaced,
    )
    if trial.orphans:
        fates = [
            f"{o['kind']} left after {o['left_by_itself_after_s']} s"
            if o["left_by_itself_after_s"] is not None
            else f"{o['kind']} killed by the soak"
            for o in trial.orphans
        ]
        trial.verdict += f"; {len(fates)} orphan(s) past --grace: {', '.join(fates)}"
    trial.wall_s = round(time.time() - t0, 1)
    return trial


def summarize(trials: Sequence[Trial]) -> dict[str, Any]:
    """Totals over the trials."""
    per: dict[str, dict[str, int]] = {}
    for t in trials:
        k = per.setdefault(NOT_TRIED if t.not_tried else str(t.victim_kind), {"trials": 0, "ok": 0, "orphans": 0})
        k["trials"] += 1
        k["ok"] += t.verdict.startswith("ok") and not t.orphans
        k["orphans"] += len(t.orphans)
    return {
        "trials": len(trials),
        "ok": sum(t.verdict.startswith("ok") and not t.orphans for t in trials),
        "signalled": sum(not t.not_tried for t in trials),
        "not_tried": sum(bool(t.not_tried) for t in trials),
        "survived_the_signal": sum(t.survived for t in trials),
        "orphan_processes": sum(len(t.orphans) for t in trials),
        "orphans_killed_by_soak": sum(o["left_by_itself_after_s"] is None for t in trials for o in t.orphans),
        "trials_with_orphans": sum(bool(t.orphans) for t in trials),
        "resumed_ok": sum(t.resumed_ok is True for t in trials),
        "resume_failed": sum(t.resumed_ok is False for t in trials),
        "max_seconds_to_exit": max((t.seconds_to_exit for t in trials if t.seconds_to_exit is not None), default=None),
        "per_victim": per,
    }


def soak_exit(totals: dict[str, Any]) -> int:
    """The soak's exit status from :func:`summarize`'s totals: 0 when there were trials and every
    one landed its signal and was ok (no orphan); a trial not tried fails the soak too."""
    return 0 if totals["trials"] and totals["ok"] == totals["trials"] and not totals["not_tried"] else 1


def _row(t: Trial) -> str:
    moment = f"{t.moment_s}s/step {t.moment_step}" if t.moment_s is not None else "-"
    return (
        f"{t.index:3d} {t.plan['phase']:8s} {t.victim_kind or '-':16s} {t.signal or '-':7s} {moment:18s} "
        f"{t.exit_code!s:>5s} {t.seconds_to_exit!s:>7s} {len(t.orphans):3d} {t.resumed_ok!s:>6s}  {t.verdict}"
        f"\n      {t.error_line[:160]}"
    )


def main(args: Any) -> int:
    """The ``--outside-kills`` mode of benchmarks/soak.py."""
    import json
    import shutil

    from soak import BASE, CONFIG, CONFIG_SYNC, trainer_env

    weights = {s: float(w) for s, w in (x.split("=") for x in args.signal_weights)}
    plans = plan_trials(
        args.seed,
        args.outside_kills,
        args.victims,
        weights,
        args.startup_frac,
        args.startup_window,
        args.kill_window,
    )
    rng = random.Random(args.seed + 1)
    root = Path(args.dir)
    if root.exists():
        shutil.rmtree(root)
    deadline = time.time() + args.minutes * 60 if args.minutes else float("inf")
    trials: list[Trial] = []
    t_start = time.time()
    header = (
        f"{'#':>3s} {'phase':8s} {'victim':16s} {'signal':7s} {'moment':18s} {'exit':>5s} {'to exit':>7s} "
        f"{'orp':>3s} {'resume':>6s}  verdict"
    )
    print(header, flush=True)
    report: dict[str, Any] = {}
    for i, plan in enumerate(plans):
        if time.time() >= deadline:
            print(f"--minutes {args.minutes} reached: {len(trials)} of {len(plans)} trials run", flush=True)
            break
        out = root / f"trial_{i:03d}"
        out.mkdir(parents=True)
        base = [o for o in BASE if args.trainer == "grpo_async" or not o.startswith("async.")]
        cmd = [
            sys.executable,
            "-m",
            f"algorithms.{args.trainer}",
            "--config",
            str(CONFIG if args.trainer == "grpo_async" else CONFIG_SYNC),
            *base,
            f"trainer.steps={args.trial_steps}",
            f"checkpoint.every={args.ckpt_every}",
            f"logging.output_dir={out}",
            "logging.overwrite=true",
        ]
        if args.engines > 1:
            key = "async.num_collectors" if args.trainer == "grpo_async" else "generation.num_engines"
            cmd.append(f"{key}={args.engines}")
        trial = run_trial(i, plan, rng, out, cmd, trainer_env(), args.victims, args)
        trials.append(trial)
        print(_row(trial), flush=True)
        report = {"args": vars(args), "wall_s": round(time.time() - t_start, 1), **summarize(trials)}
        report["trials_detail"] = [asdict(t) for t in trials]
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=2))
    s = summarize(trials)
    print(
        f"\noutside kills: {s['trials']} trials, {s['signalled']} signalled ({s['not_tried']} not tried), "
        f"{s['ok']} ok, {s['survived_the_signal']} survived their signal, "
        f"{s['orphan_processes']} orphan processes in {s['trials_with_orphans']} trials "
        f"({s['orphans_killed_by_soak']} never left by themselves), "
        f"resumed ok {s['resumed_ok']} (failed {s['resume_failed']}), max s to exit {s['max_seconds_to_exit']}"
    )
    for kind, k in sorted(s["per_victim"].items()):
        print(f"  {kind:20s} trials {k['trials']:3d} ok {k['ok']:3d} orphans {k['orphans']:3d}")
    print(f"wrote {args.out}")
    return soak_exit(s)
