"""StatelessProcessGroup on CPU (gloo): collectives, rendezvous failures, several groups per process."""

from __future__ import annotations

import importlib.util
import ipaddress
import sys
import threading
import warnings
from pathlib import Path

import pytest
import torch

from nemo_dataplane.distributed.stateless_group import (
    StatelessGroupError,
    StatelessGroupTimeout,
    StatelessProcessGroup,
    wire_view,
)

# Spawned workers import the rank bodies by module name, so that module's folder must be on
# sys.path (inherited by the children); it is never imported as part of a ``tests`` package.
sys.path.insert(0, str(Path(__file__).parent))
import _refit_procs as P  # noqa: E402


@pytest.mark.parametrize("world", [2, 4])
def test_collectives_gloo(pool: P.Pool, world: int) -> None:
    port = P.free_port()
    res = P.run_ranks(pool, P.collectives, list(range(world)), world=world, port=port)
    for r in range(world):
        out = res[r]
        assert not isinstance(out, BaseException), P.format_exc(out)
        bcasts = {k: v for k, v in out.items() if k.startswith("bcast_")}
        assert bcasts and all(bcasts.values()), (r, bcasts)
        if P.HAS_FP8:
            assert "bcast_fp8_e4m3" in bcasts
        assert out["sum"] == [world * (world + 1) / 2] * 5
        assert out["max"] == [world - 1] * 3
        prv = (r - 1) % world
        assert out["ring"] == [100 * prv + i for i in range(4)]


def test_a_gloo_group_hosted_on_loopback_listens_on_loopback_only(pool: P.Pool) -> None:
    """gloo listens where GLOO_SOCKET_IFNAME points; a group whose every rank is on this host
    builds its device on loopback even when the variable names a routable interface."""
    res = P.run_ranks(pool, P.listeners, [0, 1], world=2, port=P.free_port(), interface=P.routable_interface())
    for r in (0, 1):
        assert not isinstance(res[r], BaseException), P.format_exc(res[r])
        # rank 0 hosts the store (loopback by host_tcp_store) and both run gloo's listener.
        assert len(res[r]) >= 1, f"rank {r}: no listener found, nothing was checked"
        assert all(ipaddress.ip_address(a).is_loopback for a in res[r]), (r, res[r])


def test_rank_that_never_joins_is_named(pool: P.Pool) -> None:
    port, timeout = P.free_port(), 2.0
    res = P.run_ranks(pool, P.join_then_idle, [0, 1], world=3, port=port, timeout=timeout)
    for r in (0, 1):
        out = res[r]
        assert out["error"] in ("StatelessGroupTimeout", "StatelessGroupError"), out
        assert "missing ranks [2]" in out["msg"], out["msg"]
        assert f"rank {r} of world size 3" in out["msg"]
        assert f"127.0.0.1:{port}" in out["msg"]
        assert out["elapsed"] < timeout + 3.0


def test_missing_rank0_is_named(pool: P.Pool) -> None:
    port, timeout = P.free_port(), 1.5
    res = P.run_ranks(pool, P.join_then_idle, [1], world=2, port=port, timeout=timeout)
    out = res[1]
    assert out["error"] == "StatelessGroupTimeout", out
    assert "missing ranks [0]" in out["msg"] and "rank 0" in out["msg"]
    assert out["elapsed"] < timeout + 1.5


def test_rank_skipping_barrier_is_named(pool: P.Pool) -> None:
    port, timeout = P.free_port(), 2.0
    res = P.run_ranks(pool, P.join_then_idle, [0, 1], world=2, port=port, timeout=timeout, skip="barrier")
    out = res[0]
    assert out["error"] == "StatelessGroupTimeout", out
    assert "barrier #0" in out["msg"] and "missing ranks [1]" in out["msg"], out["msg"]
    assert out["elapsed"] < timeout + 2.0


def test_dead_peer_recv_times_out(pool: P.Pool) -> None:
    port, timeout = P.free_port(), 2.0
    res = P.run_ranks(pool, P.join_then_idle, [0, 1], world=2, port=port, timeout=timeout, skip="send")
    out = res[0]
    assert out["error"] == "StatelessGroupTimeout", out
    assert "recv" in out["msg"] and "from rank 1 did not finish within 2s" in out["msg"], out["msg"]
    assert out["elapsed"] < timeout + 2.0


