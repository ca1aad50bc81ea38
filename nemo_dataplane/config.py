"""Typed, validated ``data_plane`` configuration. Every default is documented here, once.

YAML shape (all keys optional)::

    data_plane:
      enabled: false              # trainers: move batches through the store (true) or Ray (false)
      backend: transfer_queue     # transfer_queue | ray | memory | "pkg.module:MyClient"
      backend_kwargs: {}          # passed to a custom backend's constructor
      fetch_policy: auto          # independent | leader_broadcast | auto
      column_max_bytes_per_sample: 64   # driver column I/O refuses wider fields
      max_rows: null              # capacity: a put that would hold more keys in the store raises StoreFullError
      gpu_fields: []              # fields whose CUDA tensors stay on their GPU (one node; the store holds handles)
      verify_rows: true           # every get checks each row is its key's own (8 bytes a row; RowIdentityError)
      verify_integrity: false     # per-row digests of every field, checked at get (DataIntegrityError)
      transfer_queue:
        ray_address: null         # null: join a running Ray if one is up, else start a local one
        num_storage_units: null   # null: sized to the cluster's free CPUs (1 on a 2-CPU machine)
        storage_placement: pack   # pack: Ray places the units | per_node: one unit on every node
        unit_in_controller: null  # storage unit 0 in the controller's process; null: when there is one unit
        storage_unit_num_cpus: 0.5
        controller_num_cpus: 0.5
        bootstrap_timeout_s: 60   # how long creating/attaching may take before a clear error
        op_timeout_s: 300         # bound on any single put/get/clear/list
        quiet: true               # silence TransferQueue's per-op log lines
      ray_store:                  # backend: ray (tensors in Ray's object store, a metadata actor)
        ray_address: null         # null: join a running Ray if one is up, else start a local one
        adopt_objects: true       # rows outlive the process that put them (one background copy)
        zero_copy_reads: false    # true: whole-put reads are read-only views of shared memory
        bootstrap_timeout_s: 60
        op_timeout_s: 300
      observability:
        enabled: false            # wrap the client to record every op
        track_outstanding: true   # and keep a per-key ledger of bytes put and not cleared
      packing:
        mode: none                # none | sequence | dynamic
        max_tokens_per_microbatch: null   # required for sequence / dynamic
        micro_batch_size: null            # required for none
"""

from __future__ import annotations

import dataclasses
import keyword
import math
import types
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, TypeVar, cast, get_args

from nemo_dataplane.errors import NemoDataplaneError

if TYPE_CHECKING:  # pragma: no cover - typing only
    from _typeshed import DataclassInstance

T = TypeVar("T", bound="DataclassInstance")


class ConfigError(NemoDataplaneError, ValueError):
    """A config key is unknown, mistyped or invalid; the message names its dotted path."""


class FieldError(NemoDataplaneError, ValueError):
    """A section's own check of one of its fields failed; :func:`build_config` names the field
    by its dotted path (the section does not know where it sits)."""

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"{field}{'' if problem.startswith('=') else ' '}{problem}")
        self.field, self.problem = field, problem


def require_positive(section: Any, *names: str, allow_zero: bool = False) -> None:
    """Each named field of ``section`` that is not ``None`` must be a finite number ``> 0``
    (``>= 0`` with ``allow_zero``): NaN (which compares false with every bound) and infinities
    (a timeout that never ends, a bound that bounds nothing) never pass, as in YAML
    (:func:`build_config`), so a section built directly is held to the same rule.

    Raises:
        FieldError: naming the first field out of range.
    """
    for name in names:
        value = getattr(section, name)
        if value is None:
            continue
        if isinstance(value, float) and not math.isfinite(value):
            raise FieldError(name, f"must be a finite number, got {value}")
        ok = value >= 0 if allow_zero else value > 0
        if not ok:
            raise FieldError(name, f"must be {'>= 0' if allow_zero else '> 0'}, got {value}")


def _below_one(value: Any) -> bool:
    """``value < 1``, true for NaN too (``nan < 1`` is false: a ``< 1`` check lets NaN through)."""
    return not value >= 1


FetchPolicy = Literal["independent", "leader_broadcast", "auto"]
# The built-in ``data_plane.backend`` names, the one list of them: the factory maps each to its
# adapter, and code that must not import Ray or TransferQueue (trainer configs) checks against it.
BUILTIN_BACKENDS: tuple[str, ...] = ("transfer_queue", "ray", "memory")
PackingMode = Literal["none", "sequence", "dynamic"]


def _is_name(part: str) -> bool:
    return part.isidentifier() and not keyword.iskeyword(part)


