"""The Ray cluster a run uses: attach to ``ray.address``, or start one of its own and stop it,
every process of it, however far its start got (:class:`RunCluster`)."""

from __future__ import annotations

import os
import signal
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import ray
import torch

from algorithms.config import TrainerConfig, check_devices

__all__ = ["CLUSTER_ENV", "RunCluster", "cluster_pids", "worker_env"]

# Every process of a local cluster a run starts (GCS, raylet, its agents, the workers and what
# they spawn) carries the cluster's id in this variable: the run finds them by it at its end,
# including agents whose raylet is already gone (they outlive it by a minute or more otherwise).
CLUSTER_ENV = "NEMO_DATAPLANE_CLUSTER"


def worker_env(cfg: TrainerConfig) -> dict[str, str]:
    """The environment every worker process of a run needs: its thread count, no tokenizer
    thread pool, and the driver's import path (so a ``task.reward_fn`` module the driver can
    import, the collector can too): the driver's working directory and ``sys.path`` without its
    first entry (the directory of the script the driver runs, not the workers')."""
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


def cluster_pids(cluster_id: str) -> list[int]:
    """The live processes of this machine whose environment holds ``CLUSTER_ENV=cluster_id``
    (read from ``/proc``; empty where there is none), this process excepted."""
    want = f"{CLUSTER_ENV}={cluster_id}".encode()
    try:
        entries = os.listdir("/proc")
    except OSError:
        return []
    pids = []
    for entry in entries:
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:  # a zombie's is empty: it has exited
                if want in f.read().split(b"\0"):
                    pids.append(int(entry))
        except OSError:  # gone meanwhile, or another user's
            continue
    return pids


class RunCluster:
    """The Ray cluster of one run: ``ray.address``'s (attached; left running at the end), or a
    local one the run starts (:meth:`start`) and stops (:meth:`stop`).

    A local cluster's processes start with :func:`worker_env` in their environment, so the
    run's actors need no ``runtime_env`` and Ray hands them its prestarted idle workers (an
    actor with a ``runtime_env`` always gets a new process). On an attached cluster the actors
    carry :func:`worker_env` as their ``runtime_env`` instead. They also carry
    ``CLUSTER_ENV=<id>``, by which :meth:`stop` finds every one of them.
    """

    def __init__(self, cfg: TrainerConfig, name: str, generators: int, preload: tuple[str, ...] = ()) -> None:
        self.cfg = cfg
        self.name = name
        self.generators = generators
        self.preload = preload
        self.id = uuid.uuid4().hex
        # Set before ray.init is called: an interrupt inside it still leaves processes to stop.
        self.owned = False

    def start(self) -> None:
        """Attach to ``cfg.ray.address`` or start a local cluster (``num_cpus``, every visible GPU
        when a worker runs on CUDA, idle workers importing the modules in ``preload``). A CUDA
        layout this machine cannot hold fails here, before any process exists. A local start that
        hits Ray's fixed 30 s raylet wait is tried once more."""
        cfg = self.cfg
        check_devices(cfg, generators=self.generators)
        # Errors are surfaced through gather(); refs abandoned after a failure (peers of the rank
        # that raised) would otherwise print their own, secondary tracebacks at shutdown.
        os.environ.setdefault("RAY_IGNORE_UNHANDLED_ERRORS", "1")
        kwargs: dict[str, Any] = {"include_dashboard": False, "log_to_driver": False, "logging_level": "ERROR"}
        if cfg.ray.address:
            ray.init(address=cfg.ray.address, **kwargs)
            return
        num_gpus = torch.cuda.device_count() if "cuda" in (cfg.policy.device, cfg.generation.device) else 0
        # The store's actors take idle workers: importing their modules ahead overlaps the import
        # (torch, seconds) with the rest of the start-up (docs/data-flow.md, "Start-up").
        system = {"preload_python_modules": list(self.preload)} if self.preload else None
        env = {**worker_env(cfg), CLUSTER_ENV: self.id}
        self.owned = True
        for attempt in (1, 2):
            try:
                # address="local": a cluster of this run's own, even if `ray start` left one running.
                with _environ(env):  # the raylet, and so every worker, inherits it
                    ray.init(
                        address="local", num_cpus=cfg.ray.num_cpus, num_gpus=num_gpus, _system_config=system, **kwargs
                    )
                return
            except Exception as e:  # noqa: BLE001 - Ray raises a bare Exception for this
                # Ray waits a fixed 30 s for its raylet; on a loaded machine a second try usually starts.
                if attempt == 2 or "timed out during startup" not in str(e):
                    raise
                print(f"{self.name}: local Ray did not start within its 30 s ({e}); trying once more", file=sys.stderr)
                self.stop()

    def stop(self, grace_s: float = 2.0) -> list[int]:
        """Stop the local cluster this run started, whatever state its start reached: Ray's own
        shutdown, then every process still carrying the cluster's id (agents whose raylet is gone
        wait a minute for the GCS otherwise) gets ``grace_s`` seconds to exit and is then
        SIGKILLed. Returns the pids killed. On an attached cluster: nothing (it is not the run's)."""
        if not self.owned:
            return []
        try:
            ray.shutdown()
        except Exception as e:  # noqa: BLE001 - a start cut short leaves Ray half set up
            print(f"{self.name}: ray.shutdown failed ({e!r}); stopping the cluster's processes", file=sys.stderr)
        deadline = time.monotonic() + grace_s
        left = cluster_pids(self.id)
        while left and time.monotonic() < deadline:
            time.sleep(0.1)
            left = cluster_pids(self.id)
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:  # exited meanwhile
                pass
        deadline = time.monotonic() + 5.0
        while cluster_pids(self.id) and time.monotonic() < deadline:
            time.sleep(0.05)
        return left
