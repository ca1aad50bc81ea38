"""Model replicas of several ranks: the driver's per-DP-rank calls fanned out over TP groups.

With ``policy.tensor_parallel_size = tp > 1`` the trainer starts ``dp * tp`` policy ranks in
Megatron's order (TP innermost: global rank ``r`` is TP rank ``r % tp`` of DP replica
``r // tp``). The step itself stays in DP terms: it pre-shards for ``dp`` ranks and sums ``dp``
results. :class:`ReplicaDispatch` is the one place that maps between the two: every rank of a
replica gets its replica's input (its ``KVBatchMeta``: the TP leader fetches it and broadcasts,
``WorkerFetcher``'s ``leader_broadcast``), and the driver keeps the leaders' results only (the
other ranks computed the same loss on the same rows; summing them would count each row ``tp``
times).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def replica_of(rank: int, tp: int) -> tuple[int, int]:
    """``(dp_rank, tp_rank)`` of global policy rank ``rank`` (TP innermost, Megatron's order)."""
    if tp < 1 or rank < 0:
        raise ValueError(f"replica_of: rank={rank}, tp={tp}")
    return rank // tp, rank % tp


class ReplicaDispatch:
    """Wraps a per-rank dispatcher (``algorithms.dispatch``) over ``dp * tp`` ranks so that it
    takes and returns one item per DP replica.

    ``call(kind, inputs)`` with ``len(inputs) == dp``: rank ``r`` gets ``inputs[r // tp]``;
    returns the TP leaders' results in DP order. Everything else (``report``, ``close``,
    ``active``, ...) is the wrapped dispatcher's.
    """

    def __init__(self, inner: Any, tp: int) -> None:
        if tp < 1:
            raise ValueError(f"ReplicaDispatch: tp must be >= 1, got {tp}")
        self.inner = inner
        self.tp = tp

    def call(self, kind: str, inputs: Sequence[Any], step: int, flag: bool, timeout_s: float, what: str) -> list[Any]:
        """As the wrapped ``call``, with one input per replica and one result per replica."""
        ranks = [x for x in inputs for _ in range(self.tp)]
        out = self.inner.call(kind, ranks, step, flag, timeout_s, what)
        return list(out[:: self.tp])

    def __getattr__(self, name: str) -> Any:
        # Only reached for attributes this class does not define: report, close, active, name...
        return getattr(self.inner, name)
