"""Rank bodies for tests/unit/test_bounded_waits.py, run as ``python _wait_procs.py SCENARIO RANK WORLD INIT_FILE``.

Each prints one JSON line: what the rank raised and after how long.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import threading
import time

import torch
import torch.distributed as dist

from nemo_dataplane.distributed.stateless_group import call_with_deadline  # noqa: E402
from nemo_dataplane.meta import KVBatchMeta  # noqa: E402
from nemo_dataplane.worker.fetch import WorkerFetcher  # noqa: E402  (imported before the group forms)


def _fetcher(backend: str, timeout_s: float) -> WorkerFetcher:
    return WorkerFetcher(
        None,
        fetch_policy="leader_broadcast",
        replica_group=dist.group.WORLD,
        replica_ranks=list(range(dist.get_world_size())),
        timeout_s=timeout_s,
    )


def main() -> None:
    scenario, rank, world, init_file = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    if scenario == "deadline_thread":
        t0 = time.monotonic()
        try:
            call_with_deadline(threading.Event().wait, 0.5, "blocked-init")
        except TimeoutError as e:
            print(
                json.dumps({"error": type(e).__name__, "message": str(e), "elapsed": time.monotonic() - t0}), flush=True
            )
        return  # the blocked daemon thread must not keep the interpreter alive
    backend = "nccl" if scenario.endswith("_nccl") else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(
        backend, init_method=f"file://{init_file}", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120)
    )
    # Both ranks past the group's set-up before the leader goes silent or dies: a leader that
    # exits while the other rank still connects fails that rank's init, not the fetch under test.
    dist.barrier()
    meta = KVBatchMeta(keys=["a"], tags=[{}], partition_id="p")
    if rank == 0:  # the replica leader
        if scenario.startswith("silent_leader"):
            time.sleep(float(os.environ.get("LEADER_SLEEP_S", "300")))  # never broadcasts; the test kills it
        else:  # dead_leader: gone without a word
            os._exit(0)
        return
    fetcher = _fetcher(backend, float(os.environ.get("FETCH_TIMEOUT_S", "2")))
    t0 = time.monotonic()
    try:
        fetcher.fetch(meta, ["x"])
        out = {"error": None}
    except Exception as e:  # noqa: BLE001 - reported to the test
        out = {"error": type(e).__name__, "message": str(e)}
    out["elapsed"] = time.monotonic() - t0
    print(json.dumps(out), flush=True)
    os._exit(0)  # the group is broken; do not wait on its shutdown


if __name__ == "__main__":
    main()
