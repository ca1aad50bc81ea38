"""The weight-transfer options (``WeightTransferConfig``)."""

from __future__ import annotations

import dataclasses

import pytest

from nemo_dataplane.config import ConfigError
from nemo_dataplane.refit.config import BUILTIN_TRANSPORTS, MIN_BUCKET_BYTES, WeightTransferConfig

# ---------------------------------------------------------------- options


def test_config_defaults_are_stated_once_and_round_trip_through_a_mapping() -> None:
    cfg = WeightTransferConfig()
    assert (cfg.family, cfg.transport, cfg.bucket_bytes, cfg.direct_bytes) == ("packed", "auto", None, None)
    assert (cfg.ipc_done, cfg.ipc_map_peers) == ("event", True)
    assert WeightTransferConfig.from_dict(None) == cfg
    assert WeightTransferConfig.from_dict(cfg) is cfg
    back = WeightTransferConfig.from_dict(dataclasses.asdict(cfg))
    assert back == cfg
    got = WeightTransferConfig.from_dict({"family": "reshard", "transport": "ipc", "bucket_bytes": 1 << 20,
                                          "ipc_done": "host", "ipc_map_peers": False})
    assert got == WeightTransferConfig("reshard", "ipc", 1 << 20, None, "host", False)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"family": ""}, "refit.family"),
        ({"transport": "broadcast", "family": "reshard"}, "refit.transport"),  # packed only
        ({"transport": "carrier-pigeon"}, "refit.transport"),
        ({"bucket_bytes": MIN_BUCKET_BYTES - 1}, "refit.bucket_bytes"),
        ({"bucket_bytes": True}, "refit.bucket_bytes"),
        ({"direct_bytes": -1}, "refit.direct_bytes"),
        ({"ipc_done": "eventually"}, "refit.ipc_done"),
        ({"ipc_map_peers": "yes"}, "refit.ipc_map_peers"),
    ],
)
def test_config_refuses_a_bad_value_naming_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        WeightTransferConfig(**kwargs)


def test_config_from_dict_names_unknown_keys_and_wrong_types() -> None:
    with pytest.raises(ConfigError, match=r"refit\.ipc_batch"):
        WeightTransferConfig.from_dict({"ipc_batch": False})
    with pytest.raises(ConfigError, match=r"refit\.bucket_bytes"):
        WeightTransferConfig.from_dict({"bucket_bytes": "1GiB"})


def test_a_third_party_family_may_name_its_own_transport() -> None:
    # Checked against the family's registered choices when it is built (factory), not here.
    assert WeightTransferConfig(family="mine", transport="rdma").transport == "rdma"
    assert set(BUILTIN_TRANSPORTS) == {"packed", "reshard"}
