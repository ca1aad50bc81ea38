"""The outside-kill soak's pure pieces (benchmarks/soak_outside.py) on fake process lists: victim
kinds from command lines, the victim chooser, orphan and foreign-process detection, the plan and
the verdict. No trainer runs here; the soak itself is ``benchmarks/soak.py --outside-kills N``."""

from __future__ import annotations

import importlib.util
import random
import signal
import sys
from pathlib import Path
from types import ModuleType

REPO = Path(__file__).resolve().parents[2]


def _load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, REPO / "benchmarks" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


so = _load("soak_outside")
soak = _load("soak")
Proc = so.Proc
DRIVER = 100
RAY = "/venv/lib/python3.11/site-packages/ray"


def _tree() -> list[object]:
    cmds = {
        100: "/venv/bin/python -m algorithms.grpo_async --config x.yaml",
        101: f"{RAY}/core/src/ray/gcs/gcs_server --log_dir=/tmp/ray/s/logs",
        102: f"{RAY}/core/src/ray/raylet/raylet --raylet_socket_name=/tmp/ray/s/sockets/raylet",
        103: "ray::DashboardAgent",
        104: f"/venv/bin/python -u {RAY}/_private/log_monitor.py --session-dir=/tmp/ray/s",
        110: "ray::PolicyWorker.train",
        111: "ray::PolicyWorker",
        112: "ray::GeneratorWorker.__init__",
        113: "ray::RolloutCollector",
        114: "ray::_Controller",
        115: "ray::_StorageUnit",
    }
    return [Proc(pid, 1, 1000.0 + pid, "sleeping", cmd, True) for pid, cmd in cmds.items()]


def test_kinds_from_the_command_lines_ray_shows() -> None:
    kinds = {p.pid: so.kind_of(p, DRIVER) for p in _tree()}
    assert kinds == {
        100: "driver",
        101: "gcs_server",
        102: "raylet",
        103: "ray_other",
        104: "ray_other",
        110: "policy_rank",
        111: "policy_rank",
        112: "generator",
        113: "collector",
        114: "store_controller",
        115: "store_unit",
    }
    assert so.kind_of(Proc(7, 1, 0.0, "sleeping", "bash -c sleep 1", False), DRIVER) is None
    assert set(so.VICTIMS) == set(soak.VICTIMS), "soak.py's --victims choices and soak_outside agree"
    assert set(so.NAMES) == set(so.KINDS)


def test_victim_is_of_the_drawn_kind_else_of_a_kind_present() -> None:
    rng = random.Random(0)
    tree = _tree()
    for _ in range(20):
        pick = so.choose_victim(rng, tree, DRIVER, "policy_rank", so.VICTIMS)
        assert pick is not None and pick[0] == "policy_rank" and pick[1].pid in (110, 111)
    # start-up: no worker yet, so the drawn kind falls back to one that is up
    early = [p for p in tree if p.pid < 110]
    seen = {so.choose_victim(rng, early, DRIVER, "collector", so.VICTIMS)[0] for _ in range(50)}
    assert seen == {"driver", "gcs_server", "raylet"}
    # never another job's process, a zombie or a kind not allowed
    foreign = [Proc(p.pid, p.ppid, p.create_time, p.status, p.cmdline, False) for p in tree]
    assert so.choose_victim(rng, foreign, DRIVER, "policy_rank", so.VICTIMS) is None
    zombie = [Proc(110, 1, 0.0, "zombie", "ray::PolicyWorker", True)]
    assert so.choose_victim(rng, zombie, DRIVER, "policy_rank", so.VICTIMS) is None
    assert so.choose_victim(rng, tree, DRIVER, "driver", ["generator"])[1].pid == 112


def test_orphans_are_the_runs_live_processes_not_zombies_nor_recycled_pids() -> None:
    recorded = _tree()
    assert so.orphans(recorded, []) == []
    agent = next(p for p in recorded if p.pid == 103)
    # the agent outlived the run (reparented to init), in a session of its own
    stray = Proc(103, 1, agent.create_time, "sleeping", agent.cmdline, False)
    zombie = Proc(110, 1, 1110.0, "zombie", "ray::PolicyWorker", True)
    recycled = Proc(111, 1, 5000.0, "sleeping", "vim", False)  # pid 111 reused by another process
    later = Proc(120, 102, 1200.0, "sleeping", "ray::IDLE", True)  # started after the kill, the run's
    other_job = Proc(130, 1, 1300.0, "sleeping", f"{RAY}/core/src/ray/raylet/raylet", False)
    live = [stray, zombie, recycled, later, other_job]
    assert [p.pid for p in so.orphans(recorded, live)] == [103, 120]
    assert [p.pid for p in so.foreign_ray(recorded, live)] == [130]


def test_plan_is_reproducible_and_covers_phases_and_signals() -> None:
    weights = {"SIGKILL": 0.6, "SIGTERM": 0.2, "SIGINT": 0.2}
    a = so.plan_trials(3, 200, so.VICTIMS, weights, 0.25, 30.0, 15.0)
    assert a == so.plan_trials(3, 200, so.VICTIMS, weights, 0.25, 30.0, 15.0)
    assert {p.phase for p in a} == {"startup", "training"}
    assert {p.signal for p in a} == set(weights) and {p.kind for p in a} == set(so.VICTIMS)
    assert all(0 <= p.delay_s <= (30 if p.phase == "startup" else 15) for p in a)
    assert {p.signal for p in so.plan_trials(0, 20, ["driver"], {"SIGKILL": 1.0}, 0, 1, 1)} == {"SIGKILL"}


