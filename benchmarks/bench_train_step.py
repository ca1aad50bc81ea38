"""The trainer's log-prob and train phases per step against a plain FSDP2 loop, and the refit of a
fully sharded model as the trainer does it against the peer copies of the same bytes.

    python benchmarks/bench_train_step.py --device cuda --cases 1b:none,1b:fsdp,8b:fsdp --refit 8b \\
        --out benchmarks/results/bench_train_step.json
    python benchmarks/bench_train_step.py --device cpu --cases tiny:none,tiny:fsdp --refit tiny   # a check

Each case (``size:sharding``) runs one process per GPU (``--world``, default every GPU; on CPU 2
ranks over gloo) and, in the same processes, two paths over the same model (the real-size
config's ``policy.model``, built on the device from its seed), the same batch (``--mbs``
micro-batches of ``--rows`` rows of ``--seq`` tokens per rank, a 16-token prompt) and the same
precision (the config's: bf16 with float32 masters):

* ``trainer``: the training engine the config names (``policy.sharding`` none: replicated with
  one gradient all-reduce; fsdp: FSDP2), driven as a policy rank drives it: per micro-batch the
  policy's and the reference's log-probs under ``no_grad`` (to the host, as the write-back
  does), then ``train_step`` (GRPO loss with the KL term, entropy, non-finite checks, clipping
  over every shard, AdamW);
* ``peer``: the same work written as a plain FSDP2 loop (each decoder layer and the root
  ``fully_shard``-ed with the same mixed-precision policy; ``log_softmax`` + gather; a
  policy-gradient loss; ``clip_grad_norm_``; AdamW), the baseline every ratio is taken against.

Per path: every step's time (the first apart: ``first/later``), the median of the others, tokens/s
per GPU, MFU (model FLOPs: two log-prob forwards ``2 * (2N + 4Lhs)`` and a train pass
``6N + 12Lhs`` per token, plus ``2N + 4Lhs`` with activation checkpointing; against
``--peak-tflops`` per GPU, 989 for an H100/H200's dense bf16), peak memory per GPU.

``--refit SIZE``: the ``fsdp`` case of that size also refits a generator process (one more
rank, on the last GPU, sharing it with the last policy rank; CUDA IPC with a gloo control group,
as ``grpo_llama_8b.yaml`` on 2 GPUs): ``--refit-iters`` refits after a warm-up, each timed on
the generator from a barrier to its weights being usable (``refit_receive_s`` as the trainer
reports it), checked bit for bit by an order-free checksum of every tensor against the senders'
shards; and, in the same run, the peer copies of the same bytes (each sender's shard bytes into
the generator's GPU, all at once: the ideal the refit is held to).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from refit_model import HOST, run_ranks  # noqa: E402

CONFIGS = {
    "tiny": REPO / "examples" / "configs" / "grpo_tiny.yaml",
    "1b": REPO / "examples" / "configs" / "grpo_llama_1b.yaml",
    "8b": REPO / "examples" / "configs" / "grpo_llama_8b.yaml",
}
VOCAB_PAD = {"tiny": (40, 0), "1b": (32000, 2), "8b": (32000, 2)}
PROMPT = 16
RATIO_TARGET = 1.1
REFIT_TARGET = 0.8


def _cfg(args: argparse.Namespace, size: str, sharding: str, world: int) -> Any:
    from algorithms.config import load_config

    dev = args.device
    overrides = [
        f"policy.sharding={sharding}",
        f"trainer.dp_size={world}",
        f"policy.device={dev}",
        f"policy.dist_backend={'nccl' if dev == 'cuda' else 'gloo'}",
        "policy.gpus_per_rank=1" if dev == "cuda" else "policy.gpus_per_rank=null",
        f"generation.device={dev}",
        # The refit as grpo_llama_8b.yaml runs it on 2 GPUs: CUDA IPC, a gloo group for control.
        "refit.backend=gloo",
        f"refit.transport={'ipc' if dev == 'cuda' else 'p2p'}",
        "refit.mode=reshard",
        "policy.tokenizer=char",  # the engine is given the vocabulary size; no tokenizer is built
        f"generation.num_gpus={0.3 if dev == 'cuda' else 1}",
    ]
    if args.activation_checkpointing is not None:
        overrides.append(f"policy.activation_checkpointing={args.activation_checkpointing}")
    if args.precision:
        overrides.append(f"policy.precision={args.precision}")
    return load_config(CONFIGS[size], overrides)


def _batch(args: argparse.Namespace, rank: int, vocab: int, dev: torch.device) -> list[Any]:
    """``--mbs`` micro-batches of ``--rows`` rows of ``--seq`` tokens: (micro-batch, advantages)."""
    from tensordict import TensorDict

    from nemo_dataplane.codec import jagged_from_rows

    gen = torch.Generator().manual_seed(7 + rank)
    out = []
    for _ in range(args.mbs):
        rows = [torch.randint(3, vocab, (args.seq,), generator=gen) for _ in range(args.rows)]
        mb = TensorDict(
            {"input_ids": jagged_from_rows(rows), "prompt_len": torch.full((args.rows,), PROMPT, dtype=torch.int64)},
            batch_size=[args.rows],
        )
        out.append((mb, torch.randn(args.rows, generator=gen).to(dev)))
    return out


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    dist.barrier()


def _trainer_path(args: argparse.Namespace, cfg: Any, rank: int, dev: torch.device, batch: list[Any]) -> Any:
    """Step the engine as a policy rank does; returns (engine, per-step seconds, phases)."""
    from algorithms.engines.training import Prepared, build_training_engine
    from algorithms.workers.policy import warm_up_collectives

    vocab, pad = VOCAB_PAD[args.size]
    engine = build_training_engine(cfg, dev, vocab_size=vocab, pad_id=pad, rank=rank)
    warm_up_collectives(dev)  # as the policy worker sets up: NCCL's communicator at start-up
    engine.connect(rank)
    steps, lp_s, tr_s = [], [], []
    for _ in range(args.steps):
        _sync(dev)
        t0 = time.perf_counter()
        prepared, tokens = [], 0.0
        with torch.no_grad():
            for mb, adv in batch:
                old, _, mask = engine.score("policy", mb, False)
                ref, _, _ = engine.score("reference", mb, False)
                old_h, ref_h = old.float().cpu(), ref.float().cpu()  # the write-back's copy to the host
                prepared.append(
                    Prepared(mb=mb, mask=mask, old=old_h.to(dev), ref=ref_h.to(dev), adv=adv, behaviour=None)
                )
                tokens += float(mask.sum())
        t1 = time.perf_counter()
        total = torch.tensor([tokens], dtype=torch.float64, device=dev)
        dist.all_reduce(total)
        engine.train_step(prepared, float(total.item()), False)
        _sync(dev)
        t2 = time.perf_counter()
        steps.append(t2 - t0)
        lp_s.append(t1 - t0)
        tr_s.append(t2 - t1)
    return engine, steps, {"logprobs_s": lp_s, "train_s": tr_s}


def _peer_path(args: argparse.Namespace, cfg: Any, dev: torch.device, batch: list[Any]) -> Any:
    """The same work as a plain FSDP2 loop (the baseline)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from algorithms.models import build_model, pad_batch

    vocab, pad = VOCAB_PAD[args.size]
    bf16 = cfg.policy.precision == "bf16"
    model = build_model(dict(cfg.policy.model), vocab_size=vocab, device=dev)
    if cfg.policy.activation_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ref = build_model(dict(cfg.policy.model), vocab_size=vocab, device=dev)
    if bf16:
        ref.to(torch.bfloat16)
    ref.requires_grad_(False)
    mesh = init_device_mesh(dev.type, (dist.get_world_size(),))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else None
    for m, policy in ((model, mp), (ref, None)):
        kw: dict[str, Any] = {"mesh": mesh, **({"mp_policy": policy} if policy else {})}
        for layer in m.model.layers:
            fully_shard(layer, **kw)
        fully_shard(m, **kw)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.policy.lr, weight_decay=cfg.policy.weight_decay)

    def logprobs(m: torch.nn.Module, ids: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        logits = m(input_ids=ids, attention_mask=attn, use_cache=False).logits[:, :-1].float()
        return torch.log_softmax(logits, -1).gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)

    inputs = []
    for mb, adv in batch:
        ids, attn = pad_batch(list(mb["input_ids"].unbind()), pad)
        mask = torch.zeros(ids.shape[0], ids.shape[1] - 1)
        mask[:, PROMPT - 1 :] = 1
        inputs.append((ids.to(dev), attn.to(dev), mask.to(dev), adv))
    steps = []
    for _ in range(args.steps):
        _sync(dev)
        t0 = time.perf_counter()
        with torch.no_grad():
            olds = [(logprobs(model, i, a).cpu(), logprobs(ref, i, a).cpu()) for i, a, _, _ in inputs]
        tokens = sum(float(m.sum()) for _, _, m, _ in inputs) * dist.get_world_size()
        for (ids, attn, mask, adv), (old, _) in zip(inputs, olds):
            lp = logprobs(model, ids, attn)
            ratio = torch.exp(lp - old.to(dev))
            loss = -(ratio * adv[:, None] * mask).sum() / tokens
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.policy.max_grad_norm)
        opt.step()
        opt.zero_grad()
        _sync(dev)
        steps.append(time.perf_counter() - t0)
    del model, ref, opt
    return steps


