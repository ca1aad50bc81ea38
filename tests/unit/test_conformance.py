"""The client contract (nemo_dataplane.testing.conformance) run against every built-in adapter.

``TestMemoryConformance`` pins the reference semantics; ``TestTransferQueueConformance`` holds
the real TransferQueue on local Ray (the session ``tq_client``) and ``TestRayStoreConformance``
the Ray object-store backend (the session ``ray_store_client``) to the same tests.
``TestByKeyOnlyConformance`` runs a backend that opts out of claims (``supports_claims = False``);
``TestByteBoundedMemoryConformance`` the reference store with a byte bound it never reaches.
"""

from __future__ import annotations

import sys
import uuid
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest

from nemo_dataplane.adapters.memory import InMemoryClient
from nemo_dataplane.client import DataPlaneClient
from nemo_dataplane.testing.conformance import DataPlaneConformance

sys.path.insert(0, str(Path(__file__).parent))
from _backends import ByKeyOnly  # noqa: E402


class TestMemoryConformance(DataPlaneConformance):
    @pytest.fixture
    def client(self) -> Iterator[DataPlaneClient]:
        c = InMemoryClient()
        yield c
        c.close()

    def remote_config(self) -> None:
        return None  # one process's store

    def fresh_config(self) -> Mapping[str, Any]:
        return {"backend": "memory"}


class TestByteBoundedMemoryConformance(DataPlaneConformance):
    """A byte bound the tests never reach changes nothing; every clear gives its bytes back."""

    @pytest.fixture
    def client(self) -> Iterator[DataPlaneClient]:
        c = InMemoryClient(max_bytes=1 << 30)
        yield c
        for p in c.kv_partitions():
            c.kv_clear(None, p)
        assert c.bytes_stored() == 0
        c.close()

    def remote_config(self) -> None:
        return None

    def fresh_config(self) -> Mapping[str, Any]:
        return {"backend": "memory", "backend_kwargs": {"max_bytes": 1 << 30}}


class TestByKeyOnlyConformance(DataPlaneConformance):
    supports_claims = False

    @pytest.fixture
    def client(self) -> Iterator[DataPlaneClient]:
        c = ByKeyOnly()
        yield c
        c.close()

    def remote_config(self) -> None:
        return None

    def fresh_config(self) -> Mapping[str, Any]:
        return {"backend": "_backends:ByKeyOnly"}


class TestTransferQueueConformance(DataPlaneConformance):
    @pytest.fixture
    def client(self, tq_client: DataPlaneClient) -> DataPlaneClient:
        return tq_client

    def remote_config(self) -> Mapping[str, Any]:
        # Workers attach (bootstrap=False) to the session store under its default name.
        return {"backend": "transfer_queue", "transfer_queue": {"bootstrap_timeout_s": 60, "op_timeout_s": 60}}

    def fresh_config(self) -> Mapping[str, Any]:
        # A store of its own: one unit in the controller, no CPUs reserved (the session's 2 are taken).
        return {
            "backend": "transfer_queue",
            "backend_kwargs": {"controller_name": f"conf-{uuid.uuid4().hex[:8]}"},
            "transfer_queue": {
                "num_storage_units": 1,
                "storage_unit_num_cpus": 0,
                "controller_num_cpus": 0,
                "bootstrap_timeout_s": 60,
                "op_timeout_s": 60,
            },
        }


class TestRayStoreConformance(DataPlaneConformance):
    @pytest.fixture
    def client(self, ray_store_client: DataPlaneClient) -> DataPlaneClient:
        return ray_store_client

    def remote_config(self) -> Mapping[str, Any]:
        # Workers attach (bootstrap=False) to the session's index under its default name.
        return {"backend": "ray", "ray_store": {"bootstrap_timeout_s": 60, "op_timeout_s": 60}}

    def fresh_config(self) -> Mapping[str, Any]:
        return {
            "backend": "ray",
            "backend_kwargs": {"actor_name": f"conf-{uuid.uuid4().hex[:8]}"},
            "ray_store": {"bootstrap_timeout_s": 60, "op_timeout_s": 60},
        }
