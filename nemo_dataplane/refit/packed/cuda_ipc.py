"""CUDA IPC transport of the packed refit (``transport="ipc"``, same host; docs/refit.md, section 3a).

No bulk data goes through the group: CUDA IPC handles are exchanged once, and every refit is
copy-engine peer copies between the two processes' tensors (``nemo_dataplane/refit/cuda/ipc.py``
holds the handles, the copy plan, ``PushSource`` / ``PushTargets``). ``push`` (default where
possible): the sender writes into the receivers' exported tensors, gated on the GPU by a
readiness ``all_reduce``, then sends the header and a verdict. ``pull``: receivers copy out of
the sender's exported tensors after the header, then acknowledge.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable
from dataclasses import replace

import torch

from nemo_dataplane.distributed.stateless_group import StatelessProcessGroup
from nemo_dataplane.refit.cuda import ipc as _ipc
from nemo_dataplane.refit.cuda.copy_engine import CopyPlan
from nemo_dataplane.refit.packed.base import STATUS_NEW_HANDLES, PackedEndpoint
from nemo_dataplane.refit.packed.plan import DEFAULT_TRANSPORT_GPU
from nemo_dataplane.refit.protocol import STATUS_ABORT, STATUS_OK, NamedTensors, RefitError, clip

__all__ = [
    "AUTO_IPC_MAX_RECEIVERS",
    "AUTO_PICKS_IPC",
    "IPC_COPY_ON",
    "IPC_DIRECTIONS",
    "IpcEndpoint",
    "IpcReceiver",
    "IpcSender",
]

# transport="auto" on NCCL picks "ipc" when every rank is on the sender's host and can see its
# GPU (falling back to DEFAULT_TRANSPORT_GPU if opening the handles fails anywhere), for at most
# AUTO_IPC_MAX_RECEIVERS receivers: each receiver pulls its own copy out of the sender's GPU,
# so several share the sender's NVLink bandwidth, where a broadcast forwards along a ring
# (docs/refit.md, section 5).
AUTO_PICKS_IPC = True
AUTO_IPC_MAX_RECEIVERS = 1
IPC_COPY_ON = ("src", "dst")
# "push": receivers export their tensors once and the sender writes into them with copy-engine
# copies, gated on the GPU by the receivers' readiness: no host round trip before the first
# byte moves. "pull": the sender exports its tensors and each receiver copies them out after
# the refit header reached its host. None: push where the sender sees the receivers' GPUs,
# else pull (docs/refit.md, section 3).
IPC_DIRECTIONS = ("push", "pull")


class IpcEndpoint(PackedEndpoint):
    """The handles and streams both sides of the IPC transport hold, and their agreement step."""

    def __init__(self, group: StatelessProcessGroup, named_tensors: NamedTensors, channel: str) -> None:
        super().__init__(group, named_tensors, channel)
        self._ipc_views: list[torch.Tensor | None] | None = None  # receiver: sender's memory
        self._ipc_plan_cache: tuple[list[torch.Tensor | None], _ipc.Signature, CopyPlan] | None = None
        self._ipc_keep: list[torch.Tensor] | None = None  # sender: the exported tensors
        self._ipc_sig: _ipc.Signature | None = None
        self._ipc_streams: tuple[torch.cuda.Stream, torch.cuda.Stream] | None = None
        # ipc_direction="push": the sender's view of the receivers' memory and its copy stream;
        # the receiver's exported targets.
        self._push_src: _ipc.PushSource | None = None
        self._push_tgt: _ipc.PushTargets | None = None
        self._push_stream: torch.cuda.Stream | None = None
        self._flags: torch.Tensor | None = None  # push: [ready, verdict]
        # Set ipc_timing to record CUDA events around the copies (and, pull, the ack);
        # ipc_phases then holds the last refit's host timestamps (perf_counter) and GPU times
        # (docs/refit.md, section 5).
        self.ipc_timing = False
        self.ipc_phases: dict[str, object] = {}
        self._copier: _ipc.PeerCopier | None = None
        self._ack: torch.Tensor | None = None
        # Why transport="auto" did not end up on "ipc" (None: it did, or it was not asked for).
        self.ipc_fallback_reason: str | None = None

    def close(self) -> None:
        """Free buffers and drop CUDA IPC handles (sender: exported, receiver: opened). Idempotent.

        Call before destroying the group; a later ``prepare_refit_info()`` sets up again.
        """
        super().close()
        self._drop_ipc()

    def _drop_ipc(self) -> None:
        had = (
            self._ipc_views is not None
            or self._ipc_keep is not None
            or self._push_src is not None
            or self._push_tgt is not None
        )
        self._push_src = None
        self._push_tgt = None
        self._push_stream = None
        self._ipc_views = None
        self._ipc_plan_cache = None
        self._ipc_keep = None
        self._ipc_sig = None
        self._ipc_streams = None
        if had and self._cuda:
            with contextlib.suppress(Exception):
                torch.cuda.ipc_collect()  # type: ignore[no-untyped-call]  # torch.cuda: unannotated

    def _post_host(self) -> None:
        if self._cuda:
            g = self.group
            g.store.set(self._key(self._gen, "host", g.rank), json.dumps(_ipc.host_record(g.device)).encode())  # type: ignore[arg-type]  # torch's stub: str only

    def _ipc_agree(self, my_status: str) -> None:
        """Every rank posts whether its IPC setup worked; all decide alike: go on, fall back, or raise."""
        g = self.group
        info = self.info
        assert info is not None
        g.store.set(self._key(self._gen, "ipc_open", g.rank), my_status.encode())  # type: ignore[arg-type]  # torch's stub: str only
        g.wait_for_ranks(
            lambda r: self._key(self._gen, "ipc_open", r),
            range(g.world_size),
            "CUDA IPC setup (waiting for every rank to open the sender's handles)",
        )
        bad = []
        for r in range(g.world_size):
            st = g.store.get(self._key(self._gen, "ipc_open", r)).decode()
            if st != "ok":
                bad.append(f"rank {r}: {st}")
        if not bad:
            return
        self._drop_ipc()
        if info.extra.get("ipc_fallback"):
            # transport="auto": every rank switches to the NCCL transport the same way.
            self._compile(replace(info, transport=DEFAULT_TRANSPORT_GPU, extra={}))
            self.ipc_fallback_reason = "; ".join(bad)
            return
        raise RefitError(f"rank {g.rank}: transport='ipc' setup failed, no weights were moved: {clip(bad)}")


class IpcSender(IpcEndpoint):
    """Sender half: the transport choice (host check), export/open of handles, push and pull refits."""

    src: int
    ipc_direction: str | None
    ipc_copy_on: str
    _direction: str
    _requested: str

    def _choose_transport(self) -> tuple[str, bool]:
        """(transport, whether a failed IPC setup may fall back); ipc/auto check the ranks' hosts."""
        want = self._requested
        if not self._cuda:
            return ("broadcast" if want == "auto" else want), False
        g = self.group
        if want not in ("ipc", "auto") or (
            want == "auto" and (not AUTO_PICKS_IPC or g.world_size - 1 > AUTO_IPC_MAX_RECEIVERS)
        ):
            return (DEFAULT_TRANSPORT_GPU if want == "auto" else want), False
        g.wait_for_ranks(
            lambda r: self._key(self._gen, "host", r),
            range(g.world_size),
            "refit host check (waiting for every rank's host and GPU)",
        )
        records = {r: json.loads(g.store.get(self._key(self._gen, "host", r))) for r in range(g.world_size)}
        push_problems = _ipc.ipc_problems(records, g.rank, push=True)
        problems = _ipc.ipc_problems(records, g.rank)
        if self.ipc_direction in (None, "push") and not push_problems:
            self._direction = "push"
            return "ipc", want == "auto"
        if self.ipc_direction == "push":
            problems = push_problems
        elif not problems:
            self._direction = "pull"
            return "ipc", want == "auto"
        if want == "ipc":
            raise RefitError(
                f"rank {g.rank}: transport='ipc' needs every rank on the sender's host with "
                f"its GPU visible: {clip(problems)}"
            )
        self.ipc_fallback_reason = "; ".join(problems)
        return DEFAULT_TRANSPORT_GPU, False

    def _export_blob(self, tensors: list[torch.Tensor]) -> bytes:
        return _ipc.export_tensors([t if t.numel() else None for t in tensors], self.group.device)

    def _export_ipc(self, tensors: list[torch.Tensor]) -> None:
        g = self.group
        status = "ok"
        try:
            blob = self._export_blob(tensors)
        except Exception as e:
            status = f"sender could not export CUDA IPC handles: {e}"
            blob = json.dumps({"error": status}).encode()
        g.store.set(self._key(self._gen, "ipc_handles"), blob)  # type: ignore[arg-type]  # torch's stub: str only
        if status == "ok":
            self._ipc_keep = list(tensors)
            self._ipc_sig = _ipc.signature(tensors)
        self._ipc_agree(status)

    def _open_push(self, tensors: list[torch.Tensor]) -> None:
        """Push: open every receiver's exported tensors once and plan the copies into them."""
        g = self.group
        peers = self._peers()
        key: Callable[[int], str] = lambda r: self._key(self._gen, "ipc_dst", r)  # noqa: E731
        g.wait_for_ranks(key, peers, "CUDA IPC handles of the receivers' tensors (ipc_direction='push')")
        status = "ok"
        try:
            if self._copier is None:
                self._copier = _ipc.PeerCopier()
            self._push_stream = torch.cuda.Stream(g.device)  # type: ignore[no-untyped-call]  # torch.cuda: unannotated
            self._push_src = _ipc.PushSource({r: g.store.get(key(r)) for r in peers}, g.device, self._copier)
            self._push_src.plan(tensors, self._push_stream)
        except Exception as e:
            self._drop_ipc()
            status = f"sender could not open the receivers' CUDA IPC handles: {e}"
        self._ipc_agree(status)

    def _send_push(self, version: int) -> None:
        """Push: gate, copies, then the checks, the header (after the copies) and the verdict.

        The copies of the current plan are issued before this refit's tensors are looked up
        and checked: host work before the first byte moves is on the critical path. If the
        tensors moved, the copies are redone from the new ones before the header goes out; if
        their layout changed, the header aborts the refit (the receivers' tensors are then
        undefined, as after a failure mid-transfer on the other transports). Each refit is, on
        both sides and in this order: readiness all_reduce, header broadcast, verdict all_reduce.
        """
        g = self.group
        ph = self.ipc_phases = {"t_enter": time.perf_counter()}
        cur = torch.cuda.current_stream(g.device)
        comm, _ = self._side_streams()
        push, src, copier = self._push_stream, self._push_src, self._copier
        assert push is not None and src is not None and copier is not None
        if self._flags is None:
            self._flags = torch.zeros(2, dtype=torch.int32, device=g.device)
        # ``ready`` is 0 everywhere and stays 0: the all_reduce is only a gate. Each receiver
        # joins it once its own queued work on its tensors is done, and the copies queued
        # behind it on our copy stream wait for that on the GPU, not on this host.
        ready, verdict = self._flags[:1], self._flags[1:]
        timing = self.ipc_timing
        if timing:
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]  # torch.cuda: unannotated
        failed: Exception | None = None
        gated = False
        try:
            push.wait_stream(cur)  # read the weights after whatever wrote them
            if src.needs_gather:
                with torch.cuda.stream(push):
                    src.gather()  # non-contiguous sources into scratch (needs no receiver)
            g.all_reduce(ready, "max", stream=push)
            gated = True
            ph["t_gate"] = time.perf_counter()
            if timing:
                e0.record(push)
            copier.issue(*src.current, push, [push])
            ph["t_issued"] = time.perf_counter()
            tensors = self._ordered(self._tensors())
            redo = src.plan(tensors, push)
            if redo is not None:  # our tensors moved: copy again from where they are now
                if src.needs_gather:
                    with torch.cuda.stream(push):
                        src.gather()
                copier.issue(*redo, push, [push])
            if timing:
                e1.record(push)
        except Exception as e:
            failed = e
            self._publish_error(f"sender failed to push refit version {version}: {e}")
            if not gated:  # keep the receivers' sequence of collectives
                g.all_reduce(ready, "max", stream=comm)
        comm.wait_stream(push)
        g.broadcast(self._header_on(comm, version, STATUS_ABORT if failed else STATUS_OK), self.src, stream=comm)
        with torch.cuda.stream(comm):
            verdict.zero_()
        g.all_reduce(verdict, "max", stream=comm)
        ph["t_header_sent"] = time.perf_counter()
        # Later writes to the weights (optimizer step) wait for the copies reading them.
        cur.wait_stream(comm)
        g.synchronize(comm, watch=self._watch, what=f"refit push of version {version}")
        if failed is not None:
            if isinstance(failed, RefitError):
                raise failed
            raise RefitError(f"rank {g.rank}: failed to push refit version {version}: {failed}") from failed
        if timing:
            ph["copy_gpu_ms"] = e0.elapsed_time(e1)
            ph["copy_mode"] = copier.mode
        if int(verdict.item()):
            why = self._watch() or "no reason posted"
            raise RefitError(
                f"rank {g.rank}: a receiver could not take refit version {version} "
                f"(the copies went to memory it no longer uses): {why}"
            )

    def _send_ipc(self, tensors: list[torch.Tensor], version: int) -> None:
        """Header (with new handles if a tensor moved), then wait for every receiver's ack."""
        g = self.group
        self.ipc_phases = {"t_enter": time.perf_counter()}
        status = STATUS_OK
        old = None
        sig = _ipc.signature(tensors)
        if sig != self._ipc_sig:
            # A tensor now lives elsewhere (e.g. the callable returned new tensors): publish new
            # handles for this refit; the old tensors stay alive until the receivers' ack.
            g.store.set(self._key(self._gen, "ipc_handles", self._seq), self._export_blob(tensors))  # type: ignore[arg-type]  # torch's stub: str only
            old, self._ipc_keep, self._ipc_sig = self._ipc_keep, list(tensors), sig
            status = STATUS_NEW_HANDLES
        cur = torch.cuda.current_stream(g.device)
        comm, _ = self._side_streams()
        if self._ack is None:
            self._ack = torch.zeros(1, dtype=torch.int32, device=g.device)
        # The header leaves only after whatever wrote the weights on the current stream, so a
        # receiver that has it may read them.
        comm.wait_stream(cur)
        g.broadcast(self._header_on(comm, version, status), self.src, stream=comm)
        self.ipc_phases["t_header_sent"] = time.perf_counter()
        with torch.cuda.stream(comm):
            self._ack.zero_()
        g.all_reduce(self._ack, "max", stream=comm)
        # Later writes to the weights (optimizer step) wait for every receiver's ack.
        cur.wait_stream(comm)
        g.synchronize(comm, watch=self._watch, what=f"refit send of version {version} (waiting for receivers' ack)")
        del old
        if int(self._ack.item()):
            why = self._watch() or "no reason posted"
            raise RefitError(f"rank {g.rank}: a receiver failed to copy refit version {version}: {why}")


