"""The GRPO step written once; sync and async trainers differ only in where a batch comes from.

A training step on a :class:`RolloutBatch` (``train_on_batch``)::

    prepare        driver: rewards -> (dynamic sampling) -> group-relative advantages
    preshard       driver: one plan (ranks x micro-batches) from the seq_len of every sample
    logprobs       each policy rank: proximal (current) and reference log-probs of its rows
    train          each policy rank: clipped PG + KL loss (+ the off-policy correction when the
                   batch carries behaviour log-probs), gradient all-reduce, AdamW step
    release        (finally, also on failure) exactly the batch's keys leave the store
    refit          policy rank 0 -> generator, weight version ``step + 1``

Where the batch comes from: ``grpo_sync`` calls :func:`collect` (the collector generates one
step's prompts with the current weights and hands the batch over); ``grpo_async`` claims groups
that a continuously running collector streamed into the store (``algorithms.rollout_buffer``).

A transport implements the data movements: :class:`DataPlaneTransport` (rollouts stay in the
store, the driver moves metas) or :class:`algorithms.legacy_transport.LegacyTransport` (the
driver holds the batch and ships shards through Ray). This module imports neither transport's
dependencies eagerly.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import ray
import torch

from algorithms.config import TrainerConfig
from algorithms.metrics import PhaseTimer, payload_bytes

ROLLOUTS = "rollouts"  # the one partition rollouts live in; keys are released one batch at a time
TRAINER_TASK = "trainer"  # the consumer task name of the trainer's claims
ROLLOUT_FIELDS = ("input_ids", "prompt_len", "seq_len", "group_id", "weight_version", "rewards", "gen_logprobs")


class StepError(RuntimeError):
    """A step failed; the message names the step, the phase and the worker's own error."""


def gather(refs: Sequence[ray.ObjectRef], timeout_s: float, what: str, who: str | Sequence[str] = "worker") -> list[Any]:
    """``ray.get`` of ``refs`` that raises the *first* worker error as soon as it arrives (a rank
    that failed would otherwise leave its peers blocked in a collective until they time out).
    A worker that died (no error of its own) is named as ``{who} {its index in refs}``, or
    ``who[index]`` when ``who`` is a list of names, one per ref.

    Raises:
        StepError: a worker raised (its error is the cause and is quoted) or ``timeout_s`` passed.
    """
    pending = list(refs)
    index = {r: i for i, r in enumerate(refs)}
    results: list[Any] = [None] * len(refs)
    deadline = time.monotonic() + timeout_s
    while pending:
        left = deadline - time.monotonic()
        if left <= 0:
            raise StepError(f"{what}: {len(pending)} of {len(refs)} worker call(s) did not finish within {timeout_s}s")
        ready, pending = ray.wait(pending, num_returns=1, timeout=left)
        for r in ready:
            try:
                results[index[r]] = ray.get(r)
            except ray.exceptions.RayTaskError as e:
                cause = getattr(e, "cause", None) or e
                raise StepError(f"{what}: {type(cause).__name__}: {cause}") from cause
            except ray.exceptions.RayError as e:
                name = f"{who} {index[r]}" if isinstance(who, str) else who[index[r]]
                raise StepError(f"{what}: {name} died or was lost: {type(e).__name__}: {e}") from e
    return results


class Transport(Protocol):
    """How a step's data moves. ``handle`` is a ``KVBatchMeta`` or a ``TensorDict``."""

    name: str
    driver_bytes: int
    column_bytes: int  # bytes the driver itself wrote to the store this step

    def partition(self) -> str | None: ...

    def rollouts(self, result: Mapping[str, Any]) -> Any: ...

    def keep(self, handle: Any, keep_idx: list[int], drop_idx: list[int]) -> Any: ...

    def write_advantages(self, handle: Any, advantages: torch.Tensor) -> Any: ...

    def preshard(self, handle: Any, dp_world: int) -> Any: ...

    def rank_inputs(self, handle: Any, preshards: Any, step: int) -> list[Any]: ...

    def absorb(self, handle: Any, preshards: Any, field: str, rank_results: Sequence[Mapping[str, Any]]) -> Any: ...

    def release(self, handle: Any) -> None: ...

    def outstanding(self) -> int: ...


