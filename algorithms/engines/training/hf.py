"""The Hugging Face training engine: the policy's ``transformers`` model trained with torch,
data-parallel (``policy.backend=torch``)."""

from __future__ import annotations

import copy
from collections.abc import Iterable, Mapping

import torch
from tensordict import TensorDict

from algorithms.config import TrainerConfig
from algorithms.engines.training.base import Scored, TrainingEngine, Which
from algorithms.losses import PolicyLoss
from algorithms.models import build_model, pad_batch, save_pretrained_dir, sequence_logprobs
from nemo_dataplane.codec import jagged_rows

__all__ = ["HFTrainingEngine", "model_inputs"]


def model_inputs(mb: TensorDict, pad_id: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``input_ids [n, L]``, ``attention_mask [n, L]``, ``response_mask [n, L]`` for a micro-batch
    with a jagged ``input_ids`` field and a ``prompt_len`` field (response = positions >= prompt_len)."""
    input_ids, attn = pad_batch(jagged_rows(mb["input_ids"]), pad_id)
    pos = torch.arange(input_ids.shape[1]).unsqueeze(0)
    response = (pos >= mb["prompt_len"].reshape(-1, 1)) & attn.bool()
    return input_ids.to(device), attn.to(device), response.to(device)


class HFTrainingEngine(TrainingEngine):
    """``policy.model`` built with ``transformers`` (random init or a local directory) in the
    run's precision (:mod:`algorithms.precision`), a frozen deep copy as the reference, AdamW.
    Args: the trainer config, the device, the tokenizer's
    ``vocab_size`` and ``pad_id``, this policy rank."""

    name = "torch"

    def __init__(
        self,
        cfg: TrainerConfig,
        device: torch.device,
        *,
        vocab_size: int,
        pad_id: int,
        rank: int = 0,
        loss: PolicyLoss | None = None,
    ) -> None:
        super().__init__(cfg, device, rank, loss)
        self.pad_id = pad_id
        self.model = build_model(cfg.policy.model, vocab_size=vocab_size, device=device)
        if cfg.policy.activation_checkpointing:
            # Non-reentrant: the only kind that composes with fully_shard and no_grad scoring.
            self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})  # type: ignore[operator]  # transformers' stubs
        self._setup()

    def _setup(self) -> None:
        """Make the float32 model trainable, copy the reference, make the optimizer. Engines
        whose setup needs the process group (sharding) do it in :meth:`connect` instead."""
        self.trained = self.precision.train(self.model)  # casts the model first: the reference copies it
        self.ref_model = copy.deepcopy(self.model)
        self._freeze_reference()
        self.optimizer = self._make_optimizer()

    def _model(self, which: Which) -> torch.nn.Module:
        return self.model if which == "policy" else self.ref_model

    def score(self, which: Which, mb: TensorDict, entropy: bool) -> Scored:
        ids, attn, resp = model_inputs(mb, self.pad_id, self.device)
        mask = (resp[:, 1:] & attn[:, 1:].bool()).float()
        model = self._model(which)
        if entropy:
            lp, ent = sequence_logprobs(model, ids, attn, resp, return_entropy=True, temperature=self.temperature)
            return lp, ent, mask
        return sequence_logprobs(model, ids, attn, resp, temperature=self.temperature), None, mask

    def named_for_refit(self) -> Iterable[tuple[str, torch.Tensor]]:
        return self.model.named_parameters()

    def refit_shapes(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        return {n: (tuple(p.shape), p.dtype) for n, p in self.model.named_parameters()}

    def save_hf(self, directory: str, special_ids: Mapping[str, int | None]) -> bool:
        # Every replica holds the same whole weights: policy rank 0 writes them.
        if self.rank != 0:
            return False
        save_pretrained_dir(self.model, directory, special_ids=special_ids)
        return True
