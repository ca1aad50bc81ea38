"""The pieces of a stateless group's operations that do not need the group's rendezvous: its
errors, the handle of an issued operation (:class:`Work`, every wait bounded), what each
backend carries natively (:func:`wire_view`), the lazy nccl4py import and
:func:`call_with_deadline` (a bounded call of something that cannot be interrupted).

Split from ``stateless_group.py`` (rendezvous, communicator set-up and collectives) to keep each
file to one responsibility.
"""

from __future__ import annotations

import contextlib
import datetime
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from nemo_dataplane.dtypes import DTYPES
from nemo_dataplane.errors import NemoDataplaneError
from nemo_dataplane.timeouts import check_timeout

if TYPE_CHECKING:
    from nemo_dataplane.distributed.stateless_group import StatelessProcessGroup

# Float8 formats have no native NCCL/gloo type in every release we support; their bytes
# travel as uint8. The table holds only those this torch build has.
FP8_DTYPES: frozenset[torch.dtype] = frozenset(d for n, d in DTYPES.items() if n.startswith("float8_"))

# What each backend carries natively; anything else (fp8, int16, complex, ...) goes as bytes.
_NATIVE_DTYPES: dict[str, frozenset[torch.dtype]] = {
    "nccl": frozenset(
        {
            torch.float16,
            torch.bfloat16,
            torch.float32,
            torch.float64,
            torch.int8,
            torch.uint8,
            torch.int32,
            torch.int64,
            torch.bool,
        }
    ),
    "gloo": frozenset(
        {
            torch.float16,
            torch.bfloat16,
            torch.float32,
            torch.float64,
            torch.int8,
            torch.uint8,
            torch.int32,
            torch.int64,
            torch.bool,
        }
    ),
}

_GPU_EXTRA_HINT = "pip install 'nemo-dataplane[gpu]'"

# CUDA event queries are cheap and their latency is on the refit's critical path (see
# stateless_group's polling cadence): a waiting Work sleeps at most this long between queries.
_EVENT_POLL_MAX_S = 0.0001


class StatelessGroupError(NemoDataplaneError, RuntimeError):
    """A stateless group failed; the message names the rank, world size and store."""


class StatelessGroupTimeout(StatelessGroupError, TimeoutError):
    """A bounded wait of a stateless group ran out of time."""


def _try(fn: Callable[[], object]) -> None:
    with contextlib.suppress(Exception):
        fn()