def _flops_per_token(cfg: Any, n_params: int, seq: int) -> float:
    from algorithms.models import model_config_values

    v = model_config_values(cfg.policy.model)
    layers, hidden = int(v["num_hidden_layers"]), int(v["hidden_size"])
    fwd = 2 * n_params + 4 * layers * hidden * seq
    train = 3 * fwd + (fwd if cfg.policy.activation_checkpointing else 0)
    return 2 * fwd + train


def _summary(steps: list[float], tokens_per_gpu: int, flops_per_token: float, peak: float) -> dict[str, Any]:
    later = statistics.median(steps[1:]) if len(steps) > 1 else steps[0]
    return {
        "steps_s": steps,
        "first_s": steps[0],
        "step_s": later,
        "first_over_later": steps[0] / later,
        "tokens_per_s_per_gpu": tokens_per_gpu / later,
        "mfu": tokens_per_gpu * flops_per_token / later / (peak * 1e12) if peak else None,
    }


def _peak_gb(dev: torch.device) -> float | None:
    return torch.cuda.max_memory_allocated(dev) / 1e9 if dev.type == "cuda" else None


def case_rank(rank: int, port: int, args: argparse.Namespace, size: str, sharding: str, world: int) -> dict[str, Any]:
    """One rank of a case; ``rank == world`` is the generator of the refit (``--refit``)."""
    args.size = size
    dev = (
        torch.device("cuda", min(rank, torch.cuda.device_count() - 1)) if args.device == "cuda" else torch.device("cpu")
    )
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // (world + 1)))
    refit = args.refit == size and sharding == "fsdp"
    cfg = _cfg(args, size, sharding, world)
    if rank == world:
        return _generator(cfg, world, port + 1, dev, args)
    dist.init_process_group(
        "nccl" if dev.type == "cuda" else "gloo", init_method=f"tcp://{HOST}:{port}", rank=rank, world_size=world
    )
    try:
        vocab, _ = VOCAB_PAD[size]
        batch = _batch(args, rank, vocab, dev)
        tokens = args.mbs * args.rows * args.seq
        out: dict[str, Any] = {"size": size, "sharding": sharding, "world": world, "tokens_per_gpu": tokens}
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats(dev)
        t0 = time.perf_counter()
        engine, steps, phases = _trainer_path(args, cfg, rank, dev, batch)
        out["params"] = engine.num_params()
        fpt = _flops_per_token(cfg, out["params"], args.seq)
        out["trainer"] = {**_summary(steps, tokens, fpt, args.peak_tflops), "peak_gb": _peak_gb(dev)}
        out["trainer"]["logprobs_s"] = statistics.median(phases["logprobs_s"][1:] or phases["logprobs_s"])
        out["trainer"]["train_s"] = statistics.median(phases["train_s"][1:] or phases["train_s"])
        out["trainer"]["first_phases_s"] = {k: v[0] for k, v in phases.items()}
        out["trainer"]["build_and_steps_s"] = time.perf_counter() - t0
        if refit:
            out["refit"] = _send(engine, cfg, rank, world, port + 1, dev, args)
        del engine
        gc.collect()
        if dev.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(dev)
        if not args.no_peer:
            steps = _peer_path(args, cfg, dev, batch)
            out["peer"] = {**_summary(steps, tokens, fpt, args.peak_tflops), "peak_gb": _peak_gb(dev)}
        return out
    finally:
        dist.destroy_process_group()


