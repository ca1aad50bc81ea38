"""The store faults of algorithms.faults against a real TransferQueue store in the session's Ray:
``maybe_kill_store`` kills the named actor, and the adapter then fails every op within its
liveness bound (not ``op_timeout_s``) with an error naming the dead controller or storage unit;
closing the client of a dead store returns promptly."""

from __future__ import annotations

import time
import uuid
from typing import Any

import pytest
import torch

from algorithms.config import DebugConfig
from algorithms.faults import maybe_kill_store
from nemo_dataplane.config import DataPlaneConfig

pytestmark = pytest.mark.usefixtures("ray_session")


def _store(name: str, unit_in_controller: bool | None = None) -> Any:
    from nemo_dataplane.adapters.transfer_queue.client import TransferQueueClient
    from nemo_dataplane.config import TransferQueueConfig

    # No CPUs reserved: the session cluster's 2 CPUs are shared with its own store.
    cfg = TransferQueueConfig(
        num_storage_units=1,
        controller_num_cpus=0,
        storage_unit_num_cpus=0,
        op_timeout_s=120,
        bootstrap_timeout_s=120,
        unit_in_controller=unit_in_controller,
    )
    return TransferQueueClient(cfg, bootstrap=True, controller_name=name)


@pytest.mark.parametrize(
    "point, hosted, named",
    [
        ("store_unit", False, "TransferQueue storage unit"),
        ("store_controller", False, "TransferQueue controller"),
        # The controller holds the unit (the default with one unit): unit 0 dies with its process.
        ("store_unit", True, "TransferQueue controller .* \\(and its storage unit"),
    ],
)
def test_a_killed_store_actor_fails_the_next_op_naming_it_within_the_bound(
    point: str, hosted: bool, named: str, tmp_path
) -> None:
    from nemo_dataplane.adapters.transfer_queue.client import LIVENESS_EVERY_S, LIVENESS_PING_S, StoreLostError

    name = f"chaos_{point}_{uuid.uuid4().hex[:6]}"
    client = _store(name, unit_in_controller=hosted)
    try:
        client.kv_batch_put(["a", "b"], "p", {"x": torch.arange(2.0)})
        debug = DebugConfig(fail_in=point, fail_at_step=2, fault_marker=str(tmp_path / "m"))
        dp = DataPlaneConfig.from_dict({"backend": "transfer_queue", "backend_kwargs": {"controller_name": name}})
        assert maybe_kill_store(debug, 1, dp) is None  # another step: nothing happens
        killed = maybe_kill_store(debug, 2, dp)
        assert killed == (name if point == "store_controller" or hosted else f"{name}.StorageUnit#0")
        t0 = time.monotonic()
        with pytest.raises(StoreLostError, match=f"{named} .* died or was lost"):
            client.kv_batch_put(["c"], "p", {"x": torch.ones(1)})
        took = time.monotonic() - t0
        assert took < LIVENESS_EVERY_S + LIVENESS_PING_S + 2, took  # not op_timeout_s=120
        t0 = time.monotonic()
        with pytest.raises(StoreLostError, match=named):  # every later op fails at once
            client.kv_partitions()
        assert time.monotonic() - t0 < 0.5
    finally:
        t0 = time.monotonic()
        client.close()
        assert time.monotonic() - t0 < 15  # teardown of a dead store is bounded (10 s storage shutdown wait)


def test_a_live_store_is_not_reported_lost_during_a_long_claim(tq_client) -> None:
    # A claim that waits several liveness periods for rows that never come is a timeout, not a loss.
    pid = f"liveness_{uuid.uuid4().hex[:6]}"
    tq_client.kv_batch_put(["k"], pid, {"x": torch.ones(1)})
    tq_client.kv_claim(pid, "t", ["x"], 1, 5.0)
    t0 = time.monotonic()
    meta = tq_client.kv_claim(pid, "t", ["x"], 1, 2.5)  # nothing left to claim: waits it out
    assert len(meta) == 0 and time.monotonic() - t0 >= 2.0
    tq_client.kv_clear(None, pid)
