"""The rows a partial-rollout collector keeps between generate calls (``async.partial_rollout``).

Every response is a :class:`Row`: its group's job, its sample index, its prompt, its limit, and
the tokens, behaviour log-probs and weight versions drawn so far. A generate call draws every row
in the pool one more stretch (the engine stops it at a refit, or once too few rows are left
running, so finished rows free their places for new prompts); finished rows wait for the rest of
their group; a group is complete once all ``n`` rows are. Pure bookkeeping: no Ray, no torch.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from algorithms.rollouts import Job, Sampled

__all__ = ["Row", "RowPool"]


@dataclass
class Row:
    """One response in progress."""

    job: Job
    sample: int
    prompt: list[int]
    limit: int
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)

    @property
    def prefix(self) -> list[int]:
        """What the next stretch is drawn from: the prompt and the tokens so far."""
        return self.prompt + self.tokens

    @property
    def left(self) -> int:
        return self.limit - len(self.tokens)


class RowPool:
    """Rows of the groups a collector has started and not delivered, ``n`` per group."""

    def __init__(self, group_size: int) -> None:
        self.n = group_size
        self.running: list[Row] = []
        self._done: dict[int, dict[int, Row]] = {}  # group id -> sample -> finished row
        self._jobs: dict[int, Job] = {}

    def start(self, jobs: Iterable[Job], prompts: Sequence[Sequence[int]], limits: Sequence[int]) -> None:
        """Add ``n`` rows for each new job (its prompt's token ids, its response limit)."""
        for job, prompt, limit in zip(jobs, prompts, limits):
            self._jobs[job.group_id] = job
            self.running += [Row(job, s, list(prompt), int(limit)) for s in range(self.n)]

    def groups(self) -> int:
        """Groups started and not yet complete."""
        return len(self._jobs)

    def absorb(
        self,
        rows: Sequence[Row],
        tokens: Sequence[Sequence[int]],
        logprobs: Sequence[Sequence[float]],
        finished: Sequence[bool],
        version: int,
    ) -> list[tuple[Job, list[Row]]]:
        """Add one generate call's stretch (drawn by ``version``) to ``rows`` (the pool's running
        rows, in the order they were drawn); returns the groups now complete (oldest id first),
        each with its rows in sample order, and forgets them."""
        if len(rows) != len(tokens):
            raise ValueError(f"RowPool.absorb: {len(tokens)} responses for {len(rows)} rows")
        still = []
        for row, t, lp, done in zip(rows, tokens, logprobs, finished):
            row.tokens += list(t)
            row.logprobs += list(lp)
            row.versions += [version] * len(t)
            if done or row.left <= 0:
                self._done.setdefault(row.job.group_id, {})[row.sample] = row
            else:
                still.append(row)
        self.running = still
        complete = sorted(g for g, got in self._done.items() if len(got) == self.n)
        out = []
        for g in complete:
            got = self._done.pop(g)
            out.append((self._jobs.pop(g), [got[s] for s in range(self.n)]))
        return out

    def drop(self) -> list[int]:
        """Forget every group in progress (a failed call); returns their ids."""
        lost = sorted(self._jobs)
        self.running, self._done, self._jobs = [], {}, {}
        return lost


def batches_by_version(done: Sequence[tuple[Job, list[Row]]]) -> list[tuple[list[Job], list[list[int]], Sampled]]:
    """Complete groups, batched by their oldest token's version (one put each: a put's keys
    carry one version): their jobs, prompts and rows (group-major)."""
    by: dict[int, list[tuple[Job, list[Row]]]] = {}
    for job, rows in done:
        by.setdefault(min(v for r in rows for v in (r.versions or [-1])), []).append((job, rows))
    out = []
    for version, groups in sorted(by.items()):
        rows = [r for _, rs in groups for r in rs]
        out.append(
            (
                [j for j, _ in groups],
                [rs[0].prompt for _, rs in groups],
                Sampled([r.tokens for r in rows], [r.logprobs for r in rows], [r.versions for r in rows], version, 0.0),
            )
        )
    return out
