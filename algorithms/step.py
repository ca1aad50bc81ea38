"""One GRPO step, written once; the data-plane and legacy paths differ only in a transport.

Order of a step (``run_step``)::

    collect        collector samples n responses per prompt, scores them; rollouts go to the
                   store (data plane) or back to the driver (legacy)
    advantages     driver: rewards -> (dynamic sampling) -> group-relative advantages
    preshard       driver: one plan (ranks x micro-batches) from the seq_len of every sample
    logprobs       each policy rank: previous-policy and reference log-probs of its rows
    train          each policy rank: clipped PG + KL loss, gradient all-reduce, AdamW step
    clear          (finally, also on failure) the step's partition is emptied
    refit          policy rank 0 -> generator, new weight version

A transport implements the five data movements (:class:`DataPlaneTransport` over the store,
:class:`LegacyTransport` through Ray object refs). The legacy one lives in a module that never
imports the data-plane client; this module imports neither transport's dependencies eagerly.
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


class StepError(RuntimeError):
    """A step failed; the message names the step, the phase and the worker's own error."""


def gather(refs: Sequence[ray.ObjectRef], timeout_s: float, what: str) -> list[Any]:
    """``ray.get`` of ``refs`` that raises the *first* worker error as soon as it arrives (a rank
    that failed would otherwise leave its peers blocked in a collective until they time out).

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
                raise StepError(f"{what}: {type(e).__name__}: {e}") from e
    return results


class Transport(Protocol):
    """How a step's data moves. ``handle`` is a ``KVBatchMeta`` or a ``TensorDict``."""

    name: str
    driver_bytes: int
    column_bytes: int  # bytes the driver itself wrote to the store this step
    last_outstanding: int  # keys left in the last cleared partition (-1: the clear failed)

    def partition(self, step: int) -> str | None: ...

    def rollouts(self, result: Mapping[str, Any]) -> Any: ...

    def rewards(self, handle: Any, result: Mapping[str, Any]) -> torch.Tensor: ...

    def keep(self, handle: Any, keep_idx: list[int], drop_idx: list[int]) -> Any: ...

    def write_advantages(self, handle: Any, advantages: torch.Tensor) -> Any: ...

    def preshard(self, handle: Any, dp_world: int) -> Any: ...

    def rank_inputs(self, handle: Any, preshards: Any, step: int) -> list[Any]: ...

    def absorb(self, handle: Any, preshards: Any, field: str, rank_results: Sequence[Mapping[str, Any]]) -> Any: ...

    def clear(self, step: int) -> int: ...


@dataclass
class Workers:
    """Actor handles of one run."""

    policy: list[Any]
    generator: Any
    collector: Any


@dataclass
class StepResult:
    """The step's metrics row (flat scalars) and whether training ran."""

    row: dict[str, Any] = field(default_factory=dict)
    trained: bool = True


def generation_seed(cfg: TrainerConfig, step: int) -> int:
    return cfg.trainer.seed * 1_000_003 + step