@dataclass
class Workers:
    """Actor handles of one run (``collectors[0]`` is the one the sync trainer drives)."""

    policy: list[Any]
    generator: Any
    collectors: list[Any]
    dispatch: Any = None  # the per-rank calls (algorithms.dispatch); None: plain actor calls
    refit_senders: list[Any] | None = None  # the ranks that send a refit; None: policy rank 0

    def __post_init__(self) -> None:
        if self.dispatch is None:
            from algorithms.dispatch import ActorDispatch

            self.dispatch = ActorDispatch(self.policy)
        if self.refit_senders is None:
            self.refit_senders = self.policy[:1]

    @property
    def collector(self) -> Any:
        return self.collectors[0]


@dataclass
class RolloutBatch:
    """One training batch: whole groups of ``group_size`` rows, group-major.

    ``handle`` is what the transport moves (a meta of store keys, or the rows themselves);
    ``rewards`` [B] come with it (tags or the collector's reply), never from a store read;
    ``versions`` is the weight version that generated each group, ``group_ids`` its id.
    """

    handle: Any
    rewards: torch.Tensor
    group_size: int
    group_ids: list[int]
    versions: list[int]
    response_len: float
    row: dict[str, Any] = field(default_factory=dict)  # metrics the source adds (timings, drops)


@dataclass
class StepResult:
    """The step's metrics row (flat scalars) and whether training ran."""

    row: dict[str, Any] = field(default_factory=dict)
    trained: bool = True


def generation_seed(run_seed: int, first_group_id: int) -> int:
    """The sampling seed of one generate call, keyed by the first group it draws: a group's
    samples depend on its id and the weights only, not on when or by whom it was drawn."""
    return run_seed * 1_000_003 + first_group_id


def collect(
    cfg: TrainerConfig, workers: Workers, transport: Transport, jobs: Sequence[Any], timer: PhaseTimer, step: int
) -> RolloutBatch:
    """Sync source: the collector generates ``jobs`` (one step's prompts) with the generator's
    current weights and hands over the batch (store keys, or the rows through Ray).

    Raises:
        StepError: the collector failed or timed out.
    """
    from algorithms.rollout_buffer import batch_from_result

    with timer("generate"):
        call = workers.collector.collect.remote(list(jobs), generation_seed(cfg.trainer.seed, jobs[0].group_id), transport.partition())
        transport.driver_bytes += payload_bytes(list(jobs))
        (res,) = gather([call], cfg.trainer.step_timeout_s, f"step {step} collect")
        transport.driver_bytes += payload_bytes(res)
    batch = batch_from_result(transport, res, cfg.generation.n)
    batch.row["dp_bytes_collect"] = int(res["dp_bytes"])
    return batch


