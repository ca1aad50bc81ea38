"""The Ray cluster a run starts for itself (algorithms.cluster.start_ray): its idle workers are
what the run's actors take, so they must hold the run's environment and the store's imports."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from algorithms.cluster_procs import CLUSTER_ENV, cluster_mark, cluster_processes, kill_cluster_processes
from nemo_dataplane.adapters.transfer_queue.client import TransferQueueClient

REPO = Path(__file__).resolve().parents[2]

# In a process of its own: start_ray starts a cluster, and this session already has one.
_PROBE = r"""
import json, os, sys, time
import ray
from algorithms.cluster import start_ray, stop_ray
from algorithms.cluster_procs import CLUSTER_ENV, cluster_mark, cluster_processes
from algorithms.config import load_config
from algorithms.transports import make_transport

cfg = load_config("examples/configs/grpo_tiny.yaml", ["ray.num_cpus=2", "trainer.num_threads=3"])
modules = make_transport(cfg).actor_modules()
start_ray(cfg, "probe", 1, modules)
driver = {k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "TOKENIZERS_PARALLELISM")}


def report() -> dict:
    env = {k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "TOKENIZERS_PARALLELISM")}
    path = os.environ.get("PYTHONPATH", "").split(os.pathsep)
    return {
        "modules": {m: m in sys.modules for m in ("transfer_queue", "torch._dynamo")},
        "env": env,
        "cwd_on_path": os.getcwd() in path,
    }


@ray.remote(num_cpus=0.25)
def task() -> dict:
    return report()


@ray.remote(num_cpus=0)
class Actor:  # as the trainer creates its workers on a cluster it started: no runtime_env
    def report(self) -> dict:
        return {**report(), "mark": os.environ.get(CLUSTER_ENV)}


# An idle worker imports its preload before it takes a task; a task may land on one still
# importing (then it waits for it), never on one that skipped it.
got = {"modules": list(modules), "driver": driver, "task": ray.get(task.remote(), timeout=120)}
got["actor"] = ray.get(Actor.remote().report.remote(), timeout=120)
got["mark"], got["driver_mark"] = cluster_mark(), os.environ.get(CLUSTER_ENV)


def http_answers() -> list:
    # [command, port, HTTP status of GET /metrics or None] for every listener of the cluster
    import urllib.error
    import urllib.request

    import psutil

    out = []
    for pid in cluster_processes(cluster_mark()):
        try:
            p = psutil.Process(pid)
            cmd, conns = " ".join(p.cmdline())[:100], p.net_connections("inet")
        except psutil.Error:
            continue
        for c in conns:
            if c.status != psutil.CONN_LISTEN:
                continue
            host = "127.0.0.1" if c.laddr.ip in ("0.0.0.0", "::") else c.laddr.ip
            try:
                code = urllib.request.urlopen(f"http://{host}:{c.laddr.port}/metrics", timeout=2).status
            except urllib.error.HTTPError as e:
                code = e.code
            except Exception:
                code = None
            out.append([cmd, c.laddr.port, code])
    return out


# Probed once the dashboard agent listens (its metrics export, when on, starts with it).
for _ in range(120):
    got["http"] = http_answers()
    if any("DashboardAgent" in cmd or "dashboard/agent.py" in cmd for cmd, _, _ in got["http"]):
        break
    time.sleep(0.5)
