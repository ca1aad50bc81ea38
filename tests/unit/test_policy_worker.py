"""The policy worker's packed log-probs and loss against an independent reference.

The data-plane/legacy comparisons elsewhere only show the two transports agree; a bug they share
(padding, packing, the shift by one, the token mean) would pass them. Here the worker runs
in-process (one rank, gloo) on a batch cut into several sequence-packed micro-batches, and
its numbers are checked against a plain forward of the same model on each row alone (no padding,
no attention mask, no micro-batches) and a per-token loop of the loss formula.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from tensordict import TensorDict

from algorithms.config import load_config
from algorithms.transports.legacy import LegacyBatchIO, legacy_shard
from algorithms.workers.policy import PolicyWorker
from nemo_dataplane.codec import jagged_from_rows, jagged_rows
from nemo_dataplane.driver.preshard import driver_balanced_preshards

CONFIG = Path(__file__).resolve().parents[2] / "examples" / "configs" / "grpo_tiny.yaml"


# Max |packed - per-row| log-prob and the loss's relative error. Measured on 2-core CPUs: fp32
# 2.4e-7 and <1e-6; bf16 0 and 2e-6 where the CPU rounds the same fp32 accumulations to bf16
# whatever the padding, 5.9e-4 and 1.2e-3 on an AMD EPYC whose bf16 kernels do not (the loss's
# relative error is larger than a token's: its terms cancel to 0.04). bf16 is held to about one
# bf16 rounding step of a logit, and the loss to 4x the EPYC's error.
TOL = {"fp32": (1e-5, 1e-4), "bf16": (1e-2, 5e-3)}


@pytest.fixture(scope="module", params=["fp32", "bf16"])
def worker(request: pytest.FixtureRequest):
    cfg = load_config(
        CONFIG,
        [
            "data_plane.packing.mode=sequence",
            "data_plane.packing.max_tokens_per_microbatch=24",
            "data_plane.packing.micro_batch_size=null",
            "grpo.epochs=1",
            "generation.temperature=0.8",
            "grpo.kl_coef=0.1",
            f"policy.precision={request.param}",
        ],
    )
    w = PolicyWorker(0, 1, cfg)
    w.join_train_group(*w.host_rendezvous("train", 1, loopback=True))
    w.attach(LegacyBatchIO(60.0))
    yield w, cfg
    w.shutdown()
    assert not dist.is_initialized()


def _batch(seed: int = 0) -> TensorDict:
    g = torch.Generator().manual_seed(seed)
    rows, prompt_len = [], []
    for i in range(10):
        p = 2 + i % 3
        r = 1 + (i * 7) % 5
        rows.append(torch.randint(3, 20, (p + r,), generator=g))
        prompt_len.append(p)
    return TensorDict(
        {
            "input_ids": jagged_from_rows(rows),
            "prompt_len": torch.tensor(prompt_len),
            "seq_len": torch.tensor([r.numel() for r in rows]),
            "advantages": torch.randn(10, generator=g),
        },
        batch_size=[10],
    )


def _reference_logprobs(model: torch.nn.Module, ids: torch.Tensor, temperature: float) -> torch.Tensor:
    """log p(ids[t + 1] | ids[:t + 1]) of one unpadded row, by the plainest forward there is."""
    with torch.no_grad():
        logits = model(input_ids=ids[None]).logits[0, :-1].float() / temperature
    return torch.log_softmax(logits, -1).gather(1, ids[1:, None])[:, 0]


def test_packed_logprobs_and_loss_match_a_plain_per_row_forward(worker) -> None:
    w, cfg = worker
    lp_tol, loss_tol = TOL[cfg.policy.precision]
    temperature = cfg.generation.temperature
    batch = _batch()
    pre = driver_balanced_preshards(batch, 1, cfg.data_plane.packing)
    (shard,) = legacy_shard(batch, pre)
    assert len(shard.microbatches()) >= 3, "the case must cut the rank's rows into several packed micro-batches"
    out = w.get_logprobs(shard, 0, with_reference=True)
    got = jagged_rows(out["prev_logprobs"])
    ids_rows = jagged_rows(shard.data["input_ids"])
    worst = 0.0
    for i, ids in enumerate(ids_rows):
        ref = _reference_logprobs(w.engine.model, ids, temperature)
        p = int(shard.data["prompt_len"][i])
        assert got[i].shape == ref.shape
        assert torch.equal(got[i][: p - 1], torch.zeros(p - 1)), "prompt positions must score 0"
        worst = max(worst, float((got[i][p - 1 :] - ref[p - 1 :]).abs().max()))
    print(f"{cfg.policy.precision}: max |packed - per-row| log-prob = {worst:.3g}")
    assert worst < lp_tol, worst

    # The loss: proximal/reference log-probs perturbed so ratio, clip and KL all bite.
    gen = torch.Generator().manual_seed(3)
    prev = [r + 0.3 * torch.randn(r.shape, generator=gen) for r in got]
    refl = [r + 0.3 * torch.randn(r.shape, generator=gen) for r in got]
    shard.data.set("prev_logprobs", jagged_from_rows(prev))
    shard.data.set("ref_logprobs", jagged_from_rows(refl))
    eps, kl_coef = cfg.grpo.clip_eps, cfg.grpo.kl_coef
    total, tokens = 0.0, 0
    for i, ids in enumerate(ids_rows):
        lp = _reference_logprobs(w.engine.model, ids, temperature)
        a = float(shard.data["advantages"][i])
        for t in range(int(shard.data["prompt_len"][i]) - 1, ids.numel() - 1):
            r = math.exp(float(lp[t]) - float(prev[i][t]))
            pg = max(-a * r, -a * min(max(r, 1 - eps), 1 + eps))
            d = float(refl[i][t]) - float(lp[t])
            total += pg + kl_coef * (math.exp(d) - d - 1)
            tokens += 1
    m = w.train(shard, 0)
    assert int(m["tokens"]) == tokens
    # The precision's contract after an optimizer step: weights in its dtype, equal to the float32
    # masters rounded; AdamW's state float32.
    e, dtype = w.engine, w.engine.precision.dtype
    assert {p.dtype for p in e.model.parameters()} == {dtype} == {p.dtype for p in e.ref_model.parameters()}
    assert {p.dtype for p in e.trained.params} == {torch.float32}
    assert all(torch.equal(p, mp.to(dtype)) for p, mp in zip(e.model.parameters(), e.trained.params))
    assert {s["exp_avg"].dtype for s in e.optimizer.state.values()} == {torch.float32}
    assert ("master" in e.state_dict()["trained"]) == (cfg.policy.precision == "bf16")
    print(f"{cfg.policy.precision}: loss {m['loss']:.6g} vs per-token {total / tokens:.6g}")
    assert math.isclose(m["loss"], total / tokens, rel_tol=loss_tol, abs_tol=1e-6), (m["loss"], total / tokens)
