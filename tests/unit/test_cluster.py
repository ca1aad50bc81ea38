"""The Ray cluster a run starts for itself (algorithms.cluster.RunCluster): its idle workers are
what the run's actors take, so they must hold the run's environment and the store's imports; and
its stop leaves none of its processes behind."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from nemo_dataplane.adapters.transfer_queue.client import TransferQueueClient

REPO = Path(__file__).resolve().parents[2]

# In a process of its own: RunCluster starts a cluster, and this session already has one.
_PROBE = r"""
import json, os, sys
import ray
from algorithms.cluster import CLUSTER_ENV, RunCluster, cluster_pids
from algorithms.config import load_config
from algorithms.transports import make_transport

cfg = load_config("examples/configs/grpo_tiny.yaml", ["ray.num_cpus=2", "trainer.num_threads=3"])
modules = make_transport(cfg).actor_modules()
cluster = RunCluster(cfg, "probe", 1, modules)
cluster.start()
driver = {k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "TOKENIZERS_PARALLELISM")}


def report() -> dict:
    env = {k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "TOKENIZERS_PARALLELISM")}
    path = os.environ.get("PYTHONPATH", "").split(os.pathsep)
    return {
        "modules": {m: m in sys.modules for m in ("transfer_queue", "torch._dynamo")},
        "env": env,
        "cwd_on_path": os.getcwd() in path,
        "cluster": os.environ.get(CLUSTER_ENV),
    }


@ray.remote(num_cpus=0.25)
def task() -> dict:
    return report()


@ray.remote(num_cpus=0)
class Actor:  # as the trainer creates its workers on a cluster it started: no runtime_env
    def report(self) -> dict:
        return report()


# An idle worker imports its preload before it takes a task; a task may land on one still
# importing (then it waits for it), never on one that skipped it.
got = {"modules": list(modules), "driver": driver, "task": ray.get(task.remote(), timeout=120)}
got["actor"] = ray.get(Actor.remote().report.remote(), timeout=120)
got["id"], got["driver_tagged"] = cluster.id, os.environ.get(CLUSTER_ENV)
got["processes"] = len(cluster_pids(cluster.id))
cluster.stop()
got["left"] = cluster_pids(cluster.id)
print(json.dumps(got))
"""


def test_a_run_started_cluster_gives_its_idle_workers_the_run_env_and_the_store_modules() -> None:
    """A worker of the cluster (a task's, and an actor's without a runtime_env) has the store's
    ACTOR_MODULES imported ahead (not torch._dynamo), the run's thread count, no tokenizer
    threads, the driver's working directory on its import path and the cluster's id; the driver's
    own environment is left as it was. The stop leaves none of the cluster's processes (GCS,
    raylet, agents, workers: all found by that id)."""
    env = {"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1", "HOME": str(Path.home())}
    out = subprocess.run([sys.executable, "-c", _PROBE], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["modules"] == list(TransferQueueClient.ACTOR_MODULES)
    assert got["driver"] == {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": None}
    for who in ("task", "actor"):
        seen = got[who]
        assert seen["env"] == {"OMP_NUM_THREADS": "3", "TOKENIZERS_PARALLELISM": "false"}, who
        assert seen["cwd_on_path"], who
        assert seen["cluster"] == got["id"], who
    assert got["driver_tagged"] is None
    assert got["processes"] >= 5, "GCS, raylet, its two agents and the workers carry the id"
    assert got["left"] == []
    assert got["task"]["modules"] == {"transfer_queue": True, "torch._dynamo": False}
