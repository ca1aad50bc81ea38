"""End-to-end runs of ``python -m algorithms.grpo_async`` (each in its own subprocess).

Every trainer run costs ~30 s of a 2-core CI machine, so two concurrent waves serve most checks:
the default async config on the store (learning, bounds, checkpoints) and a small run on the
in-memory baseline (legacy, whose compiled graph is made to fail its compile); then a small run whose put
of one group fails half-way with two
concurrent collectors (dispatched through the compiled graph), a soak of a couple of hundred
tiny steps under tight backpressure, and a run whose policy rank raises. Then two runs
SIGKILLed after a checkpoint and resumed, side by side (whole rollouts at a random step; partial
rollouts, responses spanning refits, one step past a checkpoint), and an interrupted run. Longer
soaks with faults:
``benchmarks/soak.py``.
"""

from __future__ import annotations

import json
import os
import random
import signal
from pathlib import Path
from typing import Any, NamedTuple

import pytest

# The module fixture runs two waves of trainer runs: more than pytest-timeout's default 600 s when loaded.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]

REPO = Path(__file__).resolve().parents[2]
SMALL_ASYNC = (
    "grpo.prompts_per_step=4",
    "generation.n=4",
    "data_plane.packing.micro_batch_size=4",
    "async.groups_per_generation=2",
)


def _trained(run) -> list[dict[str, Any]]:
    path = run.out_dir / "trained_groups.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _bound(run) -> int:
    return int(run.summary["keys_outstanding_bound"])


def _assert_lossless(run) -> None:
    """0 skipped, 0 trained twice: trained handouts are unique and, with the prompts still in
    flight at exit, are exactly the prompts handed out."""
    handouts = [h for r in _trained(run) for h in r["handouts"]]
    assert len(handouts) == len(set(handouts)), "a prompt was trained twice"
    pending = run.summary["prompts_in_flight_at_exit"]
    assert sorted(handouts + pending) == list(range(run.summary["prompts_handed_out"])), "a prompt was lost"


@pytest.fixture(scope="module")
def runs_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("grpo_async_runs")


SOAK_STEPS = 100


@pytest.fixture(scope="module")
def batch_runs(run_trainers_concurrently, runs_dir: Path):
    # At most three at a time: more Ray clusters starting at once can time out on 2 cores.
    runs = run_trainers_concurrently(
        [
            (runs_dir / "dp", ("checkpoint.every=4", "logging.plot=true"), "grpo_async"),
            # The graph's compile is made to fail: one warning, then actor calls.
            (
                runs_dir / "legacy",
                (
                    *SMALL_ASYNC,
                    "data_plane.enabled=false",
                    "trainer.steps=8",
                    "trainer.val_every=0",
                    "trainer.dispatch=compiled_graph",
                    "debug.fail_dispatch_compile=true",
                ),
                "grpo_async",
            ),
        ],
        timeout=900,
    )
    runs += run_trainers_concurrently(
        [
            (
                runs_dir / "putfail",
                (
                    *SMALL_ASYNC,
                    "debug.fail_in=put",
                    "debug.fail_at_group=5",
                    "async.num_collectors=2",
                    "trainer.steps=10",
                    "trainer.val_every=0",
                    "trainer.dispatch=compiled_graph",
                ),
                "grpo_async",
            ),
            # Tight backpressure over a hundred tiny steps: the soak (benchmarks/soak.py runs for minutes).
            (
                runs_dir / "soak",
                (
                    *SMALL_ASYNC,
                    "async.max_staleness=2",
                    "async.max_inflight_groups=2",
                    f"trainer.steps={SOAK_STEPS}",
                    "trainer.val_every=0",
                    "generation.max_new_tokens=2",
                    "trainer.dp_size=1",
                    "logging.quiet=true",
                ),
                "grpo_async",
            ),
            (
                runs_dir / "fail",
                (
                    *SMALL_ASYNC,
                    "debug.fail_in=train",
                    "debug.fail_at_step=2",
                    "debug.fail_rank=1",
                    "trainer.val_every=0",
                ),
                "grpo_async",
            ),
        ],
        timeout=900,
    )
    for r in runs[:4]:
        assert r.returncode == 0, r.explain()
    return dict(zip(("dp", "legacy", "putfail", "soak", "fail"), runs))


