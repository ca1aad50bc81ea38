"""Conformance tests for task-mediated claims (``kv_claim`` and friends).

:class:`ClaimConformance` is a base of :class:`~nemo_dataplane.testing.conformance.DataPlaneConformance`,
so every backend that runs the suite runs these too, against the same ``client`` and ``pid``
fixtures. A backend without claims sets ``supports_claims = False`` on its test class: the claim
tests are then skipped, and one test checks that ``kv_claim``, ``kv_mark_consumed`` and
``kv_claim_status`` raise :class:`~nemo_dataplane.client.ClaimsNotSupported` (the ABC's defaults)
instead of half-working. ``kv_partitions`` is part of the by-key contract, tested for every
backend in ``conformance.py``. The cross-process claim test lives with the other
cross-process test in ``lifecycle_conformance.py``; a 1,000-row claim in ``scale_conformance.py``.

Waits are short (at most about a second each) and asserted loosely: a claim that times out
returns after at least 80% of ``timeout_s`` and less than ``timeout_s + 5`` seconds.
"""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import pytest
import torch

from nemo_dataplane.client import ClaimsNotSupported, ClaimStatus, DataPlaneClient

__all__ = ["ClaimConformance"]


def _keys(n: int, prefix: str = "k") -> list[str]:
    return [f"{prefix}{i}" for i in range(n)]


def _timed(fn: Any, *args: Any) -> tuple[Any, float]:
    t0 = time.monotonic()
    out = fn(*args)
    return out, time.monotonic() - t0


