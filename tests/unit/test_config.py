"""DataPlaneConfig: defaults, validation naming the dotted path, dict round trip."""

from __future__ import annotations

import dataclasses

import pytest
from omegaconf import OmegaConf

from nemo_dataplane.config import (
    DataPlaneConfig,
    FieldError,
    PackingConfig,
    RayStoreConfig,
    TransferQueueConfig,
)

NAN, INF = float("nan"), float("inf")


def test_defaults_are_the_documented_ones() -> None:
    cfg = DataPlaneConfig.from_dict(None)
    assert (cfg.enabled, cfg.backend, cfg.fetch_policy, cfg.column_max_bytes_per_sample) == (
        False,
        "transfer_queue",
        "auto",
        64,
    )
    tq = cfg.transfer_queue
    assert (tq.ray_address, tq.num_storage_units, tq.storage_unit_num_cpus, tq.controller_num_cpus) == (
        None,
        None,
        0.5,
        0.5,
    )
    assert (tq.bootstrap_timeout_s, tq.op_timeout_s, tq.quiet) == (60.0, 300.0, True)
    assert cfg.packing == PackingConfig(mode="none", micro_batch_size=4)


@pytest.mark.parametrize(
    ("data", "path"),
    [
        ({"bogus": 1}, "data_plane.bogus"),
        ({"transfer_queue": {"num_units": 2}}, "data_plane.transfer_queue.num_units"),
        ({"packing": {"mode": "none", "micro_batch_size": 2, "mbs": 1}}, "data_plane.packing.mbs"),
        ({"observability": {"enable": True}}, "data_plane.observability.enable"),
    ],
)
def test_unknown_keys_name_their_dotted_path(data: dict, path: str) -> None:
    with pytest.raises(ValueError, match=rf"unknown config key\(s\) \['{path}'\]"):
        DataPlaneConfig.from_dict(data)


@pytest.mark.parametrize(
    ("data", "match"),
    [
        ({"fetch_policy": "sometimes"}, "data_plane.fetch_policy must be one of"),
        ({"backend": ""}, "data_plane.backend must be a non-empty str"),
        ({"column_max_bytes_per_sample": 0}, "column_max_bytes_per_sample must be >= 1"),
        ({"transfer_queue": {"num_storage_units": 0}}, r"transfer_queue.num_storage_units must be >= 1"),
        ({"transfer_queue": {"storage_unit_num_cpus": -1}}, r"transfer_queue.storage_unit_num_cpus must be >= 0"),
        ({"transfer_queue": {"op_timeout_s": 0}}, r"transfer_queue.op_timeout_s must be > 0"),
        ({"packing": {"mode": "sequence"}}, "max_tokens_per_microbatch must be >= 1"),
        ({"packing": {"mode": "none", "micro_batch_size": None}}, "micro_batch_size must be >= 1"),
        ({"packing": {"mode": "zip"}}, "packing.mode must be one of"),
    ],
)
def test_invalid_values_are_rejected_with_their_path(data: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        DataPlaneConfig.from_dict(data)


def test_round_trip_and_omegaconf_input() -> None:
    data = {
        "enabled": True,
        "backend": "memory",
        "transfer_queue": {"num_storage_units": 2, "quiet": False},
        "packing": {"mode": "dynamic", "max_tokens_per_microbatch": 4096},
        "observability": {"enabled": True},
    }
    cfg = DataPlaneConfig.from_dict(OmegaConf.to_container(OmegaConf.create(data)))  # type: ignore[arg-type]
    assert cfg.transfer_queue == TransferQueueConfig(num_storage_units=2, quiet=False)
    assert cfg.packing.mode == "dynamic" and cfg.observability.enabled
    assert DataPlaneConfig.from_dict(cfg.to_dict()) == cfg
    assert DataPlaneConfig.from_dict(cfg) is cfg
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.backend = "x"  # type: ignore[misc]  # frozen


@pytest.mark.parametrize(
    ("make", "field"),
    [
        (lambda v: TransferQueueConfig(op_timeout_s=v), "op_timeout_s"),
        (lambda v: TransferQueueConfig(bootstrap_timeout_s=v), "bootstrap_timeout_s"),
        (lambda v: TransferQueueConfig(controller_num_cpus=v), "controller_num_cpus"),
        (lambda v: TransferQueueConfig(storage_unit_num_cpus=v), "storage_unit_num_cpus"),
        (lambda v: RayStoreConfig(op_timeout_s=v), "op_timeout_s"),
        (lambda v: RayStoreConfig(bootstrap_timeout_s=v), "bootstrap_timeout_s"),
        (lambda v: RayStoreConfig(index_num_cpus=v), "index_num_cpus"),
    ],
)
@pytest.mark.parametrize("value", [NAN, INF, -INF])
def test_sections_built_directly_refuse_non_finite_bounds_naming_the_field(make, field: str, value: float) -> None:
    """A NaN passes a ``<= 0`` check (and an op would then wait forever); an infinite timeout
    never ends. Built directly (not from YAML), each section refuses both, naming the field."""
    with pytest.raises(FieldError, match=rf"^{field} must be a finite number, got {value}"):
        make(value)


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: TransferQueueConfig(num_storage_units=NAN), "num_storage_units must be >= 1"),  # type: ignore[arg-type]
        (lambda: PackingConfig(mode="none", micro_batch_size=NAN), "micro_batch_size must be >= 1"),  # type: ignore[arg-type]
        (lambda: PackingConfig(mode="sequence", max_tokens_per_microbatch=NAN), "max_tokens_per_microbatch"),  # type: ignore[arg-type]
        (lambda: DataPlaneConfig(max_rows=NAN), "max_rows must be >= 1"),  # type: ignore[arg-type]
        (lambda: DataPlaneConfig(column_max_bytes_per_sample=NAN), "column_max_bytes_per_sample must be >= 1"),  # type: ignore[arg-type]
    ],
)
def test_count_fields_refuse_nan(make, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        make()


def test_a_nan_timeout_through_a_mapping_names_its_dotted_path() -> None:
    with pytest.raises(ValueError, match=r"data_plane.ray_store.op_timeout_s must be a finite number"):
        DataPlaneConfig.from_dict({"ray_store": {"op_timeout_s": NAN}})
