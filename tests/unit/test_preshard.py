"""driver_balanced_preshards: lengths from tags or from a field, config forms, errors; row helpers."""

from __future__ import annotations

import random

import pytest
import torch
from tensordict import TensorDict

from nemo_dataplane.config import DataPlaneConfig, PackingConfig
from nemo_dataplane.driver.planner import plan
from nemo_dataplane.driver.preshard import driver_balanced_preshards
from nemo_dataplane.meta import KVBatchMeta
from nemo_dataplane.rows import select_rows, split_microbatches

SEQ = PackingConfig(mode="sequence", max_tokens_per_microbatch=128)


def _lens(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randint(4, 100) for _ in range(n)]


def _meta(lens: list[int]) -> KVBatchMeta:
    return KVBatchMeta(
        keys=[f"k{i}" for i in range(len(lens))],
        tags=[{"seq_len": s, "uid": i} for i, s in enumerate(lens)],
        partition_id="p",
    )


def test_meta_and_tensordict_give_the_same_plan() -> None:
    lens = _lens(24)
    td = TensorDict({"seq_len": torch.tensor(lens), "x": torch.zeros(24, 3)}, batch_size=[24])
    from_meta = driver_balanced_preshards(_meta(lens), 4, SEQ)
    from_td = driver_balanced_preshards(td, 4, SEQ)
    assert from_meta == from_td == plan(lens, 4, SEQ)
    assert len({len(m) for m in from_meta.microbatches}) == 1


def test_config_forms() -> None:
    lens = _lens(16, 1)
    meta = _meta(lens)
    as_mapping = {"mode": "sequence", "max_tokens_per_microbatch": 128}
    as_dp = DataPlaneConfig.from_dict({"packing": as_mapping})
    assert driver_balanced_preshards(meta, 2, as_mapping) == driver_balanced_preshards(meta, 2, as_dp)
    assert driver_balanced_preshards(meta, 2, as_dp).mode == "sequence"
    with pytest.raises(ValueError, match="data_plane.packing.max_tokens_per_microbatch"):
        driver_balanced_preshards(meta, 2, {"mode": "dynamic"})


def test_missing_tag_names_the_key() -> None:
    meta = _meta([5, 6, 7])
    broken = KVBatchMeta(keys=meta.keys, tags=[meta.tags[0], {"uid": 1}, meta.tags[2]], partition_id="p")
    with pytest.raises(KeyError, match=r"'k1'.*'seq_len'"):
        driver_balanced_preshards(broken, 1, SEQ)


def test_bad_tag_value_names_the_key() -> None:
    meta = KVBatchMeta(keys=["a", "b"], tags=[{"seq_len": 3}, {"seq_len": "long"}], partition_id="p")
    with pytest.raises(ValueError, match=r"key 'b'"):
        driver_balanced_preshards(meta, 1, SEQ)
    # Tensor-valued and integral float tags (as some stores hand them back) are accepted.
    ok = KVBatchMeta(keys=["a", "b"], tags=[{"seq_len": torch.tensor(3)}, {"seq_len": 4.0}], partition_id="p")
    assert driver_balanced_preshards(ok, 1, SEQ).seq_lens == (3, 4)


def test_tensordict_field_errors() -> None:
    td = TensorDict({"x": torch.zeros(3)}, batch_size=[3])
    with pytest.raises(KeyError, match="seq_len"):
        driver_balanced_preshards(td, 1, SEQ)
    td = TensorDict({"seq_len": torch.ones(3)}, batch_size=[3])
    with pytest.raises(ValueError, match="integers"):
        driver_balanced_preshards(td, 1, SEQ)
    td = TensorDict({"n_tok": torch.tensor([3, 4, 5])}, batch_size=[3])
    assert driver_balanced_preshards(td, 1, SEQ, seq_len_field="n_tok").seq_lens == (3, 4, 5)


def _jagged(lens: list[int], dtype: torch.dtype = torch.int64) -> torch.Tensor:
    offsets = torch.zeros(len(lens) + 1, dtype=torch.int64)
    offsets[1:] = torch.cumsum(torch.tensor(lens), 0)
    return torch.nested.nested_tensor_from_jagged(torch.arange(int(offsets[-1])).to(dtype), offsets=offsets)


def test_select_rows_keeps_jagged_and_order() -> None:
    lens = [3, 1, 4, 1, 5]
    td = TensorDict({"ids": _jagged(lens), "r": torch.arange(5.0), "m": torch.ones(5, 2, dtype=torch.bool)}, [5])
    out = select_rows(td, [4, 0, 2])
    ids = out["ids"]
    assert ids.is_nested and ids.layout == torch.jagged
    assert ids.offsets().tolist() == [0, 5, 8, 12]
    assert torch.equal(ids.values(), torch.cat([td["ids"][4], td["ids"][0], td["ids"][2]]))
    assert out["r"].tolist() == [4.0, 0.0, 2.0]
    assert out["m"].shape == (3, 2)
    with pytest.raises(IndexError, match="out of range"):
        select_rows(td, [5])


def test_split_microbatches_follows_plan_and_checks_it() -> None:
    td = TensorDict({"r": torch.arange(5.0)}, [5])
    parts = split_microbatches(td, {"microbatches": [[0, 1], [2], [3, 4]]})
    assert [p["r"].tolist() for p in parts] == [[0.0, 1.0], [2.0], [3.0, 4.0]]
    assert split_microbatches(td, None)[0] is td
    with pytest.raises(ValueError, match="5 rows arrived"):
        split_microbatches(td, {"microbatches": [[0, 1], [2]]})


def test_select_rows_copies_but_microbatches_are_views() -> None:
    lens = [3, 1, 4, 1, 5]
    td = TensorDict({"ids": _jagged(lens), "r": torch.arange(5.0)}, [5])
    # A contiguous run still comes back as a copy: a view would pickle the whole source storage.
    part = select_rows(td, [1, 2, 3])
    assert part["r"].untyped_storage().data_ptr() != td["r"].untyped_storage().data_ptr()
    assert part["ids"].values().untyped_storage().data_ptr() != td["ids"].values().untyped_storage().data_ptr()
    assert part["ids"].offsets().tolist() == [0, 1, 5, 6]
    # Micro-batches are contiguous runs of the shard: views, no copy.
    mbs = split_microbatches(td, {"microbatches": [[0, 1], [2, 3, 4]]})
    assert mbs[1]["r"].untyped_storage().data_ptr() == td["r"].untyped_storage().data_ptr()
    assert mbs[1]["ids"].offsets().tolist() == [0, 4, 5, 10]
    assert torch.equal(mbs[1]["ids"].values(), td["ids"].values()[4:])
