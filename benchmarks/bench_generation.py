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
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import threading
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
ENGINES = ("hf", "vllm", "vllm-mp", "vllm-bf16")


# ------------------------------------------------------------------------------ one case
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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


# ------------------------------------------------------------------------------ driver
def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--n", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--sizes", default="toy,4x512")
    ap.add_argument("--engines", default=",".join(ENGINES))
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "bench_generation.json"))
    ap.add_argument("--case", help=argparse.SUPPRESS)  # size:engine, run in this process (internal)
    args = ap.parse_args()

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
