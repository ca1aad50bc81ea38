"""2D (pitched) copy-engine copies: how the reshard's IPC push sends a piece that is not one
contiguous run on both sides (a column block of a row-parallel weight), without a kernel.

``pitched_copies`` turns ``dst.copy_(src)`` into ``cudaMemcpy2D`` arguments; ``PitchedCopier``
issues a list of them: as one ``cudaMemcpy3DBatchAsync`` (depth 1) where the bindings and
driver have it (CUDA >= 12.8), otherwise as one ``cudaMemcpy2DAsync`` each. Why batched: across
GPUs each separate copy-engine copy costs GPU time of its own, which a batched call amortises
(the same path as the contiguous copies; docs/refit.md, section 6.4, has the measurements).
These copies serve the reshard only where a receiver on another GPU could not be mapped into
the sender's context.
"""

from __future__ import annotations

import itertools
from typing import Any

import torch

from nemo_dataplane.refit.cuda.copy_engine import batch_allowed

__all__ = ["Copy", "PitchedCopier", "pitched_copies"]

Copy = tuple[int, int, int, int, int, int]  # dst ptr, dst pitch, src ptr, src pitch, width, height (bytes)


def pitched_copies(dst: torch.Tensor, src: torch.Tensor) -> list[Copy] | None:
    """``dst.copy_(src)`` (same shape and dtype) as 2D pitched memory copies, or None if it is
    not expressible so (the innermost dimension strided on either side).

    Dimensions that are contiguous across on both sides are merged first, so a contiguous
    block is one copy of height 1, a block of columns one copy of height ``rows``, and a 3D
    box one 2D copy per index of its outer dims.
    """
    if dst.shape != src.shape or dst.dtype != src.dtype:
        raise ValueError(f"pitched_copies: {tuple(dst.shape)} {dst.dtype} vs {tuple(src.shape)} {src.dtype}")
    isz = dst.element_size()
    dims = [(n, d, s) for n, d, s in zip(dst.shape, dst.stride(), src.stride()) if n != 1]
    if dst.numel() == 0:
        return []
    if not dims:
        return [(dst.data_ptr(), isz, src.data_ptr(), isz, isz, 1)]
    merged = [dims[-1]]
    for n, d, s in reversed(dims[:-1]):
        n1, d1, s1 = merged[0]
        if d == n1 * d1 and s == n1 * s1:
            merged[0] = (n * n1, d1, s1)
        else:
            merged.insert(0, (n, d, s))
    n_in, d_in, s_in = merged[-1]
    if d_in != 1 or s_in != 1:
        return None
    width = n_in * isz
    if len(merged) == 1:
        return [(dst.data_ptr(), width, src.data_ptr(), width, width, 1)]
    rows, dp, sp = merged[-2]
    outer = merged[:-2]
    out: list[Copy] = []
    for idx in itertools.product(*(range(n) for n, _, _ in outer)):
        do = sum(i * d for i, (_, d, _) in zip(idx, outer)) * isz
        so = sum(i * s for i, (_, _, s) in zip(idx, outer)) * isz
        out.append((dst.data_ptr() + do, dp * isz, src.data_ptr() + so, sp * isz, width, rows))
    return out


class PitchedCopier:
    """Issues ``Copy`` lists on a stream through the CUDA runtime bindings ``rt``
    (``cuda.bindings.runtime``): batched (``mode == "batch"``) until the batched call is
    refused once, then one ``cudaMemcpy2DAsync`` per copy for good (``batch_error`` says why).
    ``batch=False`` skips the batched call, as for ``cuda.copy_engine.PeerCopier``.
    A refused ``cudaMemcpy2DAsync`` raises (the caller falls back to torch copies)."""

    def __init__(self, rt: Any, batch: bool = True) -> None:
        self._rt = rt
        self.batch = batch and batch_allowed(rt, "cudaMemcpy3DBatchAsync")
        self.batch_error: str | None = None
        self._ops: tuple[list[Copy], list[Any]] | None = None  # the op list of the last copies

    @property
    def mode(self) -> str:
        return "batch" if self.batch else "loop"

    def issue(self, copies: list[Copy], stream: torch.cuda.Stream) -> None:
        """Enqueue ``copies`` on ``stream`` (in any order among themselves: no two may overlap)."""
        if not copies:
            return
        handle = int(stream.cuda_stream)
        if self.batch:
            try:
                self._batch(copies, handle)
                return
            except Exception as e:  # no batched 3D copies here: one call per copy from now on
                self.batch, self.batch_error = False, f"{type(e).__name__}: {e}"
        rt = self._rt
        kind, ok = rt.cudaMemcpyKind.cudaMemcpyDefault, rt.cudaError_t.cudaSuccess
        for dp, dpitch, sp, spitch, width, height in copies:
            (err,) = rt.cudaMemcpy2DAsync(dp, dpitch, sp, spitch, width, height, kind, handle)
            if err != ok:
                raise RuntimeError(f"cudaMemcpy2DAsync: {err}")

    def _batch(self, copies: list[Copy], handle: int) -> None:
        rt = self._rt
        if self._ops is None or self._ops[0] is not copies:  # built once per plan: host time counts
            self._ops = (copies, [self._op(c) for c in copies])
        ops = self._ops[1]
        res = rt.cudaMemcpy3DBatchAsync(len(ops), ops, 0, handle)
        err = res[0] if isinstance(res, tuple) else res
        if err != rt.cudaError_t.cudaSuccess:
            raise RuntimeError(f"cudaMemcpy3DBatchAsync: {err}")

    def _op(self, c: Copy) -> Any:
        # Pointer operands count in elements of 1 byte: row length = pitch, extent width = bytes.
        rt = self._rt
        dp, dpitch, sp, spitch, width, height = c
        op = rt.cudaMemcpy3DBatchOp()
        for side, ptr, pitch in ((op.src, sp, spitch), (op.dst, dp, dpitch)):
            side.type = rt.cudaMemcpy3DOperandType.cudaMemcpyOperandTypePointer
            side.op.ptr.ptr = ptr
            side.op.ptr.rowLength = pitch
            side.op.ptr.layerHeight = height
        op.extent.width, op.extent.height, op.extent.depth = width, height, 1
        op.srcAccessOrder = rt.cudaMemcpySrcAccessOrder.cudaMemcpySrcAccessOrderStream
        return op