got["marked"] = len(cluster_processes(cluster_mark()))
got["killed"] = stop_ray()
got["left"] = cluster_processes(cluster_mark())
print(json.dumps(got))
"""


def test_a_run_started_cluster_gives_its_idle_workers_the_run_env_and_the_store_modules() -> None:
    """A worker of the cluster (a task's, and an actor's without a runtime_env) has the store's
    ACTOR_MODULES imported ahead (not torch._dynamo), the run's thread count, no tokenizer
    threads and the driver's working directory on its import path; the driver's own environment
    is left as it was."""
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
    assert got["task"]["modules"] == {"transfer_queue": True, "torch._dynamo": False}
    # Every process of the cluster carries the run's mark (the driver's own environment does not),
    # and stopping the cluster leaves none of them.
    assert got["actor"]["mark"] == got["mark"] and got["driver_mark"] is None
    assert got["marked"] >= 4, "the raylet, the GCS, an agent and the actor's worker at least"
    assert got["left"] == {}, got["killed"]
    # No listener of the cluster answers an HTTP request without Ray's token: its Prometheus
    # endpoints (the dashboard agent's metrics export, the dashboard process's and the autoscaler
    # monitor's) are off, the agents' HTTP ports answer 401, the rest speak gRPC (token checked).
    assert any("DashboardAgent" in cmd or "dashboard/agent.py" in cmd for cmd, _, _ in got["http"]), got["http"]
    assert [x for x in got["http"] if x[2] is not None and x[2] != 401] == [], got["http"]


def _spawned(cmd: str, env: dict[str, str]) -> dict[str, int]:
    """``name=pid`` pairs a shell command prints (it backgrounds them and exits: orphans)."""
    out = subprocess.run(["sh", "-c", cmd], env=env, capture_output=True, text=True, check=True).stdout
    return {k: int(v) for k, v in (x.split("=") for x in out.split())}


# A process whose environment, as /proc shows it, lost the mark (Ray's workers and agents write
# their new title over its start), under a marked parent that lives ``life`` s: a raylet, its agent.
_RAYLET_AND_AGENT = (
    "sh -c 'env -u {env} sleep 300 >/dev/null 2>&1 & echo agent=$!; exec sleep {life} >/dev/null 2>&1' & echo raylet=$!"
)


def test_what_carries_a_clusters_mark_or_descends_from_it_is_killed_and_nothing_else() -> None:
    """After an interrupted ``ray.init`` (``ray.shutdown`` then stops nothing) or a raylet gone first
    (its agents orphaned): every process with the mark, and every descendant of one, is SIGKILLed,
    orphans included; a process with another run's mark is left alone."""
    mark = cluster_mark()
    env = {**os.environ, CLUSTER_ENV: mark}
    orphan = _spawned("sleep 300 >/dev/null 2>&1 & echo orphan=$!", env)["orphan"]  # an agent, its raylet gone
    child = subprocess.Popen(["sleep", "300"], env=env)
    pair = _spawned(_RAYLET_AND_AGENT.format(env=CLUSTER_ENV, life=300), env)
    raylet, unmarked = pair["raylet"], pair["agent"]
    other = subprocess.Popen(["sleep", "300"], env={**os.environ, CLUSTER_ENV: "4242:0"})
    try:
        ours = {orphan, child.pid, raylet, unmarked}
        assert set(cluster_processes(mark)) == ours
        assert set(kill_cluster_processes(mark, grace_s=0.2)) == ours
        assert child.wait(5) == -9 and other.poll() is None
        assert cluster_processes(mark) == {}
    finally:
        for p in (child, other):
            p.kill()
            p.wait()


_DRIVER = r"""
import os, subprocess, sys, time
from algorithms.cluster_procs import CLUSTER_ENV, cluster_mark, start_watchdog
mark = cluster_mark()
watchdog = start_watchdog(mark)
env = {**os.environ, CLUSTER_ENV: mark}
# An agent-like process that outlives its parent, and a child of the driver's own.
orphan = subprocess.run(["sh", "-c", "sleep 300 >/dev/null 2>&1 & echo $!"], env=env, capture_output=True, text=True)
child = subprocess.Popen(["sleep", "300"], env=env)
# A raylet that goes first (2 s), leaving its agent, whose /proc environment lost the mark.
out = subprocess.run(["sh", "-c", sys.argv[1]], env=env, capture_output=True, text=True).stdout
pair = dict(x.split("=") for x in out.split())
print(watchdog.pid, int(orphan.stdout), child.pid, pair["agent"], flush=True)
time.sleep(300)
"""


def test_the_watchdog_kills_the_cluster_when_the_driver_is_sigkilled() -> None:
    """A driver SIGKILLed runs no shutdown: the watchdog it started kills every process of its
    cluster (a raylet's agents would otherwise spend Ray's 60 s reporting to a dead GCS), those it
    saw descend from a marked one before they were orphaned too, then exits."""
    import signal
    import time

    raylet_and_agent = _RAYLET_AND_AGENT.format(env=CLUSTER_ENV, life=2)
    cmd = [sys.executable, "-c", _DRIVER, raylet_and_agent]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        watchdog, *marked = (int(x) for x in proc.stdout.readline().split())
        assert all(_alive(p) for p in (watchdog, *marked))
        time.sleep(3)  # the raylet-like parent has exited: its unmarked agent is an orphan now
        assert _alive(marked[-1])
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        deadline = time.monotonic() + 15
        while any(_alive(p) for p in (watchdog, *marked)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(_alive(p) for p in marked), "the marked processes outlived the driver"
        assert not _alive(watchdog), "the watchdog did not exit"
    finally:
        if proc.poll() is None:
            proc.kill()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


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
                            found.append(g.read().replace(b"\0", b" ").decode(errors="replace"))
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
