"""Megatron-core training engine: a GPT model from MCore's layer spec, loaded from HF weights.

megatron-core (extra ``megatron``, 0.19.x; Python >= 3.12) is imported inside the functions
only, so this module imports anywhere. What runs here:

* :func:`init_parallel`: Megatron's parallel state (TP x PP x CP, DP the rest) on an already
  initialised ``torch.distributed`` world, plus the TP-aware CUDA RNG;
* :func:`build_gpt`: ``GPTModel`` from the **local** layer spec (no Transformer Engine) with the
  HF config's shape (``mcore_convert.transformer_kwargs``), TP rank's shard of the HF weights
  loaded; ``use_te=True`` takes the TE spec instead (names via ``mcore_convert(te=True)``);
* :func:`forward_packed` / :func:`microbatch_logprobs`: one packed forward per micro-batch from
  the fetched jagged ``input_ids`` (``packing``): ``PackedSeqParams`` on the TE path, the same
  ``cu_seqlens`` as a block-causal mask on the local path (its attention has no varlen kernel);
* :func:`hf_shards` / :func:`refit_layout`: this TP rank's weights under HF names and the
  trainer-side layout for the resharding refit;
* :class:`MegatronEngine`: the training engine (``policy.backend=megatron``) built on them.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from tensordict import TensorDict
from torch import Tensor

from algorithms.engines.training.base import Scored, Which
from algorithms.engines.training.hf import HFTrainingEngine
from algorithms.engines.training.hf_export import HFDirWriter
from algorithms.engines.training.mcore_convert import (
    GPTShape,
    hf_to_mcore,
    mcore_shard_to_hf,
    shape_from_hf_config,
    tp_split_dim,
    transformer_kwargs,
)
from algorithms.engines.training.packing import block_causal_mask, packed_from_jagged, packed_logprobs, unpack_to_padded
from algorithms.precision import cast_weights
from algorithms.replicas import replica_of

__all__ = [
    "MegatronEngine",
    "build_gpt",
    "forward_packed",
    "hf_shards",
    "init_parallel",
    "load_hf",
    "microbatch_logprobs",
    "refit_layout",
]


def init_parallel(tp: int = 1, *, seed: int = 0, pp: int = 1, cp: int = 1) -> None:
    """Megatron parallel state on the current ``torch.distributed`` world (idempotent)."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, context_parallel_size=cp
        )
    if torch.cuda.is_available():
        model_parallel_cuda_manual_seed(seed)


