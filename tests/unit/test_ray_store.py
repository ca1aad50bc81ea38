"""Ray object-store backend specifics: the index's put protocol, object lifetime (adoption,
freeing), zero-copy reads, scattered reads, claims, bootstrap. The contract itself is covered by
test_conformance.py (``TestRayStoreConformance``)."""

from __future__ import annotations

import asyncio
import re
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from nemo_dataplane.adapters.memory import InMemoryClient
from nemo_dataplane.adapters.ray_store.actors import StoreIndex
from nemo_dataplane.adapters.ray_store.client import RayStoreClient
from nemo_dataplane.client import DataPlaneError
from nemo_dataplane.config import RayStoreConfig
from nemo_dataplane.factory import build_data_plane_client
from nemo_dataplane.testing.fields import assert_same_field, jagged, random_field


@pytest.fixture
def pid(ray_store_client: RayStoreClient) -> Iterator[str]:
    p = f"rs-{uuid.uuid4().hex[:8]}"
    yield p
    ray_store_client.kv_clear(None, p)


def _store(name: str, **cfg: Any) -> RayStoreClient:
    return RayStoreClient(RayStoreConfig(op_timeout_s=30, **cfg), bootstrap=True, actor_name=name, namespace="nd_tests")


# ----------------------------------------------------------- the index, in process
# StoreIndex is a plain class; its protocol is checked here without Ray (chunk refs are opaque).
def _run(coro: Any) -> Any:
    return asyncio.run(coro)


def test_commit_arriving_before_its_begin_waits_for_it() -> None:
    async def scenario() -> Any:
        ix = StoreIndex(lock_timeout_s=5, adopt=False)
        commit = asyncio.ensure_future(ix.commit("t1", [(["x"], "ref-x")], "w", None))
        await asyncio.sleep(0.05)  # the commit is parked, nothing applied yet
        assert (await ix.list("p"))[1] == []
        begun = await ix.begin("t1", "p", ["a", "b"], [{"i": 0}, {"i": 1}], ["x"])
        return begun, await commit, await ix.resolve("p", ["b", "a"], ["x"]), await ix.list("p")

    begun, committed, resolved, listed = _run(scenario())
    assert begun == ("ok", [{"i": 0}, {"i": 1}], ["x"]) and committed == ("ok",)
    _, where, refs = resolved
    assert where["x"] == ("runs", [(0, 1, 1), (0, 0, 1)]) and refs == {0: "ref-x"}
    assert listed == ("ok", ["a", "b"], [{"i": 0}, {"i": 1}], ["x"])


def test_abort_before_begin_and_a_commit_that_never_comes_leave_nothing() -> None:
    async def scenario() -> Any:
        ix = StoreIndex(lock_timeout_s=0.3, adopt=False)
        await ix.abort("t1")
        refused = await ix.begin("t1", "p", ["a"], None, ["x"])
        # a begin whose writer died before committing: readers wait lock_timeout_s, then it is dropped
        await ix.begin("t2", "p", ["b"], None, ["x"])
        t0 = time.monotonic()
        missing = await ix.resolve("p", ["b"], ["x"])
        waited = time.monotonic() - t0
        late = await ix.commit("t2", [(["x"], "ref")], "w", None)
        return refused, missing, waited, late, await ix.list("p"), await ix.stats()

    refused, missing, waited, late, listed, stats = _run(scenario())
    assert refused[0] == "error" and "aborted" in refused[2]
    assert missing[:2] == ("error", "KeyError") and "'b'" in missing[2]
    assert 0.25 < waited < 3
    assert late[0] == "error" and listed[1] == [] and stats["pending_puts"] == 0 and stats["chunks"] == 0


def test_upserts_share_chunks_until_the_last_row_lets_go() -> None:
    async def scenario() -> list[int]:
        ix = StoreIndex(lock_timeout_s=5, adopt=False)
        await ix.begin("t1", "p", ["a", "b", "c"], None, ["x", "y"])
        await ix.commit("t1", [(["x", "y"], "r1")], "w", None)
        await ix.begin("t2", "p", ["b"], None, ["x"])
        await ix.commit("t2", [(["x"], "r2")], "w", None)
        counts = [(await ix.stats())["chunks"]]
        await ix.clear("p", ["a", "c"])
        counts.append((await ix.stats())["chunks"])  # b's y still lives in r1
        await ix.begin("t3", "p", ["b"], None, ["y"])
        await ix.commit("t3", [(["y"], "r3")], "w", None)
        counts.append((await ix.stats())["chunks"])  # r1 released
        await ix.clear("p", None)
        counts.append((await ix.stats())["chunks"])
        return counts

    assert _run(scenario()) == [2, 2, 2, 0]


