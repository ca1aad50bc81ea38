"""The engine contract (algorithms/engines/generation/base.py) on the Hugging Face engine (hf.py),
and the generator actor's body (algorithms/workers/generator.py) that owns an engine: the tokens
and log-probs are those of ``algorithms.models.generate`` for the call's seed, a refit over a
real gloo group installs the sender's weights and labels later batches with its version."""

from __future__ import annotations

import dataclasses
import socket
import threading
from typing import Any

import pytest
import torch

from algorithms.config import ConfigError, load_config
from algorithms.engines.generation import RefitSpec, SamplingSpec, build_engine
from algorithms.engines.generation.hf import HFEngine
from algorithms.models import build_model, generate
from algorithms.tasks import CharTokenizer
from algorithms.workers.generator import GeneratorWorker
from nemo_dataplane.distributed.stateless_group import StatelessProcessGroup
from nemo_dataplane.refit import RefitSender, WeightTransferConfig

TOK = CharTokenizer()
MODEL: dict[str, Any] = {
    "arch": "llama",
    "seed": 0,
    "hf_config": {
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "max_position_embeddings": 64,
    },
}
PROMPTS = [[1, 5, 6, 7], [1, 9], [1, 4, 4, 4, 4, 4]]


def _engine() -> HFEngine:
    return HFEngine(MODEL, vocab_size=TOK.vocab_size, eos_id=TOK.eos_id, pad_id=TOK.pad_id)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_tokens_and_logprobs_are_those_of_the_seeded_sampler() -> None:
    eng = _engine()
    spec = SamplingSpec(max_new_tokens=5, temperature=0.9, seed=7)
    out = eng.generate(PROMPTS, 3, spec)
    ref_model = build_model(MODEL, vocab_size=TOK.vocab_size)
    tokens, logprobs = generate(
        ref_model, PROMPTS, 3, 5, 0.9, torch.Generator().manual_seed(7), TOK.eos_id, TOK.pad_id, return_logprobs=True
    )
    assert out.tokens == tokens and out.logprobs == logprobs
    assert out.version == -1 and len(out.tokens) == 9
    assert all(len(t) == len(lp) for t, lp in zip(out.tokens, out.logprobs))


def test_refit_installs_the_senders_weights_and_labels_later_batches() -> None:
    eng = _engine()
    trainer = build_model(MODEL, vocab_size=TOK.vocab_size)
    with torch.no_grad():
        for p in trainer.parameters():
            p.mul_(-1.5)
    port = _free_port()
    errors: list[BaseException] = []

    def send() -> None:
        g = StatelessProcessGroup("127.0.0.1", port, 0, 2, "gloo", 60.0, group_name="refit")
        try:
            s = RefitSender(g, trainer.named_parameters)
            s.prepare_refit_info()
            s.send_weights(4)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)
        finally:
            g.destroy()

    with pytest.raises(RuntimeError, match="before init_refit"):
        eng.receive_weights()
    t = threading.Thread(target=send)
    t.start()
    eng.init_refit("127.0.0.1", port, 2, 1, RefitSpec("gloo", 60, WeightTransferConfig(), senders=1))
    assert eng.receive_weights() == 4
    t.join(60)
    assert not errors, errors
    for (name, a), (_, b) in zip(eng.model.named_parameters(), trainer.named_parameters()):
        assert torch.equal(a, b), name
    spec = SamplingSpec(max_new_tokens=4, seed=3)
    out = eng.generate(PROMPTS, 2, spec)
    assert out.version == 4
    ref = generate(trainer, PROMPTS, 2, 4, 1.0, torch.Generator().manual_seed(3), TOK.eos_id, TOK.pad_id)
    assert out.tokens == ref
    eng.shutdown()
    eng.shutdown()  # idempotent
    with pytest.raises(RuntimeError, match="shut down"):
        eng.generate(PROMPTS, 1, spec)


