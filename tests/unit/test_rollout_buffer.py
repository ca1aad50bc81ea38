"""Async GRPO's driver side: prompt ledger, admission (lag layer 1), group assembly, and the
buffer's consumption check (lag layer 2) over real claims on the in-memory store.

The buffer talks to its collectors through three methods (submit, poll, take); here a small
in-process pool stands in for the collector actors so a test can decide exactly which weight
version each group carries (the real actors are exercised by tests/functional/test_grpo_async.py).
"""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch
from tensordict import TensorDict

from algorithms.config import TrainerConfig
from algorithms.remote import StepError
from algorithms.rollout_buffer import DeterministicBuffer, PromptLedger, RolloutBuffer, admissible, make_buffer
from algorithms.rollouts import (
    ROLLOUT_FIELDS,
    ROLLOUTS,
    TRAINER_TASK,
    GroupAssembler,
    Job,
    keys_outside_groups,
    rollout_keys,
)
from algorithms.tasks import PromptIterator, PromptRecord
from algorithms.transports.data_plane import DataPlaneTransport
from nemo_dataplane.adapters.memory import InMemoryClient
from nemo_dataplane.codec import jagged_from_rows

RECORDS = [PromptRecord(prompt=str(i % 10), answer=str((i + 3) % 10), uid=i) for i in range(50)]


def _ledger(seed: int = 0) -> PromptLedger:
    return PromptLedger(PromptIterator(RECORDS, 1, seed))


# ------------------------------------------------------------------------------ ledger
def test_ledger_hands_out_the_stream_in_order_and_retries_first() -> None:
    led = _ledger()
    stream = PromptIterator(RECORDS, 1, 0)
    expected = [stream.next_batch()[0] for _ in range(6)]
    jobs = led.admit(4)
    assert [j.handout for j in jobs] == [0, 1, 2, 3] and [j.group_id for j in jobs] == [0, 1, 2, 3]
    assert [j.record for j in jobs] == expected[:4]
    led.requeue(2)  # e.g. too old when claimed
    again = led.admit(2)
    assert [(j.handout, j.group_id) for j in again] == [(2, 4), (4, 5)]  # retry first, then the stream
    assert again[0].record == expected[2] and again[1].record == expected[4]
    assert sorted(led.inflight) == [0, 1, 3, 4, 5]


def test_ledger_never_skips_or_repeats_a_handout_across_checkpoint_and_resume() -> None:
    """Random admit/train/requeue sequences with a checkpoint taken and resumed at random points:
    trained handouts are unique and, with what is still pending, cover a prefix of the stream."""
    rng = random.Random(7)
    for trial in range(30):
        led = _ledger(trial)
        trained: list[int] = []
        snapshot: tuple[dict[str, Any], list[int]] | None = None
        for _ in range(rng.randint(5, 40)):
            op = rng.random()
            if op < 0.4:
                led.admit(rng.randint(0, 5))
            elif op < 0.7 and led.inflight:
                gids = rng.sample(sorted(led.inflight), rng.randint(1, len(led.inflight)))
                trained += [j.handout for j in led.trained(gids)]
            elif op < 0.85 and led.inflight:
                led.requeue(rng.choice(sorted(led.inflight)))
            elif op < 0.93:
                snapshot = (led.state_dict(), list(trained))
            elif snapshot is not None:  # "crash" and resume from the snapshot
                state, done = snapshot
                led = _ledger(trial)
                led.load_state_dict(state)
                trained = list(done)
        assert len(trained) == len(set(trained)), "a prompt was trained twice"
        pending = [h for h, _ in led.state_dict()["pending"]]
        assert sorted(trained + pending) == list(range(led.next_handout)), "a prompt was skipped"


# ------------------------------------------------------------------------------ admission
@pytest.mark.parametrize("staleness", [0, 1, 2, 3])
def test_admission_bounds_the_staleness_of_every_trained_group(staleness: int) -> None:
    """Simulate a generator that draws admitted groups at a random pace with the latest weights and
    a trainer that trains G groups per step, oldest first: with admission, no trained group is
    older than the bound; admitting freely would break it (so the rule is what bounds it)."""
    G = 4
    for admit in (True, False):
        rng = random.Random(staleness)
        version, queue, worst = 0, [], 0
        generated: list[tuple[int, int]] = []  # (group, version it was drawn with), oldest first
        next_gid = 0
        for _ in range(600):
            k = admissible(len(queue) + len(generated), G, staleness) if admit else 6
            queue += list(range(next_gid, next_gid + k))
            next_gid += k
            for _ in range(rng.randint(0, 6)):  # the generator (often faster than the trainer)
                if queue:
                    generated.append((queue.pop(0), version))
            if len(generated) >= G and rng.random() < 0.3:  # the trainer trains step `version`
                batch, generated = generated[:G], generated[G:]
                worst = max(worst, *(version - v for _, v in batch))
                version += 1
        assert version > 50
        if admit:
            assert worst <= staleness
        else:
            assert worst > staleness


