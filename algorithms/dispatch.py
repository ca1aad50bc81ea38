"""How the driver makes a step's per-rank calls to the policy workers (``trainer.dispatch``).

Two calls per step go to every policy rank with that rank's input (a ``KVBatchMeta``, or the
``ObjectRef`` of a legacy shard): ``logprobs`` (``PolicyWorker.get_logprobs``, reference
included) and ``train`` (``PolicyWorker.train``).

* :class:`ActorDispatch` (``actors``): one ``.remote`` per rank, collected by
  :func:`algorithms.remote.gather`.
* :class:`CompiledGraphDispatch` (``compiled_graph``): one Ray Compiled Graph over all ranks,
  compiled once after a warm-up step made through actor calls, executed for both call kinds
  (``PolicyWorker.step_call`` picks the method). One graph, not one per kind: an actor runs a
  compiled graph's loop in its single ``_ray_system`` thread, so a second graph over the same
  actors would never start. Its input is ``(kind, step, flag, input_0, ..., input_{dp-1})``.

Failures keep their meaning in both modes: a worker's own exception is the step's
:class:`~algorithms.remote.StepError` quoting it; a wait past ``trainer.step_timeout_s`` is a
``StepError`` too. A compile or execution error that says the graph cannot serve (unsupported
environment, a channel error, a worker that died or restarted) tears the graph down and switches
to actor calls for the rest of the run, with one logged warning; the call that hit it is redone
through actors when that is safe (nothing ran yet, or the call is ``logprobs``, which only
recomputes and rewrites the same values); a ``train`` call that may have run on some ranks fails
the step instead (an optimizer step must not run twice).

A call through the graph that fails (a worker's own error, a timeout) may leave other ranks inside
it, blocked in a collective with the rank that raised; the dispatcher then serves no more calls and
``close`` kills the policy actors after a short grace rather than wait for that collective to time
out (the run is ending; actor calls would wait for the same blocked call).

Idle cost: while a graph is compiled, each policy actor's graph loop waits for its next input by
polling its channel and burns CPU although nothing runs. ``trainer.dispatch_idle_teardown_s``
bounds it: the graph is torn down after that long without a call and recompiled on the next one
(docs/grpo_sync.md, "Dispatch").
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Sequence
from typing import Any

import ray
from ray.dag import InputNode, MultiOutputNode

from algorithms.remote import StepError, gather, worker_error
from nemo_dataplane.timeouts import check_timeout

KINDS = ("logprobs", "train")


class DispatchError(RuntimeError):
    """The compiled graph cannot serve (the dispatcher falls back to actor calls)."""


def _check(kind: str, inputs: Sequence[Any], ranks: int) -> None:
    if kind not in KINDS:
        raise ValueError(f"dispatch kind must be one of {KINDS}, got {kind!r}")
    if len(inputs) != ranks:
        raise ValueError(f"dispatch {kind}: {len(inputs)} inputs for {ranks} policy ranks")


class ActorDispatch:
    """Plain actor calls: one ``.remote`` per rank, :func:`~algorithms.remote.gather`-ed."""

    name = "actors"

    def __init__(self, policy: Sequence[Any]) -> None:
        self.policy = list(policy)

    def call(self, kind: str, inputs: Sequence[Any], step: int, flag: bool, timeout_s: float, what: str) -> list[Any]:
        """Run ``kind`` on every rank with its input; ``flag`` is ``with_reference`` (logprobs)
        or ``behaviour`` (train). Returns the ranks' results in rank order.

        Raises:
            StepError: a worker raised (quoted) or ``timeout_s`` passed.
        """
        _check(kind, inputs, len(self.policy))
        if kind == "logprobs":
            refs = [w.get_logprobs.remote(inputs[r], step, with_reference=flag) for r, w in enumerate(self.policy)]
        else:
            refs = [w.train.remote(inputs[r], step, behaviour=flag) for r, w in enumerate(self.policy)]
        return gather(refs, timeout_s, what, who="policy rank")

    def report(self) -> dict[str, Any]:
        """For summary.json."""
        return {"mode": self.name}

    def close(self, timeout_s: float = 10.0) -> None:
        """Nothing to release."""


class _Teardown:
    """Ray's ``CompiledDAG.teardown()`` of ``graph``, run in a daemon thread so that no caller
    waits on it unbounded (after its own timeout Ray waits for a loop that does not leave without
    a bound). The graph's loops leave once their actors' default threads take the cancel and the
    user call each one is in returns."""

    def __init__(self, graph: Any) -> None:
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(graph,), name="dispatch-graph-teardown", daemon=True)
        self._thread.start()

    def _run(self, graph: Any) -> None:
        try:
            graph.teardown()
        except Exception as e:  # noqa: BLE001 - reported by close(); the actors stay usable for actor calls
            self.error = e

    def wait(self, timeout_s: float) -> bool:
        """Whether the teardown finished within ``timeout_s``."""
        self._thread.join(max(0.0, timeout_s))
        return not self._thread.is_alive()


class CompiledGraphDispatch:
    """One Ray Compiled Graph over the policy ranks, for both call kinds.

    The first ``warmup_calls`` calls (default: one step's two) go through actor calls; the
    next call compiles the graph (``experimental_compile``) and every later one executes it.
    ``fail_compile`` (``debug.fail_dispatch_compile``) makes the compile raise as an unsupported
    environment would, to exercise the fallback.

    ``idle_teardown_s`` (``trainer.dispatch_idle_teardown_s``; None: never) bounds the idle
    polling: a driver thread tears the graph down once no call has run through it for that long,
    and the next call recompiles it (waiting first, bounded by its ``timeout_s``, for the old
    loops to leave). Calls, compiles and the idle teardown's decision hold one lock, so a graph is
    never torn down under a call in flight. A failed recompile falls back to actor calls as a
    failed first compile does.

    After a call through the graph failed (a worker's own error, or ``timeout_s`` passed), its
    other ranks may still be inside that call (e.g. blocked in a collective with the rank that
    raised): the dispatcher serves no more calls (each raises :class:`~algorithms.remote.StepError`)
    and :meth:`close` kills the policy actors after a short grace instead of waiting for them.
    """

    name = "compiled_graph"
    failed_grace_s = 1.0  # close() after a failed call: how long the loops get to leave before the kill

    def __init__(
        self,
        policy: Sequence[Any],
        *,
        warmup_calls: int = len(KINDS),
        fail_compile: bool = False,
        idle_teardown_s: float | None = None,
        log: Any = None,
    ) -> None:
        if idle_teardown_s is not None:
            idle_teardown_s = check_timeout(idle_teardown_s, "idle_teardown_s", allow_zero=False)
        self.policy = list(policy)
        self.actors = ActorDispatch(policy)
        self.warmup_calls = warmup_calls
        self.fail_compile = fail_compile
        self.idle_teardown_s = idle_teardown_s
        self.graph: Any = None
        self.calls = 0
        self.fallback_reason: str | None = None  # set once the graph was given up
        self.failed: str | None = None  # set once a call through the graph failed (see the class doc)
        self.compile_s: float | None = None  # the first compile
        self.recompiles = 0  # compiles after an idle teardown
        self.recompile_s = 0.0  # their total time
        self.idle_teardowns = 0
        self.killed_actors = False  # close() killed the policy actors (their loops did not leave)
        self.graph_calls = 0  # calls that ran through the graph
        self._log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
        self._lock = threading.Lock()  # one call, compile or idle-teardown decision at a time
        self._last_call = time.monotonic()
        self._teardowns: list[_Teardown] = []  # started, not yet seen finished
        self._stop = threading.Event()
        self._watcher: threading.Thread | None = None

    @property
    def active(self) -> bool:
        """Whether calls now run through the compiled graph."""
        return self.graph is not None

    def call(self, kind: str, inputs: Sequence[Any], step: int, flag: bool, timeout_s: float, what: str) -> list[Any]:
        """As :meth:`ActorDispatch.call`, through the graph once it is compiled.

        Raises:
            StepError: a worker raised (quoted), ``timeout_s`` passed, the graph failed while a
                ``train`` call may have run on some ranks, or an earlier call through the graph
                failed.
        """
        _check(kind, inputs, len(self.policy))
        if not self._lock.acquire(timeout=timeout_s):
            raise StepError(f"{what}: the dispatcher stayed busy for {timeout_s}s (another call or a teardown)")
        try:
            return self._call(kind, inputs, step, flag, timeout_s, what)
        finally:
            self._last_call = time.monotonic()
            self._lock.release()

    def _call(self, kind: str, inputs: Sequence[Any], step: int, flag: bool, timeout_s: float, what: str) -> list[Any]:
        self.calls += 1
        if self.failed is not None:
            raise StepError(
                f"{what}: an earlier call through the compiled graph failed ({self.failed}); its ranks "
                "may still be inside it, so the dispatcher serves no more calls"
            )
        if self.fallback_reason is not None or self._stop.is_set() or self.calls <= self.warmup_calls:
            return self.actors.call(kind, inputs, step, flag, timeout_s, what)  # warm-up, fallback, after close
        if self.graph is None:
            try:
                self._compile(timeout_s)
            except Exception as e:  # noqa: BLE001 - any compile failure: the graph cannot serve here
                self._fall_back(f"compile failed: {type(e).__name__}: {e}")
                return self.actors.call(kind, inputs, step, flag, timeout_s, what)
        try:
            ref = self.graph.execute(kind, step, flag, *inputs)
        except Exception as e:  # noqa: BLE001 - the submission failed: nothing ran, redo through actors
            self._fall_back(f"execute failed: {type(e).__name__}: {e}")
            return self.actors.call(kind, inputs, step, flag, timeout_s, what)
        out = self._get(ref, kind, inputs, step, flag, timeout_s, what)
        self.graph_calls += 1
        return out

    def _get(
        self, ref: Any, kind: str, inputs: Sequence[Any], step: int, flag: bool, timeout_s: float, what: str
    ) -> list[Any]:
        try:
            return list(ray.get(ref, timeout=timeout_s))
        except ray.exceptions.RayTaskError as e:
            # A worker's own exception (the graph reads every rank's output channel in turns, so
            # the first error is returned without waiting for ranks blocked in a collective).
            cause = worker_error(e)
            if isinstance(cause, (ray.exceptions.RayChannelError, ray.exceptions.ActorDiedError)):
                return self._after_graph_failure(cause, kind, inputs, step, flag, timeout_s, what)
            self.failed = f"{what}: {type(cause).__name__}: {cause}"
            raise StepError(self.failed) from cause
        except (ray.exceptions.RayChannelTimeoutError, ray.exceptions.GetTimeoutError) as e:
            self.failed = (
                f"{what}: {len(inputs)} worker call(s) through the compiled graph did not finish within {timeout_s}s"
            )
            raise StepError(self.failed) from e
        except ray.exceptions.RayError as e:  # channel closed, actor died: the graph cannot serve
            return self._after_graph_failure(e, kind, inputs, step, flag, timeout_s, what)

    def _after_graph_failure(
        self, e: BaseException, kind: str, inputs: Sequence[Any], step: int, flag: bool, timeout_s: float, what: str
    ) -> list[Any]:
        self._fall_back(f"execution failed: {type(e).__name__}: {e}")
        if kind == "logprobs":  # recomputes and rewrites the same values: safe to redo
            return self.actors.call(kind, inputs, step, flag, timeout_s, what)
        raise StepError(
            f"{what}: the compiled graph failed while train may have run on some ranks ({type(e).__name__}: {e}); "
            "later steps use actor calls"
        ) from e

    def _compile(self, timeout_s: float) -> None:
        if self.fail_compile:
            raise DispatchError("debug.fail_dispatch_compile=true: compile refused as an unsupported environment")
        # A graph's loop holds each actor's system thread until it leaves: the torn-down graph's
        # loops must be gone before a new graph can start on the same actors.
        for t in self._teardowns:
            if not t.wait(timeout_s):
                raise DispatchError(f"the previous graph's teardown did not finish within {timeout_s}s")
        self._teardowns.clear()
        t0 = time.perf_counter()
        with InputNode() as inp:
            n_fixed = 3  # kind, step, flag
            outs = [w.step_call.bind(inp[0], inp[n_fixed + r], inp[1], inp[2]) for r, w in enumerate(self.policy)]
            dag = MultiOutputNode(outs)
        self.graph = dag.experimental_compile()
        took = time.perf_counter() - t0
        if self.compile_s is None:
            self.compile_s = took
        else:
            self.recompiles += 1
            self.recompile_s += took
        if self.idle_teardown_s is not None and self._watcher is None:
            self._watcher = threading.Thread(target=self._watch_idle, name="dispatch-idle-teardown", daemon=True)
            self._watcher.start()

    def _watch_idle(self) -> None:
        """The idle teardown (a daemon thread, one per dispatcher; ends at close or fallback)."""
        idle = self.idle_teardown_s
        assert idle is not None
        try:
            while self.fallback_reason is None and self.failed is None:
                due = self._last_call + idle - time.monotonic() if self.graph is not None else idle
                if self._stop.wait(max(due, 0.0)):
                    return
                if not self._lock.acquire(timeout=idle):  # a call in flight: look again after it
                    continue
                try:
                    # Re-checked under the lock: a call that ran meanwhile moved _last_call.
                    if (
                        self.graph is not None
                        and self.failed is None
                        and not self._stop.is_set()
                        and time.monotonic() - self._last_call >= idle
                    ):
                        self._teardowns.append(_Teardown(self.graph))
                        self.graph = None
                        self.idle_teardowns += 1
                finally:
                    self._lock.release()
        except Exception as e:  # noqa: BLE001 - the graph then stays up until close(), as without the setting
            self._log(f"dispatch: the idle teardown stopped: {type(e).__name__}: {e}")

    def _fall_back(self, reason: str) -> None:
        if self.fallback_reason is None:
            self._log(f"dispatch: the compiled graph cannot serve ({reason}); using actor calls from now on")
        self.fallback_reason = reason
        # Actor calls run in the actors' default threads, beside a loop that has not left yet:
        # nothing waits for this teardown but close().
        if self.graph is not None:
            self._teardowns.append(_Teardown(self.graph))
            self.graph = None

    def report(self) -> dict[str, Any]:
        """For summary.json: the mode, calls through the graph, compile time, why it fell back,
        the idle setting with its teardowns and recompiles, and whether close killed the actors."""
        return {
            "mode": self.name,
            "graph_calls": self.graph_calls,
            "compile_s": self.compile_s,
            "fallback": self.fallback_reason,
            "idle_teardown_s": self.idle_teardown_s,
            "idle_teardowns": self.idle_teardowns,
            "recompiles": self.recompiles,
            "recompile_s": self.recompile_s,
            "killed_actors": self.killed_actors,
        }

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop the idle teardown and tear the graph down, before the actors are killed (a teardown
        waits on a dead actor's loop otherwise). Bounded: if the graph's loops have not left
        within ``timeout_s`` (``failed_grace_s`` after a failed call, whose ranks may be blocked in
        a collective until it times out), the policy actors are killed, which ends Ray's waits.
        Without a failure and with the loops gone, the actors stay usable; later calls (if any)
        are actor calls."""
        self._stop.set()
        locked = self._lock.acquire(timeout=timeout_s)
        try:
            if self.graph is not None:
                self._teardowns.append(_Teardown(self.graph))
                self.graph = None
            pending, self._teardowns = self._teardowns, []
        finally:
            if locked:
                self._lock.release()
        deadline = time.monotonic() + (min(timeout_s, self.failed_grace_s) if self.failed else timeout_s)
        if not all(t.wait(deadline - time.monotonic()) for t in pending):
            why = "a call through it failed" if self.failed else f"its loops did not leave within {timeout_s}s"
            self._log(f"dispatch: killing the policy actors to end the compiled graph ({why})")
            self.killed_actors = True
            for a in self.policy:
                try:
                    ray.kill(a, no_restart=True)
                except Exception:  # noqa: BLE001 - already dead
                    pass
            # With the actors dead Ray's waits end (a dead loop's task fails at once).
            deadline = time.monotonic() + timeout_s
            for t in pending:
                t.wait(deadline - time.monotonic())
        for t in pending:
            if t.error is not None:
                print(f"dispatch: compiled graph teardown failed: {type(t.error).__name__}: {t.error}", file=sys.stderr)
        if self._watcher is not None:
            self._watcher.join(timeout=1.0)


def make_dispatcher(
    mode: str, policy: Sequence[Any], *, fail_compile: bool = False, idle_teardown_s: float | None = None
) -> ActorDispatch | CompiledGraphDispatch:
    """The dispatcher of ``trainer.dispatch`` over the policy actors ``policy``
    (``idle_teardown_s``: ``trainer.dispatch_idle_teardown_s``, used by ``compiled_graph`` only)."""
    if mode == "actors":
        return ActorDispatch(policy)
    if mode == "compiled_graph":
        return CompiledGraphDispatch(policy, fail_compile=fail_compile, idle_teardown_s=idle_teardown_s)
    raise ValueError(f"trainer.dispatch must be 'actors' or 'compiled_graph', got {mode!r}")
