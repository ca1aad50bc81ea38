"""What a running trainer exposes: every listener the project opens is on loopback, Ray keeps its
token authentication on, and the job secret never reaches a file.

One real run (TransferQueue store, 2 policy ranks over gloo, gloo refit) with a known secret and
``GLOO_SOCKET_IFNAME`` pointing at a routable interface (the setting that once moved gloo off
loopback). While it trains, every listening socket of its process tree is listed (psutil); a
socket is Ray's own when it belongs to one of Ray's system processes or is a Ray worker's
core-worker port (from that worker's own log line). Everything else must be on loopback.
"""

from __future__ import annotations

import ipaddress
import json
import os
import random
import re
import secrets
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

psutil = pytest.importorskip("psutil")

pytestmark = pytest.mark.slow

# Ray's own processes (by command line): they listen where Ray decides and rely on its token auth.
RAY_SYSTEM = (
    "gcs_server",
    "raylet",
    "ray/dashboard",
    "ray/autoscaler",
    "log_monitor",
    "ray::DashboardAgent",
    "ray::RuntimeEnvAgent",
)
CORE_WORKER_PORT = re.compile(r"(?:worker|driver) server started, listening on port (\d+)")


def _routable_interface() -> tuple[str, str] | None:
    """(name, address) of an interface that is up and has a non-loopback IPv4 address: one gloo
    could really listen on (the first non-loopback name may be down, without an address)."""
    stats = psutil.net_if_stats()
    for name, addrs in sorted(psutil.net_if_addrs().items()):
        if name not in stats or not stats[name].isup:
            continue
        for a in addrs:
            if a.family == socket.AF_INET and not ipaddress.ip_address(a.address).is_loopback:
                return name, a.address
    return None


def _tree(pid: int) -> list[Any]:
    root = psutil.Process(pid)
    return [root, *root.children(recursive=True)]


def _session_dir(procs: list[Any]) -> Path:
    for p in procs:
        try:
            for arg in p.cmdline():
                if arg.startswith("--session_dir=") or arg.startswith("--session-dir="):
                    return Path(arg.split("=", 1)[1])
        except psutil.Error:
            continue
    raise AssertionError("no Ray process of the run names its session dir")


def _core_worker_ports(session: Path) -> dict[int, set[int]]:
    """pid -> the gRPC port Ray's core worker in that process listens on (its own log says)."""
    out: dict[int, set[int]] = {}
    for log in (session / "logs").glob("python-core-*.log"):
        pid = int(log.stem.rsplit("_", 1)[1])
        for m in CORE_WORKER_PORT.finditer(log.read_text(errors="replace")):
            out.setdefault(pid, set()).add(int(m.group(1)))
    return out


def _listeners(procs: list[Any]) -> list[tuple[int, str, str, int]]:
    out = []
    for p in procs:
        try:
            cmd = " ".join(p.cmdline())
            conns = p.net_connections("inet")
        except psutil.Error:  # exited meanwhile
            continue
        for c in conns:
            if c.status == psutil.CONN_LISTEN:
                out.append((p.pid, cmd[:120], c.laddr.ip, c.laddr.port))
    return out


def _cmd(p: Any) -> str:
    try:
        return " ".join(p.cmdline())
    except psutil.Error:
        return ""


def _env(p: Any) -> dict[str, str]:
    try:
        env: dict[str, str] = p.environ()
        return env
    except psutil.Error:
        return {}


def _files_containing(roots: list[Path], needle: bytes, since: float) -> list[str]:
    hits = []
    for root in roots:
        for dirpath, _, files in os.walk(root):
            for name in files:
                f = Path(dirpath) / name
                try:
                    st = f.lstat()
                    if not f.is_file() or st.st_mtime < since or st.st_size > 64 << 20:
                        continue
                    if needle in f.read_bytes():
                        hits.append(str(f))
                except OSError:
                    continue
    return hits


# What a stranger on this host might send: noise, a ZMTP greeting cut short, a frame whose length
# header claims 2^63 - 1 bytes, and a TCPStore-style request claiming a huge key.
HOSTILE: tuple[bytes, ...] = (
    b"\xff\x00\x00\x00\x00\x00\x00\x00\x01\x7f",
    b"\xff\x00\x00\x00\x00\x00\x00\x00\x01\x7f\x03\x00NULL" + b"\x00" * 16,
    b"\x02" + b"\x7f\xff\xff\xff\xff\xff\xff\xff" + b"A" * 64,
    b"\x00" + (2**62).to_bytes(8, "little") + b"key",
)


