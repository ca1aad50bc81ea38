"""Broadcast / p2p transport of the packed refit over the group's NCCL or gloo communicator.

Small tensors travel packed back to back in buckets (two buffers alternate, so packing bucket
k+1 on the sender and unpacking bucket k-1 on the receiver overlap with moving bucket k); large
ones go on their own, straight from/into the tensor when it is contiguous (docs/refit.md,
section 3). Peak extra memory per rank: two buckets (allocated on first use, kept until
``release_buffers()``), plus one temporary copy of a non-contiguous direct tensor.
"""

from __future__ import annotations

import contextlib

import torch

from nemo_dataplane.distributed.stateless_group import Work
from nemo_dataplane.refit.copies import copy_all
from nemo_dataplane.refit.packed.base import PackedEndpoint
from nemo_dataplane.refit.packed.plan import Bucket
from nemo_dataplane.refit.protocol import MAGIC, STATUS_OK, RefitError

__all__ = ["CollectiveEndpoint", "CollectiveReceiver", "CollectiveSender"]


class CollectiveEndpoint(PackedEndpoint):
    """Bucket buffers and the per-transfer operation (broadcast, or p2p send/recv)."""

    def _bucket_views(self) -> list[list[torch.Tensor]]:
        """Per bucket, typed views of its slot in the two reusable buffers (built once)."""
        if self._views is None:
            buckets = [b for b in self.plan if isinstance(b, Bucket)]
            views: list[list[torch.Tensor]] = []
            self._wire = []
            if buckets:
                info = self.info
                assert info is not None  # the plan was built from it
                size = max(b.nbytes for b in buckets)
                bufs = [
                    torch.empty(size, dtype=torch.uint8, device=self.group.device) for _ in range(min(2, len(buckets)))
                ]
                for k, b in enumerate(buckets):
                    buf = bufs[k & 1]
                    views.append(
                        [
                            buf[off : off + info.tensors[i].nbytes].view(self._dtypes[i]).view(self._shapes[i])
                            for i, off in b.entries
                        ]
                    )
                    self._wire.append(buf[: b.nbytes])
                self._bufs = bufs
            self._views = views
        return self._views

    def _xfer(self, t: torch.Tensor, stream: torch.cuda.Stream | None = None, async_op: bool = False) -> list[Work]:
        """Move ``t`` from ``src`` to every receiver (sender: reads it; receiver: writes it).

        Returns the gloo work handles (``async_op``); NCCL ops are enqueued on ``stream``.
        """
        g = self.group
        info = self.info
        assert info is not None
        if info.transport != "p2p":
            w = g.broadcast(t, info.src, stream=stream, async_op=async_op)
            return [w] if w is not None else []
        if g.rank != info.src:
            w = g.recv(t, info.src, stream=stream, async_op=async_op)
            return [w] if w is not None else []
        peers = self._peers()
        if self._cuda and len(peers) > 1 and not g._in_coalesce:
            with g.coalesce():
                for r in peers:
                    g.send(t, r, stream=stream)
            return []
        works = [g.send(t, r, stream=stream, async_op=async_op) for r in peers]
        return [w for w in works if w is not None]

    def _connect_p2p(self) -> None:
        """p2p transport: a small send/recv so NCCL sets up the connections now, not mid-refit."""
        info = self.info
        assert info is not None
        if info.transport != "p2p":
            return
        g = self.group
        t = torch.full((4,), 7 + info.src, dtype=torch.int32, device=g.device)
        if g.rank != info.src:
            t.fill_(-1)
        stream = torch.cuda.current_stream(g.device) if self._cuda else None
        for w in self._xfer(t, stream=stream, async_op=not self._cuda):
            w.wait()
        g.synchronize()
        if g.rank != info.src and t.tolist() != [7 + info.src] * 4:
            raise RefitError(f"rank {g.rank}: p2p connection check from sender rank {info.src} returned {t.tolist()}")