def backend_path(name: str) -> tuple[str, str]:
    """``(module, class)`` of a custom ``data_plane.backend`` ``"pkg.module:ClassName"``, its form
    checked without importing anything: a dotted module path of identifiers, one ``:``, one
    identifier. (``importlib`` given ``".pkg"`` or ``"a b"`` would fail with an unrelated error, or
    import a package's ``__init__`` before the class path is ever looked at.)

    Raises:
        ValueError: any other form (names ``data_plane.backend``; a dotted ``pkg.module.Class``
            gets the ``pkg.module:Class`` spelling suggested).
    """
    module, colon, attr = name.partition(":")
    if colon and module and all(_is_name(p) for p in module.split(".")) and _is_name(attr):
        return module, attr
    hint = ""
    if not colon and "." in name:
        head, _, tail = name.rpartition(".")
        hint = f" (did you mean {head + ':' + tail!r}?)"
    raise ValueError(
        f"data_plane.backend={name!r} is neither a built-in backend {sorted(BUILTIN_BACKENDS)} "
        f"nor a 'pkg.module:ClassName' path{hint}"
    )


@dataclass(frozen=True)
class TransferQueueConfig:
    """How the TransferQueue adapter finds or creates its controller and storage.

    ``listen``: where a store this client creates listens. TransferQueue's wire format is pickle;
    its sockets admit only clients holding the store's keys (docs/reliability.md, "Trust
    boundary"), and a one-node store stays off the network besides. ``auto``: loopback when the
    Ray cluster has one node at creation, else each actor's node address; ``loopback``: always
    (every client must be on the store's node); ``node``: the node address.
    """

    ray_address: str | None = None
    num_storage_units: int | None = None
    storage_placement: Literal["pack", "per_node"] = "pack"
    unit_in_controller: bool | None = None
    listen: Literal["auto", "loopback", "node"] = "auto"
    storage_unit_num_cpus: float = 0.5
    controller_num_cpus: float = 0.5
    bootstrap_timeout_s: float = 60.0
    op_timeout_s: float = 300.0
    quiet: bool = True

    def __post_init__(self) -> None:
        if self.num_storage_units is not None and _below_one(self.num_storage_units):
            raise ValueError(f"data_plane.transfer_queue.num_storage_units must be >= 1, got {self.num_storage_units}")
        if self.storage_placement not in ("pack", "per_node"):
            raise ValueError(
                "data_plane.transfer_queue.storage_placement must be 'pack' or 'per_node', "
                f"got {self.storage_placement!r}"
            )
        if self.listen not in ("auto", "loopback", "node"):
            raise ValueError(
                f"data_plane.transfer_queue.listen must be 'auto', 'loopback' or 'node', got {self.listen!r}"
            )
        require_positive(self, "storage_unit_num_cpus", "controller_num_cpus", allow_zero=True)
        require_positive(self, "bootstrap_timeout_s", "op_timeout_s")


@dataclass(frozen=True)
class RayStoreConfig:
    """How the Ray object-store backend finds or creates its metadata actor, and its trade-offs.

    * ``adopt_objects``: every put's objects are copied once, off the put's path, by a keeper
      actor on the writer's node into objects owned by the store, so rows survive the process
      that put them. ``false`` skips that copy: rows then die with their writer.
    * ``zero_copy_reads``: a read of whole runs of one put returns tensors that *share* Ray's
      object-store memory (like ``RAY_ENABLE_ZERO_COPY_TORCH_TENSORS``): writing into them in
      place corrupts the stored rows for every reader. ``false`` returns private copies.
    """

    ray_address: str | None = None
    adopt_objects: bool = True
    zero_copy_reads: bool = False
    index_num_cpus: float = 0.0
    bootstrap_timeout_s: float = 60.0
    op_timeout_s: float = 300.0

    def __post_init__(self) -> None:
        require_positive(self, "index_num_cpus", allow_zero=True)
        require_positive(self, "bootstrap_timeout_s", "op_timeout_s")


@dataclass(frozen=True)
class ObservabilityConfig:
    """Whether the factory wraps the client in :class:`~nemo_dataplane.wrappers.observed.ObservedClient`;
    ``track_outstanding``: whether it also keeps its per-key ledger of bytes put and not cleared
    (``bytes_outstanding``, ``snapshot()``), a cost per key of every put and clear that a caller
    wanting op timings only turns off."""

    enabled: bool = False
    track_outstanding: bool = True


