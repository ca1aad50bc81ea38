"""Asynchronous GRPO trainer: ``python -m algorithms.grpo_async --config FILE [dotted.key=value ...]``.

Generation keeps producing while the policy trains; the store decouples them. Collectors
(``async.num_collectors`` Ray actors) generate queued prompts a few groups at a time with
whatever weights the generator holds and stream them into the store's ``rollouts`` partition
(keys ``v{version}/g{group}/s{i}``, behaviour log-probs in ``gen_logprobs``). The driver admits
prompts within the lag bound, claims whole groups as they are produced
(:class:`algorithms.rollout_buffer.RolloutBuffer`), and runs the same step body as the sync
trainer (:func:`algorithms.step.train_on_batch`) with the off-policy correction on: train,
release the batch's keys, refit the generator (installed between two generate calls).

On the in-memory baseline (``data_plane.enabled=false``) the same loop runs; finished groups
wait in the collectors and travel to the driver through Ray (the transport decides).

Every step logs the staleness of the groups it trained (mean, max), groups dropped as too old,
the trainer's and the collectors' idle seconds, keys outstanding over the whole store, the
behaviour/proximal mismatch (``behaviour_kl``) and the fraction of tokens the correction
truncated. ``trained_groups.jsonl`` records, per step, the prompt handouts trained (what the
lossless-resume test compares). Exit codes as :mod:`algorithms.grpo_sync`.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Sequence
from typing import Any

from algorithms.cli import main as _main
from algorithms.config import ConfigError, TrainerConfig, async_min_rows, check_sync_only
from algorithms.engine_pool import CollectorPool
from algorithms.faults import maybe_kill_store
from algorithms.metrics import PhaseTimer
from algorithms.remote import gather
from algorithms.rollout_buffer import PromptLedger, RolloutBuffer, make_buffer
from algorithms.run_dir import RunPlan
from algorithms.step import train_on_batch
from algorithms.tasks import PromptIterator
from algorithms.trainer import Trainer

__all__ = ["AsyncTrainer", "main"]


class AsyncTrainer(Trainer):
    """Asynchronous GRPO: streaming rollouts, a bounded lag, bounded memory, lossless resume."""

    name = "grpo_async"

    def prepare(self) -> RunPlan:
        """What the sync trainer checks, and what streaming needs of the store: claims, and a
        capacity it can progress with; refused before anything is written or started (the
        CLI's exit 2)."""
        self.transport.require_claims()
        check_sync_only(self.cfg)
        if self.cfg.generation.num_engines != 1:
            raise ConfigError(
                f"generation.num_engines={self.cfg.generation.num_engines} sets grpo_sync's engines; grpo_async "
                "runs one engine per collector: set async.num_collectors instead"
            )
        cap, need = self.transport.capacity_rows(), async_min_rows(self.cfg)
        if cap is not None and cap < need:
            raise ConfigError(  # this run could never make progress
                f"data_plane.max_rows={cap} is below what grpo_async needs to progress, (grpo.prompts_per_step + "
                f"async.groups_per_generation - 1) * generation.n = {need} rows"
            )
        return super().prepare()

    def _init_data(self, train: list[Any]) -> None:
        self.ledger = PromptLedger(PromptIterator(train, 1, self.cfg.trainer.seed))
        self.buffer: RolloutBuffer | None = None
        self._buffer_state: dict[str, Any] = {}  # a resume's, restored once the transport is up

    def _groups_in_flight(self) -> set[int]:
        ledger = getattr(self, "ledger", None)  # none before the run set it up
        return set(ledger.inflight) if ledger is not None else set()

    def _start_replacement(self, collector: Any) -> None:
        """A replacement collector produces once the refit that joined it gave it the weights."""
        a, G = self.cfg.async_, self.cfg.grpo.prompts_per_step
        collector.start.remote(a.inflight_groups(G), a.generation_groups(G))

    def _driver_state(self) -> dict[str, Any]:
        assert self.buffer is not None
        return {**self.ledger.state_dict(), "buffer": self.buffer.state_dict()}

    def _load_driver_state(self, state: dict[str, Any]) -> None:
        self.ledger.load_state_dict(state)
        self._buffer_state = dict(state.get("buffer") or {})

    @classmethod
    def num_collectors(cls, cfg: TrainerConfig) -> int:
        return cfg.async_.num_collectors

    def _trained_log(self, start: int) -> Any:
        """``trained_groups.jsonl``, truncated to the steps before ``start`` (a resume replays the rest)."""
        path = self.out / "trained_groups.jsonl"
        keep = []
        if start and path.exists():
            keep = [ln for ln in path.read_text().splitlines() if ln.strip() and json.loads(ln)["step"] < start]
        path.write_text("".join(ln + "\n" for ln in keep))
        return path.open("a")

    def _loop(self, start: int, val: list[Any]) -> int:
        cfg, a = self.cfg, self.cfg.async_
        assert self.workers is not None
        G, n = cfg.grpo.prompts_per_step, cfg.generation.n
        pool = CollectorPool(self.workers.collectors, cfg.trainer.step_timeout_s, self.workers.pool)
        buffer = self.buffer = make_buffer(cfg, pool, self.transport, self.ledger)
        gather(
            [c.start.remote(a.inflight_groups(G), a.generation_groups(G)) for c in self.workers.collectors],
            cfg.trainer.startup_timeout_s,
            "collector start",
        )
        bound = (a.inflight_groups(G) + G + (len(self.workers.collectors) - 1) * a.generation_groups(G)) * n
        self.summary["keys_outstanding_bound"] = bound
        self._banner(
            f", mode={a.mode}, max_staleness={a.max_staleness}, max_inflight_groups={a.inflight_groups(G)}, "
            f"groups_per_generation={a.generation_groups(G)}"
        )
        self.summary["async_mode"] = a.mode
        buffer.load_state_dict(self._buffer_state, start)
        buffer.top_up()
        idle_before = busy_before = partial_before = timeouts_before = 0.0
        with self._trained_log(start) as trained_log:
            for step in range(start, cfg.trainer.steps):
                maybe_kill_store(cfg.debug, step, cfg.data_plane)  # fault hook (chaos tests); no-op otherwise
                t0 = time.perf_counter()
                timer = PhaseTimer()
                with timer("wait"):
                    batch = buffer.next_batch(step)
                st = buffer.stats
                batch.row.update(
                    staleness_mean=sum(st.staleness) / len(st.staleness),
                    staleness_max=max(st.staleness),
                    groups_dropped_stale=st.dropped_stale,
                    groups_requeued_failed=st.requeued_failed,
                    trainer_idle_s=st.wait_s,
                )
                busy = buffer.collector_stats.get("generator_busy_s", 0.0)
                batch.row["generator_busy_s"], busy_before = busy - busy_before, busy
                partial = buffer.collector_stats.get("partial_samples", 0.0)
                batch.row["partial_samples"], partial_before = int(partial - partial_before), partial
                timeouts = buffer.collector_stats.get("reward_timeouts", 0.0)
                batch.row["reward_timeouts"], timeouts_before = int(timeouts - timeouts_before), timeouts
                result = train_on_batch(
                    cfg,
                    self.workers,
                    self.transport,
                    batch,
                    step,
                    timer,
                    behaviour=True,
                    t_start=t0,
                    before_refit=buffer.before_refit,
                )
                jobs = self.ledger.trained(batch.group_ids)
                trained_log.write(
                    json.dumps(
                        {
                            "step": step,
                            "handouts": [j.handout for j in jobs],
                            "groups": batch.group_ids,
                            "versions": batch.versions,
                        }
                    )
                    + "\n"
                )
                trained_log.flush()
                buffer.top_up()
                row = result.row
                idle = buffer.collector_stats.get("idle_s", 0.0)
                row["collector_idle_s"], idle_before = idle - idle_before, idle
                row["collector_store_full_waits"] = int(buffer.collector_stats.get("store_full_waits", 0))  # cumulative
                if row["keys_outstanding"] > bound:
                    raise RuntimeError(
                        f"step {step}: {row['keys_outstanding']} keys outstanding in the store exceed the bound "
                        f"{bound} = (max_inflight_groups + prompts_per_step) * n: something leaks"
                    )
                result.staleness = list(st.staleness)
                self._after_step(step, result, val)
        state = self.ledger.state_dict()
        self.summary["prompts_in_flight_at_exit"] = [h for h, _ in state["pending"]]
        self.summary["prompts_handed_out"] = state["next_handout"]
        self.summary["collector_store_full_waits"] = int(buffer.collector_stats.get("store_full_waits", 0))
        return 0


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry point; returns the exit status."""
    return _main(AsyncTrainer, argv)


if __name__ == "__main__":
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    sys.exit(main())