def run_step(cfg: TrainerConfig, workers: Workers, transport: Transport, step: int, records: Sequence[Any]) -> StepResult:
    """Run GRPO step ``step`` on ``records`` (one prompt batch) and refit the generator.

    The step's partition is cleared before the refit, and also when anything in the step raises
    (the clear runs, then the step's own error propagates), so a failed step leaves no keys.

    Raises:
        StepError: any worker raised (quoting its error) or a wait timed out.
    """
    from algorithms.grpo import dynamic_sampling_mask, group_advantages

    timer = PhaseTimer()
    timeout = cfg.trainer.step_timeout_s
    n = cfg.generation.n
    dp = cfg.trainer.dp_size
    t_start = time.perf_counter()
    transport.driver_bytes = 0
    transport.column_bytes = 0
    ranks = _RankTotals()
    row: dict[str, Any] = {"step": step}
    trained = True
    try:
        with timer("generate"):
            call = workers.collector.collect.remote(step, list(records), generation_seed(cfg, step), transport.partition(step))
            transport.driver_bytes += payload_bytes(list(records))
            (res,) = gather([call], timeout, f"step {step} collect")
            transport.driver_bytes += payload_bytes(res)
            ranks.dp_bytes += int(res["dp_bytes"])
            handle = transport.rollouts(res)
        with timer("advantages"):
            rewards = transport.rewards(handle, res)
            row["reward"] = float(rewards.mean())
            row["response_len"] = float(res["response_len"])
            row["weight_version"] = int(res["weight_version"])
            row["samples"] = int(rewards.numel())
            keep_mask = (
                dynamic_sampling_mask(rewards, n) if cfg.grpo.dynamic_sampling else torch.ones_like(rewards, dtype=torch.bool)
            )
            keep_idx = [i for i, k in enumerate(keep_mask.tolist()) if k]
            drop_idx = [i for i, k in enumerate(keep_mask.tolist()) if not k]
            row["samples_dropped"] = len(drop_idx)
            if drop_idx:
                handle = transport.keep(handle, keep_idx, drop_idx)
            if len(keep_idx) < dp:
                # Every group had equal rewards: no learning signal this step.
                trained = False
            else:
                adv = group_advantages(rewards[keep_idx], n, normalize_std=cfg.grpo.normalize_std)
                handle = transport.write_advantages(handle, adv)
        if trained:
            with timer("preshard"):
                preshards = transport.preshard(handle, dp)
                inputs = transport.rank_inputs(handle, preshards, step)
            with timer("logprobs"):
                # Previous-policy and reference log-probs from one fetch per rank.
                calls = [
                    w.get_logprobs.remote(inputs[r], step, with_reference=True) for r, w in enumerate(workers.policy)
                ]
                out = ranks.gather(transport, inputs, calls, timeout, f"step {step} logprobs")
                handle = transport.absorb(handle, preshards, "prev_logprobs", out)
                handle = transport.absorb(handle, preshards, "ref_logprobs", out)
            with timer("train"):
                inputs = transport.rank_inputs(handle, preshards, step)
                calls = [w.train.remote(inputs[r], step) for r, w in enumerate(workers.policy)]
                metrics = ranks.gather(transport, inputs, calls, timeout, f"step {step} train")
            for k in ("loss", "pg_loss", "kl", "clip_frac", "entropy"):
                row[k] = float(sum(m[k] for m in metrics))
            row["grad_norm"] = float(metrics[0]["grad_norm"])
            row["tokens"] = int(sum(m["tokens"] for m in metrics))
    except BaseException:
        # Clear, then re-raise the step's own error; a failing clear must not mask it.
        try:
            transport.last_outstanding = transport.clear(step)
        except Exception as e:  # noqa: BLE001
            transport.last_outstanding = -1
            print(f"grpo_sync: clearing partition of step {step} after a failure also failed: {e}", file=sys.stderr)
        raise
    with timer("clear"):
        outstanding = transport.last_outstanding = transport.clear(step)
    row["keys_outstanding"] = outstanding
    with timer("refit"):
        send = workers.policy[0].send_weights.remote(step + 1)
        recv = workers.generator.receive_weights.remote()
        _, (version, _) = gather([send, recv], timeout, f"step {step} refit")
        if version != step + 1:
            raise StepError(f"step {step} refit: generator reports weight version {version}, expected {step + 1}")
    row["step_s"] = time.perf_counter() - t_start
    row["tokens_per_s"] = (row.get("tokens") or 0) / row["step_s"]
    row["dp_bytes"] = ranks.dp_bytes + transport.column_bytes
    row["driver_bytes"] = transport.driver_bytes
    for name, secs in timer.seconds.items():
        row[f"time/{name}"] = secs
    row["time/worker_io"] = ranks.io_s
    row["time/worker_compute"] = ranks.compute_s
    return StepResult(row=row, trained=trained)


