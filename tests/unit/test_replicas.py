"""``algorithms.replicas``: DP-level calls fanned out over TP groups, leaders' results kept.

The wrapped dispatcher here records what each rank was given and answers with the rank and its
input; it stands in for ``algorithms.dispatch`` (whose Ray paths have their own tests) so that
only the mapping is under test.
"""

from __future__ import annotations

from typing import Any

import pytest

from algorithms.replicas import ReplicaDispatch, replica_of


class _Recorder:
    name = "recorder"

    def __init__(self) -> None:
        self.seen: list[list[Any]] = []
        self.closed = False

    def call(self, kind: str, inputs: list[Any], step: int, flag: bool, timeout_s: float, what: str) -> list[Any]:
        self.seen.append(list(inputs))
        return [{"rank": r, "input": x, "kind": kind} for r, x in enumerate(inputs)]

    def report(self) -> dict[str, Any]:
        return {"mode": self.name}

    def close(self, timeout_s: float = 10.0) -> None:
        self.closed = True


@pytest.mark.parametrize(("dp", "tp"), [(1, 1), (1, 2), (2, 2), (3, 4)])
def test_each_rank_gets_its_replicas_input_and_leaders_answer(dp: int, tp: int) -> None:
    inner = _Recorder()
    d = ReplicaDispatch(inner, tp)
    metas = [f"meta{i}" for i in range(dp)]
    out = d.call("train", metas, 3, False, 10.0, "step 3 train")
    assert inner.seen == [[metas[r // tp] for r in range(dp * tp)]]
    assert [o["rank"] for o in out] == [i * tp for i in range(dp)]  # the TP leaders, in DP order
    assert [o["input"] for o in out] == metas
    # everything else is the wrapped dispatcher's
    assert d.report() == {"mode": "recorder"} and d.name == "recorder"
    d.close()
    assert inner.closed


def test_replica_of_is_megatrons_order() -> None:
    assert [replica_of(r, 2) for r in range(4)] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert [replica_of(r, 1) for r in range(3)] == [(0, 0), (1, 0), (2, 0)]
    with pytest.raises(ValueError, match="tp=0"):
        replica_of(0, 0)
    with pytest.raises(ValueError, match="tp must be >= 1"):
        ReplicaDispatch(_Recorder(), 0)
