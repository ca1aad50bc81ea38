"""The engine pool's bookkeeping (algorithms/engine_pool.py) and the step's requeue plan
(algorithms/sync_source.py), on real Ray actors: a killed actor is a loss, a live one is not, a drop
starts a replacement within the budget, the refit group is re-formed with it. The whole path with
real engines (SIGKILL mid-generate, bitwise steps) is tests/functional/test_grpo_sync.py."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest
import ray

from algorithms.config import load_config
from algorithms.engine_pool import EnginePool, Spawned
from algorithms.remote import StepError
from algorithms.rollouts import Job
from algorithms.sync_source import _positioned, _split_to, spread

REPO = Path(__file__).resolve().parents[2]


@ray.remote(num_cpus=0)
class _Member:
    """An actor with the one call the pool makes itself (``ready``)."""

    def ready(self) -> bool:
        return True


def _jobs(n: int) -> list[Job]:
    return [Job(i, i, None) for i in range(n)]


@pytest.mark.parametrize(("groups", "engines", "lost"), [(6, 3, [1]), (7, 3, [0, 2]), (5, 4, [3]), (2, 2, [0])])
def test_a_lost_part_is_split_over_the_survivors_and_the_parts_rebuild_the_step_in_order(
    groups: int, engines: int, lost: list[int]
) -> None:
    first = _positioned(spread(_jobs(groups), engines))
    back = [first[i] for i in lost]
    survivors = engines - len(lost)
    again = _split_to(back, survivors)
    # Split until every survivor has a part (or no part has two groups); never joined.
    assert len(again) == max(len(back), min(survivors, sum(len(ch) for _, ch in back)))
    for at, ch in again:  # each part is contiguous and knows where it starts
        assert [j.group_id for j in ch] == list(range(at, at + len(ch)))
    done = [p for i, p in enumerate(first) if i not in lost] + again
    order = [j.group_id for _, ch in sorted(done, key=lambda p: p[0]) for j in ch]
    assert order == list(range(groups))  # every group once, in the step's order


def test_a_dead_member_is_a_loss_a_live_one_is_not_and_the_group_is_reformed_with_the_replacement(
    ray_session: Any,
) -> None:
    # replacement_join=wait: the refit after the loss takes the replacement in, waiting for it.
    overrides = ["generation.max_replacements=1", "generation.replacement_join=wait"]
    cfg = load_config(REPO / "examples" / "configs" / "grpo_tiny.yaml", overrides)
    gens = [_Member.remote() for _ in range(3)]
    cols = [_Member.remote() for _ in range(3)]
    ray.get([a.ready.remote() for a in gens + cols])
    spawned: list[int] = []
    reformed: list[list[Any]] = []

    def spawn(i: int) -> Spawned:
        spawned.append(i)
        g, c = _Member.remote(), _Member.remote()
        return Spawned(g, c, [g.ready.remote(), c.ready.remote()], time.perf_counter())

    pool = EnginePool(cfg, gens, cols, spawn, lambda gs: reformed.append(list(gs)))
    assert pool.before_refit(5) == 0 and reformed == []  # nothing lost: the group stays
    ray.kill(gens[1], no_restart=True)
    ray.kill(cols[2], no_restart=True)
    assert [pool.is_lost(i) for i in range(3)] == [False, True, True]
    keep = gens[0]
    losses = pool.drop([1, 2], 5, [StepError("step 5 collect: x\nmore"), StepError("step 5 collect: y")])
    assert [(x.engine, x.step, x.error) for x in losses] == [(1, 5, "step 5 collect: x"), (2, 5, "step 5 collect: y")]
    assert pool.generators == [keep] and pool.ids == [0]
    assert spawned == [3]  # one replacement: the budget (max_replacements=1) allows no second
    assert pool.before_refit(5) == 1
    assert len(reformed) == 1 and reformed[0][0] == keep and len(reformed[0]) == 2 and pool.ids == [0, 3]
    assert pool.before_refit(5) == 0 and len(reformed) == 1  # re-formed once per loss
    s = pool.summary()
    assert s["generators_lost_total"] == 2 and s["generators_replaced_total"] == 1
    assert str(pool.no_engine_left(6, StepError("step 6 collect: z"))).startswith("step 6 collect: z (no generation")
    for a in [*pool.generators, *pool.collectors, *gens, *cols]:
        ray.kill(a, no_restart=True)


@ray.remote(num_cpus=0, max_concurrency=2)
class _Gated:
    """A replacement member whose start-up (``ready``) finishes only once ``release`` is called."""

    def __init__(self) -> None:
        self.go = threading.Event()

    def ready(self) -> bool:
        if not self.go.wait(120):
            raise TimeoutError("never released")
        return True

    def release(self) -> None:
        self.go.set()


def test_by_default_a_replacement_joins_once_it_is_up_and_one_past_its_start_up_bound_is_left_out(
    ray_session: Any,
) -> None:
    """``generation.replacement_join=ready``: the refit after a loss re-forms the group without
    the lost member and without waiting for the replacement still starting; the first refit after
    the replacement is up takes it in. A replacement not up within ``trainer.startup_timeout_s``
    of its start is left out at the next refit."""
    cfg = load_config(REPO / "examples" / "configs" / "grpo_tiny.yaml", ["generation.max_replacements=2"])
    gens = [_Member.remote() for _ in range(3)]
    cols = [_Member.remote() for _ in range(3)]
    ray.get([a.ready.remote() for a in gens + cols])
    started: list[tuple[Any, Any]] = []
    reformed: list[list[Any]] = []

    def spawn(i: int) -> Spawned:
        g, c = _Gated.remote(), _Gated.remote()
        started.append((g, c))
        # The second replacement started long ago, as far as the pool can tell: past its bound.
        at = time.perf_counter() - (0 if len(started) == 1 else 10 * cfg.trainer.startup_timeout_s)
        return Spawned(g, c, [g.ready.remote(), c.ready.remote()], at)

    g0, g1, g2 = gens  # the pool changes its lists in place
    members = [*gens, *cols]
    pool = EnginePool(cfg, gens, cols, spawn, lambda gs: reformed.append(list(gs)))
    ray.kill(g1, no_restart=True)
    pool.drop([1], 3, [StepError("step 3 collect: gone")])
    assert pool.before_refit(3) == 0, "the replacement is still starting: nothing joins"
    assert reformed == [[g0, g2]] and pool.left_out == 0
    assert pool.before_refit(4) == 0 and len(reformed) == 1, "nothing changed: the group stays"
    g, c = started[0]
    ray.get([g.release.remote(), c.release.remote()])
    ray.get(pool._waiting[0][1].pending)  # its start-up calls have returned
    assert pool.before_refit(5) == 1
    assert reformed[-1] == [g0, g2, g] and pool.ids == [0, 2, 3]
    ray.kill(g2, no_restart=True)
    pool.drop([1], 6, [StepError("step 6 collect: gone")])
    assert pool.before_refit(6) == 0 and pool.left_out == 1, "past its start-up bound: left out"
    assert reformed[-1] == [g0, g] and pool._waiting == []
    for a in [*members, *(x for pair in started for x in pair)]:
        ray.kill(a, no_restart=True)


@ray.remote(num_cpus=0, max_concurrency=2)
class _Beating:
    """An engine member whose heartbeat answers ``silent`` (seconds without progress), or
    (``wedged``) never within the test."""

    def __init__(self, silent: float | None, wedged: bool = False) -> None:
        self.silent, self.wedged = silent, wedged

    def ready(self) -> bool:
        return True

    def heartbeat(self) -> float | None:
        if self.wedged:
            time.sleep(60)
        return self.silent


def _dead(actor: Any, within_s: float = 30.0) -> bool:
    """Whether ``actor`` is (or within ``within_s`` becomes) dead: its calls then fail at once."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            ray.get(actor.ready.remote(), timeout=1.0)
        except ray.exceptions.RayActorError:
            return True
        except ray.exceptions.GetTimeoutError:
            pass
        time.sleep(0.05)
    return False


