"""Micro-batch planners over sequence lengths: pure functions, no I/O, no collectives.

Every planner takes the batch's per-sample token counts (``seq_lens``, caller order), the DP
world size and a :class:`~nemo_dataplane.config.PackingConfig`, and returns a
:class:`Preshards`: which samples each DP rank gets, how each rank's share is cut into
micro-batches, and the permutation that restores the caller's order.

All three share one shape of algorithm:

1. cut the batch into micro-batches ("bins"), each holding at least one sample;
2. raise the bin count to a multiple of ``dp_world`` by splitting the fullest multi-sample bin
   (splitting never breaks a token budget), so every rank can get the same count;
3. deal the bins to ranks, largest first, to the rank with the fewest tokens among those still
   short of their quota (LPT scheduling with a cardinality constraint): token-balanced ranks,
   equal micro-batch counts.

Modes:

* ``none`` (:func:`plan_none`): ``k = ceil(n / (dp_world * micro_batch_size))`` micro-batches per
  rank, each of at most ``micro_batch_size`` samples (exactly that many when ``n`` divides
  evenly), filled longest-first in snake order so their token sums are close.
* ``sequence`` (:func:`plan_sequence_packing`): first-fit-decreasing bin packing; a micro-batch's
  cost is the *sum* of its samples' lengths (packed, no padding), at most
  ``max_tokens_per_microbatch``.
* ``dynamic`` (:func:`plan_dynamic`): samples sorted by length and cut greedily; a micro-batch's
  cost is its *padded* size ``len(mb) * max(seq_len in mb)``, at most
  ``max_tokens_per_microbatch``.

Over-budget samples: a single sample longer than ``max_tokens_per_microbatch`` gets a micro-batch
of its own (it cannot be split across micro-batches and dropping it would bias training); the
budget therefore holds for every micro-batch of two or more samples. Over-long samples are better
filtered at generation time (``max_new_tokens``) than refused here.

Infeasible plans raise ``ValueError`` naming the counts: fewer samples than ``dp_world``, or a
batch whose budget demands more micro-batches than there are samples once rounded up to a
multiple of ``dp_world`` (empty micro-batches are never emitted: a rank stepping through an
empty micro-batch would still have to join every collective, with nothing to compute).
"""

from __future__ import annotations

import heapq
import numbers
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from nemo_dataplane.config import PackingConfig

__all__ = ["Preshards", "plan", "plan_dynamic", "plan_none", "plan_sequence_packing"]