def test_async_learns_within_the_lag_bound(batch_runs) -> None:
    run = batch_runs["dp"]
    rows = run.rows
    assert [r["step"] for r in rows] == list(range(16))
    rewards = [r["reward"] for r in rows]
    first, last = sum(rewards[:3]) / 3, sum(rewards[-3:]) / 3
    assert first < 0.1 and last > first + 0.1, rewards
    for r in rows:
        assert 0 <= r["staleness_max"] <= 1 and r["samples"] == 32 * 16, r
        assert r["weight_version"] >= r["step"] - 1
        for key in (
            "staleness_mean",
            "groups_dropped_stale",
            "trainer_idle_s",
            "collector_idle_s",
            "behaviour_kl",
            "is_truncated_frac",
            "keys_outstanding",
            "loss",
        ):
            assert r[key] is not None, key
    assert any(r["staleness_max"] == 1 for r in rows), "generation ran ahead of training"
    assert "grpo_async finished" in run.stdout and "staleness max" in run.stdout
    assert (run.out_dir / "reward_loss.png").stat().st_size > 1000
    _assert_lossless(run)


def test_store_memory_is_bounded_every_step_and_empty_at_exit(batch_runs) -> None:
    for name in ("dp", "putfail", "soak"):
        run = batch_runs[name]
        bound = _bound(run)
        assert all(0 <= r["keys_outstanding"] <= bound for r in run.rows), (name, bound)
        # Counted before the final clear (the count after it is 0 whatever leaked), then cleared.
        assert run.summary["keys_leaked_at_exit"] == 0 and run.summary["keys_outstanding_at_exit"] == 0, name
    assert max(r["keys_outstanding"] for r in batch_runs["dp"].rows) > 0, "rollouts wait in the store between steps"


def test_backpressure_bounds_a_soak_of_a_hundred_tiny_steps(batch_runs) -> None:
    run = batch_runs["soak"]
    n = 4
    assert len(run.rows) == SOAK_STEPS
    # Written-and-unclaimed groups never exceed 2, plus at most the one batch being trained.
    assert _bound(run) == (2 + 4) * n
    assert all(r["keys_outstanding"] <= (2 + 4) * n for r in run.rows)
    assert sum(r["collector_idle_s"] for r in run.rows) > 0, "the collector waited on backpressure"
    assert max(r["staleness_max"] for r in run.rows) <= 2
    assert run.summary["keys_outstanding_at_exit"] == 0 and run.summary["keys_leaked_at_exit"] == 0
    _assert_lossless(run)


def test_a_failed_put_is_rolled_back_and_regenerated_with_concurrent_collectors(batch_runs) -> None:
    run = batch_runs["putfail"]
    # Group 5 is written together with group 4 (two groups per generate call): both roll back.
    assert sum(r["groups_requeued_failed"] for r in run.rows) == 2
    groups = [g for r in _trained(run) for g in r["groups"]]
    assert not {4, 5} & set(groups), "no group of the failed write was ever trained"
    assert len(groups) == len(set(groups)), "two collectors, one claim: no group consumed twice"
    assert all(r["samples"] == 4 * 4 for r in run.rows), "every batch is whole groups"
    _assert_lossless(run)
    # The async trainer's per-step calls ran through the compiled graph after step 0's warm-up.
    d = run.summary["dispatch"]
    assert d["mode"] == "compiled_graph" and d["fallback"] is None and d["graph_calls"] == 2 * 9, d


def test_async_on_the_in_memory_baseline_never_loads_the_data_plane(batch_runs) -> None:
    run = batch_runs["legacy"]
    assert run.summary["driver_data_plane_modules"] == []
    assert run.summary["workers_data_plane_modules"] == {"policy0": [], "policy1": [], "collector": []}
    assert all(r["dp_bytes"] == 0 and r["staleness_max"] <= 1 for r in run.rows)
    _assert_lossless(run)


