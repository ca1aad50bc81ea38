"""Single-process GRPO proof: does the default config learn the toy task, and how fast?

No Ray, no data plane: the same math the distributed trainer runs (``algorithms.grpo``,
``algorithms.models``, ``algorithms.tasks``), in one process with one torch thread, so the
hyperparameters in ``examples/configs/grpo_tiny.yaml`` can be tuned quickly. Per step: sample
``grpo.prompts_per_step`` prompts x ``generation.n`` responses with the generator's copy of the
model, score them, group-relative advantages, old log-probs from the current policy and reference
log-probs from the frozen initial model, ``grpo.epochs`` optimizer steps over the batch, then copy
the weights to the generator copy (the "refit").

    python examples/learn_check.py [--config examples/configs/grpo_tiny.yaml] [dotted.key=value ...]
        [--micro-batches K] [--target 0.8] [--json out.json]

Prints one line per step (step, mean reward, loss, KL, entropy, seconds since start) and exits 0
iff the mean training reward reached ``--target`` (over a 3-step window).
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from omegaconf import OmegaConf  # noqa: E402

from algorithms.config_sections import TaskConfig  # noqa: E402
from algorithms.grpo import dynamic_sampling_mask, group_advantages, policy_loss  # noqa: E402
from algorithms.models import build_model, generate, pad_batch, sequence_logprobs  # noqa: E402
from algorithms.rewards import resolve_reward_fn  # noqa: E402
from algorithms.tasks import (  # noqa: E402
    CharTokenizer,
    PromptIterator,
    PromptRecord,
    load_dataset,
    make_task_dataset,
)

DEFAULT_CONFIG = REPO / "examples" / "configs" / "grpo_tiny.yaml"
SECTIONS = ("policy", "generation", "grpo", "task", "trainer")


def load_sections(path: Path, overrides: list[str]) -> dict[str, Any]:
    cfg = OmegaConf.load(path)
    if overrides:
        cfg = OmegaConf.merge(cfg, OmegaConf.from_dotlist(overrides))
    plain = OmegaConf.to_container(cfg, resolve=True)
    assert isinstance(plain, dict)
    return {s: dict(plain.get(s) or {}) for s in SECTIONS}


def build_batch(
    tok: CharTokenizer, prompts: list[list[int]], responses: list[list[int]], n: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded prompt+response sequences and the response-token mask, group-major."""
    seqs, resp_spans = [], []
    for i, r in enumerate(responses):
        p = prompts[i // n]
        seqs.append(p + r)
        resp_spans.append((len(p), len(p) + len(r)))
    ids, attn = pad_batch(seqs, tok.pad_id)
    resp = torch.zeros_like(attn)
    for i, (a, b) in enumerate(resp_spans):
        resp[i, a:b] = 1
    return ids, attn, resp


@torch.no_grad()
def validate(
    model: torch.nn.Module,
    tok: CharTokenizer,
    records: list[PromptRecord],
    reward_fn: Any,
    max_new_tokens: int,
    temperature: float,
) -> float:
    prompts = [tok.encode_prompt(r.prompt) for r in records]
    outs = generate(
        model, prompts, 1, max_new_tokens, temperature, torch.Generator().manual_seed(0), tok.eos_id, tok.pad_id
    )
    return statistics.fmean(reward_fn(r, tok.decode(o)) for r, o in zip(records, outs))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", type=Path, default=DEFAULT_CONFIG)
    ap.add_argument("--micro-batches", type=int, default=1, help="gradient-accumulation chunks per optimizer step")
    ap.add_argument("--target", type=float, default=0.8)
    ap.add_argument("--stop-at-target", action="store_true", help="stop once the target is reached")
    ap.add_argument("--json", type=Path, default=None, help="write the learning curve here")
    ap.add_argument("overrides", nargs="*", help="dotted.key=value")
    args = ap.parse_intermixed_args(argv)

    c = load_sections(args.config, args.overrides)
    pol, gen, grpo, task, trainer = (c[s] for s in SECTIONS)
    torch.set_num_threads(int(trainer.get("num_threads", 1)))
    seed = int(trainer.get("seed", 1))
    steps = int(trainer.get("steps", 60))
    torch.manual_seed(seed)

    tok = CharTokenizer()
    task_name = task.get("name", "digit_map")
    keys = {k: task.get(k, getattr(TaskConfig, k)) for k in ("prompt_key", "answer_key")}
    if task.get("dataset"):
        train = load_dataset(task["dataset"], **keys)
    else:
        train = make_task_dataset(task_name, int(task.get("seed", 0)), int(task.get("train_size", 2048)))
    if task.get("val_dataset"):
        val = load_dataset(task["val_dataset"], **keys)
    else:
        val = make_task_dataset(task_name, int(task.get("seed", 0)) + 1, int(task.get("val_size", 64)))
    reward_fn = resolve_reward_fn(task.get("reward_fn"), task_name)

    n = int(gen.get("n", 8))
    max_new = int(gen.get("max_new_tokens", 8))
    temp = float(gen.get("temperature", 1.0))
    prompts_per_step = int(grpo.get("prompts_per_step", 8))
    clip_eps, kl_coef = float(grpo.get("clip_eps", 0.2)), float(grpo.get("kl_coef", 0.0))
    epochs = int(grpo.get("epochs", 1))
    dyn = bool(grpo.get("dynamic_sampling", False))
    val_every = int(trainer.get("val_every", 10))

    policy = build_model(pol["model"], vocab_size=tok.vocab_size)
    reference = copy.deepcopy(policy).eval().requires_grad_(False)
    generator_model = copy.deepcopy(policy).eval().requires_grad_(False)
    opt = torch.optim.AdamW(
        policy.parameters(),
        lr=float(pol.get("lr", 1e-3)),
        weight_decay=float(pol.get("weight_decay", 0.0)),
        betas=tuple(pol.get("betas", (0.9, 0.999))),
    )
    max_grad_norm = float(pol.get("max_grad_norm", 1.0))
    it = PromptIterator(train, prompts_per_step, seed)
    sample_gen = torch.Generator().manual_seed(seed)

    curve: list[dict[str, float]] = []
    t0 = time.perf_counter()
    reached_at: float | None = None
    print(
        f"params={sum(p.numel() for p in policy.parameters())} vocab={tok.vocab_size} task={task_name} "
        f"batch={prompts_per_step}x{n} threads={torch.get_num_threads()}",
        flush=True,
    )
    for step in range(1, steps + 1):
        records = it.next_batch()
        prompts = [tok.encode_prompt(r.prompt) for r in records]
        t_gen = time.perf_counter()
        responses = generate(generator_model, prompts, n, max_new, temp, sample_gen, tok.eos_id, tok.pad_id)
        t_gen = time.perf_counter() - t_gen
        rewards = torch.tensor([reward_fn(records[i // n], tok.decode(r)) for i, r in enumerate(responses)])
        adv = group_advantages(rewards, n, normalize_std=bool(grpo.get("normalize_std", True)))
        keep = dynamic_sampling_mask(rewards, n) if dyn else torch.ones_like(rewards, dtype=torch.bool)

        t_train = time.perf_counter()
        metrics: dict[str, float] = {"loss": 0.0, "kl": 0.0, "clip_frac": 0.0, "grad_norm": 0.0, "entropy": 0.0}
        idx = keep.nonzero().squeeze(1)
        if idx.numel() > 0:
            ids, attn, resp = build_batch(tok, prompts, responses, n)
            ids, attn, resp, a = ids[idx], attn[idx], resp[idx], adv[idx]
            tmask = resp[:, 1:]
            with torch.no_grad():
                old_lp = sequence_logprobs(policy, ids, attn, resp, temperature=temp if temp > 0 else 1.0)
                ref_lp = (
                    sequence_logprobs(reference, ids, attn, resp, temperature=temp if temp > 0 else 1.0)
                    if kl_coef > 0
                    else None
                )
            total_tokens = float(tmask.sum())
            chunks = torch.arange(ids.shape[0]).chunk(args.micro_batches)
            for _ in range(epochs):
                opt.zero_grad(set_to_none=True)
                ep_loss = ep_kl = ep_clip = ep_ent = 0.0
                for ch in chunks:
                    lp, ent = sequence_logprobs(
                        policy, ids[ch], attn[ch], resp[ch], return_entropy=True, temperature=temp if temp > 0 else 1.0
                    )
                    loss, met = policy_loss(
                        lp,
                        old_lp[ch],
                        None if ref_lp is None else ref_lp[ch],
                        a[ch],
                        tmask[ch],
                        clip_eps=clip_eps,
                        kl_coef=kl_coef,
                        global_token_count=total_tokens,
                    )
                    loss.backward()
                    ep_loss += loss.item()
                    ep_kl += met["kl"].item()
                    ep_clip += met["clip_frac"].item()
                    ep_ent += float((ent.detach() * tmask[ch]).sum()) / total_tokens
                gn = torch.nn.utils.clip_grad_norm_(
                    policy.parameters(), max_grad_norm if max_grad_norm > 0 else float("inf")
                )
                opt.step()
                metrics = {
                    "loss": ep_loss,
                    "kl": ep_kl,
                    "clip_frac": ep_clip,
                    "grad_norm": float(gn),
                    "entropy": ep_ent,
                }
            # "Refit": the generator samples the next step with the updated weights.
            generator_model.load_state_dict(policy.state_dict())
        t_train = time.perf_counter() - t_train

        elapsed = time.perf_counter() - t0
        mean_r = float(rewards.mean())
        row: dict[str, float] = {
            "step": step,
            "reward": mean_r,
            "elapsed_s": elapsed,
            "gen_s": t_gen,
            "train_s": t_train,
            "kept": float(keep.float().mean()),
            "resp_len": statistics.fmean(len(r) for r in responses),
            **metrics,
        }
        if val_every and (step % val_every == 0 or step == steps):
            row["val_reward"] = validate(
                generator_model, tok, val, reward_fn, max_new, float(gen.get("val_temperature", 0.0))
            )
        curve.append(row)
        window = statistics.fmean(r["reward"] for r in curve[-3:])
        if reached_at is None and len(curve) >= 3 and window >= args.target:
            reached_at = elapsed
        print(
            f"step {step:3d}  reward {mean_r:.3f}  loss {metrics['loss']:+.4f}  kl {metrics['kl']:.4f}  "
            f"ent {metrics['entropy']:.3f}  clip {metrics['clip_frac']:.3f}  len {row['resp_len']:.2f}  "
            f"gen {t_gen:.2f}s train {t_train:.2f}s  elapsed {elapsed:6.1f}s"
            + (f"  val {row['val_reward']:.3f}" if "val_reward" in row else ""),
            flush=True,
        )
        if args.stop_at_target and reached_at is not None:
            break

    final = statistics.fmean(r["reward"] for r in curve[-3:])
    print(
        f"SUMMARY reached {args.target} (3-step mean) at: "
        f"{'never' if reached_at is None else f'{reached_at:.1f}s'}; final 3-step mean reward {final:.3f}; "
        f"total {time.perf_counter() - t0:.1f}s",
        flush=True,
    )
    if args.json:
        args.json.write_text(json.dumps({"curve": curve, "reached_at_s": reached_at, "config": c}, indent=1))
    return 0 if reached_at is not None else 1


if __name__ == "__main__":
    raise SystemExit(main())