# ------------------------------------------------------------------ lifetime
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -1.0])
def test_flush_refuses_a_timeout_that_is_not_a_finite_number_ge_0(ray_store_client: RayStoreClient, bad: float) -> None:
    # A NaN would reach the index's wait as a deadline that is never reached.
    with pytest.raises(ValueError, match="^timeout_s must be"):
        ray_store_client.flush(bad)
    assert ray_store_client.flush(5.0) == 0  # the client is still usable


# ------------------------------------------------------------------ lifetime
def test_clear_frees_the_objects(ray_store_client: RayStoreClient, pid: str, plasma_mib: Any) -> None:
    before = plasma_mib()
    big = {"x": torch.arange(4 * 1024 * 1024, dtype=torch.int64).view(64, -1)}  # 32 MiB
    meta = ray_store_client.kv_batch_put([f"k{i}" for i in range(64)], pid, big)
    assert ray_store_client.flush() == 0  # adopted: the writer's copy is gone, the store's is held
    held = plasma_mib()
    assert held >= before + 30, (before, held)
    assert torch.equal(ray_store_client.kv_batch_get(meta, ["x"])["x"], big["x"])
    ray_store_client.kv_clear(None, pid)
    deadline = time.monotonic() + 10
    while plasma_mib() > before + 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert plasma_mib() <= before + 2


def _writer_cls() -> Any:
    import ray

    @ray.remote(num_cpus=0)
    class Writer:
        def __init__(self, actor_name: str) -> None:
            self.client = RayStoreClient(
                RayStoreConfig(op_timeout_s=30), bootstrap=False, actor_name=actor_name, namespace="nd_tests"
            )

        def put(self, pid: str, n: int) -> Any:
            fields = {
                "ids": jagged(list(range(1, n + 1)), seed=3),
                "x": random_field((n, 300_000), torch.float32, seed=4),
            }
            return self.client.kv_batch_put([f"k{i}" for i in range(n)], pid, fields)

        def flush(self) -> int:
            return self.client.flush()

    return Writer


@pytest.mark.parametrize("adopt", [True, False])
def test_rows_outlive_their_writer_only_when_adopted(ray_session: Any, wait_actor_dead: Any, adopt: bool) -> None:
    import ray

    name = f"rs-life-{uuid.uuid4().hex[:6]}"
    store = _store(name, adopt_objects=adopt)
    writer = _writer_cls().remote(name)
    try:
        meta = ray.get(writer.put.remote("p", 4), timeout=120)
        assert ray.get(writer.flush.remote(), timeout=60) == 0
        assert store.stats()["writer_owned"] == (0 if adopt else 2)  # two objects: bulk and ids
        ray.kill(writer)  # no close(): the process just dies
        wait_actor_dead(writer)
        if adopt:
            out = store.kv_batch_get(meta, ["ids", "x"])
            assert_same_field("ids", out["ids"], jagged([1, 2, 3, 4], seed=3))
            assert_same_field("x", out["x"], random_field((4, 300_000), torch.float32, seed=4))
        else:
            # Ray frees a dead owner's objects asynchronously too: the rows go within a bound.
            deadline = time.monotonic() + 60
            while True:
                try:
                    store.kv_batch_get(meta, ["x"])
                except DataPlaneError as e:
                    assert re.search(r"rows of partition 'p' were lost.*adopt_objects=False", str(e)), e
                    break
                assert time.monotonic() < deadline, "rows of a dead writer still readable 60 s after its death"
                time.sleep(0.2)
    finally:
        ray.kill(writer)
        store.close()


# ------------------------------------------------------------------- reads
def test_zero_copy_reads_share_memory_and_default_reads_do_not(ray_store_client: RayStoreClient, pid: str) -> None:
    x = torch.arange(3 * 100_000, dtype=torch.float32).view(3, -1)  # > 100 KB: Ray keeps it in shared memory
    meta = ray_store_client.kv_batch_put(["a", "b", "c"], pid, {"x": x})
    first = ray_store_client.kv_batch_get(meta, ["x"])["x"]
    first.mul_(0)  # a private copy: the store is untouched
    assert torch.equal(ray_store_client.kv_batch_get(meta, ["x"])["x"], x)
    zc = build_data_plane_client(
        {"backend": "ray", "ray_store": {"zero_copy_reads": True}, "verify_rows": False}, bootstrap=False
    )
    try:
        a, b = (zc.kv_batch_get(meta, ["x"])["x"] for _ in range(2))
        assert a.data_ptr() == b.data_ptr() and torch.equal(a, x)  # both map the same stored object
        assert zc.kv_batch_get(meta.subset([2, 0]), ["x"])["x"].tolist() == x[[2, 0]].tolist()
    finally:
        zc.close()


