"""HF Llama <-> Megatron-core GPT converter, packed micro-batches and the TP=2 -> TP=1 export.

CPU only, no megatron-core needed (it requires Python >= 3.12 and triton; the tests that run
MCore itself are in ``test_megatron_gpu.py``). The interleave is checked against an
independent per-head loop; the packed log-probs against ``sequence_logprobs`` on the padded
batch through the HF model with a 4-D block mask; the export through the real resharding refit.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
import _megatron_procs as MP  # noqa: E402
import _refit_procs as P  # noqa: E402

from algorithms.engines.training.mcore_convert import (  # noqa: E402
    hf_to_mcore,
    mcore_shard_to_hf,
    mcore_to_hf,
    shape_from_hf_config,
    transformer_kwargs,
)
from algorithms.engines.training.packing import (  # noqa: E402
    block_causal_mask,
    packed_from_jagged,
    packed_logprobs,
    unpack_to_padded,
)


def _qkv_by_loop(q, k, v, heads, groups, d, tp, r):
    """Rank r's qkv rows built head by head (independent of the reshape code)."""
    rows = []
    per = heads // groups
    for g in range(r * groups // tp, (r + 1) * groups // tp):
        for h in range(g * per, (g + 1) * per):
            rows.append(q[h * d : (h + 1) * d])
        rows.append(k[g * d : (g + 1) * d])
        rows.append(v[g * d : (g + 1) * d])
    return torch.cat(rows)


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("kv", [1, 2, 4])
def test_hf_to_mcore_layout_matches_per_head_loop_and_round_trips(tp: int, kv: int) -> None:
    if kv % tp:
        pytest.skip("kv heads not divisible by tp")
    hf = MP.tiny_hf(3, num_key_value_heads=kv)
    sd = hf.state_dict()
    s = shape_from_hf_config(hf.config)
    shards = [hf_to_mcore(sd, s, tp=tp, rank=r) for r in range(tp)]
    for r, mc in enumerate(shards):
        for i in range(s.num_layers):
            h = f"model.layers.{i}.self_attn."
            want = _qkv_by_loop(
                sd[h + "q_proj.weight"],
                sd[h + "k_proj.weight"],
                sd[h + "v_proj.weight"],
                s.heads,
                s.groups,
                s.head_dim,
                tp,
                r,
            )
            assert torch.equal(mc[f"decoder.layers.{i}.self_attention.linear_qkv.weight"], want)
            gate, up = sd[f"model.layers.{i}.mlp.gate_proj.weight"], sd[f"model.layers.{i}.mlp.up_proj.weight"]
            f = s.ffn // tp
            fc1 = mc[f"decoder.layers.{i}.mlp.linear_fc1.weight"]
            assert torch.equal(fc1[:f], gate[r * f : (r + 1) * f]) and torch.equal(fc1[f:], up[r * f : (r + 1) * f])
            o = sd[f"model.layers.{i}.self_attn.o_proj.weight"]
            assert torch.equal(
                mc[f"decoder.layers.{i}.self_attention.linear_proj.weight"],
                o[:, r * s.hidden // tp : (r + 1) * s.hidden // tp],
            )
        assert mc["embedding.word_embeddings.weight"].shape == (s.vocab // tp, s.hidden)
    back = mcore_to_hf(shards, s)
    assert set(back) == set(sd)
    for k, v in sd.items():
        assert torch.equal(back[k], v), k


def test_te_names_and_bad_inputs() -> None:
    hf = MP.tiny_hf(0)
    s = shape_from_hf_config(hf.config)
    te = hf_to_mcore(hf.state_dict(), s, te=True)
    assert "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight" in te
    assert "decoder.layers.0.mlp.linear_fc1.layer_norm_weight" in te
    assert not any("input_layernorm" in k for k in te)
    assert all(
        torch.equal(a, b)
        for a, b in zip(
            mcore_to_hf([te], s, te=True).values(), [hf.state_dict()[k] for k in mcore_to_hf([te], s, te=True)]
        )
    )
    with pytest.raises(ValueError, match="tensor_parallel_size=4 does not divide num_key_value_heads=2"):
        hf_to_mcore(hf.state_dict(), s, tp=4)
    sd = dict(hf.state_dict())
    del sd["model.layers.1.mlp.up_proj.weight"]
    with pytest.raises(KeyError, match="model.layers.1.mlp.up_proj.weight"):
        hf_to_mcore(sd, s)
    with pytest.raises(KeyError, match="decoder.layers.0.mystery.weight"):
        mcore_shard_to_hf({"decoder.layers.0.mystery.weight": torch.zeros(1)}, s)
    tc, gpt = transformer_kwargs(hf.config, tp=2)
    assert (tc["num_query_groups"], tc["kv_channels"], tc["ffn_hidden_size"]) == (2, 16, 128)
    assert gpt["share_embeddings_and_output_weights"] is False and gpt["vocab_size"] == 34


def test_export_views_alias_the_fused_parameters() -> None:
    """What the refit reads are views of the live fused tensors: an in-place update shows."""
    hf = MP.tiny_hf(0)
    s = shape_from_hf_config(hf.config)
    mc = hf_to_mcore(hf.state_dict(), s, tp=2, rank=1)
    out = mcore_shard_to_hf(mc, s, tp=2)
    mc["decoder.layers.0.mlp.linear_fc1.weight"].add_(1.0)
    mc["decoder.layers.0.self_attention.linear_qkv.weight"].add_(1.0)
    up = hf.state_dict()["model.layers.0.mlp.up_proj.weight"][64:]
    assert torch.equal(out["model.layers.0.mlp.up_proj.weight"], up + 1.0)
    k = hf.state_dict()["model.layers.0.self_attn.k_proj.weight"][16:]
    assert torch.equal(out["model.layers.0.self_attn.k_proj.weight"], k + 1.0)


def test_packed_logprobs_equal_padded_sequence_logprobs() -> None:
    """The packed path (cu_seqlens from the jagged fetch, block-causal mask, per-sequence
    positions) scores every token as the padded batch does (fp32, atol 1e-5)."""
    from algorithms.models import pad_batch, sequence_logprobs

    hf = MP.tiny_hf(0).eval()
    g = torch.Generator().manual_seed(0)
    rows = [torch.randint(3, 34, (n,), generator=g) for n in (9, 5, 12, 7)]
    prompt_len = torch.tensor([4, 2, 6, 3])
    jag = torch.nested.nested_tensor(rows, layout=torch.jagged)
    tokens, cu = packed_from_jagged(jag)
    assert cu.tolist() == [0, 9, 14, 26, 33] and torch.equal(tokens[0], torch.cat(rows))
    T = tokens.shape[1]
    mask = block_causal_mask(cu)
    assert not mask[0, 0, 10, 9] and mask[0, 0, 9, 8] and mask[0, 0, 9, 10]  # own sequence, causal
    starts = torch.repeat_interleave(cu[:-1].long(), (cu[1:] - cu[:-1]).long())
    pos = (torch.arange(T) - starts).reshape(1, T)
    with torch.no_grad():
        add = torch.zeros(1, 1, T, T).masked_fill(mask, float("-inf"))
        logits = hf(input_ids=tokens, attention_mask=add, position_ids=pos).logits[0]
        lp, ent = packed_logprobs(logits, tokens[0], cu, temperature=0.7, return_entropy=True)
        ids, attn = pad_batch(rows, 0)
        resp = (torch.arange(ids.shape[1])[None] >= prompt_len[:, None]) & attn.bool()
        want = sequence_logprobs(hf, ids, attn, resp, temperature=0.7)
    got = unpack_to_padded(lp, cu, ids.shape[1] - 1) * (resp[:, 1:] & attn[:, 1:].bool())
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    assert float(got.abs().sum()) > 1.0
    with pytest.raises(ValueError, match="jagged"):
        packed_from_jagged(torch.zeros(2, 3))


def test_tp2_megatron_export_refits_a_tp1_generator_exactly(pool: P.Pool) -> None:
    res = P.run_ranks(pool, MP.refit_tp2_to_tp1, [0, 1, 2], world=3, port=P.free_port(), limit=240)
    for r, out in res.items():
        assert not isinstance(out, BaseException), f"rank {r}:\n{P.format_exc(out)}"
    assert res[2]["wrong"] == [[], []] and res[2]["names"] == 21
    # each trainer rank moves exactly what it owns: its half of the sharded weights
    for r in (0, 1):
        assert res[r]["sent"] == [res[r]["owned"]] * 2 and res[r]["owned"] > 0