def start_daemon(fn: Callable[[], Any], name: str) -> tuple[threading.Event, dict[str, Any]]:
    """Run ``fn()`` on a daemon thread; returns ``(done, box)``: ``done`` is set once it ended,
    with its result in ``box["result"]`` or its exception in ``box["error"]``."""
    done = threading.Event()
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["result"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            box["error"] = e
        finally:
            done.set()

    threading.Thread(target=run, name=name, daemon=True).start()
    return done, box


def call_with_deadline(fn: Callable[[], Any], timeout: float, name: str) -> Any:
    """``fn()`` on a daemon thread; its result, or its exception re-raised, within ``timeout``.

    Raises:
        TimeoutError: ``fn`` did not return within ``timeout`` seconds. The thread is left
            running (a blocked C call cannot be interrupted) but, being a daemon, it never keeps
            the interpreter from exiting, unlike a ``ThreadPoolExecutor`` worker, which is
            joined at exit.
    """
    timeout = check_timeout(timeout, "timeout")
    done, box = start_daemon(fn, name)
    if not done.wait(timeout):
        raise TimeoutError(f"{name}: did not finish within {timeout:g}s")
    if "error" in box:
        raise box["error"]
    return box["result"]


def _import_nccl() -> Any:
    """Import nccl4py lazily so CPU-only installs never need it."""
    try:
        import nccl.core as nccl
    except ImportError as e:  # also covers a missing/mismatched cuda-bindings
        raise ImportError(
            "StatelessProcessGroup(backend='nccl') needs nccl4py (import path `nccl.core`) and "
            f"cuda-bindings; install the gpu extra: {_GPU_EXTRA_HINT} ({e})"
        ) from e
    return nccl


def wire_view(tensor: torch.Tensor, backend: str) -> torch.Tensor:
    """Return ``tensor`` itself, or a ``uint8`` view of its bytes if ``backend`` cannot carry its dtype.

    The view shares storage, so data received into it lands in ``tensor``. Requires a
    contiguous tensor.
    """
    if not tensor.is_contiguous():
        raise ValueError(
            f"communication needs a contiguous tensor (shape {tuple(tensor.shape)}, "
            f"stride {tensor.stride()}); call .contiguous() first"
        )
    if tensor.dtype in _NATIVE_DTYPES[backend]:
        return tensor
    return tensor.detach().reshape(-1).view(torch.uint8)


class Work:
    """Handle of an issued operation. ``wait()`` blocks the host at most the group's timeout."""

    def __init__(
        self,
        group: StatelessProcessGroup,
        what: str,
        *,
        gloo_work: Any = None,
        event: torch.cuda.Event | None = None,
        wait_only: bool = False,
    ) -> None:
        self._group = group
        self._what = what
        self._gloo_work = gloo_work
        self._event = event
        self._done = gloo_work is None and event is None
        # gloo send/recv work reports completion only from wait(): poll a helper thread that waits.
        self._wait_only = wait_only
        self._waiter: threading.Thread | None = None
        self._waiter_exc: BaseException | None = None

    def _start_waiter(self) -> None:
        timeout = datetime.timedelta(seconds=max(self._group.timeout, 1.0))

        def run() -> None:
            try:
                self._gloo_work.wait(timeout)
            except BaseException as e:  # re-raised by wait()
                self._waiter_exc = e

        self._waiter = threading.Thread(target=run, name="spg-gloo-wait", daemon=True)
        self._waiter.start()

    def is_completed(self) -> bool:
        """Whether the operation has finished (non-blocking)."""
        if self._done:
            return True
        if self._gloo_work is not None and self._wait_only:
            if self._waiter is None:
                self._start_waiter()
            assert self._waiter is not None  # _start_waiter() set it
            return not self._waiter.is_alive()
        if self._gloo_work is not None:
            return bool(self._gloo_work.is_completed())
        assert self._event is not None
        return bool(self._event.query())  # type: ignore[no-untyped-call]  # torch.cuda.Event: unannotated

    def wait(self, *, watch: Callable[[], str | None] | None = None, timeout: float | None = None) -> None:
        """Block until done; raise ``StatelessGroupTimeout`` after ``timeout`` (default: the group's).

        ``watch`` is called periodically and may return an error message reported by a peer
        (e.g. read from the store); the wait then stops and raises with that message instead
        of running into the timeout.
        """
        if self._done:
            return
        g = self._group
        timeout = g.timeout if timeout is None else check_timeout(timeout, "timeout")
        # gloo too is polled, never waited on directly: a peer that died leaves gloo blocked until its
        # timeout, and only the poll sees the group's abort (abort.py) posted meanwhile.
        g._poll(
            self.is_completed,
            self._what,
            timeout=timeout,
            watch=watch,
            abort_on_timeout=True,
            max_sleep=_EVENT_POLL_MAX_S if self._event is not None else 0.001,
        )
        if self._waiter is not None:
            self._waiter.join()
            if self._waiter_exc is not None:
                raise self._gloo_failure(self._waiter_exc, timeout) from self._waiter_exc
        elif self._gloo_work is not None:
            try:
                self._gloo_work.wait(datetime.timedelta(seconds=max(timeout, 1.0)))
            except Exception as e:
                raise self._gloo_failure(e, timeout) from e
        self._done = True

    def _gloo_failure(self, e: BaseException, timeout: float) -> StatelessGroupError:
        """The group is broken; gloo's own expiry (its wording varies: "Timed out waiting ...",
        "Application timeout caused pair closure") is a :class:`StatelessGroupTimeout` on every
        path, anything else (a lost peer) a :class:`StatelessGroupError`."""
        g = self._group
        g._mark_broken()
        said = str(e).lower()
        if "timed out" in said or "timeout" in said:
            return g._error(
                StatelessGroupTimeout,
                f"{self._what} did not finish within {timeout:g}s; the peer may have died or skipped it ({e})",
            )
        return g._error(StatelessGroupError, f"{self._what} failed: {e}")