def train_on_batch(
    cfg: TrainerConfig, workers: Workers, transport: Transport, batch: RolloutBatch, step: int,
    timer: PhaseTimer, *, behaviour: bool, t_start: float | None = None,
) -> StepResult:
    """Train step ``step`` on ``batch``, release its keys, refit the generator to ``step + 1``.

    ``behaviour``: the batch carries the sampler's log-probs (``gen_logprobs``) and the loss
    applies the off-policy correction (async). The batch's keys are released before the refit,
    and also when anything here raises (then the step's own error propagates), so a failed step
    leaves no keys of its batch behind. ``t_start``: when the step began for the caller (its
    source's wait or generation included in ``step_s``); default now.

    Raises:
        StepError: any worker raised (quoting its error) or a wait timed out.
    """
    from algorithms.grpo import dynamic_sampling_mask, group_advantages

    timeout = cfg.trainer.step_timeout_s
    n, dp = batch.group_size, cfg.trainer.dp_size
    t_start = time.perf_counter() if t_start is None else t_start
    ranks = _RankTotals(dp_bytes=int(batch.row.pop("dp_bytes_collect", 0)))
    handle = batch.handle
    rewards = batch.rewards
    row: dict[str, Any] = {"step": step, **batch.row}
    row.update(reward=float(rewards.mean()), response_len=batch.response_len, samples=int(rewards.numel()),
               weight_version=min(batch.versions) if batch.versions else None)
    trained = True
    try:
        with timer("advantages"):
            if rewards.shape != (len(handle),):
                raise StepError(f"step {step}: {tuple(rewards.shape)} rewards for {len(handle)} rows")
            keep_mask = (
                dynamic_sampling_mask(rewards, n) if cfg.grpo.dynamic_sampling else torch.ones_like(rewards, dtype=torch.bool)
            )
            keep_idx = [i for i, k in enumerate(keep_mask.tolist()) if k]
            drop_idx = [i for i, k in enumerate(keep_mask.tolist()) if not k]
            row["samples_dropped"] = len(drop_idx)
            if drop_idx:
                handle = transport.keep(handle, keep_idx, drop_idx)
            if len(keep_idx) < dp:
                trained = False  # every group had equal rewards: no learning signal this step
            else:
                adv = group_advantages(rewards[keep_idx], n, normalize_std=cfg.grpo.normalize_std)
                handle = transport.write_advantages(handle, adv)
        if trained:
            with timer("preshard"):
                preshards = transport.preshard(handle, dp)
                inputs = transport.rank_inputs(handle, preshards, step)
            with timer("logprobs"):
                # Proximal (current weights) and reference log-probs from one fetch per rank.
                out = ranks.call(transport, workers.dispatch, "logprobs", inputs, step, True, timeout,
                                 f"step {step} logprobs")
                handle = transport.absorb(handle, preshards, "prev_logprobs", out)
                handle = transport.absorb(handle, preshards, "ref_logprobs", out)
            with timer("train"):
                inputs = transport.rank_inputs(handle, preshards, step)
                metrics = ranks.call(transport, workers.dispatch, "train", inputs, step, behaviour, timeout,
                                     f"step {step} train")
            for k in ("loss", "pg_loss", "kl", "clip_frac", "entropy", *(("is_truncated_frac", "behaviour_kl") if behaviour else ())):
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
        row["keys_outstanding"] = transport.outstanding()
    with timer("refit"):
        refit(cfg, workers, step + 1)
    row["step_s"] = time.perf_counter() - t_start
    row["tokens_per_s"] = (row.get("tokens") or 0) / row["step_s"]
    row["dp_bytes"] = ranks.dp_bytes + transport.column_bytes
    row["driver_bytes"] = transport.driver_bytes
    for name, secs in timer.seconds.items():
        row[f"time/{name}"] = secs
    row["time/worker_io"] = ranks.io_s
    row["time/worker_compute"] = ranks.compute_s
    transport.driver_bytes = transport.column_bytes = 0
    return StepResult(row=row, trained=trained)


def refit(cfg: TrainerConfig, workers: Workers, version: int) -> float:
    """Policy -> generator, weight version ``version``; returns seconds. The senders are
    ``workers.refit_senders`` (policy rank 0, or the first replica's TP ranks for a reshard).
    The generator installs it between two generate calls (its actor runs one call at a time),
    so no generation mixes two versions.

    Raises:
        StepError: a side failed, timed out (a sender timeout names the generator, its only
            peer), or the generator reports another version.
    """
    t0 = time.perf_counter()
    senders = workers.refit_senders or workers.policy[:1]  # set by Workers.__post_init__; typed Optional
    sends = [s.send_weights.remote(version) for s in senders]
    recv = workers.generator.receive_weights.remote(version)
    what = f"refit of version {version}"
    try:
        *_, (got, _) = gather([*sends, recv], cfg.trainer.step_timeout_s, what,
                              who=[*(f"policy rank {r} (refit sender)" for r in range(len(sends))),
                                   "the generator (refit receiver)"])
    except StepError as e:
        # The sender may see the broken pair before Ray reports the receiver dead: ask the receiver.
        try:
            ray.get(recv, timeout=2.0)
        except ray.exceptions.RayActorError as dead:
            raise StepError(f"{what}: the generator (refit receiver) died or was lost: {type(dead).__name__}: "
                            f"{dead}") from dead
        except Exception:  # noqa: BLE001 - alive (still waiting, or failed with the error raised below)
            pass
        cause = e.__cause__
        # The group raises StatelessGroupTimeout for its own and gloo's expiries (work.py); the text
        # check covers a cause that reached here some other way with gloo's wording.
        said = str(cause).lower() if cause is not None else ""
        if isinstance(cause, TimeoutError) or "timeout" in said or "timed out" in said:
            # The sender's group wait ran out: its one peer, the generator, never took part.
            raise StepError(f"{what}: the generator (refit rank {len(sends)}) never took part within refit.timeout_s="
                            f"{cfg.refit.timeout_s:g}s: {cause}") from e
        raise
    if got != version:
        raise StepError(f"refit: generator reports weight version {got}, expected {version}")
    return time.perf_counter() - t0


