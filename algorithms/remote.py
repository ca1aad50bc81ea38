"""Ray plumbing the trainer modules share: bounded gathers of worker calls, and the step's error."""

from __future__ import annotations

import re
import time
from collections.abc import Sequence
from typing import Any

import ray

from nemo_dataplane.errors import NemoDataplaneError
from nemo_dataplane.timeouts import check_timeout

__all__ = ["LOST_PEER_GRACE_S", "StepError", "WorkerTraceback", "gather", "may_be_a_lost_peer", "worker_error"]

# What a survivor of a collective says when a peer's process is gone (gloo's socket errors, NCCL's
# remote errors, the stateless groups' own), by type name or wording.
_LOST_PEER_TYPES = ("DistBackendError", "DistNetworkError", "StatelessGroupError")  # not its Timeout subclass
_LOST_PEER_WORDS = re.compile(
    r"connection (reset|closed|refused) by peer|broken pipe|read error|socket closed|"
    r"remote (process|peer|end)|peer (died|closed|exited|is gone)",
    re.IGNORECASE,
)
LOST_PEER_GRACE_S = 5.0  # how long gather looks for a dead worker behind such an error


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


def may_be_a_lost_peer(error: BaseException) -> bool:
    """Whether a worker's error may only be the echo of another worker's death: a collective that
    lost a peer (gloo's "Read error ...: Connection reset by peer", a stateless group's failure)."""
    chain: BaseException | None = error
    while chain is not None:
        if type(chain).__name__ in _LOST_PEER_TYPES or _LOST_PEER_WORDS.search(str(chain)):
            return True
        chain = chain.__cause__
    return False


def _dead_among(pending: list[Any], seconds: float) -> tuple[Any, BaseException] | None:
    """The first of ``pending`` whose worker is found dead (Ray's notice of a SIGKILLed process can
    come after its peers' errors) within ``seconds``; None when none is."""
    deadline = time.monotonic() + seconds
    while pending:
        left = deadline - time.monotonic()
        if left <= 0:
            return None
        ready, pending = ray.wait(pending, num_returns=1, timeout=left)
        for r in ready:
            try:
                ray.get(r)
            except ray.exceptions.RayTaskError:
                continue  # another survivor's own error
            except ray.exceptions.RayError as e:
                return r, e
    return None


def gather(
    refs: Sequence[ray.ObjectRef], timeout_s: float, what: str, who: str | Sequence[str] = "worker"
) -> list[Any]:
    """``ray.get`` of ``refs`` that raises the *first* worker error as soon as it arrives (a rank
    that failed would otherwise leave its peers blocked in a collective until they time out).
    A worker that died (no error of its own) is named as ``{who} {its index in refs}``, or
    ``who[index]`` when ``who`` is a list of names, one per ref. A first error that may be a
    collective's echo of a dead peer (:func:`may_be_a_lost_peer`) is raised only after the other
    calls were given up to :data:`LOST_PEER_GRACE_S` to show a worker that died: that one is named.

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
                # A collective that lost a peer: name the worker that died, not the survivor's echo.
                found = None
                if pending and may_be_a_lost_peer(cause):
                    found = _dead_among(list(pending), min(LOST_PEER_GRACE_S, deadline - time.monotonic()))
                if found is None:
                    raise StepError(f"{what}: {type(cause).__name__}: {cause}") from cause
                dead, death = found
                echo = f"{_name(who, index[r])} then failed with {type(cause).__name__}: {cause}"
                raise StepError(
                    f"{what}: {_name(who, index[dead])} died or was lost: {type(death).__name__}: {death} ({echo})"
                ) from death
            except ray.exceptions.RayError as e:
                raise StepError(f"{what}: {_name(who, index[r])} died or was lost: {type(e).__name__}: {e}") from e
    return results


def settle(refs: Sequence[ray.ObjectRef], timeout_s: float, what: str, who: Sequence[str]) -> list[Any]:
    """Wait for every one of ``refs`` (bounded by ``timeout_s`` in all); each one's value, or for
    a call that failed the :class:`StepError` :func:`gather` would have raised for it (its cause
    the worker's error), so the caller decides which failures it can survive.

    Raises:
        StepError: ``timeout_s`` passed with calls unfinished (named).
    """
    timeout_s = check_timeout(timeout_s, "timeout_s")
    done, pending = ray.wait(list(refs), num_returns=len(refs), timeout=timeout_s)
    if pending:
        late = [who[i] for i, r in enumerate(refs) if r in set(pending)]
        raise StepError(f"{what}: {', '.join(late)} did not finish within {timeout_s}s")
    out: list[Any] = []
    for i, r in enumerate(refs):
        try:
            out.append(ray.get(r))
        except ray.exceptions.RayTaskError as e:
            cause = worker_error(e)
            out.append(_failed(f"{what}: {type(cause).__name__}: {cause}", cause))
        except ray.exceptions.RayError as e:
            out.append(_failed(f"{what}: {who[i]} died or was lost: {type(e).__name__}: {e}", e))
    return out


def _failed(message: str, cause: BaseException) -> StepError:
    err = StepError(message)
    err.__cause__ = cause
    return err


def _name(who: str | Sequence[str], i: int) -> str:
    return f"{who} {i}" if isinstance(who, str) else who[i]
