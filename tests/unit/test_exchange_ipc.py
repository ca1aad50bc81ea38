"""CPU-testable parts of the reshard's CUDA IPC transport: the pitched-copy decomposition
(executed here with memmove, which is what cudaMemcpy2D does row by row)."""

from __future__ import annotations

import ctypes
import socket
from pathlib import Path

import pytest
import torch

import nemo_dataplane.refit as refit
from nemo_dataplane.refit.reshard.ipc_push import pitched_copies


def _run(ops: list) -> None:
    for dp, dpitch, sp, spitch, width, height in ops:
        assert width <= dpitch and width <= spitch
        for row in range(height):
            ctypes.memmove(dp + row * dpitch, sp + row * spitch, width)


@pytest.mark.parametrize(
    ("shape", "dst_idx", "src_idx", "n_ops", "height"),
    [
        ((8, 6), (slice(2, 5), slice(None)), (slice(0, 3), slice(None)), 1, 1),  # row block: one 1D copy
        ((8, 6), (slice(None), slice(2, 5)), (slice(None), slice(0, 3)), 1, 8),  # column block: pitched
        ((4, 6, 5), (slice(1, 3), slice(2, 4), slice(None)), (slice(0, 2), slice(0, 2), slice(None)), 1, 2),
        ((4, 6, 5), (slice(1, 3), slice(None), slice(1, 4)), (slice(0, 2), slice(None), slice(0, 3)), 1, 12),
        ((4, 6, 5), (slice(1, 3), slice(1, 5), slice(1, 4)), (slice(0, 2), slice(0, 4), slice(0, 3)), 2, 4),
        ((4, 6, 5), (slice(0, 4), slice(None), slice(None)), (slice(0, 4), slice(None), slice(None)), 1, 1),
    ],
    ids=["rows", "columns", "expert-rows", "expert-columns", "expert-box", "whole"],
)
def test_pitched_copies_reproduce_copy(shape: tuple, dst_idx: tuple, src_idx: tuple, n_ops: int, height: int) -> None:
    gen = torch.Generator().manual_seed(0)
    big = torch.randn(shape, generator=gen).to(torch.bfloat16)
    src_full = torch.randn(shape, generator=gen).to(torch.bfloat16)
    dst, src = big[dst_idx], src_full[src_idx]
    want = big.clone()
    want[dst_idx] = src
    ops = pitched_copies(dst, src)
    assert ops is not None and len(ops) == n_ops and ops[0][5] == height
    _run(ops)
    assert torch.equal(big.view(torch.int16), want.view(torch.int16))


def test_pitched_copies_edge_cases() -> None:
    a, b = torch.zeros(6, 4), torch.arange(24.0).reshape(4, 6)
    assert pitched_copies(a, b.t()) is None  # innermost dim strided on one side: not a pitched copy
    assert pitched_copies(torch.zeros(0, 3), torch.zeros(0, 3)) == []
    x, y = torch.zeros(()), torch.tensor(5.0)
    _run(pitched_copies(x, y))  # type: ignore[arg-type]
    assert x.item() == 5.0
    with pytest.raises(ValueError, match="pitched_copies"):
        pitched_copies(torch.zeros(2), torch.zeros(3))


def test_widened_views_copy_the_same_bits() -> None:
    from nemo_dataplane.refit.reshard.ipc_push import _widened

    src = torch.randn(6, 16).to(torch.bfloat16)
    dst = torch.zeros(6, 32, dtype=torch.bfloat16)
    d, s = _widened(dst[:, 8:24], src)  # a column block: 32 bytes per row, 8-byte aligned
    assert d.dtype == torch.int64 and s.dtype == torch.int64
    d.copy_(s)
    assert torch.equal(dst[:, 8:24], src) and not dst[:, :8].any() and not dst[:, 24:].any()
    d, s = _widened(dst[:, 1:3], src[:, :2])  # 4 bytes at an odd element offset: no wider view
    assert d.dtype == torch.bfloat16