def test_scattered_reads_across_puts_match_the_reference(ray_store_client: RayStoreClient, pid: str) -> None:
    ref = InMemoryClient()
    g = torch.Generator().manual_seed(0)
    keys = [f"k{i}" for i in range(60)]
    for lo, hi in ((0, 20), (20, 45), (45, 60)):  # three puts -> three chunks per field
        n = hi - lo
        lengths = torch.randint(0, 9, (n,), generator=g).tolist()
        fields = {
            "ids": jagged(lengths, seed=lo),
            "h": jagged(lengths, 2, dtype=torch.bfloat16, seed=lo + 1),
            "r": random_field((n,), torch.float32, seed=lo + 2),
            "d": random_field((n, 3), torch.int16, seed=lo),
        }
        for c in (ray_store_client, ref):
            c.kv_batch_put(keys[lo:hi], pid, fields, tags=[{"i": i} for i in range(lo, hi)])
    for c in (ray_store_client, ref):  # an upsert of some rows spreads one field over four chunks
        c.kv_batch_put(keys[10:30:2], pid, {"r": torch.full((10,), -1.0)})
    order = torch.randperm(60, generator=g).tolist()
    for pick in (order, order[:7], sorted(order[:30]), list(range(59, -1, -1))):
        ks = [keys[i] for i in pick]
        got = ray_store_client.kv_batch_get(ks, ["ids", "h", "r", "d"], partition_id=pid)
        want = ref.kv_batch_get(ks, ["ids", "h", "r", "d"], partition_id=pid)
        for name in ("ids", "h", "r", "d"):
            assert_same_field(name, got[name], want[name])
    assert ray_store_client.kv_list(pid).tags == ref.kv_list(pid).tags


# A Ray of its own: an 80 MiB object store whose disk fallback is refused
# (local_fs_capacity_threshold 0 makes every disk count as full), so puts really fill it.
_FILL_STORE = r"""
import json, sys, time, ray, torch
from nemo_dataplane.adapters.ray_store.client import RayStoreClient
from nemo_dataplane.client import StoreFullError
from nemo_dataplane.config import RayStoreConfig

ray.init(num_cpus=1, object_store_memory=80 * 2**20, include_dashboard=False,
         _system_config={"local_fs_capacity_threshold": 0.0})
c = RayStoreClient(RayStoreConfig(op_timeout_s=30), bootstrap=True, actor_name="full", namespace="full")
row = 4 * 2**20  # bytes per key (float32)
stored, error = [], None
for i in range(40):
    try:
        c.kv_batch_put([f"k{i}a", f"k{i}b"], "p", {"x": torch.full((2, row // 4), float(i))})
        stored += [f"k{i}a", f"k{i}b"]
    except StoreFullError as e:
        error = str(e)
        break
c.flush()
listed = list(c.kv_list("p").keys)
first = c.kv_batch_get(stored[:1], ["x"], partition_id="p")["x"]
c.kv_clear(stored[: len(stored) // 2], "p")
t0 = time.monotonic()
c.kv_batch_put(["again"], "p", {"x": torch.full((1, row // 4), 7.0)})
again = c.kv_batch_get(["again"], ["x"], partition_id="p")["x"]
print(json.dumps({"stored": stored, "error": error, "listed": listed, "first_ok": bool((first == 0).all()),
                  "again_ok": bool((again == 7).all()), "again_s": time.monotonic() - t0}))
"""


def test_a_full_ray_object_store_refuses_the_put_whole_and_takes_writes_again_once_cleared() -> None:
    import json
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _FILL_STORE], capture_output=True, text=True, timeout=300, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["error"] is not None, f"80 MiB of Ray object store took {len(got['stored'])} x 4 MiB rows"
    n = len(got["stored"]) // 2
    assert 4 <= n < 20, got["stored"]  # the store filled near its 80 MiB, not at the first put
    assert f"'k{n}a'" in got["error"] and "object store is full" in got["error"]
    # Nothing of the refused put, every earlier row still there (concurrent puts may commit in any order).
    assert sorted(got["listed"]) == sorted(got["stored"])
    assert got["first_ok"]
    assert got["again_ok"] and got["again_s"] < 30  # clearing freed room, and no key stayed locked


