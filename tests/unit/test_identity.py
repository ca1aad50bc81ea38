"""The row identity check (data_plane.verify_rows, default on): a store that returns other keys'
rows fails the get naming the keys, and a training step that hits it leaves no keys behind.

The store at fault is the reference store whose gets of more than 64 keys come back rotated by
one row (``_backends.RotatingSharedMemory``: the backend new users found, which passed the whole
conformance suite before its large reads and trained to "finished" with its rows mixed up).
``TestRowIdentityConformance`` holds the wrapper itself to the whole client contract.
"""

from __future__ import annotations

import sys
import uuid
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
import torch
from tensordict import TensorDict

from algorithms.config import load_config
from algorithms.metrics import PhaseTimer
from algorithms.rollouts import ROLLOUTS, RolloutBatch, rollout_keys
from algorithms.step import Workers, train_on_batch
from algorithms.transports.data_plane import DataPlaneTransport
from nemo_dataplane.adapters.memory import InMemoryClient
from nemo_dataplane.client import DataPlaneClient, RowIdentityError
from nemo_dataplane.codec import jagged_from_rows
from nemo_dataplane.factory import build_data_plane_client
from nemo_dataplane.testing.conformance import DataPlaneConformance
from nemo_dataplane.wrappers.identity import ROW_ID, RowIdentityCheck, row_ids

sys.path.insert(0, str(Path(__file__).parent))

CONFIG = Path(__file__).resolve().parents[2] / "examples" / "configs" / "grpo_tiny.yaml"


class TestRowIdentityConformance(DataPlaneConformance):
    """The wrapper every run uses keeps every clause of the contract (its field stays hidden)."""

    @pytest.fixture
    def client(self) -> Iterator[DataPlaneClient]:
        c = RowIdentityCheck(InMemoryClient())
        yield c
        c.close()

    def remote_config(self) -> None:
        return None  # around the in-process store

    def fresh_config(self) -> Mapping[str, Any]:
        return {"backend": "memory"}


def _rotating(verify_rows: bool = True) -> DataPlaneClient:
    cfg = {
        "backend": "_backends:RotatingSharedMemory",
        "backend_kwargs": {"name": f"rot-{uuid.uuid4().hex[:8]}"},
        "verify_rows": verify_rows,
    }
    return build_data_plane_client(cfg, bootstrap=True)


def test_a_store_that_rotates_large_gets_fails_them_naming_the_keys_and_whose_rows_they_got() -> None:
    client = _rotating()
    keys = [f"k{i}" for i in range(100)]
    meta = client.kv_batch_put(
        keys, "p", {"x": torch.arange(100), "ids": jagged_from_rows([torch.arange(i % 5) for i in range(100)])}
    )
    try:
        # 64 keys or fewer: the store is right, the check passes and its field stays hidden.
        small = client.kv_batch_get(meta.subset(list(range(64))[::-1]), ["x"])
        assert small["x"].tolist() == list(range(63, -1, -1)) and set(small.keys()) == {"x"}
        # Above 64 the store rotates: the get fails, naming keys and the keys whose rows they got.
        with pytest.raises(RowIdentityError, match=r"in partition 'p': 100 of 100 rows came back for another key") as e:
            client.kv_batch_get(meta, ["x", "ids"])
        assert "'k0' got the row of 'k99'; 'k1' got the row of 'k0'" in str(e.value)
        with pytest.raises(RowIdentityError, match=r"65 of 65 rows"):
            client.kv_batch_get(keys[:65], ["ids"], partition_id="p")
        import asyncio

        with pytest.raises(RowIdentityError, match=r"'k0' got the row of"):
            asyncio.run(client.async_kv_batch_get(meta, ["x"]))
    finally:
        client.close()
    # Without the check the same get returns the wrong rows silently: what it is there for.
    unchecked = _rotating(verify_rows=False)
    try:
        unchecked.kv_batch_put(keys, "p", {"x": torch.arange(100)})
        assert unchecked.kv_batch_get(keys, ["x"], partition_id="p")["x"][:3].tolist() == [99, 0, 1]
    finally:
        unchecked.close()


