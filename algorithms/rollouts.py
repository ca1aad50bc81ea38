"""The rollout schema: the one module that knows how a rollout is named, laid out and tagged.

A *group* is the ``n`` responses to one prompt, drawn by one weight version. Its rows go to the
store's :data:`ROLLOUTS` partition under the keys :func:`rollout_keys` makes
(``v{version}/g{group}/s{sample}``), each row carrying the fields :data:`ROLLOUT_FIELDS` and the
tags :func:`rollout_tags` makes; the trainer claims them as task :data:`TRAINER_TASK`. On the
in-memory baseline the same rows travel as a ``TensorDict``. A training batch of whole groups is a
:class:`RolloutBatch`, whatever carries its rows.

Fields (one row per sample): ``input_ids`` jagged int64 (``<bos>`` + prompt + response),
``prompt_len``, ``seq_len``, ``group_id``, ``weight_version`` int64, ``rewards`` float32,
``gen_logprobs`` jagged float32 of length ``seq_len - 1`` (the sampler's log-prob of token
``t + 1`` at ``t``; 0 over the prompt: the behaviour policy of the off-policy correction),
``token_versions`` jagged int64 aligned the same way (the weight version that drew token
``t + 1``; -1 over the prompt; a partial rollout's tokens carry two or more versions). A row's
``weight_version`` is its oldest token's: what the lag bound counts. The trainer adds
``advantages`` and the per-token ``prev_logprobs`` / ``ref_logprobs``.
"""

from __future__ import annotations

import collections
from collections.abc import Mapping, Sequence, Set
from dataclasses import dataclass, field
from typing import Any

import torch
from tensordict import TensorDict

from algorithms.remote import StepError
from nemo_dataplane.codec import jagged_from_rows, jagged_rows

__all__ = [
    "LEAK_EXIT",
    "ROLLOUTS",
    "ROLLOUT_FIELDS",
    "TRAINER_TASK",
    "ClaimedGroup",
    "GroupAssembler",
    "Job",
    "RolloutBatch",
    "RolloutKey",
    "Sampled",
    "continuation_seed",
    "generation_seed",
    "group_from_tags",
    "keys_outside_groups",
    "leak_exit",
    "parse_rollout_key",
    "rollout_keys",
    "rollout_tags",
    "rows_from_state",
    "rows_state",
    "sample_seed",
]

ROLLOUTS = "rollouts"  # the one partition rollouts live in; keys are released one batch at a time
TRAINER_TASK = "trainer"  # the consumer task name of the trainer's claims
ROLLOUT_FIELDS = (
    "input_ids",
    "prompt_len",
    "seq_len",
    "group_id",
    "weight_version",
    "rewards",
    "gen_logprobs",
    "token_versions",
)


@dataclass(frozen=True)
class Job:
    """One group to generate: ``group_id`` is unique per attempt (it keys the sampling seed),
    ``handout`` is the prompt's position in the prompt stream (a retried prompt keeps its
    handout and gets a new group id), ``record`` the prompt record.

    Deterministic async mode only: ``version`` is the weight version that must draw the group,
    and ``piece`` names the generate call it belongs to (the groups one call draws together are
    fixed by the schedule, not by what a collector found queued)."""

    group_id: int
    handout: int
    record: Any
    version: int | None = None
    piece: int | None = None


def generation_seed(run_seed: int, first_group_id: int) -> int:
    """The sampling seed of one generate call, keyed by the first group it draws: a group's
    samples depend on its id and the weights only, not on when or by whom it was drawn."""
    return run_seed * 1_000_003 + first_group_id


def sample_seed(run_seed: int, group_id: int, sample: int) -> int:
    """The sampling seed of one response (deterministic async mode): a function of the run's
    seed, its group and its index in the group only."""
    return (run_seed * 1_000_003 + group_id) * 1_009 + sample


def continuation_seed(seed: int, segment: int) -> int:
    """The seed of the ``segment``-th continuation of a generate call seeded ``seed`` (partial
    rollouts: the responses a refit interrupted go on under the new weights)."""
    return (seed * 1_000_033 + segment) % (1 << 62)


@dataclass
class Sampled:
    """A generate call's responses once complete: per response its tokens, the behaviour log-prob
    of each and the weight version that drew each (two or more where a refit interrupted it),
    the version of the call's first tokens, and the generator's busy seconds for it all."""

    tokens: list[list[int]]
    logprobs: list[list[float]]
    versions: list[list[int]]
    first_version: int
    busy_s: float


@dataclass(frozen=True)
class RolloutKey:
    """A parsed store key: the weight version that drew the row, its group, its sample index."""

    version: int
    group: int
    sample: int


def rollout_keys(version: int, group_ids: Sequence[int], group_size: int) -> list[str]:
    """Store keys of groups drawn with weight ``version``, group-major (the generator's order)."""
    return [f"v{version}/g{g}/s{i}" for g in group_ids for i in range(group_size)]


def parse_rollout_key(key: str) -> RolloutKey:
    """The inverse of :func:`rollout_keys` for one key.

    Raises:
        ValueError: ``key`` is not ``v{int}/g{int}/s{int}`` (the message quotes it).
    """
    parts = key.split("/")
    try:
        if len(parts) != 3 or parts[0][:1] != "v" or parts[1][:1] != "g" or parts[2][:1] != "s":
            raise ValueError
        return RolloutKey(int(parts[0][1:]), int(parts[1][1:]), int(parts[2][1:]))
    except ValueError:
        raise ValueError(f"{key!r} is not a rollout key (v<version>/g<group>/s<sample>)") from None


