"""Per-rank bodies of the tensor-parallel generator refit test (``test_tp_shards.py``), each run
in a fresh process (imported by file-system path; see ``_refit_procs``).

Rank 0 sends a small Llama's whole weights; every other rank is one TP rank of a generator
engine and holds parameters shaped and fused as vLLM holds them (q/k/v and gate/up fused,
column and row splits, the vocabulary padded to a multiple of 64 before its split). The
expected shards are cut here by vLLM's rules, independently of the layout code under test.
"""

from __future__ import annotations

from typing import Any

import torch
from _refit_procs import _group

from algorithms.engines.generation.tp_shards import shard_targets
from algorithms.models import build_model
from nemo_dataplane.refit import WeightTransferConfig, build_weight_receiver, build_weight_sender

VOCAB_PAD = 64  # vLLM's DEFAULT_VOCAB_PADDING_SIZE
PAD_FILL = -7.0  # what a padding row holds before and after every refit


def model(vocab: int, seed: int = 0) -> torch.nn.Module:
    cfg = {
        "arch": "llama",
        "seed": seed,
        "hf_config": {
            "hidden_size": 64,
            "intermediate_size": 96,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "max_position_embeddings": 32,
        },
    }
    return build_model(cfg, vocab_size=vocab)


def vllm_shards(full: dict[str, torch.Tensor], tp: int, t: int) -> dict[str, torch.Tensor]:
    """TP rank ``t``'s parameters as vLLM's Llama holds them, cut from the whole ``full``."""
    out: dict[str, torch.Tensor] = {}
    for name, w in full.items():
        if name.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight", "up_proj.weight")):
            continue  # fused under the first part's name
        if name.endswith("gate_proj.weight"):
            up = full[name.replace("gate_proj", "up_proj")]
            out[name.replace("gate_proj", "gate_up_proj")] = torch.cat([w.chunk(tp)[t], up.chunk(tp)[t]])
        elif name.endswith("o_proj.weight") or name.endswith("down_proj.weight"):
            out[name] = w.chunk(tp, dim=1)[t].contiguous()
        elif name.endswith(("embed_tokens.weight", "lm_head.weight")):
            per = -(-w.shape[0] // VOCAB_PAD) * VOCAB_PAD // tp
            shard = torch.full((per, w.shape[1]), PAD_FILL, dtype=w.dtype)
            rows = w[t * per : (t + 1) * per]
            shard[: rows.shape[0]] = rows
            out[name] = shard
        else:
            out[name] = w.clone()
    for name in full:
        if name.endswith("q_proj.weight"):
            parts = [full[name.replace("q_proj", p)].chunk(tp)[t] for p in ("q_proj", "k_proj", "v_proj")]
            out[name.replace("q_proj", "qkv_proj")] = torch.cat(parts)
    return out


def tp_refit(rank: int, *, world: int, port: int, tp: int, vocab: int, dtypes: list[str]) -> dict[str, Any]:
    """Rank 0 sends version 5 of ``model(vocab, seed=1)``; receiver ``r`` (engine ``e``, TP rank
    ``t``) starts from a different model's shards in ``dtypes[e]`` and returns the names of
    parameters that differ from ``model(vocab, seed=1)``'s shards afterwards, its element
    counts received and held, and how many tensors went through staging."""
    g = _group(rank, world, port, "gloo")
    cfg = WeightTransferConfig(family="reshard", transport="p2p", bucket_bytes=1 << 16)
    try:
        sent = {n: p.detach() for n, p in model(vocab, seed=1).named_parameters()}
        if rank == 0:
            snd = build_weight_sender(cfg, g, sent, senders=1)
            snd.prepare_refit_info()
            snd.send_weights(5)
            g.barrier()
            return {"sent": sum(t.numel() for t in sent.values())}
        e, t = divmod(rank - 1, tp)
        dtype = getattr(torch, dtypes[e])
        start = {n: p.detach() for n, p in model(vocab, seed=0).named_parameters()}
        params = {n: w.to(dtype) for n, w in vllm_shards(start, tp, t).items()}
        specs = [(n, list(w.shape), str(w.dtype).removeprefix("torch.")) for n, w in sent.items()]
        targets = shard_targets(
            specs, params, senders=1, world_size=world, first_rank=1 + e * tp, tp_rank=t, tp=tp, device=g.device
        )
        rcv = build_weight_receiver(cfg, g, targets.tensors, senders=1, shards=targets.layout)
        rcv.prepare_refit_info()
        version = rcv.receive_weights()
        targets.install()
        g.barrier()
        want = {n: w.to(dtype) for n, w in vllm_shards(sent, tp, t).items()}
        wrong = [n for n in want if not torch.equal(params[n], want[n])]
        return {
            "version": version,
            "wrong": wrong,
            "received": sum(x.numel() for x in targets.tensors.values()),
            "held": sum(x.numel() for x in params.values()),
            "staged": len(targets.installs),
            "whole": targets.whole,
        }
    finally:
        g.destroy()