def test_a_failed_compile_falls_back_to_actor_calls_with_one_warning(batch_runs) -> None:
    run = batch_runs["legacy"]
    assert [r["step"] for r in run.rows] == list(range(8)) and all(r["loss"] is not None for r in run.rows)
    assert run.stderr.count("dispatch: the compiled graph cannot serve") == 1, run.explain()
    d = run.summary["dispatch"]
    assert d["graph_calls"] == 0 and d["compile_s"] is None and "debug.fail_dispatch_compile" in d["fallback"]


class Resumed(NamedTuple):
    """A run SIGKILLed and resumed: the resumed run, the killed run's metrics rows and
    ``trained_groups.jsonl`` (read before the resume truncates them), and the ledger of the
    checkpoint it resumed from (``driver.pt``)."""

    run: Any
    killed_rows: list[dict[str, Any]]
    killed_trained: list[dict[str, Any]]
    driver: dict[str, Any]


def _jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()] if path.exists() else []


WHOLE_RESUME = ("trainer.steps=12", "checkpoint.every=2", "trainer.val_every=0")
# Partial rollouts, a sampler slowed per token: the generator is always busy, so every refit stops
# a generation in flight and responses span two versions; 5 small steps, checkpoints every 2.
PARTIAL_RESUME = (
    *SMALL_ASYNC,
    "async.partial_rollout=true",
    "debug.token_delay_s=0.1",
    "generation.max_new_tokens=8",
    "trainer.dp_size=1",
    "trainer.steps=5",
    "checkpoint.every=2",
    "trainer.val_every=0",
)


@pytest.fixture(scope="module")
def resumed(trainer_command, run_trainers_concurrently, sigkill_after, runs_dir: Path) -> dict[str, Resumed]:
    """Two runs SIGKILLed after a checkpoint, then resumed with ``checkpoint.resume=latest``, both
    pairs side by side: whole rollouts (the default config, killed at a random step) and partial
    rollouts (killed at step 3, one past the checkpoint of step 2)."""
    from algorithms.checkpoint import complete_checkpoints, load_trusted

    plan = {
        "whole": (runs_dir / "killed", WHOLE_RESUME, random.Random(os.getpid()).randint(3, 8)),
        "partial": (runs_dir / "killed_partial", PARTIAL_RESUME, 3),
    }
    sigkill_after([(out, *trainer_command(out, *ov, module="grpo_async"), steps) for out, ov, steps in plan.values()])
    killed = {}
    for name, (out, _, _) in plan.items():
        latest = complete_checkpoints(out / "checkpoints")[-1]  # what checkpoint.resume=latest picks
        # Read now: the resumed run's own checkpoints remove this one (checkpoint.keep).
        driver = load_trusted(latest / "driver.pt")
        killed[name] = (_jsonl(out / "metrics.jsonl"), _jsonl(out / "trained_groups.jsonl"), latest, driver)
    runs = run_trainers_concurrently(
        [(out, (*ov, "checkpoint.resume=latest"), "grpo_async") for out, ov, _ in plan.values()], timeout=900
    )
    out = {}
    for (name, (rows, trained, latest, driver)), run in zip(killed.items(), runs):
        assert run.returncode == 0, run.explain()
        assert run.summary["resumed_from"] == str(latest)
        out[name] = Resumed(run, rows, trained, driver)
    return out


