"""Tiny model build (config / local HF dir), padding, next-token log-probs and KV-cached sampling."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from algorithms.models import build_model, generate, pad_batch, save_pretrained_dir, sequence_logprobs
from algorithms.tasks import CharTokenizer

TOK = CharTokenizer()


def _cfg(seed: int = 0, arch: str = "llama") -> dict[str, Any]:
    return {
        "arch": arch,
        "seed": seed,
        "hf_config": {
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "max_position_embeddings": 64,
        },
    }


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    m = build_model(_cfg(), vocab_size=TOK.vocab_size)
    # Sharpen the random model a little so greedy decoding is not decided by float noise.
    with torch.no_grad():
        m.get_output_embeddings().weight.mul_(20.0)
    return m


def _state_equal(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_build_from_config_is_seeded_and_leaves_global_rng(arch: str) -> None:
    torch.manual_seed(123)
    before = torch.get_rng_state()
    a = build_model(_cfg(5, arch), vocab_size=TOK.vocab_size)
    assert torch.equal(torch.get_rng_state(), before)
    b = build_model(_cfg(5, arch), vocab_size=TOK.vocab_size)
    c = build_model(_cfg(6, arch), vocab_size=TOK.vocab_size)
    assert _state_equal(a, b) and not _state_equal(a, c)
    assert a.config.vocab_size == TOK.vocab_size and a.config.model_type == arch
    assert a.training and all(p.dtype == torch.float32 for p in a.parameters())


def test_build_errors() -> None:
    with pytest.raises(ValueError, match="exactly one of 'path'"):
        build_model({"arch": "llama"})
    with pytest.raises(ValueError, match="model.arch"):
        build_model({**_cfg(), "arch": "gpt9"}, vocab_size=TOK.vocab_size)
    with pytest.raises(ValueError, match="vocab_size is missing"):
        build_model(_cfg())
    with pytest.raises(ValueError, match="model vocab_size 10 < tokenizer vocab_size"):
        build_model({**_cfg(), "hf_config": {**_cfg()["hf_config"], "vocab_size": 10}}, vocab_size=TOK.vocab_size)
    with pytest.raises(FileNotFoundError, match="no config.json"):
        build_model({"path": "/nonexistent/model/dir"})


def test_local_hf_dir_roundtrip(model: torch.nn.Module, tmp_path: Path) -> None:
    path = save_pretrained_dir(model, tmp_path / "m")
    assert (tmp_path / "m" / "config.json").is_file()
    assert any(p.suffix == ".safetensors" for p in (tmp_path / "m").iterdir())
    loaded = build_model({"path": path}, vocab_size=TOK.vocab_size)
    assert _state_equal(model, loaded)
    ids = torch.tensor([TOK.encode("12=3", add_bos=True)])
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, loaded(input_ids=ids).logits)


def test_pad_batch_right_left_and_nested() -> None:
    seqs = [[5, 6, 7], [8]]
    ids, mask = pad_batch(seqs, pad_id=0)
    assert ids.tolist() == [[5, 6, 7], [8, 0, 0]] and mask.tolist() == [[1, 1, 1], [1, 0, 0]]
    ids, mask = pad_batch(seqs, pad_id=0, left=True, length=4)
    assert ids.tolist() == [[0, 5, 6, 7], [0, 0, 0, 8]] and mask.tolist() == [[0, 1, 1, 1], [0, 0, 0, 1]]
    nested = torch.nested.nested_tensor([torch.tensor(s) for s in seqs], layout=torch.jagged)
    assert torch.equal(pad_batch(nested, pad_id=0)[0], pad_batch(seqs, pad_id=0)[0])
    with pytest.raises(ValueError, match="length=2 < longest sequence 3"):
        pad_batch(seqs, pad_id=0, length=2)


def test_sequence_logprobs_match_unpadded_forward(model: torch.nn.Module) -> None:
    seqs = [TOK.encode("12=21", add_bos=True, add_eos=True), TOK.encode("7=4", add_bos=True)]
    prompt_lens = [4, 3]
    ids, attn = pad_batch(seqs, TOK.pad_id)
    resp = torch.zeros_like(attn)
    for i, (s, p) in enumerate(zip(seqs, prompt_lens)):
        resp[i, p : len(s)] = 1
    with torch.no_grad():
        lp, ent = sequence_logprobs(model, ids, attn, resp, return_entropy=True)
    assert lp.shape == ent.shape == (2, ids.shape[1] - 1) and lp.dtype == torch.float32
    for i, (s, p) in enumerate(zip(seqs, prompt_lens)):
        x = torch.tensor([s])
        with torch.no_grad():
            logp = torch.log_softmax(model(input_ids=x).logits[0].float(), -1)
        for t in range(len(s) - 1):
            if t + 1 >= p:  # response token t+1
                assert lp[i, t].item() == pytest.approx(logp[t, s[t + 1]].item(), abs=1e-5)
                want_ent = -(logp[t].exp() * logp[t]).sum().item()
                assert ent[i, t].item() == pytest.approx(want_ent, abs=1e-5)
            else:
                assert lp[i, t] == 0 and ent[i, t] == 0
        assert (lp[i, len(s) - 1 :] == 0).all()  # padding
    # temperature rescales the distribution the scores come from
    with torch.no_grad():
        lp_t = sequence_logprobs(model, ids, attn, resp, temperature=2.0)
    assert not torch.allclose(lp_t, lp) and (lp_t[resp[:, 1:].bool()] <= 0).all()


def test_sequence_logprobs_gradient_flows(model: torch.nn.Module) -> None:
    ids, attn = pad_batch([TOK.encode("3=9", add_bos=True)], TOK.pad_id)
    model.zero_grad()
    sequence_logprobs(model, ids, attn, attn).sum().backward()
    g = model.get_input_embeddings().weight.grad
    assert g is not None and g.abs().sum() > 0
    model.zero_grad()


def test_generate_is_deterministic_and_group_major(model: torch.nn.Module) -> None:
    prompts = [TOK.encode_prompt(p) for p in ("1=", "42=", "7=")]
    out1 = generate(model, prompts, 4, 5, 1.0, torch.Generator().manual_seed(0), TOK.eos_id, TOK.pad_id)
    out2 = generate(model, prompts, 4, 5, 1.0, torch.Generator().manual_seed(0), TOK.eos_id, TOK.pad_id)
    out3 = generate(model, prompts, 4, 5, 1.0, torch.Generator().manual_seed(1), TOK.eos_id, TOK.pad_id)
    assert out1 == out2 and out1 != out3
    assert len(out1) == 12
    for r in out1:
        assert 1 <= len(r) <= 5
        assert TOK.pad_id not in r
        assert (r[-1] == TOK.eos_id) or len(r) == 5
        assert TOK.eos_id not in r[:-1]
    assert model.training  # mode restored


def test_greedy_generate_matches_full_forward_per_prompt(model: torch.nn.Module) -> None:
    """KV cache + left padding must reproduce an uncached, unpadded greedy decode of each prompt."""
    prompts = [TOK.encode_prompt(p) for p in ("1=", "4321=", "77=")]
    batched = generate(model, prompts, 2, 6, 0.0, torch.Generator(), TOK.eos_id, TOK.pad_id)
    for i, p in enumerate(prompts):
        seq = list(p)
        want: list[int] = []
        with torch.no_grad():
            for _ in range(6):
                nxt = int(model(input_ids=torch.tensor([seq])).logits[0, -1].argmax())
                want.append(nxt)
                seq.append(nxt)
                if nxt == TOK.eos_id:
                    break
        assert batched[2 * i] == want and batched[2 * i + 1] == want


def test_generate_errors(model: torch.nn.Module) -> None:
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        generate(model, [[1], []], 1, 2, 1.0, torch.Generator(), TOK.eos_id, TOK.pad_id)
    with pytest.raises(ValueError, match="max_new_tokens"):
        generate(model, [[1]], 1, 0, 1.0, torch.Generator(), TOK.eos_id, TOK.pad_id)


def test_generate_logprobs_are_those_of_the_sampled_tokens_under_the_tempered_distribution(
    model: torch.nn.Module,
) -> None:
    """The behaviour log-probs returned with the tokens equal an independent teacher-forced
    forward of the same sequences at the same temperature (and the tokens are unchanged)."""
    from algorithms.models import sequence_logprobs

    prompts = [TOK.encode_prompt("3="), TOK.encode_prompt("71=")]
    temperature = 0.7
    plain = generate(model, prompts, 3, 5, temperature, torch.Generator().manual_seed(4), TOK.eos_id, TOK.pad_id)
    tokens, logprobs = generate(
        model,
        prompts,
        3,
        5,
        temperature,
        torch.Generator().manual_seed(4),
        TOK.eos_id,
        TOK.pad_id,
        return_logprobs=True,
    )
    assert tokens == plain
    for i, (resp, lps) in enumerate(zip(tokens, logprobs)):
        assert len(lps) == len(resp) > 0
        seq = torch.tensor([list(prompts[i // 3]) + resp])
        attn = torch.ones_like(seq)
        resp_mask = torch.zeros_like(seq, dtype=torch.bool)
        resp_mask[:, len(prompts[i // 3]) :] = True
        with torch.no_grad():
            ref = sequence_logprobs(model, seq, attn, resp_mask, temperature=temperature)[0, len(prompts[i // 3]) - 1 :]
        assert torch.allclose(torch.tensor(lps), ref, atol=1e-5), (i, lps, ref.tolist())
        assert all(lp <= 0 for lp in lps)
