"""``trainer.dispatch=compiled_graph`` end to end (algorithms/dispatch.py), each run its own process.

Five short runs, in two waves of runs that share the machine:

* ``actors``: sync, data plane, plain actor calls (the reference);
* ``graph``: the same with the compiled graph (compiled after step 0, serving steps 1-2);
* ``graph_legacy``: the compiled graph on the legacy transport (each rank's input is the
  ``ObjectRef`` of its shard), whose rank 0 raises in ``train`` at step 2 (through the graph);
* ``graph_async``: the async trainer with the compiled graph;
* ``fallback``: the compile is made to fail (``debug.fail_dispatch_compile``): one warning, then
  actor calls.
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.slow

SHORT = ("trainer.steps=3", "trainer.val_every=0")
KEYS = ("loss", "pg_loss", "kl", "entropy", "grad_norm", "reward")


@pytest.fixture(scope="module")
def runs(run_trainers_concurrently, small_overrides, tmp_path_factory: pytest.TempPathFactory) -> dict:
    small = small_overrides
    d = tmp_path_factory.mktemp("dispatch_runs")
    # Two waves of at most three runs: more Ray clusters starting at once time out on 2 cores.
    first = run_trainers_concurrently([
        (d / "actors", (*SHORT, "trainer.dispatch=actors")),
        (d / "graph", (*SHORT, "trainer.dispatch=compiled_graph")),
        (d / "graph_legacy", (*SHORT, "trainer.dispatch=compiled_graph", "data_plane.enabled=false",
                              "debug.fail_in=train", "debug.fail_at_step=2", "debug.fail_rank=0")),
    ], timeout=600)
    second = run_trainers_concurrently([
        (d / "graph_async", (*SHORT, *small, "async.groups_per_generation=2", "trainer.dispatch=compiled_graph"),
         "grpo_async"),
        (d / "fallback", ("trainer.steps=2", "trainer.val_every=0", *small, "trainer.dispatch=compiled_graph",
                          "debug.fail_dispatch_compile=true")),
    ], timeout=600)
    names = ["actors", "graph", "graph_legacy", "graph_async", "fallback"]
    return dict(zip(names, [*first, *second]))


def test_compiled_graph_losses_are_bitwise_equal_to_actor_calls(runs) -> None:
    actors, graph = runs["actors"], runs["graph"]
    assert actors.returncode == 0, actors.explain()
    assert graph.returncode == 0, graph.explain()
    assert [r["step"] for r in graph.rows] == [0, 1, 2]
    for key in KEYS:
        assert [r[key] for r in graph.rows] == [r[key] for r in actors.rows], key
    assert any(r["loss"] != 0.0 for r in graph.rows), "a run whose losses are all zero would compare nothing"
    # Steps 1 and 2 (logprobs + train each) ran through the graph; step 0 was the warm-up.
    assert graph.summary["dispatch"] == {**graph.summary["dispatch"], "mode": "compiled_graph", "graph_calls": 4,
                                         "fallback": None}
    assert actors.summary["dispatch"] == {"mode": "actors"}
    assert graph.summary["keys_outstanding_at_exit"] == 0


def test_legacy_shard_refs_pass_through_the_graph_and_a_worker_error_is_the_steps_error(runs) -> None:
    legacy, actors = runs["graph_legacy"], runs["actors"]
    assert legacy.returncode == 1, legacy.explain()
    # Step 1 ran through the graph on ObjectRef inputs and matches the data-plane actor run.
    assert [r["step"] for r in legacy.rows] == [0, 1]
    for key in KEYS:
        assert [r[key] for r in legacy.rows] == [r[key] for r in actors.rows[:2]], key
    assert "step 2 train: InjectedFailure" in legacy.stderr, legacy.explain()
    assert "injected failure at step 2 on policy rank 0" in legacy.summary["error"]
    assert legacy.summary["dispatch"]["fallback"] is None  # a worker's error is not a graph failure
    assert legacy.summary["dispatch"]["graph_calls"] == 3  # step 1's two calls, step 2's logprobs; its train raised
    assert "dispatch: the compiled graph cannot serve" not in legacy.stderr


def test_async_trainer_runs_with_the_compiled_graph(runs) -> None:
    run = runs["graph_async"]
    assert run.returncode == 0, run.explain()
    assert [r["step"] for r in run.rows] == [0, 1, 2]
    assert run.summary["dispatch"]["graph_calls"] == 4
    assert run.summary["dispatch"]["fallback"] is None
    assert run.summary["keys_outstanding_at_exit"] == 0


def test_a_failed_compile_falls_back_to_actor_calls_with_one_warning(runs) -> None:
    run = runs["fallback"]
    assert run.returncode == 0, run.explain()
    assert [r["step"] for r in run.rows] == [0, 1]
    assert all(r["loss"] is not None for r in run.rows)
    assert run.stderr.count("dispatch: the compiled graph cannot serve") == 1, run.explain()
    d = run.summary["dispatch"]
    assert d["graph_calls"] == 0 and d["compile_s"] is None
    assert "debug.fail_dispatch_compile" in d["fallback"]

