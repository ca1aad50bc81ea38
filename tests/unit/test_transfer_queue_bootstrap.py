"""TransferQueue adapter bootstrap and lifecycle: sizing the store to the cluster, quiet actors on
plain workers, bounded and named start-up failures, ownership of shutdown, a Ray restart. The
quirks, interop and claims: test_transfer_queue_adapter.py."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch

from nemo_dataplane.adapters.transfer_queue.client import TransferQueueClient, auto_storage_units
from nemo_dataplane.client import DataPlaneError
from nemo_dataplane.config import TransferQueueConfig
from nemo_dataplane.testing.fields import assert_same_field, jagged

REPO = Path(__file__).resolve().parents[2]


def _actor_gone(name: str, namespace: str, timeout_s: float = 20.0) -> bool:
    import ray

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            ray.get_actor(name, namespace=namespace)
        except ValueError:
            return True
        time.sleep(0.2)
    return False


# ------------------------------------------------------------------ bootstrap
def test_storage_units_are_sized_to_the_cluster(tq_client: TransferQueueClient) -> None:
    assert [auto_storage_units(c) for c in (0, 1, 2, 3, 4, 16, 64)] == [1, 1, 1, 1, 2, 8, 8]
    # TransferQueue's default (2 units x 1 CPU + controller) would hang on this 2-CPU cluster.
    assert tq_client.num_storage_units == 1 and tq_client.owns_store


def test_quiet_store_actors_take_plain_workers_and_mute_transfer_queue_logs(ray_session: Any) -> None:
    """Quiet (the default): no runtime_env, so Ray may hand the actors prestarted workers, and
    TransferQueue's loggers muted inside them anyway. Verbose: TQ_NUM_THREADS=1 through the env
    (quirk 3), loggers left alone."""
    import logging

    import ray

    def env_and_log_level(actor: Any) -> tuple[dict[str, Any], int, str | None]:
        # Defined here so cloudpickle ships it by value (test modules are not importable in workers).
        import logging
        import os

        import ray

        return (
            dict(ray.get_runtime_context().runtime_env),
            logging.getLogger("transfer_queue.utils.common").getEffectiveLevel(),
            os.environ.get("TQ_NUM_THREADS"),
        )

    for quiet in (True, False):
        cfg = TransferQueueConfig(
            num_storage_units=1, storage_unit_num_cpus=0.1, controller_num_cpus=0.1, quiet=quiet, op_timeout_s=60
        )
        name = f"nd-quiet-{uuid.uuid4().hex[:6]}"
        c = TransferQueueClient(cfg, bootstrap=True, controller_name=name, namespace="nd_tests")
        try:
            actors = [c._controller, *c._storage.values()]
            seen = ray.get([a.__ray_call__.remote(env_and_log_level) for a in actors], timeout=60)
        finally:
            c.close()
        for env, level, threads in seen:
            if quiet:
                assert env == {} and level == logging.ERROR, (env, level)
                assert threads == os.environ.get("TQ_NUM_THREADS")  # only what the driver's env had
            else:
                assert env.get("env_vars") == {"TQ_NUM_THREADS": "1"} and threads == "1", env
                if "TQ_LOGGING_LEVEL" not in os.environ:
                    assert level < logging.ERROR


def test_bootstrap_that_cannot_fit_fails_fast_naming_the_shortfall(ray_session: Any) -> None:
    name = f"nd-big-{uuid.uuid4().hex[:6]}"
    cfg = TransferQueueConfig(num_storage_units=4, storage_unit_num_cpus=1.0, controller_num_cpus=0.5)
    t0 = time.monotonic()
    with pytest.raises(DataPlaneError, match=r"needs 4\.5 CPUs .* 4 storage unit\(s\) .* cluster has [\d.]+ free"):
        TransferQueueClient(cfg, bootstrap=True, controller_name=name, namespace="nd_tests")
    assert time.monotonic() - t0 < 10
    assert _actor_gone(name, "nd_tests", timeout_s=1)


def test_bootstrap_timeout_names_what_it_waited_for_and_cleans_up(ray_session: Any) -> None:
    name = f"nd-slow-{uuid.uuid4().hex[:6]}"
    cfg = TransferQueueConfig(
        num_storage_units=1, storage_unit_num_cpus=0.1, controller_num_cpus=0.1, bootstrap_timeout_s=0.05
    )
    with pytest.raises(DataPlaneError, match=r"timed out after 0\.05s waiting for the controller.*needs 0\.2 CPUs"):
        TransferQueueClient(cfg, bootstrap=True, controller_name=name, namespace="nd_tests")
    assert _actor_gone(name, "nd_tests")


def test_attach_only_without_a_controller_says_how_to_create_one(ray_session: Any) -> None:
    with pytest.raises(
        DataPlaneError, match=r"no TransferQueue controller named 'nd-none' in Ray namespace 'nd_tests'.*bootstrap=True"
    ):
        TransferQueueClient(TransferQueueConfig(), bootstrap=False, controller_name="nd-none", namespace="nd_tests")


def test_create_when_one_exists_is_refused(tq_client: TransferQueueClient) -> None:
    with pytest.raises(DataPlaneError, match="already exists"):
        TransferQueueClient(TransferQueueConfig(), bootstrap=True)


def test_only_the_creator_shuts_the_store_down_and_multi_unit_routing(ray_session: Any) -> None:
    """A second store with 2 storage units: attached clients disconnect without killing it,
    rows spread over units come back in order, and the owner's close removes the actors."""
    name, ns = f"nd-own-{uuid.uuid4().hex[:6]}", "nd_tests"
    cfg = TransferQueueConfig(
        num_storage_units=2,
        storage_unit_num_cpus=0.25,
        controller_num_cpus=0.25,
        op_timeout_s=60,
        unit_in_controller=True,
    )
    owner = TransferQueueClient(cfg, bootstrap="auto", controller_name=name, namespace=ns)
    try:
        assert owner.owns_store and owner.num_storage_units == 2
        attached = TransferQueueClient(cfg, bootstrap="auto", controller_name=name, namespace=ns)
        assert not attached.owns_store
        # The creator measured its start-up by phase (the trainer's summary shows it), from each
        # actor's own process; the attached client started nothing.
        phases = owner.startup_phases
        for who in ("controller", "units"):
            assert phases[f"{who}_process_s"] >= 0 and phases[f"{who}_cpu_s"] > 0, phases
            # Its class imported and constructed within the wait for all actors (epoch vs
            # perf_counter clocks: a little slack).
            took = phases[f"{who}_import_s"] + phases[f"{who}_construct_s"]
            assert phases[f"{who}_import_s"] > 0 and phases[f"{who}_construct_s"] > 0, phases
            assert took <= phases["actors_up_s"] + 0.5, phases
        assert phases["config_connect_s"] > 0
        # The store's actors never compile: their processes did not load torch._dynamo (about
        # 2 CPU-s each; nemo_dataplane/compile_marks.py).
        for h in [owner._controller, *owner._storage.values()]:
            assert ray_session.get(h.__ray_call__.remote(_dynamo_loaded), timeout=60) is False
        # Unit 0 lives in the controller's process (unit_in_controller: auto is on with one unit
        # only, explicit here), unit 1 in its own; rows on both come back below.
        pids = {n: ray_session.get(h.__ray_call__.remote(_pid), timeout=60) for n, h in owner._storage.items()}
        assert pids[name] == ray_session.get(owner._controller.__ray_call__.remote(_pid), timeout=60)
        assert len(set(pids.values())) == 2, pids
        assert attached.startup_phases == {}
        n = 9
        fields = {"ids": jagged([3, 0, 5, 1, 2, 7, 4, 1, 6], seed=3), "x": torch.arange(n * 2).view(n, 2)}
        keys = [f"k{i}" for i in range(n)]
        meta = attached.kv_batch_put(keys, "p", fields)
        attached.close()
        attached.close()  # idempotent
        order = [8, 3, 0, 5, 1, 7, 2, 6, 4]
        out = owner.kv_batch_get(meta.reorder(order), ["ids", "x"])
        assert torch.equal(out["x"], fields["x"][order])
        want_rows = [fields["ids"].unbind()[i] for i in order]
        assert [r.tolist() for r in out["ids"].unbind()] == [r.tolist() for r in want_rows]
        # a subset whose rows sit on both units, in a non-contiguous order (put path gathers)
        sub = ["k7", "k2", "k4"]
        owner.kv_batch_put(sub, "p", {"ids": jagged([2, 3, 1], seed=9)})
        assert_same_field("ids", owner.kv_batch_get(sub, ["ids"], partition_id="p")["ids"], jagged([2, 3, 1], seed=9))
    finally:
        owner.close()
    assert _actor_gone(name, ns)
    assert _actor_gone(f"{name}.StorageUnit#0", ns) and _actor_gone(f"{name}.StorageUnit#1", ns)