def build_gpt(
    hf_config: Any, *, device: torch.device | str = "cuda", use_te: bool = False, bf16: bool = False
) -> torch.nn.Module:
    """An MCore ``GPTModel`` shaped like ``hf_config`` for the initialised TP size (random init;
    :func:`load_hf` fills it). fp32 parameters; ``bf16``: configured to compute in bfloat16
    once its weights are cast (``transformer_kwargs``)."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer import TransformerConfig

    tp = parallel_state.get_tensor_model_parallel_world_size()
    tc_kw, gpt_kw = transformer_kwargs(hf_config, tp=tp, bf16=bf16)
    tc_kw["use_cpu_initialization"] = torch.device(device).type == "cpu"
    config = TransformerConfig(**tc_kw)
    if use_te:
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

        spec = get_gpt_layer_with_transformer_engine_spec()
    else:
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

        spec = get_gpt_layer_local_spec(normalization="RMSNorm")
    model = GPTModel(config=config, transformer_layer_spec=spec, **gpt_kw)
    return model.to(device)


def load_hf(model: torch.nn.Module, hf_state: Mapping[str, Tensor], shape: GPTShape, *, use_te: bool = False) -> None:
    """Load this TP rank's shard of a full HF state dict; raises ``KeyError`` naming any
    parameter the converter and the model disagree on (``_extra_state`` aside)."""
    from megatron.core import parallel_state

    tp = parallel_state.get_tensor_model_parallel_world_size()
    rank = parallel_state.get_tensor_model_parallel_rank()
    mc = hf_to_mcore(hf_state, shape, tp=tp, rank=rank, te=use_te)
    own = {k for k in model.state_dict() if not k.endswith("_extra_state")}
    if shape.tied:
        own.discard("output_layer.weight")
    if set(mc) != own:
        raise KeyError(f"load_hf: converter-only keys {sorted(set(mc) - own)}, model-only keys {sorted(own - set(mc))}")
    missing, unexpected = model.load_state_dict(mc, strict=False)
    bad = [k for k in missing if not k.endswith("_extra_state") and k != "output_layer.weight"]
    if bad or unexpected:
        raise KeyError(f"load_hf: missing {bad}, unexpected {list(unexpected)}")


def forward_packed(model: torch.nn.Module, tokens: Tensor, cu_seqlens: Tensor, *, use_te: bool = False) -> Tensor:
    """Logits ``[T, V]`` (full vocab: the model gathers its TP shards) of one packed stream."""
    T = tokens.shape[1]
    lens = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    starts = torch.repeat_interleave(cu_seqlens[:-1].long(), lens, output_size=T)
    position_ids = (torch.arange(T, device=tokens.device) - starts).reshape(1, T)
    if use_te:
        from megatron.core.packed_seq_params import PackedSeqParams

        cu = cu_seqlens.to(torch.int32)
        mx = int(lens.max())
        psp = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=mx, max_seqlen_kv=mx)
        out = model(input_ids=tokens, position_ids=position_ids, attention_mask=None, packed_seq_params=psp)
    else:
        out = model(input_ids=tokens, position_ids=position_ids, attention_mask=block_causal_mask(cu_seqlens, T))
    return out.reshape(T, -1)


def microbatch_logprobs(
    model: torch.nn.Module,
    input_ids: Tensor,
    prompt_len: Tensor,
    *,
    device: torch.device,
    temperature: float = 1.0,
    return_entropy: bool = False,
    use_te: bool = False,
) -> tuple[Tensor, Tensor | None, Tensor]:
    """``(logprobs [N, L-1], entropy [N, L-1] | None, mask [N, L-1])`` of one micro-batch in the
    torch worker's padded form (``L`` = its longest row; response tokens only, else 0), from
    its jagged ``input_ids`` packed as fetched."""
    tokens, cu = packed_from_jagged(input_ids)
    tokens, cu = tokens.to(device), cu.to(device)
    logits = forward_packed(model, tokens, cu, use_te=use_te)
    lp, ent = packed_logprobs(logits, tokens.reshape(-1), cu, temperature=temperature, return_entropy=return_entropy)
    lens = (cu[1:] - cu[:-1]).long()
    width = int(lens.max()) - 1
    col = torch.arange(1, width + 1, device=device).reshape(1, -1)  # token index scored at column t
    mask = ((col >= prompt_len.to(device).reshape(-1, 1)) & (col < lens.reshape(-1, 1))).float()
    lp = unpack_to_padded(lp, cu, width) * mask
    ent = unpack_to_padded(ent, cu, width) * mask if ent is not None else None
    return lp, ent, mask


def hf_shards(model: torch.nn.Module, shape: GPTShape, *, use_te: bool = False) -> dict[str, Tensor]:
    """This TP rank's weights under HF names (views of the live parameters; q/k/v copies come
    from the interleaved qkv as strided views), for a ``ReshardSender``."""
    from megatron.core import parallel_state

    tp = parallel_state.get_tensor_model_parallel_world_size()
    params = {n: p.detach() for n, p in model.named_parameters()}
    return mcore_shard_to_hf(params, shape, tp=tp, te=use_te)


def refit_layout(hf_config: Any, ranks: list[int], dtype: torch.dtype = torch.float32) -> Any:
    """The trainer-side layout of a TP group (group ranks ``ranks``, TP order) under HF names."""
    from nemo_dataplane.refit import Mesh, build_layout

    return build_layout(Mesh.of(ranks, tp=len(ranks)), hf_full_shapes(shape_from_hf_config(hf_config), dtype))


def hf_full_shapes(s: GPTShape, dtype: torch.dtype = torch.float32) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Full HF parameter shapes of a Llama-shaped model (what a layout is built from)."""
    out: dict[str, tuple[tuple[int, ...], torch.dtype]] = {
        "model.embed_tokens.weight": ((s.vocab, s.hidden), dtype),
        "model.norm.weight": ((s.hidden,), dtype),
        "lm_head.weight": ((s.vocab, s.hidden), dtype),
    }
    for i in range(s.num_layers):
        h = f"model.layers.{i}."
        out.update(
            {
                h + "self_attn.q_proj.weight": ((s.heads * s.head_dim, s.hidden), dtype),
                h + "self_attn.k_proj.weight": ((s.groups * s.head_dim, s.hidden), dtype),
                h + "self_attn.v_proj.weight": ((s.groups * s.head_dim, s.hidden), dtype),
                h + "self_attn.o_proj.weight": ((s.hidden, s.heads * s.head_dim), dtype),
                h + "mlp.gate_proj.weight": ((s.ffn, s.hidden), dtype),
                h + "mlp.up_proj.weight": ((s.ffn, s.hidden), dtype),
                h + "mlp.down_proj.weight": ((s.hidden, s.ffn), dtype),
                h + "input_layernorm.weight": ((s.hidden,), dtype),
                h + "post_attention_layernorm.weight": ((s.hidden,), dtype),
            }
        )
    return out


