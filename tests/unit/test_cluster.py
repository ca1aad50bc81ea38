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


# A trainer whose Ctrl-C lands while Ray waits for its raylet to register: its GCS, raylet and the
# raylet's agents are up, Ray has not recorded its node yet (so ray.shutdown alone stops nothing),
# and the terminal's SIGINT reaches every process of the group, as a Ctrl-C does.
_CTRL_C = r"""
import json, os, signal, sys, time
import ray._private.services as services
from algorithms.config import load_config
from algorithms.grpo_sync import SyncTrainer

TAG = "PROBE_TAG=" + os.environ["PROBE_TAG"]


def run_processes():
    found = []
    for e in os.listdir("/proc"):
        if e.isdigit() and int(e) != os.getpid():
            try:
                with open(f"/proc/{e}/environ", "rb") as f:
                    if TAG.encode() in f.read().split(b"\0"):
                        with open(f"/proc/{e}/cmdline", "rb") as g:
                            found.append(g.read().replace(b"\0", b" ").decode()[:100])
            except OSError:
                pass
    return found


seen = {}


def ctrl_c_while_the_raylet_registers(*args, **kwargs):
    deadline = time.monotonic() + 120
    while not any("agent" in c.lower() for c in run_processes()) and time.monotonic() < deadline:
        time.sleep(0.05)
    seen["at_interrupt"] = run_processes()
    seen["t"] = time.monotonic()
    os.killpg(os.getpgid(0), signal.SIGINT)
    time.sleep(60)  # the interrupt lands here
    raise AssertionError("no KeyboardInterrupt within 60 s")


services.get_node = ctrl_c_while_the_raylet_registers
# Short, should Ray stop calling get_node (then the probe fails on a missing interrupt, quickly).
short = ["trainer.steps=1", "trainer.val_every=0", "checkpoint.every=0", "grpo.prompts_per_step=2", "generation.n=2"]
short += [f"logging.output_dir={sys.argv[1]}", "logging.plot=false"]
cfg = load_config("examples/configs/grpo_tiny.yaml", short)
code = SyncTrainer(cfg).run()
assert seen, "Ray never waited for its raylet through services.get_node: the probe must hook it elsewhere"
print(json.dumps({"code": code, "took": time.monotonic() - seen["t"], "at_interrupt": seen["at_interrupt"],
                  "left": run_processes()}))
"""


def test_ctrl_c_during_ray_start_leaves_no_process_of_the_run(tmp_path: Path) -> None:
    """Before: the run exited 130 with its GCS, raylet and agents alive (the agents for a minute
    or more after the driver). Now every one of them is gone when ``run`` returns."""
    import os
    import signal
    import uuid

    tag = uuid.uuid4().hex
    env = {"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1", "HOME": str(Path.home()), "PROBE_TAG": tag}
    env["RAY_USAGE_STATS_ENABLED"] = "0"
    out = subprocess.run(
        [sys.executable, "-c", _CTRL_C, str(tmp_path / "run")],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        start_new_session=True,  # the probe's SIGINT reaches its own group only
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        assert out.returncode == 0, out.stderr[-3000:]
        got = json.loads(out.stdout.strip().splitlines()[-1])
        assert got["code"] == 130, out.stderr[-3000:]
        names = " ".join(got["at_interrupt"])
        assert "gcs_server" in names and "raylet" in names and "agent" in names.lower(), got["at_interrupt"]
        assert got["left"] == [], got["left"]
        assert got["took"] < 30, got["took"]
    finally:  # never leave a probe's process behind, whatever failed
        for pid in os.listdir("/proc"):
            try:
                with open(f"/proc/{pid}/environ", "rb") as f:
                    if f"PROBE_TAG={tag}".encode() in f.read().split(b"\0"):
                        os.kill(int(pid), signal.SIGKILL)
            except (OSError, ValueError):
                pass
