"""``algorithms/dispatch.py`` on the session's Ray cluster: the compiled graph's runtime fallbacks,
a rank's own error (and the bounded close after it), and the idle teardown; and the actor calls'
gather naming a rank killed in a collective rather than its survivor's gloo error.

A forced compile failure is covered end to end (tests/functional/test_grpo_async.py); here a
graph that was serving breaks under the dispatcher the way it does in a run: its channels are
closed (the graph torn down through Ray's own ``teardown``) or a rank's actor dies.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from algorithms import remote
from algorithms.dispatch import CompiledGraphDispatch
from algorithms.remote import StepError, gather

pytestmark = pytest.mark.timeout(240)


class _Rank:
    """A policy rank whose calls echo what they got (no model: the dispatch is under test)."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.calls: list[tuple[str, int]] = []

    def _done(self, kind: str, batch: Any, step: int) -> dict[str, Any]:
        self.calls.append((kind, step))
        return {"rank": self.rank, "kind": kind, "step": step, "input": batch}

    def get_logprobs(self, batch: Any, step: int, *, with_reference: bool = False) -> dict[str, Any]:
        return self._done("logprobs", batch, step)

    def train(self, batch: Any, step: int, *, behaviour: bool = False) -> dict[str, Any]:
        return self._done("train", batch, step)

    def step_call(self, kind: str, batch: Any, step: int, flag: bool) -> dict[str, Any]:
        if isinstance(batch, float):  # a call that takes this long
            time.sleep(batch)
        return self.train(batch, step) if kind == "train" else self.get_logprobs(batch, step)

    def history(self) -> list[tuple[str, int]]:
        return list(self.calls)

    def pid(self) -> int:
        return os.getpid()


@pytest.fixture
def graph(ray_session: Any):
    ray = ray_session
    ranks = [ray.remote(num_cpus=0)(_Rank).remote(r) for r in range(2)]
    logs: list[str] = []
    d = CompiledGraphDispatch(ranks, warmup_calls=0, log=logs.append)
    out = d.call("logprobs", ["a", "b"], 0, False, 60.0, "step 0 logprobs")  # compiles, then runs through it
    assert d.active and d.graph_calls == 1 and [o["input"] for o in out] == ["a", "b"]
    yield d, ranks, logs
    d.close()
    for a in ranks:
        ray.kill(a, no_restart=True)


def test_closed_channels_fall_back_once_and_logprobs_is_redone_through_actor_calls(graph, ray_session) -> None:
    d, ranks, logs = graph
    d.graph.teardown()  # the channels close under the dispatcher, as when Ray tears a graph down
    out = d.call("logprobs", ["c", "d"], 1, False, 60.0, "step 1 logprobs")
    assert [(o["rank"], o["input"], o["step"]) for o in out] == [(0, "c", 1), (1, "d", 1)]
    assert not d.active and d.fallback_reason is not None and d.graph_calls == 1
    assert len(logs) == 1 and "the compiled graph cannot serve" in logs[0]
    # Every later call goes through actors without another warning.
    out = d.call("train", ["e", "f"], 1, False, 60.0, "step 1 train")
    assert [o["input"] for o in out] == ["e", "f"] and len(logs) == 1
    hist = ray_session.get([r.history.remote() for r in ranks], timeout=30)
    assert all(h == [("logprobs", 0), ("logprobs", 1), ("train", 1)] for h in hist), hist


def test_a_rank_that_dies_under_the_graph_fails_train_naming_the_rank_and_never_repeats_it(graph, ray_session) -> None:
    d, ranks, logs = graph
    ray = ray_session
    ray.kill(ranks[1], no_restart=True)
    with pytest.raises(ray.exceptions.ActorDiedError):  # ray.kill is asynchronous: wait for the death
        for _ in range(60):
            ray.get(ranks[1].__ray_ready__.remote(), timeout=30)
            time.sleep(0.5)
    with pytest.raises(StepError) as err:
        d.call("train", ["c", "d"], 1, False, 30.0, "step 1 train")
    msg = str(err.value)
    # Either the graph saw the death (train may have run on rank 0: the step fails rather than
    # train twice) or the submission failed first and the actor-call retry names the dead rank.
    assert "train may have run on some ranks" in msg or "policy rank 1" in msg, msg
    assert not d.active and len(logs) == 1
    with pytest.raises(StepError, match="policy rank 1"):
        d.call("logprobs", ["e", "f"], 2, False, 30.0, "step 2 logprobs")
    assert ray_session.get(ranks[0].history.remote(), timeout=30).count(("train", 1)) <= 1


