"""The processes of a local Ray cluster a run started, found by a mark in their environment, and
the watchdog that stops them when the run's driver is gone however it ended.

Every process of such a cluster (the raylet, the GCS, their agents, every worker and what it
starts) inherits :data:`CLUSTER_ENV` set to :func:`cluster_mark` (``algorithms.cluster.start_ray``
sets it for the raylet and the GCS); the cluster's processes are those that show it and their
descendants (:func:`cluster_processes`). :func:`kill_cluster_processes` SIGKILLs them.
:func:`start_watchdog` starts a small process (no Ray, no torch) that waits for the driver to end,
by any means, a SIGKILL or Ray's own exit of it included, and then does the same: the raylet's
agents otherwise outlive their raylet by Ray's fixed 60 s. Linux (/proc); elsewhere nothing is
found and nothing is killed.

Kept free of Ray and torch imports: the watchdog imports it.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Mapping

__all__ = [
    "CLUSTER_ENV",
    "cluster_mark",
    "cluster_processes",
    "kill_cluster_processes",
    "start_watchdog",
    "stop_watchdogs",
    "watch",
]

CLUSTER_ENV = "NEMO_DATAPLANE_RAY_CLUSTER"  # marks every process of a local cluster a run started
WATCHDOG_GRACE_S = 1.0  # after the driver is gone: its cluster's own exits first, then the kill
WATCH_EVERY_S = 1.0  # how often the watchdog notes the cluster's processes


def _proc_stat(pid: int) -> tuple[str, int, int] | None:
    """(state, parent pid, start time in clock ticks) of ``pid`` from /proc; None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return fields[0], int(fields[1]), int(fields[19])


def cluster_mark() -> str:
    """The value of :data:`CLUSTER_ENV` in the environment of every process of the local cluster
    this process starts: its pid and start time, unique on the host."""
    st = _proc_stat(os.getpid())
    return f"{os.getpid()}:{st[2] if st else 0}"


def cluster_processes(mark: str) -> dict[int, int]:
    """pid -> start time of every live process whose environment has :data:`CLUSTER_ENV` set to
    ``mark``, and of their descendants (/proc; Linux, empty elsewhere): the raylet, the GCS, their
    agents, the workers and what they started. Descendants count too: a process that renames
    itself (Ray's ``ray::DashboardAgent``, ``ray::IDLE``) may write its new title over the start
    of its environment as /proc shows it, the mark included."""
    needle = b"\0" + f"{CLUSTER_ENV}={mark}".encode() + b"\0"
    try:
        pids = [int(e) for e in os.listdir("/proc") if e.isdigit()]
    except OSError:
        return {}
    live: dict[int, tuple[int, int]] = {}  # pid -> (parent, start), zombies left out
    for pid in pids:
        st = _proc_stat(pid)
        if st is not None and st[0] != "Z" and pid != os.getpid():
            live[pid] = (st[1], st[2])
    out: dict[int, int] = {}
    for pid, (_, start) in live.items():
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if needle in b"\0" + f.read() + b"\0":
                    out[pid] = start
        except OSError:
            continue
    children: dict[int, list[int]] = {}
    for pid, (parent, _) in live.items():
        children.setdefault(parent, []).append(pid)
    stack = list(out)
    while stack:
        for child in children.get(stack.pop(), []):
            if child not in out:
                out[child] = live[child][1]
                stack.append(child)
    return out


def kill_cluster_processes(mark: str, grace_s: float, known: Mapping[int, int] | None = None) -> list[int]:
    """SIGKILL every process of the cluster marked ``mark`` (:func:`cluster_processes`, and those of
    ``known`` still alive: found earlier, since orphaned) left after ``grace_s`` (after
    ``ray.shutdown()``: all of them when ``ray.init`` was interrupted, else at most agents whose
    raylet went first). Returns the pids killed."""

    def left() -> dict[int, int]:
        out = {p: t for p, t in (known or {}).items() if _same(p, t)}
        out.update(cluster_processes(mark))
        return out

    deadline = time.monotonic() + grace_s
    while left() and time.monotonic() < deadline:
        time.sleep(0.05)
    killed: list[int] = []
    for _ in range(10):  # again while any is left: one may still have been starting (a worker)
        procs = left()
        if not procs:
            break
        for pid, start in procs.items():
            if _same(pid, start):  # the same process, not a reused pid
                try:
                    os.kill(pid, signal.SIGKILL)
                    killed.append(pid)
                except OSError:
                    pass
        time.sleep(0.1)
    return killed


def _same(pid: int, start: int) -> bool:
    """Whether ``pid`` is still the live process that started at ``start``."""
    st = _proc_stat(pid)
    return st is not None and st[0] != "Z" and st[2] == start


def start_watchdog(mark: str) -> subprocess.Popen[bytes]:
    """Start the process that kills the cluster marked ``mark`` once this one (the driver) is gone:
    it waits for the end of a pipe whose other end only this process holds."""
    r, w = os.pipe()  # not inherited by anything this process starts later (close-on-exec)
    path = os.pathsep.join(p for p in (q or os.getcwd() for q in sys.path) if os.path.isdir(p))  # "": the cwd
    env = {k: v for k, v in os.environ.items() if k != CLUSTER_ENV}
    try:
        proc = subprocess.Popen(
            [sys.executable, "-c", "from algorithms.cluster_procs import watch; watch()", str(r), mark],
            pass_fds=(r,),
            env={**env, "PYTHONPATH": path},
            stdin=subprocess.DEVNULL,
        )
    finally:
        os.close(r)
    _WATCHED.append((w, proc))  # held open until stop_watchdogs(), or for the life of this process
    return proc


_WATCHED: list[tuple[int, subprocess.Popen[bytes]]] = []


def stop_watchdogs(timeout_s: float = 5.0) -> None:
    """End this process's watchdogs (after a clean stop of their cluster): each sees its pipe end,
    makes its kill pass over what is left of the cluster (nothing, by then) and exits."""
    while _WATCHED:
        w, proc = _WATCHED.pop()
        try:
            os.close(w)
        except OSError:
            pass
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()


def watch(argv: list[str] | None = None) -> None:
    """The watchdog's body: ``argv`` = the pipe's read end, the cluster's mark. Every
    :data:`WATCH_EVERY_S` it notes the cluster's processes (so that those orphaned when the driver
    takes the raylet with it are still known); once the pipe ends it kills them."""
    fd, mark = (argv if argv is not None else sys.argv[1:])[:2]
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C is the driver's to handle
    known: dict[int, int] = {}
    while True:
        try:
            ready, _, _ = select.select([int(fd)], [], [], WATCH_EVERY_S)
            if ready and not os.read(int(fd), 1):  # b"": no process holds the write end any more
                break
        except OSError:
            break
        known = {p: t for p, t in known.items() if _same(p, t)}
        known.update(cluster_processes(mark))
    kill_cluster_processes(mark, WATCHDOG_GRACE_S, known)