def _checksums(tensors: dict[str, torch.Tensor]) -> dict[str, int]:
    """Per tensor, the sum of its elements' bit patterns (int64): order-free, so shards add up."""
    out = {}
    for n, t in tensors.items():
        bits = t.contiguous().view(torch.int16 if t.element_size() == 2 else torch.int32)
        out[n] = int(bits.to(torch.int64).sum().item())
    return out


def _send(engine: Any, cfg: Any, rank: int, world: int, port: int, dev: torch.device, args: argparse.Namespace) -> Any:
    from nemo_dataplane.distributed.stateless_group import StatelessProcessGroup
    from nemo_dataplane.refit import build_weight_sender

    g = StatelessProcessGroup(HOST, port, rank, world + 1, "gloo", 600.0, group_name="refit")
    try:
        s = build_weight_sender(
            cfg.weight_transfer, g, engine.named_for_refit, senders=world, full_shapes=engine.refit_shapes(), device=dev
        )
        s.prepare_refit_info()
        s.timings = []  # type: ignore[attr-defined]  # the reshard endpoint's opt-in phase marks
        starts = []
        for i in range(args.refit_iters + 1):
            g.barrier()
            starts.append(time.perf_counter())  # CLOCK_MONOTONIC: comparable across this host's processes
            s.send_weights(i)
        shards = dict(engine.named_for_refit())
        g.barrier()
        # The peer-copy baseline: this rank's shard bytes, ready for the generator to copy.
        nbytes = sum(t.numel() * t.element_size() for t in shards.values())
        g.barrier()
        marks = getattr(s, "timings", None) or []
        return {
            "checksums": _checksums(shards),
            "nbytes": nbytes,
            "starts": starts[1:],
            "phases": [{k: (v - m[next(iter(m))]) * 1e3 for k, v in m.items()} for m in marks[1:]],
        }
    finally:
        g.destroy()


