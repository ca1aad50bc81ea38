"""DataPlaneConfig: defaults, validation naming the dotted path, dict round trip."""

from __future__ import annotations

import dataclasses

import pytest
from omegaconf import OmegaConf

from nemo_dataplane.config import DataPlaneConfig, PackingConfig, TransferQueueConfig


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
