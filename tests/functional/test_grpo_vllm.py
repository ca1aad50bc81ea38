"""``python -m algorithms.grpo_sync ... generation.backend=vllm`` end to end (the data plane on):
the toy task is learnt with vLLM generating, and the run leaves no process behind on a normal
exit, on a failing step and on Ctrl-C.

Only the CLI, ``summary.json`` and ``metrics.jsonl`` are used, so the checks hold whatever the
trainer's internals become. Every run gets a marker in its environment; Ray's and vLLM's
processes inherit it, so a process still carrying it after the run exited is an orphan.
Skipped when vLLM is not installed (``.ci/setup-env`` installs it).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (pip install -e '.[vllm]')")

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "examples" / "configs" / "grpo_tiny.yaml"
MARKER = "NDP_TEST_RUN_ID"
# The toy model with 2 heads of 32 (vLLM's CPU attention has no head size 16).
VLLM: tuple[str, ...] = (
    "generation.backend=vllm",
    "policy.model.hf_config.num_attention_heads=2",
    "policy.model.hf_config.num_key_value_heads=2",
    "checkpoint.every=0",
    "logging.progress=false",
    "logging.plot=false",
    "trainer.startup_timeout_s=300",
    "trainer.step_timeout_s=180",
)
SMALL: tuple[str, ...] = (
    "grpo.prompts_per_step=4",
    "generation.n=4",
    "data_plane.packing.micro_batch_size=4",
    "task.val_size=4",
)


@dataclass
class Run:
    proc: subprocess.Popen
    out: Path
    marker: str
    stdout: str = ""
    stderr: str = ""
    seen: int = 0  # processes carrying the marker while the run was going (the check can see them)

    @property
    def rows(self) -> list[dict[str, Any]]:
        path = self.out / "metrics.jsonl"
        return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []

    @property
    def summary(self) -> dict[str, Any]:
        return json.loads((self.out / "summary.json").read_text())

    def finish(self, timeout: float) -> Run:
        try:
            self.stdout, self.stderr = self.proc.communicate(timeout=timeout)
        finally:
            if self.proc.poll() is None:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        return self

    def explain(self) -> str:
        return f"exit {self.proc.returncode}\n--- stdout\n{self.stdout[-3000:]}\n--- stderr\n{self.stderr[-6000:]}"


def _default_sigint() -> None:
    # As under a terminal; a session run as a background job (`cmd &`) would pass SIGINT ignored.
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _start(out: Path, *overrides: str, module: str = "grpo_sync") -> Run:
    marker = uuid.uuid4().hex
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "RAY_DEDUP_LOGS": "0",
        "RAY_USAGE_STATS_ENABLED": "0",
        "PYTHONPATH": str(REPO),
        MARKER: marker,
    }
    env.pop("RAY_ADDRESS", None)
    config = CONFIG.with_name("grpo_async_tiny.yaml") if module == "grpo_async" else CONFIG
    cmd = [
        sys.executable,
        "-m",
        f"algorithms.{module}",
        "--config",
        str(config),
        *VLLM,
        f"logging.output_dir={out}",
        *overrides,
    ]
    proc = subprocess.Popen(
        cmd,
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group: Ctrl-C reaches the run only
        preexec_fn=_default_sigint,
    )
    return Run(proc, out, marker)


def _processes_with(marker: str) -> list[str]:
    needle = f"{MARKER}={marker}".encode()
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            if needle in Path(f"/proc/{pid}/environ").read_bytes():
                found.append(f"{pid} {Path(f'/proc/{pid}/cmdline').read_bytes()[:200]!r}")
        except OSError:  # gone meanwhile, or not ours to read
            continue
    return found


def _assert_no_orphans(run: Run, grace_s: float = 30.0) -> None:
    deadline = time.monotonic() + grace_s
    left = _processes_with(run.marker)
    while left and time.monotonic() < deadline:
        time.sleep(0.5)
        left = _processes_with(run.marker)
    if left:  # do not leave them to the next test either
        for line in left:
            try:
                os.kill(int(line.split()[0]), signal.SIGKILL)
            except OSError:
                pass
    assert left == [], f"processes outlived the run: {left}"


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Run]:
    """The three runs share the machine: start-ups overlap, results are seeded."""
    root = tmp_path_factory.mktemp("grpo_vllm")
    learn = _start(root / "learn", "trainer.steps=30", "trainer.val_every=10", "task.val_size=16")
    fail = _start(
        root / "fail",
        *SMALL,
        "trainer.steps=4",
        "trainer.val_every=0",
        "debug.fail_at_step=1",
        "debug.fail_in=train",
        "debug.fail_rank=1",
    )
    # The async trainer drives the same engine: it trains steps with vLLM rollouts, then gets Ctrl-C.
    # Its weights reach vLLM by the resharding refit (a TP>1 trainer's path; the learn run: packed).
    ctrl_c = _start(
        root / "ctrl_c", *SMALL, "trainer.steps=10000", "trainer.val_every=0", "refit.mode=reshard", module="grpo_async"
    )
    try:
        deadline = time.monotonic() + 500
        while time.monotonic() < deadline and ctrl_c.proc.poll() is None and len(ctrl_c.rows) < 2:
            time.sleep(0.2)
        ctrl_c.seen = len(_processes_with(ctrl_c.marker))
        if ctrl_c.proc.poll() is None:
            os.killpg(ctrl_c.proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does: the whole group
        ctrl_c.finish(180)
        fail.finish(500)
        learn.finish(900)
    finally:
        for r in (learn, fail, ctrl_c):
            if r.proc.poll() is None:
                os.killpg(r.proc.pid, signal.SIGKILL)
                r.proc.wait()
    return {"learn": learn, "fail": fail, "ctrl_c": ctrl_c}


def test_grpo_sync_with_vllm_learns_the_toy_task(runs: dict[str, Run]) -> None:
    run = runs["learn"]
    assert run.proc.returncode == 0, run.explain()
    summary = run.summary
    assert summary["status"] == "finished"
    assert summary["data_plane"] is True
    rows = run.rows
    assert [r["step"] for r in rows] == list(range(30))
    rewards = [r["reward"] for r in rows]
    first, last = sum(rewards[:3]) / 3, sum(rewards[-3:]) / 3
    assert first < 0.1, f"a random-init model is at chance: {rewards}"
    assert last >= 0.8, f"vLLM-generated rollouts taught the policy: {rewards}"
    if "weight_version" in rows[0]:
        assert [r["weight_version"] for r in rows] == list(range(30)), "each step sampled the refit weights"
    _assert_no_orphans(run)


def test_a_failing_step_stops_the_vllm_run_with_no_process_left(runs: dict[str, Run]) -> None:
    run = runs["fail"]
    assert run.proc.returncode == 1, run.explain()
    assert "injected failure at step 1 on policy rank 1" in run.stderr, run.explain()
    assert run.summary["status"] == "failed"
    _assert_no_orphans(run)


def test_ctrl_c_stops_the_async_vllm_run_with_no_process_left(runs: dict[str, Run]) -> None:
    run = runs["ctrl_c"]
    assert len(run.rows) >= 2, run.explain()
    assert run.proc.returncode == 130, run.explain()
    assert run.summary["status"].startswith("interrupted")
    assert all(r["staleness_max"] <= 1 and r["loss"] is not None for r in run.rows), (
        "async steps trained on vLLM rollouts"
    )
    assert run.summary["policy_layout"]["refit"] == "reshard"
    assert run.summary["keys_leaked_at_exit"] == 0 and run.summary["keys_outstanding_at_exit"] == 0
    # Driver, Ray's own processes and the worker actors (the generator holds the vLLM engine).
    assert run.seen >= 5, f"the marker reached only {run.seen} processes of the running trainer"
    _assert_no_orphans(run)
