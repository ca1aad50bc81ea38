"""The Ray cluster a run uses: attach to ``ray.address``, or start one of its own and stop it, all
of it, however the run ends; and SIGTERM, which ends a run as Ctrl-C does.

Stopping a cluster the run started (:func:`stop_ray`) is ``ray.shutdown()`` and then a SIGKILL
of whatever of the cluster's processes is still up, each found by a mark in its environment
(:mod:`algorithms.cluster_procs`): a ``ray.init`` interrupted by a signal leaves the whole local
cluster running (``ray.shutdown()`` then stops nothing), and the raylet's dashboard and
runtime-env agents, once their raylet is gone, spend Ray's fixed 60 s trying to report it to the
GCS before they exit. Where the driver ends without its shutdown (a SIGKILL, or Ray's core worker
exiting it when the raylet or the GCS is lost), a watchdog process does the same.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import ray
import torch

from algorithms.cluster_procs import (
    CLUSTER_ENV,
    cluster_mark,
    cluster_processes,
    kill_cluster_processes,
    start_watchdog,
    stop_watchdogs,
)
from algorithms.config import TrainerConfig, check_devices


def worker_env(cfg: TrainerConfig) -> dict[str, str]:
    """The environment every worker process of a run needs: its thread count, no tokenizer
    thread pool, and the driver's import path (so a ``task.reward_fn`` module the driver can
    import, the collector can too)."""
    pythonpath = os.pathsep.join(p for p in [os.getcwd(), *sys.path[1:]] if p and os.path.isdir(p))
    return {
        "OMP_NUM_THREADS": str(cfg.trainer.num_threads),
        "TOKENIZERS_PARALLELISM": "false",
        "PYTHONPATH": pythonpath,
    }


@contextmanager
def _environ(extra: dict[str, str]) -> Iterator[None]:
    """``os.environ`` with ``extra`` set inside the block, restored after it."""
    saved = {k: os.environ.get(k) for k in extra}
    os.environ.update(extra)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


SIGTERM_EXIT = 143  # a run ended by SIGTERM (128 + 15), after the same shutdown as Ctrl-C's 130
# The ports of the Ray head's token-less Prometheus endpoints, set to one no socket can take.
RAY_METRICS_OFF = {"DASHBOARD_METRIC_PORT": "-1", "AUTOSCALER_METRIC_PORT": "-1"}


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised in the main thread as Ctrl-C raises ``KeyboardInterrupt`` (so the run stops
    the same way); the run then exits :data:`SIGTERM_EXIT`."""


def _raise_terminated(signum: int, frame: Any) -> None:
    raise Terminated("SIGTERM")


def raise_on_sigterm() -> None:
    """From now on SIGTERM raises :class:`Terminated` in the main thread (a no-op off it).
    ``ray.init`` installs a handler of its own: :func:`start_ray` calls this again after it."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _raise_terminated)


@contextmanager
def signals_ignored() -> Iterator[None]:
    """SIGINT and SIGTERM ignored inside the block (main thread; elsewhere a no-op): a second
    Ctrl-C or a SIGTERM during the run's shutdown must not cut it short."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    saved = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)


def _init(**kwargs: Any) -> None:
    """``ray.init``, with SIGTERM meaning :class:`Terminated` before, during and after it (inside
    it Ray's own handler raises ``SystemExit(SIGTERM)``)."""
    try:
        ray.init(**kwargs)
    except SystemExit as e:
        if e.code != signal.SIGTERM:
            raise
        raise Terminated("SIGTERM while Ray started") from None
    finally:
        raise_on_sigterm()


def stop_ray(grace_s: float = 2.0) -> list[int]:
    """Stop the local cluster this process started, a half-started one too: ``ray.shutdown()``,
    then :func:`kill_cluster_processes` of what is left (listed before: once the raylet is gone,
    its agents are no longer its descendants), then its watchdog. Returns the pids killed."""
    mark = cluster_mark()
    before = cluster_processes(mark)
    try:
        ray.shutdown()
    except Exception as e:  # noqa: BLE001 - what is left is killed below
        print(f"ray.shutdown failed: {e!r}", file=sys.stderr)
    killed = kill_cluster_processes(mark, grace_s, before)
    stop_watchdogs()  # the cluster is gone: its watchdog has nothing left to wait for
    return killed


def start_ray(cfg: TrainerConfig, name: str, generators: int, preload: tuple[str, ...] = ()) -> bool:
    """Attach to ``cfg.ray.address`` or start a local cluster (``num_cpus``, every visible GPU
    when a worker runs on CUDA, idle workers importing the modules in ``preload``); returns
    whether this call started the cluster (then the run stops it). A CUDA layout this machine
    cannot hold fails here, before any actor exists. A local start that hits Ray's fixed 30 s
    raylet wait is tried once more.

    A local cluster's processes start with :func:`worker_env` in their environment, so the
    run's actors need no ``runtime_env`` and Ray hands them its prestarted idle workers (an
    actor with a ``runtime_env`` always gets a new process). On an attached
    cluster the actors carry :func:`worker_env` as their ``runtime_env`` instead."""
    check_devices(cfg, generators=generators)
    # Errors are surfaced through gather(); refs abandoned after a failure (peers of the rank
    # that raised) would otherwise print their own, secondary tracebacks at shutdown.
    os.environ.setdefault("RAY_IGNORE_UNHANDLED_ERRORS", "1")
    kwargs: dict[str, Any] = {"include_dashboard": False, "log_to_driver": False, "logging_level": "ERROR"}
    if cfg.ray.address:
        _init(address=cfg.ray.address, **kwargs)
        return False
    num_gpus = torch.cuda.device_count() if "cuda" in (cfg.policy.device, cfg.generation.device) else 0
    start_watchdog(cluster_mark())  # stops the cluster should this process end without stop_ray
    for attempt in (1, 2):
        try:
            # address="local": a cluster of this run's own, even if `ray start` left one running.
            # The store's actors take idle workers: importing their modules ahead overlaps the
            # import (torch, seconds) with the rest of the start-up (docs/data-flow.md, "Start-up").
            # Ray's Prometheus endpoints answer without Ray's token, on every interface: its metrics
            # export (the dashboard agent's) is off, and the head's two (the dashboard process's
            # and the autoscaler monitor's) get a port they cannot bind (RAY_METRICS_OFF): Ray
            # logs the failed start and goes on. The run exports its own (logging.prometheus_port).
            system: dict[str, Any] = {"enable_metrics_collection": False}
            if preload:
                system["preload_python_modules"] = list(preload)
            # The raylet, and so every worker, inherits it; the mark finds them all at the end.
            with _environ({**worker_env(cfg), **RAY_METRICS_OFF, CLUSTER_ENV: cluster_mark()}):
                _init(address="local", num_cpus=cfg.ray.num_cpus, num_gpus=num_gpus, _system_config=system, **kwargs)
            break
        except Exception as e:  # noqa: BLE001 - Ray raises a bare Exception for this
            # Ray waits a fixed 30 s for its raylet; on a loaded machine a second try usually starts.
            if attempt == 2 or "timed out during startup" not in str(e):
                raise
            print(f"{name}: local Ray did not start within its 30 s ({e}); trying once more", file=sys.stderr)
            ray.shutdown()
    return True