# ------------------------------------------------------------------------------ assembly
def test_group_assembler_waits_for_whole_groups_and_catches_a_row_seen_twice() -> None:
    asm = GroupAssembler(3)
    asm.add(5, 2, "c")
    asm.add(5, 0, "a")
    asm.add(4, 0, "x")
    assert asm.pop_complete() == []
    asm.add(5, 1, "b")
    assert asm.pop_complete() == [(5, ["a", "b", "c"])]
    assert len(asm) == 1
    asm.add(4, 1, "y")
    asm.add(4, 2, "z")
    with pytest.raises(StepError, match="delivered twice"):
        asm.add(4, 0, "x")


# ------------------------------------------------------------------------------ the buffer
N = 2


def _cfg(**async_: Any) -> TrainerConfig:
    return TrainerConfig.from_dict(
        {
            "policy": {"model": {"arch": "llama", "hf_config": {}}},
            "generation": {"n": N},
            "grpo": {"prompts_per_step": 2},
            "trainer": {"dp_size": 1, "step_timeout_s": 5},
            "async": {"claim_poll_s": 0.05, **async_},
        }
    )


def _put_group(client: InMemoryClient, job: Job, version: int, reward: float = 0.5) -> list[str]:
    keys = rollout_keys(version, [job.group_id], N)
    ids = [torch.tensor([1, 2, 3 + i]) for i in range(N)]
    td = TensorDict(
        {
            "input_ids": jagged_from_rows(ids),
            "prompt_len": torch.full((N,), 2),
            "seq_len": torch.full((N,), 3),
            "group_id": torch.full((N,), job.group_id),
            "weight_version": torch.full((N,), version),
            "rewards": torch.full((N,), reward),
            "gen_logprobs": jagged_from_rows([torch.zeros(2)] * N),
            "token_versions": jagged_from_rows([torch.tensor([-1, version])] * N),
        },
        batch_size=[N],
    )
    tags = [
        {
            "seq_len": 3,
            "prompt_len": 2,
            "group": job.group_id,
            "weight_version": version,
            "reward": reward,
            "handout": job.handout,
        }
        for _ in range(N)
    ]
    client.kv_batch_put(keys, ROLLOUTS, td, tags=tags)
    return keys


def _buffer(cfg: TrainerConfig, pool: Any, client: InMemoryClient, ledger: PromptLedger) -> RolloutBuffer:
    """The buffer ``async.mode`` picks over the data-plane transport, its store the given in-memory client."""
    transport = DataPlaneTransport(cfg)
    transport.client = client
    return make_buffer(cfg, pool, transport, ledger)


class _Pool:
    """Stands in for the collector actors: records queued jobs; failures are reported on poll."""

    def __init__(self) -> None:
        self.jobs: list[Job] = []
        self.failed: list[int] = []
        self.error: str | None = None

    def submit(self, pieces: list[list[Job]]) -> None:
        self.jobs += [j for p in pieces for j in p]

    def poll(self, step: int, live: set[int]) -> tuple[list[dict[str, Any]], list[int]]:
        failed, self.failed = self.failed, []
        return [{"failed": failed, "error": self.error, "idle_s": 0.0, "generate_s": 0.0, "groups_written": 0}], []

    def take(self, max_groups: int, timeout_s: float) -> list[dict[str, Any]]:
        return []


def test_a_group_older_than_the_bound_is_cleared_counted_requeued_and_never_trained() -> None:
    client = InMemoryClient()
    pool = _Pool()
    led = _ledger()
    buf = _buffer(_cfg(max_staleness=1), pool, client, led)
    assert buf.top_up() == 4  # (max_staleness + 1) * G
    j0, j1, j2, j3 = pool.jobs
    old_keys = _put_group(client, j0, version=0)  # trained at step 3 it would be 3 versions old
    for j in (j1, j2, j3):
        _put_group(client, j, version=2)
    batch = buf.next_batch(step=3)
    assert buf.stats.dropped_stale == 1
    assert j0.group_id not in batch.group_ids and sorted(batch.group_ids) == [j1.group_id, j2.group_id]
    assert batch.versions == [2, 2] and buf.stats.staleness == [1, 1]
    assert not set(old_keys) & set(client.kv_list(ROLLOUTS).keys), "the stale group's keys left the store"
    # Its prompt went back first in line and was handed out again under a new group id.
    retry = [j for j in pool.jobs[4:] if j.handout == j0.handout]
    assert len(retry) == 1 and retry[0].group_id != j0.group_id and retry[0].group_id in led.inflight
    assert j0.group_id not in led.inflight
    assert batch.rewards.shape == (2 * N,) and len(batch.handle) == 2 * N


