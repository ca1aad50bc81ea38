"""Hugging Face Llama/Qwen2 <-> Megatron-core GPT (local or TE layer spec) state dicts, per TP rank.

Pure torch: nothing here imports megatron-core, so the mapping is tested on any CPU.

Megatron-core layouts this converter produces and reads (one TP rank ``r`` of ``tp``):

* ``self_attention.linear_qkv.weight``: the rank's query groups ``[r*G/tp, (r+1)*G/tp)``, each
  group's rows being its ``H/G`` query heads, then its key head, then its value head
  (``[G/tp * (H/G + 2) * d, hidden]``): Megatron's interleaved per-group layout. Because groups
  are contiguous, rank ``r``'s block is chunk ``r`` of the full interleaved tensor.
* ``mlp.linear_fc1.weight``: ``cat(gate_r, up_r)`` where ``gate_r``/``up_r`` are chunk ``r`` of
  gate/up along dim 0 (NOT chunk ``r`` of ``cat(gate, up)``).
* column-parallel (``linear_qkv``, ``linear_fc1``), vocab-parallel (``word_embeddings``,
  ``output_layer``) shard dim 0; row-parallel (``linear_proj``, ``linear_fc2``) shard dim 1;
  norms are replicated.

The local spec keeps layer norms as modules (``input_layernorm``, ``pre_mlp_layernorm``); the
Transformer Engine spec fuses them into the next linear (``linear_qkv.layer_norm_weight``,
``linear_fc1.layer_norm_weight``): ``te=True`` selects those names.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

__all__ = [
    "GPTShape",
    "deinterleave_qkv",
    "hf_to_mcore",
    "interleave_qkv",
    "mcore_shard_to_hf",
    "mcore_to_hf",
    "shape_from_hf_config",
    "tp_split_dim",
    "transformer_kwargs",
]


@dataclass(frozen=True)
class GPTShape:
    """The dimensions the mapping needs."""

    num_layers: int
    hidden: int
    heads: int
    groups: int  # key/value heads
    head_dim: int
    ffn: int
    vocab: int
    tied: bool

    def check_tp(self, tp: int) -> None:
        """Raise ``ValueError`` naming the dimension that ``tp`` does not divide."""
        for name, n in (
            ("num_attention_heads", self.heads),
            ("num_key_value_heads", self.groups),
            ("intermediate_size", self.ffn),
            ("vocab_size", self.vocab),
        ):
            if n % tp:
                raise ValueError(f"tensor_parallel_size={tp} does not divide {name}={n}")


def _rope_theta(cfg: Any) -> float:
    theta = getattr(cfg, "rope_theta", None)
    if theta is None:
        theta = (getattr(cfg, "rope_parameters", None) or {}).get("rope_theta", 10000.0)
    return float(theta)


def shape_from_hf_config(cfg: Any) -> GPTShape:
    """A :class:`GPTShape` from a transformers ``LlamaConfig``/``Qwen2Config``."""
    heads = int(cfg.num_attention_heads)
    head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // heads)
    return GPTShape(
        int(cfg.num_hidden_layers),
        int(cfg.hidden_size),
        heads,
        int(getattr(cfg, "num_key_value_heads", None) or heads),
        head_dim,
        int(cfg.intermediate_size),
        int(cfg.vocab_size),
        bool(cfg.tie_word_embeddings),
    )


def transformer_kwargs(cfg: Any, *, tp: int = 1, bf16: bool = False) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(TransformerConfig kwargs, GPTModel kwargs)`` reproducing the HF model with no fused
    kernels (the local spec runs without Transformer Engine, apex or triton). Parameters are
    created in float32 either way; ``bf16``: the model will compute in bfloat16 (its weights
    cast by the trainer's precision), so Megatron keeps the attention softmax in float32."""
    s = shape_from_hf_config(cfg)
    s.check_tp(tp)
    if getattr(cfg, "hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act={cfg.hidden_act!r}: only SwiGLU (silu) models convert")
    arch_bias = bool(getattr(cfg, "attention_bias", False)) or getattr(cfg, "model_type", "") == "qwen2"
    tc = dict(
        num_layers=s.num_layers,
        hidden_size=s.hidden,
        num_attention_heads=s.heads,
        num_query_groups=s.groups,
        kv_channels=s.head_dim,
        ffn_hidden_size=s.ffn,
        normalization="RMSNorm",
        layernorm_epsilon=float(cfg.rms_norm_eps),
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        add_qkv_bias=arch_bias,
        tensor_model_parallel_size=tp,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        masked_softmax_fusion=False,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        params_dtype=torch.float32,
        bf16=bf16,
        attention_softmax_in_fp32=True,
    )
    gpt = dict(
        vocab_size=s.vocab,
        max_sequence_length=int(cfg.max_position_embeddings),
        position_embedding_type="rope",
        rotary_base=int(_rope_theta(cfg)),
        share_embeddings_and_output_weights=s.tied,
        parallel_output=False,
    )
    return tc, gpt


