"""FP8 refit on 2 GPUs: a bf16 trainer refits a vLLM engine running FP8 weights, against the
same refit into a bf16 engine.

    python benchmarks/bench_refit_fp8.py [--size 0.7b] [--forms bf16,fp8,fp8_block] [--repeats 3]

Per form (``bf16``: no quantization; ``fp8``: one scale per matrix; ``fp8_block``: one per
128 x 128 block; ``generation.vllm.quantization``), one after another: a vLLM engine on GPU 0
starts from the size's random-init weights (seed 0) in that form; a trainer process on GPU 1
builds the same architecture from seed 1 in bf16 and sends ``--repeats`` + 1 refits over NCCL
through the project's sender in that form (the sender quantizes on the trainer's GPU). Reported:
the bytes on the wire, the warm refit's median time (the first, cold, apart) and the copy
ceiling of the same bytes (GPU 1 -> GPU 0); then the engine samples 64 prompts x 4 x 128 tokens
at temperature 1 and the **train/generation mismatch** is the per-token |log-prob| difference
between the engine and the bf16 trainer's forward of the refit weights (on GPU 1): mean, p99,
max. Writes ``benchmarks/results/bench_refit_fp8.json`` and prints a table.

Needs vLLM's CUDA build and FP8 tensor cores (compute capability 8.9+). A vLLM install without
DeepGEMM's headers needs ``VLLM_USE_DEEP_GEMM=0`` (block-wise FP8 then runs on CUTLASS).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import platform
import statistics
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).parent))
from generation_cases import (  # noqa: E402
    GPU_SIZES,
    _copy_ceiling,
    _free_port,
    bf16_refit_engine,
    gpu_prompts,
    gpu_vocab,
    logprob_mismatch,
    timed_refits,
)

FORMS = {"bf16": None, "fp8": "fp8", "fp8_block": "fp8_block"}


def _model_cfg(size: str, seed: int) -> dict[str, Any]:
    return {**GPU_SIZES[size], "seed": seed}


def _trainer_model(size: str, gpu: int) -> Any:
    import torch

    from algorithms.models import build_model

    return build_model(_model_cfg(size, 1), vocab_size=gpu_vocab(size)["vocab_size"]).to(torch.bfloat16).cuda(gpu)


def _form(name: str) -> Any:
    from algorithms.refit_weights import form_of

    return form_of(FORMS[name])


def _sender(size: str, form: str, port: int, versions: int, go: Any, errors: Any) -> None:
    """The trainer (group rank 0) on GPU 1: sends version ``v`` when ``go`` yields it."""
    import torch

    try:
        from nemo_dataplane.distributed.stateless_group import StatelessProcessGroup
        from nemo_dataplane.refit import WeightTransferConfig, build_weight_sender

        torch.set_num_threads(8)
        dev = torch.device("cuda", 1)
        torch.cuda.set_device(dev)
        model = _trainer_model(size, 1)
        shapes = {n: (p.shape, p.dtype) for n, p in model.named_parameters()}
        weights = _form(form)
        group = StatelessProcessGroup("127.0.0.1", port, 0, 2, "nccl", 300.0, device=dev, group_name="refit")
        try:
            sender = build_weight_sender(
                WeightTransferConfig(),
                group,
                weights.source(model.named_parameters, shapes),
                full_shapes=weights.layout(shapes),
                device=dev,
            )
            sender.prepare_refit_info()
            for _ in range(versions):
                sender.send_weights(int(go.get(timeout=300)))
            torch.cuda.synchronize(dev)
        finally:
            group.destroy()
    except BaseException as e:  # noqa: BLE001 - reported by the engine's side
        errors.put(repr(e))


def run_form(size: str, form: str, repeats: int) -> dict[str, Any]:
    import torch

    from algorithms.engines.generation import RefitSpec, SamplingSpec
    from nemo_dataplane.refit import TensorSpec, WeightTransferConfig

    torch.set_num_threads(8)
    v = gpu_vocab(size)
    engine, startup = bf16_refit_engine(size, weights=_form(form))
    nbytes = sum(TensorSpec(n, tuple(s), d).nbytes for n, s, d in engine.param_specs)
    ctx = mp.get_context("spawn")
    go, errors = ctx.Queue(), ctx.Queue()
    port = _free_port()
    proc = ctx.Process(target=_sender, args=(size, form, port, repeats + 1, go, errors), daemon=True)
    proc.start()
    try:
        engine.init_refit("127.0.0.1", port, 2, 1, RefitSpec("nccl", 300, WeightTransferConfig(), senders=1))
        times, _ = timed_refits(engine, go, repeats + 1, proc, errors)
        prompts = gpu_prompts(size, 64)
        out = engine.generate(prompts, 4, SamplingSpec(max_new_tokens=128, temperature=1.0, seed=0, ignore_eos=True))
    finally:
        if proc.is_alive():
            proc.kill()
        engine.shutdown()
    ceiling = _copy_ceiling(nbytes, "cuda:1", "cuda:0")
    # The bf16 trainer's forward of the weights it sent, on GPU 1.
    trainer = _trainer_model(size, 1).eval()
    d = logprob_mismatch(trainer, prompts, 4, out, v["pad_id"], "cuda:1")
    del trainer
    torch.cuda.empty_cache()
    warm = statistics.median(times[1:])
    return {
        "form": form,
        "bytes": nbytes,
        "startup_s": startup,
        "refit_s": warm,
        "refit_cold_s": times[0],
        "refits_s": times,
        "ceiling_s": ceiling,
        "ceiling_over_refit": ceiling / warm,
        "tokens": int(d.numel()),
        "mismatch_mean": float(d.mean()),
        "mismatch_p99": float(d.quantile(0.99)),
        "mismatch_max": float(d.max()),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="0.7b", choices=[s for s in GPU_SIZES if s not in ("toy", "longtail")])
    ap.add_argument("--forms", default="bf16,fp8,fp8_block")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "bench_refit_fp8.json")
    args = ap.parse_args()
    forms = args.forms.split(",")
    unknown = [f for f in forms if f not in FORMS]
    if unknown:
        ap.error(f"--forms: unknown {unknown}; choose from {list(FORMS)}")
    import torch

    results = []
    for form in forms:
        print(f"[bench_refit_fp8] {args.size} {form} ...", file=sys.stderr, flush=True)
        results.append(run_form(args.size, form, args.repeats))
        r = results[-1]
        print(f"  {form}: refit {1e3 * r['refit_s']:.1f} ms, mismatch mean {r['mismatch_mean']:.4f}", flush=True)
    base = next((r for r in results if r["form"] == "bf16"), None)
    print(f"\n{args.size} on {torch.cuda.get_device_name(0)}: bf16 trainer -> vLLM engine, NCCL, GPU 1 -> GPU 0")
    print("| form | MB sent | x bf16 bytes | refit ms (cold) | x bf16 time | ceiling ms | mismatch mean | p99 | max |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in results:
        xb = f"{r['bytes'] / base['bytes']:.3f}" if base else "-"
        xt = f"{r['refit_s'] / base['refit_s']:.2f}" if base else "-"
        print(
            f"| {r['form']} | {r['bytes'] / 1e6:.1f} | {xb} | {1e3 * r['refit_s']:.1f} ({1e3 * r['refit_cold_s']:.0f}) "
            f"| {xt} | {1e3 * r['ceiling_s']:.2f} | {r['mismatch_mean']:.4f} | {r['mismatch_p99']:.4f} "
            f"| {r['mismatch_max']:.3f} |"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    body = {
        "size": args.size,
        "model": GPU_SIZES[args.size],
        "device": torch.cuda.get_device_name(0),
        "host": platform.node(),
        "repeats": args.repeats,
        "results": results,
    }
    args.out.write_text(json.dumps(body, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
