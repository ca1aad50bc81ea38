"""Rewards under ``task.reward_timeout_s`` (algorithms/reward_pool.py): real worker processes, the
real ``math`` reward. A call that would hang scores 0 within the bound and is counted, its worker
is killed and replaced; a custom function is imported in the worker from the caller's import
path, its exceptions come back with their type; a worker dies with the process that started it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from algorithms.config import ConfigError, load_config
from algorithms.reward_pool import InProcessReward, RewardPool, make_scorer
from algorithms.rewards import RewardError, checked_reward
from algorithms.tasks import PromptRecord

REPO = Path(__file__).resolve().parents[2]
REC = PromptRecord("What is 12 + 7?", "19", 3, source="data.jsonl:4")
TOWER = r"so the answer is \boxed{9^{9^{9^{9}}}}"  # math-verify evaluates it in C, holding the GIL
BOUND_S = 2.0
SLACK_S = 3.0  # the kill, the reap and a loaded 2-core machine


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _gone_within(pids: list[int], seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not any(_alive(p) for p in pids)


@pytest.fixture(scope="module")
def math_pool() -> Iterator[RewardPool]:
    pool = RewardPool("math", "copy", BOUND_S)
    pool.wait_ready(120)
    yield pool
    pool.close()


@pytest.fixture(scope="module")
def user_module(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A user's reward module, importable only through this process's sys.path."""
    d = tmp_path_factory.mktemp("user_rewards")
    (d / "my_rewards.py").write_text(
        textwrap.dedent(
            """
            import os, time
            CALLS = []
            def worker_pid(record, text):
                CALLS.append(text)  # module state lives per worker, across calls
                return float(os.getpid()) + len(CALLS) / 1000
            def nap(record, text):
                time.sleep(float(text))
                return 1.0
            """
        )
    )
    sys.path.insert(0, str(d))
    yield "my_rewards"
    sys.path.remove(str(d))


def test_the_math_reward_on_a_tower_of_powers_scores_0_within_the_bound_and_is_counted(math_pool: RewardPool) -> None:
    assert checked_reward(math_pool, REC, "12 + 7 = 19, so the answer is 19", name="math") == 1.0
    before, pids = math_pool.timeouts, math_pool.pids()
    t0 = time.monotonic()
    # From a thread, as the collector's producer scores: math-verify's own SIGALRM bound is off there.
    with ThreadPoolExecutor(1) as ex:
        score = ex.submit(checked_reward, math_pool, REC, TOWER, name="math", group=5).result(BOUND_S + SLACK_S + 5)
    took = time.monotonic() - t0
    assert score == 0.0 and BOUND_S - 0.1 <= took < BOUND_S + SLACK_S, took
    assert math_pool.timeouts == before + 1
    assert _gone_within(pids, 5.0), "the worker that ran the tower was not killed"
    # A replacement serves the next call.
    assert checked_reward(math_pool, REC, "the answer is 19", name="math") == 1.0
    assert math_pool.timeouts == before + 1 and math_pool.started >= 2


def test_a_custom_reward_that_sleeps_scores_0_within_the_bound_and_is_counted(user_module: str) -> None:
    pool = RewardPool(f"{user_module}:nap", "copy", 1.0)
    try:
        assert pool(REC, "0") == 1.0
        t0 = time.monotonic()
        assert checked_reward(pool, REC, "3600", name=f"{user_module}:nap") == 0.0
        assert 0.9 <= time.monotonic() - t0 < 1.0 + SLACK_S
        t0 = time.monotonic()
        assert checked_reward(pool, REC, "3600", name=f"{user_module}:nap") == 0.0  # on the replacement
        assert pool.timeouts == 2 and time.monotonic() - t0 < 1.0 + SLACK_S + 5  # + a replacement's start
        assert pool(REC, "0.01") == 1.0
    finally:
        pool.close()