def _generator(cfg: Any, world: int, port: int, dev: torch.device, args: argparse.Namespace) -> dict[str, Any]:
    """The refit's receiving rank: whole tensors in the run's dtype; times ``receive_weights``."""
    from algorithms.models import build_model
    from algorithms.precision import cast_weights, precision_of
    from nemo_dataplane.distributed.stateless_group import StatelessProcessGroup
    from nemo_dataplane.refit import build_weight_receiver

    vocab, _ = VOCAB_PAD[args.size]
    model = build_model(dict(cfg.policy.model), vocab_size=vocab, device="meta")
    dtype = precision_of(cfg).dtype
    tensors = {
        n: torch.zeros(p.shape, dtype=dtype, device=dev) for n, p in cast_weights(model, dtype).named_parameters()
    }
    g = StatelessProcessGroup(HOST, port, world, world + 1, "gloo", 600.0, group_name="refit")
    try:
        r = build_weight_receiver(cfg.weight_transfer, g, tensors, senders=world, device=dev)
        r.prepare_refit_info()
        r.timings = []  # type: ignore[attr-defined]
        times, ends = [], []
        for _ in range(args.refit_iters + 1):
            g.barrier()
            t0 = time.perf_counter()
            r.receive_weights()
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            ends.append(time.perf_counter())
            times.append(ends[-1] - t0)
        checks = _checksums(tensors)
        g.barrier()
        nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
        peer_s = _peer_copies(world, nbytes, dev, args.refit_iters)
        g.barrier()
        return {
            "times_s": times[1:],
            "ends": ends[1:],
            "phases": [{k: (v - m[next(iter(m))]) * 1e3 for k, v in m.items()} for m in (r.timings or [])[1:]],
            "refit_s": statistics.median(times[1:]),
            "nbytes": nbytes,
            "checksums": checks,
            "peer_s": peer_s,
        }
    finally:
        g.destroy()


