"""The vLLM generation engine on GPUs (vLLM's CUDA build): token-id sampling with per-token
log-probs, refit into the running engine over NCCL (trainer and engine on two GPUs) and over
CUDA IPC (both on one GPU), log-probs against the trainer's forward in fp32 and bf16, a layout
mismatch, a generation waiting for a refit, and the engine's exit after a failed step and on Ctrl-C.

The engine runs in-process in this process, on its first visible GPU (``cuda:0``; vLLM's
in-process worker takes local rank 0); the trainer is a process of its own
(``_vllm_helpers.send_refits``), on the second GPU for NCCL and on the engine's GPU for CUDA IPC
(NCCL refuses two ranks on one GPU; CUDA IPC handles cannot be opened in the process that made
them). One engine per dtype serves the module. Skipped without 2 GPUs or without vLLM.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from _vllm_helpers import skip_unless_gpu_vllm  # noqa: E402

skip_unless_gpu_vllm()

import _refit_procs as P  # noqa: E402
from _vllm_helpers import (  # noqa: E402
    HOST,
    PROMPTS,
    WIDER_MODEL,
    build_trainer,
    free_port,
    logprob_deltas,
    make_engine,
    max_delta,
    send_refits,
)

from algorithms.engines.generation import RefitSpec, SamplingSpec  # noqa: E402
from algorithms.engines.generation.vllm import VLLMEngine  # noqa: E402
from algorithms.engines.generation.vllm_settings import ATTENTION  # noqa: E402
from nemo_dataplane.refit import RefitMismatchError, WeightTransferConfig  # noqa: E402

pytestmark = pytest.mark.gpu
REPO = Path(__file__).resolve().parents[2]
ENGINE_GPU, OTHER_GPU = 0, 1

# Per engine dtype: the trainer's weight noise (sd) for a refit, and the tolerance on
# |vLLM - trainer| per sampled token (max, mean). fp32: vLLM's Triton attention computes its dot
# products in TF32 (Triton's default on NVIDIA; vLLM's matmuls stay full fp32), so the error grows
# with the logits: measured on 2x H200, max 1.8e-4 / mean 4.9e-5 at the initial weights; after
# refits of 0.5 sd noise max 0.025 and 0.125, mean 0.003-0.004. bf16: FlashAttention 3 against
# the bf16 trainer's forward; the two round bf16 activations at different points. So refits
# perturb the weights by 0.1 sd, as the CPU test's bf16 case does; figures measured with it:
# docs/generation.md, section GPU.
NOISE = {"float32": 0.1, "bfloat16": 0.1}
TOL = {"float32": (0.01, 1e-3), "bfloat16": (0.1, 0.03)}
BACKEND = {"float32": "TRITON_ATTN", "bfloat16": "FLASH_ATTN"}

# Refit routes: the group's backend, the weight-transfer options, the trainer's GPU.
ROUTES: dict[str, tuple[str, dict[str, Any], int]] = {
    "nccl": ("nccl", {"transport": "broadcast"}, OTHER_GPU),
    "ipc": ("gloo", {"family": "reshard", "transport": "ipc"}, ENGINE_GPU),
}


@pytest.fixture(scope="module")
def pool() -> Iterator[P.Pool]:
    ex = P.Pool()
    yield ex
    ex.kill()


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def engine(request: pytest.FixtureRequest) -> Iterator[VLLMEngine]:
    # Module scope, parametrized: pytest finishes one dtype's engine before starting the next
    # (one in-process engine at a time).
    eng = make_engine(getattr(torch, request.param), device="cuda")
    yield eng
    eng.shutdown()


def _dtype(engine: VLLMEngine) -> str:
    return engine.param_specs[0][2]


class _Trainer:
    """A trainer rank (group rank 0) in a process of its own, sending ``version`` over ``route``;
    ``kw``: further ``send_refits`` arguments (``model``, ``go``)."""

    def __init__(
        self, pool: P.Pool, route: str, dtype: str, version: int, *, seed: int = 1, noise: float = 0.0, **kw: Any
    ) -> None:
        self.backend, transfer, gpu = ROUTES[route]
        self.transfer = WeightTransferConfig.from_dict(transfer)
        self.port = free_port()
        args = dict(port=self.port, world=2, backend=self.backend, transfer=transfer, gpu=gpu, dtype=dtype)
        args.update(seed=seed, noise=noise, versions=[version], **kw)
        self.proc, self.conn = pool.start(send_refits, 0, 110.0, args)

    def join(self, engine: VLLMEngine) -> None:
        """The engine's side of joining (collective with the trainer's prepare)."""
        engine.init_refit(HOST, self.port, 2, 1, RefitSpec(self.backend, 60, self.transfer, senders=1))

    def result(self, limit: float = 120.0) -> Any:
        """What ``send_refits`` returned, or the exception it raised (its traceback as cause)."""
        if not self.conn.poll(limit):
            self.proc.kill()
            raise AssertionError(f"the trainer process did not finish within {limit}s")
        ok, payload = self.conn.recv()
        if ok:
            return payload
        exc, tb = payload
        exc.__cause__ = P.RemoteTraceback(tb)
        return exc


def _refit(pool: P.Pool, engine: VLLMEngine, route: str, version: int, seed: int, noise: float) -> None:
    trainer = _Trainer(pool, route, _dtype(engine), version, seed=seed, noise=noise)
    trainer.join(engine)
    assert engine.receive_weights() == version
    engine.close_refit()  # as the trainer leaves: NCCL destroys the two ends together
    res = trainer.result()
    assert not isinstance(res, BaseException), res


def test_the_gpu_attention_table_is_vllms() -> None:
    """The config check's GPU rules (no vLLM import at config load) against vLLM's backends."""
    from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend
    from vllm.v1.attention.backends.triton_attn import TritonAttentionBackend

    flash, triton = ATTENTION["cuda"]
    for rule, cls, sizes in (
        (flash, FlashAttentionBackend, range(1, 257)),
        (triton, TritonAttentionBackend, range(1, 1025)),
    ):
        assert {str(d).removeprefix("torch.") for d in cls.supported_dtypes} == set(rule.dtypes), rule.backend
        wrong = [h for h in sizes if cls.supports_head_size(h) != rule.takes_head_size(h)]
        assert wrong == [], f"{rule.backend}: head sizes judged otherwise than vLLM: {wrong}"


def test_n_samples_per_prompt_with_one_logprob_per_sampled_token(engine: VLLMEngine) -> None:
    dtype = _dtype(engine)
    assert engine.settings.attention_backend == BACKEND[dtype]
    spec = SamplingSpec(max_new_tokens=6, temperature=1.0, seed=11)
    out = engine.generate(PROMPTS[:3], 4, spec)
    assert out.version == -1 and len(out.tokens) == len(out.logprobs) == 12
    for t, lp in zip(out.tokens, out.logprobs):
        assert len(lp) == len(t) >= 1
        assert all(x <= 0.0 and x == x for x in lp)
    assert len({tuple(t) for t in out.tokens[:4]}) > 1, "n distinct samples"
    assert engine.generate(PROMPTS[:3], 4, spec).tokens == out.tokens, "seeded: the same call repeats"
    trainer = build_trainer().to(getattr(torch, dtype)).cuda(ENGINE_GPU)
    deltas = logprob_deltas(trainer, PROMPTS[:3], 4, out, 1.0)
    print(f"{dtype} initial weights: |vLLM - trainer| log-prob max {deltas.max():.3g} mean {deltas.mean():.3g}")
    assert float(deltas.max()) < TOL[dtype][0] and float(deltas.mean()) < TOL[dtype][1]


@pytest.mark.parametrize("route", ["nccl", "ipc"])
def test_refit_changes_outputs_and_logprobs_match_the_trainer_forward(
    pool: P.Pool, engine: VLLMEngine, route: str
) -> None:
    dtype = _dtype(engine)
    version = {"nccl": 5, "ipc": 6}[route]
    spec = SamplingSpec(max_new_tokens=8, temperature=0.8, seed=3)
    # Sampled before the refit: also fills the prefix cache with the old weights' KV blocks.
    before = engine.generate(PROMPTS, 4, spec)
    seed = {"nccl": 1, "ipc": 2}[route]  # other weights than the last test's
    _refit(pool, engine, route, version, seed, NOISE[dtype])
    after = engine.generate(PROMPTS, 4, spec)
    assert after.version == version == engine.weight_version
    assert after.tokens != before.tokens, "new weights, same seed: other samples"
    trainer = build_trainer(seed=seed, noise=NOISE[dtype]).to(getattr(torch, dtype)).cuda(ENGINE_GPU)
    deltas = logprob_deltas(trainer, PROMPTS, 4, after, 0.8)
    print(f"{dtype} {route} refit: |vLLM - trainer| log-prob max {deltas.max():.3g} mean {deltas.mean():.3g}")
    tol_max, tol_mean = TOL[dtype]
    assert float(deltas.max()) < tol_max and float(deltas.mean()) < tol_mean, deltas
    # Not the log-probs of the weights before (the check can fail).
    initial = build_trainer().to(getattr(torch, dtype)).cuda(ENGINE_GPU)
    assert max_delta(initial, PROMPTS, 4, after, 0.8) > 2 * tol_max


def test_layout_mismatch_at_refit_names_the_parameter_and_leaves_the_engine_usable(
    pool: P.Pool, engine: VLLMEngine
) -> None:
    trainer = _Trainer(pool, "nccl", _dtype(engine), 7, model=WIDER_MODEL)
    with pytest.raises(RefitMismatchError, match=r"model\.layers\.0\.mlp\.gate_proj\.weight: shape"):
        trainer.join(engine)
    assert isinstance(trainer.result(), RefitMismatchError), "the trainer side fails too, before any transfer"
    with pytest.raises(RuntimeError, match="before init_refit"):
        engine.receive_weights()
    version = engine.weight_version
    out = engine.generate(PROMPTS[:1], 2, SamplingSpec(max_new_tokens=4, seed=1))
    assert out.version == version and len(out.tokens) == 2


def test_a_generation_waits_for_a_refit_in_progress_and_carries_its_version(pool: P.Pool, engine: VLLMEngine) -> None:
    dtype = _dtype(engine)
    go = multiprocessing.get_context("forkserver").Event()
    trainer = _Trainer(pool, "nccl", dtype, 9, seed=3, noise=NOISE[dtype], go=go)
    results: dict[str, Any] = {}
    spec = SamplingSpec(max_new_tokens=6, temperature=1.0, seed=21)
    try:
        trainer.join(engine)
        refit = threading.Thread(target=lambda: results.setdefault("version", engine.receive_weights()))
        refit.start()
        deadline = time.monotonic() + 30
        while not engine.busy and time.monotonic() < deadline:  # the refit holds the engine
            time.sleep(0.01)
        assert engine.busy, "the refit did not take the engine within 30 s"
        gen = threading.Thread(target=lambda: results.setdefault("out", engine.generate(PROMPTS, 2, spec)))
        gen.start()
        # A window in which a generation that ignored the refit would finish (one takes ~10 ms).
        time.sleep(0.5)
        assert "out" not in results, "a generation ran while a refit was being received"
    finally:
        go.set()  # the trainer sends; the refit, then the generation, complete
    refit.join(60)
    gen.join(60)
    engine.close_refit()
    assert not isinstance(res := trainer.result(), BaseException), res
    assert results["version"] == 9
    out = results["out"]
    assert out.version == 9
    assert out.tokens == engine.generate(PROMPTS, 2, spec).tokens, "drawn entirely from version 9"
    trainer_model = build_trainer(seed=3, noise=NOISE[dtype]).to(getattr(torch, dtype)).cuda(ENGINE_GPU)
    assert max_delta(trainer_model, PROMPTS, 2, out, 1.0) < TOL[dtype][0]


# The engine in a process of its own: start, generate, then inside ``with engine:`` either fail
# ("step") or keep generating until Ctrl-C ("ctrl-c"); it reports the GPU memory this process's
# allocator holds before, during and after, and its children.
_EXIT_SCRIPT = r"""
import gc, sys, traceback
import psutil, torch
sys.path.insert(0, sys.argv[1])
from _vllm_helpers import PROMPTS, make_engine
from algorithms.engines.generation import SamplingSpec

