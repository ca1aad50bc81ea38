"""Multi-node checks on one machine, run by ``test_multinode.py`` in a fresh interpreter.

``python tests/functional/multinode_check.py OUT_DIR`` starts a 3-node Ray cluster
(``ray.cluster_utils.Cluster``: a head and two nodes, one CPU each), then:

1. for each backend (``ray``, ``transfer_queue`` with one storage unit per node), a writer actor
   on node ``n1`` puts a batch, a reader actor on node ``n2`` reads it (shuffled), and the
   driver compares it bit for bit with what was put; for TransferQueue the reader also reads
   through TransferQueue's own ``kv_batch_get``; for the Ray backend the writer is then killed
   and the rows are read again (they are owned by the store, not the writer);
2. runs ``python -m algorithms.grpo_sync`` against the cluster with ``data_plane.backend=ray``
   and ``ray.worker_num_cpus=1``, so its two policy ranks and the generator can only fit on three
   different nodes.

It prints one JSON line with what it found; the test asserts on it. Every wait is bounded.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

import ray  # noqa: E402
import torch  # noqa: E402
from ray.cluster_utils import Cluster  # noqa: E402

from nemo_dataplane.factory import build_data_plane_client  # noqa: E402
from nemo_dataplane.testing.fields import assert_same_field, from_wire, jagged, random_field, to_wire  # noqa: E402

TIMEOUT_S = 120
STORE_MB = 150


def batch(n: int) -> dict[str, torch.Tensor]:
    """Random bits; big enough (> 100 KB) that Ray keeps it in shared memory, not inline."""
    return {
        "ids": jagged([50_000 + 997 * i for i in range(n)], seed=1),
        "logp": random_field((n, 20_000), torch.bfloat16, seed=2),
        "reward": random_field((n,), torch.float32, seed=3),
    }


@ray.remote(num_cpus=0)
class Peer:
    def __init__(self, cfg: dict[str, Any]) -> None:
        self.client = build_data_plane_client(cfg, bootstrap=False)

    def node(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def put(self, pid: str, n: int) -> Any:
        return self.client.kv_batch_put([f"k{i}" for i in range(n)], pid, batch(n))

    def flush(self) -> int:
        return self.client.flush() if hasattr(self.client, "flush") else 0

    def get(self, meta: Any, fields: list[str]) -> dict[str, Any]:
        return to_wire(self.client.kv_batch_get(meta, fields))

    def tq_get(self, keys: list[str], pid: str, fields: list[str]) -> dict[str, Any]:
        import transfer_queue as tq

        from nemo_dataplane.adapters.transfer_queue.client import admit_transfer_queue_clients

        admit_transfer_queue_clients()  # the store's wire keys on TransferQueue's sockets here
        tq.init()  # attaches to the running controller; never tq.close() (it would kill it)
        return to_wire(tq.kv_batch_get(keys=keys, partition_id=pid, select_fields=fields))


def compare(got_wire: dict[str, Any], order: list[int], n: int) -> list[str]:
    want, got = batch(n), from_wire(got_wire)
    errors = []
    for name, t in want.items():
        if name not in got:
            errors.append(f"{name}: missing")
            continue
        rows = list(t.unbind()) if t.is_nested else list(t)
        picked = [rows[i] for i in order]
        ref = torch.nested.as_nested_tensor(picked, layout=torch.jagged) if t.is_nested else torch.stack(picked)
        try:
            assert_same_field(name, got[name], ref)
        except AssertionError as e:
            errors.append(str(e))
    return errors


def check_backend(cfg: dict[str, Any]) -> dict[str, Any]:
    driver = build_data_plane_client(cfg, bootstrap=True)
    writer = Peer.options(resources={"n1": 0.01}).remote(cfg)
    reader = Peer.options(resources={"n2": 0.01}).remote(cfg)
    out: dict[str, Any] = {}
    try:
        out["writer_node"], out["reader_node"] = ray.get(
            [writer.node.remote(), reader.node.remote()], timeout=TIMEOUT_S
        )
        out["driver_node"] = ray.get_runtime_context().get_node_id()
        pid, n = f"mn-{uuid.uuid4().hex[:6]}", 6
        meta = ray.get(writer.put.remote(pid, n), timeout=TIMEOUT_S)
        order = [4, 1, 5, 0, 3, 2]
        fields = ["ids", "logp", "reward"]
        out["errors"] = compare(ray.get(reader.get.remote(meta.reorder(order), fields), timeout=TIMEOUT_S), order, n)
        if cfg["backend"] == "transfer_queue":
            units = [
                ray.get_actor(f"TransferQueueController.StorageUnit#{i}", namespace="transfer_queue")
                for i in range(driver.num_storage_units)
            ]
            out["unit_nodes"] = sorted(ray.get([u.__ray_call__.remote(_node_of) for u in units], timeout=TIMEOUT_S))
            keys = [meta.keys[i] for i in order]
            # TransferQueue's own client returns every non-scalar field jagged
            raw = ray.get(reader.tq_get.remote(keys, pid, fields), timeout=TIMEOUT_S)
            raw["logp"] = _dense(raw["logp"])
            out["tq_own_reader_errors"] = compare(raw, order, n)
        else:
            out["unflushed"] = ray.get(writer.flush.remote(), timeout=TIMEOUT_S)
            ray.kill(writer)
            time.sleep(1)
            out["after_writer_died_errors"] = compare(
                ray.get(reader.get.remote(meta, fields), timeout=TIMEOUT_S), list(range(n)), n
            )
        driver.kv_clear(None, pid)
    finally:
        for a in (writer, reader):
            ray.kill(a)
        driver.close()
    return out


def _node_of(actor: Any) -> str:
    return ray.get_runtime_context().get_node_id()


def _dense(wire: Any) -> Any:
    """A field TransferQueue returned jagged though every row has one shape, back to dense."""
    if wire[0] != "j":
        return wire
    values, offsets = wire[1], wire[2]
    n = offsets.numel() - 1
    return ("d", values.reshape(n, -1) if n else values)


def run_trainer(address: str, out_dir: Path) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "RAY_DEDUP_LOGS": "0"}
    env.pop("RAY_ADDRESS", None)
    cmd = [
        sys.executable,
        "-m",
        "algorithms.grpo_sync",
        "--config",
        str(REPO / "examples" / "configs" / "grpo_tiny.yaml"),
        f"ray.address={address}",
        "ray.worker_num_cpus=1",
        "data_plane.enabled=true",
        "data_plane.backend=ray",
        "trainer.steps=3",
        "trainer.val_every=0",
        "trainer.step_timeout_s=120",
        "trainer.startup_timeout_s=240",
        "task.val_size=0",
        "checkpoint.every=0",
        "logging.progress=false",
        "logging.plot=false",
        "grpo.prompts_per_step=4",
        "generation.n=4",
        "data_plane.packing.micro_batch_size=4",
        f"logging.output_dir={out_dir}",
    ]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=420)
    summary = json.loads((out_dir / "summary.json").read_text()) if (out_dir / "summary.json").exists() else {}
    return {"returncode": proc.returncode, "summary": summary, "stderr": proc.stderr[-3000:]}


def main() -> None:
    out_dir = Path(sys.argv[1])
    obj = STORE_MB * 1024 * 1024
    cluster = Cluster(
        initialize_head=True, head_node_args={"num_cpus": 1, "resources": {"head": 1}, "object_store_memory": obj}
    )
    result: dict[str, Any] = {}
    try:
        for i in (1, 2):
            cluster.add_node(num_cpus=1, resources={f"n{i}": 1}, object_store_memory=obj)
        cluster.wait_for_nodes(timeout=TIMEOUT_S)
        ray.init(address=cluster.address, log_to_driver=False)
        result["nodes"] = sorted(n["NodeID"] for n in ray.nodes() if n["Alive"])
        result["ray"] = check_backend({"backend": "ray", "backend_kwargs": {"actor_name": "mn.RayStoreIndex"}})
        result["transfer_queue"] = check_backend(
            {  # default names: tq.init() in the reader attaches
                "backend": "transfer_queue",
                "transfer_queue": {
                    "storage_placement": "per_node",
                    "storage_unit_num_cpus": 0.25,
                    "controller_num_cpus": 0.25,
                },
            }
        )
        result["trainer"] = run_trainer(cluster.address, out_dir / "trainer")
    finally:
        ray.shutdown()
        cluster.shutdown()
    print(json.dumps(result))


if __name__ == "__main__":
    main()