def test_the_heartbeat_kills_an_engine_that_stops_drawing_or_stops_answering_and_its_loss_says_why(
    ray_session: Any,
) -> None:
    cfg = load_config(
        REPO / "examples" / "configs" / "grpo_tiny.yaml",
        ["generation.heartbeat_timeout_s=1.0", "generation.max_replacements=0"],
    )
    # engine 0 draws (silent 0.2 s), 1 is idle (None), 2 drew nothing for 5 s, 3 never answers.
    gens = [_Beating.remote(0.2), _Beating.remote(None), _Beating.remote(5.0), _Beating.remote(None, wedged=True)]
    cols = [_Member.remote() for _ in gens]
    ray.get([a.ready.remote() for a in gens + cols])
    pool = EnginePool(cfg, gens, cols, lambda i: pytest.fail("no replacement is started"), lambda gs: None)
    pool.start_heartbeat()
    try:
        assert _dead(gens[2]) and _dead(cols[2]) and _dead(gens[3]) and _dead(cols[3])
        assert not any(_dead(a, within_s=1.5) for a in (*gens[:2], *cols[:2]))  # a watch period and more
    finally:
        pool.close()
    assert [pool.is_lost(i) for i in range(4)] == [False, False, True, True]
    losses = pool.drop([2, 3], 7, [StepError("step 7 collect: the collector died"), StepError("step 7: y")])
    assert losses[0].error.startswith("hung, killed by the trainer: drew nothing for 5.0s inside a generate call")
    assert losses[1].error.startswith(
        "hung, killed by the trainer: no heartbeat within generation.heartbeat_timeout_s=1s"
    )
    assert losses[0].error.endswith("(step 7 collect: the collector died)")
    for a in [*gens, *cols]:
        ray.kill(a, no_restart=True)