def _disturb(ports: list[int], seed: int) -> int:
    """Send every :data:`HOSTILE` payload and 4 KiB of random bytes to each loopback ``port``, one
    connection each, then hang up; returns the connections made."""
    rng = random.Random(seed)
    made = 0
    for port in ports:
        for payload in (*HOSTILE, rng.randbytes(4096)):
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=2) as s:
                    made += 1
                    s.sendall(payload)
            except OSError:  # refused, reset or slow: the listener's business
                continue
    return made


def _actors(procs: list[Any]) -> dict[int, str]:
    """pid -> command line of the run's own actors (Ray names their processes ``ray::<Class>``)."""
    out = {}
    for p in procs:
        try:
            cmd = " ".join(p.cmdline())
        except psutil.Error:
            continue
        if cmd.startswith("ray::") and "IDLE" not in cmd and "Agent" not in cmd:
            out[p.pid] = cmd
    return out


@pytest.fixture(scope="module")
def exposed_run(tmp_path_factory: pytest.TempPathFactory, trainer_command: Any) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("exposure")
    secret = secrets.token_hex(32)
    extra = {"NEMO_DATAPLANE_SECRET": secret}
    iface = _routable_interface()
    if iface:
        extra["GLOO_SOCKET_IFNAME"] = iface[0]
    overrides = ("trainer.steps=24", "trainer.val_every=0")
    cmd, env = trainer_command(out, *overrides)
    env.update(extra)
    # The same run, undisturbed, beside it: seeded sync runs are bitwise reproducible.
    quiet = tmp_path_factory.mktemp("undisturbed")
    qcmd, qenv = trainer_command(quiet, *overrides)
    t0 = time.time()
    repo = Path(__file__).resolve().parents[2]
    twin = subprocess.Popen(qcmd, cwd=repo, env=qenv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    proc = subprocess.Popen(cmd, cwd=repo, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    metrics = out / "metrics.jsonl"
    seen: list[tuple[int, str, str, int]] = []
    try:
        deadline = time.monotonic() + 400
        while time.monotonic() < deadline and proc.poll() is None:
            if metrics.exists() and len(metrics.read_text().splitlines()) >= 2:
                break
            time.sleep(0.1)
        assert proc.poll() is None, f"the run ended before it could be inspected: {proc.communicate()[1][-4000:]}"
        procs = _tree(proc.pid)
        seen = _listeners(procs)
        session = _session_dir(procs)
        ray_ports = _core_worker_ports(session)
        gcs_env = next(p.environ() for p in procs if "gcs_server" in " ".join(p.cmdline()))
        actors = _actors(procs)
        ranks_ifname = [_env(p).get("GLOO_SOCKET_IFNAME") for p in procs if "PolicyWorker" in _cmd(p)]
        connections = _disturb(sorted({port for *_, port in seen}), seed=len(seen))
        actors_after = _actors(_tree(proc.pid)) if proc.poll() is None else {}
        steps_at_attack_end = len(metrics.read_text().splitlines())
        stdout, stderr = proc.communicate(timeout=400)
        _, twin_err = twin.communicate(timeout=400)
    finally:
        for p in (proc, twin):
            if p.poll() is None:
                p.send_signal(signal.SIGKILL)
                p.wait()
    return {
        "proc": proc,
        "stdout": stdout,
        "stderr": stderr,
        "listeners": seen,
        "ray_ports": ray_ports,
        "gcs_env": gcs_env,
        "session": session,
        "out": out,
        "secret": secret,
        "t0": t0,
        "iface": iface,
        "ranks_ifname": ranks_ifname,
        "actors": actors,
        "actors_after": actors_after,
        "connections": connections,
        "steps_at_attack_end": steps_at_attack_end,
        "twin": twin,
        "twin_err": twin_err,
        "twin_out": quiet,
    }


def test_every_listener_the_run_opens_is_on_loopback(exposed_run: dict[str, Any]) -> None:
    assert exposed_run["proc"].returncode == 0, exposed_run["stderr"][-4000:]
    ours, ray_own = [], []
    for pid, cmd, ip, port in exposed_run["listeners"]:
        if any(m in cmd for m in RAY_SYSTEM) or port in exposed_run["ray_ports"].get(pid, set()):
            ray_own.append((pid, cmd, ip, port))
        else:
            ours.append((pid, cmd, ip, port))
    # The scan sees what it must: the store's controller (2 sockets) and the unit it holds (1;
    # transfer_queue.unit_in_controller), the train group's and refit group's stores, gloo's
    # listeners in every rank.
    assert len(ours) >= 6, f"too few listeners found to judge: {ours}; Ray's own: {ray_own}"
    assert sum("_Controller" in c for _, c, _, _ in ours) >= 3, ours
    exposed = [x for x in ours if not ipaddress.ip_address(x[2].split("%")[0]).is_loopback]
    assert exposed == [], f"listeners beyond loopback (pid, process, address, port): {exposed}"


def test_gloo_stays_on_loopback_with_gloo_socket_ifname_on_a_routable_interface(exposed_run: dict[str, Any]) -> None:
    if exposed_run["iface"] is None:
        pytest.skip("no interface here is up with a non-loopback IPv4 address for GLOO_SOCKET_IFNAME to name")
    name, address = exposed_run["iface"]
    # The setting reached the policy ranks (whose gloo groups it once moved off loopback) ...
    assert exposed_run["ranks_ifname"] and set(exposed_run["ranks_ifname"]) == {name}, exposed_run["ranks_ifname"]
    # ... and none of their listeners took that interface's address (nor any other beyond loopback).
    ray_own = exposed_run["ray_ports"]  # each rank's core-worker port is Ray's (token-guarded)
    ranks = [
        (ip, port)
        for pid, cmd, ip, port in exposed_run["listeners"]
        if "PolicyWorker" in cmd and port not in ray_own.get(pid, set())
    ]
    assert ranks, "the policy ranks listen (gloo, the train group's store): nothing found to judge"
    assert all(ipaddress.ip_address(ip.split("%")[0]).is_loopback for ip, _ in ranks), (address, ranks)


def test_ray_keeps_token_authentication_on(exposed_run: dict[str, Any]) -> None:
    # Ray's own listeners are on every interface; what guards them is Ray's token auth (on by
    # default in Ray 2.60). The run must not turn it off.
    assert exposed_run["gcs_env"].get("RAY_AUTH_MODE") == "token", exposed_run["gcs_env"].get("RAY_AUTH_MODE")


def test_the_job_secret_reaches_no_file(exposed_run: dict[str, Any]) -> None:
    assert exposed_run["proc"].returncode == 0, exposed_run["stderr"][-4000:]
    needle = exposed_run["secret"].encode()
    roots = [exposed_run["session"], exposed_run["out"], Path("/tmp")]
    hits = _files_containing(roots, needle, exposed_run["t0"] - 1)
    assert hits == [], f"the job secret was written to {hits}"
    # The scan reads what Ray wrote: the session's logs are there and were searched.
    assert any((exposed_run["session"] / "logs").glob("raylet.*"))


def _losses(out: Path) -> dict[int, tuple[Any, ...]]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return {int(r["step"]): tuple(r.get(k) for k in ("loss", "pg_loss", "kl", "reward", "grad_norm")) for r in rows}


def test_hostile_traffic_on_every_port_changes_nothing(exposed_run: dict[str, Any]) -> None:
    run = exposed_run
    assert run["proc"].returncode == 0, run["stderr"][-4000:]
    assert run["twin"].returncode == 0, run["twin_err"][-4000:]
    # The traffic really reached the ports, while the run was training (not after it ended).
    assert run["connections"] >= 5 * len({port for *_, port in run["listeners"]}) // 2, run["connections"]
    assert run["steps_at_attack_end"] < 24, "the run finished before the traffic ended: nothing was tested"
    # No process lost: every actor alive before the traffic was alive after it.
    assert set(run["actors"]) <= set(run["actors_after"]), (run["actors"], run["actors_after"])
    assert len(run["actors"]) >= 5, run["actors"]  # 2 policy ranks, generator, collector, store
    # Losses bitwise equal to the undisturbed run's, every step.
    disturbed, undisturbed = _losses(run["out"]), _losses(run["twin_out"])
    assert sorted(disturbed) == list(range(24)) and disturbed == undisturbed
