"""Fault injection for the chaos tests: one small hook, driven only by ``debug.*`` config keys.

Nothing here runs unless a test (or the chaos script) sets ``debug.fail_in``; the library's code
calls :func:`maybe_fail` at a few named points and never looks at the keys itself.

Keys (see :class:`algorithms.config.DebugConfig`):

* ``debug.fail_in``: the point to fail at: ``collect`` (the collector, after its put),
  ``logprobs`` / ``train`` (a policy rank), ``put`` (the async collector's write of group
  ``fail_at_group`` fails half-way; the collector's own code, it also tests the rollback),
  ``generate`` (an async collector, after generating group ``fail_at_group``, before its put).
* ``debug.fail_at_step`` / ``debug.fail_rank`` / ``debug.fail_at_group``: where exactly.
* ``debug.fail_mode``: ``raise`` (an :class:`InjectedFailure`) or ``sigkill`` (the process
  SIGKILLs itself, as the OOM killer or a lost node would: no cleanup, no message).
* ``debug.fault_marker``: a file the hook writes ``time.time()`` to just before it fails, so a
  test can measure the time from fault to error.

:func:`raising_reward` is a user-style reward function that always raises, for
``task.reward_fn=algorithms.faults:raising_reward``.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Mapping
from typing import Any

__all__ = ["InjectedFailure", "maybe_fail", "raising_reward"]


class InjectedFailure(RuntimeError):
    """Raised by the ``debug.fail_*`` hook (tests of the failure path)."""


def maybe_fail(debug: Mapping[str, Any], where: str, *, step: int | None = None, rank: int | None = None,
               group: int | None = None, what: str = "") -> None:
    """Fail here if ``debug`` asks for it: ``debug.fail_in == where`` and each of
    ``fail_at_step``/``fail_rank``/``fail_at_group`` that is set (and given here) matches.

    Raises:
        InjectedFailure: with ``fail_mode=raise`` (the default); the message names the point.
    """
    if not debug or debug.get("fail_in") != where:
        return
    for key, value in (("fail_at_step", step), ("fail_rank", rank), ("fail_at_group", group)):
        want = debug.get(key)
        if want is not None and value is not None and want != value:
            return
    marker = debug.get("fault_marker")
    if marker:
        with open(marker, "w") as f:
            f.write(repr(time.time()))
    if debug.get("fail_mode", "raise") == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    raise InjectedFailure(f"debug.fail_in={where}: injected failure{' ' + what if what else ''}")


def raising_reward(record: Any, response_text: str) -> float:
    """A reward function that always raises (``task.reward_fn=algorithms.faults:raising_reward``)."""
    raise ValueError(f"raising_reward: refusing to score a response of {len(response_text)} chars")
