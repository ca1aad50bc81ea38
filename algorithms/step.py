"""The GRPO step written once; sync and async trainers differ only in where a batch comes from.

A training step on a :class:`RolloutBatch` (``train_on_batch``)::

    prepare        driver: rewards -> (dynamic sampling) -> group-relative advantages
    preshard       driver: one plan (ranks x micro-batches) from the seq_len of every sample
    logprobs       each policy rank: proximal (current) and reference log-probs of its rows
    train          each policy rank: clipped PG + KL loss (+ the off-policy correction when the
                   batch carries behaviour log-probs), gradient all-reduce, AdamW step
    release        (finally, also on failure) exactly the batch's keys leave the store
    refit          policy rank 0 -> generator, weight version ``step + 1``

Where the batch comes from: ``grpo_sync`` calls :func:`algorithms.sync_source.collect` (the
engines generate one step's prompts with the current weights and hand the batch over);
``grpo_async`` claims groups that continuously running collectors streamed into the store
(``algorithms.rollout_buffer``). The engines are a pool that can lose members
(:mod:`algorithms.engine_pool`); :func:`refit` re-forms their group when one was lost.

The data movements are the transport's (:mod:`algorithms.transports`: the data plane, or the
in-memory baseline), chosen once by the trainer; nothing here depends on which.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import ray
import torch

from algorithms.config import TrainerConfig
from algorithms.dispatch import ActorDispatch
from algorithms.finite import refuse_nonfinite_groups
from algorithms.grpo import dynamic_sampling_mask
from algorithms.losses import make_advantage
from algorithms.metrics import PhaseTimer, payload_bytes
from algorithms.remote import StepError, gather
from algorithms.rollouts import RolloutBatch
from algorithms.telemetry import OpRecord, op_summary
from algorithms.transports import Transport


@dataclass
class Workers:
    """Actor handles of one run (``collectors[0]`` is the one the sync trainer drives)."""

    policy: list[Any]
    generators: list[Any]  # one per collector, in collector order
    collectors: list[Any]
    dispatch: Any = None  # the per-rank calls (algorithms.dispatch); None: plain actor calls
    refit_senders: list[Any] = field(default_factory=list)  # the ranks that send a refit; empty: policy rank 0
    pool: Any = None  # algorithms.engine_pool.EnginePool over generators/collectors; None: fixed
    # Posts a reason as the current refit group's abort (algorithms.refit_group.form_refit_group).
    abort_refit: Callable[[str], bool] | None = None
    # Where Ray puts each engine, replacements included (algorithms.placement.Slots); None: anywhere.
    slots: Any = None

    def __post_init__(self) -> None:
        if self.dispatch is None:
            self.dispatch = ActorDispatch(self.policy)
        if not self.refit_senders:
            self.refit_senders = self.policy[:1]

    @property
    def collector(self) -> Any:
        return self.collectors[0]


@dataclass
class StepResult:
    """The step's metrics row (flat scalars), whether training ran, and the store ops every caller
    made during it (:mod:`algorithms.telemetry`; the async loop adds its groups' staleness)."""

    row: dict[str, Any] = field(default_factory=dict)
    trained: bool = True
    ops: list[OpRecord] = field(default_factory=list)
    staleness: list[int] = field(default_factory=list)


def train_on_batch(
    cfg: TrainerConfig,
    workers: Workers,
    transport: Transport,
    batch: RolloutBatch,
    step: int,
    timer: PhaseTimer,
    *,
    behaviour: bool,
    t_start: float | None = None,
    before_refit: Callable[[int], float] | None = None,
) -> StepResult:
    """Train step ``step`` on ``batch``, release its keys, refit the generator to ``step + 1``.

    ``behaviour``: the batch carries the sampler's log-probs (``gen_logprobs``) and the loss
    applies the off-policy correction (async). The batch's keys are released before the refit,
    and also when anything here raises (then the step's own error propagates), so a failed step
    leaves no keys of its batch behind. ``t_start``: when the step began for the caller (its
    source's wait or generation included in ``step_s``); default now. ``before_refit(version)``:
    called before the refit, returns seconds waited (trainer idle): deterministic async mode
    waits there for every group the outgoing version still owes.

    Raises:
        StepError: any worker raised (quoting its error; a worker's ``NonFiniteError`` is its
            cause) or a wait timed out.
        NonFiniteError: a reward or advantage is NaN or infinite (names the group and prompt);
            raised before any worker trains.
    """
    timeout = cfg.trainer.step_timeout_s
    n, dp = batch.group_size, cfg.trainer.dp_size
    t_start = time.perf_counter() if t_start is None else t_start
    ranks = _RankTotals(dp_bytes=int(batch.row.pop("dp_bytes_collect", 0)))
    handle = batch.handle
    rewards = batch.rewards
    row: dict[str, Any] = {"step": step, **batch.row}
    row.update(
        reward=float(rewards.mean()),
        response_len=batch.response_len,
        samples=int(rewards.numel()),
        weight_version=min(batch.versions) if batch.versions else None,
    )
    trained = True
    try:
        with timer("advantages"):
            if rewards.shape != (len(handle),):
                raise StepError(f"step {step}: {tuple(rewards.shape)} rewards for {len(handle)} rows")
            # The collector refuses a non-finite reward already; rewards also arrive as store tags.
            refuse_nonfinite_groups(f"step {step}: reward", rewards, n, batch.group_ids, batch.prompts)
            keep_mask = (
                dynamic_sampling_mask(rewards, n)
                if cfg.grpo.dynamic_sampling
                else torch.ones_like(rewards, dtype=torch.bool)
            )
            keep_idx = [i for i, k in enumerate(keep_mask.tolist()) if k]
            drop_idx = [i for i, k in enumerate(keep_mask.tolist()) if not k]
            row["samples_dropped"] = len(drop_idx)
            if drop_idx:
                handle = transport.keep(handle, keep_idx, drop_idx)
            if len(keep_idx) < dp:
                trained = False  # every group had equal rewards: no learning signal this step
            else:
                adv = make_advantage(cfg.grpo)(rewards[keep_idx], n)
                refuse_nonfinite_groups(
                    f"step {step}: advantage", adv, n, batch.group_ids, batch.prompts, rows=keep_idx
                )
                handle = transport.write_advantages(handle, adv)
        if trained:
            with timer("preshard"):
                preshards = transport.preshard(handle, dp)
                inputs = transport.rank_inputs(handle, preshards, step)
            with timer("logprobs"):
                # Proximal (current weights) and reference log-probs from one fetch per rank.
                out = ranks.call(
                    transport, workers.dispatch, "logprobs", inputs, step, True, timeout, f"step {step} logprobs"
                )
                handle = transport.absorb(handle, preshards, "prev_logprobs", out)
                handle = transport.absorb(handle, preshards, "ref_logprobs", out)
            with timer("train"):
                inputs = transport.rank_inputs(handle, preshards, step)
                metrics = ranks.call(
                    transport, workers.dispatch, "train", inputs, step, behaviour, timeout, f"step {step} train"
                )
            for k in (
                "loss",
                "pg_loss",
                "kl",
                "clip_frac",
                "entropy",
                *(("is_truncated_frac", "behaviour_kl") if behaviour else ()),
            ):
                row[k] = float(sum(m[k] for m in metrics))
            row["grad_norm"] = float(metrics[0]["grad_norm"])
            row["tokens"] = int(sum(m["tokens"] for m in metrics))
    except BaseException:
        # Release, then re-raise the step's own error; a failing release must not mask it.
        try:
            transport.release(batch.handle)
        except Exception as e:  # noqa: BLE001
            print(f"step {step}: releasing the batch's keys after a failure also failed: {e!r}", file=sys.stderr)
        raise
    with timer("release"):
        transport.release(batch.handle)
        # Over the whole store, not the batch just released (that count could never be non-zero).
        every = cfg.logging.audit_every
        audit = bool(every) and (step + 1) % every == 0
        row["keys_outstanding"] = transport.outstanding(audit=audit)
        if audit:
            row["keys_outstanding_audited"] = True
    if before_refit is not None:
        with timer("wait_generation"):
            row["trainer_idle_s"] = float(row.get("trainer_idle_s") or 0.0) + before_refit(step + 1)
    with timer("refit"):
        timing = refit(cfg, workers, step + 1)
    row["step_s"] = time.perf_counter() - t_start
    # The senders wait with the generators in a refit: the part spent waiting for a generation
    # in flight is the trainer's idle time too.
    row["refit_wait_s"] = timing.waited_s
    row["refit_receive_s"] = timing.receive_s  # the slowest receiver
    row["trainer_idle_s"] = float(row.get("trainer_idle_s") or 0.0) + timing.waited_s
    row.update(idle_ratios(row, timing.total_s - timing.waited_s, len(workers.generators)))
    row["tokens_per_s"] = (row.get("tokens") or 0) / row["step_s"]
    row["dp_bytes"] = ranks.dp_bytes + transport.column_bytes
    row["driver_bytes"] = transport.driver_bytes
    for name, secs in timer.seconds.items():
        row[f"time/{name}"] = secs
    row["time/worker_io"] = ranks.io_s
    row["time/worker_compute"] = ranks.compute_s
    transport.driver_bytes = transport.column_bytes = 0
    ops = transport.drain_ops()
    end = time.time()
    row.update(op_summary(ops, end - row["step_s"], end))
    return StepResult(row=row, trained=trained, ops=ops)


def idle_ratios(row: Mapping[str, Any], refit_s: float, generators: int) -> dict[str, float]:
    """The field's idle accounting for one step (verl's fully-async metrics): the trainer's idle
    ratio, the seconds it waited for a batch (``trainer_idle_s``) over the step's wall time, and
    the generators' (rollouters'), the share of the step's wall time, summed over the
    generators, in which none was generating or receiving a refit (``generator_busy_s``, summed
    over generators, plus ``refit_s`` each). Both in [0, 1]; a run's ratios are the same sums
    over all its steps (:func:`run_idle_ratios`)."""
    step_s = float(row["step_s"])
    busy = float(row.get("generator_busy_s") or 0.0) + refit_s * generators
    return {
        "trainer_idle_ratio": min(1.0, max(0.0, float(row.get("trainer_idle_s") or 0.0) / step_s)),
        "generator_idle_ratio": min(1.0, max(0.0, 1.0 - busy / (step_s * generators))),
    }


def run_idle_ratios(rows: Sequence[Mapping[str, Any]], generators: int) -> dict[str, float]:
    """:func:`idle_ratios` over a whole run (sums over its steps)."""
    step_s = sum(float(r["step_s"]) for r in rows)
    if not rows or step_s <= 0:
        return {}
    idle = sum(float(r.get("trainer_idle_s") or 0.0) for r in rows)
    busy = sum(
        float(r.get("generator_busy_s") or 0.0)
        + (float(r.get("time/refit") or 0.0) - float(r.get("refit_wait_s") or 0.0)) * generators
        for r in rows
    )
    return {
        "trainer_idle_ratio": min(1.0, max(0.0, idle / step_s)),
        "generator_idle_ratio": min(1.0, max(0.0, 1.0 - busy / (step_s * generators))),
    }


@dataclass
class RefitTiming:
    """One refit's seconds: in all, what of it went to waiting for a generator to take part (for
    its generation in flight to end or stop, queued or inside it: everything but the longest
    receive; the trainer idles meanwhile), and the longest receive."""

    total_s: float
    waited_s: float
    receive_s: float


def refit(cfg: TrainerConfig, workers: Workers, version: int) -> RefitTiming:
    """Policy -> every generator, weight version ``version``. The senders are
    ``workers.refit_senders`` (policy rank 0, or the first replica's TP ranks for a reshard).
    A generator installs it between two generate calls (its engine runs one at a time), so no
    generation mixes two versions. With an engine pool (``workers.pool``) a lost engine leaves
    the group first and its replacements join (this refit reaches them); a receiver found dead
    during the refit is dropped, the group re-formed and the refit sent again to the others.

    Raises:
        StepError: a side failed, timed out (a sender timeout names the generator(s) that never
            took part), a generator reports another version, or no engine is left.
    """
    pool = workers.pool
    t0 = time.perf_counter()
    while True:
        if pool is not None:
            pool.before_refit(version - 1)
        recvs: list[Any] = []
        tried = time.perf_counter()
        try:
            timing = _refit_once(cfg, workers, version, recvs)
        except StepError as e:
            if time.perf_counter() - tried > 5.0:
                print(
                    f"refit of version {version} failed after {time.perf_counter() - tried:.1f}s: {e}",
                    file=sys.stderr,
                    flush=True,
                )
            lost = _lost_receivers(cfg, workers, recvs) if pool is not None else []
            if pool is None or not lost:
                raise
            pool.drop(lost, version - 1, [e] * len(lost))
            if not workers.generators:
                raise pool.no_engine_left(version - 1, e) from e
            continue
        if pool is not None:
            pool.after_refit()
        total = time.perf_counter() - t0
        return RefitTiming(total, timing.waited_s + (total - timing.total_s), timing.receive_s)


def _lost_receivers(cfg: TrainerConfig, workers: Workers, recvs: Sequence[Any]) -> list[int]:
    """After a failed refit: the receivers whose process died (Ray fails their call at once).
    When there are some, the senders leave the group first (so a live receiver still waiting in
    it fails at once instead of at its timeout) and every receiver's call is waited for."""
    # _refit_once's failure path already gave every receiver's call 2 s to end: look, do not wait.
    done, _ = ray.wait(list(recvs), num_returns=len(recvs), timeout=0)
    dead = [i for i, r in enumerate(recvs) if r in done and _died(r)]
    if not dead:
        return []  # a live peer that failed or never took part: the refit's own error stands
    if workers.abort_refit is not None:
        # Senders still waiting on the dead one inside the refit protocol (its handshake, a
        # status) stop now instead of at refit.timeout_s; their leave_refit then runs at once.
        workers.abort_refit(f"generator(s) {dead} (refit receivers) died during the refit")
    t0 = time.perf_counter()
    try:
        gather([s.leave_refit.remote() for s in workers.refit_senders], cfg.refit.timeout_s + 30, "refit group leave")
    except StepError as e:  # a sender lost: the step's error stands (the policy side is fail-fast)
        print(f"refit: a sender could not leave the group: {e}", file=sys.stderr)
        return []
    left = time.perf_counter() - t0
    ray.wait(list(recvs), num_returns=len(recvs), timeout=cfg.refit.timeout_s + 30)
    ended = time.perf_counter() - t0
    if ended > 5.0:  # a wait the abort should have cut short: say where the time went
        print(
            f"refit: after generator(s) {dead} died, the senders took {left:.1f}s to leave the group and "
            f"the live receivers' calls {ended - left:.1f}s more to end",
            file=sys.stderr,
            flush=True,
        )
    return [i for i, r in enumerate(recvs) if _died(r)]


def _died(ref: Any) -> bool:
    """Whether the finished call ``ref`` failed because its actor died."""
    try:
        ray.get(ref, timeout=0)
    except ray.exceptions.RayActorError:
        return True
    except Exception:  # noqa: BLE001 - alive: failed with the group, or still waiting
        pass
    return False


def _refit_once(cfg: TrainerConfig, workers: Workers, version: int, recvs: list[Any]) -> RefitTiming:
    """One refit to the current members (``recvs`` receives the receivers' call refs)."""
    t0 = time.perf_counter()
    senders = workers.refit_senders
    sends = [s.send_weights.remote(version) for s in senders]
    recvs.extend(g.receive_weights.remote(version) for g in workers.generators)
    names = ["the generator"] if len(recvs) == 1 else [f"generator {i}" for i in range(len(recvs))]
    what = f"refit of version {version}"
    try:
        got = gather(
            [*sends, *recvs],
            cfg.trainer.step_timeout_s,
            what,
            who=[
                *(f"policy rank {r} (refit sender)" for r in range(len(sends))),
                *(f"{n} (refit receiver)" for n in names),
            ],
        )[len(sends) :]
    except StepError as e:
        # A sender may see the broken group before Ray reports a receiver dead: ask the receivers.
        waiting = []
        done, _ = ray.wait(list(recvs), num_returns=len(recvs), timeout=2.0)  # all of them at once
        for n, rank, recv in zip(names, range(len(sends), len(sends) + len(recvs)), recvs):
            if recv not in done:
                waiting.append(f"{n} (refit rank {rank})")
                continue
            try:
                ray.get(recv)
            except ray.exceptions.RayActorError as dead:
                raise StepError(
                    f"{what}: {n} (refit receiver) died or was lost: {type(dead).__name__}: {dead}"
                ) from dead
            except Exception:  # noqa: BLE001 - failed with its own error: the one raised below
                pass
        cause = e.__cause__
        # The group raises StatelessGroupTimeout for its own and gloo's expiries (work.py); the text
        # check covers a cause that reached here some other way with gloo's wording.
        said = str(cause).lower() if cause is not None else ""
        if isinstance(cause, TimeoutError) or "timeout" in said or "timed out" in said:
            # A sender's group wait ran out: a receiver never took part (the one still waiting
            # here, or the ones that never called in).
            late = (
                " and ".join(waiting)
                if waiting
                else " or ".join(f"{n} (refit rank {len(sends) + i})" for i, n in enumerate(names))
            )
            raise StepError(
                f"{what}: {late} never took part within refit.timeout_s={cfg.refit.timeout_s:g}s: {cause}"
            ) from e
        raise
    for n, (v, _, _) in zip(names, got):
        if v != version:
            raise StepError(f"refit: {n} reports weight version {v}, expected {version}")
    total = time.perf_counter() - t0
    receive = max(r for _, r, _ in got)
    return RefitTiming(total, max(0.0, total - receive), receive)


@dataclass
class _RankTotals:
    """What the workers report over one step."""

    dp_bytes: int = 0  # bytes the workers moved through the store
    io_s: float = 0.0  # per phase, the slowest rank's time to get its rows and write results back
    compute_s: float = 0.0  # per phase, the slowest rank's forward/backward time

    def call(
        self,
        transport: Transport,
        dispatch: Any,
        kind: str,
        inputs: Sequence[Any],
        step: int,
        flag: bool,
        timeout_s: float,
        what: str,
    ) -> list[Any]:
        """Run ``kind`` on every policy rank through ``dispatch`` (``algorithms.dispatch``); count
        the bytes through the driver and add the ranks' ``dp_bytes``, ``io_s`` and ``compute_s``."""
        transport.driver_bytes += transport.input_bytes(inputs)
        out = dispatch.call(kind, inputs, step, flag, timeout_s, what)
        transport.driver_bytes += payload_bytes(out)
        for o in out:
            transport.ops.extend(o.pop("ops", ()))
        self.dp_bytes += sum(int(o["dp_bytes"]) for o in out)
        self.io_s += max(float(o["io_s"]) for o in out)
        self.compute_s += max(float(o["compute_s"]) for o in out)
        return out
