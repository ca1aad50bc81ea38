"""How the driver makes a step's per-rank calls to the policy workers (``trainer.dispatch``).

Two calls per step go to every policy rank with that rank's input (a ``KVBatchMeta``, or the
``ObjectRef`` of a legacy shard): ``logprobs`` (``PolicyWorker.get_logprobs``, reference
included) and ``train`` (``PolicyWorker.train``).

* :class:`ActorDispatch` (``actors``): one ``.remote`` per rank, collected by
  :func:`algorithms.step.gather`.
* :class:`CompiledGraphDispatch` (``compiled_graph``): one Ray Compiled Graph over all ranks,
  compiled once after a warm-up step made through actor calls, executed for both call kinds
  (``PolicyWorker.step_call`` picks the method). One graph, not one per kind: an actor runs a
  compiled graph's loop in its single ``_ray_system`` thread, so a second graph over the same
  actors would never start. Its input is ``(kind, step, flag, input_0, ..., input_{dp-1})``.

Failures keep their meaning in both modes: a worker's own exception is the step's
:class:`~algorithms.step.StepError` quoting it; a wait past ``trainer.step_timeout_s`` is a
``StepError`` too. A compile or execution error that says the graph cannot serve (unsupported
environment, a channel error, a worker that died or restarted) tears the graph down and switches
to actor calls for the rest of the run, with one logged warning; the call that hit it is redone
through actors when that is safe (nothing ran yet, or the call is ``logprobs``, which only
recomputes and rewrites the same values); a ``train`` call that may have run on some ranks fails
the step instead (an optimizer step must not run twice).

Idle cost: while a graph is compiled, each policy actor's graph loop waits for its next input by
polling its channel and burns CPU although nothing runs (docs/grpo_sync.md, "Dispatch").
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from typing import Any

import ray

KINDS = ("logprobs", "train")


class DispatchError(RuntimeError):
    """The compiled graph cannot serve (the dispatcher falls back to actor calls)."""


def _check(kind: str, inputs: Sequence[Any], ranks: int) -> None:
    if kind not in KINDS:
        raise ValueError(f"dispatch kind must be one of {KINDS}, got {kind!r}")
    if len(inputs) != ranks:
        raise ValueError(f"dispatch {kind}: {len(inputs)} inputs for {ranks} policy ranks")


class ActorDispatch:
    """Plain actor calls: one ``.remote`` per rank, :func:`~algorithms.step.gather`-ed."""

    name = "actors"

    def __init__(self, policy: Sequence[Any]) -> None:
        self.policy = list(policy)

    def call(self, kind: str, inputs: Sequence[Any], step: int, flag: bool, timeout_s: float, what: str) -> list[Any]:
        """Run ``kind`` on every rank with its input; ``flag`` is ``with_reference`` (logprobs)
        or ``behaviour`` (train). Returns the ranks' results in rank order.

        Raises:
            StepError: a worker raised (quoted) or ``timeout_s`` passed.
        """
        from algorithms.step import gather

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


class CompiledGraphDispatch:
    """One Ray Compiled Graph over the policy ranks, for both call kinds.

    The first ``warmup_calls`` calls (default: one step's two) go through actor calls; the
    next call compiles the graph (``experimental_compile``) and every later one executes it.
    ``fail_compile`` (``debug.fail_dispatch_compile``) makes the compile raise as an unsupported
    environment would, to exercise the fallback.
    """

    name = "compiled_graph"

    def __init__(self, policy: Sequence[Any], *, warmup_calls: int = len(KINDS), fail_compile: bool = False,
                 log: Any = None) -> None:
        self.policy = list(policy)
        self.actors = ActorDispatch(policy)
        self.warmup_calls = warmup_calls
        self.fail_compile = fail_compile
        self.graph: Any = None
        self.calls = 0
        self.fallback_reason: str | None = None  # set once the graph was given up
        self.compile_s: float | None = None
        self.graph_calls = 0  # calls that ran through the graph
        self._log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))

    @property
    def active(self) -> bool:
        """Whether calls now run through the compiled graph."""
        return self.graph is not None

    def call(self, kind: str, inputs: Sequence[Any], step: int, flag: bool, timeout_s: float, what: str) -> list[Any]:
        """As :meth:`ActorDispatch.call`, through the graph once it is compiled.

        Raises:
            StepError: a worker raised (quoted), ``timeout_s`` passed, or the graph failed while
                a ``train`` call may have run on some ranks.
        """
        _check(kind, inputs, len(self.policy))
        self.calls += 1
        if self.fallback_reason is not None or self.calls <= self.warmup_calls:
            return self.actors.call(kind, inputs, step, flag, timeout_s, what)
        if self.graph is None:
            try:
                self._compile()
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

    def _get(self, ref: Any, kind: str, inputs: Sequence[Any], step: int, flag: bool, timeout_s: float,
             what: str) -> list[Any]:
        from algorithms.step import StepError

        try:
            return list(ray.get(ref, timeout=timeout_s))
        except ray.exceptions.RayTaskError as e:
            # A worker's own exception (the graph reads every rank's output channel in turns, so
            # the first error is returned without waiting for ranks blocked in a collective).
            cause = getattr(e, "cause", None) or e
            if isinstance(cause, (ray.exceptions.RayChannelError, ray.exceptions.ActorDiedError)):
                return self._after_graph_failure(cause, kind, inputs, step, flag, timeout_s, what)
            raise StepError(f"{what}: {type(cause).__name__}: {cause}") from cause
        except (ray.exceptions.RayChannelTimeoutError, ray.exceptions.GetTimeoutError) as e:
            raise StepError(
                f"{what}: {len(inputs)} worker call(s) through the compiled graph did not finish within {timeout_s}s"
            ) from e
        except ray.exceptions.RayError as e:  # channel closed, actor died: the graph cannot serve
            return self._after_graph_failure(e, kind, inputs, step, flag, timeout_s, what)

    def _after_graph_failure(self, e: BaseException, kind: str, inputs: Sequence[Any], step: int, flag: bool,
                             timeout_s: float, what: str) -> list[Any]:
        from algorithms.step import StepError

        self._fall_back(f"execution failed: {type(e).__name__}: {e}")
        if kind == "logprobs":  # recomputes and rewrites the same values: safe to redo
            return self.actors.call(kind, inputs, step, flag, timeout_s, what)
        raise StepError(
            f"{what}: the compiled graph failed while train may have run on some ranks ({type(e).__name__}: {e}); "
            "later steps use actor calls"
        ) from e

    def _compile(self) -> None:
        from ray.dag import InputNode, MultiOutputNode

        if self.fail_compile:
            raise DispatchError("debug.fail_dispatch_compile=true: compile refused as an unsupported environment")
        t0 = time.perf_counter()
        with InputNode() as inp:
            n_fixed = 3  # kind, step, flag
            outs = [w.step_call.bind(inp[0], inp[n_fixed + r], inp[1], inp[2]) for r, w in enumerate(self.policy)]
            dag = MultiOutputNode(outs)
        self.graph = dag.experimental_compile()
        self.compile_s = time.perf_counter() - t0

    def _fall_back(self, reason: str) -> None:
        if self.fallback_reason is None:
            self._log(f"dispatch: the compiled graph cannot serve ({reason}); using actor calls from now on")
        self.fallback_reason = reason
        self.close()

    def report(self) -> dict[str, Any]:
        """For summary.json: the mode, calls through the graph, compile time, why it fell back."""
        return {"mode": self.name, "graph_calls": self.graph_calls, "compile_s": self.compile_s,
                "fallback": self.fallback_reason}

    def close(self, timeout_s: float = 10.0) -> None:
        """Tear the graph down (bounded by ``timeout_s``); the actors stay usable. Must run before
        the actors are killed, or the teardown waits on dead loops."""
        graph, self.graph = self.graph, None
        if graph is None:
            return
        from ray.dag import DAGContext

        ctx = DAGContext.get_current()
        previous = ctx.teardown_timeout
        ctx.teardown_timeout = max(1, int(timeout_s))
        try:
            graph.teardown()
        except Exception as e:  # noqa: BLE001 - at shutdown the actors are killed next anyway
            print(f"dispatch: compiled graph teardown failed: {type(e).__name__}: {e}", file=sys.stderr)
        finally:
            ctx.teardown_timeout = previous


def make_dispatcher(
    mode: str, policy: Sequence[Any], *, fail_compile: bool = False
) -> ActorDispatch | CompiledGraphDispatch:
    """The dispatcher of ``trainer.dispatch`` over the policy actors ``policy``."""
    if mode == "actors":
        return ActorDispatch(policy)
    if mode == "compiled_graph":
        return CompiledGraphDispatch(policy, fail_compile=fail_compile)
    raise ValueError(f"trainer.dispatch must be 'actors' or 'compiled_graph', got {mode!r}")
