"""Generation worker: its own copy of the policy, refreshed by refit after every step (Ray actor).

Sampling is seeded per call (``seed``), so a step's rollouts depend only on the weights and the
seed, never on what ran before; that is what makes the data-plane and legacy runs, and a resumed
run, sample the same tokens.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch


class GeneratorWorker:
    """Samples ``n`` responses per prompt; receives weights over the stateless refit group.

    Args:
        cfg: ``TrainerConfig.to_dict()``.
    """

    def __init__(self, cfg: Mapping[str, Any]) -> None:
        from algorithms.models import build_model
        from algorithms.tasks import CharTokenizer

        self.cfg = cfg
        torch.set_num_threads(int(cfg["trainer"]["num_threads"]))
        self.device = torch.device("cuda" if cfg["generation"]["device"] == "cuda" else "cpu")
        self.tokenizer = CharTokenizer()
        self.model = build_model(cfg["policy"]["model"], vocab_size=self.tokenizer.vocab_size).to(self.device)
        self.model.eval()
        for p in self.model.parameters():
            p.requires_grad_(False)
        self.weight_version = -1  # no refit received yet
        self._group: Any = None
        self._receiver: Any = None

    def ready(self) -> bool:
        return True

    def init_refit(self, host: str, port: int, world_size: int, rank: int = 1) -> None:
        """Join the refit group as a receiver (collective with policy rank 0)."""
        from nemo_dataplane.distributed.stateless_group import StatelessProcessGroup
        from nemo_dataplane.refit.packed import RefitReceiver

        rcfg = self.cfg["refit"]
        self._group = StatelessProcessGroup(
            host, port, rank, world_size, backend=rcfg["backend"], timeout=rcfg["timeout_s"], group_name="refit"
        )
        self._receiver = RefitReceiver(self._group, self.model.named_parameters, src=0)
        self._receiver.prepare_refit_info()

    def receive_weights(self) -> tuple[int, float]:
        """Receive one refit (collective); returns ``(version, seconds)``."""
        t0 = time.perf_counter()
        self.weight_version = int(self._receiver.receive_weights())
        return self.weight_version, time.perf_counter() - t0

    def generate(
        self, prompt_ids: Sequence[Sequence[int]], n: int, seed: int, *, temperature: float | None = None
    ) -> tuple[list[list[int]], list[list[float]], int]:
        """``len(prompt_ids) * n`` responses (group-major), the log-prob of each sampled token
        under the sampling distribution, and the weight version that drew them (one version per
        call: a refit is only ever installed between calls)."""
        from algorithms.models import generate

        g = self.cfg["generation"]
        gen = torch.Generator().manual_seed(int(seed))
        tokens, logprobs = generate(
            self.model, prompt_ids, n, int(g["max_new_tokens"]),
            float(g["temperature"] if temperature is None else temperature), gen,
            self.tokenizer.eos_id, self.tokenizer.pad_id, return_logprobs=True,
        )
        return tokens, logprobs, self.weight_version

    def shutdown(self) -> None:
        if self._group is not None:
            try:
                self._group.destroy()
            except Exception:  # noqa: BLE001 - shutting down
                pass
