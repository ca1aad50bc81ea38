"""Driver column I/O: small per-sample values round-trip; bulk is refused before it can leak."""

from __future__ import annotations

import pytest
import torch

from nemo_dataplane.adapters.memory import InMemoryClient
from nemo_dataplane.client import DataPlaneClient
from nemo_dataplane.driver.columns import read_columns, write_columns
from nemo_dataplane.meta import KVBatchMeta
from nemo_dataplane.wrappers.observed import ObservedClient


def _seed(client: DataPlaneClient, pid: str, n: int = 6) -> KVBatchMeta:
    lens = [3, 70, 5, 2, 9, 4][:n]
    offsets = torch.zeros(n + 1, dtype=torch.int64)
    offsets[1:] = torch.cumsum(torch.tensor(lens), 0)
    ids = torch.nested.nested_tensor_from_jagged(torch.arange(int(offsets[-1])), offsets=offsets)
    return client.kv_batch_put(
        [f"k{i}" for i in range(n)],
        pid,
        {"input_ids": ids, "reward": torch.arange(n, dtype=torch.float32), "bulk": torch.zeros(n, 32)},
        tags=[{"seq_len": s} for s in lens],
    )


def test_round_trip_in_meta_order(store: tuple[DataPlaneClient, str]) -> None:
    client, pid = store
    meta = _seed(client, pid)
    shuffled = meta.reorder([3, 0, 5, 1, 4, 2])
    out = read_columns(client, shuffled, ["reward"])
    assert out["reward"].tolist() == [3.0, 0.0, 5.0, 1.0, 4.0, 2.0]
    adv = torch.tensor([0.5, -1.0, 2.0, 0.0, 1.5, -0.5], dtype=torch.float32)
    new_meta = write_columns(client, shuffled, {"advantages": adv, "mask": torch.ones(6, 4, dtype=torch.bool)})
    assert new_meta.keys == shuffled.keys and "advantages" in (new_meta.fields or ())
    assert new_meta.tags == shuffled.tags
    back = read_columns(client, meta, ["advantages"])["advantages"]
    # Written in shuffled order, read in the original order: rows follow keys, not positions.
    assert back.tolist() == [adv[[3, 0, 5, 1, 4, 2].index(i)].item() for i in range(6)]


def test_write_refuses_bulk_before_any_io(store: tuple[DataPlaneClient, str]) -> None:
    client, pid = store
    meta = _seed(client, pid)
    observed = ObservedClient(client)
    with pytest.raises(ValueError, match=r"'logits' is 128 bytes/sample.*limit of 64.*column_max_bytes_per_sample"):
        write_columns(observed, meta, {"ok": torch.zeros(6), "logits": torch.zeros(6, 32)})
    assert sum(observed.op_counts.values()) == 0
    # The limit is configurable.
    write_columns(observed, meta, {"logits": torch.zeros(6, 32)}, max_bytes_per_sample=128)
    assert observed.op_counts["kv_batch_put"] == 1


def test_read_refuses_bulk_after_a_one_row_probe(store: tuple[DataPlaneClient, str]) -> None:
    client, pid = store
    meta = _seed(client, pid)
    observed = ObservedClient(client)
    with pytest.raises(ValueError, match=r"'bulk' is 128 bytes/sample.*probed on key 'k0'"):
        read_columns(observed, meta, ["reward", "bulk"])
    # Only the probe ran: one get of one key, never the whole batch.
    assert observed.op_counts["kv_batch_get"] == 1
    assert observed.bytes_by_op["kv_batch_get"] == 4 + 128


def test_read_refuses_jagged_field_wide_beyond_the_probed_row(store: tuple[DataPlaneClient, str]) -> None:
    client, pid = store
    meta = _seed(client, pid)
    # Row 0 has 3 ids (24 bytes, passes the probe); row 1 has 70 (560 bytes): refused, not returned.
    with pytest.raises(ValueError, match=r"'input_ids' is 560 bytes/sample \(widest row"):
        read_columns(client, meta, ["input_ids"])
    small = read_columns(client, meta.subset([0, 2, 3]), ["input_ids"])
    assert small["input_ids"].offsets().tolist() == [0, 3, 8, 10]


def test_bad_arguments() -> None:
    client = InMemoryClient()
    meta = _seed(client, "p")
    with pytest.raises(ValueError, match="batch dimension is 5"):
        write_columns(client, meta, {"adv": torch.zeros(5)})
    with pytest.raises(ValueError, match="max_bytes_per_sample"):
        read_columns(client, meta, ["reward"], max_bytes_per_sample=0)
    with pytest.raises(KeyError, match="nope"):
        read_columns(client, meta, ["nope"])
