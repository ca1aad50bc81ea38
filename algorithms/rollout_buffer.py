"""Async GRPO's rollout side on the driver: the lag bound in two layers, claims, nothing lost.

* :class:`PromptLedger`: every prompt handed out and not yet trained, by group id; what a
  checkpoint saves so a resume trains each handed-out prompt exactly once.
* :func:`admissible`: admission (layer 1). Groups are trained oldest first, ``G`` per step, and a
  group admitted while the generator holds version ``v`` is generated with ``>= v``; so keeping at
  most ``(max_staleness + 1) * G`` groups admitted-and-untrained bounds every group's staleness
  by ``max_staleness`` (AReaL's rule) and little is generated only to be thrown away.
* :class:`RolloutBuffer`: whole groups from the transport's source (the store's claims, or
  the collectors' outboxes through Ray), the consumption check (layer 2: a group older than
  ``step - max_staleness`` is cleared, counted and its prompt requeued; never trained on), and
  the training batch of ``G`` whole groups.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Iterable, Mapping, Sequence, Set
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from algorithms.config import TrainerConfig
from algorithms.remote import StepError
from algorithms.rollouts import ClaimedGroup, Job, RolloutBatch
from algorithms.transports import RolloutSource, Transport


class PromptLedger:
    """Prompts handed out and not yet trained. ``stream`` yields one record per ``next()``.

    Invariant (what resume relies on): every handout index below ``next_handout`` is either
    trained, in flight (``inflight``) or waiting to be retried (``retry``); never two of these.
    """

    def __init__(self, stream: Any, start_group_id: int = 0) -> None:
        self.stream = stream
        self.next_group_id = start_group_id
        self.next_handout = 0
        self.inflight: dict[int, Job] = {}
        self.retry: collections.deque[tuple[int, Any]] = collections.deque()
        self.trained_handouts = 0
        # handout -> group id it had in flight when the checkpoint was taken: a resumed run
        # regenerates it under the same id (same sampling seed), as the uninterrupted run did.
        self._resumed_ids: dict[int, int] = {}

    def admit(self, k: int) -> list[Job]:
        """Hand out ``k`` prompts: retries first (oldest first), then new ones from the stream."""
        jobs = []
        for _ in range(max(0, k)):
            if self.retry:
                handout, record = self.retry.popleft()
            else:
                handout, record = self.next_handout, self.stream.next_batch()[0]
                self.next_handout += 1
            gid = self._resumed_ids.pop(handout, None)
            if gid is None:
                gid = self.next_group_id
                self.next_group_id += 1
            job = Job(gid, handout, record)
            self.inflight[job.group_id] = job
            jobs.append(job)
        return jobs

    def trained(self, group_ids: Iterable[int]) -> list[Job]:
        jobs = [self.inflight.pop(g) for g in group_ids]
        self.trained_handouts += len(jobs)
        return jobs

    def requeue(self, group_id: int) -> Job:
        """The group will not be trained (too old, failed write): its prompt goes back, first in line."""
        job = self.inflight.pop(group_id)
        self.retry.append((job.handout, job.record))
        return job

    def state_dict(self) -> dict[str, Any]:
        """In-flight and retry prompts in handout order (they are regenerated first on resume,
        in-flight ones under their group ids), the stream position and the id counters."""
        pending = sorted([(j.handout, j.record) for j in self.inflight.values()] + list(self.retry), key=lambda t: t[0])
        return {
            "stream": self.stream.state_dict(),
            "next_group_id": self.next_group_id,
            "next_handout": self.next_handout,
            "pending": pending,
            "trained_handouts": self.trained_handouts,
            "inflight_group_ids": {**self._resumed_ids, **{j.handout: j.group_id for j in self.inflight.values()}},
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.stream.load_state_dict(state["stream"])
        self.next_group_id = int(state["next_group_id"])
        self.next_handout = int(state["next_handout"])
        self.trained_handouts = int(state.get("trained_handouts", 0))
        self.inflight = {}
        self.retry = collections.deque((int(h), r) for h, r in state["pending"])
        self._resumed_ids = {int(h): int(g) for h, g in state.get("inflight_group_ids", {}).items()}


def admissible(outstanding: int, groups_per_step: int, max_staleness: int) -> int:
    """How many more groups may be admitted with ``outstanding`` admitted and not yet trained."""
    return max(0, (max_staleness + 1) * groups_per_step - outstanding)


@dataclass
class BufferStats:
    """Per-step counters (reset by :meth:`RolloutBuffer.next_batch`)."""

    dropped_stale: int = 0
    requeued_failed: int = 0
    wait_s: float = 0.0
    staleness: list[int] = field(default_factory=list)


# What the collectors count (cumulative; summed over collectors at every poll).
COLLECTOR_COUNTERS = (
    "idle_s",
    "generate_s",
    "generator_busy_s",
    "partial_samples",
    "groups_written",
    "store_full_waits",
    "reward_timeouts",
)


class RolloutBuffer:
    """The async trainer's source of batches.

    Args:
        cfg: the trainer config; ``pool``: the collectors (:class:`CollectorPool` or an object
            with the same three methods); ``transport``: the run's transport, whose
            :meth:`~algorithms.transports.Transport.source` delivers whole groups and whose
            :meth:`~algorithms.transports.Transport.concat` makes a batch of them.
        ledger: the prompt ledger (restored on resume before the first :meth:`top_up`).
    """

    def __init__(self, cfg: TrainerConfig, pool: Any, transport: Transport, ledger: PromptLedger) -> None:
        self.cfg = cfg
        self.pool = pool
        self.transport = transport
        self.source: RolloutSource = transport.source(pool)
        self.ledger = ledger
        self.n = cfg.generation.n
        self.G = cfg.grpo.prompts_per_step
        self.S = cfg.async_.max_staleness
        self.ready: collections.deque[ClaimedGroup] = collections.deque()
        self.taking: set[int] = set()  # popped from ready for the batch being assembled
        self.training_ids: set[int] = set()  # the last batch's groups, until the next is asked for
        self.step = 0  # the step being assembled or trained
        self.stats = BufferStats()
        self.collector_stats: dict[str, float] = {}

    # ------------------------------------------------------------------ admission
    def top_up(self) -> int:
        """Admit what the lag bound allows and queue it on the collectors; returns how many."""
        jobs = self.ledger.admit(admissible(len(self.ledger.inflight), self.G, self.S))
        if not jobs:
            return 0
        chunk = self.cfg.async_.generation_groups(self.G)
        self.pool.submit([jobs[i : i + chunk] for i in range(0, len(jobs), chunk)])
        return len(jobs)

    # ------------------------------------------------------------------ claims
    def _arrived(self) -> set[int]:
        """Groups handed out that reached the trainer (waiting, being taken, being trained)."""
        return {g.group_id for g in self.ready} | self.taking | self.training_ids

    def _poll_collectors(self) -> None:
        """Requeue groups whose write failed (rolled back) and those a lost collector held
        (:class:`~algorithms.engine_pool.CollectorPool`); raise if a collector stopped."""
        live = set(self.ledger.inflight) - self._arrived()
        polls, lost = self.pool.poll(self.step, live)
        if lost:
            self.source.forget(lost)  # rows it wrote of them, whole or not, leave the store
            self._failed(lost, lost=True)
        for p in polls:
            if p["error"]:
                raise StepError(f"rollout collection stopped: {p['error']}")
            self._failed([int(g) for g in p["failed"]])
            self.transport.ops.extend(p.get("ops", ()))
        self.collector_stats = {k: sum(float(p.get(k, 0)) for p in polls) for k in COLLECTOR_COUNTERS}

    def _failed(self, group_ids: Sequence[int], lost: bool = False) -> None:
        """Groups whose write failed (their rows were cleared by the collector's rollback), or
        whose collector was lost (``lost``: counted by the engine pool): the prompts go back in
        line under new group ids."""
        for gid in group_ids:
            self.source.discard(gid)
            if gid in self.ledger.inflight:
                self.ledger.requeue(gid)
                self.stats.requeued_failed += 0 if lost else 1

    def _drop(self, group: ClaimedGroup) -> None:
        self.source.drop(group)
        self.ledger.requeue(group.group_id)
        self.stats.dropped_stale += 1

    def next_batch(self, step: int) -> RolloutBatch:
        """``G`` whole groups no older than ``step - max_staleness`` (oldest first).

        Raises:
            StepError: ``trainer.step_timeout_s`` passed without a full batch, or a collector failed.
        """
        self.stats = BufferStats()
        self.step, self.training_ids = step, set()
        t0 = time.perf_counter()
        deadline = time.monotonic() + self.cfg.trainer.step_timeout_s
        taken: list[ClaimedGroup] = []
        while True:
            while self.ready and len(taken) < self.G:
                g = self.ready.popleft()
                if g.version < step - self.S:
                    self._drop(g)  # layer 2: never trained on; the prompt is generated again
                else:
                    taken.append(g)
                    self.taking.add(g.group_id)
            if len(taken) == self.G:
                break
            self._poll_collectors()
            self.top_up()  # dropped or failed groups freed admission slots
            left = deadline - time.monotonic()
            if left <= 0:
                for g in reversed(taken):
                    self.ready.appendleft(g)
                self.taking.clear()
                raise StepError(
                    f"step {step}: waited {self.cfg.trainer.step_timeout_s}s for {self.G} rollout groups, got "
                    f"{len(taken)} (+{self.source.partial_rows()} rows of incomplete groups); collectors: "
                    f"{self.collector_stats}"
                )
            self.ready.extend(self.source.claim(self.G - len(self.ready), min(self.cfg.async_.claim_poll_s, left)))
        self._poll_collectors()
        self.stats.wait_s = time.perf_counter() - t0
        self.stats.staleness = [step - g.version for g in taken]
        return self._batch(taken)

    def _batch(self, groups: Sequence[ClaimedGroup]) -> RolloutBatch:
        self.training_ids = {g.group_id for g in groups}
        self.taking.clear()
        return RolloutBatch(
            handle=self.transport.concat([g.rows for g in groups]),
            rewards=torch.tensor([r for g in groups for r in g.rewards], dtype=torch.float32),
            group_size=self.n,
            group_ids=[g.group_id for g in groups],
            versions=[g.version for g in groups],
            response_len=sum(g.response_len for g in groups) / len(groups),
            prompts=[self._prompt(g.group_id) for g in groups],
        )

    def before_refit(self, version: int) -> float:
        """Called before the trainer installs weight ``version``; returns seconds waited (free
        mode: none, a generator takes whatever version is installed)."""
        return 0.0

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps of the buffer beyond the ledger (free mode: nothing; the
        in-flight prompts are generated again)."""
        return {}

    def load_state_dict(self, state: Mapping[str, Any], start: int) -> None:
        """Restore :meth:`state_dict` for a resume at step ``start`` (transport up, ledger restored)."""

    def _prompt(self, group_id: int) -> str:
        job = self.ledger.inflight.get(group_id)
        return str(getattr(job.record, "prompt", "")) if job is not None else ""


class DeterministicBuffer(RolloutBuffer):
    """``async.mode=deterministic``: the same batches whatever the timing.

    Step ``s``'s ``G`` groups are admitted together (``s`` at most ``max_staleness`` ahead of
    the step being trained), each marked with the weight version that must draw it,
    ``max(0, s - max_staleness)``, and cut into fixed pieces (one generate call each, by group
    order). A generator waits for that version and never serves an older one; the trainer
    installs version ``v + 1`` only once every group drawn by ``v`` has arrived
    (:meth:`before_refit`), and takes a step's groups in group-id order. Nothing is dropped as
    stale (every group is exactly as old as the schedule says); a failed write regenerates the
    same groups under the same ids and seeds. A checkpoint holds the groups already generated for
    later steps (:meth:`state_dict`): their weight versions are gone after a resume.
    """

    def __init__(self, cfg: TrainerConfig, pool: Any, transport: Transport, ledger: PromptLedger) -> None:
        super().__init__(cfg, pool, transport, ledger)
        self.piece = cfg.async_.generation_groups(self.G)
        self.held: dict[int, ClaimedGroup] = {}  # arrived, not yet trained
        self.steps: dict[int, list[int]] = {}  # admitted, untrained step -> its group ids in order
        self.jobs: dict[int, Job] = {}
        self.next_step = 0  # the next step to admit
        self.training = 0  # the step being trained (admission runs max_staleness ahead of it)

    def version_of(self, step: int) -> int:
        return max(0, step - self.S)

    # ------------------------------------------------------------------ admission
    def top_up(self) -> int:
        return self._admit_through(self.training + self.S)

    def _admit_through(self, last: int) -> int:
        """Admit every step up to ``last`` not admitted yet, in step order; returns the groups."""
        admitted = 0
        while self.next_step <= last:
            self._admit(self.next_step, self.ledger.admit(self.G))
            admitted += self.G
        return admitted

    def _admit(self, step: int, jobs: Sequence[Job], skip: Set[int] = frozenset()) -> None:
        v = self.version_of(step)
        pieces = [
            [replace(j, version=v, piece=chunk[0].group_id) for j in chunk]
            for chunk in (jobs[i : i + self.piece] for i in range(0, len(jobs), self.piece))
        ]
        self.steps[step] = [j.group_id for j in jobs]
        for piece in pieces:
            for j in piece:
                self.jobs[j.group_id] = j
        self.next_step = step + 1
        todo = [p for p in pieces if not all(j.group_id in skip for j in p)]
        if todo:
            self.pool.submit(todo)

    def _arrived(self) -> set[int]:
        return super()._arrived() | set(self.held)

    def _failed(self, group_ids: Sequence[int], lost: bool = False) -> None:
        """The same groups again (same ids, seeds and pieces): their version is still installed,
        since the refit past it waits for them."""
        again = [g for g in group_ids if g in self.jobs and g not in self.held]
        for gid in again:
            self.source.discard(gid)
        by_piece: dict[int | None, list[Job]] = {}
        for gid in sorted(again):
            by_piece.setdefault(self.jobs[gid].piece, []).append(self.jobs[gid])
        if by_piece:
            self.stats.requeued_failed += 0 if lost else len(again)
            self.pool.submit(list(by_piece.values()))

    # ------------------------------------------------------------------ arrivals
    def _await(self, group_ids: Sequence[int], deadline: float, what: str) -> None:
        """Claim until every one of ``group_ids`` has arrived (bounded by ``deadline``)."""
        while True:
            missing = [g for g in group_ids if g not in self.held]
            if not missing:
                return
            self._poll_collectors()
            left = deadline - time.monotonic()
            if left <= 0:
                raise StepError(
                    f"{what}: waited {self.cfg.trainer.step_timeout_s}s for groups {missing[:8]} "
                    f"(+{self.source.partial_rows()} rows of incomplete groups); collectors: {self.collector_stats}"
                )
            for g in self.source.claim(len(missing), min(self.cfg.async_.claim_poll_s, left)):
                job = self.jobs.get(g.group_id)
                if job is None or g.version != job.version:
                    raise StepError(
                        f"{what}: group {g.group_id} arrived drawn by weight version {g.version}, the schedule "
                        f"says {None if job is None else job.version} (async.mode=deterministic)"
                    )
                self.held[g.group_id] = g

    def next_batch(self, step: int) -> RolloutBatch:
        """Step ``step``'s groups, in group-id order, once all have arrived."""
        self.stats = BufferStats()
        t0 = time.perf_counter()
        self.training = self.step = step
        self.training_ids = set()
        self.top_up()
        gids = sorted(self.steps[step])
        self._await(gids, time.monotonic() + self.cfg.trainer.step_timeout_s, f"step {step}")
        taken = [self.held.pop(g) for g in gids]
        self.training_ids = set(gids)  # arrived: never handed back, whatever happens to their writer
        del self.steps[step]
        for g in gids:
            self.jobs.pop(g)
        self._poll_collectors()
        self.stats.wait_s = time.perf_counter() - t0
        self.stats.staleness = [step - g.version for g in taken]
        return self._batch(taken)

    def before_refit(self, version: int) -> float:
        """Wait until every group weight version ``version - 1`` draws has arrived, so the refit to
        ``version`` finds no generator still owing one; returns the seconds waited."""
        t0 = time.perf_counter()
        last = version - 1 + self.S  # the last step drawn by version - 1
        self._admit_through(last)
        owed = [g for s, ids in self.steps.items() if s <= last for g in ids]
        self._await(owed, time.monotonic() + self.cfg.trainer.step_timeout_s, f"refit of version {version}")
        return time.perf_counter() - t0

    # ------------------------------------------------------------------ checkpoint
    def state_dict(self) -> dict[str, Any]:
        """The admitted steps and the groups arrived for them that installed weights can no longer
        draw (rows included): those of versions up to the step just trained."""
        return {
            "steps": {int(s): list(ids) for s, ids in self.steps.items()},
            "held": [
                {
                    "group_id": g.group_id,
                    "version": g.version,
                    "rewards": list(g.rewards),
                    "response_len": g.response_len,
                    "rows": self.transport.snapshot(g),
                }
                for g in self.held.values()
                if g.version <= self.training
            ],
        }

    def load_state_dict(self, state: Mapping[str, Any], start: int) -> None:
        """Resume at step ``start`` (the transport up, the ledger restored): the held groups go
        back into the transport; the other admitted groups are generated again, in the same
        pieces, under the same ids and seeds."""
        self.training = self.next_step = start
        if start and "steps" not in state:
            raise StepError(
                f"resume at step {start}: the checkpoint holds no deterministic schedule (it was written "
                "with async.mode=free); resume it in free mode"
            )
        for g in state.get("held", ()):
            rows = self.transport.restore(int(g["group_id"]), int(g["version"]), g["rows"])
            self.held[int(g["group_id"])] = ClaimedGroup(
                int(g["group_id"]), int(g["version"]), rows, [float(r) for r in g["rewards"]], float(g["response_len"])
            )
        for step in sorted(int(s) for s in state.get("steps", {})):
            want = [int(g) for g in state["steps"][step]]
            jobs = self.ledger.admit(len(want))
            if [j.group_id for j in jobs] != want or step != self.next_step:
                raise StepError(
                    f"resume: step {step}'s groups came back as {[j.group_id for j in jobs]}, the checkpoint "
                    f"says {want} (async.mode=deterministic)"
                )
            self._admit(step, jobs, skip=set(self.held))


def make_buffer(cfg: TrainerConfig, pool: Any, transport: Transport, ledger: PromptLedger) -> RolloutBuffer:
    """The async trainer's buffer for ``async.mode``."""
    cls = DeterministicBuffer if cfg.async_.mode == "deterministic" else RolloutBuffer
    return cls(cfg, pool, transport, ledger)
