"""Store start-up after Ray, for ``bench_data_plane.py`` (``--only-startup``, ``--startup-runs``):
each run a fresh interpreter with torch and a running Ray that imports the backend, creates its
store and does one put + get; TransferQueue also on a Ray started as the trainer starts it."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]

STARTUP = r"""
import json, os, sys, time
import torch, ray                                   # a trainer's driver has these already
sys.path.insert(0, sys.argv[2])
# "preload": as the trainer starts Ray (algorithms/cluster.py): idle workers import these ahead.
system = {"preload_python_modules": sys.argv[4].split(",")} if sys.argv[3] == "preload" else None
t = time.perf_counter()
ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False, _system_config=system)
ray_s = time.perf_counter() - t
t0 = time.perf_counter()
if sys.argv[1] == "ray":
    from nemo_dataplane.adapters.ray_store.client import RayStoreClient as C
else:
    from nemo_dataplane.adapters.transfer_queue.client import TransferQueueClient as C
t1 = time.perf_counter()
client = C(None, bootstrap=True)
t2 = time.perf_counter()
x = {"x": torch.arange(8 * 16).view(8, 16)}
meta = client.kv_batch_put([f"k{i}" for i in range(8)], "p", x)
assert torch.equal(client.kv_batch_get(meta, ["x"])["x"], x["x"])
t3 = time.perf_counter()
client.close()
ray.shutdown()
phases = {f"phase.{k}": v for k, v in getattr(client, "startup_phases", {}).items()}
print(json.dumps({"ray_init_s": ray_s, "import_s": t1 - t0, "create_s": t2 - t1, "store_up_s": t2 - t0,
                  "first_put_get_s": t3 - t2, **phases}))
"""


def startup_once(backend: str, preload: bool = False) -> dict[str, float]:
    from nemo_dataplane.factory import resolve_backend

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("RAY_ADDRESS", None)
    env.pop("RAY_preload_python_modules", None)
    modules = ",".join(resolve_backend(backend).ACTOR_MODULES)
    proc = subprocess.run(
        [sys.executable, "-c", STARTUP, backend, str(REPO), "preload" if preload else "-", modules],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"start-up run of {backend} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def measure_startup(runs: int) -> dict[str, Any]:
    """Median of each phase over ``runs`` fresh interpreters per variant, the variants taken in
    turn each round (so a change in the machine's load hits them alike); each run's store-up
    time is kept.

    ``tq_as_trainer``: ``transfer_queue`` on a Ray started as the trainer starts it, with
    ``preload_python_modules`` = the client's ``ACTOR_MODULES``: the workers Ray prestarts when
    the driver connects import them before they take work (a cluster setting: every idle
    worker of that cluster does).
    """
    variants = {
        "ray": ("ray", False),
        "transfer_queue": ("transfer_queue", False),
        "tq_as_trainer": ("transfer_queue", True),
    }
    each: dict[str, list[dict[str, float]]] = {v: [] for v in variants}
    for _ in range(runs):
        for v, (backend, pre) in variants.items():
            each[v].append(startup_once(backend, pre))
    out: dict[str, Any] = {}
    for v, rs in each.items():
        out[v] = {k: statistics.median(r[k] for r in rs) for k in rs[0]}
        out[v]["store_up_s_runs"] = [r["store_up_s"] for r in rs]
    return out


def report_startup(start: dict[str, Any]) -> None:
    if not start:
        return
    print("\nStore start-up after Ray (import + create; torch and Ray already loaded), median s:")
    for name, v in start.items():
        runs = " ".join(f"{x:.2f}" for x in v["store_up_s_runs"])
        print(
            f"  {name:>14}: store up {v['store_up_s']:.2f} (import {v['import_s']:.2f} + create {v['create_s']:.2f}),"
            f" first put+get {v['first_put_get_s']:.2f}, ray.init {v['ray_init_s']:.2f}; runs: {runs}"
        )
        # What the backend measured inside create (the TransferQueue adapter's startup_phases).
        phases = {k.removeprefix("phase."): x for k, x in v.items() if k.startswith("phase.")}
        if phases:
            print(" " * 18 + ", ".join(f"{k} {x:.2f}" for k, x in phases.items()))
