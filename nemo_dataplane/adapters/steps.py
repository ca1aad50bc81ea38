"""Op bodies written once, run by a synchronous or an asynchronous caller.

A body is a generator that yields what it waits on and is sent the result (an error of the wait
is thrown in at its ``yield``):

* a Ray ``ObjectRef``, or a list of them: its value (the list of values);
* :class:`Blocking`: ``fn()``, work that blocks the calling thread (a ``ray.put``, a copy);
* any other awaitable (an asyncio client's call): its result, on the client's event loop.

:func:`drive` runs a body on an event loop (every step awaited there; blocking work on a
thread). A synchronous caller runs it in its own thread with a :class:`SyncDriver`: refs are
``ray.get`` there and blocking work is called there, so an op that only waits on Ray never
hops through the loop's thread (one hop costs about a millisecond on a loaded host); only
awaitables are handed to the loop. The bounds (timeouts, the store's liveness) belong to the
driver; a body holds none of them.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Generator
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import ray

from nemo_dataplane.errors import NemoDataplaneError

T = TypeVar("T")
R = TypeVar("R")
Steps = Generator[Any, Any, T]

__all__ = ["Blocking", "OpEnded", "Steps", "SyncDriver", "drive", "is_refs"]


@dataclass(frozen=True)
class Blocking(Generic[R]):
    """A step that blocks its thread: called in a synchronous caller's thread, on a worker
    thread under an event loop (which must not block)."""

    fn: Callable[[], R]


def is_refs(step: Any) -> bool:
    """Whether ``step`` is a Ray ref or a list of them (empty included)."""
    if isinstance(step, ray.ObjectRef):
        return True
    return isinstance(step, list) and all(isinstance(r, ray.ObjectRef) for r in step)


async def _await_step(step: Any) -> Any:
    if isinstance(step, Blocking):
        return await asyncio.to_thread(step.fn)
    if isinstance(step, list):
        return list(await asyncio.gather(*step))
    return await step


class _Body(Generic[T]):
    """A body under way: ``step`` is what it waits on now, until ``done`` (then ``result``)."""

    def __init__(self, steps: Steps[T]) -> None:
        self.steps = steps
        self.done = False
        self.result: Any = None
        self.step: Any = None
        self.resume(None)

    def resume(self, value: Any, error: BaseException | None = None) -> None:
        """Hand the body its step's result (or throw ``error`` in at its ``yield``)."""
        try:
            self.step = self.steps.throw(error) if error is not None else self.steps.send(value)
        except StopIteration as stop:
            self.done, self.result = True, stop.value


async def _settled(step: Any) -> tuple[Any, Exception | None]:
    try:
        return await _await_step(step), None
    except asyncio.CancelledError:
        raise
    except Exception as e:  # noqa: BLE001 - the body decides what its step's error means
        return None, e


async def drive(steps: Steps[T]) -> T:
    """Run ``steps`` on the running event loop. Cancelling this closes the body."""
    with contextlib.closing(steps):
        body = _Body(steps)
        while not body.done:
            body.resume(*await _settled(body.step))
        return body.result  # type: ignore[no-any-return]


class SyncDriver:
    """Runs a body in the calling thread.

    Args:
        wait_refs: ``(refs) -> values``: ``ray.get`` bounded as the op is (the caller's
            timeout and liveness watch); errors that end the op are raised from it as
            :class:`OpEnded` so they are not thrown into the body.
        run_awaitable: ``(awaitable) -> result`` on the client's loop, bounded likewise.
    """

    def __init__(self, wait_refs: Callable[[Any], Any], run_awaitable: Callable[[Awaitable[Any]], Any]) -> None:
        self.wait_refs = wait_refs
        self.run_awaitable = run_awaitable

    def _wait(self, step: Any) -> Any:
        if isinstance(step, Blocking):
            return step.fn()
        if is_refs(step):
            return self.wait_refs(step)
        return self.run_awaitable(step)

    def _settled(self, step: Any) -> tuple[Any, Exception | None]:
        try:
            return self._wait(step), None
        except OpEnded as ended:
            raise ended.error from ended.error.__cause__
        except Exception as e:  # noqa: BLE001 - the body decides what its step's error means
            return None, e

    def __call__(self, steps: Steps[T]) -> T:
        with contextlib.closing(steps):
            body = _Body(steps)
            while not body.done:
                body.resume(*self._settled(body.step))
            return body.result  # type: ignore[no-any-return]


class OpEnded(NemoDataplaneError):
    """Raised by a :class:`SyncDriver`'s waits for an error that ends the op (its timeout, a lost
    store): it reaches the caller as ``error`` without passing through the body (never raised
    out of the driver itself)."""

    def __init__(self, error: BaseException) -> None:
        super().__init__(str(error))
        self.error = error