def test_verdict() -> None:
    err = "grpo_async: error: step 3 train: policy rank 1 died or was lost: ActorDiedError"
    assert so.verdict("policy_rank", "SIGKILL", 1, err, False, True) == "ok"
    assert so.verdict("policy_rank", "SIGKILL", 1, "grpo_async: error: timeout", False, None).startswith("error does")
    # The run goes on until its signal: an exit 0 after one is not a pass.
    assert so.verdict("collector", "SIGTERM", 0, "", False, None) == "exit 0"
    # The victim outlived the bound (the raylet ignores SIGINT): ok once the soak's Ctrl-C ends the run with 130.
    assert so.verdict("raylet", "SIGINT", 130, "", True, None).startswith("ok (the process survived")
    assert not so.verdict("raylet", "SIGINT", 1, "", True, None).startswith("ok")
    # The driver itself: -9, or its own shutdown's 130 (Ctrl-C) and 143 (SIGTERM); Ray's -6 or -15 is not.
    # An engine's process in a run of several engines: the run must train on, then the soak's Ctrl-C ends it.
    ok = so.verdict("generator", "SIGKILL", 130, "", False, None, trained_on=3, replaced=1)
    assert ok.startswith("ok (trained on 3 steps after the signal and a replacement joined")
    assert so.verdict("collector", "SIGKILL", 1, err, False, None, trained_on=0).startswith("the run did not train on")
    assert not so.verdict("generator", "SIGTERM", 130, "", False, None, trained_on=1, replaced=1).startswith("ok")
    assert "no replacement joined" in so.verdict("collector", "SIGTERM", 130, "", False, None, trained_on=5, replaced=0)
    assert so.verdict("driver", "SIGKILL", -signal.SIGKILL, "", False, None) == "ok"
    assert so.verdict("driver", "SIGINT", 130, "", False, True) == "ok"
    assert so.verdict("driver", "SIGTERM", 143, "", False, None) == "ok"
    for code in (-6, -15, 1, 0):
        assert so.verdict("driver", "SIGTERM", code, "", False, None).startswith(f"driver exit {code}")
    assert so.verdict("raylet", "SIGKILL", None, "", False, None) == "no exit within the bound"
    assert so.verdict("generator", "SIGKILL", 1, err, False, False) == "resume failed"
    # A signal that never landed is not a pass of any kind.
    assert so.verdict("policy_rank", "SIGKILL", 130, "", False, None, "the run ended first") == (
        "not tried: the run ended first"
    )


def _trial(i: int, verdict: str, not_tried: str = "", survived: bool = False) -> object:
    t = so.Trial(i, {"phase": "training"}, victim_kind=None if not_tried else "collector", verdict=verdict)
    t.not_tried, t.survived = not_tried, survived
    return t


def test_trials_not_tried_are_counted_apart_and_fail_the_soak() -> None:
    ok = [_trial(0, "ok"), _trial(1, "ok (the process survived the signal; ...)", survived=True)]
    s = so.summarize(ok)
    assert (s["trials"], s["signalled"], s["not_tried"], s["ok"], s["survived_the_signal"]) == (2, 2, 0, 2, 1)
    assert so.soak_exit(s) == 0
    missed = [*ok, _trial(2, "not tried: the run ended first", not_tried="the run ended first")]
    s = so.summarize(missed)
    assert (s["trials"], s["signalled"], s["not_tried"], s["ok"]) == (3, 2, 1, 2)
    assert s["per_victim"][so.NOT_TRIED] == {"trials": 1, "ok": 0, "orphans": 0}
    assert so.soak_exit(s) == 1
    assert so.soak_exit(so.summarize([])) == 1


def test_the_soak_counts_keys_at_each_exit_before_the_clear_and_a_leak_fails_it() -> None:
    # The trainer counts before its final clear; the count after it is 0 whatever leaked.
    summary = {"keys_in_store_at_exit": 18, "keys_leaked_at_exit": 2, "keys_outstanding_at_exit": 0}
    assert soak.exit_keys(summary) == {"in_store": 18, "leaked": 2, "left": 0}
    report = {
        "faults_survived": 2,
        "faults_injected": 2,
        "final_exit_code": 0,
        "keys_left_at_final_exit": 0,
        "keys_leaked_at_each_exit": [0, -1, None, 0],  # -1: the store was killed; None: no summary
    }
    assert soak.soak_ok(report)
    assert not soak.soak_ok({**report, "keys_leaked_at_each_exit": [0, 2, 0]})
    assert not soak.soak_ok({**report, "final_exit_code": 3}), "the trainer's own exit for a leak"
    assert not soak.soak_ok({**report, "faults_survived": 1})


def test_error_line_prefers_the_trainers_error_then_rays_own() -> None:
    trainer = "Traceback ...\ngrpo_async: error: step 3 train: policy rank 1 died or was lost: X\nbye\n"
    assert so._error_line(trainer).startswith("grpo_async: error: step 3")
    ray_quit = "[E core_worker_process.cc:1029] Failed to get the system config from raylet because it is dead.\n\nx\n"
    line = so._error_line(ray_quit)
    assert line.startswith("[E core_worker") and so.verdict("raylet", "SIGKILL", 1, line, False, None) == "ok"
    assert so._error_line("") == ""
    unnamed = "grpo_async: error: data_plane transport attach: ActorDiedError: The actor died unexpectedly"
    assert so.verdict("store_controller", "SIGKILL", 1, unnamed, False, None).startswith("error does not name")