def test_top_p_is_refused_by_the_hf_engine() -> None:
    with pytest.raises(ValueError, match="generation.backend=vllm"):
        _engine().generate(PROMPTS, 1, SamplingSpec(max_new_tokens=2, top_p=0.9))


def test_generator_worker_keeps_its_contract_on_the_hf_backend() -> None:
    cfg = load_config(
        None,
        [f"policy.model.{k}={v}" for k, v in (("arch", "llama"), ("seed", 0))]
        + [f"policy.model.hf_config.{k}={v}" for k, v in MODEL["hf_config"].items()]
        + ["generation.max_new_tokens=3", "generation.temperature=0.7"],
    )
    assert cfg.generation.backend == "hf"
    worker = GeneratorWorker(cfg)
    assert worker.ready() is True
    out, _ = worker.generate(PROMPTS, 2, 5)
    tokens, logprobs, version = out.tokens, out.logprobs, out.version
    ref = generate(
        build_model(MODEL, vocab_size=TOK.vocab_size),
        PROMPTS,
        2,
        3,
        0.7,
        torch.Generator().manual_seed(5),
        TOK.eos_id,
        TOK.pad_id,
        return_logprobs=True,
    )
    assert (tokens, logprobs) == ref and version == -1
    greedy = worker.generate(PROMPTS, 1, 5, temperature=0.0)[0].tokens
    assert greedy == generate(
        build_model(MODEL, vocab_size=TOK.vocab_size), PROMPTS, 1, 3, 0.0, torch.Generator(), TOK.eos_id, TOK.pad_id
    )
    worker.shutdown()


def test_an_unknown_backend_is_refused_by_the_config_and_by_the_factory() -> None:
    model = [f"policy.model.{k}={v}" for k, v in (("arch", "llama"), ("seed", 0))]
    with pytest.raises(ConfigError, match="generation.backend"):
        load_config(None, [*model, "generation.backend=sglang"])
    cfg = load_config(None, model)
    bypassed = dataclasses.replace(cfg, generation=dataclasses.replace(cfg.generation, backend="sglang"))
    with pytest.raises(ValueError, match="generation.backend must be one of"):
        build_engine(bypassed)


