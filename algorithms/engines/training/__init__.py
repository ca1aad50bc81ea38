"""Training engines behind one contract (:class:`TrainingEngine`): what a policy rank computes with.

``policy.backend`` picks one, here and nowhere else: ``torch`` (:mod:`.hf`, the Hugging Face model
trained data-parallel) or ``megatron`` (:mod:`.megatron`, Megatron-core GPT with tensor
parallelism; extra ``megatron``, CUDA only, imported by that engine's methods only).
``mcore_convert`` and ``packing`` are pure torch.
"""

from __future__ import annotations

import torch

from algorithms.config import TrainerConfig
from algorithms.engines.training.base import Prepared, TrainingEngine
from algorithms.engines.training.hf import HFTrainingEngine
from algorithms.engines.training.megatron import MegatronEngine

__all__ = ["Prepared", "TrainingEngine", "build_training_engine"]


def build_training_engine(cfg: TrainerConfig, device: torch.device, *, vocab_size: int, pad_id: int) -> TrainingEngine:
    """The engine ``policy.backend`` names, holding ``policy.model``'s initial weights on ``device``."""
    engine = MegatronEngine if cfg.policy.backend == "megatron" else HFTrainingEngine
    return engine(cfg, device, vocab_size=vocab_size, pad_id=pad_id)