@dataclass(frozen=True)
class PackingConfig:
    """How the driver cuts each DP rank's share into micro-batches.

    * ``none``: fixed ``micro_batch_size`` samples per micro-batch.
    * ``sequence``: samples packed into micro-batches of at most ``max_tokens_per_microbatch``.
    * ``dynamic``: micro-batches sized by the same token budget, keeping sample boundaries
      in length order (no bin packing).
    """

    mode: PackingMode = "none"
    max_tokens_per_microbatch: int | None = None
    micro_batch_size: int | None = None

    def __post_init__(self) -> None:
        if self.mode not in get_args(PackingMode):
            raise ValueError(f"data_plane.packing.mode must be one of {get_args(PackingMode)}, got {self.mode!r}")
        if self.mode == "none":
            if self.micro_batch_size is None or _below_one(self.micro_batch_size):
                raise ValueError(
                    f"data_plane.packing.micro_batch_size must be >= 1 when mode is 'none', got {self.micro_batch_size}"
                )
        elif self.max_tokens_per_microbatch is None or _below_one(self.max_tokens_per_microbatch):
            raise ValueError(
                "data_plane.packing.max_tokens_per_microbatch must be >= 1 when mode is "
                f"{self.mode!r}, got {self.max_tokens_per_microbatch}"
            )


def _default_packing() -> PackingConfig:
    return PackingConfig(mode="none", micro_batch_size=4)


@dataclass(frozen=True)
class DataPlaneConfig:
    """The ``data_plane`` section: whether batches move through a store, which one, and how.

    Build from YAML/dicts with :meth:`from_dict`."""

    enabled: bool = False
    backend: str = "transfer_queue"
    backend_kwargs: Mapping[str, Any] = field(default_factory=dict)
    fetch_policy: FetchPolicy = "auto"
    column_max_bytes_per_sample: int = 64
    # Per-row digests recorded at put, checked at get (nemo_dataplane.wrappers.integrity); off: no cost.
    verify_integrity: bool = False
    # Each row's key identity stored at put, read back and compared at every get
    # (nemo_dataplane.wrappers.identity): a store that returns other keys' rows fails the get.
    verify_rows: bool = True
    transfer_queue: TransferQueueConfig = field(default_factory=TransferQueueConfig)
    ray_store: RayStoreConfig = field(default_factory=RayStoreConfig)
    observability: ObservabilityConfig = field(default_factory=ObservabilityConfig)
    packing: PackingConfig = field(default_factory=_default_packing)
    # Capacity in keys (rows), every partition together; None: unbounded. Enforced for every
    # backend by nemo_dataplane.wrappers.capacity.CapacityGuard (the factory wraps the client with it).
    max_rows: int | None = None
    # Fields whose CUDA tensors stay on the GPU that made them (nemo_dataplane.wrappers.gpu_resident).
    gpu_fields: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.max_rows is not None and _below_one(self.max_rows):
            raise ValueError(f"data_plane.max_rows must be >= 1 (or null: unbounded), got {self.max_rows}")
        if not isinstance(self.backend, str) or not self.backend:
            raise ValueError(f"data_plane.backend must be a non-empty str, got {self.backend!r}")
        if self.backend not in BUILTIN_BACKENDS:
            backend_path(self.backend)
        if self.fetch_policy not in get_args(FetchPolicy):
            raise ValueError(
                f"data_plane.fetch_policy must be one of {get_args(FetchPolicy)}, got {self.fetch_policy!r}"
            )
        if _below_one(self.column_max_bytes_per_sample):
            raise ValueError(
                f"data_plane.column_max_bytes_per_sample must be >= 1, got {self.column_max_bytes_per_sample}"
            )

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | DataPlaneConfig | None) -> DataPlaneConfig:
        """Validate a plain mapping (e.g. from OmegaConf) into a config.

        Raises:
            ValueError: an unknown key (named with its dotted path) or an invalid value.
        """
        if isinstance(data, DataPlaneConfig):
            return data
        return build_config(cls, dict(data or {}), "data_plane")

    def to_dict(self) -> dict[str, Any]:
        """Plain nested dict (round-trips through :meth:`from_dict`)."""
        return dataclasses.asdict(self)


_SECTIONS: dict[str, type] = {
    "transfer_queue": TransferQueueConfig,
    "ray_store": RayStoreConfig,
    "observability": ObservabilityConfig,
    "packing": PackingConfig,
}


def config_section(value: Any, name: str, what: str) -> Any:
    """The ``data_plane.<name>`` section from itself, a whole :class:`DataPlaneConfig`, or a
    plain mapping of that section (validated like YAML).

    Raises:
        TypeError: any other type (names ``what``, the caller's argument).
        ValueError: an invalid mapping (names the dotted key).
    """
    cls = _SECTIONS[name]
    if isinstance(value, cls):
        return value
    if isinstance(value, DataPlaneConfig):
        return getattr(value, name)
    if isinstance(value, Mapping):
        return getattr(DataPlaneConfig.from_dict({name: dict(value)}), name)
    raise TypeError(f"{what} must be a {cls.__name__}, DataPlaneConfig or mapping, got {type(value).__name__}")


