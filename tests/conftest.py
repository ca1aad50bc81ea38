"""Session fixtures: one local Ray cluster and one TransferQueue store for the whole test run.

* ``ray_session``: Ray started once with 2 CPUs (the CI machine) and no dashboard; shut down at
  session end. Every test that needs Ray shares it.
* ``tq_client``: a bootstrapped :class:`TransferQueueClient` on that cluster, under
  TransferQueue's default controller name so ``transfer_queue.init()`` in an actor attaches to
  the same store. Tests must use their own partition ids and clear them.
* ``ray_store_client``: a bootstrapped :class:`RayStoreClient` (the ``ray`` backend) on that
  cluster, under its default index name so workers attach with ``bootstrap=False``.
* ``plasma_mib``: a function returning the MiB of Ray's object store in use.
* ``memory_client``: a fresh :class:`InMemoryClient` per test.
* ``store``: ``(client, partition_id)``, parametrized over the in-memory store and ``tq_client``,
  with a fresh partition (named after the test module) that is cleared afterwards.
* ``pool``: worker processes (module scope) for the rank bodies in ``tests/unit/_refit_procs.py``.
* ``make_real_model(dir, ...)``: a checkpoint as a user brings one, built at test time (nothing is
  downloaded) by ``examples/make_tiny_checkpoint.py`` (as docs/grpo_sync.md's walkthrough does): a
  byte-level BPE tokenizer trained on arithmetic word problems and a tiny Llama (head size 32,
  which vLLM's CPU attention runs) saved beside it; ``real_model``: one under ``tmp_path``;
  ``word_problems(path)``: that script's JSONL word problems.

Nothing here is importable as ``tests.*`` (TransferQueue's wheel ships a top-level ``tests``
package); pytest runs with ``--import-mode=importlib``.
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

# Must be set before Ray starts: actors spawned by the fixtures inherit it, and TransferQueue
# reads it at import time.
os.environ.setdefault("TQ_LOGGING_LEVEL", "ERROR")
os.environ.setdefault("RAY_DEDUP_LOGS", "1")

RAY_NUM_CPUS = 2


@pytest.fixture(scope="session")
def ray_session() -> Iterator[Any]:
    """Ray initialized in this process (2 CPUs, no dashboard) for the whole session."""
    import ray

    started = False
    if not ray.is_initialized():
        # address="local": a cluster of this session's own. Without it ray.init() attaches to
        # whatever /tmp/ray/ray_current_cluster names, e.g. a functional run's cluster still
        # shutting down, and then refuses num_cpus (CI failed so once).
        ray.init(
            address="local",
            num_cpus=RAY_NUM_CPUS,
            include_dashboard=False,
            log_to_driver=True,
            configure_logging=False,
        )
        started = True
    yield ray
    if started and ray.is_initialized():
        ray.shutdown()


@pytest.fixture(scope="session")
def tq_client(ray_session: Any) -> Iterator[Any]:
    """A real TransferQueue store (1 storage unit, fractional CPUs) shared by the session."""
    from nemo_dataplane.adapters.transfer_queue.client import TransferQueueClient
    from nemo_dataplane.config import TransferQueueConfig

    client = TransferQueueClient(
        TransferQueueConfig(num_storage_units=1, bootstrap_timeout_s=60, op_timeout_s=60),
        bootstrap=True,
    )
    yield client
    client.close()


@pytest.fixture(scope="session")
def ray_store_client(ray_session: Any) -> Iterator[Any]:
    """A Ray object-store backend (metadata actor under its default name) shared by the session."""
    from nemo_dataplane.adapters.ray_store.client import RayStoreClient
    from nemo_dataplane.config import RayStoreConfig

    client = RayStoreClient(RayStoreConfig(bootstrap_timeout_s=60, op_timeout_s=60), bootstrap=True)
    yield client
    client.close()


@pytest.fixture(scope="session")
def plasma_mib(ray_session: Any) -> Any:
    """``plasma_mib()``: MiB of Ray's object store in use across the cluster (Ray's own stats)."""
    import re

    from ray._private.internal_api import memory_summary

    def used() -> int:
        text = memory_summary(ray_session.get_runtime_context().gcs_address, stats_only=True)
        return int(re.search(r"Plasma memory usage (\d+) MiB", text).group(1))  # type: ignore[union-attr]

    return used


@pytest.fixture
def memory_client() -> Iterator[Any]:
    from nemo_dataplane.adapters.memory import InMemoryClient

    client = InMemoryClient()
    yield client
    client.close()


def _wait_actor_dead(actor: Any, timeout_s: float = 60.0) -> None:
    """Return once a killed actor is known dead: ``ray.kill`` is asynchronous, and a call made
    right after it may still be served. Fails after ``timeout_s``."""
    import ray

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            ray.get(actor.__ray_ready__.remote(), timeout=max(0.1, deadline - time.monotonic()))
        except (ray.exceptions.RayActorError, ray.exceptions.ActorDiedError):
            return
        except ray.exceptions.GetTimeoutError:
            break
        time.sleep(0.05)  # it still answered: poll again until it does not
    raise AssertionError(f"actor still alive {timeout_s:.0f} s after ray.kill")


@pytest.fixture
def wait_actor_dead() -> Any:
    """``wait_actor_dead(actor)``: block until a killed actor is known dead (see above)."""
    return _wait_actor_dead


@pytest.fixture(params=["memory", "transfer_queue"])
def store(request: pytest.FixtureRequest) -> Iterator[tuple[Any, str]]:
    """A client (in-memory, or the session's TransferQueue store) and a fresh partition; the
    partition is cleared afterwards."""
    from nemo_dataplane.adapters.memory import InMemoryClient

    client = InMemoryClient() if request.param == "memory" else request.getfixturevalue("tq_client")
    pid = f"{Path(str(request.node.fspath)).stem}-{uuid.uuid4().hex[:8]}"
    yield client, pid
    client.kv_clear(None, pid)


@pytest.fixture(scope="module")
def pool() -> Iterator[Any]:
    """Worker processes for the rank bodies of ``tests/unit/_refit_procs.py``, killed after the
    module. The module that uses it has put ``tests/unit`` on ``sys.path`` (never a package)."""
    import _refit_procs

    ex = _refit_procs.Pool(4)
    yield ex
    ex.kill()


# --------------------------------------------------------------------------- a real checkpoint
def _tiny_checkpoint_module() -> Any:
    """``examples/make_tiny_checkpoint.py``: the builder the docs' walkthrough runs (examples/ is
    no package)."""
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "examples" / "make_tiny_checkpoint.py"
    spec = importlib.util.spec_from_file_location("make_tiny_checkpoint", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


TINY_CHECKPOINT = _tiny_checkpoint_module()
build_real_model = TINY_CHECKPOINT.build_tiny_checkpoint


@pytest.fixture(scope="session")
def make_real_model() -> Any:
    """``build_tiny_checkpoint``, for tests that need a variant (too few embedding rows, no pad
    token, no chat template, other heads) or their own directory."""
    return build_real_model


@pytest.fixture
def real_model(tmp_path: Path) -> Path:
    """A checkpoint directory (tokenizer + tiny Llama) under ``tmp_path``."""
    return build_real_model(tmp_path / "model")


@pytest.fixture(scope="session")
def word_problems() -> Any:
    """``write_word_problems(path, count=24)``: JSONL ``{"question", "gold"}`` word problems."""
    return TINY_CHECKPOINT.write_word_problems
