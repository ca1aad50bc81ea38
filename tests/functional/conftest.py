"""Helpers for trainer runs: each run is its own subprocess (it owns its Ray cluster).

``run_trainer(out_dir, *overrides)`` runs ``python -m algorithms.grpo_sync`` with the tiny test
config below plus ``overrides`` and returns a :class:`TrainerRun` (exit code, output, metrics
rows, summary). Runs are bounded by a timeout and leave no Ray processes behind (the trainer
stops the cluster it started; the test checks it via the summary's exit path).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "examples" / "configs" / "grpo_tiny.yaml"

# Plumbing settings shared by every test run: the default learning config (2 policy ranks,
# 32 prompts x 16 samples, 2 micro-batches per rank, TransferQueue, refit over gloo), fewer steps.
TINY: tuple[str, ...] = (
    "trainer.steps=16",
    "trainer.val_every=8",
    "trainer.step_timeout_s=120",
    "trainer.startup_timeout_s=240",
    # The store comes up while the workers start, next to other runs on 2 cores: room beyond 60 s.
    "data_plane.transfer_queue.bootstrap_timeout_s=180",
    "task.val_size=16",
    "checkpoint.every=0",
    "logging.progress=false",
    "logging.plot=false",
)

# A smaller batch for runs that check the plumbing only (failure, Ctrl-C).
SMALL: tuple[str, ...] = (
    "grpo.prompts_per_step=4",
    "generation.n=4",
    "data_plane.packing.micro_batch_size=4",
)


@dataclass
class TrainerRun:
    returncode: int
    stdout: str
    stderr: str
    out_dir: Path

    @property
    def rows(self) -> list[dict[str, Any]]:
        path = self.out_dir / "metrics.jsonl"
        if not path.exists():
            return []
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]

    @property
    def summary(self) -> dict[str, Any]:
        return json.loads((self.out_dir / "summary.json").read_text())

    def explain(self) -> str:
        return f"exit {self.returncode}\n--- stdout\n{self.stdout[-3000:]}\n--- stderr\n{self.stderr[-6000:]}"


ASYNC_CONFIG = REPO / "examples" / "configs" / "grpo_async_tiny.yaml"


def _command(
    out_dir: Path, overrides: tuple[str, ...], extra_env: dict[str, str] | None = None, module: str = "grpo_sync"
) -> tuple[list[str], dict[str, str]]:
    env = dict(os.environ)
    path = os.pathsep.join([str(REPO), *([extra_env["PYTHONPATH"]] if extra_env and "PYTHONPATH" in extra_env else [])])
    env.update(extra_env or {})
    env.update(OMP_NUM_THREADS="1", RAY_DEDUP_LOGS="0", RAY_USAGE_STATS_ENABLED="0", PYTHONPATH=path)
    env.pop("RAY_ADDRESS", None)  # a run starts its own cluster, never the test session's
    config = ASYNC_CONFIG if module == "grpo_async" else CONFIG
    cmd = [
        sys.executable,
        "-m",
        f"algorithms.{module}",
        "--config",
        str(config),
        *TINY,
        f"logging.output_dir={out_dir}",
        *overrides,
    ]
    return cmd, env


def _run(
    out_dir: Path,
    overrides: tuple[str, ...],
    timeout: float = 420,
    env: dict[str, str] | None = None,
    module: str = "grpo_sync",
) -> TrainerRun:
    cmd, env = _command(out_dir, overrides, env, module)
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    return TrainerRun(proc.returncode, proc.stdout, proc.stderr, out_dir)


def _run_many(jobs: list[tuple[Path, tuple[str, ...], str]], timeout: float) -> list[TrainerRun]:
    # Runs whose results do not depend on timing (seeded, one thread per worker) share the machine:
    # their start-ups (Ray, the store, importing torch in each worker) overlap.
    procs = []
    for out_dir, overrides, module in jobs:
        out_dir.mkdir(parents=True, exist_ok=True)
        cmd, env = _command(out_dir, overrides, module=module)
        so, se = (out_dir / "stdout.txt").open("w"), (out_dir / "stderr.txt").open("w")
        procs.append((subprocess.Popen(cmd, cwd=REPO, env=env, stdout=so, stderr=se), so, se, out_dir))
    runs = []
    try:
        for proc, so, se, out_dir in procs:
            proc.wait(timeout=timeout)
            so.close()
            se.close()
            runs.append(
                TrainerRun(
                    proc.returncode, (out_dir / "stdout.txt").read_text(), (out_dir / "stderr.txt").read_text(), out_dir
                )
            )
    finally:
        for proc, *_ in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return runs


def default_sigint() -> None:
    """``preexec_fn``: the child starts with SIGINT's default disposition, as under a terminal.

    A test session launched as a background job of a non-interactive shell (``cmd &``) has
    SIGINT ignored, children inherit that, and Python then installs no KeyboardInterrupt
    handler: a Ctrl-C test would see the trainer ignore SIGINT, as the shell asked.
    """
    import signal

    signal.signal(signal.SIGINT, signal.SIG_DFL)


def signal_after_steps(
    cmd: list[str], env: dict[str, str], out_dir: Path, steps: int, sig: int, timeout: float = 300
) -> tuple[int, str, str]:
    """Start a trainer in its own process group, send ``sig`` to the whole group (what a
    terminal's Ctrl-C does, or a SIGKILL of everything) once ``metrics.jsonl`` has ``steps``
    lines, wait for the exit (bounded) and return ``(returncode, stdout, stderr)``.

    Raises:
        AssertionError: the run ended before it could be signalled (its stderr is quoted).
    """
    import os
    import signal
    import time

    proc = subprocess.Popen(
        cmd,
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        preexec_fn=default_sigint,
    )
    metrics = out_dir / "metrics.jsonl"
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline and proc.poll() is None:
            if metrics.exists() and len(metrics.read_text().splitlines()) >= steps:
                break
            time.sleep(0.05)
        assert proc.poll() is None, proc.communicate()[1][-4000:]
        os.killpg(proc.pid, sig)
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return proc.returncode, stdout, stderr


@pytest.fixture(scope="session")
def signal_trainer():
    """:func:`signal_after_steps`."""
    return signal_after_steps


@pytest.fixture(scope="session")
def run_trainers_concurrently():
    """``run_trainers_concurrently([(out_dir, overrides[, module]), ...]) -> [TrainerRun, ...]``
    (``module``: ``grpo_sync`` (default) or ``grpo_async``, which runs grpo_async_tiny.yaml)."""

    def run(jobs: list[tuple[Any, ...]], timeout: float = 600) -> list[TrainerRun]:
        return _run_many([(Path(j[0]), tuple(j[1]), j[2] if len(j) > 2 else "grpo_sync") for j in jobs], timeout)

    return run


@pytest.fixture(scope="session")
def run_trainer():
    """``run_trainer(out_dir, *overrides) -> TrainerRun``."""

    def run(
        out_dir: Path,
        *overrides: str,
        small: bool = False,
        timeout: float = 420,
        env: dict[str, str] | None = None,
        module: str = "grpo_sync",
    ) -> TrainerRun:
        return _run(Path(out_dir), (*(SMALL if small else ()), *overrides), timeout, env, module)

    return run


@pytest.fixture(scope="session")
def trainer_command():
    """``trainer_command(out_dir, *overrides) -> (argv, env)`` for runs a test drives itself."""

    def command(
        out_dir: Path, *overrides: str, small: bool = False, module: str = "grpo_sync"
    ) -> tuple[list[str], dict[str, str]]:
        return _command(Path(out_dir), (*(SMALL if small else ()), *overrides), module=module)

    return command


@pytest.fixture(scope="session")
def small_overrides() -> tuple[str, ...]:
    """:data:`SMALL`, for tests that build their own job lists."""
    return SMALL


# --------------------------------------------------------------------------- resume comparisons
LOSS_KEYS: tuple[str, ...] = ("loss", "pg_loss", "kl", "reward", "grad_norm")


def rows_by_step(run: TrainerRun, keys: tuple[str, ...] = LOSS_KEYS) -> dict[int, tuple[Any, ...]]:
    """``{step: (row[key] for key in keys)}`` of a run's metrics (exact floats: a bitwise comparison)."""
    return {int(r["step"]): tuple(r.get(k) for k in keys) for r in run.rows}


def trained_groups(run: TrainerRun) -> dict[int, dict[str, Any]]:
    """``{step: {"handouts", "groups", "versions"}}`` from an async run's ``trained_groups.jsonl``."""
    path = run.out_dir / "trained_groups.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
    return {int(r["step"]): {k: r[k] for k in ("handouts", "groups", "versions")} for r in rows}


def assert_resumed_like_uninterrupted(
    resumed: TrainerRun, reference: TrainerRun, steps: range, keys: tuple[str, ...] = LOSS_KEYS
) -> None:
    """The resumed run's rows at ``steps`` equal the uninterrupted run's, bitwise, key by key."""
    got, ref = rows_by_step(resumed, keys), rows_by_step(reference, keys)
    missing = [s for s in steps if s not in got or s not in ref]
    assert not missing, f"steps {missing} missing (resumed has {sorted(got)}, reference {sorted(ref)})"
    for s in steps:
        assert got[s] == ref[s], (
            f"step {s}: resumed {dict(zip(keys, got[s]))} != uninterrupted {dict(zip(keys, ref[s]))}"
        )


@pytest.fixture(scope="session")
def resume_checks():
    """The comparison helpers above, for modules that cannot import this conftest."""
    import types

    return types.SimpleNamespace(
        rows_by_step=rows_by_step,
        trained_groups=trained_groups,
        loss_keys=LOSS_KEYS,
        assert_resumed_like_uninterrupted=assert_resumed_like_uninterrupted,
    )


def _sigkill_after(runs: list[tuple[Path, list[str], dict[str, str], int]], timeout: float = 600) -> None:
    """Start every ``(out_dir, argv, env, steps)`` run at once (their start-ups overlap), each in
    its own process group, and SIGKILL the whole group (no clean-up at all) once its
    ``metrics.jsonl`` has ``steps`` lines."""
    procs = []
    for out, cmd, env, steps in runs:
        out.mkdir(parents=True, exist_ok=True)
        with (out / "killed_stdout.txt").open("w") as so, (out / "killed_stderr.txt").open("w") as se:
            procs.append(
                (subprocess.Popen(cmd, cwd=REPO, env=env, stdout=so, stderr=se, start_new_session=True), out, steps)
            )
    deadline = time.monotonic() + timeout
    try:
        left = list(procs)
        while left and time.monotonic() < deadline:
            for proc, out, steps in list(left):
                assert proc.poll() is None, (
                    f"{out.name} ended before its kill: {(out / 'killed_stderr.txt').read_text()[-4000:]}"
                )
                metrics = out / "metrics.jsonl"
                if metrics.exists() and len(metrics.read_text().splitlines()) >= steps:
                    os.killpg(proc.pid, signal.SIGKILL)
                    left.remove((proc, out, steps))
            time.sleep(0.05)
        assert not left, f"{[out.name for _, out, _ in left]}: no {[s for *_, s in left]} steps within {timeout}s"
    finally:
        for proc, *_ in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.fixture(scope="session")
def sigkill_after():
    """``sigkill_after([(out_dir, argv, env, steps), ...])``: start the runs together and SIGKILL
    each one's whole process group once it logged ``steps`` steps."""
    return _sigkill_after