# The trainer's log-prob of each sampled token (sequence_logprobs over prompt + response, right
# padded) against the sampler's (KV cache, left padded), after a refit from the trainer engine
# over gloo. Measured max |delta| on 2-core CPUs: fp32 9.5e-7; bf16 0 where both paths round the
# same per-element fp32 accumulations to bf16, 0.014 on an AMD EPYC whose bf16 kernels reduce the
# two batch shapes in another order. bf16 is held to 3e-2: two bf16 rounding steps (2^-8
# relative) of a logit of magnitude 4.
PARITY_TOL = {"fp32": 1e-5, "bf16": 3e-2}


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_sampler_logprobs_match_the_trainer_engine_in_each_precision(precision: str) -> None:
    from algorithms.engines.training.hf import HFTrainingEngine
    from algorithms.models import pad_batch, sequence_logprobs
    from algorithms.precision import PRECISIONS
    from nemo_dataplane.refit import build_weight_sender

    cfg = load_config(
        None,
        [f"policy.model.{k}={v}" for k, v in (("arch", "llama"), ("seed", 0))]
        + [f"policy.model.hf_config.{k}={v}" for k, v in MODEL["hf_config"].items()]
        + [f"policy.precision={precision}", "generation.temperature=0.8"],
    )
    dtype = PRECISIONS[precision].dtype
    trainer = HFTrainingEngine(cfg, torch.device("cpu"), vocab_size=TOK.vocab_size, pad_id=TOK.pad_id)
    with torch.no_grad():  # the trained weights move away from the generator's initial ones
        for m in trainer.trained.params:
            m.add_(torch.randn(m.shape, generator=torch.Generator().manual_seed(1)) * 0.3)
    trainer.trained.publish()
    sent = list(trainer.named_for_refit())
    assert {t.dtype for _, t in sent} == {dtype}
    assert sum(t.numel() * t.element_size() for _, t in sent) == trainer.num_params() * dtype.itemsize
    eng = HFEngine.from_config(cfg)
    assert {p.dtype for p in eng.model.parameters()} == {dtype}
    port = _free_port()
    errors: list[BaseException] = []

    def send() -> None:
        g = StatelessProcessGroup("127.0.0.1", port, 0, 2, "gloo", 60.0, group_name="refit")
        try:
            s = build_weight_sender(
                cfg.weight_transfer, g, trainer.named_for_refit, senders=1, full_shapes=trainer.refit_shapes()
            )
            s.prepare_refit_info()
            s.send_weights(1)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)
        finally:
            g.destroy()

    t = threading.Thread(target=send)
    t.start()
    eng.init_refit("127.0.0.1", port, 2, 1, RefitSpec("gloo", 60, cfg.weight_transfer, senders=1))
    assert eng.receive_weights() == 1
    t.join(60)
    assert not errors, errors
    for (name, a), (_, b) in zip(eng.model.named_parameters(), trainer.model.named_parameters()):
        assert torch.equal(a, b), name
    out = eng.generate(PROMPTS, 4, SamplingSpec(max_new_tokens=6, temperature=0.8, seed=2))
    rows = [p for p in PROMPTS for _ in range(4)]
    ids, attn = pad_batch([p + r for p, r in zip(rows, out.tokens)], TOK.pad_id)
    resp = torch.zeros_like(ids)
    for i, (p, r) in enumerate(zip(rows, out.tokens)):
        resp[i, len(p) : len(p) + len(r)] = 1
    with torch.no_grad():
        lp = sequence_logprobs(trainer.model, ids, attn, resp, temperature=0.8)
    delta = max(
        float((lp[i, len(p) - 1 : len(p) - 1 + len(r)] - torch.tensor(out.logprobs[i])).abs().max())
        for i, (p, r) in enumerate(zip(rows, out.tokens))
    )
    print(f"{precision}: max |sampler - trainer| log-prob = {delta:.3g}")
    assert delta < PARITY_TOL[precision], delta
    eng.shutdown()


# ------------------------------------------------------------------ deterministic async mode
def test_row_seeded_responses_do_not_depend_on_the_batch_they_share() -> None:
    eng = _engine()
    same_len = [[1, 5, 6, 7], [1, 9, 9, 2], [1, 4, 4, 4]]  # one length: no padding difference
    seeds = (11, 12, 13, 21, 22, 23, 31, 32, 33)
    spec = SamplingSpec(max_new_tokens=6, temperature=1.0, row_seeds=seeds)
    whole = eng.generate(same_len, 3, spec)
    alone = eng.generate(same_len[1:2], 3, dataclasses.replace(spec, row_seeds=seeds[3:6]))
    assert whole.tokens[3:6] == alone.tokens
    # The same tokens; their log-probs within fp32 rounding, as a CPU's matmul kernels may
    # accumulate a batch of 9 rows and one of 3 in another order (measured: 2.4e-7).
    for a, b in zip(whole.logprobs[3:6], alone.logprobs):
        assert torch.allclose(torch.tensor(a), torch.tensor(b), rtol=0, atol=1e-5), (a, b)
    reordered = eng.generate(same_len[::-1], 3, dataclasses.replace(spec, row_seeds=seeds[6:] + seeds[3:6] + seeds[:3]))
    assert reordered.tokens[:3] == whole.tokens[6:] and reordered.tokens[6:] == whole.tokens[:3]
    other = eng.generate(same_len, 3, dataclasses.replace(spec, row_seeds=tuple(s + 100 for s in seeds)))
    assert other.tokens != whole.tokens, "the seeds drive the draw"
    with pytest.raises(ValueError, match="row seeds"):
        eng.generate(same_len, 3, dataclasses.replace(spec, row_seeds=seeds[:4]))