def _chunk(t: Tensor, tp: int, r: int, dim: int = 0) -> Tensor:
    if t.shape[dim] % tp:
        raise ValueError(f"dim {dim} of size {t.shape[dim]} does not split over tp={tp}")
    return t.chunk(tp, dim=dim)[r]


def interleave_qkv(q: Tensor, k: Tensor, v: Tensor, groups: int) -> Tensor:
    """Megatron's per-group layout along dim 0: for each group its queries, its key, its value."""
    qg = q.reshape(groups, -1, *q.shape[1:])
    kg = k.reshape(groups, -1, *k.shape[1:])
    vg = v.reshape(groups, -1, *v.shape[1:])
    return torch.cat([qg, kg, vg], dim=1).reshape(-1, *q.shape[1:])


def deinterleave_qkv(qkv: Tensor, groups: int, heads: int, head_dim: int) -> tuple[Tensor, Tensor, Tensor]:
    """Inverse of :func:`interleave_qkv` for ``groups`` groups of ``heads`` query heads in all
    (views: no copy until the caller makes one)."""
    per = heads // groups
    g = qkv.reshape(groups, (per + 2) * head_dim, *qkv.shape[1:])
    q, k, v = g.split([per * head_dim, head_dim, head_dim], dim=1)
    rest = qkv.shape[1:]
    return q.reshape(-1, *rest), k.reshape(-1, *rest), v.reshape(-1, *rest)


_HF_LAYER = "model.layers.{i}."
_MC_LAYER = "decoder.layers.{i}."


def _norm_names(te: bool) -> tuple[str, str]:
    if te:
        return "self_attention.linear_qkv.layer_norm_weight", "mlp.linear_fc1.layer_norm_weight"
    return "input_layernorm.weight", "pre_mlp_layernorm.weight"


def hf_to_mcore(
    hf: Mapping[str, Tensor], shape: GPTShape, *, tp: int = 1, rank: int = 0, te: bool = False
) -> dict[str, Tensor]:
    """TP rank ``rank``'s Megatron-core state dict from a full HF state dict (new tensors).

    Raises ``KeyError`` naming a missing HF key and ``ValueError`` for a dimension ``tp`` does
    not divide."""
    shape.check_tp(tp)
    out: dict[str, Tensor] = {}
    ln_in, ln_mlp = _norm_names(te)

    def get(name: str) -> Tensor:
        if name not in hf:
            raise KeyError(f"hf_to_mcore: missing {name!r} in the Hugging Face state dict")
        return hf[name]

    out["embedding.word_embeddings.weight"] = _chunk(get("model.embed_tokens.weight"), tp, rank).clone()
    out["decoder.final_layernorm.weight"] = get("model.norm.weight").clone()
    if not shape.tied:
        out["output_layer.weight"] = _chunk(get("lm_head.weight"), tp, rank).clone()
    for i in range(shape.num_layers):
        h, m = _HF_LAYER.format(i=i), _MC_LAYER.format(i=i)
        for suffix in ("weight", "bias"):
            qn = f"{h}self_attn.q_proj.{suffix}"
            if suffix == "bias" and qn not in hf:
                continue
            full = interleave_qkv(
                get(qn), get(f"{h}self_attn.k_proj.{suffix}"), get(f"{h}self_attn.v_proj.{suffix}"), shape.groups
            )
            out[f"{m}self_attention.linear_qkv.{suffix}"] = _chunk(full, tp, rank).clone()
        out[f"{m}self_attention.linear_proj.weight"] = _chunk(get(f"{h}self_attn.o_proj.weight"), tp, rank, 1).clone()
        out[f"{m}mlp.linear_fc1.weight"] = torch.cat(
            [_chunk(get(f"{h}mlp.gate_proj.weight"), tp, rank), _chunk(get(f"{h}mlp.up_proj.weight"), tp, rank)]
        )
        out[f"{m}mlp.linear_fc2.weight"] = _chunk(get(f"{h}mlp.down_proj.weight"), tp, rank, 1).clone()
        out[m + ln_in] = get(f"{h}input_layernorm.weight").clone()
        out[m + ln_mlp] = get(f"{h}post_attention_layernorm.weight").clone()
    return out


