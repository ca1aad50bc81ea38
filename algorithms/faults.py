"""Fault injection for the chaos tests: one small hook, driven only by ``debug.*`` config keys.

Nothing here runs unless a test (or the chaos script) sets ``debug.fail_in``; the library's code
calls :func:`maybe_fail` at a few named points and never looks at the keys itself.

Keys (see :class:`algorithms.config.DebugConfig`):

* ``debug.fail_in``: the point to fail at: ``collect`` (the collector, after its put),
  ``logprobs`` / ``train`` (a policy rank), ``put`` (the async collector's write of group
  ``fail_at_group`` fails half-way; the collector's own code, it also tests the rollback),
  ``generate`` (an async collector, after generating group ``fail_at_group``, before its put),
  ``reward`` (the collector's reward call for group ``fail_at_group`` raises: reported like a
  user's raising reward function),
  ``generator`` (the generator actor, inside its generate call with weight version
  ``fail_at_step``), ``refit`` (the generator, on the refit that installs version
  ``fail_at_step``, before it joins the transfer: with ``fail_mode=hang`` the trainer's peer never
  arrives), ``store_controller`` / ``store_unit`` (the driver, at the start of step
  ``fail_at_step``, ``ray.kill``s the TransferQueue controller / storage unit 0:
  :func:`maybe_kill_store`).
* ``debug.fail_at_step`` / ``debug.fail_rank`` / ``debug.fail_at_group``: where exactly.
* ``debug.fail_mode``: ``raise`` (an :class:`InjectedFailure`), ``sigkill`` (the process
  SIGKILLs itself, as the OOM killer or a lost node would: no cleanup, no message) or ``hang``
  (the call sleeps, alive but silent, as a wedged or partitioned peer; for at most
  :data:`HANG_S`, after which it raises; the trainer kills the actor long before).
* ``debug.fault_marker``: a file the hook writes ``time.time()`` to just before it fails, so a
  test can measure the time from fault to error.

:func:`raising_reward` is a user-style reward function that always raises, for
``task.reward_fn=algorithms.faults:raising_reward``; :func:`hanging_reward` one that never
returns (once per run with ``$NEMO_DATAPLANE_HANG_ONCE``), for ``task.reward_timeout_s``.
"""

from __future__ import annotations

import os
import signal
import time
from typing import TYPE_CHECKING, Any

from algorithms.rewards import char_match_score

if TYPE_CHECKING:  # type names only: a reward worker imports this module for the rewards below
    from algorithms.config import DebugConfig
    from nemo_dataplane.config import DataPlaneConfig

__all__ = [
    "HANG_ONCE_ENV",
    "HANG_S",
    "STORE_ACTORS",
    "InjectedFailure",
    "hanging_reward",
    "maybe_fail",
    "maybe_kill_store",
    "raising_reward",
]

HANG_S = 3600.0  # fail_mode=hang: longest sleep (a bound, so the hook itself never waits forever)
STORE_ACTORS = ("store_controller", "store_unit")  # fail_in points where the driver kills a store actor


class InjectedFailure(RuntimeError):
    """Raised by the ``debug.fail_*`` hook (tests of the failure path)."""


def maybe_fail(
    debug: DebugConfig,
    where: str,
    *,
    step: int | None = None,
    rank: int | None = None,
    group: int | None = None,
    what: str = "",
) -> None:
    """Fail here if ``debug`` asks for it: ``debug.fail_in == where`` and each of
    ``fail_at_step``/``fail_rank``/``fail_at_group`` that is set (and given here) matches.

    Raises:
        InjectedFailure: with ``fail_mode=raise`` (the default); the message names the point.
    """
    if debug.fail_in != where:
        return
    for want, value in ((debug.fail_at_step, step), (debug.fail_rank, rank), (debug.fail_at_group, group)):
        if want is not None and value is not None and want != value:
            return
    _mark(debug)
    if debug.fail_mode == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    if debug.fail_mode == "hang":
        time.sleep(HANG_S)
    raise InjectedFailure(f"debug.fail_in={where}: injected failure{' ' + what if what else ''}")