def test_hash_noise_samples_the_softmax_distribution() -> None:
    from algorithms.models import hash_uniform

    logits = torch.tensor([0.0, 1.0, 2.0, -1.0, -30.0])
    draws = 100_000
    noise = -torch.log(-torch.log(hash_uniform(torch.arange(draws), 3, 5)))
    freq = torch.bincount((logits.double() + noise).argmax(-1), minlength=5).double() / draws
    want = torch.softmax(logits.double(), 0)
    # 5 standard deviations of a binomial frequency
    assert torch.all((freq - want).abs() <= 5 * (want * (1 - want) / draws).sqrt() + 1e-9), (freq, want)
    assert torch.equal(hash_uniform(torch.tensor([5, 5]), 0, 7)[0], hash_uniform(torch.tensor([5]), 0, 7)[0])
    assert not torch.equal(hash_uniform(torch.tensor([5]), 0, 7), hash_uniform(torch.tensor([5]), 1, 7))


def test_a_generation_pinned_to_a_version_waits_for_it_and_refuses_an_older_one() -> None:
    eng = _engine()
    trainer = build_model(MODEL, vocab_size=TOK.vocab_size)
    port = _free_port()
    spec = SamplingSpec(max_new_tokens=3, row_seeds=tuple(range(2)))
    results: list[Any] = []

    def pinned() -> None:
        try:
            results.append(eng.generate(PROMPTS[:1], 2, spec, version=1, timeout_s=60))
        except BaseException as e:  # noqa: BLE001 - reported below
            results.append(e)

    waiter = threading.Thread(target=pinned)
    sender_group: list[StatelessProcessGroup] = []

    def send() -> None:
        g = StatelessProcessGroup("127.0.0.1", port, 0, 2, "gloo", 60.0, group_name="refit")
        sender_group.append(g)
        s = RefitSender(g, trainer.named_parameters)
        s.prepare_refit_info()
        s.send_weights(1)
        s.send_weights(2)

    t = threading.Thread(target=send)
    t.start()
    eng.init_refit("127.0.0.1", port, 2, 1, RefitSpec("gloo", 60, WeightTransferConfig(), senders=1))
    waiter.start()
    waiter.join(0.5)
    assert waiter.is_alive() and not results, "a generation pinned to version 1 ran on the initial weights"
    assert eng.receive_weights() == 1
    waiter.join(60)
    assert results and not isinstance(results[0], BaseException), results
    assert results[0].version == 1
    assert eng.receive_weights() == 2
    t.join(60)
    with pytest.raises(RuntimeError, match="already holds the newer 2"):
        eng.generate(PROMPTS[:1], 2, spec, version=1, timeout_s=5)
    with pytest.raises(RuntimeError, match="did not arrive within"):
        eng.generate(PROMPTS[:1], 2, spec, version=3, timeout_s=0.2)
    sender_group[0].destroy()
    eng.shutdown()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_a_gpu_the_seed_draws_one_stream_per_response_on_the_device() -> None:
    """A CUDA model's tokens are drawn on the device: the call's generator gives each response
    a seed and the draw is the ``row_seeds`` one (no distribution copied to the host per token)."""
    from algorithms.models import sample

    model = build_model(MODEL, vocab_size=TOK.vocab_size).cuda()
    rows = len(PROMPTS) * 4

    def draw(seed: int, row_seeds: list[int] | None = None) -> Any:
        gen = torch.Generator().manual_seed(seed)
        return sample(model, PROMPTS, 4, 8, 1.0, gen, TOK.eos_id, TOK.pad_id, row_seeds=row_seeds)

    first = draw(7)
    seeds = torch.randint(0, 1 << 62, (rows,), generator=torch.Generator().manual_seed(7)).tolist()
    assert first.tokens == draw(0, row_seeds=seeds).tokens
    assert first.logprobs == draw(0, row_seeds=seeds).logprobs
    assert draw(7).tokens == first.tokens and draw(8).tokens != first.tokens
