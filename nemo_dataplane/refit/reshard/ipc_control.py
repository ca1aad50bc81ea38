"""The CUDA IPC refit of ``ReshardSender`` / ``ReshardReceiver`` (``transport="ipc"``): setup and
each refit's control; the copies themselves are ``ipc_push.IpcPush``.

Setup (in ``prepare_refit_info``): receivers export their tensors, senders open them; each
sender also makes an interprocess CUDA event and shares its handle once through the group's
store; every rank posts whether its part worked and all agree before a refit may run.

Each refit: the receiver waits (host, bounded by the group timeout) for the work already queued
on its current stream, so nothing it still reads is overwritten; the header exchange (abort,
plan, version, done-signal agreement); the senders enqueue their copies; then the done signal,
one of (``done``, from ``WeightTransferConfig.ipc_done``; the same on every rank, the header
checks it):

* ``"event"`` (default): a sender records its event
  after its copies, then posts one status key per refit to the store (``ok`` or its error) and
  only then waits (host) for its copies, off every receiver's critical path. A receiver waits
  (``store.wait``, bounded by the group timeout) for the status of each of its senders, raises
  if one failed, and makes its current stream wait on their events on the GPU
  (``cudaStreamWaitEvent``); its host never waits for the copies. ``receive_weights()`` then
  returns with the weights valid **on the receiver's current stream** (the stream current when
  it was called): work queued there later runs after every copy; a host read or another stream
  must synchronise with that stream first.
  Across GPUs ``IpcPush.wait_signals`` bridges a sender's event through a stream of its GPU.
* ``"host"``: every rank joins a ``done`` max exchange once each sender's copies finished (host
  wait), so ``receive_weights()`` returns with the weights complete; slower than ``"event"``
  by that wait (docs/refit.md, section 6.4). Every rank also posts with its setup status
  whether it has a peer on another GPU (``CROSS_GPU``).

Why the event path is safe without more handshakes: a sender re-records its event (next refit)
only after that refit's header, which every receiver joins only after ``receive_weights()``
returned, i.e. after it enqueued its waits on the previous record; the sender's current stream
waits for its copies (``IpcPush.issue``), so its next writes to its weights cannot overtake
them; its status key of the previous refit is deleted once all its receivers read it (they did
before joining this header). Failures: a sender whose copies could not be enqueued posts its
error as its status (every receiver raises it); a sender that dies before posting costs its
receivers the group timeout; copies that fail on the sender's GPU after it posted ``ok`` are
raised by the sender (it waits for them); a receiver stream that can then never pass its waits
makes the receiver's next readiness wait raise within the group timeout. Nothing waits forever.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from nemo_dataplane.distributed.stateless_group import StatelessGroupTimeout, StatelessProcessGroup, Work
from nemo_dataplane.refit.config import IPC_DONE_SIGNALS
from nemo_dataplane.refit.protocol import RefitError, clip
from nemo_dataplane.refit.reshard.ipc_push import IpcPush
from nemo_dataplane.refit.reshard.layout import LocalTensor
from nemo_dataplane.refit.reshard.plan import ReshardPlan

__all__ = ["CROSS_GPU", "DONE_SIGNALS", "IpcRefit", "get_all", "has_key", "mark"]

DONE_SIGNALS = IPC_DONE_SIGNALS

CROSS_GPU = "ok cross-gpu"  # a rank's IPC setup status when one of its peers is on another GPU


class IpcRefit:
    """The ``transport="ipc"`` steps of a reshard endpoint (a mixin of ``endpoints._ReshardEndpoint``,
    which provides the attributes declared here)."""

    group: StatelessProcessGroup
    sender: bool
    device: torch.device
    transport: str | None
    ipc_fallback_reason: str | None
    reshard_plan: ReshardPlan | None
    bytes_moved: int
    version: int | None
    _push: IpcPush | None
    _locals: dict[str, LocalTensor]
    _peers_watch: list[int]
    _gen: int
    _seq: int
    _key: Callable[..., str]
    _tensors: Callable[[], Mapping[str, torch.Tensor]]
    _watch: Callable[[], str | None]
    _publish_error: Callable[[str], None]
    _errors_of: Callable[[Iterable[int]], str | None]
    _header: Callable[[int | None, BaseException | None], int]
    _max: Callable[[list[int], str], list[int]]

    def _init_ipc(self, done: str, map_peers: bool) -> None:
        """``done``: how a receiver learns the copies landed (module doc); ``map_peers``: whether
        a sender maps receivers on other GPUs into its own context (``ipc_push.IpcPush``)."""
        if done not in DONE_SIGNALS:
            raise ValueError(f"ipc_done must be one of {DONE_SIGNALS}, got {done!r}")
        # ``done`` may be changed between refits, alike on every rank (the header refuses a
        # disagreement); each prepare starts again from the configured one.
        self._done_configured = done
        self.done = done
        self._map_peers = map_peers

    @property
    def _done_code(self) -> int:
        """The done signal as the header carries it (0 where there is no IPC push)."""
        return 1 if self._push is not None and self.done == "event" else 0

    def _setup_ipc(self, plan: ReshardPlan, fallback: bool) -> None:
        """Receivers export their tensors, senders open their receivers' and share their done
        events, receivers open those; all agree it worked."""
        g = self.group
        push = IpcPush(plan, g.rank, self.sender, self._locals, self.device, map_peers=self._map_peers)
        status = "ok"
        dst_key: Callable[[int], str] = lambda r: self._key(self._gen, "ipc_dst", r)  # noqa: E731
        ev_key: Callable[[int], str] = lambda r: self._key(self._gen, "ipc_event", r)  # noqa: E731
        try:
            if not self.sender:
                _post(g.store, dst_key(g.rank), lambda: push.export(self._tensors()))
                g.wait_for_ranks(ev_key, push.peers, "the senders' CUDA IPC done events")
                push.open_signals({r: g.store.get(ev_key(r)) for r in push.peers})
            else:
                _post(g.store, ev_key(g.rank), push.signal_blob)
                g.wait_for_ranks(dst_key, push.peers, "CUDA IPC handles of the receivers' tensors")
                push.open(
                    {r: g.store.get(dst_key(r)) for r in push.peers},
                    {r: list(plan.dst_layout.local_tensors(r)) for r in push.peers},
                )
            if push.cross_gpu:
                status = CROSS_GPU
        except Exception as e:
            push.close()
            status = f"CUDA IPC setup failed: {e}"
        g.store.set(self._key(self._gen, "ipc_open", g.rank), status.encode())  # type: ignore[arg-type]  # torch's stub: str only
        g.wait_for_ranks(
            lambda r: self._key(self._gen, "ipc_open", r),
            range(g.world_size),
            "CUDA IPC setup (waiting for every rank to export or open handles)",
        )
        keys = [self._key(self._gen, "ipc_open", r) for r in range(g.world_size)]
        statuses = [x.decode() for x in get_all(g, keys)]
        bad = [f"rank {r}: {st}" for r, st in enumerate(statuses) if st not in ("ok", CROSS_GPU)]
        if not bad:
            self._push = push
            self._peers_watch = push.peers
            self.done = self._done_configured
            return
        push.close()
        if fallback and g.backend == "nccl":
            self.transport = "p2p"
            self.ipc_fallback_reason = "; ".join(bad)
            return
        raise RefitError(f"rank {g.rank}: transport='ipc' setup failed, no weights were moved: {clip(bad)}")

    def _refit_ipc(
        self,
        version: int | None,
        tensors: Mapping[str, torch.Tensor],
        failed: BaseException | None,
        marks: dict[str, float] | None,
    ) -> int:
        g = self.group
        assert self._push is not None and self.reshard_plan is not None  # both made by prepare_refit_info()
        if not self.sender and failed is None:
            # Ready only once the work already queued on our tensors (e.g. generation) is done;
            # with done="event" this also covers the previous refit's copies (bounded: a stuck
            # sender surfaces here, not as a hang).
            ev = torch.cuda.Event()  # type: ignore[no-untyped-call]  # torch.cuda: unannotated
            ev.record(torch.cuda.current_stream(self.device))
            Work(g, "reshard receiver readiness (its queued GPU work)", event=ev).wait(watch=self._watch)
            mark(marks, "ready")
        v = self._header(version, failed)
        mark(marks, "header")
        if self.done == "event":
            self._event_done(v, tensors, marks)
        else:
            self._host_done(v, tensors, marks)
        if not self.sender:
            self._push.scatter()
            mark(marks, "scatter")
            self.bytes_moved = self.reshard_plan.bytes_to(g.rank)
        self.version = v
        return v

    def _host_done(self, v: int, tensors: Mapping[str, torch.Tensor], marks: dict[str, float] | None) -> None:
        """done="host": senders wait for their copies, then every rank joins a done exchange."""
        g = self.group
        push = self._push
        assert push is not None
        status = 0
        failed: BaseException | None = None
        if self.sender:
            try:
                with torch.no_grad():
                    done = push.issue(tensors)
                mark(marks, "issue")
                Work(g, f"reshard ipc copies of version {v}", event=done).wait(watch=self._watch)
                mark(marks, "copies")
                self.bytes_moved = push.bytes_issued
            except Exception as e:
                status = 1
                failed = e
                self._publish_error(f"sender failed to copy refit version {v}: {e}")
        (st,) = self._max([status], f"reshard ipc refit of version {v} (waiting for every sender's copies)")
        mark(marks, "done")
        if st:
            if failed is not None:
                raise RefitError(f"rank {g.rank}: failed to copy refit version {v}: {failed}") from failed
            why = self._errors_of(r for r in range(g.world_size) if r != g.rank) or "no reason posted"
            raise RefitError(f"rank {g.rank}: a sender failed to copy refit version {v}: {why}")

    def _signal_key(self, seq: int, rank: int) -> str:
        return self._key(self._gen, "signal", seq, rank)

    def _event_done(self, v: int, tensors: Mapping[str, torch.Tensor], marks: dict[str, float] | None) -> None:
        """done="event" (module doc). Sender marks: issue, signal (status posted), copies;
        receiver: signal (every sender's status read and the stream waits enqueued)."""
        g = self.group
        push = self._push
        assert push is not None
        if not self.sender:
            self._await_signals(v, push)
            push.wait_signals(torch.cuda.current_stream(self.device))
            mark(marks, "signal")
            return
        failed: BaseException | None = None
        try:
            with torch.no_grad():
                done = push.issue(tensors)  # records push.done_event after every copy
            mark(marks, "issue")
        except Exception as e:
            failed = e
        status = "ok" if failed is None else f"rank {g.rank}: sender failed to copy refit version {v}: {failed}"
        if failed is not None:
            self._publish_error(status)
        g.store.set(self._signal_key(self._seq, g.rank), status.encode())  # type: ignore[arg-type]  # torch's stub: str only
        mark(marks, "signal")
        if failed is not None:
            raise RefitError(f"rank {g.rank}: failed to copy refit version {v}: {failed}") from failed
        try:
            Work(g, f"reshard ipc copies of version {v}", event=done).wait(watch=self._watch)
        except Exception as e:
            self._publish_error(f"sender's copies of refit version {v} failed: {e}")
            raise
        mark(marks, "copies")
        self.bytes_moved = push.bytes_issued
        with contextlib.suppress(Exception):  # every receiver read it before joining this refit's header
            g.store.delete_key(self._signal_key(self._seq - 1, g.rank))

    def _await_signals(self, v: int, push: IpcPush) -> None:
        """Receiver: every sender's status of this refit (one blocking store wait, bounded)."""
        g = self.group
        keys = [self._signal_key(self._seq, r) for r in push.peers]
        try:
            g.store.wait(keys, datetime.timedelta(seconds=g.timeout))
        except Exception as e:
            missing = [r for r, k in zip(push.peers, keys) if not has_key(g, k)]
            why = self._errors_of(missing)
            raise StatelessGroupTimeout(
                f"rank {g.rank}: reshard ipc refit of version {v} (waiting for every sender's done signal) did not "
                f"finish within {g.timeout:g}s: sender ranks {missing} never posted"
                + (f"; they reported: {why}" if why else "")
                + f" ({e})"
            ) from e
        bad = [st for x in get_all(g, keys) if (st := x.decode()) != "ok"]
        if bad:
            raise RefitError(f"rank {g.rank}: a sender failed to copy refit version {v}: {clip(bad)}")


def get_all(g: StatelessProcessGroup, keys: list[str]) -> list[bytes]:
    """The values of ``keys`` (all present) in one store round trip where the store can, else one
    get per key (a store without ``multi_get``, or one that refuses it)."""
    if not keys:
        return []
    multi = getattr(g.store, "multi_get", None)
    if multi is not None:
        try:
            return [bytes(x) for x in multi(keys)]
        except Exception:  # noqa: S110 - the per-key gets below give the real error, if any
            pass
    return [g.store.get(k) for k in keys]


def has_key(g: StatelessProcessGroup, key: str) -> bool:
    try:
        return bool(g.store.check([key]))
    except Exception:
        return False


def mark(marks: dict[str, float] | None, phase: str) -> None:
    if marks is not None:
        marks[phase] = time.perf_counter()


def _post(store: Any, key: str, make: Callable[[], bytes]) -> None:
    """Set ``key`` to ``make()``, or to ``{"error": ...}`` before re-raising what ``make`` raised,
    so that the peers waiting on the key learn of the failure instead of timing out."""
    try:
        blob = make()
    except Exception as e:
        store.set(key, json.dumps({"error": str(e)}).encode())
        raise
    store.set(key, blob)