def test_failed_writes_are_requeued_and_a_stopped_collector_fails_the_step_with_its_error() -> None:
    client = InMemoryClient()
    pool = _Pool()
    led = _ledger()
    buf = _buffer(_cfg(max_staleness=0), pool, client, led)
    buf.top_up()
    j0, j1 = pool.jobs
    pool.failed = [j0.group_id]  # its write was rolled back by the collector
    _put_group(client, j1, version=0)
    with pytest.raises(StepError, match="waited 5.0s for 2 rollout groups, got 1"):
        buf.next_batch(step=0)
    assert buf.stats.requeued_failed == 1
    assert [j.handout for j in pool.jobs[2:]] == [j0.handout]  # regenerated, not lost
    pool.error = "collector 0: RuntimeError: generator died"
    with pytest.raises(StepError, match="generator died"):
        buf.next_batch(step=0)


def test_under_tight_backpressure_a_claim_never_waits_for_rows_that_cannot_be_written() -> None:
    """``max_inflight_groups=1``: a writer that (like the collector) puts the next group only once
    the last one is claimed. A claim asking for the whole batch would wait out ``claim_poll_s``
    on every round; asking for what can be in flight, the batch comes as soon as it is written."""
    import threading
    import time

    client = InMemoryClient()
    pool = _Pool()
    poll_s = 4.0  # below the 5 s step timeout: the unfixed claim still returns, just late
    cfg = _cfg(max_staleness=0, max_inflight_groups=1, groups_per_generation=1, claim_poll_s=poll_s)
    buf = _buffer(cfg, pool, client, _ledger())
    buf.top_up()
    jobs = list(pool.jobs)

    def write_under_backpressure() -> None:
        for i, job in enumerate(jobs):
            while client.kv_claim_status(ROLLOUTS, TRAINER_TASK, list(ROLLOUT_FIELDS)).claimed < i * N:
                time.sleep(0.01)
            _put_group(client, job, version=0)

    writer = threading.Thread(target=write_under_backpressure, daemon=True)
    t0 = time.monotonic()
    writer.start()
    batch = buf.next_batch(step=0)
    elapsed = time.monotonic() - t0
    writer.join(5)
    assert sorted(batch.group_ids) == sorted(j.group_id for j in jobs)
    assert elapsed < poll_s / 2, f"a claim waited out its {poll_s}s poll ({elapsed:.1f}s)"


def test_a_resumed_ledger_regenerates_in_flight_prompts_under_their_group_ids() -> None:
    """Same group id -> same sampling seed: a resume draws what the uninterrupted run drew."""
    led = _ledger()
    first = led.admit(4)
    led.trained([first[0].group_id, first[1].group_id])
    led.requeue(first[2].group_id)  # a failed write: retried under a new id, in either run
    state = led.state_dict()
    uninterrupted = [(j.handout, j.group_id) for j in led.admit(2)]  # the retry, then a new prompt
    resumed = _ledger()
    resumed.load_state_dict(state)
    again = [(j.handout, j.group_id) for j in resumed.admit(3)]  # the in-flight one is regenerated too
    assert again == sorted([*uninterrupted, (first[3].handout, first[3].group_id)])
    assert len({j.group_id for j in resumed.inflight.values()}) == len(resumed.inflight)


@pytest.mark.parametrize("backend", ["memory", "transfer_queue"])
def test_the_per_step_count_of_outstanding_keys_agrees_with_the_whole_store_listing(
    backend: str, request: pytest.FixtureRequest
) -> None:
    """Every step counts the rollouts' rows from the store's claim status (no tags move); the
    audit lists every partition. Both see the same keys, and a key elsewhere shows only in the audit."""
    client = InMemoryClient() if backend == "memory" else request.getfixturevalue("tq_client")
    transport = DataPlaneTransport(_cfg())
    transport.client = client
    led = _ledger()
    jobs = led.admit(3)
    keys = [k for j in jobs for k in _put_group(client, j, version=0)]
    try:
        assert transport.outstanding() == transport.outstanding(audit=True) == 3 * N
        client.kv_clear(keys[:N], ROLLOUTS)
        assert transport.outstanding() == transport.outstanding(audit=True) == 2 * N
        client.kv_batch_put(["stray"], "elsewhere", {"x": torch.zeros(1)})
        assert transport.outstanding() == 2 * N and transport.outstanding(audit=True) == 2 * N + 1
    finally:
        client.kv_clear(None, ROLLOUTS)
        client.kv_clear(None, "elsewhere")


