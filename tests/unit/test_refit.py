"""Packed refit over a gloo StatelessProcessGroup: bit-exact transfer, handshake failures, versions."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from nemo_dataplane.refit import RefitInfo, TensorSpec
from nemo_dataplane.refit.packed import Bucket, Direct, build_plan, diff_specs, group_directs

sys.path.insert(0, str(Path(__file__).parent))
import _refit_procs as P  # noqa: E402

# ---------------------------------------------------------------- plan and metadata (in process)


def _info(specs: list[TensorSpec], bucket: int = 1024, direct: int | None = None) -> RefitInfo:
    return RefitInfo(tuple(specs), bucket, bucket + 1 if direct is None else direct, 0)


def test_plan_packs_in_order_aligned_and_sends_big_tensors_directly() -> None:
    specs = [
        TensorSpec("a", (10,), "float32"),  # 40 B
        TensorSpec("b", (3,), "bfloat16"),  # 6 B, starts at 256
        TensorSpec("big", (300,), "float32"),  # 1200 B > bucket: direct
        TensorSpec("empty", (0, 4), "float32"),  # skipped
        TensorSpec("c", (200,), "float32"),  # 800 B
        TensorSpec("d", (100,), "float32"),  # 400 B: 800 + 400 > 1024, new bucket
    ]
    plan = build_plan(_info(specs))
    assert plan == [
        Direct(2),  # goes as it comes; the open bucket keeps filling across it
        Bucket(262, ((0, 0), (1, 256))),
        Bucket(800, ((4, 0),)),
        Bucket(400, ((5, 0),)),
    ]
    per_tensor = build_plan(_info(specs, direct=0))
    assert per_tensor == [Direct(0), Direct(1), Direct(2), Direct(4), Direct(5)]
    for item in plan:  # every packed slice is aligned and inside its bucket
        if isinstance(item, Bucket):
            for idx, off in item.entries:
                assert off % 256 == 0 and off + specs[idx].nbytes <= 1024


def test_info_roundtrip_and_fingerprint() -> None:
    info = _info([TensorSpec("w", (2, 3), "bfloat16"), TensorSpec("s", (), "float8_e4m3fn")])
    back = RefitInfo.from_bytes(info.to_bytes())
    assert back == info and back.fingerprint() == info.fingerprint()
    other = _info([TensorSpec("w", (3, 2), "bfloat16"), TensorSpec("s", (), "float8_e4m3fn")])
    assert other.fingerprint() != info.fingerprint()
    assert info.total_bytes == 13


def test_diff_specs_lists_every_kind_of_mismatch() -> None:
    sent = [TensorSpec("a", (4, 4), "float32"), TensorSpec("b", (8,), "bfloat16"), TensorSpec("c", (3,), "float32")]
    mine = [TensorSpec("a", (4, 5), "float32"), TensorSpec("b", (8,), "float32"), TensorSpec("x", (2,), "float32")]
    out = diff_specs(sent, mine)
    assert out == [
        "a: shape sender [4, 4] != receiver [4, 5]",
        "b: dtype sender bfloat16 != receiver float32",
        "c: sent by the trainer, but the receiver has no such tensor",
        "x: receiver tensor not sent by the trainer (it would go stale)",
    ]
    assert diff_specs(sent, sent) == []


# ---------------------------------------------------------------- across processes


@pytest.mark.parametrize(
    ("world", "direct_bytes", "transport"),
    [(2, None, "auto"), (4, None, "auto"), (2, 0, "auto"), (2, 0, "p2p"), (3, None, "p2p")],
    ids=["packed-2ranks", "packed-4ranks", "per-tensor-2ranks", "per-tensor-p2p-2ranks", "packed-p2p-3ranks"],
)
def test_refit_is_bit_exact(pool: P.Pool, world: int, direct_bytes: int | None, transport: str) -> None:
    port = P.free_port()
    res = P.run_ranks(
        pool,
        P.refit_roundtrip,
        list(range(world)),
        world=world,
        port=port,
        bucket_bytes=4096,
        direct_bytes=direct_bytes,
        versions=(7, 8),
        transport=transport,
    )
    for r in range(world):
        assert not isinstance(res[r], BaseException), P.format_exc(res[r])
    assert res[0]["n_tensors"] == len(P.model_tensors(0, torch.device("cpu")))
    assert res[0]["transport"] == ("broadcast" if transport == "auto" else transport)
    for r in range(1, world):
        refits = res[r]["refits"]
        assert [x["version"] for x in refits] == [7, 8]
        assert [x["attr_version"] for x in refits] == [7, 8]
        assert [x["wrong"] for x in refits] == [[], []], refits


def test_model_fixture_covers_the_tricky_dtypes() -> None:
    t = P.model_tensors(0, torch.device("cpu"))
    dtypes = {v.dtype for v in t.values()}
    assert {torch.bfloat16, torch.int64, torch.bool, torch.int8}.issubset(dtypes)
    if P.HAS_FP8:
        assert torch.float8_e4m3fn in dtypes and torch.float8_e5m2 in dtypes
    assert t["lm_head.big"].numel() * 4 > 4096  # larger than the bucket used above
    assert P.model_tensors(0, torch.device("cpu"))["embed.weight"].equal(t["embed.weight"])
    assert not P.model_tensors(1, torch.device("cpu"))["embed.weight"].equal(t["embed.weight"])


def test_mismatch_is_caught_before_transfer_on_both_sides(pool: P.Pool) -> None:
    port = P.free_port()
    res = P.run_ranks(pool, P.refit_mismatch, [0, 1, 2], world=3, port=port, bad_ranks=(1,))
    expected = [
        "a: shape sender [4, 4] != receiver [4, 5]",
        "b: dtype sender bfloat16 != receiver float32",
        "c: sent by the trainer, but the receiver has no such tensor",
        "extra: receiver tensor not sent by the trainer",
    ]
    for r in (0, 1, 2):
        out = res[r]
        assert out["error"] == "RefitMismatchError", out
        assert "rank 1:" in out["msg"]
        for line in expected:
            assert line in out["msg"], (r, out["msg"])
        if r:
            assert out["untouched"], "no weights may move after a failed handshake"
    assert "rank 2:" not in res[0]["msg"]  # the good receiver is not blamed


def test_matching_layout_passes_handshake(pool: P.Pool) -> None:
    res = P.run_ranks(pool, P.refit_mismatch, [0, 1], world=2, port=P.free_port(), bad_ranks=())
    assert res[0] == {"error": None} and res[1]["error"] is None


def test_sender_abort_reaches_receivers(pool: P.Pool) -> None:
    res = P.run_ranks(pool, P.refit_sender_abort, [0, 1, 2], world=3, port=P.free_port())
    assert res[0]["error"] == "RefitMismatchError", res[0]
    assert "w: shape at prepare_refit_info() [6] != now [7]" in res[0]["msg"]
    for r in (1, 2):
        assert res[r]["error"] == "RefitError", res[r]
        assert "sender rank 0 aborted refit of version 3" in res[r]["msg"]
        assert "tensors changed since prepare_refit_info" in res[r]["msg"]
        assert res[r]["next_version"] == 4 and res[r]["next_values"] == [5.0] * 6  # group still usable


def test_receiver_that_never_prepares_is_named(pool: P.Pool) -> None:
    timeout = 2.0
    res = P.run_ranks(pool, P.refit_missing_receiver, [0, 1, 2], world=3, port=P.free_port(), timeout=timeout)
    for r in (0, 1):
        out = res[r]
        assert out["error"] in ("StatelessGroupTimeout", "StatelessGroupError"), out
        assert "refit handshake" in out["msg"] and "missing ranks [2]" in out["msg"], out["msg"]
        assert out["elapsed"] < timeout + 2.0


# ---------------------------------------------------------------- CUDA IPC transport (CPU-side pieces)


def test_ipc_host_check_names_the_rank_and_reason() -> None:
    from nemo_dataplane.refit.cuda.ipc import ipc_problems

    me = {"host": "a", "boot_id": "b1", "cuda": True, "uuid": "GPU-0", "visible": ["GPU-0", "GPU-1"]}
    ok = {"host": "a", "boot_id": "b1", "cuda": True, "uuid": "GPU-1", "visible": ["GPU-0", "GPU-1"]}
    assert ipc_problems({0: me, 1: ok}, 0) == []
    out = ipc_problems({0: me, 1: {**ok, "host": "z"}, 2: {**ok, "visible": ["GPU-1"]}, 3: {**ok, "boot_id": "b2"}}, 0)
    assert len(out) == 3
    assert out[0].startswith("rank 1 runs on host 'z'")
    assert out[1].startswith("rank 2 cannot see the sender's GPU GPU-0")
    assert out[2].startswith("rank 3 runs on host 'a'")  # same name, other boot: another machine
    assert ipc_problems({0: {**me, "cuda": False}, 1: ok}, 0) == ["sender rank 0 is not on a CUDA device"]


def test_ipc_handle_encoding_roundtrips() -> None:
    from nemo_dataplane.refit.cuda.ipc import _dec, _enc

    args = (
        torch.Tensor,
        torch.Size([3, 4]),
        (4, 1),
        5,
        torch.storage.TypedStorage,
        torch.bfloat16,
        1,
        b"\x00\xffhandle",
        4096,
        512,
        False,
        b"/torch_1_2",
        0,
        None,
        True,
    )
    back = tuple(_dec(_enc(a)) for a in args)
    assert back[0] is torch.Tensor and back[4] is torch.storage.TypedStorage and back[5] is torch.bfloat16
    assert back[1] == (3, 4) and back[2] == (4, 1) and back[7] == b"\x00\xffhandle" and back[13] is None
    with pytest.raises(TypeError):
        _enc(dict)


def test_ipc_transport_needs_cuda() -> None:
    from nemo_dataplane.refit.packed import TRANSPORTS

    assert "ipc" in TRANSPORTS
    g = P.StatelessProcessGroup(P.HOST, P.free_port(), 0, 1, "gloo", 10.0)
    try:
        with pytest.raises(ValueError, match="transport='ipc' needs CUDA"):
            P.RefitSender(g, {"w": torch.ones(2)}, transport="ipc")
        with pytest.raises(ValueError, match="ipc_direction must be one of"):
            P.RefitSender(g, {"w": torch.ones(2)}, ipc_direction="sideways")
        snd = P.RefitSender(g, {"w": torch.ones(2)}, ipc_direction="push")  # gloo: broadcast, push unused
        assert snd.prepare_refit_info().transport == "broadcast"
        snd.close()
        snd = P.RefitSender(g, {"w": torch.ones(2)})  # auto on gloo: broadcast, no host check
        assert snd.prepare_refit_info().transport == "broadcast" and snd.transport == "broadcast"
        snd.send_weights(1)
        snd.close()
    finally:
        g.destroy()


def test_group_directs_cuts_at_buckets_bytes_and_op_count() -> None:
    b = Bucket(512, ((9, 0),))
    plan = [Direct(0), Direct(1), b, Direct(2), Direct(3), Direct(4), Direct(5), Direct(6)]
    nbytes = [10, 10, 100, 30, 1, 1, 1, 0, 0, 0]
    # bucket closes the first group; 100 + 30 >= 120 closes the next; then max_ops=2 cuts
    assert group_directs(plan, nbytes, group_bytes=120, max_ops=2) == [[0, 1], b, [2, 3], [4, 5], [6]]
    assert group_directs(plan, nbytes, group_bytes=1 << 30, max_ops=64) == [[0, 1], b, [2, 3, 4, 5, 6]]
    assert group_directs([b], nbytes, group_bytes=1) == [b]
    # Every direct tensor appears exactly once, in order, whatever the limits.
    for gb in (1, 50, 10**9):
        for mo in (1, 3, 64):
            flat = [i for x in group_directs(plan, nbytes, gb, mo) if isinstance(x, list) for i in x]
            assert flat == [0, 1, 2, 3, 4, 5, 6]