class CollectiveSender(CollectiveEndpoint):
    """Sender half: the header, then buckets and direct tensors, on CPU (gloo) or GPU (NCCL)."""

    src: int

    def _header(self, version: int, status: int) -> torch.Tensor:
        assert self.info is not None
        return torch.tensor([MAGIC, self._fp, version, status], dtype=torch.int64, device=self.group.device)

    def _broadcast_header(self, version: int, status: int) -> None:
        g = self.group
        with contextlib.suppress(Exception):
            g.broadcast(self._header(version, status), self.src)
            g.synchronize()

    def _send_cpu(self, tensors: list[torch.Tensor], version: int) -> None:
        g = self.group
        views = self._bucket_views()
        works = [g.broadcast(self._header(version, STATUS_OK), self.src, async_op=True)]
        in_flight: list[list[Work]] = [[], []]  # per buffer: the transfers still reading it
        keep: list[torch.Tensor] = []  # contiguous copies of direct tensors, alive until sent
        k = 0
        for item in self.plan:
            if isinstance(item, Bucket):
                slot = k & 1
                for w in in_flight[slot]:
                    w.wait(watch=self._watch)
                copy_all(views[k], [tensors[i] for i in self._bucket_idx[k]])
                in_flight[slot] = self._xfer(self._wire[k], async_op=True)
                k += 1
            else:
                t = tensors[item.index]
                wire = t if t.is_contiguous() else t.contiguous()
                keep.append(wire)
                works += self._xfer(wire, async_op=True)
        for w in [*works, *in_flight[0], *in_flight[1]]:
            w.wait(watch=self._watch)

    def _send_cuda(self, tensors: list[torch.Tensor], version: int) -> None:
        g = self.group
        cur = torch.cuda.current_stream(g.device)
        comm, pack = self._side_streams()
        # Both side streams start after whatever produced the weights on the current stream.
        comm.wait_stream(cur)
        pack.wait_stream(cur)
        g.broadcast(self._header_on(comm, version, STATUS_OK), self.src, stream=comm)
        views = self._bucket_views()
        free: list[torch.cuda.Event | None] = [None, None]  # per buffer: its last broadcast done
        k = 0
        for item in self._launches:
            if isinstance(item, Bucket):
                slot = k & 1
                with torch.cuda.stream(pack):
                    last = free[slot]
                    if last is not None:
                        pack.wait_event(last)
                    copy_all(views[k], [tensors[i] for i in self._bucket_idx[k]])
                    packed = torch.cuda.Event()  # type: ignore[no-untyped-call]  # torch.cuda: unannotated
                    packed.record(pack)
                comm.wait_event(packed)
                self._xfer(self._wire[k], stream=comm)
                done = torch.cuda.Event()  # type: ignore[no-untyped-call]  # torch.cuda: unannotated
                done.record(comm)
                free[slot] = done
                k += 1
                continue
            keep = []  # contiguous copies must outlive the group launch
            with torch.cuda.stream(comm), g.coalesce():
                for i in item:
                    t = tensors[i]
                    wire = t if t.is_contiguous() else t.contiguous()
                    keep.append(wire)
                    self._xfer(wire, stream=comm)
            del keep
        # Later writes to the weights (optimizer step) must wait for the broadcasts reading them.
        cur.wait_stream(comm)
        cur.wait_stream(pack)
        g.synchronize(comm, watch=self._watch, what=f"refit send of version {version}")


class CollectiveReceiver(CollectiveEndpoint):
    """Receiver half: the header, then buckets (unpacked) and direct tensors (in place)."""

    src: int

    def _recv_cpu(self, tensors: list[torch.Tensor]) -> int:
        g = self.group
        header = torch.zeros(4, dtype=torch.int64)
        g.broadcast(header, self.src, async_op=True).wait(watch=self._watch)
        version = self._check_header(header)
        views = self._bucket_views()
        pending: tuple[Work, int] | None = None  # (work, bucket number) received but not yet unpacked
        directs: list[tuple[Work, torch.Tensor | None, torch.Tensor]] = []  # (work, tmp or None, destination)
        k = 0

        def unpack(p: tuple[Work, int]) -> None:
            work, j = p
            work.wait(watch=self._watch)
            copy_all([tensors[i] for i in self._bucket_idx[j]], views[j])

        for item in self.plan:
            if isinstance(item, Bucket):
                # Bucket k reuses the buffer of bucket k-2, which was unpacked one step ago.
                (work,) = self._xfer(self._wire[k], async_op=True)
                if pending is not None:
                    unpack(pending)
                pending = (work, k)
                k += 1
            else:
                t = tensors[item.index]
                tmp = None if t.is_contiguous() else torch.empty(t.shape, dtype=t.dtype)
                (work,) = self._xfer(t if tmp is None else tmp, async_op=True)
                directs.append((work, tmp, t))
        if pending is not None:
            unpack(pending)
        for work, tmp, t in directs:
            work.wait(watch=self._watch)
            if tmp is not None:
                t.copy_(tmp)
        return version

    def _recv_cuda(self, tensors: list[torch.Tensor]) -> int:
        g = self.group
        cur = torch.cuda.current_stream(g.device)
        comm, unpack = self._side_streams()
        # The tensors may still be read by work on the current stream (e.g. generation).
        comm.wait_stream(cur)
        unpack.wait_stream(cur)
        header = self._header_on(comm, fill=False)
        g.broadcast(header, self.src, stream=comm)
        # One host sync here lets a sender abort (or a layout mismatch) stop us before any bulk.
        g.synchronize(comm, watch=self._watch, what=f"waiting for the refit header from sender rank {self.src}")
        version = self._check_header(header)
        views = self._bucket_views()
        free: list[torch.cuda.Event | None] = [None, None]  # per buffer: unpack of its last bucket done
        k = 0
        for item in self._launches:
            if isinstance(item, Bucket):
                slot = k & 1
                last = free[slot]
                if last is not None:
                    comm.wait_event(last)
                self._xfer(self._wire[k], stream=comm)
                got = torch.cuda.Event()  # type: ignore[no-untyped-call]  # torch.cuda: unannotated
                got.record(comm)
                with torch.cuda.stream(unpack):
                    unpack.wait_event(got)
                    copy_all([tensors[i] for i in self._bucket_idx[k]], views[k])
                    done = torch.cuda.Event()  # type: ignore[no-untyped-call]  # torch.cuda: unannotated
                    done.record(unpack)
                free[slot] = done
                k += 1
                continue
            copies = []  # non-contiguous destinations receive into a temporary first
            with torch.cuda.stream(comm), g.coalesce():
                for i in item:
                    t = tensors[i]
                    if t.is_contiguous():
                        self._xfer(t, stream=comm)
                    else:
                        tmp = torch.empty(t.shape, dtype=t.dtype, device=g.device)
                        self._xfer(tmp, stream=comm)
                        copies.append((tmp, t))
            with torch.cuda.stream(comm):
                for tmp, t in copies:
                    t.copy_(tmp)
        unpack.wait_stream(comm)
        g.synchronize(unpack, watch=self._watch, what=f"refit receive of version {version}")
        cur.wait_stream(unpack)
        return version
