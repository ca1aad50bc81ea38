"""Resharding refit on GPUs: CUDA IPC push (ranks sharing a GPU, gloo control group; one case on
one GPU) and NCCL p2p; skipped without CUDA, the 2-GPU cases without 2 GPUs."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

sys.path.insert(0, str(Path(__file__).parent))
import _refit_procs as P  # noqa: E402
import _reshard_procs as R  # noqa: E402

pytestmark = pytest.mark.gpu
two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")


@pytest.fixture(scope="module")
def pool() -> Iterator[P.Pool]:
    ex = P.Pool(2)
    yield ex
    ex.kill()


@pytest.mark.parametrize(
    ("case", "gpus", "open_mode"),
    [
        pytest.param("tp2->tp1", (0, 1, 0), None, marks=two_gpus),
        pytest.param("tp2->tp1", (0, 1, 0), "torch", marks=two_gpus),
        pytest.param("tp1->tp2", (0, 0, 1), None, marks=two_gpus),
        pytest.param("dp2tp2->tp2", (0, 1, 0, 1, 0, 1), None, marks=two_gpus),
        pytest.param("ep2->ep1", (1, 0, 0), None, marks=two_gpus),
        ("tp2->tp1", (0, 0, 0), None),
    ],
    ids=["tp2-tp1", "tp2-tp1-torch-open", "tp1-tp2", "dp2tp2-tp2", "ep2-ep1", "tp2-tp1-one-gpu"],
)
def test_ipc_reshard_bit_exact_with_shared_gpus(
    pool: P.Pool, case: str, gpus: tuple[int, ...], open_mode: str | None
) -> None:
    res = P.run_ranks(
        pool,
        R.reshard_roundtrip,
        list(range(len(gpus))),
        world=len(gpus),
        port=P.free_port(),
        case=case,
        gpus=gpus,
        transport="ipc",
        limit=120,
        timings=True,
        open_mode=open_mode,
    )
    R.check_reshard(res, case)
    # Placement picks the copies (ipc_push doc): strided kernels wherever the sender's views
    # are in its own GPU's context (a receiver elsewhere mapped there, ipc.PeerMapping); 2D copies
    # where torch opened them on the receiver's GPU (kernels faulted there); event done on all.
    cross = {r: res[r]["cross_gpu"] for r in res}
    if len(set(gpus)) == 1:
        assert not any(cross.values()), cross
    if case == "tp2->tp1" and gpus == (0, 1, 0):
        assert cross == {0: False, 1: True, 2: True}, cross
    assert {res[r]["done"] for r in res} == {"event"}, res
    R.check_timings(
        res,
        {
            "send": ["check", "header", "issue", "signal", "copies"],
            "recv": ["check", "ready", "header", "signal", "scatter"],
        },
        refits=2,
    )
    assert {res[r]["transport"] for r in res} == {"ipc"}
    src, _ = R.reshard_layouts(case)
    for s in src.mesh.ranks:  # copy-engine copies, not the torch fallback
        assert res[s]["raw"], res[s]["raw_error"]
        torch_views = cross[s] and open_mode == "torch"
        assert res[s]["mapped"] == (cross[s] and not torch_views), res[s]
        assert res[s]["pitched"] == ("memcpy2d" if torch_views else "kernel"), res[s]
        print(f"rank {s}: {res[s]['copies_used']}")


@pytest.mark.parametrize("batch", ["1", "0"], ids=["batched", "one-call-each"])
def test_pitched_copier_is_bit_exact_on_the_gpu(batch: str) -> None:
    """The 2D copies of column blocks (and a box) through the real runtime, batched or not,
    across GPUs where there are two (plain memory, peer access as torch turns it on)."""
    from nemo_dataplane.refit.cuda.copy_engine import _cudart
    from nemo_dataplane.refit.reshard.pitched import PitchedCopier, pitched_copies

    rt = _cudart()
    if rt is None:
        pytest.skip("cuda-bindings not installed")
    there = "cuda:1" if torch.cuda.device_count() > 1 else "cuda:0"
    gen = torch.Generator(device="cuda:0").manual_seed(3)
    src = torch.randn(4, 96, 40, generator=gen, device="cuda:0").to(torch.bfloat16)
    col = torch.randn(128, 10, generator=gen, device="cuda:0").to(torch.bfloat16)
    dst = torch.zeros(4, 128, 80, dtype=torch.bfloat16, device=there)
    dst[0, 0, :1].copy_(src[0, 0, :1])  # torch turns peer access on, as ipc.probe does for the push
    dst.zero_()
    torch.cuda.synchronize()
    copies = (pitched_copies(dst[:, 16:112, 20:60], src) or []) + (pitched_copies(dst[1, :, 70:80], col) or [])
    assert len(copies) == 5 and all(c[5] > 1 for c in copies), copies  # 4 column blocks of a box + 1
    pc = PitchedCopier(rt, batch=batch == "1")
    s = torch.cuda.Stream(0)
    with torch.cuda.device(0):
        pc.issue(copies, s)
    s.synchronize()
    want = torch.zeros_like(dst)
    want[:, 16:112, 20:60] = src.to(there)
    want[1, :, 70:80] = col.to(there)
    assert torch.equal(dst.view(torch.int16), want.view(torch.int16))
    assert pc.mode == ("batch" if batch == "1" and hasattr(rt, "cudaMemcpy3DBatchAsync") else "loop"), pc.batch_error


@two_gpus
def test_nccl_p2p_reshard_bit_exact(pool: P.Pool) -> None:
    pytest.importorskip("nccl.core", reason="nccl4py not installed (pip install 'nemo-dataplane[gpu]')")
    res = P.run_ranks(
        pool,
        R.reshard_roundtrip,
        [0, 1],
        world=2,
        port=P.free_port(),
        case="tp1->tp1",
        backend="nccl",
        gpus=(0, 1),
        transport="p2p",
        limit=120,
    )
    R.check_reshard(res, "tp1->tp1")
    assert {res[r]["transport"] for r in res} == {"p2p"}


# GPU clock cycles of the sleep each sender queues before its copies (~0.1-0.2 s on an H100/H200):
# far longer than a receiver needs to learn that the copies were enqueued and return.
_DELAY_CYCLES = 300_000_000


@pytest.mark.parametrize(
    ("done", "gpus"),
    [("event", (0, 0, 0)), ("host", (0, 0, 0)), pytest.param("event", (0, 1, 0), marks=two_gpus)],
    ids=["event", "host", "event-across-gpus"],
)
def test_ipc_weights_are_ordered_after_late_copies_on_the_receivers_stream(
    pool: P.Pool, done: str, gpus: tuple[int, ...]
) -> None:
    """Each sender's copies start ~0.15 s late (a GPU sleep before them on its stream). With the
    event done signal the receiver returns before they ran (its stream still waits on the
    senders' events, through a stream of the sender's GPU for one on another GPU), yet what it
    reads on its current stream right after is bit-exact; with the host done signal (the
    earlier way) the same read is bit-exact too."""
    res = P.run_ranks(
        pool,
        R.reshard_roundtrip,
        [0, 1, 2],
        world=3,
        port=P.free_port(),
        case="tp2->tp1",
        gpus=gpus,
        transport="ipc",
        limit=120,
        done=done,
        delay_cycles=_DELAY_CYCLES,
    )
    R.check_reshard(res, "tp2->tp1")
    if done == "event":
        assert [x["pending_at_return"] for x in res[2]["refits"]] == [True, True], res[2]["refits"]


def test_ipc_sender_failure_before_signalling_raises_on_the_receiver(pool: P.Pool) -> None:
    """done="event": a sender whose copies cannot be enqueued posts its error as its done
    status: every receiver raises it at once, naming the rank; the next refit works."""
    res = P.run_ranks(pool, R.reshard_ipc_failure, [0, 1, 2], world=3, port=P.free_port(), what="raise", limit=120)
    for r, out in res.items():
        assert not isinstance(out, BaseException), f"rank {r}:\n{P.format_exc(out)}"
    assert res[0]["first"] is None
    assert res[1]["first"]["error"] == "RefitError" and "injected: copies refused" in res[1]["first"]["msg"]
    err = res[2]["first"]
    assert err["error"] == "RefitError", err
    assert "a sender failed to copy refit version 3" in err["msg"] and "rank 1:" in err["msg"], err
    assert res[2]["first_s"] < 3.0, res[2]["first_s"]  # not the group timeout (6 s)
    assert res[2]["next_version"] == 4 and res[2]["wrong"] == []


def test_ipc_silent_sender_times_out_on_the_receiver(pool: P.Pool) -> None:
    """done="event": a sender that never posts its done signal (as if it died after the header)
    makes the receiver raise within the group timeout, naming the rank, instead of returning
    weights nothing orders; the next refit works."""
    res = P.run_ranks(
        pool, R.reshard_ipc_failure, [0, 1, 2], world=3, port=P.free_port(), what="silent", timeout=6.0, limit=120
    )
    for r, out in res.items():
        assert not isinstance(out, BaseException), f"rank {r}:\n{P.format_exc(out)}"
    err = res[2]["first"]
    assert err["error"] == "StatelessGroupTimeout", err
    assert "sender ranks [1] never posted" in err["msg"], err
    assert 5.0 < res[2]["first_s"] < 20.0, res[2]["first_s"]
    assert res[2]["next_version"] == 4 and res[2]["wrong"] == []
