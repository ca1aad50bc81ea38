"""``algorithms/dispatch.py`` on the session's Ray cluster: the compiled graph's runtime fallbacks.

A forced compile failure is covered end to end (tests/functional/test_grpo_async.py); here a
graph that was serving breaks under the dispatcher the way it does in a run: its channels are
closed (the graph torn down through Ray's own ``teardown``) or a rank's actor dies.
"""

from __future__ import annotations

import time
from typing import Any

import pytest

from algorithms.dispatch import CompiledGraphDispatch
from algorithms.step import StepError

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
        return self.train(batch, step) if kind == "train" else self.get_logprobs(batch, step)

    def history(self) -> list[tuple[str, int]]:
        return list(self.calls)


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
    """Rank 1 raises in step 1's train while rank 0 stays blocked (as in a collective with it)."""

    def step_call(self, kind: str, batch: Any, step: int, flag: bool) -> dict[str, Any]:
        if kind == "train" and step == 1:
            if self.rank == 1:
                raise ValueError("rank 1 refuses step 1")
            time.sleep(20)
        return super().step_call(kind, batch, step, flag)


def test_a_ranks_own_error_through_the_graph_is_the_steps_error_without_waiting_for_blocked_peers(
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
    finally:
        d.close(timeout_s=2.0)
        for a in ranks:
            ray.kill(a, no_restart=True)
