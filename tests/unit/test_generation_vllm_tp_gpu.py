"""vLLM with tensor parallelism on GPUs: an engine of TP=2 (its two TP ranks vLLM's worker
processes on GPUs 0 and 1) refit from a trainer on GPU 2 over NCCL, each TP rank receiving only
its shards into vLLM's own parameters (``algorithms/engines/generation/tp_shards.py``).

Checked: the engine's log-probs match the trainer's forward before and after the refit, the
refit changes the samples, and each TP rank received less than the whole model. Skipped without
3 GPUs or without vLLM's CUDA build.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from _vllm_helpers import skip_unless_gpu_vllm  # noqa: E402

skip_unless_gpu_vllm(3)

import _refit_procs as P  # noqa: E402
from _vllm_helpers import HOST, PROMPTS, build_trainer, free_port, logprob_deltas, make_engine, send_refits  # noqa: E402

from algorithms.engines.generation import RefitSpec, SamplingSpec  # noqa: E402
from algorithms.engines.generation.vllm import VLLMEngine  # noqa: E402
from nemo_dataplane.refit import WeightTransferConfig  # noqa: E402

pytestmark = pytest.mark.gpu
TRAINER_GPU = 2
TRANSFER: dict[str, Any] = {"family": "reshard", "transport": "p2p"}
# As test_generation_vllm_gpu.py's bf16 case: FlashAttention 3 against the bf16 trainer's forward.
NOISE, TOL = 0.1, (0.1, 0.03)


@pytest.fixture(scope="module")
def pool() -> Iterator[P.Pool]:
    ex = P.Pool()
    yield ex
    ex.kill()


@pytest.fixture(scope="module")
def engine() -> Iterator[VLLMEngine]:
    eng = make_engine(torch.bfloat16, device="cuda", tensor_parallel_size=2)
    yield eng
    eng.shutdown()


def _deltas(seed: int, noise: float, out: Any) -> torch.Tensor:
    trainer = build_trainer(seed=seed, noise=noise).to(torch.bfloat16).cuda(TRAINER_GPU)
    return logprob_deltas(trainer, PROMPTS, 4, out, 0.8)


def test_tp2_refit_lands_in_each_ranks_shards_and_follows_the_trainer(pool: P.Pool, engine: VLLMEngine) -> None:
    spec = SamplingSpec(max_new_tokens=8, temperature=0.8, seed=3)
    before = engine.generate(PROMPTS, 4, spec)
    d0 = _deltas(0, 0.0, before)
    print(f"TP=2 initial weights: |vLLM - trainer| log-prob max {d0.max():.3g} mean {d0.mean():.3g}")
    assert float(d0.max()) < TOL[0] and float(d0.mean()) < TOL[1]

    port = free_port()
    args = dict(port=port, world=3, backend="nccl", transfer=TRANSFER, gpu=TRAINER_GPU, dtype="bfloat16")
    proc, conn = pool.start(send_refits, 0, 110.0, dict(args, seed=1, noise=NOISE, versions=[5]))
    transfer = WeightTransferConfig.from_dict(TRANSFER)
    engine.init_refit(HOST, port, 3, 1, RefitSpec("nccl", 60, transfer, senders=1, tensor_parallel=2))
    assert engine.receive_weights() == 5
    received = engine.llm.collective_rpc("ndp_refit_received", timeout=60)
    engine.close_refit()
    assert conn.poll(120), "the trainer process did not finish"
    ok, sent = conn.recv()
    assert ok, sent
    print(f"TP=2 refit: sent {sent['bytes']} bytes; received per TP rank {received}")
    assert len(received) == 2 and all(0 < r < 0.75 * sent["bytes"] for r in received), (received, sent)

    after = engine.generate(PROMPTS, 4, spec)
    assert after.version == 5 and after.tokens != before.tokens, "new weights, same seed: other samples"
    d1 = _deltas(1, NOISE, after)
    print(f"TP=2 after the refit: |vLLM - trainer| log-prob max {d1.max():.3g} mean {d1.mean():.3g}")
    assert float(d1.max()) < TOL[0] and float(d1.mean()) < TOL[1], d1
    assert float(_deltas(0, 0.0, after).max()) > 2 * TOL[0], "not the initial weights' log-probs"
