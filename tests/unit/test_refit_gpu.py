"""StatelessProcessGroup(nccl) and packed refit on 2 GPUs; skipped without nccl4py or 2 GPUs."""

from __future__ import annotations

import ipaddress
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

pytest.importorskip("nccl.core", reason="nccl4py not installed (pip install 'nemo-dataplane[gpu]')")
if torch.cuda.device_count() < 2:
    pytest.skip("needs 2 CUDA GPUs", allow_module_level=True)

sys.path.insert(0, str(Path(__file__).parent))
import _ipc_procs as I  # noqa: E402
import _refit_procs as P  # noqa: E402

from nemo_dataplane.refit.packed import AUTO_PICKS_IPC  # noqa: E402

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def pool() -> Iterator[P.Pool]:
    ex = P.Pool(2)
    yield ex
    ex.kill()


def _ok(res: dict) -> None:
    for r, out in res.items():
        assert not isinstance(out, BaseException), f"rank {r}:\n{P.format_exc(out)}"


def test_nccl_collectives(pool: P.Pool) -> None:
    res = P.run_ranks(pool, P.collectives, [0, 1], world=2, port=P.free_port(), backend="nccl")
    _ok(res)
    for r in (0, 1):
        bcasts = {k: v for k, v in res[r].items() if k.startswith("bcast_")}
        assert all(bcasts.values()), (r, bcasts)
        assert res[r]["sum"] == [3.0] * 5 and res[r]["max"] == [1] * 3
        assert res[r]["ring"] == [100 * (1 - r) + i for i in range(4)]


@pytest.mark.parametrize(
    ("direct_bytes", "transport", "defaults"),
    [
        (None, "broadcast", False),
        (0, "broadcast", False),
        (None, "p2p", False),
        (0, "p2p", False),
        (None, "auto", True),
        (None, "ipc", False),
    ],
    ids=["packed", "per-tensor", "packed-p2p", "per-tensor-p2p", "defaults", "ipc"],
)
def test_nccl_refit_is_bit_exact(pool: P.Pool, direct_bytes: int | None, transport: str, defaults: bool) -> None:
    res = P.run_ranks(
        pool,
        P.refit_roundtrip,
        [0, 1],
        world=2,
        port=P.free_port(),
        backend="nccl",
        bucket_bytes=4096,
        direct_bytes=direct_bytes,
        versions=(41, 42),
        transport=transport,
        defaults=defaults,
    )
    _ok(res)
    if defaults:  # GPU default: per-tensor; on one host "auto" picks CUDA IPC
        assert res[0]["direct_bytes"] == 0, res[0]
        want = "ipc" if AUTO_PICKS_IPC else "broadcast"
        assert res[0]["transport"] == want and res[1]["transport"] == want, (res[0], res[1]["transport"])
    refits = res[1]["refits"]
    assert [x["version"] for x in refits] == [41, 42]
    assert [x["attr_version"] for x in refits] == [41, 42]
    assert [x["wrong"] for x in refits] == [[], []], refits


@pytest.mark.parametrize("copy_on", ["src", "dst"])
def test_ipc_refit_bit_exact_reuses_handles_and_follows_new_storage(pool: P.Pool, copy_on: str) -> None:
    res = P.run_ranks(pool, I.refit_ipc, [0, 1], world=2, port=P.free_port(), versions=(11, 12), copy_on=copy_on)
    _ok(res)
    assert res[0]["transport"] == res[0]["self_transport"] == res[1]["transport"] == "ipc", (res[0], res[1])
    refits = res[1]["refits"]
    assert [x["version"] for x in refits] == [11, 12, 100]
    assert [x["attr_version"] for x in refits] == [11, 12, 100]
    assert [x["wrong"] for x in refits] == [[], [], []], refits
    # Values changed in place between the first two refits: same handles, same opened views.
    assert res[0]["same_handles"] == [True, True] and [x["same_views"] for x in refits] == [True, True, False]
    assert res[0]["reexported"]
    assert res[1]["raw"], res[1]["raw_error"]  # copies went out as raw cudaMemcpyAsync
    print(
        f"copy_on={copy_on}: copies went out as {res[1]['mode']} (batch error: {res[1]['batch_error']}); "
        f"last refit phases: {res[1]['phases']}"
    )
    if copy_on == "src":
        assert res[1]["phases"]["copy_gpu_ms"] > 0 and res[1]["phases"]["ack_gpu_ms"] > 0, res[1]["phases"]


