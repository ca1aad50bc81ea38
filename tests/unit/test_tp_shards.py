"""A tensor-parallel generator's refit (``algorithms/engines/generation/tp_shards.py``): every TP
rank receives only its shards, straight into parameters shaped and fused as vLLM holds them, from
a trainer that sends whole weights over gloo; and the errors that name a parameter the two sides
do not agree on."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
import _refit_procs as P  # noqa: E402
import _tp_procs as T  # noqa: E402

from algorithms.engines.generation.tp_shards import shard_targets  # noqa: E402


@pytest.fixture(scope="module")
def pool():  # type: ignore[no-untyped-def]
    ex = P.Pool(preload=("_tp_procs",))  # transformers imported once, not in every rank
    yield ex
    ex.kill()


@pytest.mark.parametrize("vocab", [34, 256], ids=["padded-vocab", "even-vocab"])
def test_two_engines_of_tp2_each_receive_their_shards_in_place(pool: P.Pool, vocab: int) -> None:
    """Two engines of TP=2 (one fp32, whose parameters receive in place; one bf16, through
    staging): every TP rank ends with exactly vLLM's shards of the sent weights, its vocabulary
    padding untouched. A vocabulary whose padded split differs from an even one (34 ids: 32
    rows per rank) is received whole and cut; an even one (256) is sharded like the rest."""
    tp, engines = 2, 2
    world = 1 + engines * tp
    res = P.run_ranks(
        pool,
        T.tp_refit,
        list(range(world)),
        world=world,
        port=P.free_port(),
        tp=tp,
        vocab=vocab,
        dtypes=["float32", "bfloat16"],
        limit=150,
    )
    for r, out in res.items():
        assert not isinstance(out, BaseException), f"rank {r}: {out!r}"
    sent = res[0]["sent"]
    vocab_names = ["model.embed_tokens.weight", "lm_head.weight"]
    for r in range(1, world):
        out = res[r]
        assert out["version"] == 5 and out["wrong"] == [], (r, out)
        assert out["whole"] == (vocab_names if vocab == 34 else []), (r, out["whole"])
        if vocab == 256:
            # Only this rank's half of every split tensor arrives (norms are whole: they are tiny).
            assert out["received"] < 0.6 * sent, (r, out["received"], sent)
        engine = (r - 1) // tp
        if engine == 0:  # fp32 parameters receive in place, except a vocabulary received whole
            assert out["staged"] == (2 if vocab == 34 else 0), (r, out["staged"])
        else:  # bf16 parameters from an fp32 trainer: every tensor goes through staging
            assert out["staged"] == len(T.vllm_shards({n: p for n, p in T.model(vocab).named_parameters()}, tp, 0))


def _specs(m: torch.nn.Module) -> list[tuple[str, list[int], str]]:
    return [(n, list(p.shape), str(p.dtype).removeprefix("torch.")) for n, p in m.named_parameters()]


def test_a_parameter_the_engine_lacks_or_shapes_otherwise_is_named() -> None:
    m = T.model(256)
    full = {n: p.detach() for n, p in m.named_parameters()}
    params = T.vllm_shards(full, 2, 1)
    params.pop("model.norm.weight")
    params["model.layers.1.mlp.down_proj.weight"] = torch.zeros(64, 96)  # whole, not its half
    params["model.layers.0.extra.weight"] = torch.zeros(3)
    with pytest.raises(RuntimeError) as e:
        shard_targets(
            _specs(m), params, senders=1, world_size=3, first_rank=1, tp_rank=1, tp=2, device=torch.device("cpu")
        )
    msg = str(e.value)
    assert "TP rank 1 (group rank 2)" in msg
    assert "model.norm.weight: the trainer sends it, the engine has no such parameter" in msg
    assert "model.layers.1.mlp.down_proj.weight: this rank's shard is [64, 48], the engine's parameter [64, 96]" in msg
    assert "model.layers.0.extra.weight: the engine's parameter receives nothing" in msg


def test_receivers_that_do_not_split_into_engines_are_refused() -> None:
    m = T.model(256)
    params = T.vllm_shards({n: p.detach() for n, p in m.named_parameters()}, 2, 0)
    with pytest.raises(RuntimeError, match="3 receiver ranks do not split into engines of 2"):
        shard_targets(
            _specs(m), params, senders=1, world_size=4, first_rank=1, tp_rank=0, tp=2, device=torch.device("cpu")
        )
