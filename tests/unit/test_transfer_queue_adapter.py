"""TransferQueue adapter specifics: the quirks it absorbs, interop with TransferQueue's own
clients, claims. Bootstrap and lifecycle: test_transfer_queue_bootstrap.py; the contract itself:
test_conformance.py."""

from __future__ import annotations

import ast
import asyncio
import dataclasses
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import ray
import torch

from nemo_dataplane.adapters.transfer_queue import compat as tq_compat
from nemo_dataplane.adapters.transfer_queue.client import LAYOUT_TAG, TransferQueueClient
from nemo_dataplane.client import ClaimsNotSupported, ClaimStatus
from nemo_dataplane.config import TransferQueueConfig
from nemo_dataplane.testing.fields import assert_same_field, jagged

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def pid(tq_client: TransferQueueClient) -> Iterator[str]:
    p = f"tqa-{uuid.uuid4().hex[:8]}"
    yield p
    tq_client.kv_clear(None, p)


# ------------------------------------------------------------------ quirks
def test_caller_thread_settings_are_left_alone(tq_client: TransferQueueClient, pid: str) -> None:
    original = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            meta = tq_client.kv_batch_put(["a", "b"], pid, {"ids": jagged([2, 3]), "x": torch.ones(2, 3)})
            tq_client.kv_batch_get(meta, ["ids", "x"])
            assert torch.get_num_threads() == n

            async def ops() -> None:
                await tq_client.async_kv_batch_put(["c"], pid, {"x": torch.ones(1, 3)})
                await tq_client.async_kv_batch_get(["c"], ["x"], partition_id=pid)
                await tq_client.async_kv_list(pid)

            asyncio.run(ops())
            assert torch.get_num_threads() == n
    finally:
        torch.set_num_threads(original)


def test_logs_are_quiet_by_default(tq_client: TransferQueueClient, pid: str, capfd: pytest.CaptureFixture[str]) -> None:
    import logging

    tq_client.kv_batch_put(["a"], pid, {"ids": jagged([4]), "x": torch.ones(1)})
    tq_client.kv_batch_get(["a"], ["ids", "x"], partition_id=pid)
    with pytest.raises(KeyError):
        tq_client.kv_batch_get(["a", "zz"], ["x"], partition_id=pid)
    tq_client.kv_clear(["a"], pid)
    out, err = capfd.readouterr()
    assert "transfer_queue" not in out + err and "target_num_threads" not in out + err
    tq_loggers = [n for n in logging.Logger.manager.loggerDict if n.startswith("transfer_queue")]
    assert tq_loggers and all(logging.getLogger(n).getEffectiveLevel() >= logging.ERROR for n in tq_loggers)


def test_our_tests_never_resolve_to_transfer_queues_tests_package(request: pytest.FixtureRequest) -> None:
    """TransferQueue's wheel installs a top-level ``tests`` package; nothing of ours may be
    imported through that name, and no test file may import from it."""
    import importlib.util

    spec = importlib.util.find_spec("tests")
    if spec is not None and spec.origin:
        assert REPO not in Path(spec.origin).resolve().parents  # `tests` is theirs, not ours
    # importlib mode may *name* our modules tests.*, but each must be loaded from our files.
    ours = {n: m for n, m in sys.modules.items() if n == "tests" or n.startswith("tests.")}
    for name, mod in ours.items():
        origin = getattr(mod, "__file__", None)
        if origin and name.count(".") >= 1 and "site-packages" in origin:
            assert not (REPO / "tests" / Path(*name.split(".")[1:])).with_suffix(".py").exists(), (
                f"{name} resolved to {origin}, shadowing our {name}"
            )
    assert Path(sys.modules[__name__].__file__).resolve() == Path(__file__).resolve()
    conftests = [
        m
        for m in sys.modules.values()
        if getattr(m, "__file__", None) and Path(m.__file__).resolve() == REPO / "tests" / "conftest.py"
    ]
    assert conftests, "tests/conftest.py was not loaded from the repository"
    for path in (REPO / "tests").rglob("*.py"):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                assert node.module.split(".")[0] != "tests", f"{path} imports from `tests`"
            if isinstance(node, ast.Import):
                assert all(a.name.split(".")[0] != "tests" for a in node.names), f"{path} imports `tests`"
    assert request.getfixturevalue("memory_client") is not None  # conftest fixtures do load


