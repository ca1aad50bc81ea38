"""Generation engines behind one contract (:class:`GenerationEngine`): sample ``n`` responses per
token-id prompt with the log-prob of every sampled token, take weight refits over the project's
stateless process group, report the weight version.

``generation.backend`` picks one: ``hf`` (:mod:`.hf`, a Hugging Face model sampled token by token
in the generator process) or ``vllm`` (:mod:`.vllm`, a ``vllm.LLM`` engine). vLLM itself (an
optional dependency) is imported only by a vLLM engine's methods, so ``hf`` never imports it.
"""

from __future__ import annotations

from algorithms.config import TrainerConfig
from algorithms.engines.generation.base import BACKENDS, GenerationEngine, RefitSpec, Rollouts, SamplingSpec
from algorithms.engines.generation.hf import HFEngine
from algorithms.engines.generation.vllm import VLLMEngine

__all__ = [
    "BACKENDS",
    "GenerationEngine",
    "RefitSpec",
    "Rollouts",
    "SamplingSpec",
    "build_engine",
    "check_generation_config",
]


def _engine_class(cfg: TrainerConfig) -> type[HFEngine] | type[VLLMEngine]:
    backend = cfg.generation.backend
    if backend == "hf":
        return HFEngine
    if backend == "vllm":
        return VLLMEngine
    raise ValueError(f"generation.backend must be one of {list(BACKENDS)}, got {backend!r}")


def check_generation_config(cfg: TrainerConfig) -> None:
    """Refuse, before any worker starts, a model the engine ``generation.backend`` names cannot
    run (``ConfigError`` naming the key); nothing is built and vLLM is not imported."""
    _engine_class(cfg).check_config(cfg)


def build_engine(cfg: TrainerConfig) -> GenerationEngine:
    """The engine ``generation.backend`` names, built from ``cfg`` with the policy's initial
    weights (``policy.model``) in the run's precision."""
    return _engine_class(cfg).from_config(cfg)
