"""nemo_dataplane.wrappers.capacity: ``data_plane.max_rows`` for every backend; a put past it raises
StoreFullError naming the key and writes nothing; rows of other writers count."""

from __future__ import annotations

import uuid

import pytest
import torch

from nemo_dataplane.wrappers.capacity import CapacityGuard, StoreFullError


def _rows(n: int) -> dict:
    return {"x": torch.arange(float(n))}


@pytest.mark.parametrize("store", ["memory", "tq"], indirect=False)
def test_a_put_past_max_rows_is_refused_whole_and_names_the_key(store: str, memory_client, request) -> None:
    inner = memory_client if store == "memory" else request.getfixturevalue("tq_client")
    pid, other = f"cap_{uuid.uuid4().hex[:6]}", f"cap_other_{uuid.uuid4().hex[:6]}"
    held_before = sum(len(inner.kv_list(p)) for p in inner.kv_partitions())
    guard = CapacityGuard(inner, held_before + 6)
    try:
        guard.kv_batch_put(["a", "b", "c"], pid, _rows(3))
        inner.kv_batch_put(["o1", "o2"], other, _rows(2))  # another writer, another partition: counts
        with pytest.raises(
            StoreFullError,
            match=rf"data_plane.max_rows={held_before + 6} reached .*would make "
            rf"{held_before + 7}\); nothing was written",
        ):
            guard.kv_batch_put(["d", "e"], pid, _rows(2))
        assert sorted(inner.kv_list(pid).keys) == ["a", "b", "c"]
        guard.kv_batch_put(["a", "b"], pid, {"y": torch.ones(2)})  # new fields of existing rows: no new keys
        guard.kv_batch_put(["d"], pid, _rows(1))  # exactly at capacity
        guard.kv_clear(["a", "b"], pid)
        guard.kv_batch_put(["e", "f"], pid, _rows(2))  # room again once rows are released
        assert sorted(guard.kv_list(pid).keys) == ["c", "d", "e", "f"]
    finally:
        inner.kv_clear(None, pid)
        inner.kv_clear(None, other)


def test_the_factory_wraps_the_client_when_max_rows_is_set_and_the_config_refuses_nonsense() -> None:
    from nemo_dataplane.config import DataPlaneConfig
    from nemo_dataplane.factory import build_data_plane_client

    client = build_data_plane_client({"backend": "memory", "max_rows": 2})
    assert isinstance(client, CapacityGuard) and client.max_rows == 2
    client.kv_batch_put(["a", "b"], "p", _rows(2))
    with pytest.raises(StoreFullError, match="data_plane.max_rows=2"):
        client.kv_batch_put(["c"], "p", _rows(1))
    assert not isinstance(build_data_plane_client({"backend": "memory"}), CapacityGuard)
    with pytest.raises(ValueError, match="data_plane.max_rows must be >= 1"):
        DataPlaneConfig.from_dict({"max_rows": 0})


def test_the_trainer_refuses_a_capacity_below_one_step_naming_the_key() -> None:
    from pathlib import Path

    from algorithms.config import ConfigError, async_min_rows, load_config

    cfg = Path(__file__).resolve().parents[2] / "examples" / "configs" / "grpo_tiny.yaml"
    small = ["grpo.prompts_per_step=4", "generation.n=4", "data_plane.packing.micro_batch_size=4"]
    with pytest.raises(ConfigError, match=r"data_plane.max_rows=15 is below one step's batch .* = 16 rows"):
        load_config(str(cfg), [*small, "data_plane.max_rows=15"])
    ok = load_config(str(cfg), [*small, "data_plane.max_rows=16", "async.groups_per_generation=2"])
    assert async_min_rows(ok) == (4 + 2 - 1) * 4


def test_the_memory_backend_bounds_the_bytes_of_stored_tensors_not_the_keys() -> None:
    from nemo_dataplane.adapters.memory import InMemoryClient
    from nemo_dataplane.codec import jagged_from_rows

    store = InMemoryClient(max_bytes=100)
    store.kv_batch_put(["a", "b"], "p", {"x": torch.zeros(2, 4)})  # 2 rows of 4 float32: 32 bytes
    store.kv_batch_put(["t"], "q", None, tags=[{"only": "tags"}])  # a key without tensors costs nothing
    assert store.bytes_stored() == 32
    with pytest.raises(StoreFullError, match=r"max_bytes=100 reached \(32 bytes held, .* would make 104\)"):
        store.kv_batch_put(["c"], "p", {"y": torch.zeros(1, 9, dtype=torch.float64)})  # 72 bytes, one key
    assert store.kv_list("p").keys == ("a", "b") and store.bytes_stored() == 32  # nothing written
    store.kv_batch_put(["a", "b"], "p", {"x": torch.zeros(2, 2)})  # replacing a field: 16 - 32
    assert store.bytes_stored() == 16
    store.kv_batch_put(["c", "d"], "q", {"j": jagged_from_rows([torch.zeros(3), torch.zeros(18)])})  # 84
    assert store.bytes_stored() == 100  # exactly at the bound
    store.kv_clear(["c"], "q")
    store.kv_clear(None, "p")
    assert store.bytes_stored() == 72
    with pytest.raises(ValueError, match="max_bytes must be an int >= 1"):
        InMemoryClient(max_bytes=0)


def test_max_bytes_reaches_the_memory_backend_through_backend_kwargs() -> None:
    from nemo_dataplane.adapters.memory import InMemoryClient
    from nemo_dataplane.factory import build_data_plane_client

    client = build_data_plane_client({"backend": "memory", "backend_kwargs": {"max_bytes": 8}, "verify_rows": False})
    assert isinstance(client, InMemoryClient) and client.max_bytes == 8
    with pytest.raises(StoreFullError, match="max_bytes=8"):
        client.kv_batch_put(["a"], "p", {"x": torch.zeros(1, 3)})
