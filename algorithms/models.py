"""Tiny causal LMs for GRPO: build (random init from a config, or a local HF dir), pad, score, sample.

Nothing is ever downloaded: a config builds a randomly initialised model under a fixed seed and
a path loads with ``local_files_only=True``. All functions are single-process and deterministic
on CPU for fixed inputs (and a fixed ``torch.Generator`` for sampling).

``transformers`` is imported by the functions that build or run a model, not at load: it takes
seconds to import and the driver, which loads this module through the trainer, never builds one.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, overload

import torch
from torch import Tensor

from algorithms.grpo import entropy_from_logits

__all__ = [
    "Samples",
    "attention_head_size",
    "build_model",
    "generate",
    "model_config_values",
    "model_files_digest",
    "pad_batch",
    "sample",
    "save_pretrained_dir",
    "sequence_logprobs",
]

_ARCHS = ("llama", "qwen2")


def _config_class(arch: str) -> type:
    if arch == "llama":
        from transformers import LlamaConfig

        return LlamaConfig
    if arch == "qwen2":
        from transformers import Qwen2Config

        return Qwen2Config
    raise ValueError(f"model.arch must be one of {list(_ARCHS)}, got {arch!r}")


def build_model(
    model_cfg: Mapping[str, Any], *, vocab_size: int | None = None, device: torch.device | str | None = None
) -> torch.nn.Module:
    """A float32 causal LM from ``model_cfg``, in train mode.

    ``model_cfg`` is either ``{"path": "/local/hf/dir"}`` (``config.json`` + safetensors, loaded
    with ``local_files_only=True``) or ``{"hf_config": {...config kwargs...}, "arch": "llama" |
    "qwen2", "seed": int}`` (random init under ``seed``; the global torch RNG is left untouched).
    ``vocab_size`` (the tokenizer's) fills ``hf_config.vocab_size`` when missing and is checked
    against the model's embedding: a model smaller than the tokenizer raises ``ValueError``.
    ``device``: where the model is made (default the CPU). A random init on a CUDA device draws
    there (seconds for billions of parameters, where the CPU takes minutes): the same seed gives
    the same weights on every rank of one kind of device, other weights than the CPU's.
    """
    from transformers import AutoModelForCausalLM

    if not isinstance(model_cfg, Mapping):
        raise TypeError(f"model config must be a mapping, got {type(model_cfg).__name__}")
    has_path = model_cfg.get("path") not in (None, "")
    has_cfg = model_cfg.get("hf_config") is not None
    if has_path == has_cfg:
        raise ValueError("model config needs exactly one of 'path' (local HF dir) or 'hf_config' (random init)")

    if has_path:
        path = os.fspath(model_cfg["path"])
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise FileNotFoundError(f"model.path {path!r}: no config.json (expected a local Hugging Face model dir)")
        model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=torch.float32)
    else:
        kwargs = dict(model_cfg["hf_config"])
        if vocab_size is not None:
            kwargs.setdefault("vocab_size", vocab_size)
        if "vocab_size" not in kwargs:
            raise ValueError("model.hf_config.vocab_size is missing (pass vocab_size=tokenizer.vocab_size)")
        config_cls = _config_class(str(model_cfg.get("arch", "llama")))
        try:
            config = config_cls(**kwargs)
        except TypeError as e:
            raise ValueError(f"model.hf_config: {e}") from e
        seed = int(model_cfg.get("seed", 0))
        where = torch.device(device) if device is not None else torch.device("cpu")
        forked = [where.index or 0] if where.type == "cuda" else []
        with torch.random.fork_rng(devices=forked), where:
            torch.manual_seed(seed)
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)

    if device is not None:
        torch.nn.Module.to(model, device)  # a loaded checkpoint (or a CPU init) moved where it was asked for
    n_emb = int(model.get_input_embeddings().num_embeddings)  # type: ignore[arg-type]  # transformers' stubs
    if vocab_size is not None and n_emb < vocab_size:
        raise ValueError(f"model vocab_size {n_emb} < tokenizer vocab_size {vocab_size}")
    model.train()
    return model


def save_pretrained_dir(
    model: torch.nn.Module, path: str | os.PathLike[str], *, special_ids: Mapping[str, int | None] | None = None
) -> str:
    """Write ``model`` as a local HF dir (config.json with the weights' dtype + model.safetensors,
    and generation_config.json); returns the path. ``special_ids`` (``bos_token_id``,
    ``eos_token_id``, ``pad_token_id``: the tokenizer's) are set on the model's config and
    generation config first, so a loader that reads no tokenizer (vLLM) stops at its EOS."""
    hf_model: Any = model
    for cfg in (hf_model.config, getattr(hf_model, "generation_config", None)):
        if cfg is not None:
            for key, value in (special_ids or {}).items():
                setattr(cfg, key, None if value is None else int(value))
    os.makedirs(path, exist_ok=True)
    hf_model.save_pretrained(os.fspath(path))
    return os.fspath(path)


def model_config_values(model_cfg: Mapping[str, Any]) -> dict[str, Any]:
    """The model's config as its ``policy.model`` states it, read without building it or importing
    ``transformers``: ``config.json`` under ``path`` (a multimodal one's ``text_config`` filling
    what the top level lacks), else ``hf_config``. Keys left to the architecture's defaults are absent."""
    if model_cfg.get("path") not in (None, ""):
        data = json.loads((Path(str(model_cfg["path"])).expanduser() / "config.json").read_text())
        return {**(data.get("text_config") or {}), **data}
    return dict(model_cfg.get("hf_config") or {})


# What a model directory's weights are: every file with one of these suffixes, with the indices
# that map tensors to shards, and config.json.
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")
_INDEX_SUFFIX = ".index.json"
# A weights file up to this size is hashed whole; above it, its head (with the whole safetensors
# header), its tail and evenly spaced blocks (~5 MiB read however large the file: a full hash of a
# 16 GB checkpoint takes minutes on a loaded CPU).
_WHOLE_FILE_BYTES = 4 << 20
_SAMPLE_BLOCKS = 64
_BLOCK_BYTES = 1 << 16


def _file_digest(path: Path) -> str:
    """``"<size>:<sha256>"`` of ``path``: the whole file up to :data:`_WHOLE_FILE_BYTES`, else its
    first MiB (or its safetensors header, if longer), :data:`_SAMPLE_BLOCKS` blocks spread over
    it and its last block."""
    size = path.stat().st_size
    h = hashlib.sha256()
    with open(path, "rb") as f:
        if size <= _WHOLE_FILE_BYTES:
            h.update(f.read())
        else:
            head = f.read(8)
            header = int.from_bytes(head, "little") + 8 if path.suffix == ".safetensors" else 0
            f.seek(0)
            h.update(f.read(max(1 << 20, min(header, size))))
            for i in range(_SAMPLE_BLOCKS):
                f.seek(size * i // _SAMPLE_BLOCKS)
                h.update(f.read(_BLOCK_BYTES))
            f.seek(size - _BLOCK_BYTES)
            h.update(f.read(_BLOCK_BYTES))
    return f"{size}:{h.hexdigest()}"


def model_files_digest(model_cfg: Mapping[str, Any]) -> dict[str, str] | None:
    """``{file name: digest}`` of a ``policy.model.path`` directory's ``config.json``, weights
    files and shard indices (:func:`_file_digest`: size and content, sampled above 4 MiB), to tell
    a model rewritten in place from the one a checkpoint was trained from; ``None`` for a
    random-init model (its ``hf_config`` is part of the config already)."""
    if model_cfg.get("path") in (None, ""):
        return None
    root = Path(str(model_cfg["path"])).expanduser()
    names = sorted(
        p.name
        for p in root.iterdir()
        if p.is_file() and (p.name == "config.json" or p.name.endswith(_INDEX_SUFFIX) or p.suffix in _WEIGHT_SUFFIXES)
    )
    return {name: _file_digest(root / name) for name in names}


def attention_head_size(model_cfg: Mapping[str, Any]) -> int:
    """``head_dim``, else ``hidden_size // num_attention_heads``, of ``policy.model``; keys its
    config leaves out take the architecture's defaults (which imports ``transformers``)."""
    values = model_config_values(model_cfg)
    if not {"hidden_size", "num_attention_heads"} <= values.keys() and not values.get("head_dim"):
        values = {**_config_class(str(model_cfg.get("arch", "llama")))().to_dict(), **values}
    if values.get("head_dim"):
        return int(values["head_dim"])
    return int(values["hidden_size"]) // int(values["num_attention_heads"])


def pad_batch(
    seqs: Sequence[Sequence[int]] | Sequence[Tensor] | Tensor,
    pad_id: int,
    *,
    left: bool = False,
    length: int | None = None,
) -> tuple[Tensor, Tensor]:
    """Pad sequences to ``input_ids [N, L]`` (long) and ``attention_mask [N, L]`` (long, 1 = token).

    ``seqs`` is a list of id lists / 1-D tensors or a jagged ``torch.nested`` tensor. Right padding
    by default (training); ``left=True`` for batched generation. ``L`` = longest sequence, or
    ``length`` if given (must be >= the longest).
    """
    if isinstance(seqs, Tensor) and seqs.is_nested:
        rows = [t.reshape(-1).long() for t in seqs.unbind()]
    elif isinstance(seqs, Tensor):
        if seqs.dim() != 2:
            raise ValueError(f"pad_batch: a dense tensor must be [N, L], got shape {tuple(seqs.shape)}")
        rows = [r.long() for r in seqs]
    else:
        rows = [
            s.reshape(-1).long() if isinstance(s, Tensor) else torch.tensor(list(s), dtype=torch.long) for s in seqs
        ]
    n = len(rows)
    longest = max((r.numel() for r in rows), default=0)
    L = longest if length is None else length
    if L < longest:
        raise ValueError(f"pad_batch: length={length} < longest sequence {longest}")
    input_ids = torch.full((n, L), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((n, L), dtype=torch.long)
    for i, r in enumerate(rows):
        k = r.numel()
        if k == 0:
            continue
        if left:
            input_ids[i, L - k :] = r
            attention_mask[i, L - k :] = 1
        else:
            input_ids[i, :k] = r
            attention_mask[i, :k] = 1
    return input_ids, attention_mask


def _position_ids(attention_mask: Tensor) -> Tensor:
    # Left padding: positions count real tokens only, as in the same prompt unpadded.
    return (attention_mask.long().cumsum(-1) - 1).clamp_min(0)


@overload
def sequence_logprobs(
    model: torch.nn.Module,
    input_ids: Tensor,
    attention_mask: Tensor,
    response_mask: Tensor | None = ...,
    *,
    return_entropy: Literal[False] = ...,
    temperature: float = ...,
) -> Tensor: ...


@overload
def sequence_logprobs(
    model: torch.nn.Module,
    input_ids: Tensor,
    attention_mask: Tensor,
    response_mask: Tensor | None = ...,
    *,
    return_entropy: Literal[True],
    temperature: float = ...,
) -> tuple[Tensor, Tensor]: ...


def sequence_logprobs(
    model: torch.nn.Module,
    input_ids: Tensor,
    attention_mask: Tensor,
    response_mask: Tensor | None = None,
    *,
    return_entropy: bool = False,
    temperature: float = 1.0,
) -> Tensor | tuple[Tensor, Tensor]:
    """Log-prob of every next token: ``out[:, t] = log p(input_ids[:, t + 1] | input_ids[:, :t + 1])``.

    Shapes: ``input_ids``, ``attention_mask``, ``response_mask`` ``[N, L]``; result ``[N, L - 1]``
    float32. Where ``response_mask[:, t + 1]`` is 0 the result is 0 (so it can be used directly as
    the token mask shifted by one: ``response_mask[:, 1:]``). ``return_entropy=True`` also returns
    the entropy of each next-token distribution ``[N, L - 1]`` (masked the same way). Logits are
    divided by ``temperature`` so the scores match what the sampler drew from. Gradients flow
    unless called under ``torch.no_grad()``.
    """
    if input_ids.dim() != 2 or attention_mask.shape != input_ids.shape:
        raise ValueError(
            f"sequence_logprobs: input_ids and attention_mask must be the same [N, L] shape, got "
            f"{tuple(input_ids.shape)} and {tuple(attention_mask.shape)}"
        )
    if response_mask is not None and response_mask.shape != input_ids.shape:
        raise ValueError(
            f"sequence_logprobs: response_mask shape {tuple(response_mask.shape)} != input_ids shape "
            f"{tuple(input_ids.shape)}"
        )
    if temperature <= 0:
        raise ValueError(f"sequence_logprobs: temperature must be > 0, got {temperature}")
    out = model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=_position_ids(attention_mask),
        use_cache=False,
    )
    logits = out.logits[:, :-1, :].float()
    if temperature != 1.0:
        logits = logits / temperature
    logp_all = torch.log_softmax(logits, dim=-1)
    logp = logp_all.gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    keep = attention_mask[:, 1:].bool()
    if response_mask is not None:
        keep = keep & response_mask[:, 1:].bool()
    logp = torch.where(keep, logp, torch.zeros_like(logp))
    if not return_entropy:
        return logp
    ent = entropy_from_logits(logits)
    ent = torch.where(keep, ent, torch.zeros_like(ent))
    return logp, ent


@dataclass(frozen=True)
class Samples:
    """What :func:`sample` drew: per response (group-major), its tokens, the log-prob of each under
    the distribution it was drawn from, and whether it is complete (it emitted EOS or reached its
    limit) or was interrupted at a token boundary (``should_stop``)."""

    tokens: list[list[int]]
    logprobs: list[list[float]]
    finished: list[bool]


@torch.no_grad()
def sample(
    model: torch.nn.Module,
    prompt_ids: Sequence[Sequence[int]],
    n: int,
    max_new_tokens: int,
    temperature: float,
    generator: torch.Generator | None,
    eos_id: int,
    pad_id: int,
    *,
    row_seeds: Sequence[int] | None = None,
    limits: Sequence[int] | None = None,
    ignore_eos: bool = False,
    should_stop: Callable[[], bool] | None = None,
    min_running: float = 0.0,
    on_token: Callable[[], None] | None = None,
) -> Samples:
    """Sample ``n`` responses per prompt with a KV-cached loop; deterministic for a given ``generator`` state.

    Responses are group-major (the ``n`` responses of prompt ``i`` are at ``[i * n, (i + 1) * n)``).
    A response ends with ``eos_id`` when the model emitted it (unless ``ignore_eos``), else it has
    exactly its limit of tokens: ``limits[i]`` for prompt ``i`` (each ``<= max_new_tokens``) or
    ``max_new_tokens``. ``temperature <= 0`` means greedy. ``generator`` is a CPU generator: on
    CPU it draws the tokens; for a model on another device it draws one seed per response and
    the tokens are drawn there, from each response's counter-based stream (as with
    ``row_seeds``), so no distribution is copied to the host per token. Either way a seed gives
    the same samples on the same kind of device. The log-probs are
    ``log_softmax(logits / temperature)`` of each sampled token (greedy: of the untempered
    logits): the behaviour log-probs an off-policy correction needs.

    ``should_stop``: asked after every token; when it returns true the loop stops there and the
    unfinished responses come back as they are (``finished`` false). ``min_running``: the loop
    also stops once fewer than this fraction of the responses are still running. The model's
    train/eval mode is restored on exit. ``on_token``: called after every token (a progress mark).
    """
    if n < 1 or max_new_tokens < 1:
        raise ValueError(f"generate: n and max_new_tokens must be >= 1, got n={n}, max_new_tokens={max_new_tokens}")
    for i, p in enumerate(prompt_ids):
        if len(p) == 0:
            raise ValueError(f"generate: prompt {i} is empty (prepend <bos>)")
    if limits is not None:
        if len(limits) != len(prompt_ids):
            raise ValueError(f"generate: {len(limits)} limits for {len(prompt_ids)} prompts")
        bad = [(i, m) for i, m in enumerate(limits) if not 1 <= int(m) <= max_new_tokens]
        if bad:
            raise ValueError(f"generate: limits must be in [1, max_new_tokens={max_new_tokens}], got {bad[:5]}")
    if not prompt_ids:
        return Samples([], [], [])
    from transformers import DynamicCache

    rows = [list(p) for p in prompt_ids for _ in range(n)]
    if row_seeds is not None and len(row_seeds) != len(rows):
        raise ValueError(f"generate: {len(row_seeds)} row seeds for {len(rows)} responses")
    if row_seeds is None and generator is None:
        raise ValueError("generate: a generator or row seeds")
    input_ids, attention_mask = pad_batch(rows, pad_id, left=True)
    device = next(model.parameters()).device
    input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
    B = input_ids.shape[0]
    steps = max_new_tokens if limits is None else max(int(m) for m in limits)
    limit = None if limits is None else torch.tensor([int(m) for m in limits], device=device).repeat_interleave(n)
    was_training = model.training
    model.eval()
    try:
        cache = DynamicCache()
        out_tokens = torch.full((B, steps), pad_id, dtype=torch.long, device=device)
        out_logprobs = torch.zeros((B, steps), dtype=torch.float32, device=device)
        finished = torch.zeros(B, dtype=torch.bool, device=device)
        lengths = torch.zeros(B, dtype=torch.long, device=device)
        cur_ids, position_ids = input_ids, _position_ids(attention_mask)
        seeds = None if row_seeds is None else torch.tensor([int(x) for x in row_seeds], device=device)
        if seeds is None and temperature > 0 and device.type != "cpu":
            # Copying [B, vocab] probabilities to the host for every token costs more than the
            # model at real vocabularies (1024 x 32000 took ~1.9 s a token on one CPU thread).
            assert generator is not None
            seeds = torch.randint(0, 1 << 62, (B,), generator=generator).to(device)
        for step in range(steps):
            out = model(
                input_ids=cur_ids,
                attention_mask=attention_mask,
                position_ids=position_ids,
                past_key_values=cache,
                use_cache=True,
            )
            cache = out.past_key_values
            logits = out.logits[:, -1, :].float()
            if temperature > 0:
                if seeds is not None:
                    gumbel = -torch.log(-torch.log(hash_uniform(seeds, step, logits.shape[-1])))
                    nxt = ((logits / temperature).double() + gumbel).argmax(dim=-1)
                else:
                    probs = torch.softmax(logits / temperature, dim=-1)
                    nxt = torch.multinomial(probs.cpu(), 1, generator=generator).squeeze(1).to(device)
            else:
                nxt = logits.argmax(dim=-1)
            scaled = logits / temperature if temperature > 0 else logits
            out_logprobs[:, step] = torch.log_softmax(scaled, dim=-1).gather(1, nxt.unsqueeze(1)).squeeze(1)
            nxt = torch.where(finished, torch.full_like(nxt, pad_id), nxt)
            out_tokens[:, step] = nxt
            lengths += (~finished).long()
            if on_token is not None:
                on_token()
            if not ignore_eos:
                finished = finished | (nxt == eos_id)
            if limit is not None:
                finished = finished | (lengths >= limit)
            if bool(finished.all()) or step == steps - 1:
                finished = finished | (lengths >= (steps if limit is None else limit))
                break
            if should_stop is not None and should_stop():
                break
            if min_running and int((~finished).sum()) < min_running * B:
                break
            cur_ids = nxt.unsqueeze(1)
            position_ids = position_ids[:, -1:] + 1
            attention_mask = torch.cat([attention_mask, torch.ones_like(attention_mask[:, :1])], dim=1)
    finally:
        model.train(was_training)
    out_cpu, len_cpu, lp_cpu = out_tokens.cpu(), lengths.cpu(), out_logprobs.cpu()
    return Samples(
        tokens=[out_cpu[i, : int(len_cpu[i])].tolist() for i in range(B)],
        logprobs=[lp_cpu[i, : int(len_cpu[i])].tolist() for i in range(B)],
        finished=[bool(f) for f in finished.cpu().tolist()],
    )


_MASK = (1 << 64) - 1


def _i64(c: int) -> int:
    """A 64-bit constant as the signed value torch's int64 holds (arithmetic wraps mod 2**64)."""
    c &= _MASK
    return c - (1 << 64) if c >> 63 else c


def _shr(x: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's ``>>`` is arithmetic)."""
    return (x >> k) & ((1 << (64 - k)) - 1)


def hash_uniform(seeds: torch.Tensor, step: int, vocab: int) -> torch.Tensor:
    """``[B, vocab]`` float64 in (0, 1): splitmix64 of (seed, step, token id), a pure function of
    its inputs on any device (a counter-based stream: no generator state, no batch dependence)."""
    ids = torch.arange(vocab, dtype=torch.int64, device=seeds.device)
    x = seeds[:, None] * _i64(0xD1342543DE82EF95) + _i64(step * 0x2545F4914F6CDD1D) + ids[None, :]
    z = x + _i64(0x9E3779B97F4A7C15)
    z = (z ^ _shr(z, 30)) * _i64(0xBF58476D1CE4E5B9)
    z = (z ^ _shr(z, 27)) * _i64(0x94D049BB133111EB)
    z = z ^ _shr(z, 31)
    return (_shr(z, 11).double() + 0.5) * (1.0 / (1 << 53))


def generate(
    model: torch.nn.Module,
    prompt_ids: Sequence[Sequence[int]],
    n: int,
    max_new_tokens: int,
    temperature: float,
    generator: torch.Generator,
    eos_id: int,
    pad_id: int,
    *,
    return_logprobs: bool = False,
) -> list[list[int]] | tuple[list[list[int]], list[list[float]]]:
    """:func:`sample` to completion: the tokens of each response, and with ``return_logprobs`` the
    log-prob of each sampled token (group-major)."""
    out = sample(model, prompt_ids, n, max_new_tokens, temperature, generator, eos_id, pad_id)
    return (out.tokens, out.logprobs) if return_logprobs else out.tokens
