"""The generation engines as a pool that can lose members (grpo_sync's ``generation.num_engines``,
grpo_async's ``async.num_collectors``).

An engine is a generator actor and the collector that drives it. When a call to it fails (sync:
the step's collect; async: the collectors' poll; either: a refit) and a liveness check finds the
engine's collector or generator dead (killed, lost with its node, a CUDA error that ended the
process), the pool:

* drops the engine (both actors are killed, so a half-alive one never holds a refit slot);
* hands its groups back to be generated again on the survivors. Sync: the step's part, the same
  group ids and prompts, and, with several engines, every response from its own seed, so the
  step samples exactly what it would have. Async (:class:`CollectorPool`): every group it held
  and had not delivered whole; its rows leave the store; free mode gives the prompts new group
  ids, deterministic mode the same ids, seeds and weight versions, so the run stays bitwise
  equal to an undisturbed one;
* with ``generation.replace_lost`` (and ``generation.max_replacements`` left), starts a
  replacement at once, without waiting for it;
* before the next refit re-forms the refit group without the lost rank and with the
  replacements that are up (``generation.replacement_join``: ``ready`` joins each at the first
  refit after its start-up, training going on meanwhile; ``wait`` holds that refit for them;
  a new group instance at a new rendezvous, whose records the old group's refuse), so that
  refit gives every member, replacements first of all, the current weights before they
  generate (an async replacement starts producing after it).

A failure that is not a loss (a collector that raised, a store error) is the step's error, as
with one engine. With no engine left the step fails naming each loss. The policy side stays
fail-fast: a lost policy rank ends the run.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import ray

from algorithms.config import TrainerConfig
from algorithms.remote import StepError, gather, settle
from algorithms.rollouts import Job

__all__ = ["CollectorPool", "EngineLoss", "EnginePool", "Spawned"]

# How long a liveness probe of a failed engine's actors waits: a dead actor answers at once
# (Ray knows), a live one answers its trivial ``ready`` within it.
PROBE_S = 5.0


@dataclass(frozen=True)
class Spawned:
    """A replacement engine's actors, created and not waited for; ``pending``: the refs of its
    start-up calls (ready, attach) that must succeed before it joins."""

    generator: Any
    collector: Any
    pending: list[Any]
    started_at: float


@dataclass
class EngineLoss:
    """One lost engine: its id, the step it was lost in, the error seen, the seconds from the
    failure being seen to the step's generation going on without it (requeued), and when the
    trainer next finished a step (``trained_at``, wall clock: training went on)."""

    engine: int
    step: int
    error: str
    seen_at: float  # perf_counter
    seen_wall: float  # time.time(), for a fault's own clock
    resumed_s: float | None = None
    trained_at: float | None = None  # time.time() at the end of the first step after the loss

    def record(self) -> dict[str, Any]:
        return {
            "engine": self.engine,
            "step": self.step,
            "error": self.error,
            "seen_at": self.seen_wall,
            "resumed_at": None if self.resumed_s is None else self.seen_wall + self.resumed_s,
            "resumed_s": self.resumed_s,
            "trained_at": self.trained_at,
        }


@dataclass
class EnginePool:
    """The run's engines (``generators[i]`` with ``collectors[i]``, id ``ids[i]``; the lists are
    the run's :class:`~algorithms.step.Workers` lists, changed in place) and their losses.

    Args:
        spawn: creates engine ``id``'s actors (not waited for; its collector attached to the
            run's sink) and records them with the run's actors, so shutdown reaches them.
        reform: re-forms the refit group over the given generators (:func:`algorithms.refit_group.form_refit_group`
            bound to the run's senders, rendezvous host and secret).
    """

    cfg: TrainerConfig
    generators: list[Any]
    collectors: list[Any]
    spawn: Callable[[int], Spawned]
    reform: Callable[[list[Any]], None]
    on_join: Callable[[Any], None] | None = None  # called with a replacement's collector once it has weights
    ids: list[int] = field(default_factory=list)
    size: int = 0  # the configured engine count (0: as many as given)
    losses: list[EngineLoss] = field(default_factory=list)
    replaced: int = 0
    left_out: int = 0  # replacements that failed to start (killed, or past the start-up bound)
    requeued_groups: int = 0
    first_generation_s: list[float] = field(default_factory=list)  # per replacement: spawn -> first part
    _waiting: list[tuple[int, Spawned]] = field(default_factory=list)  # replacements not yet in the group
    _joined_at: dict[int, float] = field(default_factory=dict)  # replacement id -> spawn time
    _stale: bool = False  # a member was lost: the refit group must be re-formed first
    _to_start: list[Any] = field(default_factory=list)  # joined collectors, for on_join after the refit
    _hung: dict[int, str] = field(default_factory=dict)  # engine id -> why the heartbeat killed it

    def __post_init__(self) -> None:
        if not self.ids:
            self.ids = list(range(len(self.generators)))
        self.size = self.size or len(self.generators)
        self._next_id = max(self.ids, default=-1) + 1
        self._stop = threading.Event()
        self._watchdog: threading.Thread | None = None

    def start_heartbeat(self) -> None:
        """Watch the engines' heartbeats (``generation.heartbeat_timeout_s``; 0: off) on a
        daemon thread until :meth:`close`. An engine whose generator does not answer its
        heartbeat within the timeout (its process wedged or stopped), or answers that it has
        drawn nothing for longer inside a generate call, is killed: the call waiting on it then
        fails as a dead engine's does, and it is dropped like one (:meth:`drop` records why)."""
        timeout = self.cfg.generation.heartbeat_timeout_s
        if timeout <= 0 or self._watchdog is not None:
            return
        self._watchdog = threading.Thread(target=self._watch, args=(timeout,), name="engine-heartbeat", daemon=True)
        self._watchdog.start()

    def close(self) -> None:
        """Stop the heartbeat watch (idempotent)."""
        self._stop.set()

    def _watch(self, timeout: float) -> None:
        while not self._stop.wait(min(1.0, timeout / 4)):
            try:
                self._check_heartbeats(timeout)
            except Exception as e:  # noqa: BLE001 - a thread must not die of one bad round
                if self._stop.is_set():
                    return  # the run is shutting down (Ray may be gone)
                print(f"engine heartbeat: {type(e).__name__}: {e}", file=sys.stderr, flush=True)

    def _check_heartbeats(self, timeout: float) -> None:
        # A snapshot: the step's thread drops and adds engines meanwhile.
        members = list(zip(self.ids, self.generators, self.collectors))
        refs = [g.heartbeat.remote() for _, g, _ in members]
        answered, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout)
        for (eid, generator, collector), ref in zip(members, refs):
            if self._stop.is_set():
                return
            why = self._silence(ref, answered, timeout)
            if why is None or eid in self._hung:
                continue
            self._hung[eid] = why
            print(f"engine {eid}: {why}; killing it", file=sys.stderr, flush=True)
            _kill(collector, generator)

    @staticmethod
    def _silence(ref: Any, answered: Sequence[Any], timeout: float) -> str | None:
        """Why a heartbeat ``ref`` shows a hung engine, or ``None`` (answered in time and drew
        recently, or dead: the loss path finds a dead one itself)."""
        if ref not in answered:
            return f"no heartbeat within generation.heartbeat_timeout_s={timeout:g}s"
        try:
            silent = ray.get(ref, timeout=0)
        except Exception:  # noqa: BLE001 - dead or failing: not a hang
            return None
        if silent is not None and silent > timeout:
            return (
                f"drew nothing for {silent:.1f}s inside a generate call (generation.heartbeat_timeout_s={timeout:g}s)"
            )
        return None

    @property
    def holding(self) -> list[int]:
        """Ids of the engines alive or starting (replacements not yet joined)."""
        return [*self.ids, *(rid for rid, _ in self._waiting)]

    def name(self, i: int) -> str:
        """Position ``i``'s engine in messages."""
        return f"engine {self.ids[i]}"

    def is_lost(self, i: int) -> bool:
        """Whether position ``i``'s collector or generator is dead (Ray reports it at once); a
        live actor answers ``ready`` within :data:`PROBE_S`."""
        for actor in (self.collectors[i], self.generators[i]):
            try:
                ray.get(actor.ready.remote(), timeout=PROBE_S)
            except ray.exceptions.RayActorError:
                return True
            except Exception:  # noqa: BLE001 - alive (busy, or failing on its own): not a loss
                pass
        return False

    def drop(self, positions: Sequence[int], step: int, errors: Sequence[BaseException]) -> list[EngineLoss]:
        """Remove the engines at ``positions`` (both actors killed), record the losses, and
        start replacements as the budget allows. Returns the new losses."""
        now = time.perf_counter()
        new = []
        for i, err in sorted(zip(positions, errors), key=lambda p: -p[0]):
            first = str(err).splitlines()[0] if str(err) else type(err).__name__
            hung = self._hung.pop(self.ids[i], None)
            if hung is not None:  # killed by the heartbeat watch: why comes first
                first = f"hung, killed by the trainer: {hung} ({first})"
            loss = EngineLoss(self.ids[i], step, first[:400], now, time.time())
            new.append(loss)
            _kill(self.collectors[i], self.generators[i])
            del self.collectors[i], self.generators[i], self.ids[i]
            print(f"step {step}: {_loss_line(loss)}; the other engines go on", file=sys.stderr, flush=True)
        self.losses.extend(reversed(new))
        self._stale = True
        g = self.cfg.generation
        for _ in new:
            # No survivor: the step fails now, a replacement would come too late for it.
            if self.generators and g.replace_lost and self.replaced + len(self._waiting) < g.max_replacements:
                rid, self._next_id = self._next_id, self._next_id + 1
                self._waiting.append((rid, self.spawn(rid)))
        return list(reversed(new))

    def resumed(self, losses: Sequence[EngineLoss]) -> None:
        """The step's generation went on without ``losses``' engines (their prompts requeued)."""
        now = time.perf_counter()
        for loss in losses:
            loss.resumed_s = now - loss.seen_at

    def stepped(self) -> None:
        """The trainer finished a step: losses without one since are stamped ``trained_at`` (in
        async runs the generation resumes at once, so this is when training is seen to go on)."""
        now = time.time()
        for loss in self.losses:
            if loss.trained_at is None:
                loss.trained_at = now

    def no_engine_left(self, step: int, error: StepError) -> StepError:
        """The error of a step that lost its last engine: the last failure as a single engine's
        would read, then the run's earlier losses."""
        earlier = [_loss_line(x) for x in self.losses[:-1]]
        tail = f" (no generation engine left; earlier: {'; '.join(earlier)})" if earlier else ""
        return StepError(f"{error}{tail}")

    def before_refit(self, step: int) -> int:
        """Re-form the refit group if a member was lost or a replacement is ready to join, taking
        in the replacements ``generation.replacement_join`` admits: ``ready`` (default) those
        whose start-up has finished, without waiting for the others (they join at a later
        refit); ``wait`` all of them, waiting for each. Either way a replacement not up within
        ``trainer.startup_timeout_s`` of its start, or whose start-up failed, is reported and
        left out. The refit that follows gives the joined ones the current weights. A member
        that died meanwhile is dropped and the group formed again. Returns how many replacements
        joined. ``step``: the step the refit ends (for the loss records)."""
        timeout = self.cfg.trainer.startup_timeout_s
        wait = self.cfg.generation.replacement_join == "wait"
        admitted: list[tuple[int, Spawned]] = []
        still: list[tuple[int, Spawned]] = []
        for rid, sp in self._waiting:
            done, _ = ray.wait(sp.pending, num_returns=len(sp.pending), timeout=0)
            late = time.perf_counter() - sp.started_at > timeout
            (admitted if wait or len(done) == len(sp.pending) or late else still).append((rid, sp))
        if not self._stale and not admitted:
            return 0
        joined = 0
        for rid, sp in admitted:
            left = max(0.0, timeout - (time.perf_counter() - sp.started_at))
            try:
                gather(sp.pending, left, f"replacement engine {rid} start-up", [f"engine {rid}"] * len(sp.pending))
            except StepError as e:
                print(f"replacement engine {rid} did not start, left out: {e}", file=sys.stderr, flush=True)
                self.left_out += 1
                _kill(sp.collector, sp.generator)
                continue
            self.generators.append(sp.generator)
            self.collectors.append(sp.collector)
            self.ids.append(rid)
            self._joined_at[rid] = sp.started_at
            self._to_start.append(sp.collector)
            self.replaced += 1
            joined += 1
            print(f"engine {rid} replaces a lost engine: it joins the refit group now", file=sys.stderr, flush=True)
        self._waiting = still
        while True:
            try:
                self.reform(self.generators)
                break
            except StepError as e:
                # A member died before or while the group formed: drop it and form again.
                dead = [i for i in range(len(self.generators)) if self.is_lost(i)]
                if not dead:
                    raise
                self.drop(dead, step, [e] * len(dead))
                if not self.generators:
                    raise self.no_engine_left(step, e) from e
        # Replacements started or still starting meanwhile: each joins at a refit once it is up.
        self._stale = False
        return joined

    def after_refit(self) -> None:
        """The refit reached every member: replacements that joined before it may start."""
        started, self._to_start = self._to_start, []
        if self.on_join is not None:
            for collector in started:
                if collector in self.collectors:  # not lost meanwhile
                    self.on_join(collector)

    def on_any(self, call: Callable[[Any], Any], timeout_s: float, what: str, step: int) -> Any:
        """``call(collector)`` (a Ray call) on the first engine, dropping each one found lost and
        trying the next (validation: any engine draws the same with the same weights and seed).

        Raises:
            StepError: the call failed on a live engine, or no engine is left.
        """
        while True:
            try:
                (out,) = gather([call(self.collectors[0])], timeout_s, what, [self.name(0)])
                return out
            except StepError as e:
                if not self.is_lost(0):
                    raise
                self.drop([0], step, [e])
                if not self.collectors:
                    raise self.no_engine_left(step, e) from e

    def generated(self, positions: Sequence[int]) -> None:
        """Positions whose parts were delivered: a replacement's first delivery records its
        seconds from start to first generation."""
        now = time.perf_counter()
        for i in positions:
            started = self._joined_at.pop(self.ids[i], None)
            if started is not None:
                self.first_generation_s.append(now - started)

    def counts(self) -> dict[str, int]:
        """Run totals: engines lost, replacements joined, groups generated again."""
        return {
            "generators_lost": len(self.losses),
            "generators_replaced": self.replaced,
            "groups_requeued_lost": self.requeued_groups,
        }

    def summary(self) -> dict[str, Any]:
        """The run's account of losses: each loss, the totals, each replacement's seconds from its
        start to its first delivered generation."""
        return {
            "generator_losses": [x.record() for x in self.losses],
            **{f"{k}_total": v for k, v in self.counts().items()},
            "replacements_left_out": self.left_out,
            "replacement_first_generation_s": self.first_generation_s,
        }