class _FailingRank(_Rank):
    """Rank 1 raises in step 1's train while rank 0 stays blocked (as in a collective with it that
    would time out after 60 s)."""

    def step_call(self, kind: str, batch: Any, step: int, flag: bool) -> dict[str, Any]:
        if kind == "train" and step == 1:
            if self.rank == 1:
                raise ValueError("rank 1 refuses step 1")
            time.sleep(60)
        return super().step_call(kind, batch, step, flag)


def test_a_ranks_own_error_through_the_graph_is_the_steps_error_and_close_kills_the_blocked_ranks_at_once(
    ray_session: Any,
) -> None:
    ray = ray_session
    ranks = [ray.remote(num_cpus=0)(_FailingRank).remote(r) for r in range(2)]
    logs: list[str] = []
    d = CompiledGraphDispatch(ranks, warmup_calls=0, log=logs.append)
    try:
        d.call("logprobs", ["a", "b"], 0, False, 60.0, "step 0 logprobs")
        t0 = time.monotonic()
        with pytest.raises(StepError, match=r"step 1 train: ValueError: rank 1 refuses step 1"):
            d.call("train", ["a", "b"], 1, False, 60.0, "step 1 train")
        assert time.monotonic() - t0 < 10.0, "the error waited for rank 0's blocked call"
        assert d.fallback_reason is None and not logs, "a worker's error is not a graph failure"
        # Rank 0 is still inside step 1's train: nothing more goes through the graph.
        with pytest.raises(StepError, match="an earlier call through the compiled graph failed"):
            d.call("logprobs", ["c", "d"], 2, False, 60.0, "step 2 logprobs")
        # Closing does not wait for rank 0's 60 s "collective": the ranks are killed after a 1 s grace.
        t0 = time.monotonic()
        d.close(timeout_s=10.0)
        took = time.monotonic() - t0
        assert took < 8.0, f"close took {took:.1f}s: it waited for the blocked rank"
        assert d.killed_actors and d.report()["killed_actors"] is True
        assert any("killing the policy actors" in m for m in logs), logs
        for a in ranks:
            with pytest.raises(ray.exceptions.RayActorError):  # dead, not merely busy: answers at once
                ray.get(a.__ray_ready__.remote(), timeout=10)
    finally:
        d.close(timeout_s=2.0)
        for a in ranks:
            ray.kill(a, no_restart=True)