def _assert_replayed_exactly_once(
    resumed, killed_trained: list[dict[str, Any]], driver: dict[str, Any], steps: int
) -> None:
    """Across the killed and the resumed run, every prompt consumed is consumed once: the steps
    before the checkpoint are the killed run's, kept as they were; every prompt the checkpoint's
    ledger held (in flight, partially generated or waiting for a retry) and every prompt the killed
    run trained after the checkpoint is trained again after it, exactly once, the in-flight ones
    under their own group ids (the ledger's invariant: regenerated, never carried)."""
    ckpt, ledger = int(driver["step"]), driver["prompts"]
    assert [r["step"] for r in resumed.rows] == list(range(steps)), "resumed rows replace the killed run's tail"
    _assert_lossless(resumed)
    trained = _trained(resumed)
    assert trained[:ckpt] == [r for r in killed_trained if r["step"] < ckpt], "the steps before the checkpoint stay"
    before = {h for r in trained[:ckpt] for h in r["handouts"]}
    after = [h for r in trained[ckpt:] for h in r["handouts"]]
    pending = [int(h) for h, _ in ledger["pending"]]
    assert pending and not before & set(pending), "the ledger holds prompts in flight, none trained yet"
    assert set(pending) <= set(after), "a prompt in flight at the checkpoint was never trained after the resume"
    lost_steps = [h for r in killed_trained if r["step"] >= ckpt for h in r["handouts"]]
    assert lost_steps, "the kill came after the checkpoint: the killed run trained steps the resume replays"
    assert set(lost_steps) <= set(after), "a prompt the killed run trained after the checkpoint was lost"
    if not any(r["groups_dropped_stale"] or r["groups_requeued_failed"] for r in resumed.rows):  # no new ids
        group_of = {h: g for r in trained[ckpt:] for h, g in zip(r["handouts"], r["groups"])}
        assert all(group_of[int(h)] == int(g) for h, g in ledger["inflight_group_ids"].items())


def test_killed_at_a_random_step_and_resumed_trains_every_prompt_exactly_once(resumed, batch_runs) -> None:
    r = resumed["whole"]
    assert all(row["staleness_max"] <= 1 for row in r.run.rows)
    if int(r.driver["step"]) < len(r.killed_trained):  # else the kill landed right after a checkpoint
        _assert_replayed_exactly_once(r.run, r.killed_trained, r.driver, 12)
    else:
        _assert_lossless(r.run)
    # The uninterrupted run trained the same prompts at the same steps (oldest first, none dropped).
    ref = {row["step"]: row["handouts"] for row in _trained(batch_runs["dp"])}
    got = {row["step"]: row["handouts"] for row in _trained(r.run)}
    if not any(row["groups_dropped_stale"] for row in (*r.run.rows, *batch_runs["dp"].rows)):
        assert all(sorted(got[s]) == sorted(ref[s]) for s in range(12)), (got, ref)


def test_partial_rollouts_killed_after_a_checkpoint_and_resumed_lose_or_repeat_no_prompt(resumed) -> None:
    """Partial rollouts: killed one step past a checkpoint, with responses half drawn in the
    collector's row pool; the resume regenerates what the checkpoint's ledger held in flight
    (partial responses are not carried) and trains every prompt exactly once."""
    r = resumed["partial"]
    assert sum(row["partial_samples"] for row in r.killed_rows) > 0, "no response of the killed run spanned a refit"
    assert int(r.driver["step"]) < len(r.killed_trained), "the killed run trained past its last checkpoint"
    _assert_replayed_exactly_once(r.run, r.killed_trained, r.driver, 5)
    assert all(row["staleness_max"] <= 1 for row in r.run.rows)


