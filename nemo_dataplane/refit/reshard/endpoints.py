"""Resharding refit: many trainer ranks to many generator ranks, each moving only the bytes it owns.

Every rank of the group is a sender (it appears in the trainer-side ``Layout``) or a receiver
(generator side). ``ReshardSender`` / ``ReshardReceiver`` hold the rank's local tensors (the
shards its layout gives it; fused ones included) and carry them over the group
(docs/refit.md, section 6):

1. ``prepare_refit_info()`` (once, collective): the first rank of each side publishes its
   side's layout (the senders' with the transfer options); every rank reads both, checks that
   its own layout is the published one and that its tensors are what the layout gives it,
   computes the plan (``reshard.plan_reshard``: the same on every rank, cached) and posts
   ``ok`` or its problems; every rank waits for all posts and raises ``RefitMismatchError``
   listing them, before any bulk data moves. A receiver parameter that no sender covers fails
   here, named.
2. ``send_weights(version)`` / ``receive_weights()`` (each refit, collective): a header
   element-wise max of ``[magic, fingerprint, -fingerprint, version, -version, status, done,
   -done]`` over every rank (exchanged through the store, ``_max``), so every sender and
   receiver learns of an abort, a plan, version or done-signal disagreement before any bulk
   data moves; then the bytes:

   * ``transport="p2p"``: each rank's part of the exchange (``transports/exchange.py``:
     send/recv per round over NCCL or gloo, packed buckets and direct pieces);
   * ``transport="ipc"`` (CUDA, every pair on one host; ``ipc_control.py``, ``ipc_push.py``):
     receivers exported their tensors at prepare; each sender writes its pieces straight into
     them with copy-engine copies, then signals them: with ``ipc_done="event"`` (default)
     through an interprocess CUDA event the receiver's stream waits on, so
     ``receive_weights()`` returns with the weights valid on the receiver's current stream
     (not yet on the host); ``ipc_done="host"``: a host-side ``done`` exchange after the
     copies. The group only carries control, so it may be a gloo group even when several
     ranks share a GPU.

``timings``: opt-in host-side phase timing (``None`` by default: nothing is recorded). Set it to
a list and every refit appends a dict of ``time.perf_counter()`` marks, ``"start"`` then the end
of each phase in order: ``check`` (tensors against the layout), ``ready`` (ipc receiver: its
queued GPU work), ``header``, then for p2p ``exchange``; for ipc with ``done="event"``:
``issue``, ``signal`` (status posted), ``copies`` (host wait for them) on a sender, ``signal``
(senders' statuses read, stream waits enqueued) and ``scatter`` on a receiver; with
``done="host"``: ``issue``, ``copies``, ``done`` (the done exchange) on a sender, ``done`` and
``scatter`` on a receiver. ``benchmarks/reshard_phases.py`` turns one into seconds per phase.

``bytes_moved`` holds what this rank sent or received in the last refit: counted at each
send/recv (p2p), or the bytes of the copies a sender issued (ipc; a receiver reports the
plan's bytes for it, as it does not see the copies). For a receiver it equals the bytes of its
local tensors.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import time
from collections.abc import Callable, Mapping
from typing import Any, cast

import torch

from nemo_dataplane.distributed.stateless_group import StatelessGroupTimeout, StatelessProcessGroup
from nemo_dataplane.refit.config import (
    DEFAULT_BUCKET_BYTES_CPU,
    DEFAULT_BUCKET_BYTES_GPU,
    MIN_BUCKET_BYTES,
    RESHARD_TRANSPORTS,
)
from nemo_dataplane.refit.cuda import ipc as _ipc
from nemo_dataplane.refit.protocol import (
    MAGIC,
    STATUS_ABORT,
    STATUS_OK,
    Endpoint,
    NamedTensors,
    RefitError,
    RefitMismatchError,
    WeightReceiver,
    WeightSender,
    clip,
)
from nemo_dataplane.refit.reshard.checks import diff_layouts, diff_locals
from nemo_dataplane.refit.reshard.ipc_control import IpcRefit, get_all, has_key, mark
from nemo_dataplane.refit.reshard.ipc_push import IpcPush
from nemo_dataplane.refit.reshard.layout import Layout, LayoutError, LocalTensor
from nemo_dataplane.refit.reshard.p2p import Exchange
from nemo_dataplane.refit.reshard.plan import ReshardPlan, ReshardPlanError, plan_reshard

__all__ = ["DEFAULT_DIRECT_BYTES", "RESHARD_TRANSPORTS", "ReshardReceiver", "ReshardSender"]

# Contiguous pieces at least this large go unpacked (zero-copy): fewer copies, while smaller ones
# share a bucket (on gloo every send/recv costs a helper thread; measured: sending every
# contiguous piece on its own made a 24 MB TP=2 -> TP=1 refit 10x slower than this).
DEFAULT_DIRECT_BYTES = 1 << 20
_PROTOCOL = 1
_I64_MIN = -(2**63)


class _ReshardEndpoint(IpcRefit, Endpoint):
    sender = False

    def __init__(
        self,
        group: StatelessProcessGroup,
        named_tensors: NamedTensors,
        layout: Layout,
        *,
        device: torch.device | str | int | None = None,
        channel: str = "reshard",
        ipc_done: str = "event",
        ipc_map_peers: bool = True,
    ) -> None:
        super().__init__(group, named_tensors, channel)
        if not isinstance(layout, Layout):
            raise TypeError(f"layout must be a nemo_dataplane.refit.Layout, got {type(layout).__name__}")
        if group.rank not in layout.mesh.coords:
            raise ValueError(f"group rank {group.rank} is not in the layout's mesh (ranks {list(layout.mesh.ranks)})")
        self.layout = layout
        if device is None:
            self.device = group.device
        else:
            self.device = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
        self._cuda = self.device.type == "cuda"
        self.reshard_plan: ReshardPlan | None = None
        self._exchange: Exchange | None = None
        self._push: IpcPush | None = None
        # Why transport="auto" did not end up on "ipc" (None: it did, or it was not considered).
        self.ipc_fallback_reason: str | None = None
        self._locals: dict[str, LocalTensor] = {}
        self.transport: str | None = None
        self.version: int | None = None
        self.bytes_moved = 0
        self._peers_watch: list[int] = []
        self._side = "send" if self.sender else "recv"
        # Opt-in phase marks of each refit (see the module doc); None: off.
        self.timings: list[dict[str, float]] | None = None
        self._nmax = 0  # control exchanges (_max) since prepare
        # How _max exchanges: "store" or "gloo" (the group's all_reduce, which
        # benchmarks/reshard_bench.py times against it by setting this); the same on every rank.
        self.control = "store"
        self._init_ipc(ipc_done, ipc_map_peers)

    # -- prepare

    def _options(self) -> dict[str, Any]:
        return {}

    def _publish(self) -> None:
        if self.group.rank == self.layout.mesh.ranks[0]:
            doc = {"layout": self.layout.to_dict(), "options": self._options(), "protocol": _PROTOCOL}
            self.group.store.set(self._key(self._gen, "layout", self._side), json.dumps(doc).encode())  # type: ignore[arg-type]  # torch's stub: str only

    def _read(self, side: str) -> dict[str, Any]:
        key = self._key(self._gen, "layout", side)
        what = "sending" if side == "send" else "receiving"
        self.group.wait_for_ranks(lambda r: key, [0], f"the {what} side's layout (published by that side's first rank)")
        return cast("dict[str, Any]", json.loads(self.group.store.get(key)))

    def prepare_refit_info(self) -> ReshardPlan:
        """Agree on both layouts and the plan with every rank (collective); see the module doc.

        Raises ``RefitMismatchError`` (``ReshardPlanError`` text included where the plan
        failed) listing every rank's problems; no bulk data has moved then.
        """
        g = self.group
        self._gen += 1
        self._nmax = 0
        self.close()
        self._exchange = None
        if self._cuda:
            g.store.set(self._key(self._gen, "host", g.rank), json.dumps(_ipc.host_record(self.device)).encode())  # type: ignore[arg-type]  # torch's stub: str only
        self._publish()
        docs = {side: self._read(side) for side in ("send", "recv")}
        problems: list[str] = []
        plan = None
        src: Layout | None
        dst: Layout | None
        try:
            src, dst = Layout.from_dict(docs["send"]["layout"]), Layout.from_dict(docs["recv"]["layout"])
        except LayoutError as e:
            src = dst = None
            problems.append(f"a published layout is malformed: {e}")
        opts = docs["send"].get("options", {})
        if src is not None and dst is not None:
            mine = src if self.sender else dst
            if mine.to_json() != self.layout.to_json():
                diff = diff_layouts(self.layout, mine)
                problems.append(
                    f"this rank's layout (fingerprint {self.layout.fingerprint}) differs from the one "
                    f"its side's first rank {mine.mesh.ranks[0]} published ({mine.fingerprint})"
                    + (f": {clip(diff)}" if diff else "")
                )
            if self.sender and opts != self._options():
                problems.append(f"options {self._options()} differ from the first sender's {opts}")
            missing = sorted(set(range(g.world_size)) - set(src.mesh.ranks) - set(dst.mesh.ranks))
            if missing:
                problems.append(f"group rank(s) {missing} are in neither layout")
            try:
                plan = plan_reshard(
                    src, dst, bucket_bytes=int(opts["bucket_bytes"]), direct_bytes=int(opts["direct_bytes"])
                )
            except ReshardPlanError as e:
                problems.append(str(e))
        problems += self._check_locals()
        self._agree(problems)
        assert plan is not None
        self.reshard_plan = plan
        self._fp = plan.fingerprint
        self.transport = self._choose(str(opts.get("transport", "auto")), plan)
        if self.transport == "ipc":
            self._setup_ipc(plan, fallback=opts.get("transport") == "auto")
        if self.transport == "p2p":
            self._exchange = Exchange(g, plan.rounds(g.rank), self.sender, self._locals, self.device)
            self._peers_watch = self._exchange.peers
            self._connect()
        return plan

    def _choose(self, requested: str, plan: ReshardPlan) -> str:
        """The transport, decided alike on every rank from what all of them posted."""
        g = self.group
        if not self._cuda:
            if requested == "ipc":
                raise RefitError(f"rank {g.rank}: transport='ipc' needs CUDA tensors")
            return "p2p"
        if requested == "p2p":
            if g.backend != "nccl":
                raise RefitError(f"rank {g.rank}: transport='p2p' with CUDA tensors needs an NCCL group")
            return "p2p"
        key: Callable[[int], str] = lambda r: self._key(self._gen, "host", r)  # noqa: E731
        g.wait_for_ranks(key, range(g.world_size), "reshard host check (waiting for every rank's host and GPU)")
        records = {r: json.loads(g.store.get(key(r))) for r in range(g.world_size)}
        problems = []
        for s, r in plan.pairs:
            problems += _ipc.ipc_problems({s: records[s], r: records[r]}, s, push=True)
        if not problems:
            return "ipc"
        if requested == "ipc" or g.backend != "nccl":
            raise RefitError(
                f"rank {g.rank}: transport='ipc' needs every sender on its receivers' host with "
                f"their GPUs visible: {clip(problems)}"
            )
        self.ipc_fallback_reason = "; ".join(problems)
        return "p2p"

    def _check_locals(self) -> list[str]:
        """This rank's tensors against what its layout gives it (names, shapes, dtypes, device)."""
        try:
            want = self.layout.local_tensors(self.group.rank)
            tensors = self._tensors()
        except (LayoutError, TypeError, ValueError) as e:
            return [str(e)]
        self._locals = want
        return diff_locals(want, tensors, self.device)

    def _agree(self, problems: list[str]) -> None:
        """Post this rank's status, wait for every rank's, raise if any failed. Ranks with the
        same problem (a plan error is computed alike everywhere) are listed together."""
        g = self.group
        status = "ok" if not problems else f"{len(problems)} problem(s): {clip(problems)}"
        g.store.set(self._key(self._gen, "status", g.rank), status.encode())  # type: ignore[arg-type]  # torch's stub: str only
        g.wait_for_ranks(
            lambda r: self._key(self._gen, "status", r),
            range(g.world_size),
            "reshard handshake (waiting for every rank to check the layouts and its tensors)",
        )
        by_status: dict[str, list[int]] = {}
        for r in range(g.world_size):
            st = g.store.get(self._key(self._gen, "status", r)).decode()
            if st != "ok":
                by_status.setdefault(st, []).append(r)
        if not by_status:
            return
        parts = [f"rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))}: {st}" for st, rs in by_status.items()]
        raise RefitMismatchError(
            f"rank {g.rank}: reshard handshake failed, no weights were moved. " + " | ".join(parts)
        )

    def _connect(self) -> None:
        """NCCL: one small send/recv per pair now, so the connections are set up at prepare
        time rather than inside the first refit."""
        if not self._cuda or self._exchange is None:
            return
        g = self.group
        t = torch.zeros(1, dtype=torch.int32, device=self.device)
        with g.coalesce():
            for p in self._exchange.peers:
                (g.send if self.sender else g.recv)(t, p)
        g.synchronize(what="reshard connection set-up")

    # -- each refit

    def _watch(self) -> str | None:
        return self._errors_of(self._peers_watch)

    def _checked(self) -> Mapping[str, torch.Tensor]:
        tensors = self._tensors()
        problems = diff_locals(self._locals, tensors, self.device)
        if problems:
            raise RefitMismatchError(
                f"rank {self.group.rank}: tensors changed since prepare_refit_info(): {clip(problems)}"
            )
        return tensors

    def _header(self, version: int | None, failed: BaseException | None) -> int:
        """The header exchange; returns the senders' version or raises (abort, disagreement)."""
        g = self.group
        fp = self._fp
        status = STATUS_ABORT if failed is not None else STATUS_OK
        done = self._done_code
        vals = [
            MAGIC,
            fp,
            -fp,
            _I64_MIN if version is None else version,
            _I64_MIN if version is None else -version,
            status,
            done,
            -done,
        ]
        magic, fp_max, neg_fp_min, v_max, neg_v_min, st, d_max, neg_d_min = self._max(vals, "reshard refit header")
        if st != STATUS_OK:
            if failed is not None:
                raise failed
            why = self._errors_of(r for r in range(g.world_size) if r != g.rank) or "no reason posted"
            raise RefitError(f"rank {g.rank}: refit of version {v_max} aborted by another rank: {why}")
        if magic != MAGIC or fp_max != fp or -neg_fp_min != fp:
            msg = (
                f"refit header mismatch (magic {magic:#x}, fingerprints {-neg_fp_min}..{fp_max}, ours {fp}): "
                "the ranks prepared different plans; call prepare_refit_info() again on every rank"
            )
            raise RefitError(f"rank {g.rank}: {msg}")
        if v_max != -neg_v_min:
            raise RefitError(f"rank {g.rank}: the senders disagree on the version ({-neg_v_min}..{v_max})")
        if d_max != -neg_d_min:
            raise RefitError(
                f"rank {g.rank}: the ranks disagree on the ipc done signal (this rank: "
                f"{self.done!r}); configure ipc_done alike on every rank"
            )
        return v_max

    def _max(self, vals: list[int], what: str) -> list[int]:
        """Element-wise max over every rank, through the store (bounded by the group's timeout).

        Each rank posts its values under a key numbered by the exchange, then one blocking
        ``wait`` (answered by the store server when the last key lands; no polling) and one
        ``multi_get`` of the others' keys (one round trip instead of one per rank): cheaper on
        the critical path than a gloo ``all_reduce`` (docs/refit.md, section 6.4). A rank's key
        of two exchanges ago is deleted: every rank has read it, since each posts exchange n
        only after reading every key of n - 1."""
        g = self.group
        if self.control == "gloo":
            t = torch.tensor(vals, dtype=torch.int64, device=g.device)
            g.all_reduce(t, "max")
            g.synchronize(what=what)
            return [int(x) for x in t.tolist()]
        self._nmax += 1
        n = self._nmax
        keys = [self._key(self._gen, "max", n, r) for r in range(g.world_size)]
        g.store.set(keys[g.rank], json.dumps(vals).encode())  # type: ignore[arg-type]  # torch's stub: str only
        try:
            g.store.wait(keys, datetime.timedelta(seconds=g.timeout))
        except Exception as e:
            missing = [r for r, k in enumerate(keys) if not has_key(g, k)]
            raise StatelessGroupTimeout(
                f"rank {g.rank}: {what} did not finish within {g.timeout:g}s: ranks {missing} never posted ({e})"
            ) from e
        others = [k for r, k in enumerate(keys) if r != g.rank]
        rows = [vals] + [json.loads(x) for x in get_all(g, others)]
        if n > 2:
            with contextlib.suppress(Exception):
                g.store.delete_key(self._key(self._gen, "max", n - 2, g.rank))
        return [max(col) for col in zip(*rows)]

    def _refit(self, version: int | None) -> int:
        if self._exchange is None and self._push is None:
            raise RefitError(f"rank {self.group.rank}: call prepare_refit_info() before refitting")
        marks: dict[str, float] | None = None
        if self.timings is not None:
            marks = {"start": time.perf_counter()}
            self.timings.append(marks)
        self._seq += 1
        failed: BaseException | None = None
        tensors: Mapping[str, torch.Tensor] = {}
        try:
            tensors = self._checked()
            if self._push is not None and not self.sender:
                moved = self._push.moved(tensors)
                if moved:
                    raise RefitMismatchError(
                        f"rank {self.group.rank}: transport='ipc': tensor(s) {clip(moved)} moved to new storage "
                        "since prepare_refit_info(); call prepare_refit_info() again on every rank"
                    )
        except RefitMismatchError as e:
            failed = e
            self._publish_error(str(e))
        mark(marks, "check")
        if self._push is not None:
            return self._refit_ipc(version, tensors, failed, marks)
        assert self._exchange is not None  # prepared, and not for IPC
        v = self._header(version, failed)
        mark(marks, "header")
        what = f"reshard {'send' if self.sender else 'receive'} of version {v}"
        try:
            with torch.no_grad():
                self._exchange.run(tensors, self._watch, what)
            mark(marks, "exchange")
        except Exception as e:
            self._publish_error(f"{'sender' if self.sender else 'receiver'} failed during refit of version {v}: {e}")
            raise
        self.bytes_moved = self._exchange.bytes_moved
        self.version = v
        return v

    def release_buffers(self) -> None:
        super().release_buffers()
        if (exchange := getattr(self, "_exchange", None)) is not None:
            exchange.release_buffers()

    def close(self) -> None:
        """Free buffers and drop CUDA IPC handles; call on every rank before destroying the group."""
        super().close()
        if (push := getattr(self, "_push", None)) is not None:
            push.close()
            self._push = None


