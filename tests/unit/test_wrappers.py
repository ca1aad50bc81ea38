"""nemo_dataplane.wrappers: the forwarding base covers the whole contract, and the factory's
composition keeps what each wrapper promised (refusals and corruption are recorded as failed ops)."""

from __future__ import annotations

import asyncio
import inspect

import pytest
import torch

from nemo_dataplane.adapters.memory import InMemoryClient
from nemo_dataplane.client import DataIntegrityError, DataPlaneClient
from nemo_dataplane.factory import build_data_plane_client
from nemo_dataplane.wrappers import (
    CapacityGuard,
    ForwardingClient,
    IntegrityCheck,
    ObservedClient,
    OpEvent,
    RowIdentityCheck,
)
from nemo_dataplane.wrappers.capacity import StoreFullError


def _contract() -> list[str]:
    """Every public method of DataPlaneClient (sync, async twins, claims, listing, lifecycle)."""
    return [
        n
        for n, f in inspect.getmembers(DataPlaneClient, inspect.isfunction)
        if n.startswith(("kv_", "async_kv_")) or n in ("close",)
    ]


def test_the_forwarding_base_overrides_every_method_of_the_contract() -> None:
    # A method added to the contract but not to the base would be served by the ABC's default
    # (a thread hop, or ClaimsNotSupported) in front of every wrapped backend.
    missing = [n for n in _contract() if n not in vars(ForwardingClient)]
    assert missing == []


class _Recorder(DataPlaneClient):
    """Logs every call of the contract with its arguments, so forwarding can be checked call by call."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple]] = []

    def __getattribute__(self, name: str):  # type: ignore[no-untyped-def]
        calls = object.__getattribute__(self, "calls")
        if name.startswith("async_kv_"):

            async def twin(*args):  # type: ignore[no-untyped-def]
                calls.append((name, args))

            return twin
        if name.startswith("kv_") or name == "close":
            return lambda *args: calls.append((name, args))
        return object.__getattribute__(self, name)

    kv_batch_put = kv_batch_get = kv_clear = kv_list = kv_partitions = None  # type: ignore[assignment]


def test_every_call_reaches_the_inner_client_with_its_arguments() -> None:
    inner = _Recorder()
    w = ForwardingClient(inner)
    for name in _contract():
        params = list(inspect.signature(getattr(DataPlaneClient, name)).parameters)[1:]
        args = tuple(f"<{p}>" for p in params)
        got = getattr(w, name)(*args)
        if inspect.iscoroutine(got):
            asyncio.run(got)
        assert inner.calls[-1] == (name, args), name
    assert len(inner.calls) == len(_contract())


def test_context_manager_closes_the_inner_client_and_extras_read_through() -> None:
    inner = InMemoryClient()
    inner.label = "x"  # type: ignore[attr-defined]
    with ForwardingClient(inner) as w:
        assert w.label == "x"
        w.kv_batch_put(["a"], "p", {"x": torch.zeros(1)})
    with pytest.raises(Exception, match="closed"):
        inner.kv_list("p")


def test_the_factory_composes_identity_then_capacity_then_integrity_then_the_observer() -> None:
    events: list[OpEvent] = []
    client = build_data_plane_client(
        {"backend": "memory", "max_rows": 2, "verify_integrity": True, "observability": {"enabled": True}},
        on_event=events.append,
    )
    assert isinstance(client, ObservedClient)
    assert isinstance(client.inner, IntegrityCheck) and isinstance(client.inner.inner, CapacityGuard)
    assert isinstance(client.inner.inner.inner, RowIdentityCheck)
    raw = client.inner.inner.inner.inner
    assert isinstance(raw, InMemoryClient)

    meta = client.kv_batch_put(["a", "b"], "p", {"x": torch.arange(2.0)})
    with pytest.raises(StoreFullError):
        client.kv_batch_put(["c"], "p", {"x": torch.zeros(1)})
    raw.kv_batch_put(["a"], "p", {"x": torch.tensor([9.0])})  # corrupted below every wrapper
    with pytest.raises(DataIntegrityError, match="key 'a'"):
        client.kv_batch_get(meta, ["x"])
    # The observer saw each call once, as the caller made it; the wrappers' own store reads
    # (capacity's listing, integrity's re-read of tags) are not ops of the caller.
    assert [(e.op, e.status) for e in events] == [
        ("kv_batch_put", "ok"),
        ("kv_batch_put", "error"),
        ("kv_batch_get", "error"),
    ]
    assert events[1].error is not None and events[1].error.startswith("StoreFullError")
    assert events[2].error is not None and events[2].error.startswith("DataIntegrityError")
    assert client.bytes_outstanding == 8  # the refused put holds nothing


def test_each_wrapper_only_when_its_key_is_set() -> None:
    assert type(build_data_plane_client({"backend": "memory", "verify_rows": False})) is InMemoryClient
    rows = build_data_plane_client({"backend": "memory"})  # verify_rows: on by default
    assert type(rows) is RowIdentityCheck and type(rows.inner) is InMemoryClient
    only = build_data_plane_client({"backend": "memory", "verify_integrity": True, "verify_rows": False})
    assert type(only) is IntegrityCheck and type(only.inner) is InMemoryClient
