"""Rewards under a hard time limit (``task.reward_timeout_s``): the reward function runs in a small
pool of worker processes that can be killed.

A reward that parses or verifies an answer can take unbounded time on what a model samples: the
``math`` reward on ``\\boxed{9^{9^{9^9}}}`` computes a power in C, holding the GIL, where no
signal and no thread reaches it (math-verify's own ``SIGALRM`` bound works only on a main
thread, and the collector scores on a producer thread). So every call goes to a worker process
(:class:`RewardPool`); a call that has not answered after ``reward_timeout_s`` seconds scores 0
(:class:`RewardTimeout`, counted in :attr:`RewardPool.timeouts`), its worker is SIGKILLed and a
replacement starts in the background. A collector never waits longer than that for a score.

What a custom ``reward_fn`` gets in a worker: it is imported there by its
``"pkg.module:function"`` name (the worker's import path is the collector's ``sys.path``), and
called in the worker's main thread with a pickled copy of the record and the response text; it
returns a number, or raises (the exception comes back pickled, its worker-side traceback attached
as a note, and fails the step as before). Module-level state lives per worker and lasts until the
worker is replaced or the run ends. A worker dies with the process that started it (Linux
``PR_SET_PDEATHSIG``, and a watch on its parent elsewhere). ``reward_timeout_s: null`` calls the
function in the collector's own process instead, unbounded (:class:`InProcessReward`), for a
function that cannot leave it.

Cost: a worker starts as a fresh interpreter importing :mod:`algorithms.rewards` and the reward's
module (the ``math`` reward: ~1.4 s of CPU, math-verify and sympy). The pool starts one at once,
in the background, a second only when a call finds the first busy (a validation beside the
producer); a call costs one pipe round trip (~0.1 ms), a timeout the bound plus, for the next call,
the replacement's start.
"""

from __future__ import annotations

import ctypes
import os
import pickle
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any, Protocol

from algorithms.faults import maybe_fail
from algorithms.rewards import RewardError, RewardFn, RewardTimeout, checked_reward, resolve_reward_fn

if TYPE_CHECKING:
    from algorithms.config import TrainerConfig
    from algorithms.config_sections import TaskConfig
    from algorithms.tasks import PromptRecord

__all__ = ["InProcessReward", "ResponseScorer", "RewardPool", "RewardTimeout", "Scorer", "make_scorer", "worker_main"]

MAX_WORKERS = 2  # worker processes per pool: the producer's calls and a validation's side by side
START_TIMEOUT_S = 120.0  # a worker that has not imported its reward by then failed to start


class RewardWorkerError(RuntimeError):
    """A reward worker process failed outside the reward function (it exited mid-call, or the
    function's exception or result could not be sent back); the message says which."""


class InProcessReward:
    """``reward_timeout_s: null``: the function called in this process, with no bound."""

    timeouts = 0

    def __init__(self, fn: RewardFn) -> None:
        self.fn = fn

    def __call__(self, record: PromptRecord, text: str) -> float:
        return self.fn(record, text)

    def wait_ready(self, timeout_s: float) -> None:
        """Nothing to wait for."""

    def close(self) -> None:
        """Nothing to release."""


class Scorer(Protocol):
    """What the collector scores with: a call per response, the timeouts so far, a readiness wait."""

    timeouts: int

    def __call__(self, record: PromptRecord, text: str) -> float: ...

    def wait_ready(self, timeout_s: float) -> None: ...

    def close(self) -> None: ...


def make_scorer(task: TaskConfig) -> Scorer:
    """The reward scorer ``task`` asks for: a :class:`RewardPool` bounded by
    ``task.reward_timeout_s``, or with ``null`` the function called in this process."""
    if task.reward_timeout_s is None:
        return InProcessReward(resolve_reward_fn(task.reward_fn, task.name))
    return RewardPool(task.reward_fn, task.name, task.reward_timeout_s)