def test_the_identity_field_is_hidden_reserved_and_required() -> None:
    raw = InMemoryClient()
    client = RowIdentityCheck(raw)
    meta = client.kv_batch_put(["a", "b"], "p", {"x": torch.zeros(2)}, tags=[{"t": 1}, {}])
    assert meta.fields == ("x",) and client.kv_list("p").fields == ("x",)
    assert client.kv_claim("p", "t", ["x"], 2, 0).fields == ("x",)
    # Stored for real, as the keys' identities (what a get compares with).
    assert torch.equal(raw.kv_batch_get(["b", "a"], [ROW_ID], partition_id="p")[ROW_ID], row_ids("p", ["b", "a"]))
    assert row_ids("p", ["a"]).tolist() != row_ids("q", ["a"]).tolist()  # a row of another partition is caught too
    with pytest.raises(ValueError, match=f"{ROW_ID!r} is reserved"):
        client.kv_batch_put(["c"], "p", {ROW_ID: torch.zeros(1, dtype=torch.int64)})
    with pytest.raises(ValueError, match=f"{ROW_ID!r} is the row identity check's own"):
        client.kv_batch_get(["a"], ["x", ROW_ID], partition_id="p")
    assert client.kv_list("p").keys == ("a", "b")  # the refused put wrote nothing
    # A tags-only put adds no row data; fields come later and carry the identity.
    client.kv_batch_put(["t"], "p", None, tags=[{"only": True}])
    client.kv_batch_put(["t"], "p", {"x": torch.ones(1)})
    assert client.kv_batch_get(["t", "a"], ["x"], partition_id="p")["x"].tolist() == [1.0, 0.0]
    # A row put by a client without the check: refused, saying why; a missing field stays a KeyError.
    raw.kv_batch_put(["bare"], "p", {"x": torch.ones(1)})
    with pytest.raises(RowIdentityError, match=r"have no '_row_id' field.* without data_plane.verify_rows"):
        client.kv_batch_get(["a", "bare"], ["x"], partition_id="p")
    with pytest.raises(KeyError, match="'nope'"):
        client.kv_batch_get(["a", "bare"], ["nope"], partition_id="p")
    client.close()


def _rows(n: int) -> TensorDict:
    g = torch.Generator().manual_seed(0)
    lens = torch.randint(3, 7, (n,), generator=g)
    return TensorDict(
        {
            "input_ids": jagged_from_rows([torch.randint(3, 20, (int(s),), generator=g) for s in lens]),
            "prompt_len": torch.full((n,), 2),
            "seq_len": lens,
            "group_id": torch.arange(n) // 16,
            "weight_version": torch.zeros(n, dtype=torch.int64),
            "rewards": torch.rand(n, generator=g),
            "gen_logprobs": jagged_from_rows([torch.zeros(int(s) - 1) for s in lens]),
            "token_versions": jagged_from_rows([torch.zeros(int(s) - 1, dtype=torch.int64) for s in lens]),
        },
        batch_size=[n],
    )


class _LoadingDispatch:
    """Stands in for the policy ranks: each reads its rows the way a rank does (the real
    ``DataPlaneBatchIO``, attached to the driver's store), then would compute."""

    def __init__(self, io: Any) -> None:
        self.io = io

    def call(self, kind: str, inputs: list[Any], step: int, flag: bool, timeout_s: float, what: str) -> list[Any]:
        for inp in inputs:
            self.io.load(inp, ["input_ids", "advantages"])
        raise AssertionError("unreachable: the store rotates every rank's rows")


def test_a_step_on_a_store_that_misplaces_rows_fails_naming_the_keys_and_leaves_no_keys() -> None:
    cfg = load_config(
        CONFIG,
        [
            "data_plane.enabled=true",
            "data_plane.backend=_backends:RotatingSharedMemory",
            f"data_plane.backend_kwargs.name=step-{uuid.uuid4().hex[:8]}",
        ],
    )
    transport = DataPlaneTransport(cfg)
    transport.start()
    io = transport.batch_io()
    try:
        io.open(0, None, 60.0)  # a rank's own client, attached to the driver's store
        n, groups = cfg.generation.n, list(range(cfg.grpo.prompts_per_step))
        rows = _rows(n * len(groups))
        tags = [
            {
                "seq_len": int(s),
                "prompt_len": 2,
                "group": i // n,
                "weight_version": 0,
                "reward": float(r),
                "handout": i // n,
            }
            for i, (s, r) in enumerate(zip(rows["seq_len"], rows["rewards"]))
        ]
        meta = transport.store.kv_batch_put(rollout_keys(0, groups, n), ROLLOUTS, rows, tags=tags)
        batch = RolloutBatch(
            handle=meta,
            rewards=rows["rewards"].clone(),
            group_size=n,
            group_ids=groups,
            versions=[0] * len(groups),
            response_len=3.0,
            prompts=[f"p{g}" for g in groups],
        )
        workers = Workers(policy=[None], generators=[], collectors=[], dispatch=_LoadingDispatch(io))
        with pytest.raises(
            RowIdentityError, match=r"rows came back for another key .*'v0/g\d+/s\d+' got the row of 'v0/g\d+/s\d+'"
        ):
            train_on_batch(cfg, workers, transport, batch, 0, PhaseTimer(), behaviour=False)
        assert transport.stored_keys() == {}, "the failed step left keys in the store"
    finally:
        io.close()
        transport.close()
