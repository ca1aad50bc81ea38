"""What a refit carries (``generation.vllm.quantization``): the trainer's weights as they are, or
their decoder-layer matrices quantized to FP8 for a vLLM engine that runs FP8 weights.

:func:`refit_weights` is the only reader of the key. The policy rank that sends, the engine that
receives and the checkpoint the engine starts from all take the layout of the
:class:`RefitWeights` it returns, so the two ends agree by construction and the layout check of
every refit names any tensor where they do not.

* ``null``: every weight in the trainer's dtype.
* ``fp8``: each matrix of the decoder layers (attention and MLP projections) as
  ``float8_e4m3fn`` bytes plus one fp32 scale (``<name>_scale``); vLLM requantizes a fused
  module's shards (q, k, v; gate, up) to one scale when it installs them, as it does loading an
  FP8 checkpoint. Embeddings, norms and the LM head travel unquantized (vLLM does not quantize them).
* ``fp8_block``: the same matrices with one scale per 128 x 128 block (``<name>_scale_inv``),
  installed without requantizing.

The engine installs a refit through vLLM's in-place reload of checkpoint-format weights, which
re-runs the FP8 layers' post-load processing; nothing is read from disk.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from algorithms.config import ConfigError, TrainerConfig
from algorithms.models import model_config_values
from nemo_dataplane.refit.fp8 import Fp8Scheme, Fp8Source, fp8_layout
from nemo_dataplane.refit.protocol import NamedTensors, TensorSpec

__all__ = [
    "FP8_BLOCK",
    "QUANTIZATION_KEY",
    "RefitWeights",
    "check_quantization",
    "form_of",
    "fp8_targets",
    "refit_weights",
]

QUANTIZATION_KEY = "generation.vllm.quantization"
FP8_BLOCK = (128, 128)  # DeepSeek-V3's block, the one vLLM's block-FP8 kernels are tuned for
_SCHEMES: dict[str | None, Fp8Scheme | None] = {None: None, "fp8": Fp8Scheme(), "fp8_block": Fp8Scheme(FP8_BLOCK)}
# The matrices vLLM's FP8 linear layers hold: 2-D weights inside the decoder layers.
_TARGET = re.compile(r"(^|\.)layers\.\d+\..+\.weight$")

Shapes = Mapping[str, tuple[Sequence[int], torch.dtype | str]]


def fp8_targets(shapes: Shapes) -> list[str]:
    """The names among ``shapes`` (trainer names, in order) that an FP8 refit quantizes."""
    return [n for n, (shape, _) in shapes.items() if len(shape) == 2 and _TARGET.search(n)]


@dataclass(frozen=True)
class RefitWeights:
    """The form of the refit's tensors; ``scheme=None``: the trainer's weights as they are."""

    scheme: Fp8Scheme | None = None

    @property
    def quantized(self) -> bool:
        return self.scheme is not None

    def layout(self, shapes: Shapes) -> dict[str, tuple[tuple[int, ...], str]]:
        """Name -> (shape, dtype name) of what the sender sends, from the trainer's ``shapes``."""
        if self.scheme is None:
            return {
                n: (tuple(int(s) for s in shape), str(dt).removeprefix("torch.")) for n, (shape, dt) in shapes.items()
            }
        return fp8_layout(shapes, fp8_targets(shapes), self.scheme)

    def nbytes(self, shapes: Shapes) -> int:
        """The bytes one refit sends, from the trainer's ``shapes``."""
        return sum(TensorSpec(n, shape, dt).nbytes for n, (shape, dt) in self.layout(shapes).items())

    def source(self, named: NamedTensors, shapes: Shapes) -> NamedTensors:
        """The sender's tensors: ``named`` itself, or FP8 bytes and scales of its targets."""
        if self.scheme is None:
            return named
        return Fp8Source(named, fp8_targets(shapes), self.scheme)

    def checkpoint(self, state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``state`` (a saved checkpoint's tensors) in the refit's form: what the engine loads first."""
        if self.scheme is None:
            return dict(state)
        shapes = {n: (tuple(t.shape), t.dtype) for n, t in state.items()}
        return dict(Fp8Source(state, fp8_targets(shapes), self.scheme)())

    def quantization_config(self) -> dict[str, Any] | None:
        """The ``quantization_config`` of the checkpoint's ``config.json`` (vLLM's ``fp8`` method
        reading FP8-serialized weights, activations quantized per token at run time)."""
        if self.scheme is None:
            return None
        cfg: dict[str, Any] = {"quant_method": "fp8", "activation_scheme": "dynamic"}
        if self.scheme.block is not None:
            cfg["weight_block_size"] = list(self.scheme.block)
        return cfg


def form_of(quantization: str | None) -> RefitWeights:
    """The form a ``generation.vllm.quantization`` value names (``None``: the weights as trained)."""
    if quantization not in _SCHEMES:
        raise ValueError(f"{QUANTIZATION_KEY} must be one of {list(_SCHEMES)}, got {quantization!r}")
    return RefitWeights(_SCHEMES[quantization])


def refit_weights(cfg: TrainerConfig) -> RefitWeights:
    """The form ``generation.vllm.quantization`` names (validated by :func:`check_quantization`)."""
    return form_of(cfg.generation.vllm.quantization)


def check_quantization(cfg: TrainerConfig, compute_dtype: str) -> None:
    """Refuse at config load what an FP8 refit cannot serve (``ConfigError`` naming the key):
    a compute dtype other than bf16 / fp16 (``compute_dtype``: the engine's), several senders
    (a scale covers a whole matrix, which one sender must hold), or, block-wise, fused shards
    (q, k, v sizes; the MLP's intermediate size) that are not whole blocks."""
    name = cfg.generation.vllm.quantization
    scheme = form_of(name).scheme
    if scheme is None:
        return
    if compute_dtype not in ("bfloat16", "float16"):
        raise ConfigError(
            f"{QUANTIZATION_KEY}={name} computes activations in bfloat16 or float16, got {compute_dtype}: "
            "set generation.vllm.dtype=bfloat16 (or policy.precision=bf16)"
        )
    if cfg.refit_senders != 1:
        raise ConfigError(
            f"{QUANTIZATION_KEY}={name} needs whole weights from one sender (a scale covers a whole matrix); "
            f"this run has {cfg.refit_senders} (policy.tensor_parallel_size with refit.mode=reshard, or "
            "trainer.dp_size with policy.sharding=fsdp)"
        )
    if scheme.block is not None:
        v = model_config_values(cfg.policy.model)
        heads = int(v.get("num_attention_heads", 0) or 0)
        head = int(v.get("head_dim") or (int(v.get("hidden_size", 0)) // heads if heads else 0))
        sizes = {
            "num_attention_heads * head_dim": heads * head,
            "num_key_value_heads * head_dim": int(v.get("num_key_value_heads", heads) or heads) * head,
            "intermediate_size": int(v.get("intermediate_size", 0) or 0),
        }
        bad = {k: s for k, s in sizes.items() if s and s % scheme.block[0]}
        if bad:
            raise ConfigError(
                f"{QUANTIZATION_KEY}=fp8_block: vLLM fuses q, k, v and gate, up into one matrix whose parts "
                f"must be whole {scheme.block[0]}-row blocks; policy.model has {bad}"
            )