@pytest.mark.parametrize("rows", [4, 64])  # 4: inside the request; 64 (>100 KiB): through the object store
def test_with_the_unit_in_the_controller_put_get_and_clear_send_no_zmq_request(
    tq_client: TransferQueueClient, pid: str, monkeypatch: pytest.MonkeyPatch, rows: int
) -> None:
    """Quirk 14: the store's one unit lives in the controller, so each op is one Ray call to
    it, served under the lock its ZMQ thread holds; the controller sees no ZMQ request."""
    sent: list[Any] = []
    real = tq_client._tq._request_controller

    async def spy(*args: Any, **kwargs: Any) -> Any:
        sent.append(kwargs.get("request_type"))
        return await real(*args, **kwargs)

    monkeypatch.setattr(tq_client._tq, "_request_controller", spy)
    ids = jagged([300 + i for i in range(rows)])
    x = torch.randn(rows, 64)
    keys = [f"k{i}" for i in range(rows)]
    meta = tq_client.kv_batch_put(keys, pid, {"ids": ids, "x": x}, tags=[{"i": i} for i in range(rows)])
    meta = tq_client.kv_batch_put(keys[:2], pid, None, tags=[{"i": -1}, {"i": -2}])  # tags only
    got = tq_client.kv_batch_get(keys[::-1], ["x", "ids"], partition_id=pid)
    assert torch.equal(got["x"], x.flip(0))
    assert_same_field("ids", got["ids"], _pick(ids, list(range(rows))[::-1]))
    assert meta.fields == ("ids", "x") and meta.tags == ({"i": -1}, {"i": -2})
    tq_client.kv_clear(keys[:2], pid)
    assert sent == []
    assert tq_client.kv_list(pid).keys == tuple(keys[2:])  # TransferQueue's own two requests
    tq_client.kv_clear(None, pid)
    with pytest.raises(KeyError, match=r"3 key\(s\) not in partition"):
        tq_client.kv_batch_get(keys[:3], ["x"], partition_id=pid)
    assert len(sent) == 2