@dataclass(frozen=True)
class Preshards:
    """The driver's plan for one batch: per-rank samples and per-rank micro-batches.

    Attributes:
        rank_indices: per DP rank, indices into the caller's order, in the rank's local order
            (the rank's micro-batches concatenated).
        microbatches: per rank, per micro-batch, positions *within that rank's shard*.
        microbatch_tokens: per rank, per micro-batch, the sum of its samples' ``seq_len``.
        inverse_permutation: with ``flat = [i for r in rank_indices for i in r]``,
            ``flat[inverse_permutation[j]] == j``: gathering rank-concatenated results at these
            positions restores the caller's order.
        global_forward_pad_seqlen: the longest ``seq_len`` in the batch (one pad length shared by
            every rank, so forward passes agree on shapes across DP).
        dp_world: number of DP ranks.
        mode: the packing mode that produced the plan.
        seq_lens: the per-sample token counts planned over, caller order.

    Invariants (checked on construction): every sample lands on exactly one rank exactly once,
    every micro-batch is non-empty, and every rank has the same number of micro-batches.
    """

    rank_indices: tuple[tuple[int, ...], ...]
    microbatches: tuple[tuple[tuple[int, ...], ...], ...]
    microbatch_tokens: tuple[tuple[int, ...], ...]
    inverse_permutation: tuple[int, ...]
    global_forward_pad_seqlen: int
    dp_world: int
    mode: str
    seq_lens: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if len(self.rank_indices) != self.dp_world or len(self.microbatches) != self.dp_world:
            raise ValueError(
                f"Preshards: {len(self.rank_indices)} rank shards / {len(self.microbatches)} micro-batch "
                f"plans for dp_world={self.dp_world}"
            )
        counts = {len(mbs) for mbs in self.microbatches}
        if len(counts) != 1:
            raise ValueError(
                f"Preshards: micro-batch counts differ across ranks: {[len(m) for m in self.microbatches]}"
            )
        flat = [i for r in self.rank_indices for i in r]
        if sorted(flat) != list(range(len(flat))):
            raise ValueError("Preshards: rank_indices must cover every sample exactly once")
        for r, (idx, mbs) in enumerate(zip(self.rank_indices, self.microbatches)):
            positions = [p for mb in mbs for p in mb]
            if sorted(positions) != list(range(len(idx))) or any(not mb for mb in mbs):
                raise ValueError(f"Preshards: rank {r}'s micro-batches must partition its shard into non-empty parts")

    @property
    def num_samples(self) -> int:
        """Samples in the batch."""
        return len(self.inverse_permutation)

    @property
    def num_microbatches(self) -> int:
        """Micro-batches per rank (equal on every rank)."""
        return len(self.microbatches[0])

    def rank_plan(self, rank: int) -> dict[str, Any]:
        """Rank ``rank``'s share of the plan as a JSON-able dict (rides in ``extra_info["packing"]``).

        Keys: ``mode``, ``dp_rank``, ``dp_world``, ``num_microbatches``, ``microbatches`` (positions
        within the shard), ``microbatch_tokens``, ``sample_indices`` (caller-order indices of the
        shard's rows), ``global_forward_pad_seqlen``.

        Raises:
            IndexError: ``rank`` is not in ``range(dp_world)``.
        """
        if not 0 <= rank < self.dp_world:
            raise IndexError(f"rank {rank} out of range for dp_world={self.dp_world}")
        return {
            "mode": self.mode,
            "dp_rank": rank,
            "dp_world": self.dp_world,
            "num_microbatches": self.num_microbatches,
            "microbatches": [list(mb) for mb in self.microbatches[rank]],
            "microbatch_tokens": list(self.microbatch_tokens[rank]),
            "sample_indices": list(self.rank_indices[rank]),
            "global_forward_pad_seqlen": self.global_forward_pad_seqlen,
        }

    def rank_extra_info(self, rank: int) -> dict[str, Any]:
        """The batch-level entries rank ``rank``'s share carries next to its rows (fan-out meta
        ``extra_info``, legacy shard ``extra_info``): ``packing`` (:meth:`rank_plan`),
        ``global_forward_pad_seqlen``, ``dp_rank`` and ``dp_world``.

        Raises:
            IndexError: ``rank`` is not in ``range(dp_world)``.
        """
        return {
            "packing": self.rank_plan(rank),
            "global_forward_pad_seqlen": self.global_forward_pad_seqlen,
            "dp_rank": rank,
            "dp_world": self.dp_world,
        }

    def restore_order(self, rank_results: Sequence[Sequence[Any]]) -> list[Any]:
        """Per-rank results (each in its rank's local order) back in the caller's order.

        Raises:
            ValueError: a rank's result count differs from its shard size.
        """
        if len(rank_results) != self.dp_world:
            raise ValueError(f"restore_order: got {len(rank_results)} rank results for dp_world={self.dp_world}")
        for r, (res, idx) in enumerate(zip(rank_results, self.rank_indices)):
            if len(res) != len(idx):
                raise ValueError(f"restore_order: rank {r} returned {len(res)} rows, its shard has {len(idx)}")
        flat = [x for res in rank_results for x in res]
        return [flat[p] for p in self.inverse_permutation]


# ------------------------------------------------------------------ entry point
def plan(seq_lens: Sequence[int], dp_world: int, cfg: PackingConfig) -> Preshards:
    """Dispatch to the planner named by ``cfg.mode`` (see the module docstring)."""
    if cfg.mode == "none":
        assert cfg.micro_batch_size is not None  # PackingConfig validates this
        return plan_none(seq_lens, dp_world, cfg.micro_batch_size)
    assert cfg.max_tokens_per_microbatch is not None
    if cfg.mode == "sequence":
        return plan_sequence_packing(seq_lens, dp_world, cfg.max_tokens_per_microbatch)
    if cfg.mode == "dynamic":
        return plan_dynamic(seq_lens, dp_world, cfg.max_tokens_per_microbatch)
    raise ValueError(f"data_plane.packing.mode {cfg.mode!r} is not one of 'none', 'sequence', 'dynamic'")


