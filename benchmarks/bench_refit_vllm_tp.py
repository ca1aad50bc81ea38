"""Refit into a vLLM engine with tensor parallelism: each TP rank receives only its shards.

    python benchmarks/bench_refit_vllm_tp.py [--size 1.3b] [--tp 2] [--repeats 3]

A vLLM engine of ``--tp`` TP ranks (GPUs ``0..tp-1``, bf16, the size's random-init weights from
seed 0) is refit ``--repeats`` + 1 times by a trainer process on GPU ``tp`` (seed 1, bf16) over
NCCL through the resharding refit (``refit.mode=reshard refit.transport=p2p``). Reported: the
bytes each TP rank receives, the warm refit's median time (the first, cold, apart) and the
**aggregate peer copy** of the same bytes measured in the same run (the trainer GPU copying each
rank's share to that rank's GPU, all at once: the most the links can carry). Then the engine
samples 64 prompts x 4 x 64 tokens and the per-token |log-prob| difference to the trainer's
forward of the weights it sent (on GPU ``tp``) is reported. Writes
``benchmarks/results/bench_refit_vllm_tp.json`` and prints a table.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).parent))
from generation_cases import (  # noqa: E402
    GPU_SIZES,
    _free_port,
    bf16_refit_engine,  # noqa: E402
    gpu_prompts,
    gpu_vocab,
    logprob_mismatch,
    timed_refits,
)

TRANSFER = {"family": "reshard", "transport": "p2p"}


def _model_cfg(size: str, seed: int) -> dict[str, Any]:
    return {**GPU_SIZES[size], "seed": seed}


def _trainer_model(size: str, gpu: int) -> Any:
    import torch

    from algorithms.models import build_model

    # vLLM's executor leaves the engine's process one torch thread, and the random init runs on
    # the CPU: at 1.3B that took minutes at one thread.
    torch.set_num_threads(os.cpu_count() or 1)
    return build_model(_model_cfg(size, 1), vocab_size=gpu_vocab(size)["vocab_size"]).to(torch.bfloat16).cuda(gpu)


def _sender(size: str, tp: int, port: int, versions: int, go: Any, done: Any, errors: Any) -> None:
    """The trainer (group rank 0) on GPU ``tp``: sends version ``v`` when ``go`` yields it and
    puts the seconds ``send_weights`` took (synchronized) on ``done``."""
    import torch

    try:
        from nemo_dataplane.distributed.stateless_group import StatelessProcessGroup
        from nemo_dataplane.refit import WeightTransferConfig, build_weight_sender

        dev = torch.device("cuda", tp)
        torch.cuda.set_device(dev)
        model = _trainer_model(size, tp)
        group = StatelessProcessGroup("127.0.0.1", port, 0, 1 + tp, "nccl", 300.0, device=dev, group_name="refit")
        try:
            params = dict(model.named_parameters())
            sender = build_weight_sender(WeightTransferConfig.from_dict(TRANSFER), group, params)
            sender.prepare_refit_info()
            for _ in range(versions):
                v = int(go.get(timeout=300))
                torch.cuda.synchronize(dev)
                s = time.perf_counter()
                sender.send_weights(v)
                torch.cuda.synchronize(dev)
                done.put(time.perf_counter() - s)
        finally:
            group.destroy()
    except BaseException as e:  # noqa: BLE001 - reported by the engine's side
        errors.put(repr(e))


def _aggregate_copy(shares: list[int], src_gpu: int, iters: int = 5) -> float:
    """Median seconds of copying ``shares[i]`` bytes from GPU ``src_gpu`` to GPU ``i``, all at once."""
    import torch

    src = [torch.empty(n, dtype=torch.uint8, device=f"cuda:{src_gpu}") for n in shares]
    dst = [torch.empty(n, dtype=torch.uint8, device=f"cuda:{i}") for i, n in enumerate(shares)]
    devs = list(range(len(shares))) + [src_gpu]
    times = []
    for i in range(iters + 2):
        for d in devs:
            torch.cuda.synchronize(d)
        s = time.perf_counter()
        for a, b in zip(src, dst):
            b.copy_(a, non_blocking=True)
        for d in devs:
            torch.cuda.synchronize(d)
        if i >= 2:
            times.append(time.perf_counter() - s)
    del src, dst
    torch.cuda.empty_cache()
    return statistics.median(times)


def run(size: str, tp: int, repeats: int) -> dict[str, Any]:
    from algorithms.engines.generation import RefitSpec, SamplingSpec
    from nemo_dataplane.refit import TensorSpec, WeightTransferConfig

    v = gpu_vocab(size)
    engine, startup = bf16_refit_engine(size, tensor_parallel_size=tp)
    whole = sum(TensorSpec(n, tuple(s), d).nbytes for n, s, d in engine.param_specs)
    ctx = mp.get_context("spawn")
    go, done, errors = ctx.Queue(), ctx.Queue(), ctx.Queue()
    port = _free_port()
    proc = ctx.Process(target=_sender, args=(size, tp, port, repeats + 1, go, done, errors), daemon=True)
    proc.start()
    try:
        spec = RefitSpec("nccl", 300, WeightTransferConfig.from_dict(TRANSFER), senders=1, tensor_parallel=tp)
        engine.init_refit("127.0.0.1", port, 1 + tp, 1, spec)
        shares = [int(b) for b in engine.llm.collective_rpc("ndp_refit_received", timeout=60)]
        times, send_times = timed_refits(engine, go, repeats + 1, proc, errors, done)
        prompts = gpu_prompts(size, 64)
        out = engine.generate(prompts, 4, SamplingSpec(max_new_tokens=64, temperature=1.0, seed=0, ignore_eos=True))
    finally:
        if proc.is_alive():
            proc.kill()
        engine.shutdown()
    ceiling = _aggregate_copy(shares, tp)
    trainer = _trainer_model(size, tp).eval()
    d = logprob_mismatch(trainer, prompts, 4, out, v["pad_id"], f"cuda:{tp}")
    warm = statistics.median(times[1:])
    return {
        "size": size,
        "tp": tp,
        "whole_bytes": whole,
        "rank_bytes": shares,
        "startup_s": startup,
        "refit_s": warm,
        "refit_cold_s": times[0],
        "refits_s": times,
        "send_s": statistics.median(send_times[1:]),
        "aggregate_copy_s": ceiling,
        "refit_rate_of_copy": ceiling / warm,
        "tokens": int(d.numel()),
        "mismatch_mean": float(d.mean()),
        "mismatch_max": float(d.max()),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="1.3b", choices=[s for s in GPU_SIZES if s not in ("toy", "longtail")])
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "bench_refit_vllm_tp.json")
    args = ap.parse_args()
    import torch

    if torch.cuda.device_count() < args.tp + 1:
        ap.error(
            f"--tp {args.tp} needs {args.tp + 1} GPUs (the engine's and the trainer's), this machine has "
            f"{torch.cuda.device_count()}"
        )
    r = run(args.size, args.tp, args.repeats)
    gpu = torch.cuda.get_device_name(0)
    print(f"\n{args.size}, vLLM TP={args.tp} on GPUs 0..{args.tp - 1}, trainer on GPU {args.tp}, {gpu}, bf16, NCCL")
    print(
        "| MB whole | MB per TP rank | refit ms (cold) | sender ms | aggregate peer copy ms | refit / copy rate |"
        " mismatch mean | max |"
    )
    print("|---|---|---|---|---|---|---|---|")
    print(
        f"| {r['whole_bytes'] / 1e6:.1f} | {', '.join(f'{b / 1e6:.1f}' for b in r['rank_bytes'])} "
        f"| {1e3 * r['refit_s']:.1f} ({1e3 * r['refit_cold_s']:.0f}) | {1e3 * r['send_s']:.1f} "
        f"| {1e3 * r['aggregate_copy_s']:.2f} | {100 * r['refit_rate_of_copy']:.0f} % "
        f"| {r['mismatch_mean']:.4f} | {r['mismatch_max']:.3f} |"
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    body = {"device": gpu, "host": platform.node(), "model": GPU_SIZES[args.size], **r}
    args.out.write_text(json.dumps(body, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