# --------------------------------------------------------------------------- typed building
# One validator for every config of this library and of the trainers (algorithms/config.py).
def plain(x: Any) -> Any:
    if isinstance(x, Mapping):
        return {k: plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [plain(v) for v in x]
    return x


def _coerce(value: Any, tp: Any, key: str) -> Any:
    origin = typing.get_origin(tp)
    if tp is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for a in args:
            if a is type(None):
                continue
            try:
                return _coerce(value, a, key)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[0] if errors else f"{key}: invalid value {value!r}")
    if origin is Literal:
        allowed = typing.get_args(tp)
        if value not in allowed:
            raise ConfigError(f"{key} must be one of {list(allowed)}, got {value!r}")
        return value
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key} must be true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key} must be an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key} must be a number, got {value!r}")
        if not math.isfinite(value):  # a NaN compares false with every bound; an infinite wait never ends
            raise ConfigError(f"{key} must be a finite number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{key} must be a string, got {value!r}")
        return value
    if origin is tuple and typing.get_args(tp)[-1:] == (Ellipsis,):  # tuple[X, ...]: any length
        (item, _) = typing.get_args(tp)
        if not isinstance(value, Sequence) or isinstance(value, str):
            raise ConfigError(f"{key} must be a list, got {value!r}")
        return tuple(_coerce(v, item, f"{key}[{i}]") for i, v in enumerate(value))
    if origin is tuple:
        args = typing.get_args(tp)
        if not isinstance(value, Sequence) or isinstance(value, str) or len(value) != len(args):
            raise ConfigError(f"{key} must be a list of {len(args)} values, got {value!r}")
        return tuple(_coerce(v, a, f"{key}[{i}]") for i, (v, a) in enumerate(zip(value, args)))
    if origin in (Mapping, dict) or tp in (dict, Mapping):
        if not isinstance(value, Mapping):
            raise ConfigError(f"{key} must be a mapping, got {value!r}")
        return plain(value)
    raise ConfigError(f"{key}: unsupported config type {tp!r}")  # pragma: no cover - schema bug


def config_key(f: dataclasses.Field[Any]) -> str:
    """A field's YAML key (``async`` is a Python keyword, so its field is ``async_``)."""
    return cast(str, f.metadata.get("key", f.name))


def _over_default(cls: type, name: str, value: Any) -> Any:
    """``value`` (a section's mapping) over the field's default instance, per top-level key."""
    f = next(f for f in dataclasses.fields(cls) if f.name == name)
    if f.default_factory is not dataclasses.MISSING:
        default = f.default_factory()
    else:
        default = None if f.default is dataclasses.MISSING else f.default
    if not isinstance(value, Mapping) or not dataclasses.is_dataclass(default):
        return value
    base = {config_key(g): getattr(default, g.name) for g in dataclasses.fields(default)}
    return {**base, **value}


def build_config(cls: type[T], data: Any, path: str) -> T:
    """Build the frozen dataclass ``cls`` from a plain mapping, driven by its type hints.

    Nested dataclass fields recurse; a field's YAML key is ``metadata["key"]`` or its name. A
    partial mapping for a nested section is merged key by key over that field's own default
    (its ``default``/``default_factory``, e.g. packing's ``micro_batch_size=4``), not over the
    section class's bare defaults.

    Raises:
        ConfigError: an unknown key, a value of the wrong type, or the section's own
            ``__post_init__`` check failing; the message names the dotted key.
    """
    if data is None:
        data = {}
    if not isinstance(data, Mapping):
        raise ConfigError(f"{path or 'config'} must be a mapping, got {data!r}")
    hints = typing.get_type_hints(cls)
    by_key = {config_key(f): f.name for f in dataclasses.fields(cls)}
    names = list(by_key)
    unknown = sorted(set(data) - set(names))
    if unknown:
        dotted = [f"{path}.{k}" if path else str(k) for k in unknown]
        raise ConfigError(f"unknown config key(s) {dotted}; known under {path or 'the top level'}: {names}")
    kwargs: dict[str, Any] = {}
    for yaml_key, value in data.items():
        name = by_key[yaml_key]
        key = f"{path}.{yaml_key}" if path else yaml_key
        tp = hints[name]
        if dataclasses.is_dataclass(tp):
            section = cast("type[DataclassInstance]", tp)  # a type hint: the class, never an instance
            kwargs[name] = (
                value if isinstance(value, section) else build_config(section, _over_default(cls, name, value), key)
            )
        else:
            kwargs[name] = _coerce(value, tp, key)
    try:
        return cls(**kwargs)
    except FieldError as e:
        raise ConfigError(f"{path}.{e}" if path else str(e)) from e
    except (ValueError, TypeError) as e:  # the section's own checks (data_plane.* name their key)
        msg = str(e)
        raise ConfigError(msg if path and path in msg else f"{path or 'config'}: {msg}") from e
