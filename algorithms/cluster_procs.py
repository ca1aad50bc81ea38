"""The processes of a local Ray cluster a run started, found by a mark in their environment, and
the watchdog that stops them when the run's driver is gone however it ended.

Every process of such a cluster (the raylet, the GCS, their agents, every worker and what it
starts) inherits :data:`CLUSTER_ENV` set to :func:`cluster_mark` (``algorithms.cluster.start_ray``
sets it for the raylet and the GCS). :func:`kill_cluster_processes` SIGKILLs what still carries it.
:func:`start_watchdog` starts a small process (no Ray, no torch) that waits for the driver to end,
by any means, a SIGKILL or Ray's own exit of it included, and then does the same: the raylet's
agents otherwise outlive their raylet by Ray's fixed 60 s. Linux (/proc); elsewhere nothing is
found and nothing is killed.

Kept free of Ray and torch imports: the watchdog imports it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

__all__ = ["CLUSTER_ENV", "cluster_mark", "cluster_processes", "kill_cluster_processes", "start_watchdog", "watch"]

CLUSTER_ENV = "NEMO_DATAPLANE_RAY_CLUSTER"  # marks every process of a local cluster a run started
WATCHDOG_GRACE_S = 1.0  # after the driver is gone: its cluster's own exits first, then the kill


def _proc_stat(pid: int) -> tuple[str, int] | None:
    """(state, start time in clock ticks) of ``pid`` from /proc; None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return fields[0], int(fields[19])


def cluster_mark() -> str:
    """The value of :data:`CLUSTER_ENV` in the environment of every process of the local cluster
    this process starts: its pid and start time, unique on the host."""
    st = _proc_stat(os.getpid())
    return f"{os.getpid()}:{st[1] if st else 0}"


def cluster_processes(mark: str) -> dict[int, int]:
    """pid -> start time of every live process whose environment has :data:`CLUSTER_ENV` set to
    ``mark`` (/proc; Linux, empty elsewhere): the raylet, the GCS, their agents, the workers and
    what they started."""
    needle = b"\0" + f"{CLUSTER_ENV}={mark}".encode() + b"\0"
    out: dict[int, int] = {}
    try:
        pids = [int(e) for e in os.listdir("/proc") if e.isdigit()]
    except OSError:
        return out
    for pid in pids:
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if needle not in b"\0" + f.read() + b"\0":
                    continue
        except OSError:
            continue
        st = _proc_stat(pid)
        if st is not None and st[0] != "Z" and pid != os.getpid():
            out[pid] = st[1]
    return out


def kill_cluster_processes(mark: str, grace_s: float) -> list[int]:
    """SIGKILL every process still marked ``mark`` (:func:`cluster_processes`) after ``grace_s``
    (after ``ray.shutdown()``: all of them when ``ray.init`` was interrupted, else at most agents
    whose raylet went first). Returns the pids killed."""
    deadline = time.monotonic() + grace_s
    while cluster_processes(mark) and time.monotonic() < deadline:
        time.sleep(0.05)
    killed: list[int] = []
    for _ in range(10):  # again while any is left: one may still have been starting (a worker)
        left = cluster_processes(mark)
        if not left:
            break
        for pid, start in left.items():
            st = _proc_stat(pid)
            if st is not None and st[1] == start:  # the same process, not a reused pid
                try:
                    os.kill(pid, signal.SIGKILL)
                    killed.append(pid)
                except OSError:
                    pass
        time.sleep(0.1)
    return killed


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
    _WATCHED.append(w)  # held open for the life of this process
    return proc


_WATCHED: list[int] = []


def watch(argv: list[str] | None = None) -> None:
    """The watchdog's body: ``argv`` = the pipe's read end, the cluster's mark."""
    fd, mark = (argv if argv is not None else sys.argv[1:])[:2]
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C is the driver's to handle
    try:
        while os.read(int(fd), 1):  # returns b"" once no process holds the write end
            pass
    except OSError:
        pass
    kill_cluster_processes(mark, WATCHDOG_GRACE_S)