# ------------------------------------------------------------------ claims
def test_claims_are_atomic_per_task_and_wait_bounded(ray_store_client: RayStoreClient, pid: str) -> None:
    c = ray_store_client
    c.kv_batch_put([f"k{i}" for i in range(6)], pid, {"x": torch.arange(6)}, tags=[{"i": i} for i in range(6)])
    c.kv_batch_put(["k0", "k1", "k2"], pid, {"y": torch.zeros(3)})
    first = c.kv_claim(pid, "train", ["x", "y"], batch_size=2, timeout_s=0)
    assert first.keys == ("k0", "k1") and first.tags == ({"i": 0}, {"i": 1}) and set(first.fields or ()) >= {"x", "y"}
    assert c.kv_claim(pid, "train", ["x", "y"], batch_size=5, timeout_s=0).keys == ("k2",)  # only produced rows
    assert c.kv_claim(pid, "other", ["x"], batch_size=2, timeout_s=0).keys == ("k0", "k1")  # tasks independent
    status = c.kv_claim_status(pid, "train", ["x", "y"])
    assert (status.rows, status.produced, status.claimed, status.claimable) == (6, 3, 3, 0)

    c.kv_mark_consumed(["k3", "ghost"], pid, "train")
    # a claim waits for rows produced later, and returns what there is at its deadline
    threading.Timer(0.5, lambda: c.kv_batch_put(["k4", "k5"], pid, {"y": torch.zeros(2)})).start()
    t0 = time.monotonic()
    late = c.kv_claim(pid, "train", ["x", "y"], batch_size=3, timeout_s=3)
    waited = time.monotonic() - t0
    assert late.keys == ("k4", "k5") and 2.5 < waited < 10
    # a key cleared and put again is a new row
    c.kv_clear(["k0"], pid)
    c.kv_batch_put(["k0"], pid, {"x": torch.zeros(1), "y": torch.zeros(1)})
    assert c.kv_claim(pid, "train", ["x", "y"], batch_size=4, timeout_s=0).keys == ("k0",)
    assert pid in c.kv_partitions()
    with pytest.raises(ValueError, match="batch_size"):
        c.kv_claim(pid, "train", ["x"], batch_size=0, timeout_s=0)


def test_concurrent_claimers_in_other_processes_never_share_a_row(ray_store_client: RayStoreClient, pid: str) -> None:
    import ray

    @ray.remote(num_cpus=0)
    def claimer(p: str) -> list[str]:
        client = build_data_plane_client({"backend": "ray"}, bootstrap=False)
        got: list[str] = []
        while True:
            meta = client.kv_claim(p, "t", ["x"], batch_size=3, timeout_s=0)
            if not meta.keys:
                client.close()
                return got
            got += list(meta.keys)

    keys = [f"k{i}" for i in range(90)]
    ray_store_client.kv_batch_put(keys, pid, {"x": torch.arange(90)})
    parts = ray.get([claimer.remote(pid) for _ in range(3)], timeout=120)
    claimed = [k for p in parts for k in p]
    assert sorted(claimed) == sorted(keys) and len(set(claimed)) == 90


# --------------------------------------------------------------- bootstrap
def test_bootstrap_modes_say_what_is_wrong(ray_store_client: RayStoreClient) -> None:
    with pytest.raises(
        DataPlaneError, match=r"no Ray store index named 'nope' in Ray namespace 'nd_tests'.*bootstrap=True"
    ):
        RayStoreClient(bootstrap=False, actor_name="nope", namespace="nd_tests")
    with pytest.raises(DataPlaneError, match="already exists"):
        RayStoreClient(bootstrap=True)  # the session's index has the default name
    with pytest.raises(ValueError, match=r"backend_kwargs \['port'\]"):
        build_data_plane_client({"backend": "ray", "backend_kwargs": {"port": 1}}, bootstrap=False)


def test_close_of_the_creator_ends_the_store(ray_session: Any) -> None:
    name = f"rs-close-{uuid.uuid4().hex[:6]}"
    store = _store(name)
    peer = RayStoreClient(bootstrap=False, actor_name=name, namespace="nd_tests")
    peer.kv_batch_put(["a"], "p", {"x": torch.arange(3).view(1, 3)})
    peer.close()  # a peer's close keeps the store
    assert store.kv_list("p").keys == ("a",)
    store.close()
    store.close()  # idempotent
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:  # ray.kill is asynchronous
        try:
            RayStoreClient({"bootstrap_timeout_s": 5}, bootstrap=False, actor_name=name, namespace="nd_tests").close()
        except DataPlaneError as e:
            assert "no Ray store index" in str(e) or "died" in str(e)
            break
        time.sleep(0.2)
    else:
        pytest.fail("the index outlived the close() of the client that created it")