class ResponseScorer:
    """A collector's rewards: one checked score per response (:func:`algorithms.rewards.checked_reward`:
    a raising reward or a non-finite or non-number score fails the step, naming the prompt and
    group; a call past ``task.reward_timeout_s`` scores 0 and is counted in :attr:`timeouts`),
    through :func:`make_scorer`'s scorer, with the ``debug.fail_in=reward`` hook in each call."""

    def __init__(self, cfg: TrainerConfig, decode: Callable[[Sequence[int]], str]) -> None:
        self.cfg, self.decode = cfg, decode
        self.name = cfg.task.reward_fn or cfg.task.name
        self.scorer = make_scorer(cfg.task)
        self._reported = 0

    @property
    def timeouts(self) -> int:
        """Reward calls past the time limit since the start (cumulative)."""
        return self.scorer.timeouts

    def new_timeouts(self) -> int:
        """Reward calls past the time limit since the last call of this method."""
        total = self.scorer.timeouts
        new, self._reported = total - self._reported, total
        return new

    def score(
        self, records: Sequence[Any], responses: Sequence[Sequence[int]], n: int, groups: Sequence[int] | None = None
    ) -> list[float]:
        """The score of each response; response ``i`` answers ``records[i // n]`` of group ``groups[i // n]``."""
        out = []
        for i, resp in enumerate(responses):
            group = groups[i // n] if groups else None
            out.append(
                checked_reward(self._call(group), records[i // n], self.decode(resp), name=self.name, group=group)
            )
        return out

    def _call(self, group: int | None) -> RewardFn:
        def call(record: PromptRecord, text: str) -> float:
            # fail_in=reward: the call for group fail_at_group raises, as a user's function would.
            what = f"in the reward function of group {'?' if group is None else group}"
            maybe_fail(self.cfg.debug, "reward", group=group, what=what)
            return self.scorer(record, text)

        return call

    def wait_ready(self, timeout_s: float) -> None:
        self.scorer.wait_ready(timeout_s)

    def close(self) -> None:
        self.scorer.close()


class _Worker:
    """One worker process and this end of its socket."""

    def __init__(self, proc: subprocess.Popen[bytes], conn: Connection) -> None:
        self.proc, self.conn = proc, conn

    def kill(self) -> None:
        """SIGKILL and reap (bounded: a process stuck in the kernel is left to init)."""
        try:
            self.proc.kill()
            self.proc.wait(5.0)
        except (OSError, subprocess.TimeoutExpired):
            pass
        self.conn.close()


class RewardPool:
    """``spec``/``task`` as :func:`algorithms.rewards.resolve_reward_fn` takes them, run in up to
    :data:`MAX_WORKERS` worker processes, each call bounded by ``timeout_s``. Thread-safe: calls
    from several threads each take an idle worker. ``close()`` kills every worker (idempotent).

    Raises (from a call): :class:`RewardTimeout` past ``timeout_s`` (counted); the function's own
    exception; :class:`RewardWorkerError` when its worker died mid-call; :class:`RewardError`
    when no worker could start (the reason is the worker's: the module did not import, ...).
    """

    def __init__(
        self,
        spec: str | None,
        task: str,
        timeout_s: float,
        *,
        max_workers: int = MAX_WORKERS,
        start_timeout_s: float = START_TIMEOUT_S,
    ) -> None:
        if not timeout_s > 0:
            raise ValueError(f"reward timeout must be > 0 seconds, got {timeout_s}")
        self.spec, self.task = spec, task
        self.name = spec or task
        self.timeout_s = float(timeout_s)
        self.max_workers = max_workers
        self.start_timeout_s = start_timeout_s
        self.timeouts = 0  # calls past timeout_s, since the pool started
        self.started = 0  # worker processes started (replacements included)
        self._cv = threading.Condition()
        self._idle: list[_Worker] = []
        self._busy: set[_Worker] = set()
        self._starting = 0
        self._launched: _Worker | None = None  # started, not yet ready (close() kills it too)
        self._start_error: BaseException | None = None
        self._closed = False
        # Every worker is started from this one thread: PR_SET_PDEATHSIG fires when the thread
        # that started a child ends, so it must live as long as the pool.
        self._spawns: queue.SimpleQueue[bool] = queue.SimpleQueue()
        self._spawner = threading.Thread(target=self._spawn_loop, name="reward-pool-spawner", daemon=True)
        self._spawner.start()
        self._add_worker()

    # ------------------------------------------------------------------ workers
    def _add_worker(self) -> None:
        """Start one more worker in the background (caller holds no lock or ``_cv``)."""
        with self._cv:
            self._starting += 1
        self._spawns.put(True)

    def _spawn_loop(self) -> None:
        while self._spawns.get():
            try:
                worker = self._start_worker()
            except BaseException as e:  # noqa: BLE001 - every call is told (see _acquire)
                with self._cv:
                    self._starting -= 1
                    self._start_error = e
                    self._cv.notify_all()
                continue
            with self._cv:
                self._starting -= 1
                if self._closed:
                    worker.kill()
                else:
                    self._idle.append(worker)
                    self._start_error = None
                self._cv.notify_all()

    def _start_worker(self) -> _Worker:
        ours, theirs = socket.socketpair()
        path = os.pathsep.join(p for p in (q or os.getcwd() for q in sys.path) if os.path.isdir(p))  # "": the cwd
        env = {**os.environ, "PYTHONPATH": path}
        code = "from algorithms.reward_pool import worker_main; worker_main()"
        try:
            proc = subprocess.Popen(
                [sys.executable, "-c", code, str(theirs.fileno()), str(os.getpid()), self.spec or "", self.task],
                pass_fds=(theirs.fileno(),),
                env=env,
                stdin=subprocess.DEVNULL,
            )
        finally:
            theirs.close()
        conn = Connection(ours.detach())
        worker = _Worker(proc, conn)
        self.started += 1
        with self._cv:
            if self._closed:
                worker.kill()
                raise RewardError(f"reward_fn {self.name!r}: the reward pool is closed")
            self._launched = worker
        try:
            if not conn.poll(self.start_timeout_s):
                raise RewardError(
                    f"reward_fn {self.name!r}: its worker process did not start within {self.start_timeout_s:g}s"
                )
            ok, value = conn.recv()
        except (EOFError, OSError) as e:
            worker.kill()
            raise RewardError(
                f"reward_fn {self.name!r}: its worker process exited while starting (code {proc.returncode})"
            ) from e
        except BaseException:
            worker.kill()
            raise
        finally:
            with self._cv:
                self._launched = None
        if not ok:
            worker.kill()
            raise value
        return worker

    def _acquire(self) -> _Worker:
        deadline = time.monotonic() + self.start_timeout_s
        with self._cv:
            while True:
                if self._closed:
                    raise RewardError(f"reward_fn {self.name!r}: the reward pool is closed")
                if self._idle:
                    worker = self._idle.pop()
                    self._busy.add(worker)
                    return worker
                if self._start_error is not None and not self._starting:
                    raise self._start_error
                if not self._starting and len(self._busy) < self.max_workers:
                    self._starting += 1
                    self._spawns.put(True)
                left = deadline - time.monotonic()
                if left <= 0:
                    raise RewardError(
                        f"reward_fn {self.name!r}: no worker process free or started within {self.start_timeout_s:g}s"
                    )
                self._cv.wait(left)

    def _release(self, worker: _Worker) -> None:
        with self._cv:
            self._busy.discard(worker)
            if self._closed:
                worker.kill()
            else:
                self._idle.append(worker)
            self._cv.notify_all()

    def _replace(self, worker: _Worker) -> None:
        """Kill ``worker`` and start another in its place, in the background."""
        worker.kill()
        with self._cv:
            self._busy.discard(worker)
            closed = self._closed
        if not closed:
            self._add_worker()

    def pids(self) -> list[int]:
        """The worker processes now up (idle or in a call)."""
        with self._cv:
            return sorted(w.proc.pid for w in (*self._idle, *self._busy))

    # ------------------------------------------------------------------ calls
    def wait_ready(self, timeout_s: float) -> None:
        """Block until one worker is up (or raise why none could start), at most ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        with self._cv:
            while not self._idle and not self._busy:
                if self._start_error is not None and not self._starting:
                    raise self._start_error
                left = deadline - time.monotonic()
                if left <= 0:
                    raise RewardError(f"reward_fn {self.name!r}: no worker process started within {timeout_s:g}s")
                self._cv.wait(left)

    def __call__(self, record: PromptRecord, text: str) -> float:
        worker = self._acquire()
        try:
            worker.conn.send((record, text))
            answered = worker.conn.poll(self.timeout_s)
        except OSError as e:
            self._replace(worker)
            raise RewardWorkerError(
                f"reward_fn {self.name!r}: its worker process is gone (code {worker.proc.poll()}): {e}"
            ) from e
        if not answered:
            self._replace(worker)
            with self._cv:
                self.timeouts += 1
            raise RewardTimeout(
                f"reward_fn {self.name!r} did not finish within task.reward_timeout_s={self.timeout_s:g}s "
                "(its worker process was killed and replaced)"
            )
        try:
            ok, value = worker.conn.recv()
        except (EOFError, OSError) as e:
            self._replace(worker)
            raise RewardWorkerError(
                f"reward_fn {self.name!r}: its worker process exited mid-call (code {worker.proc.wait()})"
            ) from e
        self._release(worker)
        if not ok:
            raise value
        return value  # checked_reward checks the type

    def close(self) -> None:
        """Kill every worker and stop the spawner (idempotent)."""
        with self._cv:
            if self._closed:
                return
            self._closed = True
            workers = [*self._idle, *self._busy, *([self._launched] if self._launched else [])]
            self._idle, self._busy = [], set()
            self._cv.notify_all()
        self._spawns.put(False)
        for w in workers:
            w.kill()


# ---------------------------------------------------------------------------------- worker side
def _die_with_parent(parent: int) -> None:
    """End this process when ``parent`` ends, even while the reward holds the GIL in C: the
    kernel's parent-death signal where there is one (Linux), else a thread watching the parent."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent:  # it ended before the signal was armed
        os._exit(1)

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch, name="reward-worker-parent-watch", daemon=True).start()


def _portable(e: BaseException, where: str) -> BaseException:
    """``e`` with its worker-side traceback as a note, or a :class:`RewardWorkerError` quoting it
    when it does not survive pickling."""
    try:
        # A note (shown under the exception from Python 3.11; add_note's effect, by hand for 3.10).
        note = f"raised in reward worker process {os.getpid()}:\n{where}"
        e.__notes__ = [*getattr(e, "__notes__", []), note]  # type: ignore[attr-defined]  # 3.10's stubs
        pickle.loads(pickle.dumps(e))
        return e
    except Exception:  # noqa: BLE001 - any pickling failure
        return RewardWorkerError(f"{type(e).__name__}: {e}\n{where}")


def worker_main(argv: list[str] | None = None) -> None:
    """A worker's loop: ``argv`` = socket fd, parent pid, reward spec ('' for the task's own), task."""
    fd, parent, spec, task = (argv if argv is not None else sys.argv[1:])[:4]
    _die_with_parent(int(parent))
    conn = Connection(int(fd))
    try:
        fn: Callable[[PromptRecord, str], Any] = resolve_reward_fn(spec or None, task)
    except BaseException as e:  # noqa: BLE001 - handed to the pool, which fails every call with it
        conn.send((False, _portable(e, traceback.format_exc())))
        return
    conn.send((True, None))
    while True:
        try:
            record, text = conn.recv()
        except (EOFError, OSError):
            return  # the pool closed its end
        try:
            msg: tuple[bool, Any] = (True, fn(record, text))
        except Exception as e:  # noqa: BLE001 - the caller's checked_reward reports it
            msg = (False, _portable(e, traceback.format_exc()))
        try:
            conn.send(msg)
        except Exception as e:  # noqa: BLE001 - e.g. a result that cannot be pickled
            conn.send((False, RewardWorkerError(f"cannot send the reward's result {msg[1]!r} back: {e}")))
