"""The sharded training engine (``policy.sharding=fsdp``, FSDP2 over gloo on CPU), one process
per rank standing in for a GPU, against the replicated engine on the same rows.

One run per precision serves every check: per-step metrics (the sharded engine with activation
checkpointing) within a stated tolerance of the replicated engine's, each rank holding its share
of the parameters, the warm-up's rates, a checkpoint that reloads bitwise (and on another rank
count, saying so), the refit from shards bit-exact at a generator, and the Hugging Face export
loading in ``transformers`` with the sharded model's logits.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
import _fsdp_procs as F  # noqa: E402
import _refit_procs as P  # noqa: E402

# The sharded run reduce-scatters every micro-batch's float32 gradients where the replicated one
# sums them locally first, so sums round in another order; the forward is the same model.
# Measured on CPU (gloo), largest relative difference of a step's metrics over 3 steps: fp32
# 3.5e-8, bf16 3.8e-5 (the third step's gradient norm); of the float32 master weights after them:
# fp32 7.5e-7, bf16 2.9e-4 (a bf16 gradient rounded differently moves a weight by one update's
# rounding, and the next step's bf16 forward sees that).
TOLERANCE = {"fp32": 1e-6, "bf16": 5e-4}
WEIGHT_TOLERANCE = {"fp32": 1e-5, "bf16": 2e-3}
WORLD = 2


def _ok(res: dict) -> None:
    for r, out in res.items():
        assert not isinstance(out, BaseException), f"rank {r}:\n{P.format_exc(out)}"


@pytest.fixture(scope="module", params=["fp32", "bf16"])
def run(request: pytest.FixtureRequest, pool: P.Pool, tmp_path_factory: pytest.TempPathFactory):
    tmp = tmp_path_factory.mktemp(f"fsdp_{request.param}")
    res = P.run_ranks(
        pool,
        F.train_and_compare,
        list(range(WORLD + 1)),
        limit=240,
        world=WORLD,
        port=P.free_port(),
        refit_port=P.free_port(),
        tmp=str(tmp),
        precision=request.param,
    )
    _ok(res)
    return request.param, tmp, res


def test_sharded_steps_match_the_replicated_engine_within_the_stated_tolerance(run) -> None:
    precision, _, res = run
    tol = TOLERANCE[precision]
    for r in range(WORLD):
        fsdp, none = res[r]["history"]["fsdp"], res[r]["history"]["none"]
        assert len(fsdp) == len(none) == 3
        for a, b in zip(fsdp, none):
            for key in ("loss", "pg_loss", "kl", "entropy", "grad_norm"):
                assert abs(a[key] - b[key]) <= tol * max(1.0, abs(b[key])), (precision, r, key, a[key], b[key])
        assert all(abs(a["loss"]) > 0 and a["grad_norm"] > 0 for a in fsdp), "the steps did learn something"
    assert res[0]["weight_diff"] < WEIGHT_TOLERANCE[precision], res[0]["weight_diff"]


def test_each_rank_holds_its_share_of_the_parameters(run) -> None:
    _, _, res = run
    total = res[0]["params"]
    shares = [res[r]["local_params"] for r in range(WORLD)]
    assert sum(shares) == total and max(shares) < 0.6 * total, shares


def test_the_learning_rate_warms_up_over_the_stated_optimizer_steps(run) -> None:
    _, _, res = run
    for name in ("fsdp", "none"):
        h = res[0]["history"][name]
        assert [x["steps"] for x in h] == [1, 2, 3]
        # lr 0.01 over 2 warm-up steps: the rate of the *next* step after each.
        assert [x["lr"] for x in h] == [0.01, 0.01, 0.01]


def test_a_checkpoint_reloads_bitwise_and_the_same_step_repeats_exactly(run) -> None:
    _, _, res = run
    for r in range(WORLD):
        assert res[r]["resumed_equal"], r
        assert res[r]["note"] is None, "same rank count: nothing to say"


def test_a_checkpoint_loads_on_another_rank_count_and_says_so(run, pool: P.Pool) -> None:
    precision, tmp, res = run
    other = P.run_ranks(
        pool, F.load_elsewhere, [0], limit=120, world=1, port=P.free_port(), tmp=str(tmp), precision=precision
    )
    _ok(other)
    assert F.bitwise_equal(F.unpack(other[0]["weights"]), F.unpack(res[0]["saved"])) == []
    assert other[0]["steps"] == 3, "AdamW's state came back with its step count"
    note = other[0]["note"]
    assert "written by 2 rank(s) and are loaded by 1" in note and "not bitwise" in note, note


def test_the_refit_from_shards_is_bit_exact_at_the_generator(run) -> None:
    precision, _, res = run
    got, want = F.unpack(res[WORLD]["got"]), F.unpack(res[0]["sent"])
    assert res[WORLD]["version"] == 5
    assert {t.dtype for t in got.values()} == {torch.float32 if precision == "fp32" else torch.bfloat16}
    assert F.bitwise_equal(got, want) == []
    assert any(float(t.abs().sum()) > 0 for t in got.values()), "the generator's zeros were overwritten"


def test_the_export_loads_in_transformers_with_the_sharded_models_logits(run) -> None:
    _, _, res = run
    assert [res[r]["wrote"] for r in range(WORLD)] == [True, False], "rank 0 writes, rank 1 only gathers"
    assert res[0]["export_files"] == ["config.json", "generation_config.json", "model.safetensors"]
    assert res[0]["export_diff"] == 0.0