torch.cuda.init()
# cuBLAS keeps a workspace per process in the allocator's blocks: allocated by any GPU matmul,
# the engine's or not, so it belongs in the baseline.
torch.ones(64, 64, device="cuda", dtype=torch.bfloat16) @ torch.ones(64, 64, device="cuda", dtype=torch.bfloat16)
base, base_tensors = torch.cuda.memory_reserved(), torch.cuda.memory_allocated()
engine = make_engine(torch.bfloat16, device="cuda")
print("HELD", torch.cuda.memory_reserved() - base, flush=True)
print("MODEL_DIR", engine.model_dir, flush=True)
failure = None
try:
    with engine:
        out = engine.generate(PROMPTS, 2, SamplingSpec(max_new_tokens=4, seed=1))
        print("RESPONSES", len(out.tokens), flush=True)
        if sys.argv[2] == "step":
            raise RuntimeError("a step failed")
        print("GENERATING", flush=True)
        while True:  # interrupted inside vLLM's engine loop, wherever the signal lands
            engine.generate(PROMPTS, 2, SamplingSpec(max_new_tokens=64, seed=1))
except BaseException as e:  # the failed step, or Ctrl-C
    traceback.print_exc()
    failure = type(e).__name__
# Counted once the error is handled, as a trainer's handler would: until then its traceback keeps
# the interrupted frames (vLLM's, with their tensors) alive. Tensors still allocated are leaks.
gc.collect()
print("LEFT", torch.cuda.memory_allocated() - base_tensors, flush=True)
print("CHILDREN", len(psutil.Process().children(recursive=True)), flush=True)
sys.exit(130 if failure == "KeyboardInterrupt" else 1)
"""


def _default_sigint() -> None:
    """The child takes Ctrl-C as under a terminal (a background shell job ignores SIGINT)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.parametrize("end", ["step", "ctrl-c"])