_SKIP = re.compile(r"(_extra_state|\.rotary_pos_emb\.inv_freq)$")


def mcore_shard_to_hf(mc: Mapping[str, Tensor], shape: GPTShape, *, tp: int = 1, te: bool = False) -> dict[str, Tensor]:
    """One TP rank's Megatron-core tensors -> that rank's shards under HF names, as views where
    the layout allows (norms and row/column/vocab shards are the same tensors; q/k/v and
    gate/up are views into the fused ones). Sharding of each HF name is what
    ``nemo_dataplane.refit.build_layout``'s default rules give for TP=``tp``, so these
    feed a :class:`~nemo_dataplane.refit.ReshardSender` directly. Unknown keys raise ``KeyError``.
    """
    ln_in, ln_mlp = _norm_names(te)
    layer_rx = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
    out: dict[str, Tensor] = {}
    for name, t in mc.items():
        if _SKIP.search(name):
            continue
        if name == "embedding.word_embeddings.weight":
            out["model.embed_tokens.weight"] = t
            if shape.tied:
                out["lm_head.weight"] = t
            continue
        if name == "output_layer.weight":
            out["lm_head.weight"] = t
            continue
        if name == "decoder.final_layernorm.weight":
            out["model.norm.weight"] = t
            continue
        mm = layer_rx.match(name)
        if mm is None:
            raise KeyError(f"mcore_shard_to_hf: unknown Megatron-core key {name!r}")
        h, rest = f"model.layers.{mm[1]}.", mm[2]
        if rest.startswith("self_attention.linear_qkv.") and rest != ln_in:
            suffix = rest.rsplit(".", 1)[1]
            q, k, v = deinterleave_qkv(t, shape.groups // tp, shape.heads // tp, shape.head_dim)
            out.update(
                {
                    f"{h}self_attn.q_proj.{suffix}": q,
                    f"{h}self_attn.k_proj.{suffix}": k,
                    f"{h}self_attn.v_proj.{suffix}": v,
                }
            )
        elif rest == "mlp.linear_fc1.weight":
            gate, up = t.chunk(2, dim=0)
            out[f"{h}mlp.gate_proj.weight"], out[f"{h}mlp.up_proj.weight"] = gate, up
        elif rest == "self_attention.linear_proj.weight":
            out[f"{h}self_attn.o_proj.weight"] = t
        elif rest == "mlp.linear_fc2.weight":
            out[f"{h}mlp.down_proj.weight"] = t
        elif rest == ln_in:
            out[f"{h}input_layernorm.weight"] = t
        elif rest == ln_mlp:
            out[f"{h}post_attention_layernorm.weight"] = t
        else:
            raise KeyError(f"mcore_shard_to_hf: unknown Megatron-core key {name!r}")
    return out


_ROW = re.compile(r"(o_proj|down_proj)\.weight$")


def tp_split_dim(name: str, t: Tensor) -> int | None:
    """The dim along which :func:`mcore_shard_to_hf`'s shard ``t`` of HF name ``name`` is split
    over TP ranks (the shards concatenate along it, in rank order); ``None``: replicated."""
    if t.dim() == 1 and name.endswith(("norm.weight", "layernorm.weight")):
        return None
    return 1 if _ROW.search(name) else 0


def mcore_to_hf(shards: Sequence[Mapping[str, Tensor]], shape: GPTShape, *, te: bool = False) -> dict[str, Tensor]:
    """The full HF state dict from every TP rank's Megatron-core state dict (rank order)."""
    tp = len(shards)
    per_rank = [mcore_shard_to_hf(s, shape, tp=tp, te=te) for s in shards]
    out: dict[str, Tensor] = {}
    for name, t0 in per_rank[0].items():
        dim = tp_split_dim(name, t0)
        out[name] = t0.clone() if dim is None else torch.cat([p[name] for p in per_rank], dim=dim)
    return out
