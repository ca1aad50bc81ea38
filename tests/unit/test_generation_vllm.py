"""The vLLM generation engine (algorithms/engines/generation/vllm.py, vllm_worker.py) on the real
vLLM CPU engine: token-id sampling with per-token log-probs, refit in place over a real gloo
``StatelessProcessGroup`` (the sender is a ``RefitSender`` in a thread of this process, the
receiver runs inside vLLM's worker), log-probs against the trainer's own forward, a layout
mismatch, versions under concurrency, and the multiprocess engine's clean exit.

One in-process engine serves the module (start-up is seconds, importing vLLM ~10 s). Skipped
when vLLM is not installed (``.ci/setup-env`` installs it).
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed (pip install -e '.[vllm]')")

from algorithms.engines.generation import RefitSpec, Rollouts, SamplingSpec  # noqa: E402
from algorithms.engines.generation.vllm import VLLMEngine, prompt_seed  # noqa: E402
from algorithms.engines.generation.vllm_settings import ATTENTION, CPU_HEAD_SIZES  # noqa: E402
from nemo_dataplane.distributed.stateless_group import StatelessProcessGroup  # noqa: E402
from nemo_dataplane.refit import RefitMismatchError, RefitSender, WeightTransferConfig  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from _vllm_helpers import (  # noqa: E402
    MODEL,
    PROMPTS,
    TOK,
    WIDER_MODEL,
    build_trainer,
    free_port,
    logprob_deltas,
    make_engine,
    max_delta,
)

REPO = Path(__file__).resolve().parents[2]
# fp32 engine vs fp32 trainer forward: measured max |delta| ~1e-6 per token.
LOGPROB_TOL = 1e-4


class _Sender:
    """A trainer rank in a thread: joins the group, prepares, then sends each version put in
    ``send``. Default: policy rank 0 of a 2-rank group with a ``RefitSender`` of ``model``;
    ``make(group)`` builds another sender (a TP rank's ``ReshardSender``) as group ``rank``."""

    def __init__(
        self,
        model: torch.nn.Module | None,
        port: int,
        *,
        rank: int = 0,
        world: int = 2,
        make: Callable[[StatelessProcessGroup], Any] | None = None,
    ) -> None:
        self.model, self.port, self.rank, self.world = model, port, rank, world
        self.make = make or (lambda g: RefitSender(g, self.model.named_parameters))
        self.error: BaseException | None = None
        self._versions: list[int] = []
        self._cv = threading.Condition()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        group = StatelessProcessGroup("127.0.0.1", self.port, self.rank, self.world, "gloo", 60.0, group_name="refit")
        try:
            sender = self.make(group)
            sender.prepare_refit_info()
            while True:
                with self._cv:
                    self._cv.wait_for(lambda: bool(self._versions), timeout=120)
                    if not self._versions:
                        return
                    v = self._versions.pop(0)
                if v < 0:
                    return
                sender.send_weights(v)
        except BaseException as e:  # noqa: BLE001 - reported to the test
            self.error = e
        finally:
            group.destroy()

    def send(self, version: int) -> None:
        with self._cv:
            self._versions.append(version)
            self._cv.notify()

    def close(self) -> None:
        self.send(-1)
        self.thread.join(timeout=60)


@pytest.fixture(scope="module")
def engine():
    eng = make_engine()
    yield eng
    eng.shutdown()


def _refit(engine: VLLMEngine, model: torch.nn.Module, version: int) -> int:
    port = free_port()
    sender = _Sender(model, port)
    try:
        engine.init_refit("127.0.0.1", port, 2, 1, RefitSpec("gloo", 60, WeightTransferConfig(), senders=1))
        sender.send(version)
        got = engine.receive_weights()
    finally:
        sender.close()
    assert sender.error is None, sender.error
    return got


def test_the_cpu_attention_table_is_vllms() -> None:
    """The config check's table (no vLLM import at config load) against vLLM's own lists."""
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    assert tuple(CPUAttentionBackend.get_supported_head_sizes()) == CPU_HEAD_SIZES
    (rule,) = ATTENTION["cpu"]
    assert rule.backend == "CPU_ATTN"
    assert {str(d).removeprefix("torch.") for d in CPUAttentionBackend.supported_dtypes} == set(rule.dtypes)


# bf16 engine (policy.precision=bf16: the trainer's bf16 weights refit as they are, vLLM computes
# in bfloat16) vs the bf16 trainer's forward, weights perturbed by 0.1 sd. Measured on the 2-core
# CPU: max |delta| 0.028, mean 0.0098 (initial weights: 0.0034 / 0.0008); vLLM's CPU kernels
# round bf16 activations at other points than torch's, and the error grows with the logits' size
# (0.5 sd noise: max 0.98, where even the fp32 forward of the same weights differs by 4.6). Held
# to 0.1 max, 0.03 mean. The fp32 engine's tolerance is LOGPROB_TOL.
BF16_LOGPROB_TOL = 0.1


def test_a_bf16_engine_takes_bf16_refits_and_its_logprobs_match_the_bf16_trainer() -> None:
    # Its own engine, run before the module's fp32 one starts (one in-process engine at a time).
    eng = make_engine(torch.bfloat16)
    try:
        assert {dt for _, _, dt in eng.param_specs} == {"bfloat16"}, "the refit layout is the bf16 trainer's"
        trainer = build_trainer(seed=1, noise=0.1).to(torch.bfloat16)
        assert _refit(eng, trainer, version=3) == 3
        out = eng.generate(PROMPTS, 4, SamplingSpec(max_new_tokens=8, temperature=0.8, seed=3))
        deltas = logprob_deltas(trainer, PROMPTS, 4, out, 0.8)
        print(f"bf16: |vLLM - trainer| log-prob max {deltas.max():.3g} mean {deltas.mean():.3g}")
        assert float(deltas.max()) < BF16_LOGPROB_TOL and float(deltas.mean()) < 0.03, deltas
        # Not the initial weights' log-probs: the bf16 refit landed.
        assert max_delta(build_trainer().to(torch.bfloat16), PROMPTS, 4, out, 0.8) > 2 * BF16_LOGPROB_TOL
    finally:
        eng.shutdown()


def test_n_samples_per_prompt_with_one_logprob_per_sampled_token(engine: VLLMEngine) -> None:
    spec = SamplingSpec(max_new_tokens=6, temperature=1.0, seed=11)
    assert engine.settings.attention_backend == "CPU_ATTN"
    out = engine.generate(PROMPTS[:3], 4, spec)
    assert out.version == -1, "no refit yet: the initial weights"
    assert len(out.tokens) == len(out.logprobs) == 12
    for t, lp in zip(out.tokens, out.logprobs):
        assert len(lp) == len(t) >= 1
        assert all(x <= 0.0 and x == x for x in lp)
        # A response stops at EOS or runs to max_new_tokens.
        assert len(t) == 6 or t[-1] == TOK.eos_id, t
        assert TOK.eos_id not in t[:-1]
    # Each group holds n distinct samples (a random model over a 40-token vocabulary).
    assert len({tuple(t) for t in out.tokens[:4]}) > 1
    # Seeded: the same call repeats, another seed samples differently.
    again = engine.generate(PROMPTS[:3], 4, spec)
    assert again.tokens == out.tokens
    other = engine.generate(PROMPTS[:3], 4, SamplingSpec(max_new_tokens=6, temperature=1.0, seed=12))
    assert other.tokens != out.tokens
    # The log-probs are those of the distribution sampled from: the initial weights here.
    assert max_delta(build_trainer(), PROMPTS[:3], 4, out, 1.0) < LOGPROB_TOL


def test_per_prompt_limits_ignore_eos_and_an_interruptible_call_stopping_when_half_run(engine: VLLMEngine) -> None:
    """Long-tail support (each prompt its own limit, EOS ignored) and the stepped, interruptible
    path partial rollouts use: a call that stops once fewer than ``min_running`` of its responses
    still run returns the finished ones whole and the others as far as they got, each token the
    same as the uninterrupted call's (one request per sample, seeded as vLLM seeds sample j)."""
    limits = (2, 12, 12)
    spec = SamplingSpec(max_new_tokens=12, temperature=1.0, seed=5, limits=limits, ignore_eos=True)
    whole = engine.generate(PROMPTS[:3], 2, spec)
    assert [len(t) for t in whole.tokens] == [2, 2, 12, 12, 12, 12] and all(whole.finished)
    stop = SamplingSpec(max_new_tokens=12, temperature=1.0, seed=5, limits=limits, ignore_eos=True, min_running=0.7)
    part = engine.generate(PROMPTS[:3], 2, stop, interruptible=True)
    assert part.finished[:2] == [True, True] and not any(part.finished[2:]), part.finished
    assert all(2 <= len(t) < 12 for t in part.tokens[2:]), [len(t) for t in part.tokens]
    for j, (got, ref) in enumerate(zip(part.tokens, whole.tokens)):
        assert got == ref[: len(got)], f"response {j} is not a prefix of the uninterrupted one"
        assert part.logprobs[j] == pytest.approx(whole.logprobs[j][: len(got)], abs=1e-5)


def test_prompt_seeds_differ_across_prompts_and_calls() -> None:
    seeds = {prompt_seed(s, i) for s in range(50) for i in range(50)}
    assert len(seeds) == 2500 and all(0 <= s < 2**61 for s in seeds)


def test_refit_changes_outputs_and_logprobs_match_the_trainer_forward(engine: VLLMEngine) -> None:
    greedy = SamplingSpec(max_new_tokens=8, temperature=0.0, seed=0)
    before = engine.generate(PROMPTS, 1, greedy)  # also fills the prefix cache with old-weight KV blocks
    trainer = build_trainer(seed=1, noise=0.5)
    assert _refit(engine, trainer, version=5) == 5
    after = engine.generate(PROMPTS, 1, greedy)
    assert after.version == 5 and engine.weight_version == 5
    assert after.tokens != before.tokens, "new weights, new greedy continuations"
    # Sampled at temperature 0.8 with the same (cached) prompts: vLLM's log-prob of each sampled
    # token equals the trainer's forward of the new weights at that temperature.
    out = engine.generate(PROMPTS, 4, SamplingSpec(max_new_tokens=8, temperature=0.8, seed=3))
    delta = max_delta(trainer, PROMPTS, 4, out, 0.8)
    assert delta < LOGPROB_TOL, f"max |vLLM - trainer| log-prob = {delta:.3g}"
    # And not those of the old weights (the check can fail).
    assert max_delta(build_trainer(), PROMPTS, 4, out, 0.8) > 100 * LOGPROB_TOL


def test_reshard_refit_from_two_tp_ranks_installs_the_whole_model(engine: VLLMEngine) -> None:
    """A TP=2 trainer (Megatron's shards of the trainer model, exported under HF names by the
    converter, which needs no megatron-core) refits vLLM through ``ReshardSender`` x 2 ->
    the worker's ``ReshardReceiver`` (``init_refit`` with the reshard family, the trainer's path at TP > 1):
    vLLM's log-probs are then the whole trainer model's."""
    from algorithms.engines.training.mcore_convert import hf_to_mcore, mcore_shard_to_hf, shape_from_hf_config
    from algorithms.engines.training.megatron import hf_full_shapes
    from nemo_dataplane.refit import Mesh, build_layout
    from nemo_dataplane.refit.reshard import ReshardSender

    trainer = build_trainer(seed=4, noise=0.5)
    shape = shape_from_hf_config(trainer.config)
    shards = [mcore_shard_to_hf(hf_to_mcore(trainer.state_dict(), shape, tp=2, rank=r), shape, tp=2) for r in (0, 1)]
    layout = build_layout(Mesh.of([0, 1], tp=2), {n: s for n, s in hf_full_shapes(shape).items() if n in shards[0]})
    port = free_port()
    senders = [
        _Sender(None, port, rank=r, world=3, make=lambda g, r=r: ReshardSender(g, shards[r], layout, 4096))
        for r in (0, 1)
    ]
    try:
        engine.init_refit(
            "127.0.0.1", port, 3, 2, RefitSpec("gloo", 60, WeightTransferConfig(family="reshard"), senders=2)
        )
        for s in senders:
            s.send(13)
        assert engine.receive_weights() == 13
    finally:
        for s in senders:
            s.close()
    assert [s.error for s in senders] == [None, None], [s.error for s in senders]
    out = engine.generate(PROMPTS, 4, SamplingSpec(max_new_tokens=8, temperature=0.8, seed=5))
    assert out.version == 13
    delta = max_delta(trainer, PROMPTS, 4, out, 0.8)
    assert delta < LOGPROB_TOL, f"max |vLLM - trainer| log-prob = {delta:.3g}"
    assert max_delta(build_trainer(), PROMPTS, 4, out, 0.8) > 100 * LOGPROB_TOL  # not the initial weights


def test_layout_mismatch_at_refit_names_the_parameter_and_leaves_the_engine_usable(engine: VLLMEngine) -> None:
    port = free_port()
    sender = _Sender(build_trainer(model=WIDER_MODEL), port)
    try:
        with pytest.raises(RefitMismatchError, match=r"model\.layers\.0\.mlp\.gate_proj\.weight: shape"):
            engine.init_refit("127.0.0.1", port, 2, 1, RefitSpec("gloo", 60, WeightTransferConfig(), senders=1))
    finally:
        sender.close()
    assert isinstance(sender.error, RefitMismatchError), "the trainer side fails too, before any transfer"
    with pytest.raises(RuntimeError, match="before init_refit"):
        engine.receive_weights()
    version = engine.weight_version
    out = engine.generate(PROMPTS[:1], 2, SamplingSpec(max_new_tokens=4, seed=1))
    assert out.version == version and len(out.tokens) == 2


def test_a_generation_waits_for_a_refit_in_progress_and_carries_its_version(engine: VLLMEngine) -> None:
    trainer = build_trainer(seed=2, noise=0.5)
    port = free_port()
    sender = _Sender(trainer, port)
    results: dict[str, Any] = {}
    spec = SamplingSpec(max_new_tokens=6, temperature=1.0, seed=21)
    try:
        engine.init_refit("127.0.0.1", port, 2, 1, RefitSpec("gloo", 60, WeightTransferConfig(), senders=1))
        refit = threading.Thread(target=lambda: results.setdefault("version", engine.receive_weights()))
        refit.start()
        deadline = time.monotonic() + 30
        while not engine.busy and time.monotonic() < deadline:  # the refit holds the engine
            time.sleep(0.01)
        gen = threading.Thread(target=lambda: results.setdefault("out", engine.generate(PROMPTS, 2, spec)))
        gen.start()
        time.sleep(0.5)
        assert "out" not in results, "a generation ran while a refit was being received"
        sender.send(9)
        refit.join(60)
        gen.join(60)
    finally:
        sender.close()
    assert sender.error is None, sender.error
    assert results["version"] == 9
    out: Rollouts = results["out"]
    assert out.version == 9
    assert out.tokens == engine.generate(PROMPTS, 2, spec).tokens, "drawn entirely from version 9"
    assert max_delta(trainer, PROMPTS, 2, out, 1.0) < LOGPROB_TOL


def test_bad_requests_are_refused(engine: VLLMEngine) -> None:
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        engine.generate([[1, 5], []], 2, SamplingSpec(max_new_tokens=2))
    with pytest.raises(ValueError, match="top_p"):
        SamplingSpec(max_new_tokens=2, top_p=0.0)
    bad_heads = {**MODEL, "hf_config": {**MODEL["hf_config"], "num_attention_heads": 4, "num_key_value_heads": 4}}
    with pytest.raises(ValueError, match=r"attention head size 16 .*num_attention_heads"):
        VLLMEngine(bad_heads, vocab_size=TOK.vocab_size, eos_id=TOK.eos_id, bos_id=TOK.bos_id, pad_id=TOK.pad_id)


# ---------------------------------------------------------------- multiprocess engine, own process

_MP_SCRIPT = r"""
import importlib.util, sys
import psutil
spec = importlib.util.spec_from_file_location("vllm_tests", sys.argv[1])
t = importlib.util.module_from_spec(spec)
spec.loader.exec_module(t)
MODEL, PROMPTS, TOK, _refit = t.MODEL, t.PROMPTS, t.TOK, t._refit
build_trainer, max_delta = t.build_trainer, t.max_delta
from algorithms.config import VLLMEngineConfig
from algorithms.engines.generation import SamplingSpec
from algorithms.engines.generation.vllm import VLLMEngine

engine = VLLMEngine(MODEL, vocab_size=TOK.vocab_size, eos_id=TOK.eos_id, bos_id=TOK.bos_id, pad_id=TOK.pad_id,
                    engine=VLLMEngineConfig(multiprocessing=True, kv_cache_memory_bytes=64 << 20),
                    llm_kwargs={"block_size": 32})
children = [p.pid for p in psutil.Process().children(recursive=True)]
print("CHILDREN", " ".join(map(str, children)), flush=True)
print("MODEL_DIR", engine.model_dir, flush=True)
trainer = build_trainer(seed=4, noise=0.5)
with engine:
    assert _refit(engine, trainer, version=3) == 3
    out = engine.generate(PROMPTS, 2, SamplingSpec(max_new_tokens=6, temperature=1.0, seed=5))
    print("VERSION", out.version, flush=True)
    print("DELTA", max_delta(trainer, PROMPTS, 2, out, 1.0), flush=True)
    raise RuntimeError("a step failed")
"""


def test_multiprocess_engine_refits_in_its_worker_process_and_leaves_no_process_on_failure(tmp_path: Path) -> None:
    psutil = pytest.importorskip("psutil")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        [sys.executable, "-c", _MP_SCRIPT, __file__], cwd=REPO, env=env, capture_output=True, text=True, timeout=400
    )
    lines = dict(
        line.split(" ", 1) for line in proc.stdout.splitlines() if line.split(" ", 1)[0].isupper() and " " in line
    )
    assert proc.returncode == 1 and "RuntimeError: a step failed" in proc.stderr, proc.stderr[-4000:]
    children = [int(p) for p in lines["CHILDREN"].split()]
    assert children, "the multiprocess engine runs its core and worker in processes of their own"
    assert lines["VERSION"] == "3"
    assert float(lines["DELTA"]) < LOGPROB_TOL
    deadline = time.monotonic() + 30

    def alive() -> list[int]:
        return [p for p in children if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]

    while alive() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert alive() == [], "vLLM processes outlived the failed run"
    assert not Path(lines["MODEL_DIR"]).exists(), "the engine's model directory is removed at shutdown"
