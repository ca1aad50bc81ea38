"""Chaos tests (issue 14): injected faults end in a clear error naming the failed component,
within a stated bound, with no keys left in the store. CPU, tiny model.

Faults come from :mod:`algorithms.faults` (``debug.*`` keys) or a user-style reward function;
the hook writes the injection time to ``debug.fault_marker`` and the trainer writes
``summary.json`` on its way out, so time-to-error = summary mtime - marker time.

Bounds (asserted): the error arrives within ``FAULT_BOUND_S`` of the fault. A raising reward or
a dead worker is seen at the next ``gather``/collector poll, not at ``trainer.step_timeout_s``.
All runs start together (``run_trainers_concurrently``) to keep CI time to one trainer's worth.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

SMALL_ASYNC = ("grpo.prompts_per_step=4", "generation.n=4", "data_plane.packing.micro_batch_size=4",
               "async.groups_per_generation=2", "trainer.val_every=0", "trainer.steps=6")
SMALL_SYNC = ("grpo.prompts_per_step=4", "generation.n=4", "data_plane.packing.micro_batch_size=4",
              "trainer.val_every=0", "trainer.steps=6")
FAULT_BOUND_S = 30.0  # time from fault to the trainer's exit; the step timeout here is 120 s


@pytest.fixture(scope="module")
def runs_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("chaos_runs")


def _time_to_error(run) -> float:  # noqa: ANN001 - TrainerRun
    marker = run.out_dir / "fault_marker"
    return (run.out_dir / "summary.json").stat().st_mtime - float(marker.read_text())


@pytest.fixture(scope="module")
def chaos_runs(run_trainers_concurrently, runs_dir: Path) -> dict:
    jobs = {
        "async_reward": (SMALL_ASYNC + ("task.reward_fn=algorithms.faults:raising_reward",), "grpo_async"),
        "sync_reward": (SMALL_SYNC + ("task.reward_fn=algorithms.faults:raising_reward",), "grpo_sync"),
        "async_kill_rank": (SMALL_ASYNC + ("debug.fail_in=train", "debug.fail_at_step=2", "debug.fail_rank=1",
                                           "debug.fail_mode=sigkill"), "grpo_async"),
        "async_kill_collector": (SMALL_ASYNC + ("debug.fail_in=generate", "debug.fail_at_group=6",
                                                "debug.fail_mode=sigkill"), "grpo_async"),
    }
    specs = []
    for name, (overrides, module) in jobs.items():
        out = runs_dir / f"chaos_{name}"
        specs.append((out, (*overrides, f"debug.fault_marker={out / 'fault_marker'}"), module))
    runs = run_trainers_concurrently(specs, timeout=600)
    return dict(zip(jobs, runs))


@pytest.mark.parametrize("name", ["async_reward", "sync_reward"])
def test_a_raising_reward_fn_is_named_with_its_prompt_and_the_store_is_empty(chaos_runs: dict, name: str) -> None:
    run = chaos_runs[name]
    assert run.returncode == 1, run.explain()
    assert "reward_fn 'algorithms.faults:raising_reward' raised ValueError on prompt uid" in run.stderr, run.explain()
    assert "refusing to score" in run.stderr
    assert run.summary["keys_outstanding_at_exit"] == 0


def test_sigkill_of_a_policy_rank_mid_train_names_the_rank_within_the_bound(chaos_runs: dict) -> None:
    run = chaos_runs["async_kill_rank"]
    assert run.returncode == 1, run.explain()
    assert "step 2 train: policy rank 1 died or was lost" in run.stderr, run.explain()
    assert run.summary["keys_outstanding_at_exit"] == 0
    assert [r["step"] for r in run.rows] == [0, 1]
    assert _time_to_error(run) < FAULT_BOUND_S


def test_sigkill_of_a_collector_mid_generation_names_it_within_the_bound(chaos_runs: dict) -> None:
    run = chaos_runs["async_kill_collector"]
    assert run.returncode == 1, run.explain()
    assert "collector 0 died or was lost" in run.stderr, run.explain()
    assert run.summary["keys_outstanding_at_exit"] == 0
    assert _time_to_error(run) < FAULT_BOUND_S


def test_report_times(chaos_runs: dict, runs_dir: Path) -> None:
    """Writes the observed times for docs/reliability.md (not an assertion on speed)."""
    report = {n: {"returncode": r.returncode, "keys_at_exit": r.summary.get("keys_outstanding_at_exit"),
                  "time_to_error_s": round(_time_to_error(r), 2) if (r.out_dir / "fault_marker").exists() else None}
              for n, r in chaos_runs.items()}
    (runs_dir / "chaos_report.json").write_text(json.dumps(report, indent=2))
    print(json.dumps(report))
    assert all(v["returncode"] == 1 for v in report.values())
