"""Partial rollouts: a refit stops a generation in flight at a token boundary, the responses keep
their tokens and behaviour log-probs, and go on under the new weights; each token records the
version that drew it, and its behaviour log-prob is that version's (teacher-forced, fp32 on CPU,
within ``LOGPROB_TOL``).

* On the engine (in-process, deterministic: the model's forward is slowed so the refit lands
  mid-generation): an interruptible generation comes back unfinished with version v, the
  continuation with v + 1.
* Through the collector and a real generator actor (Ray): one ``_sample`` call spans a refit and
  its responses carry two versions, per token.
"""

from __future__ import annotations

import socket
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from algorithms.config import load_config
from algorithms.engines.generation import RefitSpec, SamplingSpec
from algorithms.engines.generation.hf import HFEngine
from algorithms.models import build_model, pad_batch, sequence_logprobs
from algorithms.tasks import CharTokenizer
from nemo_dataplane.distributed.stateless_group import StatelessProcessGroup
from nemo_dataplane.refit import RefitSender, WeightTransferConfig

TOK = CharTokenizer()
LOGPROB_TOL = 1e-4  # fp32 on CPU: a KV-cached decode step against one full forward of the prefix
MODEL: dict[str, Any] = {
    "arch": "llama",
    "seed": 0,
    "hf_config": {
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "max_position_embeddings": 128,
    },
}
PROMPTS = [[1, 5, 6, 7], [1, 9]]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _trained(seed: int = 3) -> torch.nn.Module:
    """The trainer's model after 'a step': the initial weights, perturbed."""
    model = build_model(MODEL, vocab_size=TOK.vocab_size)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.5 * torch.randn(p.shape, generator=gen))
    return model


def _teacher_forced(model: torch.nn.Module, prompt: list[int], tokens: list[int], temperature: float) -> list[float]:
    """log p(tokens[t] | prompt + tokens[:t]) under ``model``, one full forward."""
    ids, attn = pad_batch([prompt + tokens], TOK.pad_id)
    resp = torch.zeros_like(attn)
    resp[0, len(prompt) :] = 1
    with torch.no_grad():
        lp = sequence_logprobs(model, ids, attn, resp, temperature=temperature)
    return lp[0, len(prompt) - 1 :].tolist()


class _Sender:
    """The trainer side of the refit group, in a thread: prepares, then sends on request."""

    def __init__(self, model: torch.nn.Module, port: int) -> None:
        self.model, self.port = model, port
        self.error: BaseException | None = None
        self.go = threading.Semaphore(0)
        self.versions: list[int] = []
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        g = StatelessProcessGroup("127.0.0.1", self.port, 0, 2, "gloo", 60.0, group_name="refit")
        try:
            s = RefitSender(g, self.model.named_parameters)
            s.prepare_refit_info()
            while self.go.acquire(timeout=60):
                if not self.versions:
                    break
                s.send_weights(self.versions.pop(0))
        except BaseException as e:  # noqa: BLE001 - reported by the test
            self.error = e
        finally:
            g.destroy()

    def send(self, version: int) -> None:
        self.versions.append(version)
        self.go.release()

    def close(self) -> None:
        self.go.release()
        self.thread.join(30)