def test_partial_selection_fetches_only_the_selected_fields(
    tq_client: TransferQueueClient, pid: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    asked: list[tuple[str, list[str]]] = []
    fetched: list[set[str]] = []
    bulk, per_row = tq_compat.read_columns, tq_compat.get_rows

    def spy_bulk(client: Any, units: Any, meta: Any, fields: Any, first: Any = None) -> Any:
        asked.append(("bulk", list(fields)))
        if first is not None:  # the controller's one-request answer (quirk 14) has only those too
            fetched.append(set(first[0]))
        out = yield from bulk(client, units, meta, fields, first)
        fetched.append(set(out))
        return out

    async def spy_rows(client: Any, meta: Any, fields: Any) -> Any:
        asked.append(("rows", list(fields)))
        out = await per_row(client, meta, fields)
        fetched.append(set(out))
        return out

    monkeypatch.setattr(tq_compat, "read_columns", spy_bulk)
    monkeypatch.setattr(tq_compat, "get_rows", spy_rows)
    meta = tq_client.kv_batch_put(["a", "b"], pid, {"big": torch.zeros(2, 4096), "small": torch.ones(2)})
    out = tq_client.kv_batch_get(meta, ["small"])
    assert tq_client._hosted is not None  # the session store: its one unit in the controller
    monkeypatch.setattr(tq_client, "_units", {})
    monkeypatch.setattr(tq_client, "_hosted", None)
    tq_client.kv_batch_get(meta, ["small"])
    assert asked == [("bulk", ["small"]), ("rows", ["small"])] and list(out.keys()) == ["small"]
    assert fetched == [{"small"}, {"small"}, {"small"}]


@pytest.mark.parametrize("path", ["one_request", "requests"])
def test_failed_write_leaves_no_new_keys_and_keeps_old_ones(
    tq_client: TransferQueueClient, pid: str, monkeypatch: pytest.MonkeyPatch, path: str
) -> None:
    """Both write paths: one request to the controller holding the unit (quirk 14), whose rows
    here arrive corrupt (4 bytes for 3 floats) and fail inside the unit after the keys were
    made; and the request-per-step path, whose unit write fails."""
    tq_client.kv_batch_put(["old"], pid, {"x": torch.tensor([1.0])}, tags=[{"v": 1}])
    if path == "one_request":
        assert tq_client._hosted is not None
        real_chunk_of = tq_compat.chunk_of

        def corrupt(columns: Any) -> Any:
            return {k: (*enc[:2], enc[2][:4], enc[3]) for k, enc in real_chunk_of(columns).items()}

        monkeypatch.setattr(tq_compat, "chunk_of", corrupt)
        expect = "needs 12 bytes"
    else:

        async def boom(*args: Any, **kwargs: Any) -> None:
            raise RuntimeError("storage unit went away")

        monkeypatch.setattr(tq_client, "_hosted", None)
        monkeypatch.setattr(tq_compat, "put_rows", boom)
        expect = "went away"
    with pytest.raises(Exception, match=expect):
        tq_client.kv_batch_put(["old", "new1", "new2"], pid, {"x": torch.zeros(3)})
    listed = tq_client.kv_list(pid)
    assert listed.keys == ("old",) and listed.tags == ({"v": 1},)
    monkeypatch.undo()
    assert tq_client.kv_batch_get(["old"], ["x"], partition_id=pid)["x"].tolist() == [1.0]


def test_failed_clean_up_of_a_failed_write_is_noted_on_the_write_error(
    tq_client: TransferQueueClient, pid: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def boom(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("storage unit went away")

    async def clear_fails(*args: Any, **kwargs: Any) -> None:
        raise ConnectionError("controller unreachable")

    monkeypatch.setattr(tq_client, "_hosted", None)  # the one-request put cleans up inside its request
    monkeypatch.setattr(tq_compat, "put_rows", boom)
    monkeypatch.setattr(tq_client._tq, "async_clear_samples", clear_fails)
    with pytest.raises(RuntimeError, match="went away") as info:
        tq_client.kv_batch_put(["n1", "n2"], pid, {"x": torch.zeros(2)})
    if sys.version_info >= (3, 11):
        notes = " ".join(info.value.__notes__)
        assert f"2 key(s) this failed put created in partition {pid!r}" in notes
        assert "ConnectionError: controller unreachable" in notes
    monkeypatch.undo()
    tq_client.kv_clear(None, pid)


def test_op_timeout_names_op_partition_and_key_count(tq_client: TransferQueueClient, pid: str) -> None:
    tq_client.kv_batch_put(["a", "b", "c"], pid, {"x": torch.zeros(3, 256)})
    impatient = TransferQueueClient(TransferQueueConfig(op_timeout_s=1e-4), bootstrap=False)
    try:
        with pytest.raises(TimeoutError, match=rf"kv_batch_get on partition '{pid}' \(3 keys\).*op_timeout_s=0\.0001"):
            impatient.kv_batch_get(["a", "b", "c"], ["x"], partition_id=pid)

        async def one() -> None:
            await impatient.async_kv_list(pid)

        with pytest.raises(TimeoutError, match="kv_list"):
            asyncio.run(one())
    finally:
        impatient.close()
    assert tq_client.kv_list(pid).keys == ("a", "b", "c")  # store untouched, owner unaffected


def test_reserved_layout_tag_is_hidden_and_protected(tq_client: TransferQueueClient, pid: str) -> None:
    meta = tq_client.kv_batch_put(["a"], pid, {"x": torch.ones(1, 2)}, tags=[{"t": 1}])
    assert meta.tags == ({"t": 1},) and tq_client.kv_list(pid).tags == ({"t": 1},)
    with pytest.raises(ValueError, match=LAYOUT_TAG):
        tq_client.kv_batch_put(["a"], pid, None, tags=[{LAYOUT_TAG: {}}])


# ------------------------------------------------------------------ interop
def test_transfer_queues_own_clients_read_and_write_the_same_store(tq_client: TransferQueueClient, pid: str) -> None:
    """A Ray actor using plain ``transfer_queue`` (tq.init() attaches to the store by name, its
    sockets carrying the store's wire keys) reads what the adapter wrote, and the adapter reads
    what it wrote."""
    import ray

    @ray.remote(num_cpus=0)
    class RawTQ:
        def __init__(self) -> None:
            import transfer_queue as tq

            from nemo_dataplane.adapters.transfer_queue.client import admit_transfer_queue_clients

            admit_transfer_queue_clients()  # the store's wire keys on TransferQueue's sockets here
            tq.init()  # attaches: the controller exists; never tq.close() here (it kills it)
            self.tq = tq

        def get(self, keys: list[str], pid: str, fields: list[str]) -> dict[str, Any]:
            td = self.tq.kv_batch_get(keys=keys, partition_id=pid, select_fields=fields)
            return {k: ([r.clone() for r in v.unbind()] if v.is_nested else v.clone()) for k, v in td.items()}

        def put(self, keys: list[str], pid: str) -> None:
            from tensordict import TensorDict

            td = TensorDict({"score": torch.tensor([0.5, 1.5]), "tok": torch.arange(6).view(2, 3)}, batch_size=[2])
            self.tq.kv_batch_put(keys=keys, partition_id=pid, fields=td, tags=[{"src": "raw"}] * 2)

        def tags(self, pid: str) -> dict[str, Any]:
            return self.tq.kv_list(partition_id=pid)[pid]

    ids = jagged([2, 5, 1])
    dense = torch.arange(12, dtype=torch.float32).view(3, 4)
    tq_client.kv_batch_put(
        ["a", "b", "c"], pid, {"ids": ids, "logp": dense, "r": torch.tensor([1, 2, 3])}, tags=[{"n": 1}] * 3
    )
    raw = RawTQ.remote()
    try:
        got = ray.get(raw.get.remote(["c", "a"], pid, ["ids", "logp", "r"]), timeout=120)
        assert [t.tolist() for t in got["ids"]] == [ids.unbind()[2].tolist(), ids.unbind()[0].tolist()]
        assert [t.tolist() for t in got["logp"]] == [dense[2].tolist(), dense[0].tolist()]  # TQ's own: nested
        assert got["r"].tolist() == [3, 1]
        raw_tags = ray.get(raw.tags.remote(pid), timeout=60)
        assert raw_tags["a"]["n"] == 1 and raw_tags["a"][LAYOUT_TAG] == {"ids": "jagged", "logp": "dense", "r": "dense"}

        ray.get(raw.put.remote(["x", "y"], pid), timeout=120)
        out = tq_client.kv_batch_get(["y", "x"], ["score", "tok"], partition_id=pid)
        assert out["score"].tolist() == [1.5, 0.5]  # scalar rows: dense
        assert out["tok"].is_nested and [r.tolist() for r in out["tok"].unbind()] == [[3, 4, 5], [0, 1, 2]]
        assert tq_client.kv_list(pid).tags[-1] == {"src": "raw"}
        # TransferQueue's own puts count as produced for claims, ours too.
        claimed = tq_client.kv_claim(pid, "t", ["score"], 2, 5)
        assert claimed.keys == ("x", "y") and claimed.tags == ({"src": "raw"}, {"src": "raw"})
        assert tq_client.kv_claim(pid, "t", ["ids", "r"], 5, 0).keys == ("a", "b", "c")
    finally:
        ray.kill(raw)


def test_per_row_fallback_reads_the_same_as_bulk_reads(
    tq_client: TransferQueueClient, pid: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Stores whose storage units are not named actors (made by tq.init()) are read through
    TransferQueue's per-row protocol; both paths must agree bit for bit."""
    fields = {
        "ids": jagged([3, 0, 2, 5]),
        "h": jagged([1, 2, 1, 1], 3, dtype=torch.bfloat16),
        "x": torch.randn(4, 2),
        "r": torch.arange(4),
    }
    meta = tq_client.kv_batch_put(["a", "b", "c", "d"], pid, fields)
    bulk = tq_client.kv_batch_get(meta.reorder([2, 0, 3, 1]), list(fields))
    assert tq_client._units  # the session store is read in bulk
    monkeypatch.setattr(tq_client, "_units", {})
    rows = tq_client.kv_batch_get(meta.reorder([2, 0, 3, 1]), list(fields))
    for name in fields:
        assert_same_field(name, rows[name], bulk[name])


def test_rows_travel_as_one_object_the_units_map_and_outlive_their_writer(
    tq_client: TransferQueueClient, pid: str, plasma_mib: Any, wait_actor_dead: Any
) -> None:
    """The writer's one copy into shared memory is the only one: storage units hold views of it
    and reads map it (quirk 11). When the writer dies the units still hold the rows, and reads
    (ours and TransferQueue's own) fall back to the units' stacked copies."""
    import ray

    @ray.remote(num_cpus=0)
    class Writer:
        def __init__(self) -> None:
            self.client = TransferQueueClient(TransferQueueConfig(op_timeout_s=60), bootstrap=False)

        def put(self, pid: str) -> Any:
            return self.client.kv_batch_put([f"k{i}" for i in range(64)], pid, _big())

    before = plasma_mib()
    writer = Writer.remote()
    try:
        meta = ray.get(writer.put.remote(pid), timeout=120)
        held = plasma_mib()
        assert before + 30 <= held <= before + 40, (before, held)  # 32 MiB, once
        order = list(range(63, -1, -2)) + list(range(0, 64, 2))  # odd rows descending, then even
        want = {n: _pick(t, order) for n, t in _big().items()}
        for name, t in tq_client.kv_batch_get(meta.reorder(order), ["x", "ids"]).items():
            assert_same_field(name, t, want[name])
        ray.kill(writer)
        wait_actor_dead(writer)
        for name, t in tq_client.kv_batch_get(meta.reorder(order), ["x", "ids"]).items():
            assert_same_field(name, t, want[name])
    finally:
        ray.kill(writer)
    tq_client.kv_clear(None, pid)
    deadline = time.monotonic() + 15
    while plasma_mib() > before + 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert plasma_mib() <= before + 2  # the units dropped their views: the object is gone


def _big() -> dict[str, torch.Tensor]:
    return {
        "x": torch.arange(4 * 1024 * 1024, dtype=torch.int64).view(64, -1),
        "ids": jagged([i % 7 for i in range(64)], seed=5),
    }


def _pick(t: torch.Tensor, order: list[int]) -> torch.Tensor:
    if t.is_nested:
        rows = t.unbind()
        return torch.nested.as_nested_tensor([rows[i] for i in order], layout=torch.jagged)
    return t[order]


# ------------------------------------------------------------------ claims
def test_claimed_rows_carry_the_tags_of_the_put_that_produced_them(
    tq_client: TransferQueueClient, pid: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Quirk 10: rows become produced only once their tags are stored, so a claimer waiting on
    them never gets a row without the tags it was put with, however slow the row write is."""
    real_put_rows = tq_compat.put_rows

    async def slow_put_rows(*args: Any, **kwargs: Any) -> Any:
        await asyncio.sleep(0.5)
        return await real_put_rows(*args, **kwargs)

    monkeypatch.setattr(tq_compat, "put_rows", slow_put_rows)
    monkeypatch.setattr(tq_client, "_hosted", None)  # a one-request put is atomic (quirk 14)
    put = threading.Thread(
        target=tq_client.kv_batch_put, args=(["a", "b"], pid, {"x": torch.zeros(2)}, [{"g": 0}, {"g": 1}])
    )
    put.start()
    meta = tq_client.kv_claim(pid, "t", ["x"], 2, 10)
    put.join(30)
    assert meta.keys == ("a", "b") and meta.tags == ({"g": 0}, {"g": 1})


def test_a_put_across_actors_sends_tags_and_production_in_one_request_after_the_rows(
    tq_client: TransferQueueClient, pid: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the unit apart from the controller, a put is the key lookup, the rows (the unit)
    and one request that stores the tags and then marks the rows produced (quirk 10); a
    tags-only put's second request stores its tags alone."""
    monkeypatch.setattr(tq_client, "_hosted", None)
    sent: list[tuple[Any, bool]] = []
    real_request = tq_client._tq._request_controller

    async def spy(*args: Any, **kwargs: Any) -> Any:
        sent.append((kwargs["request_type"].name, tq_compat.PRODUCED in kwargs["body"]))
        return await real_request(*args, **kwargs)

    def never(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a production notice of its own")

    monkeypatch.setattr(tq_client._tq, "_request_controller", spy)
    monkeypatch.setattr(tq_compat, "mark_produced", never)
    x = torch.randn(3, 5)
    tq_client.kv_batch_put(["a", "b", "c"], pid, {"x": x}, tags=[{"i": 0}, {"i": 1}, {"i": 2}])
    assert sent == [("KV_RETRIEVE_META", False), ("SET_CUSTOM_META", True)]
    tq_client.kv_batch_put(["b"], pid, None, tags=[{"i": -1}])
    assert sent[2:] == [("KV_RETRIEVE_META", False), ("SET_CUSTOM_META", False)]
    monkeypatch.setattr(tq_client._tq, "_request_controller", real_request)
    assert torch.equal(tq_client.kv_batch_get(["c", "b"], ["x"], partition_id=pid)["x"], x[[2, 1]])
    assert tq_client.kv_claim(pid, "t", ["x"], 3, 0).tags == ({"i": 0}, {"i": -1}, {"i": 2})


def test_claims_need_a_store_started_by_this_adapter(
    tq_client: TransferQueueClient, pid: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A store made by tq.init() runs SequentialSampler without polling (quirk 8): a claim there
    could stall the controller, so claims refuse, naming why; status and listing still work."""
    assert tq_compat.claims_unsupported(tq_compat.base_config(1)) is None
    foreign = tq_compat.base_config(1)
    foreign.controller.sampler, foreign.controller.polling_mode = "SequentialSampler", False
    reason = tq_compat.claims_unsupported(foreign)
    assert reason is not None and "polling_mode=False" in reason and "SequentialSampler" in reason
    tq_client.kv_batch_put(["a"], pid, {"x": torch.zeros(1)})
    monkeypatch.setattr(tq_client, "_claims_unsupported", reason)
    with pytest.raises(ClaimsNotSupported, match="polling_mode=False"):
        tq_client.kv_claim(pid, "t", ["x"], 1, 0)
    with pytest.raises(ClaimsNotSupported):
        tq_client.kv_mark_consumed(["a"], pid, "t")
    assert tq_client.kv_claim_status(pid, "t", ["x"]) == ClaimStatus(pid, "t", 1, 1, 0, 1)
    assert pid in tq_client.kv_partitions()


def test_a_claim_is_bounded_by_its_timeout_plus_op_timeout(pid: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A claim request the controller never answers ends as a TimeoutError naming the limit."""
    impatient = TransferQueueClient(TransferQueueConfig(op_timeout_s=0.2), bootstrap=False)

    async def stalled(*args: Any, **kwargs: Any) -> Any:
        await asyncio.sleep(60)

    monkeypatch.setattr(tq_compat, "ask_claim", stalled)
    try:
        t0 = time.monotonic()
        with pytest.raises(TimeoutError, match=rf"kv_claim on partition '{pid}' \(4 keys\).*within 0\.5s"):
            impatient.kv_claim(pid, "t", ["x"], 4, 0.3)
        assert time.monotonic() - t0 < 5.5
    finally:
        impatient.close()


def _claim_stats(client: TransferQueueClient) -> dict[str, int]:
    stats: dict[str, int] = ray.get(tq_compat.ask_claim_stats(client._control), timeout=30)
    return stats


@pytest.mark.parametrize("hosted", [True, False], ids=["one_request_put", "zmq_put"])
def test_a_waiting_claim_is_woken_by_the_put_that_produces_its_row(
    tq_client: TransferQueueClient, pid: str, monkeypatch: pytest.MonkeyPatch, hosted: bool
) -> None:
    """A claim waits inside the controller without polling: it scans once when it starts and
    once more when a put produces rows (through the one-request put, or TransferQueue's ZMQ
    notice), then returns the row, long before its timeout; the ops it waits for run meanwhile."""
    if not hosted:
        monkeypatch.setattr(tq_client, "_hosted", None)
    got: list[Any] = []
    claim = threading.Thread(target=lambda: got.append(tq_client.kv_claim(pid, "t", ["x"], 1, 60)))
    t0 = time.monotonic()
    claim.start()
    while _claim_stats(tq_client)["waiting"] == 0:  # the claim is waiting in the controller
        assert time.monotonic() - t0 < 30 and claim.is_alive()
        time.sleep(0.01)
    scans = _claim_stats(tq_client)["scans"]
    tq_client.kv_batch_put(["a"], pid, {"x": torch.ones(1)}, tags=[{"g": 7}])
    claim.join(30)
    assert not claim.is_alive() and time.monotonic() - t0 < 30  # not its 60 s timeout
    assert got[0].keys == ("a",) and got[0].tags == ({"g": 7},)
    stats = _claim_stats(tq_client)
    assert stats == {"waiting": 0, "scans": scans + 1}


def test_a_waiting_claim_takes_what_is_there_at_its_deadline_after_two_scans(
    tq_client: TransferQueueClient, pid: str
) -> None:
    """Nothing produced while it waits: the claim scans when it starts and at its deadline (no
    poll in between), then takes the one row there of the three it asked for; with none, none."""
    tq_client.kv_batch_put(["a"], pid, {"x": torch.ones(1)})
    scans = _claim_stats(tq_client)["scans"]
    t0 = time.monotonic()
    meta = tq_client.kv_claim(pid, "t", ["x"], 3, 0.5)
    assert time.monotonic() - t0 >= 0.5 and meta.keys == ("a",)
    assert _claim_stats(tq_client)["scans"] == scans + 2
    t0 = time.monotonic()
    assert tq_client.kv_claim(pid, "t", ["x"], 1, 0.3).keys == ()
    assert time.monotonic() - t0 >= 0.3


# ------------------------------------------------------------------ gets racing clears
@pytest.mark.parametrize("hosted", [True, False], ids=["one_request_ops", "zmq_ops"])
def test_a_get_racing_a_clear_of_its_keys_returns_every_row_or_names_the_cleared_keys(
    tq_client: TransferQueueClient, pid: str, monkeypatch: pytest.MonkeyPatch, hosted: bool
) -> None:
    """TransferQueue has no lease on a read: a clear of the same keys may land before, during or
    after a get. Whatever the interleaving (either op starts 0-5 ms after the other; rows
    inline and through the object store), the get returns every row as put or raises a
    ``KeyError`` naming keys it asked for; never a short or mixed batch."""
    if not hosted:
        monkeypatch.setattr(tq_client, "_hosted", None)
    n = 16
    keys = [f"r{i}" for i in range(n)]
    seen: dict[str, int] = {"rows": 0, "error": 0}

    async def after(delay_s: float, op: Any) -> Any:
        await asyncio.sleep(delay_s)  # a jitter between the two ops, not a wait for anything
        return await op

    async def races() -> None:
        for i in range(48):
            width = 4 if i % 2 else 2048  # 256 B or 8 KiB a row: inside the request, or an object
            x = torch.arange(n * width, dtype=torch.float32).view(n, width) + 1e6 * i
            ids = jagged([1 + (i + r) % 7 for r in range(n)], seed=i)
            await tq_client.async_kv_batch_put(keys, pid, {"x": x, "ids": ids})
            # The clear 0-5 ms after the get starts, or the get up to 5 ms after the clear.
            lag = (i // 2 % 6) * 1e-3
            get = tq_client.async_kv_batch_get(keys, ["x", "ids"], partition_id=pid)
            clear = tq_client.async_kv_clear(keys, pid)
            got, _ = await asyncio.gather(
                *((get, after(lag, clear)) if i % 4 < 2 else (after(lag, get), clear)), return_exceptions=True
            )
            if isinstance(got, BaseException) and not isinstance(got, KeyError):
                raise got
            if isinstance(got, KeyError):
                assert any(repr(k) in str(got) for k in keys), got
                seen["error"] += 1
            else:
                assert not isinstance(got, BaseException), got
                assert torch.equal(got["x"], x)
                assert_same_field("ids", got["ids"], ids)
                seen["rows"] += 1
            assert (await tq_client.async_kv_list(pid)).keys == ()  # the clear finished

    asyncio.run(races())
    # Both orders happened (half the rounds start the clear first), so the race was run.
    assert seen["rows"] > 0 and seen["error"] > 0 and seen["rows"] + seen["error"] == 48


def test_a_cancelled_claim_stops_waiting_and_takes_no_row(tq_client: TransferQueueClient, pid: str) -> None:
    """An ``async_kv_claim`` cancelled while it waits (here by ``asyncio.wait_for``) tells the
    controller, which ends that wait at once without taking rows: a row put afterwards goes to
    the next claim, not to the caller that is gone."""

    async def impatient() -> None:
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(tq_client.async_kv_claim(pid, "t", ["x"], 1, 60), 0.3)

    asyncio.run(impatient())
    t0 = time.monotonic()
    while _claim_stats(tq_client)["waiting"]:  # the cancelled claim leaves the controller
        assert time.monotonic() - t0 < 30, "the cancelled claim is still waiting (its timeout is 60 s)"
        time.sleep(0.01)
    tq_client.kv_batch_put(["a"], pid, {"x": torch.ones(1)})
    assert tq_client.kv_claim(pid, "t", ["x"], 1, 0).keys == ("a",)


def test_a_small_put_across_actors_rides_inside_the_units_calls(
    tq_client: TransferQueueClient, pid: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Up to ``INLINE_MAX_BYTES`` a put's rows travel inside the units' calls, with no
    ``ray.put``; a larger put is put once into the object store. Both read back bit-exact."""
    monkeypatch.setattr(tq_client, "_hosted", None)
    objects: list[int] = []
    real_put_chunk = tq_compat.put_chunk

    def spy(columns: Any) -> Any:
        objects.append(sum(t.numel() * t.element_size() for t in columns.values()))
        return real_put_chunk(columns)

    monkeypatch.setattr(tq_compat, "put_chunk", spy)
    small, big = torch.randn(4, 16), torch.randn(64, 1024)  # 256 B and 256 KiB
    assert small.numel() * 4 <= tq_compat.INLINE_MAX_BYTES < big.numel() * 4
    tq_client.kv_batch_put([f"s{i}" for i in range(4)], pid, {"x": small})
    assert objects == []
    tq_client.kv_batch_put([f"b{i}" for i in range(64)], pid, {"x": big})
    assert objects == [big.numel() * 4]
    assert torch.equal(tq_client.kv_batch_get(["s3", "s0"], ["x"], partition_id=pid)["x"], small[[3, 0]])
    assert torch.equal(tq_client.kv_batch_get(["b9", "b63"], ["x"], partition_id=pid)["x"], big[[9, 63]])


def test_a_sync_op_of_a_store_with_its_unit_in_the_controller_never_waits_on_the_clients_loop(
    tq_client: TransferQueueClient, pid: str
) -> None:
    # The op body runs in the caller's thread (ray.get there), so a put (inline and through the
    # object store), a get and a clear all finish while the client's event loop is held busy.
    assert tq_client._hosted is not None and tq_client._loop is not None
    held, release = threading.Event(), threading.Event()

    def hold() -> None:
        held.set()
        release.wait(120)

    tq_client._loop.call_soon_threadsafe(hold)
    done: dict[str, Any] = {}

    def ops() -> None:
        small = tq_client.kv_batch_put(["a", "b"], pid, {"x": torch.arange(2)}, tags=[{"t": 1}, {"t": 2}])
        big = tq_client.kv_batch_put(["c"], pid, {"x": torch.arange(1), "y": torch.ones(1, 64 * 1024)})
        done["x"] = tq_client.kv_batch_get(small, ["x"])["x"].tolist()
        done["y"] = float(tq_client.kv_batch_get(big, ["y"])["y"].sum())
        tq_client.kv_clear(["a", "b", "c"], pid)
        done["ok"] = True

    try:
        assert held.wait(30)
        worker = threading.Thread(target=ops, daemon=True)
        worker.start()
        worker.join(60)
        assert done.get("ok"), f"sync ops did not finish while the loop was held: {done}"
        assert done["x"] == [0, 1] and done["y"] == 64 * 1024
    finally:
        release.set()
    assert tq_client.kv_list(pid).keys == ()


@ray.remote(num_cpus=0)
class _Busy:
    def hold(self, seconds: float) -> None:
        time.sleep(seconds)

    def nd_locate(self, *args: Any) -> None:  # what a get asks the controller; queued behind hold
        return None


def test_a_sync_op_that_cannot_finish_raises_at_its_op_timeout_naming_op_partition_and_keys(
    tq_client: TransferQueueClient, pid: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The store's answer never comes in time (its one-request handle is an actor busy for 60 s):
    # the caller's ray.get is bounded by op_timeout_s; the store itself stays alive and usable.
    busy = _Busy.remote()
    try:
        blocker = busy.hold.remote(60)
        monkeypatch.setattr(tq_client, "_hosted", busy)
        monkeypatch.setattr(tq_client, "cfg", dataclasses.replace(tq_client.cfg, op_timeout_s=1.5))
        started = time.monotonic()
        with pytest.raises(TimeoutError, match=rf"kv_batch_get on partition '{pid}' \(2 keys\).*op_timeout_s=1.5s"):
            tq_client.kv_batch_get(["a", "b"], ["x"], pid)
        assert time.monotonic() - started < 10
        monkeypatch.undo()
        tq_client.kv_batch_put(["a"], pid, {"x": torch.ones(1)})
        assert tq_client.kv_batch_get(["a"], ["x"], pid)["x"].tolist() == [1.0]
        del blocker
    finally:
        ray.kill(busy)
