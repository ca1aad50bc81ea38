"""`build_data_plane_client(config, bootstrap)`: one place that turns config into a client.

Backends are named in ``data_plane.backend``:

* ``transfer_queue`` (default): the real TransferQueue on Ray (local Ray when none is running);
* ``ray``: tensors in Ray's object store, put and read by the workers themselves, keys and tags
  in one metadata actor (:mod:`nemo_dataplane.adapters.ray_store.client`);
* ``memory``: the in-process reference backend;
* ``"pkg.module:ClassName"``: any :class:`DataPlaneClient` subclass. If it defines a
  ``from_config(config, bootstrap)`` classmethod that is used, else it is called with
  ``**data_plane.backend_kwargs``.

Optional dependencies are imported only when their backend is asked for, and a missing one
fails with a message naming what to install.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any, Literal

from nemo_dataplane.client import DataPlaneClient, claims_not_implemented
from nemo_dataplane.config import BUILTIN_BACKENDS, ConfigError, DataPlaneConfig, backend_path
from nemo_dataplane.wrappers.capacity import CapacityGuard
from nemo_dataplane.wrappers.gpu_resident import GpuResidentClient
from nemo_dataplane.wrappers.identity import RowIdentityCheck
from nemo_dataplane.wrappers.integrity import IntegrityCheck
from nemo_dataplane.wrappers.observed import ObservedClient, OpEvent

Bootstrap = bool | Literal["auto"]

_ADAPTERS: dict[str, tuple[str, str]] = {
    # name -> (import path, what to install if the import fails)
    "transfer_queue": (
        "nemo_dataplane.adapters.transfer_queue.client:TransferQueueClient",
        "transferqueue==0.1.11 ray",
    ),
    "ray": ("nemo_dataplane.adapters.ray_store.client:RayStoreClient", "ray"),
    "memory": ("nemo_dataplane.adapters.memory:InMemoryClient", "nemo-dataplane"),
}
# Keyed by the one list of names (config.BUILTIN_BACKENDS): a name without an adapter fails here,
# at import, and an adapter whose name is not on the list is never reached.
_BUILTIN: dict[str, tuple[str, str]] = {name: _ADAPTERS[name] for name in BUILTIN_BACKENDS}


def resolve_backend(name: str, *, needs_claims: bool = False) -> type[DataPlaneClient]:
    """The client class for a backend name or ``"pkg.module:ClassName"`` path, refused when it
    is structurally unusable: the one check of a backend class (config load and factory alike).

    Args:
        needs_claims: the caller claims rows (``grpo_async``): a class that leaves any of
            ``kv_claim``, ``kv_mark_consumed``, ``kv_claim_status`` to the ABC's defaults is refused.

    Raises:
        ValueError: an unknown name, a malformed path (refused before any import), a class that
            is not a DataPlaneClient, one with abstract methods left unimplemented, or one
            without claims when ``needs_claims``; the message names ``data_plane.backend``.
        ImportError: the backend's module (or its dependency) cannot be imported.
    """
    if not isinstance(name, str):
        raise ValueError(f"data_plane.backend must be a str, got {type(name).__name__}: {name!r}")
    target, hint = _BUILTIN.get(name, (name, None))
    # The form is checked before anything is imported: a malformed path never runs a module.
    module_name, attr = backend_path(target)
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        extra = f" (install: pip install {hint})" if hint else ""
        raise ImportError(f"data_plane.backend={name!r}: cannot import {module_name!r}: {e}{extra}") from e
    cls = getattr(module, attr, None)
    if cls is None:
        raise ValueError(f"data_plane.backend={name!r}: module {module_name!r} has no attribute {attr!r}")
    if not (isinstance(cls, type) and issubclass(cls, DataPlaneClient)):
        raise ValueError(
            f"data_plane.backend={name!r}: {target} is not a nemo_dataplane.DataPlaneClient subclass (got {cls!r})"
        )
    abstract = sorted(getattr(cls, "__abstractmethods__", ()))
    if abstract:
        raise ValueError(
            f"data_plane.backend={name!r}: {cls.__name__} does not implement {', '.join(abstract)} "
            "(abstract methods of DataPlaneClient; docs/custom-backends.md)"
        )
    missing = claims_not_implemented(cls) if needs_claims else []
    if missing:
        raise ValueError(
            f"data_plane.backend={name!r}: {cls.__name__} has no claims ({', '.join(missing)} not implemented), "
            "which grpo_async needs to take rows as they are produced; implement them, or use grpo_sync"
        )
    return cls


_MEMORY_HINT = "pass {'backend': 'memory'} for an in-process store"


def _check_asked_for(config: DataPlaneConfig | Mapping[str, Any] | None) -> None:
    """Refuse a config that does not ask for a store: the default backend is a TransferQueue
    on Ray, far too heavy to start by accident (a missing section, a disabled data plane).

    Raises:
        ConfigError: ``config`` is ``None``, a mapping with ``enabled: false``, or a mapping that
            neither names a ``backend`` nor sets ``enabled: true``.
    """
    if config is None:
        raise ConfigError(
            "build_data_plane_client: no data_plane config; name a backend (data_plane.backend: "
            f"{' | '.join(BUILTIN_BACKENDS)} | 'pkg.module:ClassName'), or {_MEMORY_HINT}"
        )
    if isinstance(config, DataPlaneConfig):
        return  # built on purpose; the trainers call the factory only when data_plane.enabled
    if not isinstance(config, Mapping):
        return  # DataPlaneConfig.from_dict names the wrong type
    if config.get("enabled") is False:
        raise ConfigError(
            "build_data_plane_client: data_plane.enabled=false says this config uses no store; "
            f"set data_plane.enabled=true, or drop 'enabled' and {_MEMORY_HINT}"
        )
    if "backend" not in config and config.get("enabled") is not True:
        raise ConfigError(
            f"build_data_plane_client: the data_plane config {dict(config)!r} names no backend "
            f"(the default would start TransferQueue on Ray); name one, or {_MEMORY_HINT}"
        )


def build_data_plane_client(
    config: DataPlaneConfig | Mapping[str, Any] | None,
    bootstrap: Bootstrap = "auto",
    on_event: Callable[[OpEvent], None] | None = None,
) -> DataPlaneClient:
    """Build the client named by ``config.backend``.

    Args:
        config: the ``data_plane`` section (a :class:`DataPlaneConfig` or a plain mapping). A
            mapping must name its ``backend`` (or set ``enabled: true``, the trainers' shape);
            ``None``, ``{}`` and ``enabled: false`` are refused (``ConfigError``) rather than
            starting the default TransferQueue on Ray: ``{"backend": "memory"}`` is the
            in-process store.
        bootstrap: for shared backends, ``"auto"`` attaches to a running store or creates one;
            ``True`` always creates; ``False`` only attaches (worker processes) and fails clearly
            when there is nothing to attach to.
        on_event: with ``observability.enabled``, called with every op's :class:`OpEvent`.

    Wrappers (:mod:`nemo_dataplane.wrappers`), each only when its key is set, innermost first:
    :class:`RowIdentityCheck` (``verify_rows``, default on: each get checks every row is its
    key's own), :class:`CapacityGuard` (``max_rows``: a put past the capacity raises ``StoreFullError``),
    :class:`IntegrityCheck` (``verify_integrity``: per-row digests sealed at put, checked at get),
    :class:`GpuResidentClient` (``gpu_fields``: CUDA tensors of those fields stay on their GPU
    and the store holds handles; one node only), :class:`ObservedClient`
    (``observability.enabled``). The observer is outermost so a put the
    guard refuses or a get that fails its check is recorded as a failed op; the integrity check
    sits outside the guard so a malformed put fails on its fields before the store is listed.
    """
    if bootstrap not in (True, False, "auto"):
        raise ValueError(f"bootstrap must be True, False or 'auto', got {bootstrap!r}")
    _check_asked_for(config)
    cfg = DataPlaneConfig.from_dict(config)
    cls = resolve_backend(cfg.backend)
    from_config = getattr(cls, "from_config", None)
    client: DataPlaneClient
    if callable(from_config):
        client = from_config(cfg, bootstrap=bootstrap)
    else:
        client = cls(**dict(cfg.backend_kwargs))
    if cfg.verify_rows:
        client = RowIdentityCheck(client)
    if cfg.max_rows is not None:
        client = CapacityGuard(client, cfg.max_rows)
    if cfg.verify_integrity:
        client = IntegrityCheck(client)
    if cfg.gpu_fields:
        client = GpuResidentClient(client, cfg.gpu_fields, single_node=_one_node())
    if cfg.observability.enabled:
        client = ObservedClient(client, on_event, track_outstanding=cfg.observability.track_outstanding)
    return client


def _one_node() -> bool:
    """Whether every process that can reach the store shares this host: no Ray (one process),
    or a Ray cluster of one alive node."""
    import sys

    ray = sys.modules.get("ray")  # not imported here: a process without Ray has no other node
    if ray is None or not ray.is_initialized():
        return True
    return sum(1 for n in ray.nodes() if n.get("Alive")) == 1
