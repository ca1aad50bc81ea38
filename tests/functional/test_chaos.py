"""Chaos tests (issue 14): every injected fault ends in a clear error naming the failed component,
within a stated bound, with no keys left in a store that survived; a restart with
``checkpoint.resume=latest`` after a fault reproduces the uninterrupted run. CPU, tiny model.

Faults come from :mod:`algorithms.faults` (``debug.*`` keys) or a user-style reward function;
the hook writes the injection time to ``debug.fault_marker`` and the trainer writes
``summary.json`` on its way out (after its bounded shutdown), so time-to-error =
summary mtime - marker time, shutdown included.

CI time: a trainer run costs ~25 s of start-up, a step of the SMALL config well under a second.
So each run carries one fault *after* the steps another test needs from it: the uninterrupted
reference runs end in a fault of their own past the compared steps, and so do the resumed runs.
Nine runs in three waves of three (``run_trainers_concurrently``):

====== ==================================================== =========================================
wave   run                                                  fault (and what else it serves)
====== ==================================================== =========================================
1      sync_kill_rank                                       SIGKILL policy rank 1 in train, step 2
1      sync_ref_refit                                       refit peer never arrives (version 5);
                                                            rows 0-3: the sync reference
1      async_kill_collector                                 SIGKILL collector mid-generation, step 2
2      sync_resume_kill_generator (from sync_kill_rank)     SIGKILL the generator mid-generate, step 4;
                                                            rows 2-3 vs the reference
2      async_ref_kill_controller                            TransferQueue controller killed, step 4;
                                                            rows 0-3: the async reference
2      async_resume_kill_unit (from async_kill_collector)   TransferQueue storage unit killed, step 4;
                                                            rows 2-3 vs the reference
3      async_store_full_kill_rank                           ``data_plane.max_rows`` below the in-flight
                                                            bound (collector backs off), then SIGKILL
                                                            policy rank 1 in train at step 3
3      sync_reward / async_reward                           the reward function raises
====== ==================================================== =========================================

Async runs use ``async.max_staleness=0``: every group is generated with the weights of the step
that trains it, and a resumed run regenerates its in-flight prompts under the same group ids
(same sampling seeds), so the resumed async losses are bitwise those of the uninterrupted run.
(With ``max_staleness >= 1`` which weight version draws a group depends on timing; only the data
order is comparable then: ``test_grpo_async.py``'s kill-and-resume test.) ``task.name=copy``: a
task the tiny random model gets partial credit on, so losses and gradients are not all zero.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

# Three waves one after the other inside the module fixture: ~3 min on an idle 2-core box, but a
# wave can take 5 min on a heavily loaded one, past the 600 s per-test default.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]

BASE = (
    "grpo.prompts_per_step=4",
    "generation.n=4",
    "data_plane.packing.micro_batch_size=4",
    "trainer.val_every=0",
    "task.name=copy",
)
SYNC = BASE
ASYNC = (*BASE, "async.groups_per_generation=2", "async.max_staleness=0")
FAULT_BOUND_S = 30.0  # fault -> trainer exit (shutdown included); trainer.step_timeout_s here is 120 s
REFIT_TIMEOUT_S = 15.0  # refit.timeout_s of the never-arriving-peer run
SIGKILL = "debug.fail_mode=sigkill"


@pytest.fixture(scope="module")
def runs_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("chaos_runs")


def _time_to_error(run) -> float:  # noqa: ANN001 - TrainerRun
    marker = run.out_dir / "fault_marker"
    return (run.out_dir / "summary.json").stat().st_mtime - float(marker.read_text())


def _wave(run_trainers_concurrently, runs_dir: Path, jobs: dict[str, tuple[tuple[str, ...], str]]) -> dict:
    specs = []
    for name, (overrides, module) in jobs.items():
        out = runs_dir / name
        specs.append((out, (*overrides, f"debug.fault_marker={out / 'fault_marker'}"), module))
    return dict(zip(jobs, run_trainers_concurrently(specs, timeout=600)))


@pytest.fixture(scope="module")
def chaos_runs(run_trainers_concurrently, runs_dir: Path) -> dict:
    runs = _wave(
        run_trainers_concurrently,
        runs_dir,
        {
            "sync_kill_rank": (
                (
                    *SYNC,
                    "trainer.steps=4",
                    "checkpoint.every=1",
                    "debug.fail_in=train",
                    "debug.fail_at_step=2",
                    "debug.fail_rank=1",
                    SIGKILL,
                ),
                "grpo_sync",
            ),
            "sync_ref_refit": (
                (
                    *SYNC,
                    "trainer.steps=6",
                    "debug.fail_in=refit",
                    "debug.fail_at_step=5",
                    "debug.fail_mode=hang",
                    f"refit.timeout_s={REFIT_TIMEOUT_S:g}",
                ),
                "grpo_sync",
            ),
            "async_kill_collector": (
                (
                    *ASYNC,
                    "trainer.steps=5",
                    "checkpoint.every=1",
                    "debug.fail_in=generate",
                    "debug.fail_at_group=8",
                    SIGKILL,
                ),
                "grpo_async",
            ),
        },
    )
    # trainer.steps grows past the faulted runs' (a resume may change it when allowed).
    resume = ("checkpoint.resume=latest", "checkpoint.every=0", "checkpoint.allow_config_change=true")
    runs |= _wave(
        run_trainers_concurrently,
        runs_dir,
        {
            "sync_resume_kill_generator": (
                (
                    *SYNC,
                    "trainer.steps=6",
                    *resume,
                    f"checkpoint.dir={runs_dir / 'sync_kill_rank' / 'checkpoints'}",
                    "debug.fail_in=generator",
                    "debug.fail_at_step=4",
                    SIGKILL,
                ),
                "grpo_sync",
            ),
            "async_ref_kill_controller": (
                (*ASYNC, "trainer.steps=6", "debug.fail_in=store_controller", "debug.fail_at_step=4"),
                "grpo_async",
            ),
            "async_resume_kill_unit": (
                (
                    *ASYNC,
                    "trainer.steps=6",
                    *resume,
                    f"checkpoint.dir={runs_dir / 'async_kill_collector' / 'checkpoints'}",
                    # A unit of its own (by default the controller holds it, and the controller
                    # kill above covers that process).
                    "data_plane.transfer_queue.unit_in_controller=false",
                    "debug.fail_in=store_unit",
                    "debug.fail_at_step=4",
                ),
                "grpo_async",
            ),
        },
    )
    runs |= _wave(
        run_trainers_concurrently,
        runs_dir,
        {
            # max_rows 20 = (G + groups_per_generation - 1) * n, the least async can progress with,
            # against an in-flight bound of (2 * G + G) * n = 48 keys.
            "async_store_full_kill_rank": (
                (
                    *BASE,
                    "async.groups_per_generation=2",
                    "data_plane.max_rows=20",
                    "trainer.steps=5",
                    "debug.fail_in=train",
                    "debug.fail_at_step=3",
                    "debug.fail_rank=1",
                    SIGKILL,
                ),
                "grpo_async",
            ),
            "sync_reward": ((*SYNC, "trainer.steps=4", "task.reward_fn=algorithms.faults:raising_reward"), "grpo_sync"),
            "async_reward": (
                (*ASYNC, "trainer.steps=4", "task.reward_fn=algorithms.faults:raising_reward"),
                "grpo_async",
            ),
        },
    )
    return runs


def _failed_naming(run, text: str) -> None:  # noqa: ANN001 - TrainerRun
    assert run.returncode == 1, run.explain()
    assert text in run.stderr, run.explain()
    assert "Traceback" in run.stderr, "the error keeps its traceback"


# ------------------------------------------------------------------------------ faults
def _no_key_leaked(run) -> None:  # noqa: ANN001 - TrainerRun
    """The keys in the store at exit, counted before the final clear, are all rows of groups still
    in flight (in the sync loop only those of a step interrupted mid-collect), and the clear left none."""
    s = run.summary
    assert s["keys_leaked_at_exit"] == 0, (s.get("keys_in_store_at_exit"), run.stderr[-3000:])
    assert s["keys_outstanding_at_exit"] == 0


@pytest.mark.parametrize("name", ["async_reward", "sync_reward"])
def test_a_raising_reward_fn_is_named_with_its_prompt_and_the_store_is_empty(chaos_runs: dict, name: str) -> None:
    run = chaos_runs[name]
    _failed_naming(run, "reward_fn 'algorithms.faults:raising_reward' raised ValueError on prompt uid")
    assert "refusing to score" in run.stderr
    _no_key_leaked(run)


@pytest.mark.parametrize("name, steps_done", [("sync_kill_rank", [0, 1]), ("async_store_full_kill_rank", [0, 1, 2])])
def test_sigkill_of_a_policy_rank_mid_train_names_the_rank_within_the_bound(
    chaos_runs: dict, name: str, steps_done: list[int]
) -> None:
    run = chaos_runs[name]
    _failed_naming(run, f"step {len(steps_done)} train: policy rank 1 died or was lost")
    _no_key_leaked(run)
    assert [r["step"] for r in run.rows] == steps_done
    assert _time_to_error(run) < FAULT_BOUND_S


def test_sigkill_of_the_async_collector_mid_generation_names_it_within_the_bound(chaos_runs: dict) -> None:
    run = chaos_runs["async_kill_collector"]
    _failed_naming(run, "collector 0 died or was lost")
    _no_key_leaked(run)
    assert [r["step"] for r in run.rows] == [0, 1]
    assert _time_to_error(run) < FAULT_BOUND_S


def test_sigkill_of_the_generator_mid_generate_names_it_within_the_bound(chaos_runs: dict) -> None:
    run = chaos_runs["sync_resume_kill_generator"]
    _failed_naming(run, "step 4 collect: RuntimeError: collector 0: the generator died or was lost mid-generation")
    _no_key_leaked(run)
    assert _time_to_error(run) < FAULT_BOUND_S


def test_a_refit_peer_that_never_arrives_fails_the_refit_naming_the_generator(chaos_runs: dict) -> None:
    run = chaos_runs["sync_ref_refit"]
    _failed_naming(
        run,
        f"refit of version 5: the generator (refit rank 1) never took part within refit.timeout_s={REFIT_TIMEOUT_S:g}s",
    )
    _no_key_leaked(run)
    assert [r["step"] for r in run.rows] == [0, 1, 2, 3], "step 4 trained; its refit never completed"
    ttl = _time_to_error(run)
    assert REFIT_TIMEOUT_S - 1 < ttl < REFIT_TIMEOUT_S + FAULT_BOUND_S, ttl


@pytest.mark.parametrize(
    "name, component",
    [
        ("async_ref_kill_controller", "TransferQueue controller"),
        ("async_resume_kill_unit", "TransferQueue storage unit"),
    ],
)
def test_a_killed_store_actor_is_named_and_the_run_ends_within_the_bound(
    chaos_runs: dict, name: str, component: str
) -> None:
    run = chaos_runs[name]
    _failed_naming(run, "StoreLostError")
    assert f"{component} '" in run.stderr and "died or was lost" in run.stderr, run.explain()
    # The store itself is gone: nothing to count or empty (reported as -1, not a hang).
    assert run.summary["keys_leaked_at_exit"] in (0, -1) and run.summary["keys_outstanding_at_exit"] in (0, -1)
    assert max(r["step"] for r in run.rows) == 3
    assert _time_to_error(run) < FAULT_BOUND_S


def test_a_full_store_backs_the_async_collector_off_within_max_rows(chaos_runs: dict) -> None:
    # (The guard refuses any put past max_rows by construction; tests/unit/test_capacity.py.) Here:
    # the collector met the full store, waited instead of failing, and training went on.
    run = chaos_runs["async_store_full_kill_rank"]
    rows = run.rows
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert rows[-1]["collector_store_full_waits"] > 0, "the collector never met the full store"
    assert all(r["groups_requeued_failed"] == 0 for r in rows), "a full store is backpressure, not a failed put"


# ------------------------------------------------------------------------------ resume
def test_sync_resume_after_a_rank_sigkill_reproduces_the_uninterrupted_losses(chaos_runs: dict, resume_checks) -> None:
    faulted, resumed, ref = (chaos_runs[n] for n in ("sync_kill_rank", "sync_resume_kill_generator", "sync_ref_refit"))
    assert resumed.summary["resumed_from"].endswith("step_000002")
    assert [r["step"] for r in resumed.rows] == [2, 3]
    resume_checks.assert_resumed_like_uninterrupted(faulted, ref, range(0, 2))
    resume_checks.assert_resumed_like_uninterrupted(resumed, ref, range(2, 4))
    assert any(r["loss"] != 0 for r in ref.rows), "all-zero losses would compare nothing"


def test_async_resume_after_a_collector_sigkill_reproduces_the_uninterrupted_run(
    chaos_runs: dict, resume_checks
) -> None:
    faulted, resumed, ref = (
        chaos_runs[n] for n in ("async_kill_collector", "async_resume_kill_unit", "async_ref_kill_controller")
    )
    assert resumed.summary["resumed_from"].endswith("step_000002")
    assert [r["step"] for r in resumed.rows] == [2, 3]
    keys = (*resume_checks.loss_keys, "behaviour_kl")
    resume_checks.assert_resumed_like_uninterrupted(faulted, ref, range(0, 2), keys)
    resume_checks.assert_resumed_like_uninterrupted(resumed, ref, range(2, 4), keys)
    got, want = resume_checks.trained_groups(resumed), resume_checks.trained_groups(ref)
    for s in (2, 3):  # same prompts, same group ids (seeds), same weight versions
        assert got[s] == want[s], (s, got[s], want[s])
    assert all(r["staleness_max"] == 0 for r in (*resumed.rows, *ref.rows))


def test_report_times(chaos_runs: dict, runs_dir: Path) -> None:
    """Writes the observed times for docs/reliability.md (not an assertion on speed)."""
    report = {
        n: {
            "returncode": r.returncode,
            "keys_leaked_at_exit": r.summary.get("keys_leaked_at_exit"),  # counted before the clear
            "keys_left_after_clear": r.summary.get("keys_outstanding_at_exit"),
            "time_to_error_s": round(_time_to_error(r), 2) if (r.out_dir / "fault_marker").exists() else None,
            "wall_s": round(r.summary.get("wall_s", 0), 1),
        }
        for n, r in chaos_runs.items()
    }
    (runs_dir / "chaos_report.json").write_text(json.dumps(report, indent=2))
    print(json.dumps(report))
    assert all(v["returncode"] == 1 for v in report.values())
