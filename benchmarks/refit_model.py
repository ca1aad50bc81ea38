"""What the refit benchmarks share: the Llama-shaped model they move, its resharding layouts,
and the ranks' processes (``bench_refit.py``, ``refit_ranks.py``, ``reshard_bench.py``,
``reshard_ranks.py``, ``reshard_phases.py``)."""

from __future__ import annotations

import math
import multiprocessing as mp
import os
import socket
import statistics
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch

from nemo_dataplane.refit.reshard.layout import Layout, Mesh
from nemo_dataplane.refit.reshard.rules import DEFAULT_FUSIONS, build_layout

HOST = "127.0.0.1"

# name -> (trainer tp, generator tp, GPU of each rank: trainers first)
SCENARIOS: dict[str, tuple[int, int, tuple[int, ...]]] = {
    "TP=2 -> TP=1": (2, 1, (0, 1, 0)),
    "TP=2 -> TP=2": (2, 2, (0, 1, 0, 1)),
}


def llama_shapes(n_params: float) -> list[tuple[str, tuple[int, ...]]]:
    """16 llama-style layers (GQA 4:1, MLP 4h) + embeddings/head: 147 tensors, about ``n_params``."""
    layers = 16
    vocab = 128256 if n_params >= 5e8 else 32000
    # n = layers * 14.5 h^2 + 2 * vocab * h  ->  solve for h, round to 128.
    a, b = layers * 14.5, 2.0 * vocab
    h = max(128, int(round((-b + math.sqrt(b * b + 4 * a * n_params)) / (2 * a) / 128)) * 128)
    kv, inter = h // 4, 4 * h
    shapes: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (vocab, h))]
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes += [
            (p + "input_layernorm.weight", (h,)),
            (p + "self_attn.q_proj.weight", (h, h)),
            (p + "self_attn.k_proj.weight", (kv, h)),
            (p + "self_attn.v_proj.weight", (kv, h)),
            (p + "self_attn.o_proj.weight", (h, h)),
            (p + "post_attention_layernorm.weight", (h,)),
            (p + "mlp.gate_proj.weight", (inter, h)),
            (p + "mlp.up_proj.weight", (inter, h)),
            (p + "mlp.down_proj.weight", (h, inter)),
        ]
    shapes += [("model.norm.weight", (h,)), ("lm_head.weight", (vocab, h))]
    return shapes


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def summarize(times_s: list[float], nbytes: int) -> dict[str, float]:
    med = statistics.median(times_s)
    return {
        "median_ms": med * 1e3,
        "best_ms": min(times_s) * 1e3,
        "gbps_median": nbytes / med / 1e9,
        "iters": len(times_s),
    }


def checksum(tensors: dict[str, torch.Tensor]) -> list[int]:
    """Integer sums of each tensor's raw 16-bit words: equal iff (barring collisions) bit-identical."""
    return [int(t.view(torch.int16).to(torch.int64).sum()) for t in tensors.values()]


def placed(sc: tuple[int, int, tuple[int, ...]]) -> tuple[int, int, tuple[int, ...]]:
    """A scenario with its ranks on the GPUs there are (all on GPU 0 on a one-GPU machine)."""
    tp_train, tp_gen, gpus = sc
    if torch.cuda.is_available() and torch.cuda.device_count() < 2:
        gpus = tuple(0 for _ in gpus)
    return tp_train, tp_gen, gpus


def layouts(shapes: list[tuple[str, tuple[int, ...]]], tp_train: int, tp_gen: int) -> tuple[Layout, Layout]:
    """(trainer, generator) layouts: trainer ranks ``0..tp_train-1``, generator ranks after them,
    its q/k/v and gate/up fused as vLLM fuses them."""
    params = {n: (s, torch.bfloat16) for n, s in shapes}
    src = build_layout(Mesh.of(range(tp_train), tp=tp_train), params)
    dst = build_layout(Mesh.of(range(tp_train, tp_train + tp_gen), tp=tp_gen), params, fusions=DEFAULT_FUSIONS)
    return src, dst


def full_value(i: int, shape: tuple[int, ...], dev: torch.device) -> torch.Tensor:
    """Parameter ``i``'s whole value, seeded by its index: every rank makes the same one."""
    gen = torch.Generator(device=dev).manual_seed(1000 + i)
    return torch.randn(shape, generator=gen, device=dev, dtype=torch.float32).to(torch.bfloat16)


def local_values(layout: Layout, rank: int, dev: torch.device) -> dict[str, torch.Tensor]:
    """``rank``'s local tensors with the model's values (each full parameter made once, sliced)."""
    index = {n: i for i, n in enumerate(layout.params)}
    out = {}
    for name, lt in layout.local_tensors(rank).items():
        parts = []
        for param, box, _ in lt.parts:
            full = full_value(index[param], layout.params[param].shape, dev)
            parts.append(full[tuple(slice(a, b) for a, b in box)].clone())
            del full
        out[name] = parts[0] if len(parts) == 1 else torch.cat(parts, lt.fuse_dim)
    return out


def _report(
    fn: Callable[..., dict[str, Any]], rank: int, port: int, args: tuple[Any, ...], env: dict[str, str], queue: Any
) -> None:
    # Before anything touches CUDA or NCCL, which read their settings (e.g. a matrix row's NCCL_*) once.
    os.environ.update(env)
    try:
        queue.put((rank, fn(rank, port, *args)))
    except BaseException as e:  # report instead of leaving the parent waiting
        queue.put((rank, {"error": "".join(traceback.format_exception(e))}))


def run_ranks(
    fn: Callable[..., dict[str, Any]],
    world: int,
    args: tuple[Any, ...],
    *,
    limit_s: float,
    env: dict[str, str] | None = None,
    label: str = "workers",
) -> dict[int, dict[str, Any]]:
    """Run ``fn(rank, port, *args)`` for ranks ``0..world-1``, each in a fresh spawned process with
    ``env`` added to its environment (``fn`` must be importable by module name); rank -> result.

    Raises ``RuntimeError`` naming ``label`` and the rank as soon as a rank fails (the others
    would only wait for it to time out), or when not every rank reported within ``limit_s``."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_report, args=(fn, r, port, args, env or {}, queue)) for r in range(world)]
    for p in procs:
        p.start()
    results: dict[int, dict[str, Any]] = {}
    deadline = time.monotonic() + limit_s
    try:
        while len(results) < world:
            try:
                r, res = queue.get(timeout=max(1.0, deadline - time.monotonic()))
            except Exception:
                raise RuntimeError(f"{label}: ranks did not report within {limit_s:g}s") from None
            if "error" in res:
                raise RuntimeError(f"{label}: rank {r} failed:\n{res['error']}")
            results[r] = res
    finally:
        for p in procs:
            p.join(timeout=30 if len(results) == world else 0.1)
            if p.is_alive():
                p.kill()
    return results