@dataclass
class _RankTotals:
    """What the workers report over one step."""

    dp_bytes: int = 0  # bytes the workers moved through the store
    io_s: float = 0.0  # per phase, the slowest rank's time to get its rows and write results back
    compute_s: float = 0.0  # per phase, the slowest rank's forward/backward time

    def gather(self, transport: Transport, inputs: Sequence[Any], calls: Sequence[ray.ObjectRef], timeout_s: float,
               what: str) -> list[Any]:
        """:func:`gather` the policy ranks' ``calls`` on ``inputs``; count the bytes through the
        driver and add the ranks' ``dp_bytes``, ``io_s`` and ``compute_s``."""
        transport.driver_bytes += payload_bytes(inputs) if not _are_refs(inputs) else 0
        out = gather(calls, timeout_s, what)
        transport.driver_bytes += payload_bytes(out)
        self.dp_bytes += sum(int(o["dp_bytes"]) for o in out)
        self.io_s += max(float(o["io_s"]) for o in out)
        self.compute_s += max(float(o["compute_s"]) for o in out)
        return out


def _are_refs(inputs: Sequence[Any]) -> bool:
    # Legacy shards are counted when the driver ray.put()s them, not again as refs.
    return bool(inputs) and isinstance(inputs[0], ray.ObjectRef)


# --------------------------------------------------------------------------- transports
class DataPlaneTransport:
    """Rollouts stay in the store; the driver moves metas, gets the per-sample ``rewards`` from the
    collector and writes only the ``advantages`` column (``write_columns``, bounded by
    ``data_plane.column_max_bytes_per_sample``)."""

    name = "data_plane"

    def __init__(self, client: Any, cfg: TrainerConfig) -> None:
        self.client = client
        self.cfg = cfg
        self.driver_bytes = 0
        self.column_bytes = 0
        self.last_outstanding = 0

    def partition(self, step: int) -> str:
        return f"step{step}"

    def rollouts(self, result: Mapping[str, Any]) -> Any:
        return result["meta"]

    def rewards(self, handle: Any, result: Mapping[str, Any]) -> torch.Tensor:
        # The collector returns the per-sample rewards it stored next to the meta (already counted
        # in the driver's bytes); reading the column back would cost two more store round trips.
        rewards = result["rewards"]
        if rewards.shape != (len(handle),):
            raise StepError(f"collector returned {tuple(rewards.shape)} rewards for {len(handle)} keys")
        return rewards

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

    def clear(self, step: int) -> int:
        partition = self.partition(step)
        self.client.kv_clear(None, partition)
        return len(self.client.kv_list(partition))


class LegacyTransport:
    """The baseline: the driver holds the rollout ``TensorDict``, computes on it in memory and
    ships each rank its shard with ``ray.put``; log-probs come back to the driver as tensors.
    Imports nothing of the data-plane client, adapters, fan-out, column I/O or worker fetch."""

    name = "legacy"

    def __init__(self, cfg: TrainerConfig) -> None:
        self.cfg = cfg
        self.driver_bytes = 0
        self.column_bytes = 0
        self.last_outstanding = 0

    def partition(self, step: int) -> None:
        return None

    def rollouts(self, result: Mapping[str, Any]) -> Any:
        return result["batch"]

    def rewards(self, handle: Any, result: Mapping[str, Any]) -> torch.Tensor:
        return handle["rewards"]

    def keep(self, handle: Any, keep_idx: list[int], drop_idx: list[int]) -> Any:
        from nemo_dataplane.rows import select_rows

        return select_rows(handle, keep_idx)

    def write_advantages(self, handle: Any, advantages: torch.Tensor) -> Any:
        handle.set("advantages", advantages)
        return handle

    def preshard(self, handle: Any, dp_world: int) -> Any:
        from nemo_dataplane.driver.preshard import driver_balanced_preshards

        return driver_balanced_preshards(handle, dp_world, self.cfg.data_plane.packing)

    def rank_inputs(self, handle: Any, preshards: Any, step: int) -> list[Any]:
        from algorithms.legacy_transport import legacy_shard, ship_shards

        shards = legacy_shard(handle, preshards)
        self.driver_bytes += sum(payload_bytes(s) for s in shards)
        return ship_shards(shards)

    def absorb(self, handle: Any, preshards: Any, field: str, rank_results: Sequence[Mapping[str, Any]]) -> Any:
        from algorithms.workers.policy import jagged_from_rows, jagged_rows

        per_rank = [jagged_rows(r[field]) for r in rank_results]
        handle.set(field, jagged_from_rows(preshards.restore_order(per_rank)))
        return handle

    def clear(self, step: int) -> int:
        return 0  # nothing is stored outside the driver's own memory