def test_a_generator_reports_its_silence_only_inside_a_generate_call_and_its_watch_kills_it(ray_session: Any) -> None:
    """The real generator actor as the trainer creates it: its heartbeat answers on its own
    thread while a generate call holds the actor, measures the time without a token, and is
    ``None`` outside a call; a call that draws nothing past the timeout gets the engine killed."""
    from algorithms.launch import engine_actors

    cfg = load_config(
        REPO / "examples" / "configs" / "grpo_tiny.yaml",
        ["generation.heartbeat_timeout_s=1.5", "generation.max_replacements=0", "debug.generate_delay_s=20"],
    )
    generator, collector = engine_actors(cfg, 0, owned_cluster=False)
    ray.get([generator.ready.remote(), collector.ready.remote()], timeout=240)
    assert ray.get(generator.heartbeat.remote(), timeout=30) is None  # no call in flight
    call = generator.generate.remote([[1, 2, 3]], 2, 0)  # sleeps 20 s before drawing: silent
    deadline = time.monotonic() + 60
    silent = None
    while time.monotonic() < deadline and (silent is None or silent < 1.0):
        silent = ray.get(generator.heartbeat.remote(), timeout=30)  # answered while the call runs
    assert silent is not None and silent >= 1.0, silent
    pool = EnginePool(cfg, [generator], [collector], lambda i: pytest.fail("no replacement"), lambda gs: None)
    pool.start_heartbeat()
    try:
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(call, timeout=60)  # killed long before its 20 s were up
        assert _dead(collector)
    finally:
        pool.close()
    (loss,) = pool.drop([0], 3, [StepError("step 3 collect: generator died")])
    assert "drew nothing for" in loss.error and "inside a generate call" in loss.error, loss.error
