"""Many-to-many transport of a resharding refit over the group's NCCL or gloo send/recv.

One rank's part of a ``ReshardPlan``: its messages by round (``ReshardPlan.rounds``), each
either a packed bucket (staged in one of two alternating buffers) or one direct piece (sent
from / received into the tensor's own memory when it is contiguous there). Rounds are issued
in the same order on both ends of every pair, so send/recv always match:

* sender, round k: pack round k's buckets into buffer ``k % 2`` once round k-2's sends (same
  buffer) finished, then post the sends (one NCCL group per round on GPU);
* receiver, round k: post the receives once round k-2 was unpacked (same buffer), then unpack
  round k-1 while round k moves.

Staging memory per rank is the two buffers: at most ``2 * (bucket_bytes + 16 * peers)``
(``reshard.py``; 16: each message's alignment).
Every wait is bounded by the group's timeout and polls the peers' error reports.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

from nemo_dataplane.distributed.stateless_group import StatelessProcessGroup, Work
from nemo_dataplane.refit.copies import copy_all
from nemo_dataplane.refit.protocol import dtype_from_name
from nemo_dataplane.refit.reshard.layout import LocalTensor
from nemo_dataplane.refit.reshard.plan import Message

__all__ = ["Exchange"]

# Per round, from Exchange._view_plan(): the packed messages as (peer, wire: the message's bytes
# of the round's buffer, its slot views, the tensor views they pack), and the direct ones as
# (peer, tensor view).
_Packed = tuple[int, torch.Tensor, list[torch.Tensor], list[torch.Tensor]]
_RoundViews = tuple[list[_Packed], list[tuple[int, torch.Tensor]]]

# Messages of one round sit back to back in its buffer, each starting at a multiple of this (the
# largest itemsize), so every slot can be viewed as its dtype; the wire carries no padding.
_SLOT_ALIGN = 16


def _slices(region: Sequence[tuple[int, int]]) -> tuple[slice, ...]:
    return tuple(slice(lo, hi) for lo, hi in region)


@dataclass
class _Round:
    packed: list[tuple[Message, int]]  # (message, byte offset in this round's buffer)
    direct: list[Message]
    nbytes: int  # staging bytes this round needs


class Exchange:
    """Sends (``sender=True``) or receives this rank's messages of a plan, round by round.

    ``locals_``: this rank's local tensors under its layout (names, shapes, dtypes); the
    tensors given to ``run`` must match them. ``bytes_moved``: bytes this rank put on (sender)
    or took off (receiver) the wire in the last ``run``, counted at each send/recv.
    """

    def __init__(
        self,
        group: StatelessProcessGroup,
        rounds: list[list[Message]],
        sender: bool,
        locals_: Mapping[str, LocalTensor],
        device: torch.device,
    ) -> None:
        self.group = group
        self.sender = sender
        self.device = device
        self.cuda = device.type == "cuda"
        self.locals = dict(locals_)
        self.rounds: list[_Round] = []
        sizes = [0, 0]
        for k, msgs in enumerate(rounds):
            packed, direct, off = [], [], 0
            for m in msgs:
                if m.direct:
                    direct.append(m)
                else:
                    off = -(-off // _SLOT_ALIGN) * _SLOT_ALIGN  # slots stay aligned for their dtypes
                    packed.append((m, off))
                    off += m.nbytes
            self.rounds.append(_Round(packed, direct, off))
            sizes[k & 1] = max(sizes[k & 1], off)
        self.buffer_sizes = sizes
        self.peers = sorted({(m.dst if sender else m.src) for msgs in rounds for m in msgs})
        self._bufs: list[torch.Tensor] | None = None
        self._views_key: list[tuple[int, tuple[int, ...]]] | None = None
        self._views: list[_RoundViews] | None = None
        self._streams: tuple[torch.cuda.Stream, torch.cuda.Stream] | None = None
        self.bytes_moved = 0

    @property
    def staging_bytes(self) -> int:
        """Peak staging memory of one run (the two buffers)."""
        return sum(self.buffer_sizes)

    def release_buffers(self) -> None:
        self._bufs = None
        self._views = None
        self._views_key = None

    # -- views

    def _buffers(self) -> list[torch.Tensor]:
        if self._bufs is None:
            self._bufs = [torch.empty(max(n, 1), dtype=torch.uint8, device=self.device) for n in self.buffer_sizes]
            self._views = None
        return self._bufs

    def _view_plan(self, tensors: Mapping[str, torch.Tensor]) -> list[_RoundViews]:
        """Per round: (packed [(wire, [slot views], [tensor views])], direct [(peer, tensor view)]).
        Rebuilt only when a tensor moved (new storage or strides)."""
        key = [(t.data_ptr(), t.stride()) for t in tensors.values()]
        bufs = self._buffers()
        if self._views is not None and key == self._views_key:
            return self._views
        out: list[_RoundViews] = []
        for k, rnd in enumerate(self.rounds):
            buf = bufs[k & 1]
            packed: list[_Packed] = []
            for m, base in rnd.packed:
                slots: list[torch.Tensor] = []
                views: list[torch.Tensor] = []
                for e in m.entries:
                    t = tensors[e.src_local if self.sender else e.dst_local]
                    region = e.src_region if self.sender else e.dst_region
                    v = t[_slices(region)]
                    a = base + e.offset
                    slots.append(buf[a : a + e.nbytes].view(dtype_from_name(e.dtype)).view(v.shape))
                    views.append(v)
                packed.append(((m.dst if self.sender else m.src), buf[base : base + m.nbytes], slots, views))
            direct: list[tuple[int, torch.Tensor]] = []
            for m in rnd.direct:
                e = m.entries[0]
                t = tensors[e.src_local if self.sender else e.dst_local]
                direct.append(
                    ((m.dst if self.sender else m.src), t[_slices(e.src_region if self.sender else e.dst_region)])
                )
            out.append((packed, direct))
        self._views, self._views_key = out, key
        return out

    def _side_streams(self) -> tuple[torch.cuda.Stream, torch.cuda.Stream]:
        if self._streams is None:
            self._streams = (torch.cuda.Stream(self.device), torch.cuda.Stream(self.device))  # type: ignore[no-untyped-call]  # torch.cuda: unannotated
        return self._streams

    # -- running

    def run(self, tensors: Mapping[str, torch.Tensor], watch: Callable[[], str | None], what: str) -> None:
        """Move this rank's part of one refit; returns once its bytes left / landed (bounded)."""
        self.bytes_moved = 0
        views = self._view_plan(tensors)
        if self.cuda:
            (self._send_cuda if self.sender else self._recv_cuda)(views, watch, what)
        else:
            (self._send_cpu if self.sender else self._recv_cpu)(views, watch)

    def _count(self, t: torch.Tensor) -> None:
        self.bytes_moved += t.numel() * t.element_size()

    def _send_cpu(self, views: list[_RoundViews], watch: Callable[[], str | None]) -> None:
        g = self.group
        works: dict[int, list[Work]] = {}
        keep: list[torch.Tensor] = []  # contiguous copies of strided direct sources, alive until sent
        for k, (packed, direct) in enumerate(views):
            for w in works.pop(k - 2, []):
                w.wait(watch=watch)
            ws: list[Work] = []
            for peer, wire, slots, src in packed:
                copy_all(slots, src)
                ws.append(g.send(wire, peer, async_op=True))
                self._count(wire)
            for peer, v in direct:
                wire = v if v.is_contiguous() else v.contiguous()
                keep.append(wire)
                ws.append(g.send(wire, peer, async_op=True))
                self._count(wire)
            works[k] = ws
        for ws in works.values():
            for w in ws:
                w.wait(watch=watch)

    def _recv_cpu(self, views: list[_RoundViews], watch: Callable[[], str | None]) -> None:
        g = self.group
        # round -> (works, packed messages to unpack, (temporary, destination) pairs)
        pending: dict[int, tuple[list[Work], list[_Packed], list[tuple[torch.Tensor, torch.Tensor]]]] = {}

        def finish(j: int) -> None:
            ws, packed, temps = pending.pop(j)
            for w in ws:
                w.wait(watch=watch)
            for _, _, slots, dsts in packed:
                copy_all(dsts, slots)
            for tmp, dst in temps:
                dst.copy_(tmp)

        for k, (packed, direct) in enumerate(views):
            ws: list[Work] = []
            temps: list[tuple[torch.Tensor, torch.Tensor]] = []
            for peer, wire, _, _ in packed:
                ws.append(g.recv(wire, peer, async_op=True))
                self._count(wire)
            for peer, v in direct:
                tmp = v if v.is_contiguous() else torch.empty(v.shape, dtype=v.dtype)
                if tmp is not v:
                    temps.append((tmp, v))
                ws.append(g.recv(tmp, peer, async_op=True))
                self._count(tmp)
            pending[k] = (ws, packed, temps)
            if k >= 1:
                finish(k - 1)  # its buffer is the one round k+1 receives into
        for j in sorted(pending):
            finish(j)

    def _send_cuda(self, views: list[_RoundViews], watch: Callable[[], str | None], what: str) -> None:
        g = self.group
        cur = torch.cuda.current_stream(self.device)
        comm, pack = self._side_streams()
        # Read the weights only after whatever wrote them on the current stream.
        comm.wait_stream(cur)
        pack.wait_stream(cur)
        free: list[torch.cuda.Event | None] = [None, None]  # per buffer: its last sends done
        keep: list[torch.Tensor] = []
        for k, (packed, direct) in enumerate(views):
            slot = k & 1
            if packed:
                with torch.cuda.stream(pack):
                    last = free[slot]
                    if last is not None:
                        pack.wait_event(last)
                    copy_all(
                        [s for _, _, slots, _ in packed for s in slots], [v for _, _, _, src in packed for v in src]
                    )
                    ready = torch.cuda.Event()  # type: ignore[no-untyped-call]  # torch.cuda: unannotated
                    ready.record(pack)
                comm.wait_event(ready)
            with torch.cuda.stream(comm):
                wires = [(peer, v if v.is_contiguous() else v.contiguous()) for peer, v in direct]
                keep += [w for _, w in wires]
                with g.coalesce():
                    for peer, wire, _, _ in packed:
                        g.send(wire, peer, stream=comm)
                        self._count(wire)
                    for peer, wire in wires:
                        g.send(wire, peer, stream=comm)
                        self._count(wire)
            done = torch.cuda.Event()  # type: ignore[no-untyped-call]  # torch.cuda: unannotated
            done.record(comm)
            free[slot] = done
        # Later writes to the weights (optimizer step) wait for the sends reading them.
        cur.wait_stream(comm)
        cur.wait_stream(pack)
        g.synchronize(comm, watch=watch, what=what)

    def _recv_cuda(self, views: list[_RoundViews], watch: Callable[[], str | None], what: str) -> None:
        g = self.group
        cur = torch.cuda.current_stream(self.device)
        comm, unpack = self._side_streams()
        # The tensors may still be read by work on the current stream (e.g. generation).
        comm.wait_stream(cur)
        unpack.wait_stream(cur)
        free: list[torch.cuda.Event | None] = [None, None]  # per buffer: its last unpack done
        for k, (packed, direct) in enumerate(views):
            slot = k & 1
            last = free[slot]
            if last is not None:
                comm.wait_event(last)
            temps: list[tuple[torch.Tensor, torch.Tensor]] = []
            with torch.cuda.stream(comm):
                with g.coalesce():
                    for peer, wire, _, _ in packed:
                        g.recv(wire, peer, stream=comm)
                        self._count(wire)
                    for peer, v in direct:
                        tmp = v if v.is_contiguous() else torch.empty(v.shape, dtype=v.dtype, device=self.device)
                        if tmp is not v:
                            tmp.record_stream(unpack)  # read there after comm is done with it
                            temps.append((tmp, v))
                        g.recv(tmp, peer, stream=comm)
                        self._count(tmp)
            got = torch.cuda.Event()  # type: ignore[no-untyped-call]  # torch.cuda: unannotated
            got.record(comm)
            with torch.cuda.stream(unpack):
                unpack.wait_event(got)
                copy_all(
                    [v for _, _, _, dst in packed for v in dst] + [v for _, v in temps],
                    [s for _, _, slots, _ in packed for s in slots] + [t for t, _ in temps],
                )
                done = torch.cuda.Event()  # type: ignore[no-untyped-call]  # torch.cuda: unannotated
                done.record(unpack)
            free[slot] = done
        unpack.wait_stream(comm)
        g.synchronize(unpack, watch=watch, what=what)
        cur.wait_stream(unpack)