def test_ipc_push_refit_bit_exact_follows_moves_and_reports_receiver_realloc(pool: P.Pool) -> None:
    res = P.run_ranks(pool, I.refit_push, [0, 1], world=2, port=P.free_port(), versions=(21, 22))
    _ok(res)
    assert res[0]["transport"] == res[1]["transport"] == "ipc", (res[0], res[1])
    assert res[0]["direction"] == res[1]["direction"] == "push", (res[0], res[1])
    refits = res[1]["refits"]
    assert [x["version"] for x in refits] == [21, 22, 100, 102], refits
    assert [x["attr_version"] for x in refits] == [21, 22, 100, 102], refits
    assert [x["wrong"] for x in refits] == [[], [], [], []], refits
    moved = res[1]["moved"]
    assert moved["error"] == "RefitError" and "layers.0.norm" in moved["msg"], moved
    assert "prepare_refit_info() again" in moved["msg"], moved
    refused = res[0]["refused"]
    assert refused["error"] == "RefitError" and "layers.0.norm" in refused["msg"], refused
    assert res[0]["closed"] and res[0]["phases"]["copy_gpu_ms"] > 0, res[0]
    print(
        f"push: copies went out as {res[0]['mode']} (batch error: {res[0]['batch_error']}); "
        f"last refit phases: {res[0]['phases']}"
    )


def test_ipc_push_waits_for_the_receivers_queued_work(pool: P.Pool) -> None:
    res = P.run_ranks(pool, I.refit_push_waits_for_receiver, [0, 1], world=2, port=P.free_port())
    _ok(res)
    assert res[1]["version"] == 2, res[1]
    assert res[1]["snap"] == [1.0], res[1]  # the copies waited for the snapshot
    assert res[1]["after"] == [2.0], res[1]
    assert res[0]["send_s"] > 0.2, res[0]  # ... which waited for the receiver's GPU sleep


def test_ipc_push_sender_abort_reaches_receiver(pool: P.Pool) -> None:
    res = P.run_ranks(
        pool,
        P.refit_sender_abort,
        [0, 1],
        world=2,
        port=P.free_port(),
        backend="nccl",
        transport="ipc",
        ipc_direction="push",
    )
    assert res[0]["error"] == "RefitMismatchError", res[0]
    assert res[1]["error"] == "RefitError" and "aborted refit of version 3" in res[1]["msg"], res[1]
    assert "sender rank 0" in res[1]["msg"], res[1]
    assert res[1]["next_version"] == 4 and res[1]["next_values"] == [5.0] * 6, res[1]


@pytest.mark.parametrize("direction", ["pull", "push"])
def test_ipc_setup_failure_falls_back_on_auto_and_fails_cleanly_on_ipc(pool: P.Pool, direction: str) -> None:
    res = P.run_ranks(
        pool, I.refit_ipc_setup_fails, [0, 1], world=2, port=P.free_port(), direction=direction, transport="auto"
    )
    _ok(res)
    for r in (0, 1):
        assert res[r]["error"] is None and res[r]["transport"] == "broadcast", res[r]
        assert "rank 1" in res[r]["reason"] and "injected: IPC not permitted here" in res[r]["reason"], res[r]
    assert res[1]["version"] == 5 and res[1]["wrong"] == [], res[1]
    res = P.run_ranks(
        pool, I.refit_ipc_setup_fails, [0, 1], world=2, port=P.free_port(), direction=direction, transport="ipc"
    )
    _ok(res)
    for r in (0, 1):
        assert res[r]["error"] == "RefitError", res[r]
        assert "setup failed, no weights were moved" in res[r]["msg"] and "injected" in res[r]["msg"], res[r]
    assert res[1]["untouched"], res[1]