def test_ipc_push_options_come_from_arguments_not_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """The push's modes are options (the placement picks the pitched copies; benchmarks set
    ``order``); the environment variables that used to force them are ignored."""
    from nemo_dataplane.refit.reshard.ipc_push import ORDERS, PITCHED, IpcPush
    from nemo_dataplane.refit.reshard.layout import Mesh
    from nemo_dataplane.refit.reshard.plan import plan_reshard
    from nemo_dataplane.refit.reshard.rules import build_layout

    for name, value in (
        ("NEMO_DATAPLANE_IPC_OPEN", "torch"),
        ("NEMO_DATAPLANE_RESHARD_PITCHED", "memcpy2d"),
        ("NEMO_DATAPLANE_RESHARD_ORDER", "strided_first"),
        ("NEMO_DATAPLANE_IPC_BATCH", "0"),
    ):
        monkeypatch.setenv(name, value)
    shapes = {"model.layers.0.self_attn.o_proj.weight": ((4, 4), torch.bfloat16)}
    src, dst = build_layout(Mesh.of([0], tp=1), shapes), build_layout(Mesh.of([1], tp=1), shapes)
    plan = plan_reshard(src, dst, bucket_bytes=1024)
    cpu = torch.device("cpu")
    push = IpcPush(plan, 0, True, src.local_tensors(0), cpu)
    assert (
        (push.pitched, push.order) == ("kernel", "batched_first") and push.order in ORDERS and push.pitched in PITCHED
    )
    off = IpcPush(plan, 0, True, src.local_tensors(0), cpu, map_peers=False)
    assert off._open_here(b"never parsed") is None and off.map_error == "ipc_map_peers=False"


def test_refit_code_reads_no_environment_variable() -> None:
    """Refit behaviour is chosen by arguments (``WeightTransferConfig``), never by the environment."""
    root = Path(refit.__file__).parent
    offenders = [
        f"{p.relative_to(root)}:{i}"
        for p in sorted(root.rglob("*.py"))
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if "os.environ" in line or "getenv" in line or "NEMO_DATAPLANE_" in line
    ]
    assert offenders == []


def test_reshard_endpoints_check_the_ipc_done_option() -> None:
    from nemo_dataplane.distributed.stateless_group import StatelessProcessGroup
    from nemo_dataplane.refit.reshard import Mesh, ReshardReceiver, build_layout
    from nemo_dataplane.refit.reshard.ipc_control import DONE_SIGNALS

    assert DONE_SIGNALS == ("event", "host")
    layout = build_layout(Mesh.of([0], tp=1), {"w": ((2,), torch.float32)})
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    g = StatelessProcessGroup("127.0.0.1", port, 0, 1, "gloo", 10.0)
    try:
        assert ReshardReceiver(g, {"w": torch.zeros(2)}, layout, ipc_done="host").done == "host"
        with pytest.raises(ValueError, match="ipc_done must be one of"):
            ReshardReceiver(g, {"w": torch.zeros(2)}, layout, ipc_done="sideways")
    finally:
        g.destroy()


