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
from collections.abc import Awaitable, Callable, Generator
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import ray

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


async def drive(steps: Steps[T]) -> T:
    """Run ``steps`` on the running event loop. Cancelling this closes the body."""
    value: Any = None
    error: BaseException | None = None
    try:
        while True:
            try:
                step = steps.throw(error) if error is not None else steps.send(value)
            except StopIteration as stop:
                return stop.value  # type: ignore[no-any-return]
            value, error = None, None
            try:
                value = await _await_step(step)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - the body decides what its step's error means
                error = e
    finally:
        steps.close()


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

    def __call__(self, steps: Steps[T]) -> T:
        value: Any = None
        error: BaseException | None = None
        try:
            while True:
                try:
                    step = steps.throw(error) if error is not None else steps.send(value)
                except StopIteration as stop:
                    return stop.value  # type: ignore[no-any-return]
                value, error = None, None
                try:
                    if isinstance(step, Blocking):
                        value = step.fn()
                    elif is_refs(step):
                        value = self.wait_refs(step)
                    else:
                        value = self.run_awaitable(step)
                except OpEnded as ended:
                    raise ended.error from ended.error.__cause__
                except Exception as e:  # noqa: BLE001 - the body decides what its step's error means
                    error = e
        finally:
            steps.close()


class OpEnded(Exception):
    """Raised by a :class:`SyncDriver`'s waits for an error that ends the op (its timeout, a lost
    store): it reaches the caller as ``error`` without passing through the body."""

    def __init__(self, error: BaseException) -> None:
        super().__init__(str(error))
        self.error = error