@dataclass
class _RankTotals:
    """What the workers report over one step."""

    dp_bytes: int = 0  # bytes the workers moved through the store
    io_s: float = 0.0  # per phase, the slowest rank's time to get its rows and write results back
    compute_s: float = 0.0  # per phase, the slowest rank's forward/backward time

    def call(self, transport: Transport, dispatch: Any, kind: str, inputs: Sequence[Any], step: int, flag: bool,
             timeout_s: float, what: str) -> list[Any]:
        """Run ``kind`` on every policy rank through ``dispatch`` (``algorithms.dispatch``); count
        the bytes through the driver and add the ranks' ``dp_bytes``, ``io_s`` and ``compute_s``."""
        transport.driver_bytes += payload_bytes(inputs) if not _are_refs(inputs) else 0
        out = dispatch.call(kind, inputs, step, flag, timeout_s, what)
        transport.driver_bytes += payload_bytes(out)
        self.dp_bytes += sum(int(o["dp_bytes"]) for o in out)
        self.io_s += max(float(o["io_s"]) for o in out)
        self.compute_s += max(float(o["compute_s"]) for o in out)
        return out


def _are_refs(inputs: Sequence[Any]) -> bool:
    # Legacy shards are counted when the driver ray.put()s them, not again as refs.
    return bool(inputs) and isinstance(inputs[0], ray.ObjectRef)


# --------------------------------------------------------------------------- data-plane transport
class DataPlaneTransport:
    """Rollouts stay in the store; the driver moves metas, takes per-sample rewards from the
    rows' tags and writes only the ``advantages`` column (``write_columns``, bounded by
    ``data_plane.column_max_bytes_per_sample``). Keys are released one batch at a time."""

    name = "data_plane"

    def __init__(self, client: Any, cfg: TrainerConfig) -> None:
        self.client = client
        self.cfg = cfg
        self.driver_bytes = 0
        self.column_bytes = 0

    def partition(self) -> str:
        return ROLLOUTS

    def rollouts(self, result: Mapping[str, Any]) -> Any:
        return result["meta"]

    def keep(self, handle: Any, keep_idx: list[int], drop_idx: list[int]) -> Any:
        self.client.kv_clear([handle.keys[i] for i in drop_idx], handle.partition_id)
        return handle.subset(keep_idx)

    def write_advantages(self, handle: Any, advantages: torch.Tensor) -> Any:
        from nemo_dataplane.driver.columns import write_columns

        self.driver_bytes += payload_bytes(advantages)
        self.column_bytes = payload_bytes(advantages)
        return write_columns(
            self.client, handle, {"advantages": advantages},
            max_bytes_per_sample=self.cfg.data_plane.column_max_bytes_per_sample,
        )

    def preshard(self, handle: Any, dp_world: int) -> Any:
        from nemo_dataplane.driver.preshard import driver_balanced_preshards

        return driver_balanced_preshards(handle, dp_world, self.cfg.data_plane.packing)

    def rank_inputs(self, handle: Any, preshards: Any, step: int) -> list[Any]:
        from nemo_dataplane.driver.fan_out import fan_out_per_rank_metas

        # A meta source is re-sliced without I/O; the keys stay the collector's.
        return fan_out_per_rank_metas(
            self.client, preshards, handle, partition_id=handle.partition_id, key_prefix=f"step{step}"
        )

    def absorb(self, handle: Any, preshards: Any, field: str, rank_results: Sequence[Mapping[str, Any]]) -> Any:
        return handle.add_fields([field])  # the ranks wrote it back themselves

    def release(self, handle: Any) -> None:
        if len(handle):
            self.client.kv_clear(list(handle.keys), handle.partition_id)

    def outstanding(self) -> int:
        """Keys in the whole store, every partition (a listing, not this driver's bookkeeping)."""
        return sum(len(self.client.kv_list(p)) for p in self.client.kv_partitions())

    def clear_all(self) -> None:
        """Empty every partition (shutdown, resume): nothing of this run stays in the store."""
        for p in self.client.kv_partitions():
            self.client.kv_clear(None, p)
