"""The Ray cluster a run uses: attach to ``ray.address``, or start one of its own."""

from __future__ import annotations

import os
import sys
from typing import Any

import ray
import torch

from algorithms.config import TrainerConfig, check_devices


def start_ray(cfg: TrainerConfig, name: str, generators: int, preload: tuple[str, ...] = ()) -> bool:
    """Attach to ``cfg.ray.address`` or start a local cluster (``num_cpus``, every visible GPU
    when a worker runs on CUDA, idle workers importing the modules in ``preload``); returns
    whether this call started the cluster (then the run stops it). A CUDA layout this machine
    cannot hold fails here, before any actor exists. A local start that hits Ray's fixed 30 s
    raylet wait is tried once more."""
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
            ray.init(address="local", num_cpus=cfg.ray.num_cpus, num_gpus=num_gpus, _system_config=system, **kwargs)
            break
        except Exception as e:  # noqa: BLE001 - Ray raises a bare Exception for this
            # Ray waits a fixed 30 s for its raylet; on a loaded machine a second try usually starts.
            if attempt == 2 or "timed out during startup" not in str(e):
                raise
            print(f"{name}: local Ray did not start within its 30 s ({e}); trying once more", file=sys.stderr)
            ray.shutdown()
    return True
