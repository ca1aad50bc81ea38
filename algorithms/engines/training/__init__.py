"""Training engines behind one contract (:class:`TrainingEngine`): what a policy rank computes with.

``policy.backend`` and ``policy.sharding`` pick one, here and nowhere else: ``torch`` (:mod:`.hf`,
the Hugging Face model replicated on every rank, or with ``sharding=fsdp`` :mod:`.fsdp`, the same
model fully sharded with FSDP2) or ``megatron`` (:mod:`.megatron`, Megatron-core GPT with tensor
parallelism; extra ``megatron``, CUDA only, imported by that engine's methods only).
``mcore_convert``, ``packing`` and ``hf_export`` are pure torch.
"""

from __future__ import annotations

import torch

from algorithms.config import TrainerConfig
from algorithms.engines.training.base import Prepared, TrainingEngine
from algorithms.engines.training.fsdp import FSDPTrainingEngine
from algorithms.engines.training.hf import HFTrainingEngine
from algorithms.engines.training.megatron import MegatronEngine
from algorithms.losses import loss_of

__all__ = ["Prepared", "TrainingEngine", "build_training_engine"]


def build_training_engine(
    cfg: TrainerConfig, device: torch.device, *, vocab_size: int, pad_id: int, rank: int = 0
) -> TrainingEngine:
    """The engine ``policy.backend`` and ``policy.sharding`` name, holding ``policy.model``'s
    initial weights on ``device``, for policy rank ``rank``."""
    engine: type[HFTrainingEngine]
    if cfg.policy.backend == "megatron":
        engine = MegatronEngine
    elif cfg.policy.sharding == "fsdp":
        engine = FSDPTrainingEngine
    else:
        engine = HFTrainingEngine
    return engine(cfg, device, vocab_size=vocab_size, pad_id=pad_id, rank=rank, loss=loss_of(cfg))
