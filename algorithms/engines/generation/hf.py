"""The Hugging Face engine: the policy's architecture in the generator process, sampled token by
token with a KV cache (``algorithms.models.generate``); refits land in its parameters in place.

Sampling draws from one ``torch.Generator`` seeded per call, so a batch depends only on the
weights and the seed: the data-plane and legacy runs, and a resumed run, sample the same tokens.
Only the full distribution is sampled (``top_p`` must be 1).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

import torch

from algorithms.config import TrainerConfig
from algorithms.engines.generation.base import GenerationEngine, RefitSpec, SamplingSpec
from algorithms.models import build_model, sample
from algorithms.precision import cast_weights, precision_of
from algorithms.tokenizers import build_tokenizer
from nemo_dataplane.distributed.stateless_group import StatelessProcessGroup
from nemo_dataplane.refit import WeightReceiver, build_weight_receiver

__all__ = ["HFEngine"]


def _slowed(should_stop: Callable[[], bool] | None, delay_s: float) -> Callable[[], bool]:
    """``should_stop`` that first sleeps ``delay_s`` (asked once per token: a slower sampler)."""

    def check() -> bool:
        time.sleep(delay_s)
        return should_stop() if should_stop is not None else False

    return check


class HFEngine(GenerationEngine):
    """Args: ``model_cfg`` (``policy.model``), ``device``, the tokenizer's ``vocab_size``,
    ``eos_id`` and ``pad_id``; ``dtype``: the weights' (the trainer's precision: refits arrive in
    it)."""

    name = "hf"

    def __init__(
        self,
        model_cfg: Mapping[str, Any],
        *,
        device: str = "cpu",
        vocab_size: int,
        eos_id: int,
        pad_id: int,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__()
        self.device = torch.device("cuda" if device == "cuda" else "cpu")
        self.eos_id, self.pad_id = int(eos_id), int(pad_id)
        self.model = cast_weights(build_model(model_cfg, vocab_size=vocab_size).to(self.device), dtype)
        self.model.eval()
        for p in self.model.parameters():
            p.requires_grad_(False)
        self._group: StatelessProcessGroup | None = None
        self._receiver: WeightReceiver | None = None

    token_delay_s = 0.0  # debug.token_delay_s

    @classmethod
    def from_config(cls, cfg: TrainerConfig) -> HFEngine:
        tok = build_tokenizer(cfg)
        engine = cls(
            cfg.policy.model,
            device=cfg.generation.device,
            vocab_size=tok.vocab_size,
            eos_id=tok.eos_id,
            pad_id=tok.pad_id,
            dtype=precision_of(cfg).dtype,
        )
        engine.token_delay_s = cfg.debug.token_delay_s
        return engine

    def _generate(
        self, prompts: list[list[int]], n: int, spec: SamplingSpec, should_stop: Callable[[], bool] | None
    ) -> tuple[list[list[int]], list[list[float]], list[bool]]:
        if spec.top_p != 1.0:
            raise ValueError(
                f"the hf generation backend samples the full distribution; top_p={spec.top_p} "
                "needs generation.backend=vllm"
            )
        gen = torch.Generator().manual_seed(int(spec.seed))
        if self.token_delay_s:
            should_stop = _slowed(should_stop, self.token_delay_s)
        out = sample(
            self.model,
            prompts,
            n,
            spec.max_new_tokens,
            spec.temperature,
            gen,
            self.eos_id,
            self.pad_id,
            row_seeds=spec.row_seeds,
            limits=spec.limits,
            ignore_eos=spec.ignore_eos,
            should_stop=should_stop,
            min_running=spec.min_running if should_stop is not None else 0.0,
            on_token=self._beat,
        )
        return out.tokens, out.logprobs, out.finished

    def _init_refit(self, host: str, port: int, world_size: int, rank: int, spec: RefitSpec) -> None:
        self._group = spec.join(host, port, world_size, rank)
        # Where the parameters live, not the group's device (an ipc refit's control group is gloo)
        # nor the current device: that is per thread, and a threaded actor may call from another.
        dev = next(self.model.parameters()).device
        self._receiver = build_weight_receiver(
            spec.transfer, self._group, self.model.named_parameters, senders=spec.senders, device=dev
        )
        self._receiver.prepare_refit_info()

    def _receive_weights(self) -> int:
        if self._receiver is None:
            raise RuntimeError("hf engine: no refit receiver")
        return int(self._receiver.receive_weights())

    def _close_refit(self) -> None:
        if self._group is not None:
            try:
                self._group.destroy()
            except Exception:  # noqa: BLE001 - leaving; destroy reports its own failures
                pass
            self._group = self._receiver = None

    def _shutdown(self) -> None:
        self._close_refit()
