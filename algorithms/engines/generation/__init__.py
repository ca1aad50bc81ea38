"""Generation engines behind one contract (:class:`GenerationEngine`): sample ``n`` responses per
token-id prompt with the log-prob of every sampled token, take weight refits over the project's
stateless process group, report the weight version.

``generation.backend`` picks one: ``hf`` (:mod:`.hf`, a Hugging Face model sampled token by token
in the generator process) or ``vllm`` (:mod:`.vllm`, a ``vllm.LLM`` engine). ``build_engine``
imports only the backend it builds, so ``hf`` never imports vLLM.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from algorithms.engines.generation.base import BACKENDS, GenerationEngine, Rollouts, SamplingSpec

__all__ = ["BACKENDS", "GenerationEngine", "Rollouts", "SamplingSpec", "build_engine"]


def build_engine(cfg: Mapping[str, Any]) -> GenerationEngine:
    """The engine ``cfg["generation"]["backend"]`` names, built from ``cfg`` (``TrainerConfig.to_dict()``)
    with the policy's initial weights (``policy.model``)."""
    backend = cfg["generation"].get("backend", "hf")
    if backend == "hf":
        from algorithms.engines.generation.hf import HFEngine

        return HFEngine.from_config(cfg)
    if backend == "vllm":
        from algorithms.engines.generation.vllm import VLLMEngine

        return VLLMEngine.from_config(cfg)
    raise ValueError(f"generation.backend must be one of {list(BACKENDS)}, got {backend!r}")