def _abort_when_waiting(port: int, arrived: list[int], reason: str, secret: str) -> None:
    """Post ``reason`` as the group's abort once ``arrived`` ranks reached its store: a driver
    that saw a member die while the others wait on it."""
    import datetime
    import time

    import torch.distributed as dist

    from nemo_dataplane.distributed.abort import post_group_abort

    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            probe = dist.TCPStore(P.HOST, port, None, False, timeout=datetime.timedelta(seconds=5))
        except Exception:  # noqa: BLE001 - rank 0 has not bound its store yet
            time.sleep(0.02)
            continue
        while not probe.check([f"spg/default/arrived/{r}" for r in arrived]):
            assert time.monotonic() < deadline, f"ranks {arrived} never reached the store"
            time.sleep(0.02)
        break
    assert post_group_abort(P.HOST, port, reason, secret=secret)


@pytest.mark.parametrize("stage", ["rendezvous", "barrier"])
def test_an_abort_posted_from_outside_stops_every_wait_at_once(pool: P.Pool, stage: str) -> None:
    """A member lost while the others wait on it through the store: the waits end within a
    watch period of the abort, quoting its reason, not at the 120 s timeout."""
    import threading

    port, secret = P.free_port(), "job-secret"
    world = 3 if stage == "rendezvous" else 2  # rendezvous: rank 2 never joins
    reason = "generator 1 (refit rank 2) died: its process exited"
    poster = threading.Thread(target=_abort_when_waiting, args=(port, [0, 1], reason, secret))
    poster.start()
    res = P.run_ranks(pool, P.wait_until_aborted, [0, 1], world=world, port=port, stage=stage, secret=secret)
    poster.join()
    waiting = [0, 1] if stage == "rendezvous" else [0]
    for r in waiting:
        out = res[r]
        assert out["error"] == "StatelessGroupError" and f"rank {r} of world size {world}" in out["msg"], out
        assert out["elapsed"] < 30.0, out  # the timeout is 120 s
    # Rank 0 hosts the store and quotes the reason; a rank that polls after rank 0 returned (its
    # process, the store's host, then ends) finds the store gone instead, as quickly.
    assert f"the group was aborted: {reason}" in res[0]["msg"], res[0]
    for r in waiting[1:]:
        said = res[r]["msg"]
        assert f"the group was aborted: {reason}" in said or "lost the rendezvous store" in said, res[r]
    if stage == "barrier":
        assert res[1]["error"] is None, res[1]


def test_an_abort_stops_a_gloo_collective_blocked_on_a_member_and_leaving_does_not_wait_for_gloo(
    pool: P.Pool, tmp_path: Path
) -> None:
    """A refit sender blocked in a gloo collective on a member that never takes part (it died, or
    hangs) stops at the posted abort, not at the group's timeout (120 s here), and its
    ``destroy(abort=True)`` returns while gloo still holds the op (gloo's release would wait for it)."""
    port, secret = P.free_port(), "job-secret"
    reason = "generator 1 (refit rank 2) died: its process exited"
    poster = threading.Thread(target=_abort_when_waiting, args=(port, [0, 1, 2], reason, secret))
    poster.start()
    res = P.run_ranks(
        pool, P.collective_until_aborted, [0, 1, 2], world=3, port=port, secret=secret, flags=str(tmp_path)
    )
    poster.join()
    for r in (0, 1):
        out = res[r]
        assert not isinstance(out, BaseException), P.format_exc(out)
        assert out["error"] == "StatelessGroupError" and "all_reduce" in out["msg"], out
        assert out["elapsed"] < 30.0 and out["destroy_s"] < 5.0, out
    assert f"the group was aborted: {reason}" in res[0]["msg"], res[0]
    assert res[2] == {"error": None}, res[2]


def test_an_abort_without_the_job_secret_is_refused_by_name(pool: P.Pool) -> None:
    port = P.free_port()
    import threading

    poster = threading.Thread(target=_abort_when_waiting, args=(port, [0, 1], "forged", "not-the-secret"))
    poster.start()
    res = P.run_ranks(pool, P.wait_until_aborted, [0, 1], world=3, port=port, stage="rendezvous", secret="job-secret")
    poster.join()
    # Whoever reads it first refuses it by name; a rank 0 that refused it takes its store along.
    refused = [r for r in (0, 1) if res[r]["error"] == "StoreAuthError"]
    assert refused and all("spg/default/abort" in res[r]["msg"] for r in refused), res
    assert all(
        res[r]["error"] == "StatelessGroupError" and "lost the rendezvous store" in res[r]["msg"]
        for r in (0, 1)
        if r not in refused
    ), res