def _peer_copies(world: int, nbytes: int, dev: torch.device, iters: int) -> float:
    """Seconds to copy each sender's share of ``nbytes`` from its GPU into this one, all at once
    (CPU: one memcpy of everything): the refit's ideal."""
    share = nbytes // world
    dst = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    if dev.type != "cuda":
        src = torch.empty_like(dst)
        srcs = [(src, None)]
    else:
        srcs = []
        for r in range(world):
            g = min(r, torch.cuda.device_count() - 1)
            srcs.append((torch.empty(share, dtype=torch.uint8, device=f"cuda:{g}"), torch.cuda.Stream(dev)))
    times = []
    for i in range(iters + 1):
        torch.cuda.synchronize() if dev.type == "cuda" else None
        t0 = time.perf_counter()
        if dev.type != "cuda":
            dst.copy_(srcs[0][0])
        else:
            for k, (src, stream) in enumerate(srcs):
                with torch.cuda.stream(stream):
                    dst[k * share : k * share + src.numel()].copy_(src, non_blocking=True)
            for k in range(torch.cuda.device_count()):
                torch.cuda.synchronize(k)
        if i:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _table(results: list[dict[str, Any]]) -> str:
    lines = [
        "size  sharding  params  GPUs  path     first s  step s  first/later  logprobs s  train s  tok/s/GPU   MFU   "
        "peak GB  x peer",
    ]
    for r in results:
        peer = r.get("peer")
        for path in ("trainer", "peer"):
            x = r.get(path)
            if not x:
                continue
            mfu = f"{x['mfu']:.3f}" if x.get("mfu") else "   - "
            peak = f"{x['peak_gb']:7.1f}" if x.get("peak_gb") is not None else "     - "
            ratio = f"{x['step_s'] / peer['step_s']:.2f}" if peer else "-"
            lines.append(
                f"{r['size']:5} {r['sharding']:8} {r['params'] / 1e9:6.2f}B {r['world']:4}  {path:7} "
                f"{x['first_s']:8.2f} "
                f"{x['step_s']:7.3f} {x['first_over_later']:11.2f} {x.get('logprobs_s', float('nan')):11.3f} "
                f"{x.get('train_s', float('nan')):8.3f} {x['tokens_per_s_per_gpu']:10.0f} {mfu} {peak} {ratio:>7}"
            )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cuda")
    ap.add_argument("--cases", default="1b:none,1b:fsdp,8b:fsdp", help="size:sharding, comma-separated")
    ap.add_argument("--world", type=int, default=0, help="policy ranks (default: every GPU; CPU: 2)")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--mbs", type=int, default=2, help="micro-batches per rank per step")
    ap.add_argument("--rows", type=int, default=8, help="rows per micro-batch")
    ap.add_argument("--seq", type=int, default=1024, help="tokens per row")
    ap.add_argument("--precision", default=None, help="override the config's policy.precision")
    ap.add_argument("--activation-checkpointing", dest="activation_checkpointing", default=None)
    ap.add_argument("--refit", default="", help="size whose fsdp case also refits a generator")
    ap.add_argument("--refit-iters", type=int, default=5)
    ap.add_argument("--no-peer", action="store_true")
    ap.add_argument("--peak-tflops", type=float, default=989.0, help="dense bf16 peak per GPU (0: no MFU)")
    ap.add_argument("--limit-s", type=float, default=900.0)
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "bench_train_step.json")
    args = ap.parse_args()
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    if args.device == "cpu":
        args.peak_tflops = 0.0
    world = args.world or (torch.cuda.device_count() if args.device == "cuda" else 2)
    gpu = torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu"
    print(
        f"[bench_train_step] {gpu} x {world}, torch {torch.__version__}, "
        f"batch per rank {args.mbs} x {args.rows} x {args.seq}",
        flush=True,
    )
    results = []
    for case in args.cases.split(","):
        size, sharding = case.split(":")
        args.size = size
        refit = args.refit == size and sharding == "fsdp"
        t0 = time.perf_counter()
        ranks = run_ranks(
            case_rank, world + (1 if refit else 0), (args, size, sharding, world), limit_s=args.limit_s, label=case
        )
        r = ranks[0]
        if refit:
            gen = ranks[world]
            want: dict[str, int] = {}
            for k in range(world):
                for n, c in ranks[k]["refit"]["checksums"].items():
                    want[n] = want.get(n, 0) + c
            exact = want == gen["checksums"]
            # From the last sender's call (the refit's own cost once every rank is in it): the
            # ranks leave the store-based barrier milliseconds apart.
            last_in = [e - max(ranks[k]["refit"]["starts"][i] for k in range(world)) for i, e in enumerate(gen["ends"])]
            r["refit"] = {
                "nbytes": gen["nbytes"],
                "refit_s": gen["refit_s"],
                "times_s": gen["times_s"],
                "peer_s": gen["peer_s"],
                "of_peer": gen["peer_s"] / gen["refit_s"],
                "phases_ms": {
                    **{f"sender{k}": ranks[k]["refit"]["phases"] for k in range(world)},
                    "generator": gen["phases"],
                },
                "last_in_s": statistics.median(last_in),
                "last_in_of_peer": gen["peer_s"] / statistics.median(last_in),
                "gb_per_s": gen["nbytes"] / gen["refit_s"] / 1e9,
                "bit_exact": exact,
            }
            print(
                f"refit {size} fsdp x{world} -> 1 generator: {gen['nbytes'] / 1e9:.2f} GB in "
                f"{gen['refit_s'] * 1e3:.1f} ms "
                f"({r['refit']['gb_per_s']:.0f} GB/s), peer copies {gen['peer_s'] * 1e3:.1f} ms: "
                f"{r['refit']['of_peer']:.2f} of the peer-copy rate (target >= {REFIT_TARGET}); from the last "
                f"sender's call {r['refit']['last_in_s'] * 1e3:.1f} ms, {r['refit']['last_in_of_peer']:.2f}; "
                f"bit-exact {exact}",
                flush=True,
            )
        r["wall_s"] = time.perf_counter() - t0
        r["peak_gb_per_rank"] = [ranks[k]["trainer"]["peak_gb"] for k in range(world)]
        results.append(r)
        print("\n".join(_table([r]).splitlines()[1:]), flush=True)
    print()
    print(_table(results))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    meta = {
        "device": gpu,
        "world": world,
        "torch": torch.__version__,
        "args": {k: str(v) for k, v in vars(args).items()},
    }
    args.out.write_text(json.dumps({"meta": meta, "results": results}, indent=2))
    print(f"wrote {args.out}")
    for r in results:
        if r.get("peer") and r["size"] == "1b":
            ratio = r["trainer"]["step_s"] / r["peer"]["step_s"]
            print(
                f"target: 1b {r['sharding']} trainer step {ratio:.2f}x the plain FSDP2 loop (target <= {RATIO_TARGET})"
            )


if __name__ == "__main__":
    main()
