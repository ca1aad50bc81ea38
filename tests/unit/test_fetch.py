"""WorkerFetcher: fetch policies, plan re-attachment, leader-only write-back.

The multi-process test runs 4 ranks as Ray actors (2 DP shards x 2-rank replica groups, gloo)
on the session's Ray cluster, each attached to the session's real TransferQueue store.
"""

from __future__ import annotations

import os
import sys
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from tensordict import TensorDict

from nemo_dataplane.adapters.memory import InMemoryClient
from nemo_dataplane.client import DataPlaneClient
from nemo_dataplane.config import PackingConfig
from nemo_dataplane.driver.fan_out import fan_out_per_rank_metas
from nemo_dataplane.driver.preshard import driver_balanced_preshards
from nemo_dataplane.meta import KVBatchMeta
from nemo_dataplane.rows import select_rows
from nemo_dataplane.worker.fetch import WorkerFetcher
from nemo_dataplane.wrappers.observed import ObservedClient

REPO = str(Path(__file__).resolve().parents[2])
SEQ = PackingConfig(mode="sequence", max_tokens_per_microbatch=64)


def _batch(n: int = 12) -> TensorDict:
    lens = [(7 * i) % 23 + 3 for i in range(n)]
    offsets = torch.zeros(n + 1, dtype=torch.int64)
    offsets[1:] = torch.cumsum(torch.tensor(lens), 0)
    total = int(offsets[-1])
    return TensorDict(
        {
            "input_ids": torch.nested.nested_tensor_from_jagged(torch.arange(total) * 3, offsets=offsets),
            "logprobs": torch.nested.nested_tensor_from_jagged(torch.linspace(-5, 0, total), offsets=offsets.clone()),
            "seq_len": torch.tensor(lens),
            "reward": torch.arange(n, dtype=torch.bfloat16),
            "mask": torch.arange(n * 2).reshape(n, 2) % 3 == 0,
        },
        batch_size=[n],
    )


# ----------------------------------------------------------------- single process
def test_independent_fetch_reattaches_the_driver_plan() -> None:
    client = InMemoryClient()
    batch = _batch()
    pre = driver_balanced_preshards(batch, 2, SEQ)
    metas = fan_out_per_rank_metas(client, pre, batch, partition_id="p", key_prefix="s")
    fetcher = WorkerFetcher(client, fetch_policy="auto")  # no replica group: independent
    assert fetcher.fetch_policy == "independent" and fetcher.is_leader
    for r, meta in enumerate(metas):
        got = fetcher.fetch(meta, ["input_ids", "reward"])
        assert got.plan == pre.rank_plan(r)
        assert len(got.microbatches) == pre.num_microbatches
        sizes = [mb.batch_size[0] for mb in got.microbatches]
        assert sizes == [len(mb) for mb in pre.microbatches[r]]
        want = select_rows(batch, pre.rank_indices[r])
        assert torch.equal(got.data["input_ids"].values(), want["input_ids"].values())
        assert torch.equal(got.data["reward"], want["reward"])


def test_no_plan_means_one_microbatch_and_write_back_adds_fields() -> None:
    client = InMemoryClient()
    meta = client.kv_batch_put(["a", "b", "c"], "p", {"x": torch.arange(3.0)})
    fetcher = WorkerFetcher(client, fetch_policy="independent")
    got = fetcher.fetch(meta, ["x"])
    assert got.plan is None and len(got.microbatches) == 1
    new = fetcher.write_back(meta, {"y": got.data["x"] * 2})
    assert new is not None and new.fields == ("x", "y")
    assert client.kv_batch_get(meta, ["y"])["y"].tolist() == [0.0, 2.0, 4.0]


def test_async_twins_match_sync() -> None:
    import asyncio

    client = InMemoryClient()
    batch = _batch()
    pre = driver_balanced_preshards(batch, 2, SEQ)
    metas = fan_out_per_rank_metas(client, pre, batch, partition_id="p", key_prefix="s")
    fetcher = WorkerFetcher(client, fetch_policy="independent")
    sync = fetcher.fetch(metas[1], ["logprobs"])
    got = asyncio.run(fetcher.async_fetch(metas[1], ["logprobs"]))
    assert torch.equal(got.data["logprobs"].values(), sync.data["logprobs"].values())
    assert asyncio.run(fetcher.async_write_back(metas[1], {"adv": torch.ones(len(metas[1]))})) is not None
    assert client.kv_batch_get(metas[1], ["adv"])["adv"].sum().item() == len(metas[1])


def test_bad_construction() -> None:
    with pytest.raises(ValueError, match="fetch_policy"):
        WorkerFetcher(InMemoryClient(), fetch_policy="broadcast")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"rank 0 .*client=None"):
        WorkerFetcher(None, fetch_policy="independent")
    with pytest.raises(ValueError, match="no replica_group"):
        WorkerFetcher(InMemoryClient(), replica_ranks=[0, 1])