def test_an_abort_for_a_store_that_is_gone_is_not_posted() -> None:
    from nemo_dataplane.distributed.abort import post_group_abort

    assert post_group_abort(P.HOST, P.free_port(), "late", timeout=1.0) is False


def test_two_groups_in_one_process(pool: P.Pool) -> None:
    ports = (P.free_port(), P.free_port())
    res = P.run_ranks(pool, P.two_groups, [0, 1], ports=ports)
    for r in (0, 1):
        out = res[r]
        assert not isinstance(out, BaseException), P.format_exc(out)
        assert out["a"] == (r, [11] * 4)
        assert out["b"] == (r, [22] * 4)  # same store as "a", separate key prefix
        assert out["c"] == (1 - r, [33] * 4)  # roles swapped
    w = [[float(i * 4 + j) for j in range(4)] for i in range(3)]
    assert res[1]["got"] == (5, w)  # from process 0 over group a
    assert res[0]["got"] == (6, [[2 * x for x in row] for row in w])  # from process 1 over group c


def test_single_rank_group_and_validation() -> None:
    port = P.free_port()
    with StatelessProcessGroup(P.HOST, port, 0, 1, "gloo", timeout=5) as g:
        t = torch.arange(5)
        g.broadcast(t, 0)
        g.barrier()
        assert t.tolist() == list(range(5))
        with pytest.raises(ValueError, match="contiguous"):
            g.broadcast(torch.zeros(4, 4).t(), 0)
        with pytest.raises(ValueError, match="src=3"):
            g.broadcast(t, 3)
        if P.HAS_FP8:
            with pytest.raises(TypeError, match="float8"):
                g.all_reduce(torch.zeros(2, dtype=torch.float8_e4m3fn))
    with pytest.raises(StatelessGroupError, match="destroyed"):
        g.barrier()
    with pytest.raises(ValueError, match="rank must be"):
        StatelessProcessGroup(P.HOST, port, 2, 2)
    with pytest.raises(ValueError, match="backend"):
        StatelessProcessGroup(P.HOST, port, 0, 1, "mpi")


class _FailingComm:
    def destroy(self) -> None:
        raise RuntimeError("ncclCommDestroy: unhandled system error")


class _RecordingPg:
    def __init__(self, pg: object) -> None:
        self.pg, self.shut = pg, False

    def shutdown(self) -> None:
        self.shut = True
        getattr(self.pg, "shutdown", lambda: None)()


def test_a_failed_communicator_release_is_reported_after_everything_is_released() -> None:
    g = StatelessProcessGroup(P.HOST, P.free_port(), 0, 1, "gloo", timeout=5, group_name="refit")
    pg = _RecordingPg(g._pg)
    g._comm, g._pg = _FailingComm(), pg  # as a nccl group whose communicator will not go
    with pytest.warns(RuntimeWarning, match=r"rank 0 of world size 1, group 'refit'.*communicator destroy: "):
        g.destroy()
    assert pg.shut and g.store is None, "the rest is released despite the failure"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        g.destroy()  # idempotent: nothing left to fail


@pytest.mark.skipif(not P.HAS_FP8, reason="torch without float8 dtypes")
def test_fp8_travels_as_uint8_view() -> None:
    x = torch.randn(3, 4).to(torch.float8_e4m3fn)
    v = wire_view(x, "nccl")
    assert v.dtype == torch.uint8 and v.numel() == 12 and v.data_ptr() == x.data_ptr()
    b = torch.randn(6).to(torch.bfloat16)
    assert wire_view(b, "nccl") is b


@pytest.mark.skipif(importlib.util.find_spec("nccl") is not None, reason="nccl4py is installed")
def test_nccl_backend_without_nccl4py_names_the_extra() -> None:
    with pytest.raises(ImportError, match=r"nemo-dataplane\[gpu\]"):
        StatelessProcessGroup(P.HOST, P.free_port(), 0, 1, "nccl", timeout=2)


def test_timeout_error_is_a_runtime_error() -> None:
    assert issubclass(StatelessGroupTimeout, RuntimeError) and issubclass(StatelessGroupTimeout, TimeoutError)