def rollout_tags(
    seq_len: Sequence[int],
    prompt_len: Sequence[int],
    jobs: Sequence[Job],
    version: int,
    rewards: Sequence[float],
    group_size: int,
) -> list[dict[str, Any]]:
    """Per-row tags of ``jobs``' groups (group-major): what the driver reads without fetching a
    row (sequence lengths for packing, rewards, the group and its version, the prompt handout)."""
    return [
        {
            "seq_len": int(seq_len[i]),
            "prompt_len": int(prompt_len[i]),
            "group": int(jobs[i // group_size].group_id),
            "weight_version": int(version),
            "reward": float(rewards[i]),
            "handout": int(jobs[i // group_size].handout),
        }
        for i in range(len(seq_len))
    ]


@dataclass
class ClaimedGroup:
    """One whole group as the trainer holds it before training: its id, the version that drew it,
    its rows (a meta of its ``n`` keys, or a ``TensorDict`` of its ``n`` rows), rewards and the
    mean response length."""

    group_id: int
    version: int
    rows: Any
    rewards: list[float]
    response_len: float


def group_from_tags(group_id: int, rows: Any, tags: Sequence[Mapping[str, Any]]) -> ClaimedGroup:
    """A :class:`ClaimedGroup` from its rows and their tags (in sample order)."""
    return ClaimedGroup(
        group_id=int(group_id),
        version=int(tags[0]["weight_version"]),
        rows=rows,
        rewards=[float(t["reward"]) for t in tags],
        response_len=sum(int(t["seq_len"]) - int(t["prompt_len"]) for t in tags) / max(len(tags), 1),
    )


class GroupAssembler:
    """Collects rows by group id until each group has all ``group_size`` rows (claims deliver
    rows in any split)."""

    def __init__(self, group_size: int) -> None:
        self.n = group_size
        self._rows: dict[int, list[tuple[int, Any]]] = collections.defaultdict(list)  # gid -> [(sample, item)]

    def add(self, group_id: int, sample: int, item: Any) -> None:
        """Add one row. Raises :class:`StepError` when a group gets more than ``group_size`` rows."""
        self._rows[group_id].append((sample, item))
        if len(self._rows[group_id]) > self.n:
            raise StepError(f"group {group_id} has more than {self.n} rows: a row was delivered twice")

    def pop_complete(self) -> list[tuple[int, list[Any]]]:
        """Complete groups (oldest id first), each as its items in sample order."""
        done = sorted(g for g, rows in self._rows.items() if len(rows) == self.n)
        return [(g, [it for _, it in sorted(self._rows.pop(g), key=lambda t: t[0])]) for g in done]

    def discard(self, group_id: int) -> list[Any]:
        return [it for _, it in self._rows.pop(group_id, [])]

    def __len__(self) -> int:
        return sum(len(r) for r in self._rows.values())


@dataclass
class RolloutBatch:
    """One training batch: whole groups of ``group_size`` rows, group-major.

    ``handle`` is what the transport moves (a meta of store keys, or the rows themselves);
    ``rewards`` [B] come with it (tags or the collector's reply), never from a store read;
    ``versions`` is the weight version that generated each group, ``group_ids`` its id,
    ``prompts`` its prompt text where the source knows it (named when a value is refused).
    """

    handle: Any
    rewards: torch.Tensor
    group_size: int
    group_ids: list[int]
    versions: list[int]
    response_len: float
    row: dict[str, Any] = field(default_factory=dict)  # metrics the source adds (timings, drops)
    prompts: list[str] = field(default_factory=list)


def keys_outside_groups(stored: Mapping[str, Sequence[str]], groups: Set[int]) -> list[str]:
    """The keys of ``stored`` (partition -> keys) that are not rollout rows of one of ``groups``:
    at a run's exit, what nothing accounts for (a leak)."""
    out = []
    for partition, keys in stored.items():
        for key in keys:
            try:
                ours = partition == ROLLOUTS and parse_rollout_key(key).group in groups
            except ValueError:
                ours = False
            if not ours:
                out.append(key)
    return out


LEAK_EXIT = 3  # the exit status of a run that finished but leaked keys


def leak_exit(status: str, code: int, summary: Mapping[str, Any]) -> tuple[str, int]:
    """The run's (status, exit code) once its leak count is known: a run that finished (0) but
    left keys in the store that no group in flight owns (``keys_leaked_at_exit``, counted before
    the final clear) exits :data:`LEAK_EXIT`; any other exit keeps its code (-1, the store gone
    and nothing counted, is no leak)."""
    leaked = int(summary.get("keys_leaked_at_exit") or 0)
    if code == 0 and leaked > 0:
        return f"finished, but {leaked} key(s) leaked", LEAK_EXIT
    return status, code


def rows_state(rows: Any) -> dict[str, Any]:
    """A group's rows (a ``TensorDict`` of :data:`ROLLOUT_FIELDS`) as plain tensors and lists, for a
    checkpoint (``torch.load(weights_only=True)`` reads it back): jagged fields as per-row tensors."""
    out: dict[str, Any] = {}
    for name in ROLLOUT_FIELDS:
        t = rows[name]
        out[name] = [r.clone() for r in jagged_rows(t)] if getattr(t, "is_nested", False) else t.clone()
    return out


def rows_from_state(state: Mapping[str, Any]) -> TensorDict:
    """The ``TensorDict`` :func:`rows_state` was made from."""
    fields = {k: jagged_from_rows(v) if isinstance(v, list) else v for k, v in state.items()}
    return TensorDict(fields, batch_size=[len(fields["seq_len"])])
