"""FP8 generation on GPUs (vLLM's CUDA build, FP8 tensor cores): a bf16 trainer refits a vLLM
engine that runs FP8 weights, per tensor and block-wise; the sender quantizes, the wire carries
FP8 bytes plus scales, the engine installs them in place (no reload from disk).

Per form: the engine starts from the trainer's initial weights quantized as a refit sends them;
a refit of other weights over NCCL (and CUDA IPC, per tensor) changes its samples; its log-probs
then match the bf16 trainer's forward of the new weights within the FP8 tolerance, far closer
than the old weights'; the bytes are about half a bf16 refit's. Figures are printed (``-s``)
beside a bf16 engine's on the same model. Skipped without 2 GPUs, vLLM's GPU build or FP8.
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

skip_unless_gpu_vllm()
if torch.cuda.get_device_capability(0) < (8, 9):
    pytest.skip("needs FP8 tensor cores (compute capability 8.9+)", allow_module_level=True)

import _refit_procs as P  # noqa: E402
from _vllm_helpers import (  # noqa: E402
    HOST,
    PROMPTS,
    build_trainer,
    free_port,
    logprob_deltas,
    make_engine,
    send_refits,
)

from algorithms.engines.generation import RefitSpec, SamplingSpec  # noqa: E402
from nemo_dataplane.refit import WeightTransferConfig  # noqa: E402

pytestmark = pytest.mark.gpu
ENGINE_GPU, OTHER_GPU = 0, 1
# Sizes in whole 128-blocks (the block-wise form's fused q, k, v and gate, up), head size 64.
MODEL: dict[str, Any] = {
    "arch": "llama",
    "seed": 0,
    "hf_config": {
        "hidden_size": 256,
        "intermediate_size": 512,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 128,
    },
}
NOISE = 0.1  # sd of the trainer's weight change at a refit (the bf16 GPU test's)
# Mean |vLLM - trainer| per sampled token at the initial weights and after a refit, per form.
# FP8 keeps 3 mantissa bits (weights and activations within 1/16), bf16 7. Measured on 2x H200:
# bf16 0.0015 / 0.042; fp8 0.022 / 0.35-0.37 (NCCL, IPC); fp8_block 0.018 / 0.32 (the refit's
# noisy weights give sharper distributions, so every form moves more there).
TOL_MEAN: dict[str | None, tuple[float, float]] = {None: (0.01, 0.1), "fp8": (0.05, 0.6), "fp8_block": (0.05, 0.6)}
# After a refit the engine must be this much closer to the new weights than to the old ones
# (measured: 44x bf16, 4.8-5.8x FP8).
CLOSER = 3.0
ROUTES: dict[str, tuple[str, dict[str, Any], int]] = {
    "nccl": ("nccl", {"transport": "broadcast"}, OTHER_GPU),
    "ipc": ("gloo", {"family": "reshard", "transport": "ipc"}, ENGINE_GPU),
}
CASES = [("fp8", "nccl"), ("fp8", "ipc"), ("fp8_block", "nccl"), (None, "nccl")]


@pytest.fixture(scope="module")
def pool() -> Iterator[P.Pool]:
    ex = P.Pool()
    yield ex
    ex.kill()


@pytest.fixture(scope="module", params=["fp8", "fp8_block", None], ids=["fp8", "fp8_block", "bf16"])
def engine(request: pytest.FixtureRequest) -> Iterator[Any]:
    eng = make_engine(torch.bfloat16, device="cuda", model=MODEL, quantization=request.param)
    eng.form = request.param
    yield eng
    eng.shutdown()


def _trainer(seed: int = 0, noise: float = 0.0) -> torch.nn.Module:
    return build_trainer(seed, noise, MODEL).to(torch.bfloat16).cuda(ENGINE_GPU)


def _deltas(engine: Any, model: torch.nn.Module, temperature: float, seed: int) -> tuple[Any, torch.Tensor]:
    out = engine.generate(PROMPTS, 4, SamplingSpec(max_new_tokens=16, temperature=temperature, seed=seed))
    return out, logprob_deltas(model, PROMPTS, 4, out, temperature)


def test_the_engine_starts_from_the_trainers_weights_in_the_refit_form(engine: Any) -> None:
    n_fp8 = sum(dt == "float8_e4m3fn" for _, _, dt in engine.param_specs)
    assert n_fp8 == (14 if engine.form else 0)  # 7 projections x 2 layers
    _, d = _deltas(engine, _trainer(), 1.0, 5)
    print(f"{engine.form or 'bf16'} initial weights: |vLLM - trainer| log-prob max {d.max():.3g} mean {d.mean():.3g}")
    assert float(d.mean()) < TOL_MEAN[engine.form][0]


@pytest.mark.parametrize("route", ["nccl", "ipc"])
def test_a_bf16_trainer_refits_the_engine_in_place_and_its_logprobs_follow(
    pool: P.Pool, engine: Any, route: str
) -> None:
    if (engine.form, route) not in CASES:
        pytest.skip(f"{engine.form} over {route}: not a case of this module")
    backend, transfer, gpu = ROUTES[route]
    seed = {"nccl": 11, "ipc": 12}[route]
    before, _ = _deltas(engine, _trainer(), 0.8, 3)
    port = free_port()
    args = dict(port=port, world=2, backend=backend, transfer=transfer, gpu=gpu, dtype="bfloat16")
    args.update(seed=seed, noise=NOISE, versions=[seed], model=MODEL, quantization=engine.form)
    proc, conn = pool.start(send_refits, 0, 110.0, args)
    engine.init_refit(HOST, port, 2, 1, RefitSpec(backend, 60, WeightTransferConfig.from_dict(transfer), senders=1))
    assert engine.receive_weights() == seed
    engine.close_refit()
    assert conn.poll(120), "the trainer process did not finish"
    ok, sent = conn.recv()
    assert ok, sent
    after, d_new = _deltas(engine, _trainer(seed, NOISE), 0.8, 3)
    assert after.version == seed and after.tokens != before.tokens
    d_old = logprob_deltas(_trainer(), PROMPTS, 4, after, 0.8)
    bf16_bytes = sum(p.numel() * 2 for p in build_trainer(model=MODEL).parameters())
    print(
        f"{engine.form or 'bf16'} {route} refit: {sent['bytes']} bytes ({sent['bytes'] / bf16_bytes:.3f} of bf16); "
        f"|vLLM - trainer| new weights max {d_new.max():.3g} mean {d_new.mean():.3g}, "
        f"old weights mean {d_old.mean():.3g}"
    )
    assert float(d_new.mean()) < TOL_MEAN[engine.form][1] and float(d_old.mean()) > CLOSER * float(d_new.mean())
    if engine.form:
        assert 0.5 < sent["bytes"] / bf16_bytes < 0.75
    else:
        assert sent["bytes"] == bf16_bytes
