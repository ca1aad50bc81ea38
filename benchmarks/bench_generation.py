"""Generation engines: vLLM vs the Hugging Face sampler (the baseline), at two model sizes.

    python benchmarks/bench_generation.py [--prompts 32] [--n 16] [--max-new-tokens 32] [--repeats 3]
        [--sizes toy,4x512] [--out benchmarks/results/bench_generation.json]

Each case (size x engine) runs in a fresh subprocess, as the generator actor would: import,
engine start-up (build the policy's model, for vLLM write it to a local dir and start the
engine), one warm-up batch, then ``--repeats`` timed batches of ``--prompts`` prompts x ``--n``
samples (temperature 1, EOS allowed: tokens/s counts the tokens actually generated), and
``--repeats`` refits from a ``RefitSender`` in a thread of the same process over a real gloo
``StatelessProcessGroup`` (the receiver's ``receive_weights``: transfer, and for vLLM the install
through the model's loader and the prefix-cache reset). After the last refit the batch's
log-probs are compared with the trainer's forward of the refit weights
(``algorithms.models.sequence_logprobs``): mean and max |delta| per sampled token.

Engines: ``hf`` (baseline), ``vllm`` (in-process, fp32, the default), ``vllm-mp`` (multiprocess
engine: start-up and refit through vLLM's worker process) and ``vllm-bf16`` (toy size only: the
log-prob cost of bf16). Times are medians. Prints a table and writes JSON.

``--device cuda`` (vLLM's CUDA build; 2 GPUs for the refit case) measures where vLLM pays on GPUs
instead, with its own sizes, engines and defaults (the CPU run above is unchanged):

    python benchmarks/bench_generation.py --device cuda [--sizes toy,longtail,100m,0.7b]
        [--engines hf,vllm-v1,vllm-v2] [--lengths 128,512] [--prompts 256] [--n 4]
        [--repeats 2] [--hf-repeats 1] [--refit-size 1.3b] [--refit-routes nccl,ipc] [--lanes 2]

* Generation, per (size, engine), in a fresh subprocess on one GPU: start-up (as on CPU), one
  warm-up batch of 16 tokens, then for each length ``--repeats`` timed batches of ``--prompts``
  token-id prompts (16-31 tokens) x ``--n`` samples with ``ignore_eos`` (every response runs to
  the length; tokens/s still counts the tokens returned), weights and compute in bf16.
  ``hf``: the HF sampler (``HFEngine``, batched ``generate``; ``--hf-repeats`` timed batches
  per length, it is the slow one); ``vllm-v1`` / ``vllm-v2``: ``VLLMEngine`` with vLLM's V1 or
  V2 model runner (``VLLM_USE_V2_MODEL_RUNNER=0|1``), a KV cache sized for the whole batch
  and ``max_num_seqs`` = the batch's responses, otherwise the engine's defaults (eager, no
  CUDA graphs). One torch thread per case, as the generator actor runs with
  ``trainer.num_threads=1``. ``--lanes 2`` runs cases two at a time, one per GPU (each case sees
  only its GPU); the baseline of a size is measured in the same run.
* Refit (``--refit-size``), alone on 2 GPUs before the generation cases: a vLLM engine on
  GPU 0 receives ``--repeats`` + 1 refits (the first, cold, is reported apart) from a trainer
  process, per route: ``nccl`` (trainer on GPU 1, the packed sender's broadcast) and ``ipc``
  (trainer on GPU 0, ``refit.mode=reshard refit.transport=ipc`` over a gloo control group).
  Timed: the engine's ``receive_weights`` (transfer, install through the model's loader, prefix-
  cache reset), against the ceiling measured in the same process: one ``copy_`` of the same
  bytes GPU 1 -> GPU 0 (nccl) or GPU 0 -> GPU 0 (ipc).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import queue
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from generation_cases import GPU_SIZES, SIZES, _free_port, run_gpu_case, run_refit_case  # noqa: E402
from generation_report import print_gpu_tables  # noqa: E402

ENGINES = ("hf", "vllm", "vllm-mp", "vllm-bf16")
_RESULTS = REPO / "benchmarks" / "results"
CPU_DEFAULTS: dict[str, Any] = {
    "prompts": 32,
    "n": 16,
    "repeats": 3,
    "sizes": "toy,4x512",
    "engines": ",".join(ENGINES),
    "out": str(_RESULTS / "bench_generation.json"),
}
GPU_DEFAULTS: dict[str, Any] = {
    "prompts": 256,
    "n": 4,
    "repeats": 2,
    "sizes": "toy,longtail,100m,0.7b",
    "engines": "hf,vllm-v1,vllm-v2",
    "out": str(_RESULTS / "bench_generation_cuda.json"),
}


# ------------------------------------------------------------------------------ one case
def run_case(size: str, engine_name: str, prompts: int, n: int, max_new: int, repeats: int) -> dict[str, Any]:
    """One (size, engine) case in this process; returns its measurements."""
    t0 = time.perf_counter()
    import torch

    torch.set_num_threads(1)
    import transformers.models.llama.modeling_llama  # noqa: F401 - both engines build the policy's model

    from algorithms.engines.generation import RefitSpec, SamplingSpec
    from algorithms.engines.generation.hf import HFEngine
    from algorithms.models import build_model, pad_batch, sequence_logprobs
    from algorithms.tasks import CharTokenizer
    from nemo_dataplane.distributed.stateless_group import StatelessProcessGroup
    from nemo_dataplane.refit import RefitSender, WeightTransferConfig

    tok = CharTokenizer()
    model_cfg = SIZES[size]
    if engine_name != "hf":
        import vllm  # noqa: F401 - import time is reported on its own
    t_import = time.perf_counter() - t0

    t1 = time.perf_counter()
    if engine_name == "hf":
        engine: Any = HFEngine(model_cfg, vocab_size=tok.vocab_size, eos_id=tok.eos_id, pad_id=tok.pad_id)
    else:
        from algorithms.config import VLLMEngineConfig
        from algorithms.engines.generation.vllm import VLLMEngine

        args = VLLMEngineConfig(
            multiprocessing=engine_name == "vllm-mp", dtype="bfloat16" if engine_name == "vllm-bf16" else "float32"
        )
        engine = VLLMEngine(
            model_cfg, vocab_size=tok.vocab_size, eos_id=tok.eos_id, bos_id=tok.bos_id, pad_id=tok.pad_id, engine=args
        )
    startup = time.perf_counter() - t1
    try:
        batch = [[tok.bos_id, *[3 + (5 * i + j) % 30 for j in range(6 + i % 5)]] for i in range(prompts)]

        def timed(seed: int) -> tuple[float, int, Any]:
            s = time.perf_counter()
            out = engine.generate(batch, n, SamplingSpec(max_new_tokens=max_new, temperature=1.0, seed=seed))
            return time.perf_counter() - s, sum(len(t) for t in out.tokens), out

        timed(0)  # warm-up
        gens = [timed(1 + r) for r in range(repeats)]
        gen_s = statistics.median(g[0] for g in gens)
        tokens_per_s = statistics.median(g[1] / g[0] for g in gens)

        trainer = build_model(model_cfg, vocab_size=tok.vocab_size)
        trainer.eval()
        port = _free_port()
        errors: list[BaseException] = []
        ready, go = threading.Semaphore(0), threading.Semaphore(0)

        def sender() -> None:
            g = StatelessProcessGroup("127.0.0.1", port, 0, 2, "gloo", 120.0, group_name="refit")
            try:
                s = RefitSender(g, trainer.named_parameters)
                s.prepare_refit_info()
                for v in range(repeats):
                    go.acquire()
                    with torch.no_grad():  # new weights every refit, as after a step
                        gen = torch.Generator().manual_seed(100 + v)
                        for p in trainer.parameters():
                            p.add_(torch.randn(p.shape, generator=gen) * 0.02)
                    ready.release()
                    s.send_weights(v)
            except BaseException as e:  # noqa: BLE001 - reported below
                errors.append(e)
            finally:
                g.destroy()

        th = threading.Thread(target=sender, daemon=True)
        th.start()
        engine.init_refit("127.0.0.1", port, 2, 1, RefitSpec("gloo", 120, WeightTransferConfig(), senders=1))
        refits = []
        for v in range(repeats):
            go.release()
            ready.acquire()
            s = time.perf_counter()
            got = engine.receive_weights()
            refits.append(time.perf_counter() - s)
            assert got == v, (got, v)
        th.join(120)
        if errors:
            raise errors[0]

        _, _, out = timed(999)
        rows = [p for p in batch for _ in range(n)]
        ids, attn = pad_batch([p + t for p, t in zip(rows, out.tokens)], tok.pad_id)
        resp = torch.zeros_like(ids)
        for i, (p, t) in enumerate(zip(rows, out.tokens)):
            resp[i, len(p) : len(p) + len(t)] = 1
        with torch.no_grad():
            ref = sequence_logprobs(trainer, ids, attn, resp, temperature=1.0)
        deltas = torch.cat(
            [
                (ref[i, len(p) - 1 : len(p) - 1 + len(t)] - torch.tensor(lp)).abs()
                for i, (p, t, lp) in enumerate(zip(rows, out.tokens, out.logprobs))
                if t
            ]
        )
        params = sum(p.numel() for p in trainer.parameters())
    finally:
        engine.shutdown()
    return {
        "size": size,
        "engine": engine_name,
        "params": params,
        "import_s": t_import,
        "startup_s": startup,
        "gen_s": gen_s,
        "tokens_per_s": tokens_per_s,
        "tokens": gens[0][1],
        "refit_s": statistics.median(refits),
        "refit_bytes": sum(p.numel() * p.element_size() for p in trainer.parameters()),
        "logprob_mean_abs_delta": float(deltas.mean()),
        "logprob_max_abs_delta": float(deltas.max()),
        "logprob_tokens": int(deltas.numel()),
    }


def _run_sub(argv: list[str], env: dict[str, str], timeout: float) -> dict[str, Any]:
    """Run this script with ``argv`` in a subprocess; its RESULT, or ``{"error": ...}``."""
    t = time.perf_counter()
    try:
        proc = subprocess.run(
            [sys.executable, __file__, *argv], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout
        )
    except subprocess.TimeoutExpired as e:
        err, out = (x.decode(errors="replace") if isinstance(x, bytes) else str(x or "") for x in (e.stderr, e.stdout))
        return {"error": f"timed out after {timeout:.0f} s", "partial": _partial(out), "stderr_tail": err[-3000:]}
    lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        err = proc.stderr[-3000:]
        return {"error": f"exit code {proc.returncode}", "partial": _partial(proc.stdout), "stderr_tail": err}
    res: dict[str, Any] = json.loads(lines[-1][len("RESULT ") :])
    res["wall_s"] = time.perf_counter() - t
    return res


def _partial(stdout: str) -> dict[str, Any]:
    """The per-length results a generation case printed before it stopped."""
    done: dict[str, Any] = {}
    for line in stdout.splitlines():
        if line.startswith("LENGTH "):
            done.update(json.loads(line[len("LENGTH ") :]))
    return done


def gpu_main(args: argparse.Namespace) -> int:
    """The ``--device cuda`` run: generation cases on ``--lanes`` GPUs, then the refit case on
    two; prints the tables and writes the JSON after every case (a failed case records its error
    and the rest go on)."""
    lengths = [int(x) for x in args.lengths.split(",")]
    sizes = [s for s in args.sizes.split(",") if s]
    engines = [e for e in args.engines.split(",") if e]
    for s in sizes + ([args.refit_size] if args.refit_size else []):
        if s not in GPU_SIZES:
            raise SystemExit(f"unknown GPU size {s!r}: {list(GPU_SIZES)}")
    env = dict(
        os.environ,
        OMP_NUM_THREADS="1",
        PYTHONPATH=os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p),
    )
    common = ["--prompts", str(args.prompts), "--n", str(args.n), "--repeats", str(args.repeats)]
    common += ["--hf-repeats", str(args.hf_repeats), "--lengths", args.lengths, "--case-device", args.case_device]
    # Largest first, so the two lanes end close together.
    todo: queue.Queue[tuple[str, str]] = queue.Queue()
    for size in reversed(sizes) if args.lanes > 1 else sizes:
        for eng in engines:
            todo.put((size, eng))
    results: list[dict[str, Any]] = []
    refit: dict[str, Any] = {}
    lock = threading.Lock()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    settings: dict[str, Any] = {
        "device": "cuda",
        "prompts": args.prompts,
        "n": args.n,
        "lengths": lengths,
        "repeats": args.repeats,
        "hf_repeats": args.hf_repeats,
        "temperature": 1.0,
        "ignore_eos": True,
        "dtype": "bfloat16",
        "torch_threads": 1,
        "lanes": args.lanes,
        "sizes": {s: GPU_SIZES[s] for s in sizes + ([args.refit_size] if args.refit_size else [])},
    }

    machine: dict[str, Any] = {"platform": platform.platform(), "cpus": os.cpu_count()}
    machine.update(python=platform.python_version(), gpus=_gpu_names())

    def write() -> None:
        with lock:
            body = {"bench": "bench_generation", "machine": machine, "settings": settings, "baseline": "hf"}
            out.write_text(json.dumps({**body, "results": results, "refit": refit}, indent=2))

    def lane(gpu: int) -> None:
        while True:
            try:
                size, eng = todo.get_nowait()
            except queue.Empty:
                return
            lane_env = dict(env, CUDA_VISIBLE_DEVICES=str(gpu))
            if eng.startswith("vllm-v"):
                lane_env["VLLM_USE_V2_MODEL_RUNNER"] = "1" if eng == "vllm-v2" else "0"
            print(f"[bench_generation] {size} {eng} on GPU {gpu} ...", file=sys.stderr, flush=True)
            res = _run_sub(["--gpu-case", f"{size}:{eng}", *common], lane_env, args.timeout)
            res.update(size=size, engine=eng, gpu=gpu)
            with lock:
                results.append(res)
            print(f"[bench_generation] {size} {eng}: {res.get('error') or 'ok'}", file=sys.stderr, flush=True)
            if res.get("error"):
                print(res.get("stderr_tail", "")[-1500:], file=sys.stderr, flush=True)
            write()

    # The refit case first, alone (it takes two GPUs), so a sweep cut short still has it.
    if args.refit_size:
        print(f"[bench_generation] refit {args.refit_size} {args.refit_routes} ...", file=sys.stderr, flush=True)
        argv = ["--refit-case", args.refit_size, "--refit-routes", args.refit_routes, *common]
        refit.update(_run_sub(argv, env, args.timeout))
        if refit.get("error"):
            print(refit.get("stderr_tail", "")[-1500:], file=sys.stderr, flush=True)
        write()
    threads = [threading.Thread(target=lane, args=(g,), daemon=True) for g in range(args.lanes)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    print_gpu_tables(settings, results, refit)
    print(f"wrote {out}")
    return 0


def _gpu_names() -> list[str]:
    try:
        q = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True, timeout=30
        )
        return [x.strip() for x in q.stdout.splitlines() if x.strip()]
    except (OSError, subprocess.SubprocessError):
        return []


# ------------------------------------------------------------------------------ driver
def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    # None: the device's default (CPU_DEFAULTS / GPU_DEFAULTS).
    ap.add_argument("--prompts", type=int)
    ap.add_argument("--n", type=int)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int)
    ap.add_argument("--sizes")
    ap.add_argument("--engines")
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--out")
    ap.add_argument("--case", help=argparse.SUPPRESS)  # size:engine, run in this process (internal)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="cuda: the GPU run (module docstring)")
    ap.add_argument("--lengths", default="128,512", help="cuda: response lengths (tokens)")
    ap.add_argument("--hf-repeats", type=int, default=1, help="cuda: timed batches of the hf engine per length")
    ap.add_argument("--refit-size", default="1.3b", help="cuda: the refit case's size ('' skips it)")
    ap.add_argument("--refit-routes", default="nccl,ipc")
    ap.add_argument("--lanes", type=int, default=1, help="cuda: generation cases run at once, one per GPU")
    ap.add_argument("--gpu-case", help=argparse.SUPPRESS)  # size:engine (internal)
    ap.add_argument("--refit-case", help=argparse.SUPPRESS)  # size (internal)
    # Where a GPU run's cases run: "cpu" checks the GPU run's code on a machine without GPUs.
    ap.add_argument("--case-device", default="cuda", help=argparse.SUPPRESS)
    args = ap.parse_args()
    gpu_run = args.device == "cuda" or args.gpu_case or args.refit_case
    for key, value in (GPU_DEFAULTS if gpu_run else CPU_DEFAULTS).items():
        if getattr(args, key) is None:
            setattr(args, key, value)

    if args.gpu_case:
        size, eng = args.gpu_case.split(":")
        lengths = [int(x) for x in args.lengths.split(",")]
        res = run_gpu_case(size, eng, args.prompts, args.n, lengths, args.repeats, args.hf_repeats, args.case_device)
        print("RESULT " + json.dumps(res), flush=True)
        return 0
    if args.refit_case:
        res = run_refit_case(args.refit_case, args.refit_routes.split(","), args.repeats, args.case_device)
        print("RESULT " + json.dumps(res), flush=True)
        return 0
    if args.device == "cuda":
        return gpu_main(args)

    if args.case:
        size, eng = args.case.split(":")
        res = run_case(size, eng, args.prompts, args.n, args.max_new_tokens, args.repeats)
        print("RESULT " + json.dumps(res), flush=True)
        return 0

    env = dict(
        os.environ,
        OMP_NUM_THREADS="1",
        PYTHONPATH=os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p),
    )
    results: list[dict[str, Any]] = []
    for size in args.sizes.split(","):
        for eng in args.engines.split(","):
            if eng == "vllm-bf16" and size != "toy":
                continue
            cmd = [
                sys.executable,
                __file__,
                "--case",
                f"{size}:{eng}",
                "--prompts",
                str(args.prompts),
                "--n",
                str(args.n),
                "--max-new-tokens",
                str(args.max_new_tokens),
                "--repeats",
                str(args.repeats),
            ]
            print(f"[bench_generation] {size} {eng} ...", file=sys.stderr, flush=True)
            proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=args.timeout)
            lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
            if proc.returncode != 0 or not lines:
                raise RuntimeError(f"case {size}:{eng} failed:\n{proc.stderr[-4000:]}")
            results.append(json.loads(lines[-1][len("RESULT ") :]))

    base = {r["size"]: r for r in results if r["engine"] == "hf"}
    head = (
        f"{'size':<6} {'engine':<10} {'params':>8} {'start s':>8} {'tok/s':>8} {'x hf':>6} {'refit ms':>9} "
        f"{'x hf':>6} {'mean|dlp|':>10} {'max|dlp|':>10}"
    )
    print(
        f"bench_generation: {args.prompts} prompts x n={args.n}, max_new_tokens={args.max_new_tokens}, "
        f"temperature 1, {args.repeats} repeats (medians), OMP_NUM_THREADS=1"
    )
    print(head)
    print("-" * len(head))
    for r in results:
        b = base.get(r["size"])
        tok_x = f"{r['tokens_per_s'] / b['tokens_per_s']:.2f}" if b else "-"
        ref_x = f"{r['refit_s'] / b['refit_s']:.2f}" if b else "-"
        print(
            f"{r['size']:<6} {r['engine']:<10} {r['params']:>8} {r['startup_s']:>8.2f} {r['tokens_per_s']:>8.0f} "
            f"{tok_x:>6} {1000 * r['refit_s']:>9.1f} {ref_x:>6} {r['logprob_mean_abs_delta']:>10.2e} "
            f"{r['logprob_max_abs_delta']:>10.2e}"
        )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "bench": "bench_generation",
                "machine": {
                    "platform": platform.platform(),
                    "cpus": os.cpu_count(),
                    "python": platform.python_version(),
                },
                "settings": {
                    "prompts": args.prompts,
                    "n": args.n,
                    "max_new_tokens": args.max_new_tokens,
                    "repeats": args.repeats,
                    "temperature": 1.0,
                    "omp_num_threads": 1,
                },
                "baseline": "hf",
                "results": results,
            },
            indent=2,
        )
    )
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
