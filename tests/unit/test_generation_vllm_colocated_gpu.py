"""The colocated placement's engine on one GPU: vLLM in sleep mode shares its GPU with a trainer
process, sleeps after every generation (the trainer can then take the memory it freed), wakes its
weights for a refit that arrives over CUDA IPC on the same GPU (a gloo group carrying control
only) and its KV cache for the next generation.

Checked: sleeping frees at least the KV cache, which another process then allocates; the refit
lands (the engine's log-probs follow the trainer's new weights, the samples change); at
``sleep_level=2`` the engine refuses to generate from discarded weights and generates again
after a refit. Skipped without a GPU or without vLLM's CUDA build.
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

skip_unless_gpu_vllm(1)

import _refit_procs as P  # noqa: E402
from _vllm_helpers import HOST, PROMPTS, build_trainer, free_port, logprob_deltas, make_engine, send_refits  # noqa: E402

from algorithms.engines.generation import RefitSpec, SamplingSpec  # noqa: E402
from algorithms.engines.generation.vllm import VLLMEngine  # noqa: E402
from nemo_dataplane.refit import WeightTransferConfig  # noqa: E402

pytestmark = pytest.mark.gpu
TRANSFER: dict[str, Any] = {"family": "reshard", "transport": "ipc"}
KV_BYTES = 64 << 20  # make_engine's KV cache
NOISE, TOL = 0.1, (0.1, 0.03)  # as the bf16 vLLM GPU tests: FlashAttention 3 against the trainer


@pytest.fixture(scope="module")
def pool() -> Iterator[P.Pool]:
    ex = P.Pool()
    yield ex
    ex.kill()


def _used() -> int:
    free, total = torch.cuda.mem_get_info()
    return int(total - free)


def _refit(pool: P.Pool, engine: VLLMEngine, version: int, seed: int) -> None:
    """A trainer process on this GPU sends ``version`` (weights of ``seed``, noised) over CUDA IPC."""
    port = free_port()
    args = dict(port=port, world=2, backend="gloo", transfer=TRANSFER, gpu=0, dtype="bfloat16")
    proc, conn = pool.start(send_refits, 0, 110.0, dict(args, seed=seed, noise=NOISE, versions=[version]))
    engine.init_refit(HOST, port, 2, 1, RefitSpec("gloo", 60, WeightTransferConfig.from_dict(TRANSFER), senders=1))
    assert engine.receive_weights() == version
    engine.close_refit()
    assert conn.poll(120), "the trainer process did not finish"
    ok, sent = conn.recv()
    assert ok, sent
    assert sent["transport"] == "ipc", sent


def _deltas(seed: int, noise: float, out: Any) -> torch.Tensor:
    trainer = build_trainer(seed=seed, noise=noise).to(torch.bfloat16).cuda()
    return logprob_deltas(trainer, PROMPTS, 4, out, 0.8)


def test_a_sleeping_engine_hands_its_memory_over_and_takes_a_same_gpu_ipc_refit(pool: P.Pool) -> None:
    # One engine for both levels: vLLM's sleep-mode allocator serves one engine per process.
    spec = SamplingSpec(max_new_tokens=8, temperature=0.8, seed=3)
    engine = make_engine(torch.bfloat16, device="cuda", sleep_level=1)
    try:
        before = engine.generate(PROMPTS, 4, spec)  # the engine sleeps once it returns
        for level, version in ((1, 5), (2, 6)):
            engine.sleep_level = level
            engine._wake(["weights", "kv_cache"])
            awake = _used()
            engine._sleep()
            asleep = _used()
            print(f"level {level}: GPU used awake {awake / 2**20:.0f} MiB, asleep {asleep / 2**20:.0f} MiB")
            assert awake - asleep >= KV_BYTES, "sleeping must free at least the KV cache"
            grab = torch.empty(awake - asleep, dtype=torch.uint8, device="cuda")  # the trainer's turn
            del grab
            torch.cuda.empty_cache()
            if level == 2:
                with pytest.raises(RuntimeError, match="sleep_level=2 discarded the engine's weights"):
                    engine.generate(PROMPTS, 4, spec)
            _refit(pool, engine, version, seed=version)
            after = engine.generate(PROMPTS, 4, spec)
            assert after.version == version and after.tokens != before.tokens, "new weights: other samples"
            d1 = _deltas(version, NOISE, after)
            print(f"level {level} after the refit: |vLLM - trainer| log-prob max {d1.max():.3g} mean {d1.mean():.3g}")
            assert float(d1.max()) < TOL[0] and float(d1.mean()) < TOL[1], d1
            before = after
    finally:
        engine.shutdown()
