"""build_data_plane_client: built-in names, custom backends by path, clear failures."""

from __future__ import annotations

import importlib
import re
import sys
import types
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from nemo_dataplane.adapters.memory import InMemoryClient
from nemo_dataplane.config import ConfigError, DataPlaneConfig
from nemo_dataplane.errors import NemoDataplaneError
from nemo_dataplane.factory import build_data_plane_client, resolve_backend
from nemo_dataplane.wrappers.identity import RowIdentityCheck
from nemo_dataplane.wrappers.observed import ObservedClient, OpEvent


class ConfiguredStore(InMemoryClient):
    """A custom backend with the from_config hook."""

    def __init__(self, label: str, bootstrap: Any) -> None:
        super().__init__()
        self.label, self.bootstrap = label, bootstrap

    @classmethod
    def from_config(cls, cfg: DataPlaneConfig, bootstrap: Any = "auto") -> ConfiguredStore:
        return cls(str(cfg.backend_kwargs["label"]), bootstrap)


class KwargsStore(InMemoryClient):
    def __init__(self, size: int = 0) -> None:
        super().__init__()
        self.size = size


class NotAClient:
    pass


@pytest.fixture
def fake_module() -> Iterator[str]:
    name = "nd_fake_backends"
    mod = types.ModuleType(name)
    mod.ConfiguredStore = ConfiguredStore  # type: ignore[attr-defined]
    mod.KwargsStore = KwargsStore  # type: ignore[attr-defined]
    mod.NotAClient = NotAClient  # type: ignore[attr-defined]
    sys.modules[name] = mod
    yield name
    del sys.modules[name]


def test_memory_backend_and_observability_wrapper() -> None:
    client = build_data_plane_client({"backend": "memory", "verify_rows": False})
    assert type(client) is InMemoryClient
    events: list[OpEvent] = []
    wrapped = build_data_plane_client(
        {"backend": "memory", "observability": {"enabled": True}, "verify_rows": False}, on_event=events.append
    )
    assert isinstance(wrapped, ObservedClient) and isinstance(wrapped.inner, InMemoryClient)
    wrapped.kv_batch_put(["a"], "p", {"x": torch.zeros(1)})
    assert [e.op for e in events] == ["kv_batch_put"]


def test_custom_backend_by_path_uses_from_config(fake_module: str) -> None:
    client = build_data_plane_client(
        {"backend": f"{fake_module}:ConfiguredStore", "backend_kwargs": {"label": "x"}, "verify_rows": False},
        bootstrap=False,
    )
    assert isinstance(client, ConfiguredStore) and client.label == "x" and client.bootstrap is False
    plain = build_data_plane_client(
        {"backend": f"{fake_module}:KwargsStore", "backend_kwargs": {"size": 3}, "verify_rows": False}
    )
    assert isinstance(plain, KwargsStore) and plain.size == 3


def test_resolve_backend_errors_are_specific(fake_module: str) -> None:
    with pytest.raises(
        ValueError,
        match=r"data_plane.backend='redis' is neither a built-in backend \['memory', 'ray', 'transfer_queue'\]",
    ):
        resolve_backend("redis")
    with pytest.raises(ValueError, match="is not a nemo_dataplane.DataPlaneClient subclass"):
        resolve_backend(f"{fake_module}:NotAClient")
    with pytest.raises(ValueError, match="has no attribute 'Missing'"):
        resolve_backend(f"{fake_module}:Missing")
    with pytest.raises(ImportError, match="cannot import 'no_such_pkg.sub'"):
        resolve_backend("no_such_pkg.sub:Client")
    with pytest.raises(ValueError, match="bootstrap must be"):
        build_data_plane_client({"backend": "memory"}, bootstrap="yes")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "name",
    [
        ":Client",  # no module
        "pkg.mod:",  # no class
        ".pkg.mod:Client",  # relative: importlib would ask for a package argument
        "pkg..mod:Client",
        "pkg.mod:Client:Extra",
        "pkg.mod:Outer.Inner",
        "my pkg:Client",
        "pkg.mod:1Client",
        "pkg.class:Client",  # a keyword is no module name
        "pkg.mod.Client",  # dotted, no colon: the colon form is suggested
    ],
)
def test_a_malformed_backend_path_is_refused_before_any_import(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    imported: list[str] = []
    monkeypatch.setattr(importlib, "import_module", lambda mod, *a, **k: imported.append(mod))
    with pytest.raises(ValueError, match=rf"data_plane.backend={re.escape(repr(name))} .*'pkg.module:ClassName'"):
        resolve_backend(name)
    with pytest.raises(ValueError, match=r"data_plane\.backend="):
        DataPlaneConfig.from_dict({"backend": name})
    assert imported == []


def test_a_dotted_class_path_gets_the_colon_spelling_suggested() -> None:
    with pytest.raises(ValueError, match=r"did you mean 'pkg.mod:Client'\?"):
        resolve_backend("pkg.mod.Client")


def test_every_builtin_backend_name_resolves_to_its_adapter() -> None:
    from nemo_dataplane.adapters import InMemoryClient, RayStoreClient, TransferQueueClient
    from nemo_dataplane.config import BUILTIN_BACKENDS

    resolved = {name: resolve_backend(name) for name in BUILTIN_BACKENDS}
    assert resolved == {"transfer_queue": TransferQueueClient, "ray": RayStoreClient, "memory": InMemoryClient}


def test_missing_optional_dependency_names_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    # Simulate an environment without TransferQueue: the lazy import fails with an install hint.
    monkeypatch.setitem(sys.modules, "nemo_dataplane.adapters.transfer_queue.client", None)
    with pytest.raises(ImportError, match=r"backend='transfer_queue'.*pip install transferqueue==0.1.11 ray"):
        resolve_backend("transfer_queue")


def test_transfer_queue_backend_attaches_through_the_factory(tq_client: Any) -> None:
    from nemo_dataplane.adapters.transfer_queue.client import TransferQueueClient

    client = build_data_plane_client({"backend": "transfer_queue", "verify_rows": False}, bootstrap=False)
    try:
        assert isinstance(client, TransferQueueClient) and not client.owns_store
    finally:
        client.close()
    with pytest.raises(ValueError, match=r"backend_kwargs \['port'\]"):
        build_data_plane_client({"backend": "transfer_queue", "backend_kwargs": {"port": 1}}, bootstrap=False)


@pytest.mark.parametrize(
    ("config", "match"),
    [
        (None, "no data_plane config"),
        ({}, "names no backend"),
        ({"enabled": False}, "data_plane.enabled=false"),
        ({"enabled": False, "backend": "memory"}, "data_plane.enabled=false"),
    ],
)
def test_a_config_that_asks_for_no_store_is_refused(config: Any, match: str) -> None:
    # Not a silent TransferQueue on Ray: the error points to the in-process store.
    with pytest.raises(ConfigError, match=match) as info:
        build_data_plane_client(config)
    assert "{'backend': 'memory'}" in str(info.value) and isinstance(info.value, NemoDataplaneError)


def test_the_trainers_config_shape_still_builds() -> None:
    # enabled: true without a backend is the trainers' YAML (default backend); a built config is taken as is.
    assert DataPlaneConfig.from_dict({"enabled": True}).backend == "transfer_queue"
    for built in (
        build_data_plane_client(DataPlaneConfig(backend="memory")),
        build_data_plane_client({"enabled": True, "backend": "memory"}),
    ):
        assert type(built) is RowIdentityCheck and type(built.inner) is InMemoryClient  # verify_rows: on by default