def test_the_builtin_hanging_fault_reward_is_cut_short_too() -> None:
    pool = RewardPool("algorithms.faults:hanging_reward", "copy", 0.5)
    try:
        t0 = time.monotonic()
        assert checked_reward(pool, REC, "x", name="hang") == 0.0 and pool.timeouts == 1
        assert time.monotonic() - t0 < 0.5 + SLACK_S
    finally:
        pool.close()
        assert pool.pids() == []


def test_a_custom_reward_keeps_its_state_per_worker_and_calls_run_side_by_side(user_module: str) -> None:
    pool = RewardPool(f"{user_module}:worker_pid", "copy", 5.0)
    try:
        first, second = pool(REC, "a"), pool(REC, "b")
        assert int(first) != os.getpid() and int(second) == int(first), "one worker, reused"
        assert round(second - int(second), 3) == 0.002, "its module state survived between calls"
        # Two threads at once (the producer and a validation): a second worker starts for them.
        barrier = threading.Barrier(2)

        def call(text: str) -> float:
            barrier.wait()
            return pool(REC, text)

        with ThreadPoolExecutor(2) as ex:
            for _ in range(5):
                list(ex.map(call, ["c", "d"]))
        assert len(pool.pids()) <= 2
    finally:
        pool.close()


def test_a_raising_reward_keeps_its_type_and_the_workers_traceback() -> None:
    pool = RewardPool("algorithms.faults:raising_reward", "copy", 5.0)
    try:
        with pytest.raises(RewardError, match=r"raised ValueError on prompt uid 3 .* of group 2: raising_reward") as e:
            checked_reward(pool, REC, "abc", name="raising", group=2)
        cause = e.value.__cause__
        assert isinstance(cause, ValueError) and "in raising_reward" in "".join(getattr(cause, "__notes__", []))
        assert pool.timeouts == 0 and len(pool.pids()) == 1, "an exception does not cost the worker"
    finally:
        pool.close()


def test_a_reward_that_cannot_load_fails_the_start_naming_it() -> None:
    pool = RewardPool("algorithms.faults:no_such_reward", "copy", 5.0)
    try:
        with pytest.raises(AttributeError, match="has no attribute 'no_such_reward'"):
            pool.wait_ready(60)
        with pytest.raises(AttributeError, match="no_such_reward"):
            pool(REC, "x")
    finally:
        pool.close()


def test_a_worker_dies_with_the_process_that_started_it(tmp_path: Path) -> None:
    # The parent is SIGKILLed while its worker is inside a call that would never return.
    code = textwrap.dedent(
        """
        import sys, threading, time
        from algorithms.reward_pool import RewardPool
        from algorithms.tasks import PromptRecord
        pool = RewardPool("algorithms.faults:hanging_reward", "copy", 3600.0)
        pool.wait_ready(120)
        print(*pool.pids(), flush=True)
        threading.Thread(target=pool, args=(PromptRecord("p", "1", 0), "x"), daemon=True).start()
        time.sleep(3600)
        """
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        worker = int(proc.stdout.readline())
        assert _alive(worker)
        time.sleep(0.5)  # inside the hanging call
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        assert _gone_within([worker], 10.0), "the reward worker outlived its parent"
    finally:
        if proc.poll() is None:
            proc.kill()


def test_reward_timeout_s_is_checked_and_null_scores_in_process() -> None:
    config = REPO / "examples" / "configs" / "grpo_tiny.yaml"
    assert load_config(config, []).task.reward_timeout_s == 10.0
    for bad in ("0", "-1", "nan", "inf"):
        with pytest.raises(ConfigError, match="task.reward_timeout_s"):
            load_config(config, [f"task.reward_timeout_s={bad}"])
    scorer = make_scorer(load_config(config, ["task.reward_timeout_s=null", "task.reward_fn=exact_match"]).task)
    assert isinstance(scorer, InProcessReward) and scorer(REC, " 19 ") == 1.0 and scorer.timeouts == 0
