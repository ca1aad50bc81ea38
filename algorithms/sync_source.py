"""The sync trainer's source of batches: one step's prompts generated now by the engines.

:func:`collect` spreads the step's jobs over the engines (``generation.num_engines``) in
contiguous parts, gathers their parts and joins them into one :class:`RolloutBatch` in the jobs'
order; a part whose engine is found lost (:mod:`algorithms.engine_pool`) is generated again on
the survivors within the step.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from algorithms.config import TrainerConfig
from algorithms.metrics import PhaseTimer, payload_bytes
from algorithms.remote import StepError, settle
from algorithms.rollouts import Job, RolloutBatch, generation_seed
from algorithms.step import Workers
from algorithms.transports import Transport

__all__ = ["collect", "spread"]


def spread(jobs: Sequence[Job], engines: int) -> list[list[Job]]:
    """``jobs`` in contiguous chunks over ``engines``, sizes differing by at most one (none empty)."""
    per, extra = divmod(len(jobs), engines)
    out, at = [], 0
    for i in range(engines):
        size = per + (1 if i < extra else 0)
        if size:
            out.append(list(jobs[at : at + size]))
        at += size
    return out


def collect(
    cfg: TrainerConfig, workers: Workers, transport: Transport, jobs: Sequence[Job], timer: PhaseTimer, step: int
) -> RolloutBatch:
    """Sync source: the collectors generate ``jobs`` (one step's prompts, :func:`spread` over the
    engines) with their generators' current weights and hand over the batch (through the
    transport's sink; several engines' parts joined by ``transport.concat``, in the jobs' order).
    With several engines every response is drawn from its own seed where the engine allows it
    (hf), so the split changes nothing sampled; an engine that seeds by call (vLLM) gets its
    part's own seed. An engine found dead (``workers.pool``, :mod:`algorithms.engine_pool`) is
    dropped and its part generated again on the survivors, the same groups from the same seeds.

    Raises:
        StepError: a collector failed or timed out, or no engine is left; what the others
            delivered is released first.
    """
    pool = workers.pool
    row_seeded = (len(workers.collectors) if pool is None else pool.size) > 1
    parts: list[tuple[int, dict[str, Any]]] = []  # (position of its first job, result)
    queue = _positioned(spread(list(jobs), len(workers.collectors)))  # parts still to generate
    with timer("generate"):
        transport.driver_bytes += payload_bytes(list(jobs))
        while queue:
            # One part per engine a round; parts handed back by lost engines are split over the
            # survivors, and wait for a later round where there are more parts than engines.
            queue = _split_to(queue, len(workers.collectors))
            chunks, queue = queue[: len(workers.collectors)], queue[len(workers.collectors) :]
            # Each part seeded by its first group: an engine that draws from the call's seed (vLLM)
            # never shares a stream with another engine's part.
            calls = [
                c.collect.remote(ch, generation_seed(cfg.trainer.seed, ch[0].group_id), row_seeded)
                for c, (_, ch) in zip(workers.collectors, chunks)
            ]
            names = [f"collector{i}" if i else "collector" for i in range(len(calls))]
            outcomes = settle(calls, cfg.trainer.step_timeout_s, f"step {step} collect", names)
            failed = [i for i, o in enumerate(outcomes) if isinstance(o, StepError)]
            for i, o in enumerate(outcomes):
                if not isinstance(o, StepError):
                    parts.append((chunks[i][0], o))
            if pool is not None:
                pool.generated([i for i in range(len(outcomes)) if i not in failed])
            if not failed:
                continue
            lost = [i for i in failed if pool is not None and pool.is_lost(i)]
            errors = [outcomes[i] for i in failed]
            if len(lost) < len(failed) or pool is None:
                _release_parts(transport, [res for _, res in parts])
                raise next(e for i, e in zip(failed, errors) if i not in lost)
            losses = pool.drop(lost, step, [outcomes[i] for i in lost])
            back = [chunks[i] for i in lost]
            queue.extend(back)
            pool.requeued_groups += sum(len(ch) for _, ch in back)
            if not workers.collectors:
                _release_parts(transport, [res for _, res in parts])
                raise pool.no_engine_left(step, outcomes[lost[-1]])
            pool.resumed(losses)
    parts.sort(key=lambda p: p[0])
    results = [res for _, res in parts]
    transport.driver_bytes += sum(payload_bytes(res) for res in results)
    gids = [g for res in results for g in res["group_ids"]]
    groups = [len(res["group_ids"]) for res in results]
    batch = RolloutBatch(
        handle=results[0]["handle"] if len(results) == 1 else transport.concat([r["handle"] for r in results]),
        rewards=torch.cat([res["rewards"] for res in results]),
        group_size=cfg.generation.n,
        group_ids=gids,
        versions=[int(res["weight_version"]) for res, k in zip(results, groups) for _ in range(k)],
        response_len=sum(float(res["response_len"]) * k for res, k in zip(results, groups)) / len(gids),
        prompts=[str(getattr(j.record, "prompt", "")) for j in jobs],
    )
    batch.row["dp_bytes_collect"] = sum(int(res["dp_bytes"]) for res in results)
    for res in results:
        transport.ops.extend(res.get("ops", ()))
    # The trainer waits for the whole generation; the generators work only inside it (summed).
    batch.row["trainer_idle_s"] = timer.seconds["generate"]
    batch.row["generator_busy_s"] = sum(float(res["generator_busy_s"]) for res in results)
    batch.row["reward_timeouts"] = sum(int(res["reward_timeouts"]) for res in results)
    return batch


def _positioned(chunks: list[list[Job]]) -> list[tuple[int, list[Job]]]:
    """Each chunk with the position of its first job among all of them."""
    out, at = [], 0
    for ch in chunks:
        out.append((at, ch))
        at += len(ch)
    return out


def _split_to(chunks: list[tuple[int, list[Job]]], engines: int) -> list[tuple[int, list[Job]]]:
    """``chunks`` with the largest split in two (contiguous halves) until there are ``engines``
    of them or none has two jobs left."""
    chunks = list(chunks)
    while len(chunks) < engines:
        i = max(range(len(chunks)), key=lambda j: len(chunks[j][1]))
        at, ch = chunks[i]
        if len(ch) < 2:
            break
        half = (len(ch) + 1) // 2
        chunks[i : i + 1] = [(at, ch[:half]), (at + half, ch[half:])]
    return chunks


def _release_parts(transport: Transport, results: Sequence[Mapping[str, Any]]) -> None:
    """After a failed collect: the parts delivered leave the store (a failed collector rolled
    its own part back)."""
    for res in results:
        try:
            transport.release(res["handle"])
        except Exception as e:  # noqa: BLE001 - the step's own error is the one to raise
            print(f"step collect: could not release a delivered part: {e}", file=sys.stderr)