def test_the_engine_leaves_no_process_and_frees_its_gpu_memory_after_a_failed_step_or_ctrl_c(end: str) -> None:
    free_before = torch.cuda.mem_get_info(ENGINE_GPU)[0]
    proc = subprocess.Popen(
        [sys.executable, "-c", _EXIT_SCRIPT, str(Path(__file__).parent), end],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=_default_sigint,
    )
    watchdog = threading.Timer(300, proc.kill)  # a hung child fails the test instead of hanging it
    watchdog.start()
    try:
        head = []
        if end == "ctrl-c":
            assert proc.stdout is not None
            for line in proc.stdout:
                head.append(line)
                if line.startswith("GENERATING"):
                    proc.send_signal(signal.SIGINT)  # the engine is inside a generate call or between two
                    break
        stdout, stderr = proc.communicate()
    finally:
        watchdog.cancel()
    text = "".join(head) + stdout
    lines = dict(line.split(" ", 1) for line in text.splitlines() if " " in line and line.split(" ")[0].isupper())
    if end == "step":
        assert proc.returncode == 1 and "RuntimeError: a step failed" in stderr, stderr[-4000:]
    else:
        assert proc.returncode == 130 and "KeyboardInterrupt" in stderr, stderr[-4000:]
    assert lines["RESPONSES"] == str(2 * len(PROMPTS))
    held, left = int(lines["HELD"]), int(lines["LEFT"])
    mib = 2**20
    print(f"engine process ({end}): {held / mib:.0f} MiB held with the engine, {left / mib:.1f} MiB of tensors after")
    assert held > 64 << 20, "the engine's KV cache (64 MiB) and weights were on this GPU"
    # Measured on 2x H200: 88 MiB held. Counted before the error was handled, Ctrl-C left 68 MiB
    # (the interrupted frames' tensors); the bound leaves a margin far below what the engine holds.
    assert left <= 8 << 20, "the engine's tensors outlived its shutdown"
    assert lines["CHILDREN"] == "0", "an in-process engine starts no process"
    assert not Path(lines["MODEL_DIR"]).exists(), "the engine's model directory is removed at shutdown"
    # And the device got back what the process took (its CUDA context included).
    deadline = time.monotonic() + 30
    while torch.cuda.mem_get_info(ENGINE_GPU)[0] < free_before - (64 << 20) and time.monotonic() < deadline:
        time.sleep(0.2)
    lost = free_before - torch.cuda.mem_get_info(ENGINE_GPU)[0]
    assert lost < 64 << 20, f"{lost / 2**20:.0f} MiB of GPU {ENGINE_GPU} still taken after the engine's process exited"
