"""The weight-transfer facade: its options (``WeightTransferConfig``), the factory and registry,
and the conformance suite applied to both built-in families, a third-party toy, and broken toys
that it must fail."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from nemo_dataplane.config import ConfigError
from nemo_dataplane.refit import (
    Mesh,
    RefitReceiver,
    RefitSender,
    ReshardReceiver,
    ReshardSender,
    WeightReceiver,
    WeightSender,
    build_weight_receiver,
    build_weight_sender,
    register_weight_transfer,
    weight_transfer_families,
)
from nemo_dataplane.refit.config import BUILTIN_TRANSPORTS, MIN_BUCKET_BYTES, WeightTransferConfig
from nemo_dataplane.testing.weight_transfer_conformance import WeightTransferConformance

sys.path.insert(0, str(Path(__file__).parent))  # _toy_transport, for the suite's rank processes too
import _refit_procs as P  # noqa: E402
import _reshard_procs as R  # noqa: E402

# ---------------------------------------------------------------- options


def test_config_defaults_are_stated_once_and_round_trip_through_a_mapping() -> None:
    cfg = WeightTransferConfig()
    assert (cfg.family, cfg.transport, cfg.bucket_bytes, cfg.direct_bytes) == ("packed", "auto", None, None)
    assert (cfg.ipc_done, cfg.ipc_map_peers) == ("event", True)
    assert WeightTransferConfig.from_dict(None) == cfg
    assert WeightTransferConfig.from_dict(cfg) is cfg
    back = WeightTransferConfig.from_dict(dataclasses.asdict(cfg))
    assert back == cfg
    got = WeightTransferConfig.from_dict(
        {"family": "reshard", "transport": "ipc", "bucket_bytes": 1 << 20, "ipc_done": "host", "ipc_map_peers": False}
    )
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
        ({"sender_layout": "zero3"}, "refit.sender_layout"),
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


# ---------------------------------------------------------------- factory and registry


def _fake_group(rank: int, world: int) -> Any:
    # Building an endpoint does not communicate: a stand-in group is enough for these checks.
    return SimpleNamespace(rank=rank, world_size=world, backend="gloo", device=torch.device("cpu"), prefix="t")


def test_the_factory_builds_either_built_in_family_from_the_config_alone() -> None:
    whole = {"model.layers.0.self_attn.q_proj.weight": torch.zeros(4, 2), "model.norm.weight": torch.zeros(2)}
    packed = WeightTransferConfig(bucket_bytes=4096, transport="broadcast")
    snd = build_weight_sender(packed, _fake_group(0, 3), whole)
    rcv = build_weight_receiver(packed, _fake_group(2, 3), whole)
    assert isinstance(snd, RefitSender) and isinstance(rcv, RefitReceiver)
    assert isinstance(snd, WeightSender) and isinstance(rcv, WeightReceiver)
    assert (snd.bucket_bytes, snd.transport, rcv.src) == (4096, "broadcast", 0)

    reshard = {"family": "reshard", "transport": "p2p", "ipc_done": "host"}  # a mapping works too
    shard = {"model.layers.0.self_attn.q_proj.weight": torch.zeros(2, 2), "model.norm.weight": torch.zeros(2)}
    full = {n: (tuple(t.shape), t.dtype) for n, t in whole.items()}
    snd = build_weight_sender(reshard, _fake_group(1, 3), shard, senders=2, full_shapes=full)
    rcv = build_weight_receiver(reshard, _fake_group(2, 3), (p for p in whole.items()), senders=2)  # a generator
    assert isinstance(snd, ReshardSender) and isinstance(rcv, ReshardReceiver)
    assert snd.layout.mesh == Mesh.of([0, 1], tp=2) and snd.done == rcv.done == "host"
    assert snd.layout.local_tensors(1)["model.layers.0.self_attn.q_proj.weight"].shape == (2, 2)  # column-parallel
    assert rcv.layout.mesh == Mesh.of([2], dp=1, tp=1) and sorted(rcv._tensors()) == sorted(whole)


def test_the_factory_refuses_what_no_family_can_do() -> None:
    t = {"w": torch.zeros(2)}
    with pytest.raises(ConfigError, match=r"refit\.family='nope' is not a registered"):
        build_weight_sender(WeightTransferConfig(family="nope"), _fake_group(0, 2), t)
    with pytest.raises(ValueError, match="group rank 1 cannot be a sender with senders=1"):
        build_weight_sender(WeightTransferConfig(), _fake_group(1, 2), t)
    with pytest.raises(ValueError, match="group rank 0 cannot be a receiver"):
        build_weight_receiver(WeightTransferConfig(), _fake_group(0, 2), t)
    with pytest.raises(ValueError, match=r"senders must be an int in \[1, 1\]"):
        build_weight_sender(WeightTransferConfig(), _fake_group(0, 2), t, senders=2)
    with pytest.raises(ValueError, match="packed family sends whole weights from one rank"):
        build_weight_sender(WeightTransferConfig(), _fake_group(0, 3), t, senders=2)
    with pytest.raises(ValueError, match="pass full_shapes"):
        build_weight_sender(WeightTransferConfig(family="reshard"), _fake_group(0, 3), t, senders=2)


def test_a_third_party_family_registers_by_name() -> None:
    built: list[tuple[str, int]] = []

    def sender(
        config: WeightTransferConfig, group: Any, named: Any, *, senders: int, full_shapes: Any, device: Any
    ) -> Any:
        built.append(("sender", senders))
        return RefitSender(group, named)

    def receiver(config: WeightTransferConfig, group: Any, named: Any, *, senders: int, device: Any) -> Any:
        built.append(("receiver", senders))
        return object()  # not a WeightReceiver

    register_weight_transfer("test-only", sender, receiver, transports=("auto", "carrier"), replace=True)
    assert "test-only" in weight_transfer_families()
    with pytest.raises(ValueError, match="already registered"):
        register_weight_transfer("test-only", sender, receiver)
    cfg = WeightTransferConfig(family="test-only", transport="carrier")
    assert isinstance(build_weight_sender(cfg, _fake_group(0, 2), {"w": torch.zeros(1)}), RefitSender)
    with pytest.raises(TypeError, match="not a WeightReceiver"):
        build_weight_receiver(cfg, _fake_group(1, 2), {"w": torch.zeros(1)})
    with pytest.raises(ConfigError, match=r"refit\.transport must be one of \['auto', 'carrier'\]"):
        build_weight_sender(WeightTransferConfig(family="test-only", transport="rdma"), _fake_group(0, 2), {})
    assert built == [("sender", 1), ("receiver", 1)]


def test_the_facade_reshards_tp2_to_tp1_as_the_trainer_uses_it(pool: P.Pool) -> None:
    res = P.run_ranks(pool, R.facade_reshard, [0, 1, 2], world=3, port=P.free_port())
    for r, out in res.items():
        assert not isinstance(out, BaseException), f"rank {r}:\n{P.format_exc(out)}"
    assert [res[r]["kind"] for r in (0, 1, 2)] == ["ReshardSender", "ReshardSender", "ReshardReceiver"]
    assert res[2]["refits"] == [{"version": 7, "wrong": []}, {"version": 8, "wrong": []}]
    assert res[0]["sent"] > 0 and res[1]["sent"] > 0  # each TP rank sent its own shards


# ---------------------------------------------------------------- the conformance suite, applied


class TestPackedFamilyConforms(WeightTransferConformance):
    # Small buckets: the model goes as several buckets plus tensors on their own.
    config = WeightTransferConfig(family="packed", bucket_bytes=1024)


class TestReshardFamilyConforms(WeightTransferConformance):
    config = WeightTransferConfig(family="reshard", bucket_bytes=1024, direct_bytes=512)


class TestToyThirdPartyFamilyConforms(WeightTransferConformance):
    # tests/unit/_toy_transport.py: a family written against the facade alone.
    config = WeightTransferConfig(family="toy")
    setup_modules = ("_toy_transport",)


@pytest.mark.parametrize(
    ("family", "check", "message"),
    [
        (
            "toy-int32-version",
            "check_a_second_refit_delivers_new_weights_and_its_version",
            r"refit 1 returned version 3, the sender sent 1099511627779",
        ),
        (
            "toy-lossy",
            "check_weights_arrive_bit_exact",
            r"differ from the sender's bits: \['model\.embed_tokens\.weight'",
        ),
        (
            "toy-names-only",
            "check_a_shape_mismatch_raises_naming_the_parameter",
            r"expected RefitMismatchError, nothing was raised",
        ),
    ],
)
def test_the_suite_fails_a_broken_transport(family: str, check: str, message: str) -> None:
    suite = WeightTransferConformance.for_config(WeightTransferConfig(family=family), setup_modules=("_toy_transport",))
    with pytest.raises(AssertionError, match=message):
        getattr(suite, check)()
    suite.check_a_refit_before_prepare_raises()  # the rest of the contract may well hold
