"""Same-host transport of a resharding refit: CUDA IPC push with copy-engine copies.

Every receiver exports its local tensors once (``cuda.ipc.PushTargets``: a non-contiguous one
as a slot of a staging buffer, copied into it after each refit). Every sender opens the exports
of the receivers it has pieces for and, at each refit, writes each piece straight from its own
tensor into the receiver's memory: the pieces contiguous on both sides (row blocks, whole
shards) as batched copy-engine copies (``cuda.copy_engine.PeerCopier``) on a copy stream of
its GPU, the others (column blocks of row-parallel weights) as torch strided copy kernels on a
second stream, so both run at once, and no bulk data touches the group. Pieces are the plan's
entries (``plan.py``); messages and buckets do not matter here.

A receiver on **another GPU** is mapped into the sender's own GPU context
(``cuda.ipc.PeerMapping``), where its kernels can write it. Torch's own open maps it into the
receiver GPU's context instead, where a strided kernel of the sender's GPU faults (illegal
address) while copy-engine copies work; so where the mapping is refused (no cuda-bindings, a
handle kind it does not know) or ``map_peers`` is off (``WeightTransferConfig.ipc_map_peers``),
torch opens them and the column blocks go as 2D copy-engine copies instead (``pitched.py``: one
batched call, on the second stream). Copy-engine copies across GPUs need peer access
(``cuda.ipc.probe`` has torch turn it on; the mapping's lazy flag does too): without it they
run several times slower.

The group carries only host-side control (works on gloo, so several processes may share a
GPU, which an NCCL communicator refuses): each refit is the header max exchange (receivers
join it once their queued GPU work is done, so nothing they still read is overwritten), the
senders' copies, then the done signal (``ipc_control.py``). With ``done="event"`` (default)
each sender records an interprocess CUDA event after its copies (``signal_blob()``: made and
shared once at prepare) and posts one small status per refit to the store right after
enqueueing them; each receiver's stream waits on its senders' events on the GPU
(``wait_signals()``), so no host waits for the copies on the receiver's critical path.
``done="host"``: a ``done`` max exchange once every sender's copies finished.
"""

from __future__ import annotations

import base64
import contextlib
import json
from collections.abc import Mapping, Sequence

import torch

from nemo_dataplane.refit.copies import copy_all
from nemo_dataplane.refit.cuda import ipc as _ipc
from nemo_dataplane.refit.cuda.copy_engine import Run, _cudart
from nemo_dataplane.refit.reshard.layout import LocalTensor
from nemo_dataplane.refit.reshard.pitched import Copy, PitchedCopier, pitched_copies
from nemo_dataplane.refit.reshard.plan import ReshardPlan

__all__ = ["ORDERS", "PITCHED", "IpcPush", "pitched_copies"]

# Values of ``IpcPush.order`` and ``IpcPush.pitched`` (see ``issue()``).
ORDERS = ("batched_first", "strided_first")
PITCHED = ("kernel", "memcpy2d")


def _index(dev: torch.device) -> int:
    return dev.index if dev.index is not None else torch.cuda.current_device()


