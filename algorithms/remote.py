"""Ray plumbing the trainer modules share: bounded gathers of worker calls, and the step's error."""

from __future__ import annotations

import re
import time
from collections.abc import Sequence
from typing import Any

import ray

from nemo_dataplane.errors import NemoDataplaneError
from nemo_dataplane.timeouts import check_timeout

__all__ = ["StepError", "WorkerTraceback", "gather", "worker_error"]


class StepError(NemoDataplaneError, RuntimeError):
    """A step failed; the message names the step, the phase and the worker's own error."""


_ANSI = re.compile(r"\x1b\[[0-9;]*m")


class WorkerTraceback(Exception):
    """Where a worker's exception was raised: the worker's own traceback, as text (Ray sends the
    exception without its traceback object)."""

    def __str__(self) -> str:
        return f'\n"""\n{self.args[0].rstrip()}\n"""'


def worker_error(e: ray.exceptions.RayTaskError) -> BaseException:
    """The worker's own exception inside ``e``, chained to a :class:`WorkerTraceback` of where it
    was raised, so that a printed traceback of an error raised ``from`` it starts in the worker."""
    cause = getattr(e, "cause", None) or e
    # Ray's text of the worker's traceback (its frames, without Ray's own), headed by the worker's
    # process title and pid; colour codes dropped, and the caret lines (those of Ray's hidden
    # frames would stand alone).
    text = "\n".join(line for line in _ANSI.sub("", str(e)).splitlines() if line.strip(" ^") or not line.strip())
    if cause is not e and text and cause.__cause__ is None and cause.__traceback__ is None:
        cause.__cause__ = WorkerTraceback(text)
    return cause


def gather(
    refs: Sequence[ray.ObjectRef], timeout_s: float, what: str, who: str | Sequence[str] = "worker"
) -> list[Any]:
    """``ray.get`` of ``refs`` that raises the *first* worker error as soon as it arrives (a rank
    that failed would otherwise leave its peers blocked in a collective until they time out).
    A worker that died (no error of its own) is named as ``{who} {its index in refs}``, or
    ``who[index]`` when ``who`` is a list of names, one per ref.

    Raises:
        StepError: a worker raised (its error is the cause and is quoted) or ``timeout_s`` passed.
        ValueError: ``timeout_s`` is negative, NaN or infinite.
    """
    timeout_s = check_timeout(timeout_s, "timeout_s")  # a NaN deadline is never reached
    pending = list(refs)
    index = {r: i for i, r in enumerate(refs)}
    results: list[Any] = [None] * len(refs)
    deadline = time.monotonic() + timeout_s
    while pending:
        left = deadline - time.monotonic()
        if left <= 0:
            raise StepError(f"{what}: {len(pending)} of {len(refs)} worker call(s) did not finish within {timeout_s}s")
        ready, pending = ray.wait(pending, num_returns=1, timeout=left)
        for r in ready:
            try:
                results[index[r]] = ray.get(r)
            except ray.exceptions.RayTaskError as e:
                cause = worker_error(e)
                raise StepError(f"{what}: {type(cause).__name__}: {cause}") from cause
            except ray.exceptions.RayError as e:
                name = f"{who} {index[r]}" if isinstance(who, str) else who[index[r]]
                raise StepError(f"{what}: {name} died or was lost: {type(e).__name__}: {e}") from e
    return results
