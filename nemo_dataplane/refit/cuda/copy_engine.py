"""Copy-engine copies out of (or into) another process's CUDA memory, through the CUDA runtime
bindings: ``PeerCopier`` batches the contiguous ones (used by both IPC refits)."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["PeerCopier", "_cudart", "batch_allowed"]

Run = list[Any]  # [dst_ptr, src_ptr, nbytes, [(dst, src), ...]]: pairs adjacent in memory on both sides
Call = tuple[list[int], list[int], list[int]]  # one call's dst pointers, src pointers, sizes
Pair = tuple[torch.Tensor, torch.Tensor]  # (dst, src) for dst.copy_(src)
CopyPlan = tuple[list[Run], list[Pair]]  # PeerCopier.plan(): (raw runs, pairs for copy_)


def batch_allowed(rt: Any, call: str) -> bool:
    """Whether the runtime bindings ``rt`` have the batched copy ``call``."""
    return rt is not None and hasattr(rt, call)


def _cudart() -> Any:
    try:
        from cuda.bindings import runtime as cudart
    except ImportError:
        try:
            from cuda import cudart
        except ImportError:
            return None
    return cudart


class PeerCopier:
    """Copies ``src`` views (another process's memory) into local tensors on given streams.

    Pairs that are contiguous on both sides go out as raw copies (one per run of pairs
    adjacent in memory on both sides) on the ``raw`` stream: a copy-engine peer copy with none
    of torch's per-copy cross-device event barriers. The runs go out as (up to two)
    ``cudaMemcpyBatchAsync`` calls (CUDA >= 12.8) where the bindings and driver have it, otherwise
    (or once it was refused) as one ``cudaMemcpyAsync`` per run. Other pairs use
    ``dst.copy_(src)`` with the caller's streams current. Without cuda-bindings, or if a raw
    call is refused, everything goes through ``copy_``. ``batch=False`` (or setting ``batch``
    before ``issue``) skips the batched call: one call per run (benchmarks compare the two).
    """

    FIRST_CALL_BYTES = 64 << 20

    def __init__(self, batch: bool = True) -> None:
        self._rt = _cudart()
        self.raw = self._rt is not None
        self.raw_error: str | None = None
        self.batch = batch and batch_allowed(self._rt, "cudaMemcpyBatchAsync")
        self.batch_error: str | None = None
        self._attrs: list[Any] | None = None
        self._chunks: tuple[list[Run], list[Call]] | None = None

    @property
    def mode(self) -> str:
        """How the last copies went out: ``batch``, ``memcpy`` (one call per run) or ``copy_``."""
        return "batch" if self.raw and self.batch else "memcpy" if self.raw else "copy_"

    def plan(self, dst: Sequence[torch.Tensor], src: Sequence[torch.Tensor]) -> CopyPlan:
        """(raw runs as [dst_ptr, src_ptr, nbytes, pairs], pairs for ``copy_``)."""
        runs: list[Run] = []
        slow: list[Pair] = []
        for d, s in zip(dst, src):
            if self.raw and d.is_contiguous() and s.is_contiguous():
                n = d.numel() * d.element_size()
                dp, sp = d.data_ptr(), s.data_ptr()
                if runs and runs[-1][0] + runs[-1][2] == dp and runs[-1][1] + runs[-1][2] == sp:
                    runs[-1][2] += n
                    runs[-1][3].append((d, s))
                else:
                    runs.append([dp, sp, n, [(d, s)]])
            else:
                slow.append((d, s))
        return runs, slow

    def _batch(self, part: Call, handle: int) -> None:
        rt = self._rt
        if self._attrs is None:
            a = rt.cudaMemcpyAttributes()
            a.srcAccessOrder = rt.cudaMemcpySrcAccessOrder.cudaMemcpySrcAccessOrderStream
            self._attrs = [a]
        dsts, srcs, sizes = part
        res = rt.cudaMemcpyBatchAsync(dsts, srcs, sizes, len(sizes), self._attrs, [0], 1, handle)
        err = res[0] if isinstance(res, tuple) else res
        if err != rt.cudaError_t.cudaSuccess:
            raise RuntimeError(f"cudaMemcpyBatchAsync: {err}")

    def _loop(self, part: Call, handle: int) -> None:
        rt = self._rt
        kind = rt.cudaMemcpyKind.cudaMemcpyDeviceToDevice
        for dp, sp, n in zip(*part):
            (err,) = rt.cudaMemcpyAsync(dp, sp, n, kind, handle)
            if err != rt.cudaError_t.cudaSuccess:
                raise RuntimeError(f"cudaMemcpyAsync: {err}")

    def _chunks_of(self, runs: list[Run]) -> list[Call]:
        """The copies as argument lists for (at most) two calls: the first copies up to
        ``FIRST_CALL_BYTES``, then the rest. The driver spends about a microsecond of host time
        per copy in a batched call and starts copying only once it returns, so a short first
        call gets the bytes moving while the second is still being issued. Kept while the same
        plan is issued again: their host cost is on the critical path of every refit."""
        cached = self._chunks
        if cached is not None and cached[0] is runs:
            return cached[1]
        cut, total = 0, 0
        while cut < len(runs) and total < self.FIRST_CALL_BYTES:
            total += runs[cut][2]
            cut += 1
        out: list[Call] = [
            ([r[0] for r in chunk], [r[1] for r in chunk], [r[2] for r in chunk])
            for chunk in (runs[:cut], runs[cut:])
            if chunk
        ]
        self._chunks = (runs, out)
        return out

    def issue(
        self,
        runs: list[Run],
        slow: list[Pair],
        raw: torch.cuda.Stream,
        streams: Sequence[torch.cuda.Stream],
    ) -> None:
        """Enqueue the copies: the raw ones on ``raw``, the others with ``streams`` current."""
        rest = list(slow)
        if runs and self.raw:
            try:
                with torch.cuda.device(raw.device):
                    handle = int(raw.cuda_stream)
                    for chunk in self._chunks_of(runs):
                        if self.batch:
                            try:
                                self._batch(chunk, handle)
                                continue
                            except Exception as e:  # no batched copies here: one call per run from now on
                                self.batch, self.batch_error = False, str(e)
                        self._loop(chunk, handle)
            except Exception as e:  # binding mismatch or refused: copy_ for good (re-copying is harmless)
                self.raw, self.raw_error = False, str(e)
                rest = [pair for run in runs for pair in run[3]] + rest
        elif runs:
            rest = [pair for run in runs for pair in run[3]] + rest
        if rest:
            with contextlib.ExitStack() as stack:
                for stream in streams:
                    stack.enter_context(torch.cuda.stream(stream))
                for d, s in rest:
                    d.copy_(s, non_blocking=True)