def test_ipc_pull_receiver_copy_failure_reaches_sender_and_group_survives(pool: P.Pool) -> None:
    res = P.run_ranks(pool, I.refit_pull_receiver_copy_fails, [0, 1], world=2, port=P.free_port())
    _ok(res)
    assert res[1]["error"] == "RefitError" and "injected: copy refused" in res[1]["msg"], res[1]
    assert res[0]["error"] == "RefitError" and "a receiver failed to copy refit version 1" in res[0]["msg"], res[0]
    assert "injected: copy refused" in res[0]["msg"], res[0]
    assert res[1]["next_version"] == 2 and res[1]["wrong"] == [], res[1]


def test_ipc_mismatch_is_caught_before_transfer(pool: P.Pool) -> None:
    res = P.run_ranks(pool, P.refit_mismatch, [0, 1], world=2, port=P.free_port(), backend="nccl", transport="ipc")
    for r in (0, 1):
        assert res[r]["error"] == "RefitMismatchError", res[r]
        assert "a: shape sender [4, 4] != receiver [4, 5]" in res[r]["msg"]
    assert res[1]["untouched"]


def test_nccl_two_groups_in_one_process(pool: P.Pool) -> None:
    res = P.run_ranks(pool, P.two_groups, [0, 1], ports=(P.free_port(), P.free_port()), backend="nccl")
    _ok(res)
    for r in (0, 1):
        assert res[r]["a"] == (r, [11] * 4) and res[r]["b"] == (r, [22] * 4) and res[r]["c"] == (1 - r, [33] * 4)
    w = [[float(i * 4 + j) for j in range(4)] for i in range(3)]
    assert res[1]["got"] == (5, w)
    assert res[0]["got"] == (6, [[2 * x for x in row] for row in w])


def test_nccl_mismatch_is_caught_before_transfer(pool: P.Pool) -> None:
    res = P.run_ranks(pool, P.refit_mismatch, [0, 1], world=2, port=P.free_port(), backend="nccl")
    for r in (0, 1):
        assert res[r]["error"] == "RefitMismatchError", res[r]
        assert "a: shape sender [4, 4] != receiver [4, 5]" in res[r]["msg"]
    assert res[1]["untouched"]


def test_nccl_sender_abort_reaches_receiver(pool: P.Pool) -> None:
    res = P.run_ranks(pool, P.refit_sender_abort, [0, 1], world=2, port=P.free_port(), backend="nccl")
    assert res[0]["error"] == "RefitMismatchError", res[0]
    assert res[1]["error"] == "RefitError" and "aborted refit of version 3" in res[1]["msg"], res[1]


def test_nccl_dead_peer_times_out(pool: P.Pool) -> None:
    timeout = 3.0
    res = P.run_ranks(
        pool,
        P.join_then_idle,
        [0, 1],
        world=2,
        port=P.free_port(),
        timeout=timeout,
        backend="nccl",
        skip="bcast",
        limit=40.0,
    )
    out = res[0]
    assert out["error"] == "StatelessGroupTimeout", out
    assert "did not finish within 3s" in out["msg"] and "rank 0 of world size 2" in out["msg"], out["msg"]
    assert out["elapsed"] < timeout + 3.0


def test_an_nccl_group_hosted_on_loopback_listens_on_loopback_only(pool: P.Pool) -> None:
    """NCCL's bootstrap listens on NCCL_SOCKET_IFNAME's interface; a group whose every rank is on
    this host pins it to loopback, even when the variable names a routable interface."""
    iface = P.routable_interface()
    res = P.run_ranks(pool, P.listeners, [0, 1], world=2, port=P.free_port(), backend="nccl", interface=iface)
    _ok(res)
    for r in (0, 1):
        assert res[r], f"rank {r}: no listener found, nothing was checked"
        assert all(ipaddress.ip_address(a).is_loopback for a in res[r]), (r, res[r])
