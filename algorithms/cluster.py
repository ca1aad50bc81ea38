"""The Ray cluster a run uses: attach to ``ray.address``, or start one of its own."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import ray
import torch

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
        ray.init(address=cfg.ray.address, **kwargs)
        return False
    num_gpus = torch.cuda.device_count() if "cuda" in (cfg.policy.device, cfg.generation.device) else 0
    for attempt in (1, 2):
        try:
            # address="local": a cluster of this run's own, even if `ray start` left one running.
            # The store's actors take idle workers: importing their modules ahead overlaps the
            # import (torch, seconds) with the rest of the start-up (docs/data-flow.md, "Start-up").
            system = {"preload_python_modules": list(preload)} if preload else None
            with _environ(worker_env(cfg)):  # the raylet, and so every worker, inherits it
                ray.init(address="local", num_cpus=cfg.ray.num_cpus, num_gpus=num_gpus, _system_config=system, **kwargs)
            break
        except Exception as e:  # noqa: BLE001 - Ray raises a bare Exception for this
            # Ray waits a fixed 30 s for its raylet; on a loaded machine a second try usually starts.
            if attempt == 2 or "timed out during startup" not in str(e):
                raise
            print(f"{name}: local Ray did not start within its 30 s ({e}); trying once more", file=sys.stderr)
            ray.shutdown()
    return True