def test_a_refit_interrupts_a_generation_at_a_token_boundary_and_the_continuation_takes_the_new_version() -> None:
    engine = HFEngine(MODEL, vocab_size=TOK.vocab_size, eos_id=TOK.eos_id, pad_id=TOK.pad_id)
    initial = build_model(MODEL, vocab_size=TOK.vocab_size)
    trainer = _trained()
    port = _free_port()
    sender = _Sender(trainer, port)
    spec = RefitSpec("gloo", 60.0, WeightTransferConfig(), senders=1)
    engine.init_refit("127.0.0.1", port, 2, 1, spec)
    calls = [0]
    forward = engine.model.forward

    def slow_forward(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        time.sleep(0.02)  # a decode step slow enough for the refit to land mid-generation
        return forward(*args, **kwargs)

    engine.model.forward = slow_forward  # type: ignore[method-assign]
    sampling = SamplingSpec(max_new_tokens=40, temperature=0.9, seed=11, ignore_eos=True)
    first: dict[str, Any] = {}
    gen = threading.Thread(
        target=lambda: first.setdefault("out", engine.generate(PROMPTS, 2, sampling, interruptible=True))
    )
    gen.start()
    deadline = time.monotonic() + 30
    while calls[0] < 6 and time.monotonic() < deadline:  # a few tokens drawn with the initial weights
        time.sleep(0.005)
    sender.send(7)
    assert engine.receive_weights(interrupt=True) == 7
    gen.join(30)
    out = first["out"]
    assert out.version == -1 and not any(out.finished), "every response was stopped at a token boundary"
    lengths = {len(t) for t in out.tokens}
    assert len(lengths) == 1 and 0 < lengths.pop() < 40, [len(t) for t in out.tokens]
    # The continuation: each response's prompt and tokens so far, the rest of its limit.
    prefixes = [PROMPTS[j // 2] + out.tokens[j] for j in range(4)]
    left = tuple(40 - len(t) for t in out.tokens)
    more = engine.generate(
        prefixes, 1, SamplingSpec(max_new_tokens=40, temperature=0.9, seed=12, limits=left, ignore_eos=True)
    )
    assert more.version == 7 and all(more.finished) and [len(t) for t in more.tokens] == list(left)
    sender.close()
    assert sender.error is None, sender.error
    worst, other = 0.0, 0.0
    for j in range(4):
        prompt = PROMPTS[j // 2]
        tokens = out.tokens[j] + more.tokens[j]
        behaviour = out.logprobs[j] + more.logprobs[j]
        cut = len(out.tokens[j])
        under_initial = _teacher_forced(initial, prompt, tokens, 0.9)
        under_trained = _teacher_forced(trainer, prompt, tokens, 0.9)
        for t in range(len(tokens)):
            own, alt = (under_initial, under_trained) if t < cut else (under_trained, under_initial)
            worst = max(worst, abs(behaviour[t] - own[t]))
            other = max(other, abs(behaviour[t] - alt[t]))
    assert worst < LOGPROB_TOL, f"max |behaviour - teacher-forced (own version)| = {worst:.3g}"
    assert other > 100 * LOGPROB_TOL, "the two versions' log-probs must differ for the check to mean anything"
    engine.shutdown()


def test_without_interrupt_a_refit_waits_for_the_generation_and_a_later_one_waits_for_the_refit() -> None:
    engine = HFEngine(MODEL, vocab_size=TOK.vocab_size, eos_id=TOK.eos_id, pad_id=TOK.pad_id)
    port = _free_port()
    sender = _Sender(_trained(), port)
    engine.init_refit("127.0.0.1", port, 2, 1, RefitSpec("gloo", 60.0, WeightTransferConfig(), senders=1))
    forward = engine.model.forward
    engine.model.forward = lambda *a, **k: (time.sleep(0.01), forward(*a, **k))[1]  # type: ignore[method-assign]
    spec = SamplingSpec(max_new_tokens=20, temperature=1.0, seed=1, ignore_eos=True)
    got: dict[str, Any] = {}
    gen = threading.Thread(target=lambda: got.setdefault("a", engine.generate(PROMPTS, 1, spec, interruptible=True)))
    gen.start()
    while not engine.busy:
        time.sleep(0.002)
    sender.send(3)
    refit = threading.Thread(target=lambda: got.setdefault("v", engine.receive_weights()))  # no interrupt
    refit.start()
    while not engine._refits_waiting:  # the refit waits for the engine
        time.sleep(0.002)
    later = threading.Thread(target=lambda: got.setdefault("b", engine.generate(PROMPTS, 1, spec)))
    later.start()
    for t in (gen, refit, later):
        t.join(60)
    sender.close()
    assert all(got["a"].finished) and got["a"].version == -1, "not interrupted: it ran to completion"
    assert got["v"] == 3 and got["b"].version == 3, "the refit went before the generation that asked after it"
    engine.shutdown()


@pytest.fixture
def generator_actor(ray_session: Any) -> Any:
    cfg = load_config(
        None,
        [f"policy.model.{k}={v}" for k, v in (("arch", "llama"), ("seed", 0))]
        + [
            "policy.model.hf_config.hidden_size=256",
            "policy.model.hf_config.intermediate_size=512",
            "policy.model.hf_config.num_hidden_layers=4",
            "policy.model.hf_config.num_attention_heads=4",
            "policy.model.hf_config.num_key_value_heads=4",
            "policy.model.hf_config.max_position_embeddings=256",
            "generation.max_new_tokens=160",
            "generation.n=2",
            "task.name=longtail",
            "async.partial_rollout=true",
        ],
    )
    from algorithms.launch import generator_actor

    actor = generator_actor(cfg, 0, owned_cluster=False)  # as a run creates it (partial: 2 calls at once)
    ray_session.get(actor.ready.remote(), timeout=120)
    yield cfg, actor
    ray_session.kill(actor)


def test_a_collector_sample_across_a_refit_holds_two_versions_each_tokens_own(generator_actor: Any) -> None:
    import ray

    from algorithms.workers.collector import RolloutCollector

    cfg, actor = generator_actor
    port = _free_port()
    model_cfg = dict(cfg.policy.model)
    initial = build_model(model_cfg, vocab_size=TOK.vocab_size)
    trainer = build_model(model_cfg, vocab_size=TOK.vocab_size)
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in trainer.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    sender = _Sender(trainer, port)
    ray.get(actor.init_refit.remote("127.0.0.1", port, 2, 1), timeout=120)
    collector = RolloutCollector(cfg, actor, 0)
    prompts = [TOK.encode_prompt("381="), TOK.encode_prompt("27=")]
    got: dict[str, Any] = {}
    t = threading.Thread(target=lambda: got.setdefault("s", collector._sample(prompts, 2, 99, None, [160, 160])))
    t.start()
    deadline = time.monotonic() + 60
    while not ray.get(actor.busy.remote(), timeout=30) and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.05)
    sender.send(1)
    version, _, _ = ray.get(actor.receive_weights.remote(1), timeout=120)
    t.join(120)
    sender.close()
    assert version == 1 and sender.error is None
    s = got["s"]
    assert [len(tok) for tok in s.tokens] == [160] * 4, "every response ran to its limit (EOS ignored)"
    spans = [sorted(set(v)) for v in s.versions]
    assert any(v == [-1, 1] for v in spans), f"no response spans the refit: {spans}"
    worst = 0.0
    for j in range(4):
        prompt, tokens = prompts[j // 2], s.tokens[j]
        forced = {-1: _teacher_forced(initial, prompt, tokens, 1.0), 1: _teacher_forced(trainer, prompt, tokens, 1.0)}
        for i, (lp, v) in enumerate(zip(s.logprobs[j], s.versions[j])):
            worst = max(worst, abs(lp - forced[v][i]))
    assert worst < LOGPROB_TOL, f"max |behaviour - teacher-forced under the token's version| = {worst:.3g}"


class _FailingSink:
    """A sink in memory whose write of any batch holding ``fail_group`` raises (once)."""

    def __init__(self, fail_group: int) -> None:
        self.fail_group = fail_group
        self.written: list[int] = []

    def open(self) -> None:
        pass

    def unconsumed_groups(self) -> int:
        return 0

    def stream(self, jobs: Any, batch: Any, tags: Any, version: int, stopped: Any) -> float:
        ids = [j.group_id for j in jobs]
        if self.fail_group in ids:
            self.fail_group = -1
            from algorithms.faults import InjectedFailure  # a failure the producer survives

            raise InjectedFailure(f"write of groups {ids} failed")
        self.written += ids
        return 0.0

    def stats(self) -> dict[str, float]:
        return {}

    def drain_ops(self) -> list[Any]:
        return []


def test_a_failed_write_of_groups_completed_in_the_pool_reports_them_for_regeneration() -> None:
    """Complete groups leave the row pool before their write: if it fails they must be reported
    (the driver requeues them), or their prompts are lost for the rest of the run. Even-numbered
    groups finish in one generate call, odd ones in two, so group 1 completes together with
    group 2, and their one write fails."""
    from algorithms.engines.generation import Rollouts
    from algorithms.rollouts import Job
    from algorithms.tasks import PromptRecord
    from algorithms.workers.collector import RolloutCollector

    tiny = Path(__file__).resolve().parents[2] / "examples" / "configs" / "grpo_async_tiny.yaml"
    cfg = load_config(str(tiny), ["generation.n=2", "async.partial_rollout=true", "async.groups_per_generation=2"])
    long_prompt = len(TOK.encode_prompt("22="))

    class _OneTokenCollector(RolloutCollector):
        def _call(self, prompts: Any, n: int, seed: int, *args: Any, **kwargs: Any) -> tuple[Rollouts, float]:
            # one token per row; a row is done once its prefix is one past the longer prompt
            done = [len(p) + 1 > long_prompt for p in prompts]
            return Rollouts([[5] for _ in prompts], [[-0.5] for _ in prompts], 0, done), 0.0

    sink = _FailingSink(fail_group=1)
    collector = _OneTokenCollector(cfg, None, 0)
    collector.attach(sink)  # type: ignore[arg-type]
    jobs = [Job(g, g, PromptRecord("22=" if g % 2 == 0 else "2=", "7", g)) for g in range(4)]
    collector.start(max_inflight_groups=8, groups_per_generation=2)
    collector.submit(jobs)
    failed: list[int] = []
    deadline = time.monotonic() + 30
    while len(sink.written) + len(failed) < len(jobs) and time.monotonic() < deadline:
        p = collector.poll()
        assert p["error"] is None, p["error"]
        failed += p["failed"]
        time.sleep(0.01)
    collector.stop()
    failed += collector.poll()["failed"]
    assert sorted(sink.written) == [0, 3], "the groups whose write went through"
    assert sorted(failed) == [1, 2], "every group not in the store is reported, none that is"