class ClaimConformance:
    """Claim contract tests; see the module docstring. Needs ``client`` and ``pid`` fixtures."""

    supports_claims: bool = True

    @pytest.fixture
    def claims(self, client: DataPlaneClient, pid: str) -> tuple[DataPlaneClient, str]:
        if not self.supports_claims:
            pytest.skip("backend opts out of claims (supports_claims = False)")
        return client, pid

    def test_opting_out_of_claims_raises_claims_not_supported(self, client: DataPlaneClient, pid: str) -> None:
        if self.supports_claims:
            pytest.skip("backend implements claims")
        with pytest.raises(ClaimsNotSupported):
            client.kv_claim(pid, "t", ["x"], 1, 0)
        with pytest.raises(ClaimsNotSupported):
            client.kv_mark_consumed(["k"], pid, "t")
        with pytest.raises(ClaimsNotSupported):
            client.kv_claim_status(pid, "t", ["x"])

    # ------------------------------------------------------------- what is claimed
    def test_claim_returns_only_rows_whose_named_fields_are_stored(self, claims: tuple[DataPlaneClient, str]) -> None:
        client, pid = claims
        client.kv_batch_put(_keys(4), pid, {"a": torch.arange(4)}, tags=[{"i": i} for i in range(4)])
        client.kv_batch_put(["k1", "k3"], pid, {"b": torch.ones(2, 2)})
        client.kv_batch_put(["tags_only"], pid, None, tags=[{"i": 9}])
        meta = client.kv_claim(pid, "t", ["a", "b"], 10, 0)
        assert meta.keys == ("k1", "k3") and meta.partition_id == pid
        assert list(meta.tags) == [{"i": 1}, {"i": 3}]  # public tags only
        assert {"a", "b"} <= set(meta.fields or ())
        assert client.kv_batch_get(meta, ["a", "b"])["a"].tolist() == [1, 3]
        # A tags-only upsert stores no field; tags are not fields.
        client.kv_batch_put(["k0"], pid, None, tags=[{"late": True}])
        assert client.kv_claim(pid, "t", ["a", "b"], 10, 0).keys == ()
        assert client.kv_claim(pid, "t", ["i"], 1, 0).keys == ()
        # A claim is per (task, key), whatever fields it named: k1, k3 are taken for "t".
        later = client.kv_claim(pid, "t", ["a"], 10, 0)
        assert later.keys == ("k0", "k2") and later.tags[0] == {"i": 0, "late": True}
        client.kv_batch_put(["k0"], pid, {"b": torch.ones(1, 2)})
        assert client.kv_claim(pid, "u", ["a", "b"], 10, 0).keys == ("k0", "k1", "k3")

    def test_oldest_first_and_each_row_once(self, claims: tuple[DataPlaneClient, str]) -> None:
        client, pid = claims
        order = ["e", "a", "d", "c", "b"]
        client.kv_batch_put(order[:3], pid, {"x": torch.arange(3)})
        client.kv_batch_put(order[3:], pid, {"x": torch.arange(2)})
        got = [client.kv_claim(pid, "t", ["x"], 2, 0).keys for _ in range(4)]
        assert got == [("e", "a"), ("d", "c"), ("b",), ()]
        # Order is production order even when the store recycles slots of cleared rows.
        client.kv_batch_put(_keys(6, "n"), pid, {"x": torch.arange(6)})
        client.kv_clear(["n0", "n1", "n2", "e", "a"], pid)
        client.kv_batch_put(_keys(6, "m"), pid, {"x": torch.arange(6)})
        client.kv_batch_put(["a"], pid, {"x": torch.arange(1)})  # re-put after clear: newest
        want = ("n3", "n4", "n5", *_keys(6, "m"), "a")
        assert client.kv_claim(pid, "t", ["x"], 100, 0).keys == want

    def test_two_tasks_each_see_every_row_once(self, claims: tuple[DataPlaneClient, str]) -> None:
        client, pid = claims
        client.kv_batch_put(_keys(6), pid, {"x": torch.arange(6)})
        assert client.kv_claim(pid, "t1", ["x"], 4, 0).keys == tuple(_keys(4))
        assert client.kv_claim(pid, "t2", ["x"], 6, 0).keys == tuple(_keys(6))
        assert client.kv_claim(pid, "t1", ["x"], 4, 0).keys == ("k4", "k5")
        assert client.kv_claim(pid, "t2", ["x"], 1, 0).keys == ()
        assert client.kv_claim(pid, "t1", ["x"], 1, 0).keys == ()

    def test_concurrent_claimers_never_share_a_row(self, claims: tuple[DataPlaneClient, str]) -> None:
        client, pid = claims
        n, producer_done = 40, threading.Event()
        seen: list[list[str]] = [[] for _ in range(4)]
        errors: list[BaseException] = []

        def produce() -> None:
            try:
                for b in range(8):
                    client.kv_batch_put(_keys(5, f"r{b}_"), pid, {"x": torch.full((5,), b)})
                    time.sleep(0.01)
            except BaseException as e:  # noqa: BLE001 - reported below
                errors.append(e)
            finally:
                producer_done.set()

        def consume(mine: list[str]) -> None:
            try:
                while True:
                    done = producer_done.is_set()
                    got = client.kv_claim(pid, "t", ["x"], 3, 0.05).keys
                    mine.extend(got)
                    if done and not got:
                        return
            except BaseException as e:  # noqa: BLE001
                errors.append(e)

        threads = [threading.Thread(target=consume, args=(m,)) for m in seen] + [threading.Thread(target=produce)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(60)
        assert not errors, errors
        assert not any(th.is_alive() for th in threads)
        everything = [k for m in seen for k in m]
        assert len(everything) == len(set(everything)) == n, "a row went to two claimers, or was lost"
        assert sum(1 for m in seen if m) >= 2  # several claimers really took part
        assert len(client.kv_claim(pid, "other", ["x"], n, 0)) == n  # other tasks unaffected

    # --------------------------------------------------------------------- waiting
    def test_claim_waits_until_the_deadline_then_takes_what_is_ready(self, claims: tuple[DataPlaneClient, str]) -> None:
        client, pid = claims
        client.kv_batch_put(_keys(2), pid, {"x": torch.zeros(2)})
        meta, waited = _timed(client.kv_claim, pid, "t", ["x"], 5, 1.0)
        assert meta.keys == ("k0", "k1") and 0.8 <= waited < 6.0
        meta, waited = _timed(client.kv_claim, pid, "t", ["x"], 1, 0.5)
        assert meta.keys == () and 0.4 <= waited < 5.5
        meta, waited = _timed(client.kv_claim, pid, "t", ["x"], 1, 0)
        assert meta.keys == () and meta.partition_id == pid and waited < 5.0
        # An enough-rows claim does not wait at all.
        client.kv_batch_put(["k2"], pid, {"x": torch.zeros(1)})
        meta, waited = _timed(client.kv_claim, pid, "u", ["x"], 3, 30)
        assert meta.keys == ("k0", "k1", "k2") and waited < 5.0

    def test_a_put_during_the_wait_wakes_the_claimer(self, claims: tuple[DataPlaneClient, str]) -> None:
        client, pid = claims
        result: dict[str, Any] = {}

        def claimer() -> None:
            result["meta"], result["waited"] = _timed(client.kv_claim, pid, "t", ["x"], 3, 30)

        th = threading.Thread(target=claimer)
        th.start()
        time.sleep(0.3)
        client.kv_batch_put(["a"], pid, {"x": torch.zeros(1)})  # not enough yet
        time.sleep(0.1)
        client.kv_batch_put(["b", "c"], pid, {"x": torch.zeros(2)})
        th.join(35)
        assert not th.is_alive()
        assert result["meta"].keys == ("a", "b", "c")
        assert 0.3 <= result["waited"] < 10.0

    def test_unknown_partition_claims_nothing_and_is_not_created(self, claims: tuple[DataPlaneClient, str]) -> None:
        client, pid = claims
        ghost = f"{pid}-never-written"
        meta, waited = _timed(client.kv_claim, ghost, "t", ["x"], 1, 0.3)
        assert meta.keys == () and meta.partition_id == ghost and 0.24 <= waited < 5.3
        assert client.kv_claim_status(ghost, "t", ["x"]) == ClaimStatus(ghost, "t", 0, 0, 0, 0)
        client.kv_mark_consumed(["k"], ghost, "t")
        assert ghost not in client.kv_partitions()

    # ----------------------------------------------------------- consumed / status
    def test_mark_consumed_hides_rows_from_that_task_only(self, claims: tuple[DataPlaneClient, str]) -> None:
        client, pid = claims
        client.kv_batch_put(_keys(4), pid, {"x": torch.arange(4)})
        client.kv_mark_consumed(["k0", "k2", "ghost"], pid, "t")  # absent keys are ignored
        client.kv_mark_consumed([], pid, "t")
        assert client.kv_claim(pid, "t", ["x"], 10, 0).keys == ("k1", "k3")
        assert client.kv_claim(pid, "u", ["x"], 10, 0).keys == tuple(_keys(4))
        # Marked before its fields exist: never claimed by that task once they do.
        client.kv_batch_put(["late"], pid, None, tags=[{"s": 1}])
        client.kv_mark_consumed(["late"], pid, "t")
        client.kv_batch_put(["late"], pid, {"x": torch.arange(1)})
        assert client.kv_claim(pid, "t", ["x"], 10, 0).keys == ()
        assert client.kv_claim(pid, "u", ["x"], 10, 0).keys == ("late",)

    def test_claim_status_counts(self, claims: tuple[DataPlaneClient, str]) -> None:
        client, pid = claims
        client.kv_batch_put(_keys(4), pid, {"a": torch.arange(4)})
        client.kv_batch_put(["k0", "k1"], pid, {"b": torch.arange(2)})
        client.kv_batch_put(["n"], pid, None, tags=[{}])
        assert client.kv_claim_status(pid, "t", ["a", "b"]) == ClaimStatus(pid, "t", 5, 2, 0, 2)
        assert client.kv_claim(pid, "t", ["a"], 3, 0).keys == ("k0", "k1", "k2")
        assert client.kv_claim_status(pid, "t", ["a", "b"]) == ClaimStatus(pid, "t", 5, 2, 3, 0)
        assert client.kv_claim_status(pid, "t", ["a"]) == ClaimStatus(pid, "t", 5, 4, 3, 1)
        assert client.kv_claim_status(pid, "t", ["nope"]) == ClaimStatus(pid, "t", 5, 0, 3, 0)
        assert client.kv_claim_status(pid, "u", ["a"]) == ClaimStatus(pid, "u", 5, 4, 0, 4)
        client.kv_clear(["k0"], pid)  # a cleared key leaves the claimed count
        assert client.kv_claim_status(pid, "t", ["a"]) == ClaimStatus(pid, "t", 4, 3, 2, 1)

    def test_cleared_then_put_again_is_claimable_again_and_upserts_stay_claimed(
        self, claims: tuple[DataPlaneClient, str]
    ) -> None:
        client, pid = claims
        client.kv_batch_put(["k0", "k1"], pid, {"x": torch.arange(2)})
        assert client.kv_claim(pid, "t", ["x"], 2, 0).keys == ("k0", "k1")
        client.kv_batch_put(["k1"], pid, {"x": torch.arange(1), "y": torch.arange(1)}, tags=[{"v": 2}])
        assert client.kv_claim(pid, "t", ["x"], 2, 0).keys == ()
        assert client.kv_claim(pid, "t", ["y"], 2, 0).keys == ()
        client.kv_clear(["k0"], pid)
        client.kv_batch_put(["k0"], pid, {"x": torch.tensor([7])})
        again = client.kv_claim(pid, "t", ["x"], 2, 0)
        assert again.keys == ("k0",) and client.kv_batch_get(again, ["x"])["x"].tolist() == [7]
        client.kv_clear(None, pid)
        client.kv_batch_put(["k1"], pid, {"x": torch.arange(1)})
        assert client.kv_claim(pid, "t", ["x"], 2, 0).keys == ("k1",)

    def test_claim_argument_errors(self, claims: tuple[DataPlaneClient, str]) -> None:
        client, pid = claims
        good: dict[str, Any] = dict(partition_id=pid, task="t", fields=["x"], batch_size=1, timeout_s=0)
        bad_values: list[dict[str, Any]] = [
            dict(task=""),
            dict(fields=[]),
            dict(fields=["x", "x"]),
            dict(batch_size=0),
            dict(batch_size=True),
            dict(batch_size=1.5),
            dict(timeout_s=-1),
            dict(partition_id=""),
        ]
        for bad in bad_values:
            with pytest.raises(ValueError):
                client.kv_claim(**{**good, **bad})
        with pytest.raises(ValueError, match="task"):
            client.kv_mark_consumed(["k"], pid, "")
        with pytest.raises(ValueError):
            client.kv_mark_consumed(["k", "k"], pid, "t")
        with pytest.raises(ValueError, match="task"):
            client.kv_claim_status(pid, "", ["x"])
        with pytest.raises(ValueError):
            client.kv_claim_status(pid, "t", [])

    @pytest.mark.parametrize("timeout_s", [float("nan"), float("inf"), float("-inf"), -1.0, True, "1"])
    def test_claim_refuses_a_timeout_that_is_not_a_finite_number_ge_0(
        self, claims: tuple[DataPlaneClient, str], timeout_s: Any
    ) -> None:
        # NaN passes a `< 0` check and makes a deadline that is never reached: the claim would
        # wait forever. It must be refused, by name, and claim nothing (sync and async alike).
        client, pid = claims
        client.kv_batch_put(["k0"], pid, {"x": torch.arange(1)})
        with pytest.raises(ValueError, match="timeout_s"):
            client.kv_claim(pid, "t", ["x"], 1, timeout_s)
        with pytest.raises(ValueError, match="timeout_s"):
            asyncio.run(client.async_kv_claim(pid, "t", ["x"], 1, timeout_s))
        assert client.kv_claim(pid, "t", ["x"], 1, 0).keys == ("k0",)

    # -------------------------------------------------------------------- async
    def test_async_claim_twins(self, claims: tuple[DataPlaneClient, str]) -> None:
        client, pid = claims

        async def scenario() -> dict[str, Any]:
            await client.async_kv_batch_put(_keys(4), pid, {"x": torch.arange(4)})
            a, b = await asyncio.gather(
                client.async_kv_claim(pid, "t", ["x"], 2, 0), client.async_kv_claim(pid, "t", ["x"], 2, 0)
            )
            await client.async_kv_mark_consumed(["k0"], pid, "u")
            status = await client.async_kv_claim_status(pid, "u", ["x"])
            parts = await client.async_kv_partitions()
            waiter = asyncio.ensure_future(client.async_kv_claim(pid, "v", ["y"], 1, 20))
            await asyncio.sleep(0.2)
            await client.async_kv_batch_put(["k3"], pid, {"y": torch.arange(1)})
            woken = await asyncio.wait_for(waiter, 30)
            return dict(a=a.keys, b=b.keys, status=status, parts=parts, woken=woken.keys)

        out = asyncio.run(scenario())
        assert not set(out["a"]) & set(out["b"]) and sorted(out["a"] + out["b"]) == _keys(4)
        assert out["status"] == ClaimStatus(pid, "u", 4, 4, 1, 3)
        assert pid in out["parts"] and out["woken"] == ("k3",)