@pytest.mark.parametrize(
    ("field_header", "match"),
    [
        ([0, -1, 1, 2], r"field 'x' dtype code \(header\[4\]\): unknown dtype code -1"),  # not float64
        ([0, 10, 1, 2], r"field 'x' dtype code \(header\[4\]\): unknown dtype code 10"),
        ([0, 5, -1, 2], r"field 'x' ndim \(header\[5\]\): -1 out of range"),
        ([0, 5, 1, -2], r"field 'x': shape must hold non-negative ints"),
    ],
)
def test_a_broadcast_header_is_decoded_only_through_the_dtype_table(
    field_header: list[int], match: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A non-leader decoding a forged or corrupt header: [OK, rows, fields, jagged, code, ndim, *shape].
    fetcher = WorkerFetcher(InMemoryClient(), fetch_policy="independent")
    monkeypatch.setattr(fetcher, "_recv_header", lambda: [0, 2, 1, *field_header])
    monkeypatch.setattr(fetcher, "_bcast", lambda t: None)
    with pytest.raises(ValueError, match=match):
        fetcher._receive(["x"])
    monkeypatch.setattr(fetcher, "_recv_header", lambda: [0, 2, 1, 0, 5, 1, 2])  # int64 [2]: accepted
    assert fetcher._receive(["x"])["x"].dtype == torch.int64


def test_a_field_of_a_dtype_without_a_wire_code_is_refused_by_name() -> None:
    data = TensorDict({"z": torch.zeros(2, dtype=torch.complex64)}, batch_size=[2])
    with pytest.raises(TypeError, match=r"field 'z': dtype torch.complex64 has no wire code"):
        WorkerFetcher._encode(data, ["z"])


def test_fetch_of_mismatched_plan_raises() -> None:
    client = InMemoryClient()
    meta = client.kv_batch_put(["a", "b"], "p", {"x": torch.zeros(2)})
    meta = meta.with_extra_info(packing={"microbatches": [[0, 1, 2]]})
    with pytest.raises(ValueError, match="2 rows arrived"):
        WorkerFetcher(client, fetch_policy="independent").fetch(meta, ["x"])


# ----------------------------------------------------------------- 4 processes
class _Rank:
    """One training rank: a gloo world of 4, replica groups {0,1} and {2,3}; leaders are 0 and 2."""

    def setup(self, rank: int, world: int, init_method: str, groups: list[list[int]]) -> bool:
        import datetime

        import torch.distributed as dist

        from nemo_dataplane.adapters.transfer_queue.client import TransferQueueClient
        from nemo_dataplane.config import TransferQueueConfig

        torch.set_num_threads(1)
        dist.init_process_group(
            "gloo", init_method=init_method, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60)
        )
        handles = [dist.new_group(g, backend="gloo") for g in groups]  # every rank creates every group
        mine = next(i for i, g in enumerate(groups) if rank in g)
        self.rank, self.group, self.ranks = rank, handles[mine], groups[mine]
        self.client = ObservedClient(TransferQueueClient(TransferQueueConfig(op_timeout_s=30), bootstrap=False))
        return True

    def run(
        self, policy: str, meta: KVBatchMeta, fields: list[str], pass_client: bool = True, use_async: bool = False
    ) -> dict[str, Any]:
        import asyncio

        before = dict(self.client.op_counts)
        fetcher = WorkerFetcher(
            self.client if pass_client else None,
            fetch_policy=policy,  # type: ignore[arg-type]
            replica_group=self.group,
            replica_ranks=self.ranks,
            timeout_s=30,
        )
        out: dict[str, Any] = {"rank": self.rank, "leader": fetcher.is_leader, "policy": fetcher.fetch_policy}
        try:
            got = asyncio.run(fetcher.async_fetch(meta, fields)) if use_async else fetcher.fetch(meta, fields)
        except Exception as e:  # noqa: BLE001 - reported to the test
            out["error"] = f"{type(e).__name__}: {e}"
        else:
            out["data"] = {
                k: (v.values().tolist(), v.offsets().tolist()) if v.is_nested else (str(v.dtype), v.float().tolist())
                for k, v in got.data.items()
            }
            out["n_microbatches"] = len(got.microbatches)
            # Every rank computes the same result; only the leader's write may reach the store.
            score = torch.stack([row.float().sum() for row in got.data["logprobs"].unbind(0)])
            scores = {f"score_{policy}{'_async' if use_async else ''}": score}
            if use_async:
                out["wrote"] = asyncio.run(fetcher.async_write_back(meta, scores)) is not None
            else:
                out["wrote"] = fetcher.write_back(meta, scores) is not None
        out["ops"] = {k: v - before.get(k, 0) for k, v in self.client.op_counts.items() if v - before.get(k, 0)}
        return out

    def close(self) -> None:
        import torch.distributed as dist

        dist.destroy_process_group()
        self.client.inner.close()