def test_survives_a_ray_restart_in_one_process() -> None:
    """TransferQueue's module globals go stale after ray.shutdown(); the adapter must not care.
    Runs in its own process so the session cluster is untouched."""
    script = textwrap.dedent(
        """
        import ray, torch
        from nemo_dataplane.adapters.transfer_queue.client import TransferQueueClient
        from nemo_dataplane.config import TransferQueueConfig
        cfg = TransferQueueConfig(op_timeout_s=60)
        for round in range(2):
            c = TransferQueueClient(cfg, bootstrap="auto")   # starts Ray itself when none is up
            assert c.started_ray and c.owns_store, (c.started_ray, c.owns_store)
            c.kv_batch_put(["a", "b"], "p", {"x": torch.tensor([round, round + 1])})
            assert c.kv_batch_get(["b", "a"], ["x"], partition_id="p")["x"].tolist() == [round + 1, round]
            c.close()
            assert not ray.is_initialized()
        print("RESTART-OK")
        """
    )
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""), "RAY_ADDRESS": ""}
    env.pop("RAY_ADDRESS")
    proc = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True, text=True, timeout=240
    )
    assert proc.returncode == 0 and "RESTART-OK" in proc.stdout, proc.stderr[-3000:]


def _dynamo_loaded(actor: object) -> bool:
    return "torch._dynamo" in sys.modules


def _pid(actor: object) -> int:
    return os.getpid()
