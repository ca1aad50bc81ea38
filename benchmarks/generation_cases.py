"""The cases ``bench_generation.py`` runs, each in a subprocess of its own: the model sizes, and
the GPU run's generation case (one size x engine on one GPU) and refit case (a vLLM engine
receiving refits from a trainer process, against the copy ceiling). The driver and the CPU case
are in ``bench_generation.py`` (its docstring says what each case measures), the GPU tables in
``generation_report.py``."""

from __future__ import annotations

import json
import math
import os
import socket
import statistics
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]

SIZES: dict[str, dict[str, Any]] = {
    # The trainer's toy model (examples/configs/grpo_tiny.yaml) with 2 heads of 32.
    "toy": {
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
    },
    "4x512": {
        "arch": "llama",
        "seed": 0,
        "hf_config": {
            "hidden_size": 512,
            "intermediate_size": 1536,
            "num_hidden_layers": 4,
            "num_attention_heads": 8,
            "num_key_value_heads": 8,
            "max_position_embeddings": 128,
        },
    },
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ------------------------------------------------------------------------------ GPU (--device cuda)
# Random-init Llamas in bf16. "toy" and "longtail" keep the project's character tokenizer (their
# vocabulary is ~34 ids, as in grpo_tiny.yaml and grpo_longtail_gpu.yaml); the larger sizes take a
# 32000-id vocabulary, as real tokenizers of that size have (the output layer and the sampler's
# softmax scale with it). 640 positions: a 31-token prompt plus 512 new tokens.
_GPU_POS = 640
GPU_SIZES: dict[str, dict[str, Any]] = {
    "toy": {
        "arch": "llama",
        "seed": 0,
        "hf_config": {**SIZES["toy"]["hf_config"], "max_position_embeddings": _GPU_POS},
    },
    # examples/configs/grpo_longtail_gpu.yaml's policy (28M).
    "longtail": {
        "arch": "llama",
        "seed": 0,
        "hf_config": {
            "hidden_size": 768,
            "intermediate_size": 2048,
            "num_hidden_layers": 4,
            "num_attention_heads": 12,
            "num_key_value_heads": 12,
            "max_position_embeddings": _GPU_POS,
        },
    },
    "100m": {
        "arch": "llama",
        "seed": 0,
        "hf_config": {
            "vocab_size": 32000,
            "hidden_size": 768,
            "intermediate_size": 2048,
            "num_hidden_layers": 8,
            "num_attention_heads": 12,
            "num_key_value_heads": 4,
            "max_position_embeddings": _GPU_POS,
        },
    },
    "0.7b": {
        "arch": "llama",
        "seed": 0,
        "hf_config": {
            "vocab_size": 32000,
            "hidden_size": 1536,
            "intermediate_size": 4096,
            "num_hidden_layers": 24,
            "num_attention_heads": 12,
            "num_key_value_heads": 4,
            "max_position_embeddings": _GPU_POS,
        },
    },
    # The refit case's size.
    "1.3b": {
        "arch": "llama",
        "seed": 0,
        "hf_config": {
            "vocab_size": 32000,
            "hidden_size": 2048,
            "intermediate_size": 5632,
            "num_hidden_layers": 24,
            "num_attention_heads": 16,
            "num_key_value_heads": 8,
            "max_position_embeddings": _GPU_POS,
        },
    },
}
GPU_ENGINES = ("hf", "vllm-v1", "vllm-v2")
# Refit routes: the group's backend, the weight-transfer options and the trainer's GPU (the
# engine is on GPU 0), as the GPU tests set them up (tests/unit/test_generation_vllm_gpu.py).
# "gloo" (CPU) only exercises the case's code path without GPUs.
REFIT_ROUTES: dict[str, tuple[str, dict[str, Any], int | None]] = {
    "nccl": ("nccl", {"transport": "broadcast"}, 1),
    "ipc": ("gloo", {"family": "reshard", "transport": "ipc"}, 0),
    "gloo": ("gloo", {}, None),
}


def gpu_vocab(size: str) -> dict[str, Any]:
    """The vocabulary of a GPU size: ``vocab_size``, ``bos_id``, ``eos_id``, ``pad_id``."""
    hf = GPU_SIZES[size]["hf_config"]
    if "vocab_size" in hf:  # Llama's conventions: pad 0, bos 1, eos 2
        return {"vocab_size": int(hf["vocab_size"]), "bos_id": 1, "eos_id": 2, "pad_id": 0}
    from algorithms.tasks import CharTokenizer

    tok = CharTokenizer()
    return {"vocab_size": tok.vocab_size, "bos_id": tok.bos_id, "eos_id": tok.eos_id, "pad_id": tok.pad_id}


def gpu_prompts(size: str, prompts: int) -> list[list[int]]:
    """``prompts`` token-id prompts of 16-31 tokens (BOS first), ids drawn uniformly (seeded) from
    the size's vocabulary above the special ids."""
    import torch

    v = gpu_vocab(size)
    gen = torch.Generator().manual_seed(0)
    out = []
    for i in range(prompts):
        body = torch.randint(3, v["vocab_size"], (15 + i % 16,), generator=gen).tolist()
        out.append([v["bos_id"], *body])
    return out


def bf16_refit_engine(size: str, **kw: Any) -> tuple[Any, float]:
    """A bf16 vLLM engine on the size's random-init weights (seed 0), a 4 GiB KV cache, up to 256
    sequences, on the first GPU(s) this process sees, and its start-up seconds. ``kw``: further
    ``VLLMEngine`` arguments (``weights``, ``tensor_parallel_size``)."""
    import torch

    from algorithms.config import VLLMEngineConfig
    from algorithms.engines.generation.vllm import VLLMEngine

    t0 = time.perf_counter()
    engine = VLLMEngine(
        {**GPU_SIZES[size], "seed": 0},
        device="cuda",
        engine=VLLMEngineConfig(kv_cache_memory_bytes=4 << 30, max_num_seqs=256),
        dtype=torch.bfloat16,
        # The KV cache is sized above; vLLM still checks this share of the GPU is free at start-up.
        llm_kwargs={"gpu_memory_utilization": 0.5},
        **gpu_vocab(size),
        **kw,
    )
    return engine, time.perf_counter() - t0


def timed_refits(engine: Any, go: Any, count: int, proc: Any, errors: Any, done: Any = None) -> list[list[float]]:
    """Refits ``0..count-1`` into ``engine`` (joined to the sender process ``proc``'s group): each
    version is put on ``go`` for the sender, then received. Leaves the group and waits for the
    sender, whose first error (on ``errors``) is raised. Returns the engine-side seconds of each
    refit and, with ``done`` (the sender puts its own seconds there), the sender-side ones."""
    times: list[float] = []
    sent: list[float] = []
    for ver in range(count):
        s = time.perf_counter()
        go.put(ver)
        if engine.receive_weights() != ver:
            raise RuntimeError(f"installed another version than {ver}")
        times.append(time.perf_counter() - s)
        if done is not None:
            sent.append(float(done.get(timeout=60)))
    engine.close_refit()
    proc.join(120)
    if not errors.empty():
        raise RuntimeError(f"the trainer process failed: {errors.get()}")
    return [times, sent]


def logprob_mismatch(trainer: Any, prompts: list[list[int]], n: int, out: Any, pad_id: int, device: str) -> Any:
    """|engine log-prob - ``trainer``'s forward log-prob| of every token the engine sampled
    (``out``: ``n`` responses per prompt, group-major), in fp32 on the CPU, one tensor; the
    trainer's forward runs on ``device`` at temperature 1, 32 rows at a time."""
    import torch

    from algorithms.models import pad_batch, sequence_logprobs

    rows = [p for p in prompts for _ in range(n)]
    deltas = []
    with torch.no_grad():
        for i in range(0, len(rows), 32):
            chunk, toks = rows[i : i + 32], out.tokens[i : i + 32]
            ids, attn = pad_batch([p + t for p, t in zip(chunk, toks)], pad_id)
            resp = torch.zeros_like(ids)
            for j, (p, t) in enumerate(zip(chunk, toks)):
                resp[j, len(p) : len(p) + len(t)] = 1
            lp = sequence_logprobs(trainer, ids.to(device), attn.to(device), resp.to(device), temperature=1.0)
            lp = lp.float().cpu()
            for j, (p, t) in enumerate(zip(chunk, toks)):
                ref = lp[j, len(p) - 1 : len(p) - 1 + len(t)]
                deltas.append((ref - torch.tensor(out.logprobs[i + j])).abs())
    return torch.cat(deltas)


def kv_bytes_per_token(size: str, dtype_bytes: int = 2) -> int:
    """K and V of one token over all layers."""
    hf = GPU_SIZES[size]["hf_config"]
    head = hf["hidden_size"] // hf["num_attention_heads"]
    return 2 * hf["num_hidden_layers"] * hf.get("num_key_value_heads", hf["num_attention_heads"]) * head * dtype_bytes


def run_gpu_case(
    size: str,
    engine_name: str,
    prompts: int,
    n: int,
    lengths: list[int],
    repeats: int,
    hf_repeats: int,
    device: str = "cuda",
) -> dict[str, Any]:
    """One (size, engine) generation case in this process, on ``device``'s first GPU; returns
    start-up and, per length, the medians of the timed batches (``device="cpu"``: the same code
    on the CPU, for checking it without a GPU)."""
    t0 = time.perf_counter()
    import torch

    torch.set_num_threads(1)  # the generator actor's trainer.num_threads
    import transformers.models.llama.modeling_llama  # noqa: F401 - both engines build the policy's model

    from algorithms.engines.generation import SamplingSpec

    if engine_name != "hf":
        import vllm  # noqa: F401 - import time is reported on its own
    t_import = time.perf_counter() - t0
    model_cfg = GPU_SIZES[size]
    v = gpu_vocab(size)
    batch = gpu_prompts(size, prompts)
    rows = prompts * n
    t1 = time.perf_counter()
    if engine_name == "hf":
        from algorithms.engines.generation.hf import HFEngine

        engine: Any = HFEngine(
            model_cfg,
            device=device,
            vocab_size=v["vocab_size"],
            eos_id=v["eos_id"],
            pad_id=v["pad_id"],
            dtype=torch.bfloat16,
        )
        reps = hf_repeats
    else:
        from algorithms.config import VLLMEngineConfig
        from algorithms.engines.generation.vllm import VLLMEngine

        # The whole batch decodes at once: a KV cache for every response at the longest length
        # (+25% for block rounding), at least the engine's default.
        longest = max(len(p) for p in batch) + max(lengths)
        kv = max(256 << 20, int(1.25 * rows * longest * kv_bytes_per_token(size)))
        args = VLLMEngineConfig(kv_cache_memory_bytes=kv, max_num_seqs=rows)
        engine = VLLMEngine(model_cfg, device=device, engine=args, dtype=torch.bfloat16, **v)
        reps = repeats
    startup = time.perf_counter() - t1
    per_length: dict[str, dict[str, Any]] = {}
    try:

        def timed(length: int, seed: int) -> tuple[float, int]:
            s = time.perf_counter()
            spec = SamplingSpec(max_new_tokens=length, temperature=1.0, seed=seed, ignore_eos=True)
            out = engine.generate(batch, n, spec)
            return time.perf_counter() - s, sum(len(t) for t in out.tokens)

        timed(16, 0)  # warm-up: first-call allocations, kernels' autotuning
        for length in lengths:
            runs = [timed(length, 1 + r) for r in range(reps)]
            per_length[str(length)] = {
                "gen_s": statistics.median(r[0] for r in runs),
                "tokens_per_s": statistics.median(r[1] / r[0] for r in runs),
                "tokens": runs[0][1],
                "repeats": reps,
            }
            # Read back by the driver if the case is cut short (a timeout keeps the lengths done).
            print("LENGTH " + json.dumps({str(length): per_length[str(length)]}), flush=True)
        params = sum(math.prod(shape) for _, shape, _ in _param_specs(engine))
    finally:
        engine.shutdown()
    return {
        "size": size,
        "engine": engine_name,
        "params": params,
        "vocab_size": v["vocab_size"],
        "import_s": t_import,
        "startup_s": startup,
        "rows": rows,
        "lengths": per_length,
        "settings": getattr(engine, "settings", None) and engine.settings.attention_backend,
    }


def _param_specs(engine: Any) -> list[tuple[str, list[int], str]]:
    """(name, shape, dtype) of the engine's model, whichever engine it is."""
    specs = getattr(engine, "param_specs", None)
    if specs is not None:
        return list(specs)
    return [(name, list(p.shape), str(p.dtype)) for name, p in engine.model.named_parameters()]


def _refit_sender(
    size: str,
    port: int,
    backend: str,
    transfer: dict[str, Any],
    gpu: int | None,
    versions: int,
    go: Any,
    errors: Any,
) -> None:
    """The trainer rank (group rank 0) in a process of its own: the size's model in bf16 on
    ``cuda:gpu`` (``None``: the CPU), sending version ``v`` when ``go`` yields it. Any exception
    goes to ``errors`` (the engine's side then times out)."""
    import torch

    try:
        from transformers import AutoModelForCausalLM, LlamaConfig

        from nemo_dataplane.distributed.stateless_group import StatelessProcessGroup
        from nemo_dataplane.refit import WeightTransferConfig, build_weight_sender

        dev = torch.device("cpu") if gpu is None else torch.device("cuda", gpu)
        if gpu is not None:
            torch.cuda.set_device(dev)
        # Built on the device directly (the values do not matter, the bytes and names do).
        hf = {**GPU_SIZES[size]["hf_config"]}
        hf.setdefault("vocab_size", gpu_vocab(size)["vocab_size"])
        with dev:
            model = AutoModelForCausalLM.from_config(LlamaConfig(**hf), dtype=torch.bfloat16)
        group = StatelessProcessGroup(
            "127.0.0.1", port, 0, 2, backend, 300.0, device=dev if backend == "nccl" else None, group_name="refit"
        )
        try:
            sender = build_weight_sender(
                WeightTransferConfig.from_dict(transfer), group, model.named_parameters, device=dev
            )
            sender.prepare_refit_info()
            for _ in range(versions):
                sender.send_weights(int(go.get(timeout=300)))
            if gpu is not None:  # an IPC receiver reads this process's memory: finish first
                torch.cuda.synchronize(dev)
        finally:
            group.destroy()
    except BaseException as e:  # noqa: BLE001 - reported by the engine's side
        errors.put(repr(e))


def _copy_ceiling(nbytes: int, src: str, dst: str, iters: int = 5) -> float:
    """Median seconds of one ``dst.copy_(src)`` of ``nbytes`` (after two warm-ups)."""
    import torch

    a = torch.empty(nbytes, dtype=torch.uint8, device=src)
    b = torch.empty(nbytes, dtype=torch.uint8, device=dst)
    devs = {torch.device(d) for d in (src, dst) if d.startswith("cuda")}

    def sync() -> None:
        for d in devs:
            torch.cuda.synchronize(d)

    times = []
    for i in range(iters + 2):
        sync()
        s = time.perf_counter()
        b.copy_(a)
        sync()
        if i >= 2:
            times.append(time.perf_counter() - s)
    del a, b
    if devs:
        torch.cuda.empty_cache()
    return statistics.median(times)


def run_refit_case(size: str, routes: list[str], repeats: int, device: str = "cuda") -> dict[str, Any]:
    """Refits into a running vLLM engine (on the first GPU) per route, against the copy ceiling
    of the same bytes; returns medians of ``repeats`` warm refits and the first (cold) one."""
    import multiprocessing as mp

    import torch

    torch.set_num_threads(min(16, os.cpu_count() or 1))  # building the model only; not timed
    from algorithms.config import VLLMEngineConfig
    from algorithms.engines.generation import RefitSpec, SamplingSpec
    from algorithms.engines.generation.vllm import VLLMEngine
    from nemo_dataplane.refit import WeightTransferConfig

    v = gpu_vocab(size)
    t1 = time.perf_counter()
    engine = VLLMEngine(
        GPU_SIZES[size],
        device=device,
        engine=VLLMEngineConfig(kv_cache_memory_bytes=1 << 30, max_num_seqs=64),
        dtype=torch.bfloat16,
        **v,
    )
    startup = time.perf_counter() - t1
    nbytes = sum(math.prod(shape) * 2 for _, shape, _ in engine.param_specs)
    params = sum(math.prod(shape) for _, shape, _ in engine.param_specs)
    batch = gpu_prompts(size, 8)
    spec = SamplingSpec(max_new_tokens=8, temperature=1.0, seed=0)
    out: dict[str, Any] = {"size": size, "params": params, "bytes": nbytes, "startup_s": startup, "routes": {}}
    ctx = mp.get_context("spawn")
    try:
        engine.generate(batch, 2, spec)
        for route in routes:
            backend, transfer, gpu = REFIT_ROUTES[route]
            if gpu is None:
                src = dst = "cpu"
            else:
                src, dst = f"cuda:{gpu}", "cuda:0"
            ceiling = _copy_ceiling(nbytes, src, dst)
            port = _free_port()
            go, errors = ctx.Queue(), ctx.Queue()
            proc = ctx.Process(
                target=_refit_sender, args=(size, port, backend, transfer, gpu, repeats + 1, go, errors), daemon=True
            )
            proc.start()
            try:
                engine.init_refit(
                    "127.0.0.1",
                    port,
                    2,
                    1,
                    RefitSpec(backend, 300, WeightTransferConfig.from_dict(transfer), senders=1),
                )
                times = []
                for ver in range(repeats + 1):
                    s = time.perf_counter()
                    go.put(ver)
                    got = engine.receive_weights()
                    times.append(time.perf_counter() - s)
                    if got != ver:
                        raise RuntimeError(f"refit {route}: installed version {got}, sent {ver}")
                engine.close_refit()  # NCCL: both ends destroy their communicators together
                proc.join(120)
            finally:
                if proc.is_alive():
                    proc.kill()
            if not errors.empty():
                raise RuntimeError(f"refit {route}: the trainer process failed: {errors.get()}")
            engine.generate(batch, 2, spec)  # the engine still samples after the refits
            warm = statistics.median(times[1:])
            out["routes"][route] = {
                "backend": backend,
                "transfer": transfer,
                "trainer": src,
                "engine": dst,
                "refit_s": warm,
                "refit_cold_s": times[0],
                "refits_s": times,
                "ceiling": f"copy_ {src} -> {dst}",
                "ceiling_s": ceiling,
                "ceiling_gbps": nbytes / ceiling / 1e9,
                "refit_gbps": nbytes / warm / 1e9,
                "ceiling_over_refit": ceiling / warm,
            }
            print(f"  refit {size} {route}: {1e3 * warm:.1f} ms, ceiling {1e3 * ceiling:.2f} ms", flush=True)
    finally:
        engine.shutdown()
    return out