@pytest.fixture(scope="module")
def four_ranks(ray_session: Any, tq_client: DataPlaneClient) -> Iterator[list[Any]]:
    ray = ray_session
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    # A FileStore rendezvous: no port to pick, so no race with other processes for it.
    store_file = Path(tempfile.gettempdir()) / f"nd-fetch-{uuid.uuid4().hex}"
    init_method = f"file://{store_file}"
    env = {"PYTHONPATH": os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]), "OMP_NUM_THREADS": "1"}
    actor_cls = ray.remote(num_cpus=0, runtime_env={"env_vars": env})(_Rank)
    actors = [actor_cls.remote() for _ in range(4)]
    groups = [[0, 1], [2, 3]]
    try:
        ray.get([a.setup.remote(r, 4, init_method, groups) for r, a in enumerate(actors)], timeout=120)
        yield actors
        ray.get([a.close.remote() for a in actors], timeout=30)
    finally:
        for a in actors:
            ray.kill(a)
        store_file.unlink(missing_ok=True)


@pytest.fixture
def planned(tq_client: DataPlaneClient) -> Iterator[tuple[TensorDict, Any, list[KVBatchMeta], str]]:
    pid = f"fetch-{uuid.uuid4().hex[:8]}"
    batch = _batch()
    pre = driver_balanced_preshards(batch, 2, SEQ)
    metas = fan_out_per_rank_metas(tq_client, pre, batch, partition_id=pid, key_prefix="s0")
    yield batch, pre, metas, pid
    tq_client.kv_clear(None, pid)


def _run_all(
    ray: Any, actors: list[Any], policy: str, metas: list[KVBatchMeta], fields: list[str], **kw: Any
) -> list[dict[str, Any]]:
    # DP shard d goes to replica group d: ranks 2d and 2d+1 get the same meta.
    return ray.get([a.run.remote(policy, metas[r // 2], fields, **kw) for r, a in enumerate(actors)], timeout=120)


@pytest.mark.parametrize("use_async", [False, True], ids=["sync", "async"])
def test_leader_broadcast_only_leaders_touch_the_store(
    ray_session: Any, tq_client: DataPlaneClient, four_ranks: list[Any], planned: Any, use_async: bool
) -> None:
    batch, pre, metas, _ = planned
    fields = ["input_ids", "logprobs", "reward", "mask"]
    results = _run_all(ray_session, four_ranks, "auto", metas, fields, use_async=use_async)
    for res in results:
        assert "error" not in res, res.get("error")
        assert res["policy"] == "leader_broadcast"
        if res["leader"]:
            assert res["ops"] == {"kv_batch_get": 1, "kv_batch_put": 1} and res["wrote"]
        else:
            assert res["ops"] == {} and not res["wrote"]  # had a client, never used it
        assert res["n_microbatches"] == pre.num_microbatches
    # Siblings hold identical tensors, and they are the driver's rows for that shard.
    for d in range(2):
        a, b = results[2 * d], results[2 * d + 1]
        assert a["data"] == b["data"]
        want = select_rows(batch, pre.rank_indices[d])
        assert a["data"]["input_ids"] == (want["input_ids"].values().tolist(), want["input_ids"].offsets().tolist())
        assert a["data"]["reward"] == ("torch.bfloat16", want["reward"].float().tolist())
    # Each score written exactly once, by the leaders, with the right values.
    for d in range(2):
        name = "score_auto_async" if use_async else "score_auto"
        got = tq_client.kv_batch_get(metas[d], [name])[name]
        want = torch.stack([row.sum() for row in select_rows(batch, pre.rank_indices[d])["logprobs"].unbind(0)])
        assert torch.allclose(got, want)


def test_independent_every_rank_fetches_but_one_writes(ray_session: Any, four_ranks: list[Any], planned: Any) -> None:
    _, _, metas, _ = planned
    results = _run_all(ray_session, four_ranks, "independent", metas, ["logprobs"])
    for res in results:
        assert "error" not in res, res.get("error")
        expected = {"kv_batch_get": 1, "kv_batch_put": 1} if res["leader"] else {"kv_batch_get": 1}
        assert res["ops"] == expected
    assert results[0]["data"] == results[1]["data"] and results[2]["data"] == results[3]["data"]


def test_leader_failure_is_relayed_not_hung(ray_session: Any, four_ranks: list[Any], planned: Any) -> None:
    _, _, metas, _ = planned
    # Non-leaders pass client=None (allowed under leader_broadcast); the field does not exist.
    results = ray_session.get(
        [
            a.run.remote("leader_broadcast", metas[r // 2], ["nope"], pass_client=(r % 2 == 0))
            for r, a in enumerate(four_ranks)
        ],
        timeout=120,
    )
    for res in results:
        if res["leader"]:
            assert res["error"].startswith("KeyError") and "nope" in res["error"]
        else:
            assert "replica leader rank" in res["error"] and "nope" in res["error"]


def test_leader_broadcast_without_a_group_fetches_directly() -> None:
    # A one-rank replica group has nobody to broadcast to; it must not touch torch.distributed.
    client = ObservedClient(InMemoryClient())
    meta = client.kv_batch_put(["a", "b"], "p", {"x": torch.arange(2.0)})
    fetcher = WorkerFetcher(client, fetch_policy="leader_broadcast")
    assert fetcher.fetch(meta, ["x"]).data["x"].tolist() == [0.0, 1.0]
    assert client.op_counts["kv_batch_get"] == 1