class ReshardSender(_ReshardEndpoint, WeightSender):
    """Trainer side of a resharding refit: this rank's shards, as its ``layout`` gives them.

    Args:
        group: the refit group: every trainer rank of ``layout`` plus every generator rank.
        named_tensors: local name -> tensor (dict, pairs, or a callable returning either): the
            rank's shards under their HF names (or fused names, see ``Layout.fused``).
        layout: the trainer side's ``Layout`` (identical on every trainer rank).
        bucket_bytes: staging per rank and round (two rounds in flight); default 1 GiB on GPU,
            64 MiB on CPU.
        direct_bytes: pieces at least this large that are contiguous on both ends go on their
            own, zero-copy (default ``DEFAULT_DIRECT_BYTES``, 1 MiB).
        transport: ``"p2p"`` (send/recv over the group, NCCL or gloo), ``"ipc"`` (CUDA, every
            sender on its receivers' host: copy-engine copies into the receivers' exported
            tensors; the group only carries control) or ``"auto"`` (ipc where every pair can,
            else p2p on an NCCL group; CPU: p2p). Receivers follow the senders'.
        device: where the tensors live (default: the group's device).
        channel: store namespace, for several refits on one group.
        ipc_done: ipc: ``"event"`` or ``"host"``, as ``WeightTransferConfig.ipc_done``; the
            same on every rank (receivers take it too).
        ipc_map_peers: ipc: as ``WeightTransferConfig.ipc_map_peers`` (senders only).
    """

    sender = True

    def __init__(
        self,
        group: StatelessProcessGroup,
        named_tensors: NamedTensors,
        layout: Layout,
        bucket_bytes: int | None = None,
        *,
        direct_bytes: int | None = None,
        transport: str = "auto",
        device: torch.device | str | int | None = None,
        channel: str = "reshard",
        ipc_done: str = "event",
        ipc_map_peers: bool = True,
    ) -> None:
        super().__init__(
            group, named_tensors, layout, device=device, channel=channel, ipc_done=ipc_done, ipc_map_peers=ipc_map_peers
        )
        if transport not in RESHARD_TRANSPORTS:
            raise ValueError(f"transport must be one of {RESHARD_TRANSPORTS}, got {transport!r}")
        if bucket_bytes is None:
            bucket_bytes = DEFAULT_BUCKET_BYTES_GPU if self._cuda else DEFAULT_BUCKET_BYTES_CPU
        if bucket_bytes < MIN_BUCKET_BYTES:
            raise ValueError(f"bucket_bytes must be >= {MIN_BUCKET_BYTES}, got {bucket_bytes}")
        self.bucket_bytes = int(bucket_bytes)
        if direct_bytes is None:
            direct_bytes = min(DEFAULT_DIRECT_BYTES, self.bucket_bytes + 1)
        self.direct_bytes = int(direct_bytes)
        self._requested = transport

    def _options(self) -> dict[str, Any]:
        return {"bucket_bytes": self.bucket_bytes, "direct_bytes": self.direct_bytes, "transport": self._requested}

    def send_weights(self, version: int) -> None:
        """Send this rank's pieces of refit ``version`` (collective with every rank)."""
        self._refit(int(version))


class ReshardReceiver(_ReshardEndpoint, WeightReceiver):
    """Generator side of a resharding refit: receives into this rank's tensors in place.

    ``named_tensors``: the rank's local tensors as its ``layout`` gives them (fused ones under
    their fused name). ``version`` holds the last completed refit's version. ``device``,
    ``channel`` and ``ipc_done`` as for ``ReshardSender`` (``ipc_map_peers`` is unused here).
    """

    def receive_weights(self) -> int:
        """Receive this rank's pieces of one refit; return (and store) its version.

        With ``transport="ipc"`` and the default ``ipc_done="event"`` the weights are valid on the
        stream current at the call (work queued on it afterwards runs after every copy), not
        yet on the host: synchronise that stream before reading them elsewhere."""
        return self._refit(None)