class IpcReceiver(IpcEndpoint):
    """Receiver half: open the sender's handles (pull) or export ours (push), and each refit."""

    src: int

    def _open_ipc(self) -> None:
        """Open the sender's handles once (torch caches one mapping per segment), check a copy works."""
        g = self.group
        key = self._key(self._gen, "ipc_handles")
        g.wait_for_ranks(lambda r: key, [self.src], f"CUDA IPC handles from sender rank {self.src}")
        status = "ok"
        try:
            self._load_views(g.store.get(key))
        except Exception as e:
            self._drop_ipc()
            status = f"could not open the CUDA IPC handles of sender rank {self.src}: {e}"
        self._ipc_agree(status)

    def _export_push(self) -> None:
        """Push: export our tensors (strided ones through staging slots) for the sender to open."""
        g = self.group
        status = "ok"
        try:
            self._push_tgt = _ipc.PushTargets(self._ordered(self._tensors()), g.device)
            blob = self._push_tgt.blob()
        except Exception as e:
            self._push_tgt = None
            status = f"could not export CUDA IPC handles of the destination tensors: {e}"
            blob = json.dumps({"error": status}).encode()
        g.store.set(self._key(self._gen, "ipc_dst", g.rank), blob)  # type: ignore[arg-type]  # torch's stub: str only
        self._ipc_agree(status)

    def _recv_push(self) -> int:
        """Push: post readiness (after our queued work on the tensors), then check our tensors
        while the sender's copies run, and wait for its header (sent after the copies) and the
        verdict. Takes part in every step even when we refuse, so the sender and the group
        carry on; raises afterwards."""
        g = self.group
        tgt = self._push_tgt
        assert tgt is not None
        self.ipc_phases = {"t_enter": time.perf_counter()}
        cur = torch.cuda.current_stream(g.device)
        comm, _ = self._side_streams()
        if self._flags is None:
            self._flags = torch.zeros(2, dtype=torch.int32, device=g.device)
        ready, verdict = self._flags[:1], self._flags[1:]  # ready: always 0, a gate (see the sender)
        # Ready only once the work already queued on our tensors (e.g. generation) is done.
        comm.wait_stream(cur)
        g.all_reduce(ready, "max", stream=comm)
        header = self._header_on(comm, fill=False)
        g.broadcast(header, self.src, stream=comm)
        refused: RefitError | None = None
        try:
            moved = tgt.moved(self._ordered(self._tensors()))
            if moved:
                refused = RefitError(
                    f"rank {g.rank}: ipc_direction='push': tensor(s) {clip([self._names[i] for i in moved])} "
                    f"moved to new storage since prepare_refit_info(); this refit went to the old storage; "
                    f"call prepare_refit_info() again on every rank"
                )
        except RefitError as e:
            refused = e
        if refused is not None:
            self._publish_error(str(refused))
        with torch.cuda.stream(comm):
            verdict.fill_(0 if refused is None else 1)
        g.all_reduce(verdict, "max", stream=comm)
        g.synchronize(comm, watch=self._watch, what=f"waiting for the refit push from sender rank {self.src}")
        self.ipc_phases["t_header"] = time.perf_counter()
        version = self._check_header(header)
        if refused is not None:
            raise refused
        if tgt.needs_scatter:
            with torch.cuda.stream(comm):
                tgt.scatter()
            g.synchronize(comm, watch=self._watch, what=f"refit receive of version {version}")
        cur.wait_stream(comm)
        return version

    def _load_views(self, blob: bytes) -> None:
        g = self.group
        views = _ipc.open_tensors(blob)
        src_dev = next((v.device for v in views if v is not None), g.device)
        s_dst = torch.cuda.Stream(g.device)  # type: ignore[no-untyped-call]  # torch.cuda: unannotated
        s_src = s_dst if src_dev == g.device else torch.cuda.Stream(src_dev)  # type: ignore[no-untyped-call]  # torch.cuda: unannotated
        _ipc.probe(views, g.device)
        if self._copier is None:
            self._copier = _ipc.PeerCopier()
        self._ipc_views = views
        self._ipc_streams = (s_dst, s_src)

    def _ipc_plan(self, tensors: list[torch.Tensor]) -> CopyPlan:
        """Copy plan for our tensors, reused while they stay where they were (same pointers, strides)."""
        assert self._ipc_views is not None and self._copier is not None
        key = _ipc.signature(tensors)
        cached = self._ipc_plan_cache
        if cached is not None and cached[0] is self._ipc_views and cached[1] == key:
            return cached[2]
        pairs = [(d, s) for d, s in zip(tensors, self._ipc_views) if s is not None]
        plan = self._copier.plan([d for d, _ in pairs], [s for _, s in pairs])
        self._ipc_plan_cache = (self._ipc_views, key, plan)
        return plan

    def _ipc_copy_streams(self) -> tuple[torch.cuda.Stream, list[torch.cuda.Stream]]:
        """(the stream the raw copies go on, every stream the copies use) for ``ipc_copy_on``."""
        assert self._ipc_streams is not None and self.info is not None
        s_dst, s_src = self._ipc_streams
        raw = s_dst if self.info.extra.get("ipc_copy_on", "src") == "dst" else s_src
        return raw, list(dict.fromkeys([s_src, s_dst]))

    def _recv_ipc(self, tensors: list[torch.Tensor]) -> int:
        """Pull: wait for the header, peer-copy every tensor from the sender's memory, ack."""
        g = self.group
        ph = self.ipc_phases = {"t_enter": time.perf_counter()}
        timing = self.ipc_timing
        cur = torch.cuda.current_stream(g.device)
        comm, _ = self._side_streams()
        # Planned before the header arrives, so it overlaps with the sender's side.
        runs, slow = self._ipc_plan(tensors)
        assert self._copier is not None  # _ipc_plan() checked it
        if self._ack is None:
            self._ack = torch.zeros(1, dtype=torch.int32, device=g.device)
        comm.wait_stream(cur)
        header = self._header_on(comm, fill=False)
        g.broadcast(header, self.src, stream=comm)
        g.synchronize(comm, watch=self._watch, what=f"waiting for the refit header from sender rank {self.src}")
        ph["t_header"] = time.perf_counter()
        version = self._check_header(header)
        failed = None
        if timing:
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]  # torch.cuda: unannotated
        try:
            if self._last_status == STATUS_NEW_HANDLES:
                self._load_views(g.store.get(self._key(self._gen, "ipc_handles", self._seq)))
                runs, slow = self._ipc_plan(tensors)
            raw, used = self._ipc_copy_streams()
            for s in used:  # the tensors may still be read by work on the current stream
                s.wait_stream(cur)
            if timing:
                e0.record(raw)
            self._copier.issue(runs, slow, raw, used)
            if timing:
                e1.record(raw)
        except Exception as e:
            failed = f"receiver failed to copy refit version {version}: {e}"
            self._publish_error(failed)
        ph["t_issued"] = time.perf_counter()
        assert self._ipc_streams is not None  # replaced by _load_views only once it succeeded
        s_dst = self._ipc_streams[0]
        for s in self._ipc_copy_streams()[1]:
            if s is not s_dst:
                s_dst.wait_stream(s)
        # The ack leaves once the copies are done; the sender may then overwrite its tensors.
        comm.wait_stream(s_dst)
        if timing:
            a0, a1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]  # torch.cuda: unannotated
            a0.record(comm)
        with torch.cuda.stream(comm):
            self._ack.fill_(1 if failed else 0)
        g.all_reduce(self._ack, "max", stream=comm)
        if timing:
            a1.record(comm)
        g.synchronize(comm, watch=self._watch, what=f"refit receive of version {version}")
        ph["t_copied"] = time.perf_counter()
        cur.wait_stream(comm)
        if timing and not failed:
            ph["copy_gpu_ms"] = e0.elapsed_time(e1)
            ph["ack_gpu_ms"] = a0.elapsed_time(a1)
            ph["copy_mode"] = self._copier.mode
        if failed:
            raise RefitError(f"rank {g.rank}: {failed}")
        return version
