"""Resharding refit over a gloo StatelessProcessGroup, one process per rank standing in for a GPU.

Each case refits twice with different values; every receiver compares the bit patterns of its
tensors with the unsharded weights sharded by hand (``_refit_procs.hand_shards``: torch.chunk
and vLLM-style fused qkv / gate_up, independent of the layout code) and reports the bytes it
received, counted at each recv.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
import _refit_procs as P  # noqa: E402
import _reshard_procs as R  # noqa: E402


def _ok(res: dict) -> None:
    for r, out in res.items():
        assert not isinstance(out, BaseException), f"rank {r}:\n{P.format_exc(out)}"


CPU_CASES = ["tp2->tp1", "tp1->tp2", "dp2tp2->tp2", "pp2->pp1", "ep2->ep1", "fsdp2->tp2"]


@pytest.mark.parametrize("case", CPU_CASES)
def test_reshard_is_bit_exact_and_moves_only_owned_bytes(pool: P.Pool, case: str) -> None:
    src, dst = R.reshard_layouts(case)
    world = len(src.mesh.ranks) + len(dst.mesh.ranks)
    res = P.run_ranks(pool, R.reshard_roundtrip, list(range(world)), world=world, port=P.free_port(), case=case)
    _ok(res)
    R.check_reshard(res, case)


def test_phase_timings_are_opt_in_and_mark_each_phase_in_order(pool: P.Pool) -> None:
    off = P.run_ranks(pool, R.reshard_roundtrip, [0, 1, 2], world=3, port=P.free_port(), case="tp2->tp1")
    _ok(off)
    assert all(out["timings"] is None for out in off.values())
    on = P.run_ranks(pool, R.reshard_roundtrip, [0, 1, 2], world=3, port=P.free_port(), case="tp2->tp1", timings=True)
    _ok(on)
    R.check_reshard(on, "tp2->tp1")
    p2p = ["check", "header", "exchange"]
    R.check_timings(on, {"send": p2p, "recv": p2p}, refits=2)


def test_missing_mapping_fails_at_prepare_naming_the_parameter(pool: P.Pool) -> None:
    res = P.run_ranks(pool, R.reshard_failures, [0, 1, 2], world=3, port=P.free_port(), what="missing")
    _ok(res)
    for r in (0, 1, 2):
        err = res[r]["prepare"]
        assert err is not None and err["error"] == "RefitMismatchError", res[r]
        assert "model.layers.1.self_attn.q_norm.weight: receiver parameter that no sender layout has" in err["msg"]
        assert "ranks 0, 1, 2:" in err["msg"]  # the same plan error, computed on every rank


def test_sender_abort_stops_every_rank_before_bulk_and_group_stays_usable(pool: P.Pool) -> None:
    res = P.run_ranks(pool, R.reshard_failures, [0, 1, 2], world=3, port=P.free_port(), what="abort")
    _ok(res)
    assert res[1]["abort"]["error"] == "RefitMismatchError"
    want = "model.norm.weight: the layout gives this rank [16] float32, the tensor is [17] float32"
    assert want in res[1]["abort"]["msg"]
    for r in (0, 2):
        assert res[r]["abort"]["error"] == "RefitError", res[r]
        assert "refit of version 3 aborted by another rank: rank 1:" in res[r]["abort"]["msg"]
    assert res[2]["untouched"], "no bulk data may move in an aborted refit"
    assert res[2]["next_version"] == 4 and res[2]["wrong"] == []