def _widened(dst: torch.Tensor, src: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(dst, src) viewed as the widest integer type both allow (same bits), so a strided copy
    kernel moves 8 bytes per element instead of 2."""
    for wide in (torch.int64, torch.int32):
        if wide.itemsize <= dst.element_size():
            break
        try:
            return dst.view(wide), src.view(wide)
        except RuntimeError:
            continue
    return dst, src


class IpcPush:
    """One rank's part of the IPC push: a receiver's exported targets, or a sender's opened
    views of its receivers and its copies (planned once per placement of its tensors)."""

    def __init__(
        self,
        plan: ReshardPlan,
        rank: int,
        sender: bool,
        locals_: Mapping[str, LocalTensor],
        device: torch.device,
        *,
        map_peers: bool = True,
    ) -> None:
        self.plan = plan
        self.rank = rank
        self.sender = sender
        self.device = device
        self.names = list(locals_)
        self.targets: _ipc.PushTargets | None = None
        self.views: dict[int, dict[str, torch.Tensor]] = {}
        self.peers = sorted({(d if sender else s) for s, d in plan.pairs if (s if sender else d) == rank})
        self._stream: torch.cuda.Stream | None = None
        self._key: list[tuple[int, tuple[int, ...]] | str] | None = None  # see _plan()
        self._copies: list[Copy] = []
        self._slow: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._runs: list[Run] = []
        self._copier = _ipc.PeerCopier()
        # How non-contiguous pieces are copied (see issue()); use_views() picks it by placement.
        self.pitched = "kernel"
        # Whether a peer (receiver's view or sender's event) lives on another GPU than ours.
        self.cross_gpu = False
        # Which kind of copies the host enqueues first (see issue()); benchmarks time the other.
        self.order = "batched_first"
        # The done signal (done="event", see signal_blob()): the sender's interprocess event,
        # recorded after its copies; a receiver's opened events of its senders.
        self.done_event: torch.cuda.Event | None = None
        self.sender_events: dict[int, torch.cuda.Event] = {}
        self._bridges: dict[int, torch.cuda.Stream] = {}  # wait_signals(): sender on another GPU -> a stream there
        self._stream2: torch.cuda.Stream | None = None
        self._sources: list[torch.Tensor] = []
        self._gather: tuple[list[torch.Tensor], list[torch.Tensor]] = ([], [])
        self._rt = _cudart()
        self.raw = self._rt is not None
        self._copier2d = PitchedCopier(self._rt)
        # Receivers on another GPU: mapped into our GPU's context (open()) unless map_peers is off.
        self._map_peers = map_peers
        self._mapping: _ipc.PeerMapping | None = None
        self.map_error: str | None = None
        self.mapped = False  # whether a receiver's tensors were mapped into our GPU's context
        self.foreign = False  # whether some views are torch's, on another GPU (no kernels there)
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
        """Sender: open every peer receiver's exported tensors (``peer_names``: their order); those
        of a receiver on another GPU in our GPU's context (``ipc.PeerMapping``) unless that is
        refused or ``map_peers`` is off (then torch opens them on their GPU)."""
        here = _index(self.device)
        remote = False
        for r, blob in blobs.items():
            try:
                on = _ipc.exporter_device(blob)
                remote = remote or on != here
                views = self._open_here(blob) if on != here else None
                if views is None:
                    views = _ipc.open_tensors(blob)
            except Exception as e:
                raise RuntimeError(f"rank {r}: {e}") from e
            _ipc.probe(views, self.device)
            self.views[r] = {n: v for n, v in zip(peer_names[r], views) if v is not None}
        self.use_views(self.views, cross_gpu=remote)

    def _open_here(self, blob: bytes) -> list[torch.Tensor | None] | None:
        """A receiver's tensors mapped into our GPU's context, or None (``map_error`` says why)."""
        if not self._map_peers:
            self.map_error = "ipc_map_peers=False"
            return None
        try:
            if self._mapping is None:
                self._mapping = _ipc.PeerMapping(self.device)
            views = _ipc.open_tensors(blob, self._mapping)
            self.mapped = True
            return views
        except Exception as e:  # e.g. no cuda-bindings: torch's open, with 2D copies (module doc)
            self.map_error = f"{type(e).__name__}: {e}"
            return None

    def use_views(self, views: Mapping[int, Mapping[str, torch.Tensor]], cross_gpu: bool | None = None) -> None:
        """Sender: write into these receiver views (rank -> local name -> tensor), e.g. ones another
        ``IpcPush`` of this process opened (a process maps an IPC handle once). ``cross_gpu``:
        whether a receiver is on another GPU (default: whether a view is)."""
        self.views = {r: dict(v) for r, v in views.items()}
        here = _index(self.device)
        # Views torch opened on another GPU's context: its kernels cannot write them (module doc).
        foreign = any(_index(t.device) != here for v in self.views.values() for t in v.values())
        if foreign and not self.raw:
            raise RuntimeError(
                "a receiver on another GPU could not be mapped into this GPU's context "
                f"({self.map_error}) and, without cuda-bindings, its column blocks would "
                "need torch kernels, which fault there: install cuda-bindings "
                "(nemo-dataplane[gpu]) or use transport='p2p'"
            )
        self.foreign = foreign
        self.cross_gpu = foreign if cross_gpu is None else cross_gpu
        self.pitched = "memcpy2d" if foreign else "kernel"
        self._key = None
        self._stream = torch.cuda.Stream(self.device)  # type: ignore[no-untyped-call]  # torch.cuda: unannotated
        self._stream2 = torch.cuda.Stream(self.device)  # type: ignore[no-untyped-call]  # torch.cuda: unannotated

    def signal_blob(self) -> bytes:
        """Sender: make the interprocess CUDA event that ``issue()`` records after every copy
        and export its handle (JSON: its GPU and the handle) for the receivers to open once."""
        with torch.cuda.device(self.device):
            self.done_event = torch.cuda.Event(interprocess=True)  # type: ignore[no-untyped-call]  # torch.cuda: unannotated
            handle = bytes(self.done_event.ipc_handle())  # type: ignore[no-untyped-call]  # torch.cuda: unannotated
        return json.dumps(
            {
                "uuid": _ipc._uuid(self.device.index),
                "device": self.device.index,
                "handle": base64.b64encode(handle).decode(),
            }
        ).encode()

    def open_signals(self, blobs: Mapping[int, bytes]) -> None:
        """Receiver: open every sender's done event (``blobs``: sender rank -> ``signal_blob()``)."""
        events = {}
        for r, blob in blobs.items():
            d = json.loads(blob)
            if "error" in d:
                raise RuntimeError(f"rank {r} could not export its done event: {d['error']}")
            dev = torch.device("cuda", _ipc.local_index_of(str(d.get("uuid", "")), int(d["device"])))
            events[r] = torch.cuda.Event.from_ipc_handle(dev, base64.b64decode(d["handle"]))  # type: ignore[no-untyped-call]  # torch.cuda: unannotated
            if dev.index != _index(self.device):
                self._bridges[r] = torch.cuda.Stream(dev)  # type: ignore[no-untyped-call]  # torch.cuda: unannotated
        self.sender_events = events
        self.cross_gpu = bool(self._bridges)

    def wait_signals(self, stream: torch.cuda.Stream) -> None:
        """Receiver: order ``stream`` after each sender's last recorded done event (GPU-side
        ``cudaStreamWaitEvent``; the host does not wait). Call only once every sender said it
        recorded this refit's: a wait sees the record made before it was enqueued.

        An IPC event is waited on only by a stream of the GPU it was made on (where it was
        opened): for a sender on another GPU a stream there waits on it and records a plain
        event, which ``stream`` waits on (cross-GPU waits on plain events are supported;
        tests/unit/test_sharded_gpu.py checks the ordering after late copies)."""
        for r, ev in self.sender_events.items():
            side = self._bridges.get(r)
            if side is None:
                stream.wait_event(ev)
                continue
            side.wait_event(ev)
            plain = torch.cuda.Event()  # type: ignore[no-untyped-call]  # torch.cuda: unannotated
            plain.record(side)
            stream.wait_event(plain)

    def close(self) -> None:
        had = bool(self.views) or self.targets is not None
        self.views, self.targets, self._sources, self._copies, self._slow = {}, None, [], [], []
        self.done_event, self.sender_events, self._bridges = None, {}, {}
        self._runs = []
        self._gather = ([], [])
        self._key = None
        if self._mapping is not None:  # after the views that use it are dropped
            with contextlib.suppress(Exception):
                torch.cuda.synchronize(self.device)  # no copy may still write through it
            self._mapping.close()
            self._mapping = None
        if had:
            with contextlib.suppress(Exception):
                torch.cuda.ipc_collect()  # type: ignore[no-untyped-call]  # torch.cuda: unannotated

    # -- each refit

    def moved(self, tensors: Mapping[str, torch.Tensor]) -> list[str]:
        """Receiver: names of tensors no longer where they were exported."""
        assert self.targets is not None
        return [self.names[i] for i in self.targets.moved([tensors[n] for n in self.names])]

    @property
    def bytes_issued(self) -> int:
        """Sender: bytes its copies write per refit."""
        issued: int = (
            sum(w * h for _, _, _, _, w, h in self._copies)
            + sum(r[2] for r in self._runs)
            + sum(d.numel() * d.element_size() for d, _ in self._slow)
        )
        return issued

    def _plan(self, tensors: Mapping[str, torch.Tensor]) -> None:
        key = [(t.data_ptr(), t.stride()) for t in tensors.values()] + [self.pitched]
        if key == self._key:
            return
        copies: list[Copy] = []
        slow: list[tuple[torch.Tensor, torch.Tensor]] = []
        flat: list[tuple[torch.Tensor, torch.Tensor]] = []
        gather: tuple[list[torch.Tensor], list[torch.Tensor]] = ([], [])
        for r in self.peers:
            dst_views = self.views[r]
            for m in self.plan.messages(self.rank, r):
                for e in m.entries:
                    src = tensors[e.src_local][tuple(slice(a, b) for a, b in e.src_region)]
                    dst = dst_views[e.dst_local][tuple(slice(a, b) for a, b in e.dst_region)]
                    if dst.is_contiguous() and src.is_contiguous():
                        flat.append((dst, src))  # batched copy-engine copies in every mode
                        continue
                    if self.pitched == "kernel" or not self.raw:
                        slow.append(_widened(dst, src))
                        continue
                    ops = pitched_copies(dst, src)
                    if ops is None:
                        # A source strided in its innermost dim: gathered into a contiguous
                        # scratch on our GPU first (allocated on the second stream, which uses it).
                        with torch.cuda.stream(self._stream2):
                            tmp = torch.empty(src.shape, dtype=src.dtype, device=self.device)
                        gather[0].append(tmp)
                        gather[1].append(src)
                        ops = pitched_copies(dst, tmp)
                    if ops is None:
                        slow.append((dst, src))
                    else:
                        copies += ops
        runs, rest = self._copier.plan([d for d, _ in flat], [x for _, x in flat])
        self._key, self._copies, self._slow, self._gather = key, copies, rest + slow, gather
        self._runs = runs
        self._sources = list(tensors.values())  # what the copies read stays alive

    def issue(self, tensors: Mapping[str, torch.Tensor]) -> torch.cuda.Event:
        """Sender: enqueue every copy (after the current stream); returns an event recorded
        after them, records ``done_event`` (if made) after them, and orders the current stream
        after them (later writes to the weights wait for the copies reading them).

        The contiguous pieces go out as batched copy-engine copies on the copy stream; the
        others (column blocks of row-parallel weights) on a second stream, so both kinds run at
        once: ``pitched="kernel"`` (the default) as torch strided copy kernels, ``"memcpy2d"``
        (the default where torch opened a receiver on another GPU, whose views take no kernel
        writes) as 2D copy-engine copies (``pitched.PitchedCopier``). ``order``: which of the two kinds
        the host enqueues first
        (the GPU starts on them while the host enqueues the others)."""
        assert self._stream is not None and self._stream2 is not None
        self._plan(tensors)
        cur = torch.cuda.current_stream(self.device)
        s, s2 = self._stream, self._stream2
        s.wait_stream(cur)  # read the weights after whatever wrote them
        marks: list[torch.cuda.Event] = []
        if self.timing:
            marks = [torch.cuda.Event(enable_timing=True) for _ in range(4)]  # type: ignore[no-untyped-call]  # torch.cuda: unannotated
        other = bool(self._slow or self._copies)
        if other:
            s2.wait_stream(cur)
        if other and self.order == "strided_first":
            self._issue_other(tensors, s2, marks)
            self._issue_batched(s, marks)
        else:
            self._issue_batched(s, marks)
            if other:
                self._issue_other(tensors, s2, marks)
        if other:
            s.wait_stream(s2)
        elif marks:
            marks[2].record(s)
            marks[3].record(s)
        self._events = marks
        ev = torch.cuda.Event()  # type: ignore[no-untyped-call]  # torch.cuda: unannotated
        ev.record(s)
        if self.done_event is not None:
            self.done_event.record(s)
        cur.wait_stream(s)  # later writes to the weights wait for the copies reading them
        return ev

    def _issue_batched(self, s: torch.cuda.Stream, marks: list[torch.cuda.Event]) -> None:
        """The contiguous pieces as batched copy-engine copies on ``s``."""
        if marks:
            marks[0].record(s)
        if self._runs:
            self._copier.issue(self._runs, [], s, [s])
            if not self._copier.raw:  # bindings refused: copy_ from now on (re-copying is harmless)
                self.raw, self.raw_error = False, self._copier.raw_error
        if marks:
            marks[1].record(s)

    def _issue_other(
        self, tensors: Mapping[str, torch.Tensor], s2: torch.cuda.Stream, marks: list[torch.cuda.Event]
    ) -> None:
        """The non-contiguous pieces on ``s2``: 2D copies (sources strided in their innermost
        dim gathered first) and strided copy kernels."""
        if marks:
            marks[2].record(s2)
        if self._copies:
            try:
                with torch.cuda.stream(s2):
                    if self._gather[0]:
                        copy_all(*self._gather)
                with torch.cuda.device(self.device):
                    self._copier2d.issue(self._copies, s2)
            except Exception as e:  # bindings refused: torch copies from now on (re-copying is harmless)
                if self.foreign:  # torch's strided kernels would fault on these views (module doc)
                    raise RuntimeError(
                        f"2D copies into a receiver on another GPU were refused ({e}); "
                        "torch's kernels cannot write there"
                    ) from e
                self.raw, self.raw_error = False, str(e)
                self._key = None
                self._plan(tensors)
                self._copier.issue(self._runs, [], s2, [s2])
        with torch.cuda.stream(s2):
            for d, x in self._slow:
                d.copy_(x, non_blocking=True)
        if marks:
            marks[3].record(s2)

    @property
    def copies_used(self) -> str:
        """How the last refit's pieces went out (for reports)."""
        if not self.raw:
            return f"torch copy_ ({self.raw_error})"
        if self.pitched == "memcpy2d":
            how = "cudaMemcpy3DBatchAsync" if self._copier2d.mode == "batch" else "cudaMemcpy2DAsync"
            return f"contiguous: {self._copier.mode}, pitched: {how}"
        return f"contiguous: {self._copier.mode}, pitched: torch strided kernels"

    def phases(self) -> dict[str, float]:
        """After a refit with ``timing`` (and its copies done): bytes and GPU milliseconds of the
        contiguous copies (copy stream) and of the others (second stream: strided kernels or
        2D copies)."""
        if len(self._events) != 4:
            return {}
        e0, e1, e2, e3 = self._events
        flat = sum(r[2] for r in self._runs)
        return {
            "contiguous_bytes": flat,
            "contiguous_ms": e0.elapsed_time(e1),
            "pitched_bytes": self.bytes_issued - flat,
            "pitched_ms": e2.elapsed_time(e3),
        }

    def scatter(self) -> None:
        """Receiver: staged values into its non-contiguous tensors, on the current stream."""
        if self.targets is not None and self.targets.needs_scatter:
            self.targets.scatter()
