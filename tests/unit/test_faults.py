"""algorithms.faults: the fault-injection hook fires exactly where the debug keys say."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

from algorithms.config import DebugConfig as D
from algorithms.faults import InjectedFailure, maybe_fail, raising_reward

REPO = Path(__file__).resolve().parents[2]


def test_fires_only_at_the_named_point_step_rank_and_group(tmp_path: Path) -> None:
    debug = D(fail_in="train", fail_at_step=2, fail_rank=1, fail_at_group=None)
    maybe_fail(D(), "train", step=2, rank=1)  # nothing asked
    maybe_fail(debug, "logprobs", step=2, rank=1)  # another point
    maybe_fail(debug, "train", step=1, rank=1)  # another step
    maybe_fail(debug, "train", step=2, rank=0)  # another rank
    marker = tmp_path / "t"
    with pytest.raises(InjectedFailure, match="debug.fail_in=train: injected failure on rank one"):
        maybe_fail(dataclasses.replace(debug, fault_marker=str(marker)), "train", step=2, rank=1, what="on rank one")
    assert float(marker.read_text()) > 0
    # a key the call site does not know (rank=None) does not block the match
    with pytest.raises(InjectedFailure):
        maybe_fail(D(fail_in="generate", fail_at_group=5, fail_rank=0), "generate", group=5)
    maybe_fail(D(fail_in="generate", fail_at_group=5), "generate", group=4)


def test_sigkill_mode_kills_the_process_without_cleanup() -> None:
    code = (
        "from algorithms.config import DebugConfig\nfrom algorithms.faults import maybe_fail\n"
        "maybe_fail(DebugConfig(fail_in='train', fail_mode='sigkill'), 'train', step=0, rank=0)\n"
        "print('survived')"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"},
    )
    assert proc.returncode == -9 and "survived" not in proc.stdout


def test_raising_reward_raises() -> None:
    with pytest.raises(ValueError, match="refusing to score a response of 3 chars"):
        raising_reward(None, "abc")


def test_hang_mode_goes_silent_then_raises_after_its_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    import time

    import algorithms.faults as faults

    monkeypatch.setattr(faults, "HANG_S", 0.3)  # the hook's own bound, shortened for the test
    t0 = time.monotonic()
    with pytest.raises(InjectedFailure, match="debug.fail_in=refit"):
        maybe_fail(D(fail_in="refit", fail_at_step=4, fail_mode="hang"), "refit", step=4)
    assert time.monotonic() - t0 >= 0.3
    maybe_fail(D(fail_in="refit", fail_at_step=4, fail_mode="hang"), "refit", step=3)  # not this refit


def test_store_kill_points_need_the_transfer_queue_data_plane() -> None:
    from algorithms.config import ConfigError, load_config

    cfg = REPO / "examples" / "configs" / "grpo_tiny.yaml"
    with pytest.raises(ConfigError, match="debug.fail_in=store_unit needs data_plane.enabled"):
        load_config(str(cfg), ["debug.fail_in=store_unit", "debug.fail_at_step=1", "data_plane.enabled=false"])
    assert (
        load_config(str(cfg), ["debug.fail_in=store_controller", "debug.fail_at_step=1"]).debug.fail_in
        == "store_controller"
    )