def test_keys_outside_groups_in_flight_are_the_leak_at_exit() -> None:
    in_flight = rollout_keys(3, [7], 2)  # rows of group 7, still in flight
    stray = rollout_keys(2, [5], 2)  # rows of group 5, trained or dropped: nothing accounts for them
    stored = {ROLLOUTS: [*in_flight, *stray, "not-a-rollout-key"], "step4": ["v0/g7/s0"]}
    # A key of another partition is a leak even if it looks like a row of a group in flight.
    assert keys_outside_groups(stored, {7}) == [*stray, "not-a-rollout-key", "v0/g7/s0"]
    assert keys_outside_groups(stored, set()) == [*in_flight, *stray, "not-a-rollout-key", "v0/g7/s0"]
    assert keys_outside_groups({}, {7}) == []


# ------------------------------------------------------------------------------ deterministic mode
def test_deterministic_schedule_pins_versions_orders_groups_and_gates_the_refit() -> None:
    client = InMemoryClient()
    pool = _Pool()
    led = _ledger()
    cfg = _cfg(max_staleness=1, mode="deterministic", groups_per_generation=1)
    buf = _buffer(cfg, pool, client, led)
    assert isinstance(buf, DeterministicBuffer)
    assert buf.top_up() == 4  # steps 0 and 1, G = 2 each
    assert [(j.group_id, j.version, j.piece) for j in pool.jobs] == [(0, 0, 0), (1, 0, 1), (2, 0, 2), (3, 0, 3)]
    j0, j1, j2, j3 = pool.jobs
    for j in (j1, j0):  # written out of order
        _put_group(client, j, version=0)
    batch = buf.next_batch(step=0)
    assert batch.group_ids == [0, 1] and buf.stats.staleness == [0, 0]
    led.trained(batch.group_ids)
    assert len(pool.jobs) == 4, "step 2 (version 1) is admitted once step 1 is trained"
    # The refit to version 1 waits for step 1's groups (drawn by version 0).
    with pytest.raises(StepError, match=r"refit of version 1: waited 5.0s for groups \[2, 3\]"):
        buf.before_refit(1)
    pool.failed = [3]  # its write was rolled back: the same group again, same id, version, piece
    _put_group(client, j2, version=0)
    with pytest.raises(StepError, match=r"for groups \[3\]"):
        buf.before_refit(1)
    assert [(j.group_id, j.version, j.piece) for j in pool.jobs[4:]] == [(3, 0, 3)]
    _put_group(client, j3, version=0)
    assert buf.before_refit(1) >= 0
    state = buf.state_dict()  # a checkpoint after step 0: step 1's groups are kept with their rows
    assert state["steps"] == {1: [2, 3]} and [g["group_id"] for g in state["held"]] == [2, 3]
    ledger_state = led.state_dict()

    # Resume at step 1 on a fresh store: held groups come back (not generated again, not delivered twice).
    client2, pool2, led2 = InMemoryClient(), _Pool(), _ledger()
    led2.load_state_dict(ledger_state)
    buf2 = _buffer(cfg, pool2, client2, led2)
    buf2.load_state_dict(state, start=1)
    assert pool2.jobs == []
    assert client2.kv_claim_status(ROLLOUTS, TRAINER_TASK, ["input_ids"]).claimable == 0, "restored rows re-delivered"
    again = buf2.next_batch(step=1)
    assert again.group_ids == [2, 3] and again.rewards.tolist() == batch.rewards.tolist()
    assert [(j.group_id, j.version) for j in pool2.jobs] == [(4, 1), (5, 1)]
    _put_group(client2, pool2.jobs[0], version=0)  # drawn by the wrong version: refused
    with pytest.raises(StepError, match="group 4 arrived drawn by weight version 0, the schedule says 1"):
        buf2.before_refit(2)


def test_deterministic_mode_refuses_partial_rollouts_and_vllm() -> None:
    from algorithms.config import ConfigError
    from algorithms.engines.generation import check_generation_config

    with pytest.raises(ConfigError, match="partial_rollout"):
        _cfg(mode="deterministic", partial_rollout=True)
    cfg = TrainerConfig.from_dict(
        {
            "policy": {"model": {"arch": "llama", "hf_config": {}}},
            "generation": {"n": N, "backend": "vllm"},
            "async": {"mode": "deterministic"},
        }
    )
    with pytest.raises(ConfigError, match="async.mode=deterministic needs generation.backend=hf"):
        check_generation_config(cfg)