def _thread_states(pid: int) -> dict[str, str]:
    """Each thread's scheduler state (``R``: running or runnable) from /proc."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            out[tid] = Path(f"/proc/{pid}/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError):
            pass  # the thread ended meanwhile
    return out


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _idle_probe(pids: list[int], seconds: float, samples: int = 16) -> tuple[float, float]:
    """Over ``seconds``: the largest fraction of samples in which one thread of one of ``pids`` was
    runnable, and the mean CPU% of the processes. A thread spinning on a channel is runnable in
    every sample however loaded the machine is (it never blocks), while its CPU share depends on
    the load; a blocked thread is never runnable."""
    runnable: dict[tuple[int, str], int] = {}
    cpu0 = [_cpu_s(p) for p in pids]
    t0 = time.monotonic()
    for _ in range(samples):
        for p in pids:
            for tid, state in _thread_states(p).items():
                runnable[(p, tid)] = runnable.get((p, tid), 0) + (state == "R")
        time.sleep(seconds / samples)
    wall = time.monotonic() - t0
    cpu = 100.0 * sum(_cpu_s(p) - c for p, c in zip(pids, cpu0)) / len(pids) / wall
    return max(runnable.values()) / samples, cpu


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="reads thread states from /proc")
def test_an_idle_graph_is_torn_down_its_ranks_stop_polling_and_the_next_call_recompiles(ray_session: Any) -> None:
    ray = ray_session
    idle_s = 2.0
    ranks = [ray.remote(num_cpus=0)(_Rank).remote(r) for r in range(2)]
    logs: list[str] = []
    d = CompiledGraphDispatch(ranks, warmup_calls=0, idle_teardown_s=idle_s, log=logs.append)
    try:
        pids = ray.get([a.pid.remote() for a in ranks], timeout=60)
        d.call("logprobs", ["a", "b"], 0, False, 60.0, "step 0 logprobs")  # compiles
        # A call longer than idle_s is never torn down under: the idle time counts from a call's end.
        out = d.call("train", [idle_s + 0.5, idle_s + 0.5], 1, False, 60.0, "step 1 train")
        assert [(o["rank"], o["step"]) for o in out] == [(0, 1), (1, 1)]
        assert d.active and d.idle_teardowns == 0 and d.graph_calls == 2 and d.fallback_reason is None
        polling, cpu_polling = _idle_probe(pids, 0.8)
        assert d.idle_teardowns == 0, "the probe of the live graph overran idle_s (machine overloaded?)"
        assert polling >= 0.75, f"no rank thread spun while the graph was idle ({polling:.2f}, {cpu_polling:.0f}%)"
        deadline = time.monotonic() + idle_s + 15
        while d.active and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not d.active and d.idle_teardowns == 1, "the idle graph was not torn down"
        time.sleep(0.5)  # the teardown (in its thread) ends the loops within milliseconds
        after, cpu_after = _idle_probe(pids, 1.6)
        # An idle actor without a graph: no thread runnable in most samples, ~1% CPU (of a core).
        assert after <= 0.5, f"a rank thread still spins after the teardown ({after:.2f}, {cpu_after:.0f}%)"
        assert cpu_after < 10.0, f"idle ranks used {cpu_after:.0f}% CPU after the teardown"
        # The next call recompiles the graph and gets each rank's own result through it.
        out = d.call("logprobs", ["c", "d"], 2, False, 60.0, "step 2 logprobs")
        assert [(o["rank"], o["input"], o["step"]) for o in out] == [(0, "c", 2), (1, "d", 2)]
        rep = d.report()
        assert d.active and rep["recompiles"] == 1 and rep["recompile_s"] > 0 and rep["graph_calls"] == 3
        assert rep["idle_teardowns"] == 1 and rep["fallback"] is None and not logs
        hist = ray.get([a.history.remote() for a in ranks], timeout=30)
        assert all(h == [("logprobs", 0), ("train", 1), ("logprobs", 2)] for h in hist), hist
        d.close(timeout_s=10.0)
        assert not d.killed_actors and ray.get(ranks[0].pid.remote(), timeout=30) == pids[0], "close kept the actors"
    finally:
        d.close(timeout_s=2.0)
        for a in ranks:
            ray.kill(a, no_restart=True)


@pytest.mark.parametrize(
    ("value", "match"),
    [(0, "idle_teardown_s must be > 0"), (float("nan"), "idle_teardown_s must be a finite"), (float("inf"), "finite")],
)
def test_the_idle_teardown_setting_is_validated(value: float, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        CompiledGraphDispatch([], idle_teardown_s=value)


# ------------------------------------------------------------------ a rank dies in a collective
GLOO_ECHO = (
    "[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Read error [127.0.0.1]:40155: Connection reset by peer"
)


class _Peer:
    """A policy rank in a collective whose peer dies: the survivor's error may reach the driver
    before Ray's notice of the death (a loaded machine), which these calls make certain."""

    def survivor(self) -> None:
        raise RuntimeError(GLOO_ECHO)

    def own_error(self) -> None:
        raise ValueError("a rank's own bug")

    def die_after(self, seconds: float) -> None:
        time.sleep(seconds)
        os.kill(os.getpid(), signal.SIGKILL)

    def block(self, seconds: float) -> None:
        time.sleep(seconds)


@pytest.fixture
def peers(ray_session: Any):
    ranks = [ray_session.remote(num_cpus=0)(_Peer).remote() for _ in range(2)]
    ray_session.get([a.block.remote(0) for a in ranks], timeout=120)  # up: the timings below are the gather's
    yield ranks
    for a in ranks:
        ray_session.kill(a, no_restart=True)


def test_a_rank_killed_mid_collective_is_named_not_its_survivors_gloo_error(peers) -> None:
    survivor, victim = peers
    with pytest.raises(StepError) as e:
        gather([survivor.survivor.remote(), victim.die_after.remote(0.5)], 60.0, "step 3 train", who="policy rank")
    msg = str(e.value)
    assert msg.startswith("step 3 train: policy rank 1 died or was lost: "), msg
    assert "policy rank 0 then failed with RuntimeError" in msg and "Connection reset by peer" in msg


def test_a_ranks_own_error_is_raised_at_once_and_an_echo_without_a_dead_peer_after_the_grace(
    peers, monkeypatch: pytest.MonkeyPatch
) -> None:
    first, second = peers
    t0 = time.monotonic()
    with pytest.raises(StepError, match=r"^step 1 train: ValueError: a rank's own bug$"):
        gather([first.own_error.remote(), second.block.remote(30.0)], 60.0, "step 1 train", who="policy rank")
    assert time.monotonic() - t0 < 5.0, "a rank's own error does not wait for its blocked peers"
    monkeypatch.setattr(remote, "LOST_PEER_GRACE_S", 1.0)
    t0 = time.monotonic()
    with pytest.raises(StepError, match=r"^step 2 train: RuntimeError: .*Connection reset by peer$"):
        gather([first.survivor.remote(), second.block.remote(30.0)], 60.0, "step 2 train", who="policy rank")
    assert 1.0 <= time.monotonic() - t0 < 5.0
    assert not remote.may_be_a_lost_peer(ValueError("x")) and remote.may_be_a_lost_peer(RuntimeError(GLOO_ECHO))
