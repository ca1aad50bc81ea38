"""Waits that must end within their bound (issue 14, item 7), each in fresh processes.

* ``WorkerFetcher`` leader broadcast: a leader that never sends, or dies, ends a non-leader's
  fetch within ``timeout_s`` (gloo raises from ``wait`` instead of returning ``False``; NCCL's
  ``wait`` does not block the host, so the bound is enforced by polling).
* A call that blocks forever (an NCCL communicator init whose peer never comes) run through
  ``call_with_deadline`` times out and leaves nothing that blocks interpreter exit.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

SCRIPT = Path(__file__).with_name("_wait_procs.py")
REPO = Path(__file__).resolve().parents[2]


def _run(
    scenario: str, world: int, tmp_path: Path, *, env: dict[str, str] | None = None, limit: float = 60.0
) -> tuple[list[dict], float]:
    init = tmp_path / "init"
    e = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", **(env or {})}
    t0 = time.monotonic()
    procs = [
        subprocess.Popen(
            [sys.executable, str(SCRIPT), scenario, str(r), str(world), str(init)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=e,
        )
        for r in range(world)
    ]
    outs: list[dict] = []
    try:
        # Followers first: a silent leader sleeps until it is killed below.
        for p in procs[1:] + procs[:1]:
            try:
                stdout, stderr = p.communicate(timeout=limit if p is not procs[0] or world == 1 else 5)
            except subprocess.TimeoutExpired:
                p.kill()
                stdout, stderr = p.communicate()
            lines = [ln for ln in stdout.splitlines() if ln.startswith("{")]
            outs.append(json.loads(lines[-1]) if lines else {"stderr": stderr[-2000:]})
        outs = outs[-1:] + outs[:-1]  # back in rank order
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return outs, time.monotonic() - t0


def test_fetch_from_a_silent_leader_times_out_within_its_bound_gloo(tmp_path: Path) -> None:
    outs, _ = _run("silent_leader", 2, tmp_path, env={"FETCH_TIMEOUT_S": "2"})
    got = outs[1]
    assert got.get("error") == "TimeoutError", outs
    assert "rank 1: broadcast from replica leader rank 0 did not finish within 2s" in got["message"]
    assert 1.5 <= got["elapsed"] < 6.0, got  # bound 2 s (+ process noise), not the group's 120 s


def test_fetch_from_a_dead_leader_fails_naming_it_gloo(tmp_path: Path) -> None:
    outs, _ = _run("dead_leader", 2, tmp_path, env={"FETCH_TIMEOUT_S": "5"})
    got = outs[1]
    assert got.get("error") in ("RuntimeError", "TimeoutError"), got
    assert "replica leader rank 0" in got["message"]
    assert got["elapsed"] < 8.0, got


def test_a_call_that_never_returns_times_out_and_does_not_block_exit(tmp_path: Path) -> None:
    outs, wall = _run("deadline_thread", 1, tmp_path, limit=30)
    assert outs[0]["error"] == "TimeoutError" and "blocked-init" in outs[0]["message"], outs
    assert outs[0]["elapsed"] < 2.0
    assert wall < 20.0  # the interpreter exited although the blocked thread still runs


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices (NCCL)")
def test_fetch_from_a_silent_leader_times_out_within_its_bound_nccl(tmp_path: Path) -> None:
    outs, _ = _run("silent_leader_nccl", 2, tmp_path, env={"FETCH_TIMEOUT_S": "3"})
    got = outs[1]
    assert got.get("error") == "TimeoutError", got
    assert "replica leader rank 0" in got["message"] and got["elapsed"] < 8.0, got


class _NcclLikeWork:
    """Stands in for an NCCL work handle, which cannot run on this CPU machine: ``wait()``
    returns at once (it only orders the stream), ``is_completed()`` reports the device. The
    2-GPU test above runs the real one."""

    def __init__(self, done_after_s: float | None) -> None:
        self._done_at = None if done_after_s is None else time.monotonic() + done_after_s

    def wait(self, timeout: Any = None) -> bool:
        return True

    def is_completed(self) -> bool:
        return self._done_at is not None and time.monotonic() >= self._done_at


def test_an_nccl_style_wait_is_bounded_on_the_host_and_returns_once_the_device_is_done() -> None:
    from nemo_dataplane.worker.fetch import wait_work

    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match=r"leader broadcast did not finish within 0.5s \(device collective"):
        wait_work(_NcclLikeWork(None), 0.5, "leader broadcast", on_device=True)
    assert 0.5 <= time.monotonic() - t0 < 1.5
    t0 = time.monotonic()
    wait_work(_NcclLikeWork(0.2), 5.0, "leader broadcast", on_device=True)
    assert 0.2 <= time.monotonic() - t0 < 1.5
    # Without on_device the host trusts wait(): NCCL would return before the device finished.
    t0 = time.monotonic()
    wait_work(_NcclLikeWork(None), 5.0, "leader broadcast", on_device=False)
    assert time.monotonic() - t0 < 0.5