def _mark(debug: DebugConfig) -> None:
    if debug.fault_marker:
        with open(debug.fault_marker, "w") as f:
            f.write(repr(time.time()))


def maybe_kill_store(debug: DebugConfig, step: int, data_plane: DataPlaneConfig) -> str | None:
    """At ``debug.fail_at_step``, ``ray.kill`` the TransferQueue controller (``fail_in=store_controller``)
    or the process holding its storage unit 0 (``store_unit``: the unit's own, or the controller's
    when it holds the unit) of the store ``data_plane`` names, as a crashed or lost store process
    would; returns the killed actor's name (``None``: nothing asked here). The run
    then goes on and meets the dead store.

    Raises:
        ValueError: the backend is not ``transfer_queue`` (the only store with such actors here).
    """
    if debug.fail_in not in STORE_ACTORS or debug.fail_at_step != step:
        return None
    # Only a chaos run gets here: it names the store's actors, so it needs the adapter.
    import ray

    from nemo_dataplane.adapters.transfer_queue.client import DEFAULT_CONTROLLER, DEFAULT_NAMESPACE

    if data_plane.backend != "transfer_queue":
        raise ValueError(f"debug.fail_in={debug.fail_in} needs data_plane.backend=transfer_queue")
    kwargs = data_plane.backend_kwargs or {}
    controller = kwargs.get("controller_name", DEFAULT_CONTROLLER)
    namespace = kwargs.get("namespace", DEFAULT_NAMESPACE)
    # The adapter names its units "<controller>.StorageUnit#<rank>" (tests/unit/test_faults.py checks
    # it); a store whose controller holds unit 0 (transfer_queue.unit_in_controller) has no such
    # actor, and the process to kill for unit 0 is the controller's.
    name = controller if debug.fail_in == "store_controller" else f"{controller}.StorageUnit#0"
    try:
        handle = ray.get_actor(name, namespace=namespace)
    except ValueError:
        if debug.fail_in != "store_unit":
            raise
        name, handle = controller, ray.get_actor(controller, namespace=namespace)
    # Its process, if on this node: Ray calls an actor dead ~10 ms before the process is gone
    # (measured), and a store actor can still serve a request in that window.
    pid, node = ray.get(
        handle.__ray_call__.remote(lambda _: (os.getpid(), ray.get_runtime_context().get_node_id())), timeout=30
    )
    local_pid = pid if node == ray.get_runtime_context().get_node_id() else None
    _mark(debug)
    ray.kill(handle, no_restart=True)
    deadline = time.monotonic() + 10.0  # ray.kill is asynchronous: return once the actor is gone
    while time.monotonic() < deadline:
        try:
            ray.get(handle.__ray_ready__.remote(), timeout=1.0)
        except ray.exceptions.RayActorError:
            if local_pid is None or not _process_alive(local_pid):
                return name
        except ray.exceptions.GetTimeoutError:
            pass
        time.sleep(0.005)
    raise RuntimeError(f"debug.fail_in={debug.fail_in}: {name} was killed but still runs after 10 s")


def _process_alive(pid: int) -> bool:
    """Whether process ``pid`` (this node) still runs (a zombie has exited)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def raising_reward(record: Any, response_text: str) -> float:
    """A reward function that always raises (``task.reward_fn=algorithms.faults:raising_reward``)."""
    raise ValueError(f"raising_reward: refusing to score a response of {len(response_text)} chars")


HANG_ONCE_ENV = "NEMO_DATAPLANE_HANG_ONCE"


def hanging_reward(record: Any, response_text: str) -> float:
    """``char_match`` of the response, except for calls that sleep :data:`HANG_S` (a reward that
    never returns, for ``task.reward_timeout_s``): every call, or with ``$NEMO_DATAPLANE_HANG_ONCE``
    set to a path, only the one call of the run that creates that file."""
    once = os.environ.get(HANG_ONCE_ENV)
    if once:
        try:
            os.close(os.open(once, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            return char_match_score(str(record.answer), response_text)
    time.sleep(HANG_S)
    raise RuntimeError(f"hanging_reward: still running after {HANG_S:g}s")