class _FakeRuntime:
    """Stands in for ``cuda.bindings.runtime`` (no CUDA here): records the calls and runs each
    2D copy with memmove, so the batched ops' fields are checked by the bytes they move. The
    real runtime runs in tests/unit/test_sharded_gpu.py."""

    class _Obj:
        def __init__(self, **kw: object) -> None:
            self.__dict__.update(kw)

    def __init__(self, refuse_batch: bool) -> None:
        O = self._Obj  # noqa: N806, E741
        self.refuse_batch = refuse_batch
        self.calls: list[str] = []
        self.cudaError_t = O(cudaSuccess=0)
        self.cudaMemcpyKind = O(cudaMemcpyDefault=4)
        self.cudaMemcpy3DOperandType = O(cudaMemcpyOperandTypePointer="ptr")
        self.cudaMemcpySrcAccessOrder = O(cudaMemcpySrcAccessOrderStream="stream")

    def cudaMemcpy3DBatchOp(self) -> object:  # noqa: N802 - the runtime's name
        O = self._Obj  # noqa: N806, E741
        side = lambda: O(type=None, op=O(ptr=O(ptr=0, rowLength=0, layerHeight=0)))  # noqa: E731
        return O(src=side(), dst=side(), extent=O(width=0, height=0, depth=0), srcAccessOrder=None)

    def cudaMemcpy3DBatchAsync(self, n: int, ops: list, flags: int, stream: int) -> tuple[int]:  # noqa: N802
        self.calls.append(f"batch {n}")
        if self.refuse_batch:
            return (801,)
        for op in ops:
            assert op.src.type == op.dst.type == "ptr" and op.extent.depth == 1 and op.srcAccessOrder == "stream"
            _run(
                [
                    (
                        op.dst.op.ptr.ptr,
                        op.dst.op.ptr.rowLength,
                        op.src.op.ptr.ptr,
                        op.src.op.ptr.rowLength,
                        op.extent.width,
                        op.extent.height,
                    )
                ]
            )
        return (0,)

    def cudaMemcpy2DAsync(
        self,
        dp: int,
        dpitch: int,
        sp: int,
        spitch: int,
        w: int,
        h: int,  # noqa: N802
        kind: int,
        stream: int,
    ) -> tuple[int]:
        self.calls.append("2d")
        _run([(dp, dpitch, sp, spitch, w, h)])
        return (0,)


@pytest.mark.parametrize("refuse_batch", [False, True], ids=["batched", "refused-then-loop"])
def test_pitched_copier_moves_column_blocks_batched_or_one_call_each(refuse_batch: bool) -> None:
    from nemo_dataplane.refit.reshard.pitched import PitchedCopier

    class _Stream:
        cuda_stream = 7

    gen = torch.Generator().manual_seed(1)
    dst, src = torch.zeros(2, 16, 12, dtype=torch.bfloat16), torch.randn(2, 12, 6, generator=gen).to(torch.bfloat16)
    copies = pitched_copies(dst[:, 2:14, 3:9], src)  # a box: one column block per expert
    assert copies is not None and len(copies) == 2
    rt = _FakeRuntime(refuse_batch)
    pc = PitchedCopier(rt)
    for _ in range(2):  # the second refit reuses the first one's ops (or stays on the loop)
        dst.zero_()
        pc.issue(copies, _Stream())  # type: ignore[arg-type]
        want = torch.zeros_like(dst)
        want[:, 2:14, 3:9] = src
        assert torch.equal(dst.view(torch.int16), want.view(torch.int16))
    assert rt.calls == (["batch 2", "2d", "2d", "2d", "2d"] if refuse_batch else ["batch 2", "batch 2"])
    assert pc.mode == ("loop" if refuse_batch else "batch")
    assert (pc.batch_error is not None) == refuse_batch and (not refuse_batch or "801" in pc.batch_error)


def test_peer_mapping_reads_torchs_handle_format_and_refuses_others() -> None:
    """torch's CUDA IPC handle: version, kind ('c': cudaMalloc), then the 64-byte
    cudaIpcMemHandle_t (66 bytes, seen on 2x H200 with torch 2.11); a bare 64-byte handle is
    taken as is; another kind (e.g. expandable segments) or length is refused, naming it, so the
    sender falls back to torch's open. Opening needs a GPU (test_sharded_gpu.py)."""
    from nemo_dataplane.refit.cuda.ipc import PeerMapping

    h = bytes(range(64))
    assert PeerMapping._mem_handle(b"\x02c" + h) == h
    assert PeerMapping._mem_handle(h) == h
    with pytest.raises(RuntimeError, match=r"66 bytes, kind b'e'"):
        PeerMapping._mem_handle(b"\x02e" + h)
    with pytest.raises(RuntimeError, match="65 bytes"):
        PeerMapping._mem_handle(b"c" + h)