def plan_none(seq_lens: Sequence[int], dp_world: int, micro_batch_size: int) -> Preshards:
    """Fixed-size micro-batches of at most ``micro_batch_size`` samples, token-balanced across ranks.

    Raises:
        ValueError: bad lengths, ``micro_batch_size < 1``, or too few samples for equal counts
            (e.g. 5 samples, ``dp_world=4``, ``micro_batch_size=1``).
    """
    lens = _check_inputs(seq_lens, dp_world)
    if micro_batch_size < 1:
        raise ValueError(f"data_plane.packing.micro_batch_size must be >= 1, got {micro_batch_size}")
    n = len(lens)
    per_rank = -(-n // (dp_world * micro_batch_size))
    n_bins = per_rank * dp_world
    _check_feasible(n, n_bins, dp_world, f"micro_batch_size={micro_batch_size}")
    # Even sizes (differ by one at most), filled longest-first in snake order so each bin gets a
    # mix of long and short samples.
    base, extra = divmod(n, n_bins)
    caps = [base + (1 if b < extra else 0) for b in range(n_bins)]
    bins: list[list[int]] = [[] for _ in range(n_bins)]
    order = _by_length_desc(lens)
    b, step = 0, 1
    for i in order:
        while len(bins[b]) >= caps[b]:
            b, step = _snake(b, step, n_bins)
        bins[b].append(i)
        b, step = _snake(b, step, n_bins)
    return _assemble(bins, lens, dp_world, "none")


def plan_sequence_packing(seq_lens: Sequence[int], dp_world: int, max_tokens_per_microbatch: int) -> Preshards:
    """First-fit-decreasing packing into micro-batches of at most ``max_tokens_per_microbatch``
    tokens (sum of lengths), micro-batch count a multiple of ``dp_world``.

    Raises:
        ValueError: bad lengths or budget, or too few samples for the needed micro-batch count.
    """
    lens = _check_inputs(seq_lens, dp_world)
    budget = _check_budget(max_tokens_per_microbatch)
    bins: list[list[int]] = []
    room = _RoomTree(len(lens), budget)  # first fit in O(log n) per sample, not O(bins)
    for i in _by_length_desc(lens):
        b = room.leftmost_fit(lens[i])
        if b is None:  # longer than the budget: a micro-batch of its own, closed to others
            b = len(bins)
            room.set(b, -1)  # closed even to zero-length samples
        else:
            room.set(b, room.get(b) - lens[i])
        if b == len(bins):
            bins.append([])
        bins[b].append(i)
    bins = _round_up_bins(bins, lens, dp_world, f"max_tokens_per_microbatch={budget}", padded=False)
    return _assemble(bins, lens, dp_world, "sequence")


def plan_dynamic(seq_lens: Sequence[int], dp_world: int, max_tokens_per_microbatch: int) -> Preshards:
    """Dynamic batching: length-sorted samples cut greedily into micro-batches whose padded size
    ``len(mb) * max(seq_len)`` is at most ``max_tokens_per_microbatch``; count a multiple of
    ``dp_world``.

    Raises:
        ValueError: bad lengths or budget, or too few samples for the needed micro-batch count.
    """
    lens = _check_inputs(seq_lens, dp_world)
    budget = _check_budget(max_tokens_per_microbatch)
    bins: list[list[int]] = []
    current: list[int] = []
    # Descending order: the first sample of a micro-batch is its longest, so the padded cost of
    # adding one more is (len + 1) * first.
    for i in _by_length_desc(lens):
        if current and (len(current) + 1) * lens[current[0]] > budget:
            bins.append(current)
            current = []
        current.append(i)
    if current:
        bins.append(current)
    bins = _round_up_bins(bins, lens, dp_world, f"max_tokens_per_microbatch={budget}", padded=True)
    return _assemble(bins, lens, dp_world, "dynamic")


# ------------------------------------------------------------------ helpers
def _check_inputs(seq_lens: Sequence[int], dp_world: int) -> list[int]:
    if isinstance(dp_world, bool) or not isinstance(dp_world, int) or dp_world < 1:
        raise ValueError(f"dp_world must be an int >= 1, got {dp_world!r}")
    lens: list[int] = []
    for i, s in enumerate(seq_lens):
        if isinstance(s, bool) or not isinstance(s, numbers.Real) or s != s or int(s) != s or s < 0:
            raise ValueError(f"seq_lens[{i}] must be a non-negative int, got {s!r}")
        lens.append(int(s))
    if len(lens) < dp_world:
        raise ValueError(
            f"cannot shard {len(lens)} sample(s) over dp_world={dp_world}: every rank needs at least one "
            "sample (grow the batch or shrink DP)"
        )
    return lens


def _check_budget(budget: int) -> int:
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
        raise ValueError(f"data_plane.packing.max_tokens_per_microbatch must be an int >= 1, got {budget!r}")
    return budget


def _check_feasible(n: int, n_bins: int, dp_world: int, why: str) -> None:
    if n_bins > n:
        raise ValueError(
            f"cannot give every one of dp_world={dp_world} ranks {n_bins // dp_world} non-empty micro-batch(es) "
            f"({n_bins} in all, needed for {why}) from only {n} samples; raise the token budget / "
            "micro_batch_size or grow the batch"
        )


class _RoomTree:
    """Max segment tree over the free tokens of ``n`` bins (unopened bins hold the full budget,
    so the leftmost fitting bin is an open one with room or else the next one to open)."""

    def __init__(self, n: int, budget: int) -> None:
        self.size = 1
        while self.size < max(n, 1):
            self.size *= 2
        self.tree = [0] * (2 * self.size)
        for i in range(n):
            self.tree[self.size + i] = budget
        for node in range(self.size - 1, 0, -1):
            self.tree[node] = max(self.tree[2 * node], self.tree[2 * node + 1])

    def get(self, i: int) -> int:
        return self.tree[self.size + i]

    def set(self, i: int, value: int) -> None:
        node = self.size + i
        self.tree[node] = value
        node //= 2
        while node:
            self.tree[node] = max(self.tree[2 * node], self.tree[2 * node + 1])
            node //= 2

    def leftmost_fit(self, need: int) -> int | None:
        if self.tree[1] < need:
            return None
        node = 1
        while node < self.size:
            node = 2 * node if self.tree[2 * node] >= need else 2 * node + 1
        return node - self.size


def _by_length_desc(lens: list[int]) -> list[int]:
    # Ties broken by index so plans are deterministic.
    return sorted(range(len(lens)), key=lambda i: (-lens[i], i))


def _snake(b: int, step: int, n: int) -> tuple[int, int]:
    if n == 1:
        return 0, 1
    nb = b + step
    if nb == n or nb < 0:
        return b, -step  # bounce: the end bin takes two in a row, as in a snake draft
    return nb, step


def _bin_cost(bin_: list[int], lens: list[int], padded: bool) -> int:
    if padded:
        return len(bin_) * max(lens[i] for i in bin_)
    return sum(lens[i] for i in bin_)


def _round_up_bins(bins: list[list[int]], lens: list[int], dp_world: int, why: str, *, padded: bool) -> list[list[int]]:
    """Split the costliest multi-sample bins until the count is a multiple of ``dp_world``.

    A split halves a bin (by alternating its length-sorted samples, so both halves keep a
    similar cost); costs never grow, so budgets keep holding.
    """
    target = -(-len(bins) // dp_world) * dp_world
    _check_feasible(len(lens), target, dp_world, why)
    # Max-heap on (cost, size) over bins that can still be split.
    heap = [(-_bin_cost(b, lens, padded), -len(b), k) for k, b in enumerate(bins) if len(b) > 1]
    heapq.heapify(heap)
    while len(bins) < target:
        _, _, k = heapq.heappop(heap)  # feasibility guarantees a splittable bin exists
        members = sorted(bins[k], key=lambda i: (-lens[i], i))
        first, second = members[0::2], members[1::2]
        bins[k] = first
        bins.append(second)
        for j in (k, len(bins) - 1):
            if len(bins[j]) > 1:
                heapq.heappush(heap, (-_bin_cost(bins[j], lens, padded), -len(bins[j]), j))
    return bins


def _assemble(bins: list[list[int]], lens: list[int], dp_world: int, mode: str) -> Preshards:
    """Deal bins to ranks (LPT with equal counts) and build the :class:`Preshards`."""
    per_rank = len(bins) // dp_world
    tokens = [sum(lens[i] for i in b) for b in bins]
    rank_bins: list[list[int]] = [[] for _ in range(dp_world)]
    rank_load = [0] * dp_world
    # Heaviest first; ties by first sample index for determinism.
    for k in sorted(range(len(bins)), key=lambda k: (-tokens[k], -len(bins[k]), min(bins[k]))):
        r = min((r for r in range(dp_world) if len(rank_bins[r]) < per_rank), key=lambda r: (rank_load[r], r))
        rank_bins[r].append(k)
        rank_load[r] += tokens[k]
    rank_indices: list[tuple[int, ...]] = []
    microbatches: list[tuple[tuple[int, ...], ...]] = []
    mb_tokens: list[tuple[int, ...]] = []
    for r in range(dp_world):
        order: list[int] = []
        mbs: list[tuple[int, ...]] = []
        for k in rank_bins[r]:
            members = sorted(bins[k])  # caller order inside a micro-batch
            mbs.append(tuple(range(len(order), len(order) + len(members))))
            order.extend(members)
        rank_indices.append(tuple(order))
        microbatches.append(tuple(mbs))
        mb_tokens.append(tuple(tokens[k] for k in rank_bins[r]))
    flat = [i for r in rank_indices for i in r]
    inverse = [0] * len(flat)
    for pos, i in enumerate(flat):
        inverse[i] = pos
    return Preshards(
        rank_indices=tuple(rank_indices),
        microbatches=tuple(microbatches),
        microbatch_tokens=tuple(mb_tokens),
        inverse_permutation=tuple(inverse),
        global_forward_pad_seqlen=max(lens),
        dp_world=dp_world,
        mode=mode,
        seq_lens=tuple(lens),
    )
