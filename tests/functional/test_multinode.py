"""Several Ray nodes on one machine (``ray.cluster_utils.Cluster``): both backends read bit-exact
across nodes, TransferQueue runs one storage unit per node, and ``grpo_sync`` trains with its
workers on different nodes. One subprocess (``multinode_check.py``) does it all, since the
cluster must not meet the test session's own Ray."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def result(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("multinode")
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "TQ_LOGGING_LEVEL": "ERROR"}
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.run(
        [sys.executable, str(REPO / "tests" / "functional" / "multinode_check.py"), str(out)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=840,
    )
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("backend", ["ray", "transfer_queue"])
def test_rows_put_on_one_node_read_bit_exact_on_another(result: dict[str, Any], backend: str) -> None:
    r = result[backend]
    assert len(result["nodes"]) == 3
    assert len({r["writer_node"], r["reader_node"], r["driver_node"]}) == 3, r
    assert r["errors"] == []


def test_ray_backend_rows_outlive_a_writer_on_another_node(result: dict[str, Any]) -> None:
    r = result["ray"]
    assert r["unflushed"] == 0 and r["after_writer_died_errors"] == []


def test_transfer_queue_runs_a_storage_unit_on_every_node_readable_by_its_own_client(result: dict[str, Any]) -> None:
    r = result["transfer_queue"]
    assert r["unit_nodes"] == result["nodes"]
    assert r["tq_own_reader_errors"] == []


def test_grpo_sync_trains_with_its_workers_spread_over_nodes(result: dict[str, Any]) -> None:
    t = result["trainer"]
    assert t["returncode"] == 0, t["stderr"]
    s = t["summary"]
    assert s["status"] == "finished" and s["steps"] == 3 and s["keys_outstanding_at_exit"] == 0
    assert s["keys_leaked_at_exit"] == 0, "counted before the final clear"
    nodes = s["worker_nodes"]
    assert len({nodes["policy0"], nodes["policy1"], nodes["generator"]}) == 3, nodes
