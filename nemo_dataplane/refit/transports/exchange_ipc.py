"""Same-host transport of a resharding refit: CUDA IPC push with copy-engine copies.

Every receiver exports its local tensors once (``ipc.PushTargets``: a non-contiguous one as a
slot of a staging buffer, copied into it after each refit). Every sender opens the exports of
the receivers it has pieces for and, at each refit, writes each piece straight from its own
tensor into the receiver's memory: one ``cudaMemcpy2DAsync`` per piece (a column block of a
row-major tensor is a pitched 2D copy; a row block a 1D one), on a copy stream of its GPU, so
the copy engines move the bytes (NVLink to another GPU, or within the same GPU) and no bulk
data touches the group. Pieces are the plan's entries (``reshard.py``); messages and buckets do
not matter here.

The group carries only host-side control (works on gloo, so several processes may share a
GPU, which an NCCL communicator refuses): each refit is the header ``all_reduce`` (receivers
join it once their queued GPU work is done, so nothing they still read is overwritten), the
senders' copies, then a ``done`` ``all_reduce`` once every sender's copies finished.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Mapping, Sequence

import torch

from nemo_dataplane.refit import ipc as _ipc
from nemo_dataplane.refit.copies import copy_all
from nemo_dataplane.refit.layout import LocalTensor
from nemo_dataplane.refit.reshard import ReshardPlan

__all__ = ["IpcPush", "pitched_copies"]

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


class IpcPush:
    """One rank's part of the IPC push: a receiver's exported targets, or a sender's opened
    views of its receivers and its copies (planned once per placement of its tensors)."""

    def __init__(self, plan: ReshardPlan, rank: int, sender: bool, locals_: Mapping[str, LocalTensor],
                 device: torch.device) -> None:
        self.plan = plan
        self.rank = rank
        self.sender = sender
        self.device = device
        self.names = list(locals_)
        self.targets: _ipc.PushTargets | None = None
        self.views: dict[int, dict[str, torch.Tensor]] = {}
        self.peers = sorted({(d if sender else s) for s, d in plan.pairs if (s if sender else d) == rank})
        self._stream: torch.cuda.Stream | None = None
        self._key: list | None = None
        self._copies: list[Copy] = []
        self._slow: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._sources: list[torch.Tensor] = []
        self._gather: tuple[list[torch.Tensor], list[torch.Tensor]] = ([], [])
        self._rt = _ipc._cudart()
        self.raw = self._rt is not None
        self.raw_error: str | None = None
        # timing=True: CUDA events split the last refit's copies into the contiguous ones
        # (height 1) and the pitched ones; phases() then gives bytes and GPU ms of each.
        self.timing = False
        self._events: list[torch.cuda.Event] = []

    # -- setup

    def export(self, tensors: Mapping[str, torch.Tensor]) -> bytes:
        """Receiver: export our tensors (in local-tensor order) for the senders to open."""
        self.targets = _ipc.PushTargets([tensors[n] for n in self.names], self.device)
        return self.targets.blob()

    def open(self, blobs: Mapping[int, bytes], peer_names: Mapping[int, Sequence[str]]) -> None:
        """Sender: open every peer receiver's exported tensors (``peer_names``: their order)."""
        for r, blob in blobs.items():
            try:
                views = _ipc.open_tensors(blob)
            except Exception as e:
                raise RuntimeError(f"rank {r}: {e}") from e
            _ipc.probe(views, self.device)
            self.views[r] = {n: v for n, v in zip(peer_names[r], views) if v is not None}
        self._stream = torch.cuda.Stream(self.device)

    def close(self) -> None:
        had = bool(self.views) or self.targets is not None
        self.views, self.targets, self._sources, self._copies, self._slow = {}, None, [], [], []
        self._gather = ([], [])
        self._key = None
        if had:
            with contextlib.suppress(Exception):
                torch.cuda.ipc_collect()

    # -- each refit

    def moved(self, tensors: Mapping[str, torch.Tensor]) -> list[str]:
        """Receiver: names of tensors no longer where they were exported."""
        assert self.targets is not None
        return [self.names[i] for i in self.targets.moved([tensors[n] for n in self.names])]

    @property
    def bytes_issued(self) -> int:
        """Sender: bytes its copies write per refit."""
        return sum(w * h for _, _, _, _, w, h in self._copies) + sum(
            d.numel() * d.element_size() for d, _ in self._slow)

    def _plan(self, tensors: Mapping[str, torch.Tensor]) -> None:
        key = [(t.data_ptr(), t.stride()) for t in tensors.values()]
        if key == self._key:
            return
        copies: list[Copy] = []
        slow: list[tuple[torch.Tensor, torch.Tensor]] = []
        gather: tuple[list[torch.Tensor], list[torch.Tensor]] = ([], [])
        for r in self.peers:
            dst_views = self.views[r]
            for m in self.plan.messages(self.rank, r):
                for e in m.entries:
                    src = tensors[e.src_local][tuple(slice(a, b) for a, b in e.src_region)]
                    dst = dst_views[e.dst_local][tuple(slice(a, b) for a, b in e.dst_region)]
                    ops = pitched_copies(dst, src) if self.raw else None
                    if ops is None and self.raw:
                        # A source strided in its innermost dim: gathered into a contiguous
                        # scratch on our GPU first (allocated on the copy stream, which uses it).
                        with torch.cuda.stream(self._stream):
                            tmp = torch.empty(src.shape, dtype=src.dtype, device=self.device)
                        gather[0].append(tmp)
                        gather[1].append(src)
                        ops = pitched_copies(dst, tmp)
                    if ops is None:
                        slow.append((dst, src))
                    else:
                        copies += ops
        # Contiguous copies first, then the pitched ones (order is free: no two write the same
        # bytes), so timing can tell their rates apart.
        copies.sort(key=lambda c: c[5] > 1)
        self._key, self._copies, self._slow, self._gather = key, copies, slow, gather
        self._sources = list(tensors.values())  # what the copies read stays alive

    def issue(self, tensors: Mapping[str, torch.Tensor]) -> torch.cuda.Event:
        """Sender: enqueue every copy on the copy stream (after the current stream); returns an
        event recorded after them, and orders the current stream after them."""
        assert self._stream is not None
        self._plan(tensors)
        cur = torch.cuda.current_stream(self.device)
        s = self._stream
        s.wait_stream(cur)  # read the weights after whatever wrote them
        if self._copies:
            try:
                if self._gather[0]:
                    with torch.cuda.stream(s):
                        copy_all(*self._gather)
                self._raw(s)
            except Exception as e:  # bindings refused: torch copies from now on (re-copying is harmless)
                self.raw = False
                self._key = None
                self._plan(tensors)
                self.raw_error = str(e)
        if self._slow:
            with torch.cuda.stream(s):
                for d, x in self._slow:
                    d.copy_(x, non_blocking=True)
        ev = torch.cuda.Event()
        ev.record(s)
        cur.wait_stream(s)  # later writes to the weights wait for the copies reading them
        return ev

    def _raw(self, stream: torch.cuda.Stream) -> None:
        rt = self._rt
        kind = rt.cudaMemcpyKind.cudaMemcpyDefault
        handle = int(stream.cuda_stream)
        ok = rt.cudaError_t.cudaSuccess
        marks = []
        if self.timing:
            marks = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
            marks[0].record(stream)
        pitched = False
        with torch.cuda.device(self.device):
            for dp, dpitch, sp, spitch, width, height in self._copies:
                if marks and height > 1 and not pitched:
                    marks[1].record(stream)
                    pitched = True
                (err,) = rt.cudaMemcpy2DAsync(dp, dpitch, sp, spitch, width, height, kind, handle)
                if err != ok:
                    raise RuntimeError(f"cudaMemcpy2DAsync: {err}")
        if marks:
            if not pitched:
                marks[1].record(stream)
            marks[2].record(stream)
        self._events = marks

    def phases(self) -> dict[str, float]:
        """After a refit with ``timing`` (and its copies done): bytes and GPU milliseconds of the
        contiguous and of the pitched copies."""
        if len(self._events) != 3:
            return {}
        e0, e1, e2 = self._events
        flat = sum(w for _, _, _, _, w, h in self._copies if h == 1)
        return {"contiguous_bytes": flat, "contiguous_ms": e0.elapsed_time(e1),
                "pitched_bytes": self.bytes_issued - flat, "pitched_ms": e1.elapsed_time(e2)}

    def scatter(self) -> None:
        """Receiver: staged values into its non-contiguous tensors, on the current stream."""
        if self.targets is not None and self.targets.needs_scatter:
            self.targets.scatter()
