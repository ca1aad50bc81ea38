"""Synchronous GRPO trainer: ``python -m algorithms.grpo_sync --config FILE [dotted.key=value ...]``.

Each step: the collector generates this step's prompts with the current weights
(:func:`algorithms.step.collect`), then the shared step body trains on them, releases their keys
and refits the generator (:func:`algorithms.step.train_on_batch`). Set-up, checkpoints, shutdown
and the summary are :class:`algorithms.trainer.Trainer`'s; the asynchronous trainer
(:mod:`algorithms.grpo_async`) differs only in where a batch comes from.

Exit status: 0 on success, 1 when a step or the set-up failed (the worker's error is printed),
2 for a bad config, 3 when the run finished but leaked keys in the store, 130 on Ctrl-C, 143 on
SIGTERM. In every case the store is emptied, the store and the workers are shut down, and the Ray
cluster the run started is stopped.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Sequence
from typing import Any

from algorithms.cli import main as _main
from algorithms.config import TrainerConfig
from algorithms.faults import maybe_kill_store
from algorithms.inputs import load_datasets
from algorithms.metrics import PhaseTimer
from algorithms.rollouts import Job
from algorithms.step import train_on_batch
from algorithms.sync_source import collect
from algorithms.tasks import PromptIterator
from algorithms.trainer import DATA_PLANE_MODULES, Trainer, data_plane_modules_loaded

__all__ = ["DATA_PLANE_MODULES", "SyncTrainer", "data_plane_modules_loaded", "load_datasets", "main"]


class SyncTrainer(Trainer):
    """Synchronous GRPO: generate a step's batch, train on it, refit, repeat."""

    name = "grpo_sync"

    @classmethod
    def num_collectors(cls, cfg: TrainerConfig) -> int:
        """One collector (with its generator) per generation engine."""
        return cfg.generation.num_engines

    def _init_data(self, train: list[Any]) -> None:
        self.prompts = PromptIterator(train, self.cfg.grpo.prompts_per_step, self.cfg.trainer.seed)

    def _driver_state(self) -> dict[str, Any]:
        return self.prompts.state_dict()

    def _load_driver_state(self, state: dict[str, Any]) -> None:
        self.prompts.load_state_dict(state)

    def _loop(self, start: int, val: list[Any]) -> int:
        cfg = self.cfg
        assert self.workers is not None
        G = cfg.grpo.prompts_per_step
        self._banner("")
        for step in range(start, cfg.trainer.steps):
            maybe_kill_store(cfg.debug, step, cfg.data_plane)  # fault hook (chaos tests); no-op otherwise
            t0 = time.perf_counter()
            timer = PhaseTimer()
            # Group ids (and with them the sampling seed) follow from the step: a resumed run and
            # the legacy transport draw exactly the same samples.
            jobs = [Job(step * G + i, step * G + i, r) for i, r in enumerate(self.prompts.next_batch())]
            self._collecting = {j.group_id for j in jobs}
            try:
                batch = collect(cfg, self.workers, self.transport, jobs, timer, step)
            except Exception:
                # A failed collect rolled its rows back (the sink's contract): none may remain. An
                # interrupt (Ctrl-C) may land while the collector still writes them: in flight.
                self._collecting = set()
                raise
            self._collecting = set()  # the batch's handle releases them from here on
            result = train_on_batch(cfg, self.workers, self.transport, batch, step, timer, behaviour=False, t_start=t0)
            self._after_step(step, result, val)
        return 0

    def _groups_in_flight(self) -> set[int]:
        return set(getattr(self, "_collecting", ()))


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry point; returns the exit status."""
    return _main(SyncTrainer, argv)


if __name__ == "__main__":
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    sys.exit(main())
