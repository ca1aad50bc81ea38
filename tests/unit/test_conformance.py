"""The client contract (nemo_dataplane.testing.conformance) run against every built-in adapter.

``TestMemoryConformance`` pins the reference semantics; ``TestTransferQueueConformance`` holds
the real TransferQueue on local Ray (the session ``tq_client``) and ``TestRayStoreConformance``
the Ray object-store backend (the session ``ray_store_client``) to the same tests.
``TestByKeyOnlyConformance`` runs a backend that opts out of claims (``supports_claims = False``);
``TestByteBoundedMemoryConformance`` the reference store with a byte bound it never reaches.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import pytest

from nemo_dataplane.adapters.memory import InMemoryClient
from nemo_dataplane.client import DataPlaneClient
from nemo_dataplane.testing.conformance import DataPlaneConformance


class TestMemoryConformance(DataPlaneConformance):
    @pytest.fixture
    def client(self) -> Iterator[DataPlaneClient]:
        c = InMemoryClient()
        yield c
        c.close()


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


class _ByKeyOnly(InMemoryClient):
    """The reference store with the ABC's claim defaults back: a backend without claims."""

    kv_claim = DataPlaneClient.kv_claim  # type: ignore[assignment]
    kv_mark_consumed = DataPlaneClient.kv_mark_consumed  # type: ignore[assignment]
    kv_claim_status = DataPlaneClient.kv_claim_status  # type: ignore[assignment]


class TestByKeyOnlyConformance(DataPlaneConformance):
    supports_claims = False

    @pytest.fixture
    def client(self) -> Iterator[DataPlaneClient]:
        c = _ByKeyOnly()
        yield c
        c.close()


class TestTransferQueueConformance(DataPlaneConformance):
    @pytest.fixture
    def client(self, tq_client: DataPlaneClient) -> DataPlaneClient:
        return tq_client

    def remote_config(self) -> Mapping[str, Any] | None:
        # Workers attach (bootstrap=False) to the session store under its default name.
        return {"backend": "transfer_queue", "transfer_queue": {"bootstrap_timeout_s": 60, "op_timeout_s": 60}}


class TestRayStoreConformance(DataPlaneConformance):
    @pytest.fixture
    def client(self, ray_store_client: DataPlaneClient) -> DataPlaneClient:
        return ray_store_client

    def remote_config(self) -> Mapping[str, Any] | None:
        # Workers attach (bootstrap=False) to the session's index under its default name.
        return {"backend": "ray", "ray_store": {"bootstrap_timeout_s": 60, "op_timeout_s": 60}}