def _kill(*actors: Any) -> None:
    """Kill ``actors`` for good; one already gone is no error."""
    for actor in actors:
        try:
            ray.kill(actor, no_restart=True)
        except Exception:  # noqa: BLE001 - already gone
            pass


def _loss_line(loss: EngineLoss) -> str:
    return f"engine {loss.engine} lost at step {loss.step} ({loss.error})"


class CollectorPool:
    """The async buffer's view of the collectors: queue jobs (remembering which collector holds
    which group), poll failures, take outboxes. With an :class:`EnginePool` (``engines``) a
    collector found lost is dropped and :meth:`poll` reports the groups it held and had not
    delivered (``lost_groups``), for the buffer to generate again; without one a lost collector
    fails the step, as any failed call does."""

    def __init__(self, collectors: list[Any], timeout_s: float, engines: EnginePool | None = None) -> None:
        self.collectors = collectors if engines is None else engines.collectors  # the engines' own list
        self.engines = engines
        self.timeout_s = timeout_s
        self._rr = 0
        self.held: dict[int, set[int]] = {}  # engine id -> group ids submitted to it, not yet dropped

    def _id(self, i: int) -> int:
        return self.engines.ids[i] if self.engines is not None else i

    def _names(self) -> list[str]:
        return [f"collector {self._id(i)}" for i in range(len(self.collectors))]

    def submit(self, pieces: Sequence[Sequence[Job]]) -> None:
        """Queue each piece (one generate call's worth) on the next collector, round robin."""
        per: dict[int, list[Job]] = {}
        for piece in pieces:
            per.setdefault(self._rr % len(self.collectors), []).extend(piece)
            self._rr += 1
        for i, jobs in per.items():  # recorded first: a collector lost in the call still owes them
            self.held.setdefault(self._id(i), set()).update(j.group_id for j in jobs)
        # One call per collector: its calls run concurrently (threaded actor), so two calls could
        # queue their jobs out of order, and groups are trained oldest first.
        pos = list(per)
        refs = [self.collectors[i].submit.remote(per[i]) for i in pos]
        outs = settle(refs, self.timeout_s, "submitting prompts to the collectors", [self._names()[i] for i in pos])
        for i, out in zip(pos, outs):
            if isinstance(out, StepError) and not (self.engines is not None and self.engines.is_lost(i)):
                raise out  # a lost one is found by the next poll, which hands its groups back

    def poll(self, step: int, live: set[int]) -> tuple[list[dict[str, Any]], list[int]]:
        """Every live collector's poll, and the groups lost collectors held that are still in
        ``live`` (handed out, not yet arrived at the trainer): their rows may be partly written.

        Raises:
            StepError: a collector's call failed and it is not lost (or there is no pool).
        """
        outs = settle([c.poll.remote() for c in self.collectors], 60, "polling the collectors", self._names())
        failed = [i for i, o in enumerate(outs) if isinstance(o, StepError) or o["error"]]
        lost = [i for i in failed if self.engines is not None and self.engines.is_lost(i)]
        for i in failed:
            if i not in lost:
                o = outs[i]
                raise o if isinstance(o, StepError) else StepError(f"rollout collection stopped: {o['error']}")
        polls = [o for i, o in enumerate(outs) if i not in lost]
        if self.engines is not None:  # a replacement's first delivery
            self.engines.generated([i for i, o in enumerate(outs) if i not in lost and o.get("groups_written")])
        groups: list[int] = []
        if self.engines is not None:
            if lost:
                errors = [
                    o if isinstance(o, StepError) else StepError(str(o["error"])) for o in (outs[i] for i in lost)
                ]
                self.engines.resumed(self.engines.drop(lost, step, errors))
                if not self.collectors:
                    raise self.engines.no_engine_left(step, errors[-1])
            # Engines dropped here or elsewhere (a refit that found one dead): their groups back.
            for eid in [e for e in self.held if e not in self.engines.ids]:
                groups += sorted(g for g in self.held.pop(eid) if g in live)
            self.engines.requeued_groups += len(groups)
        for held in self.held.values():  # what was trained or requeued meanwhile is no one's now
            held &= live
        return polls, groups

    def take(self, max_groups: int, timeout_s: float) -> list[dict[str, Any]]:
        """Finished groups from the outboxes (a failed call gives none; :meth:`poll` judges it)."""
        per = max(timeout_s / len(self.collectors), 0.05)
        refs = [c.take.remote(max_groups, per) for c in self.collectors]
        outs = settle(refs, timeout_s + 60, "taking rollouts", self._names())
        return [g for out in outs if not isinstance(out, StepError) for g in out]