def test_a_failing_step_and_ctrl_c_both_leave_the_store_empty(
    trainer_command, signal_trainer, batch_runs, runs_dir: Path
) -> None:
    fail = batch_runs["fail"]
    assert fail.returncode == 1, fail.explain()
    assert "injected failure at step 2 on policy rank 1" in fail.stderr
    assert "Traceback" in fail.stderr, "the error keeps its traceback"
    assert fail.summary["keys_leaked_at_exit"] == 0 and fail.summary["keys_outstanding_at_exit"] == 0
    assert [r["step"] for r in fail.rows] == [0, 1]

    out = runs_dir / "interrupted"
    cmd, env = trainer_command(out, *SMALL_ASYNC, "trainer.steps=10000", "trainer.val_every=0", module="grpo_async")
    code, _, stderr = signal_trainer(cmd, env, out, 3, signal.SIGINT)
    assert code == 130, stderr[-4000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"].startswith("interrupted") and summary["keys_outstanding_at_exit"] == 0
    assert summary["keys_leaked_at_exit"] == 0


def test_sigterm_during_start_up_ends_the_run_with_143_leaving_no_process(trainer_command, runs_dir: Path) -> None:
    """SIGTERM to the driver as soon as its raylet is up (inside or just after ``ray.init``): the
    trainer's own shutdown runs, it exits 143, and no process of the run outlives it (Ray's agents
    included, which otherwise spend 60 s reporting their raylet's death to a dead GCS)."""
    import subprocess
    import time
    import uuid

    psutil = pytest.importorskip("psutil")
    out = runs_dir / "sigterm_start_up"
    out.mkdir(parents=True)
    cmd, env = trainer_command(out, *SMALL_ASYNC, "trainer.steps=10000", "trainer.val_every=0", module="grpo_async")
    tag = uuid.uuid4().hex
    env["NEMO_DATAPLANE_TEST_RUN_TAG"] = tag  # every process of the run inherits it (Ray's included)

    def ours() -> list[Any]:
        procs = []
        for p in psutil.process_iter(["cmdline"]):
            try:
                if p.environ().get("NEMO_DATAPLANE_TEST_RUN_TAG") == tag and p.status() != psutil.STATUS_ZOMBIE:
                    procs.append(p)
            except psutil.Error:
                continue
        return procs

    with open(out / "stderr.txt", "w") as err:
        proc = subprocess.Popen(cmd, cwd=Path(__file__).resolve().parents[2], env=env, stdout=err, stderr=err)
    try:
        deadline = time.monotonic() + 300
        while proc.poll() is None and time.monotonic() < deadline:
            if any("raylet/raylet" in " ".join(p.info["cmdline"] or []) for p in ours()):
                break
            time.sleep(0.05)
        assert proc.poll() is None, (out / "stderr.txt").read_text()[-4000:]
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(120)
        stderr = (out / "stderr.txt").read_text()
        assert code == 143, stderr[-4000:]
        assert json.loads((out / "summary.json").read_text())["status"] == "terminated (SIGTERM)"
        left = ours()
        assert left == [], [(p.pid, " ".join(p.info["cmdline"] or [])[:80]) for p in left]
    finally:
        if proc.poll() is None:
            proc.kill()
        for p in ours():  # never leave a process behind, whatever failed above
            p.kill()


def test_idle_ratios_move_with_work_injected_on_each_side(run_trainers_concurrently, runs_dir: Path) -> None:
    """The trainer's and the generators' idle ratios (time waiting / wall) follow the work: with
    each generate call made 3 s slower the trainer waits and the generators do not; with each
    train call made 3 s slower, the other way round. Two collectors, so two generators, and both
    receive every refit."""
    common = (
        *SMALL_ASYNC,
        "data_plane.enabled=false",
        "trainer.steps=5",
        "trainer.val_every=0",
        "async.num_collectors=2",
        "logging.plot=false",
    )
    slow_gen, slow_train = run_trainers_concurrently(
        [
            (runs_dir / "idle_gen", (*common, "debug.generate_delay_s=3.0"), "grpo_async"),
            (runs_dir / "idle_train", (*common, "debug.train_delay_s=3.0"), "grpo_async"),
        ],
        timeout=900,
    )
    for r in (slow_gen, slow_train):
        assert r.returncode == 0, r.explain()
        assert r.summary["generator_versions"] == [5, 5], "every generator received every refit"
        for row in r.rows:
            assert 0.0 <= row["trainer_idle_ratio"] <= 1.0 and 0.0 <= row["generator_idle_ratio"] <= 1.0
    t = {"gen": slow_gen.summary["trainer_idle_ratio"], "train": slow_train.summary["trainer_idle_ratio"]}
    g = {"gen": slow_gen.summary["generator_idle_ratio"], "train": slow_train.summary["generator_idle_ratio"]}
    assert t["gen"] > t["train"] + 0.2, t
    assert g["train"] > g["gen"] + 0.2, g
    assert "idle: trainer" in slow_gen.stdout