class MegatronEngine(HFTrainingEngine):
    """Megatron-core GPT models converted from the policy's HF model (same weights), on
    Megatron's parallel state over the policy ranks (TP = ``policy.tensor_parallel_size``, DP the
    rest). Built as the HF engine; :meth:`connect` swaps in the MCore models once
    ``torch.distributed`` spans every rank. With TP > 1 the gradient norm combines the TP shards.

    Precision as the torch engine's (:mod:`algorithms.precision`): under bf16 the MCore model's
    weights are bfloat16 and the optimizer steps float32 masters taken from the HF model's
    float32 values (Megatron's own mixed precision: bf16 params, fp32 main params)."""

    name = "megatron"

    def _setup(self) -> None:
        # connect() builds the MCore models from the HF model's float32 weights.
        self.hf_config = copy.deepcopy(self.model.config)

    def connect(self, rank: int) -> None:
        tp = self.cfg.policy.tensor_parallel_size
        torch.cuda.set_device(self.device if self.device.index is not None else torch.cuda.current_device())
        init_parallel(tp, seed=self.cfg.trainer.seed)
        hf_cfg, hf_state = self.model.config, self.model.state_dict()
        self.shape = shape_from_hf_config(hf_cfg)
        bf16 = self.precision.dtype == torch.bfloat16
        self.model = build_gpt(hf_cfg, device=self.device, bf16=bf16)
        load_hf(self.model, hf_state, self.shape)
        self.ref_model = build_gpt(hf_cfg, device=self.device, bf16=bf16)
        load_hf(self.ref_model, hf_state, self.shape)
        del hf_state
        cast_weights(self.ref_model, self.precision.dtype)
        self._freeze_reference()
        self.trained = self.precision.train(self.model)  # masters from the float32 values, then the cast
        self.optimizer = self._make_optimizer()
        if tp > 1:
            from megatron.core import parallel_state as ps

            self.dp_group = ps.get_data_parallel_group()
            self.tp_group = ps.get_tensor_model_parallel_group()
            got, want = (ps.get_data_parallel_rank(), ps.get_tensor_model_parallel_rank()), replica_of(rank, tp)
            if got != want:
                raise RuntimeError(f"policy rank {rank}: Megatron placed it at (dp, tp) = {got}, the driver at {want}")

    def score(self, which: Which, mb: TensorDict, entropy: bool) -> Scored:
        return microbatch_logprobs(
            self._model(which),
            mb["input_ids"],
            mb["prompt_len"],
            device=self.device,
            temperature=self.temperature,
            return_entropy=entropy,
        )

    def _clip(self, params: Sequence[torch.nn.Parameter], flat: Tensor, max_norm: float) -> Tensor:
        """The whole model's gradient norm from TP shards (a TP-split parameter contributes its
        shard on every TP rank, a replicated one once), then ``clip_grad_norm_``'s scaling."""
        if self.tp_group is None:
            return super()._clip(params, flat, max_norm)
        sq = torch.zeros((), dtype=torch.float32, device=self.device)
        for p in params:
            if p.grad is not None and (getattr(p, "tensor_model_parallel", False) or self.tp_rank == 0):
                sq += p.grad.float().pow(2).sum()
        dist.all_reduce(sq, group=self.tp_group)
        norm = sq.sqrt()
        if max_norm > 0:
            coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
            for p in params:
                if p.grad is not None:
                    p.grad.mul_(coef.to(p.grad.dtype))
        return norm

    def save_hf(self, directory: str, special_ids: Mapping[str, int | None]) -> bool:
        """The first replica's TP ranks gather each HF tensor from their shards (one at a time,
        all in the same order); its TP rank 0 writes. Other replicas take no part."""
        if self.dp_rank != 0:
            return False
        writer = HFDirWriter(directory) if self.tp_rank == 0 else None
        tp = self.cfg.policy.tensor_parallel_size
        with torch.no_grad():
            for name, shard in hf_shards(self.model, self.shape).items():
                if self.shape.tied and name == "lm_head.weight":
                    continue  # the embedding, written once
                dim = tp_split_dim(name, shard)
                full = shard
                if tp > 1 and dim is not None:
                    parts = [torch.empty_like(shard, memory_format=torch.contiguous_format) for _ in range(tp)]
                    dist.all_gather(parts, shard.contiguous(), group=self.tp_group)
                    full = torch.cat(parts, dim=dim)
                if writer is not None:
                    writer.add(name, full)
        if writer is None:
            return False
        writer.finish(self.hf_config, special_ids, self.precision.dtype)
        return True

    def named_for_refit(self) -> Iterable[tuple[str, Tensor]]:
        # Views of the live parameters under HF names (nothing is gathered or copied at TP=1).
        return hf_shards(self.model, self.shape).items()

    def refit_shapes(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        names = {n for n, _ in self.named_for_refit()}
        return {n: s for n, s in hf_full_shapes(self.shape, self.precision.dtype).items() if n in names}
