"""What both packed transports share: the prepare handshake, the refit header, the compiled plan.

``prepare_refit_info()`` (once, collective): the sender publishes a ``RefitInfo`` (names,
shapes, dtypes, schedule parameters) in the group's store; each receiver checks it against its
own tensors and posts ``ok`` or its list of mismatches; every rank waits for all posts and
raises if any rank failed, so no bulk transfer starts on a bad layout. Each refit then carries
a 4-int header ``[magic, fingerprint, version, status]`` (docs/refit.md, sections 2-3).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from nemo_dataplane.distributed.stateless_group import StatelessProcessGroup
from nemo_dataplane.refit.packed.plan import Bucket, Direct, RefitInfo, build_plan, group_directs
from nemo_dataplane.refit.protocol import (
    MAGIC,
    STATUS_ABORT,
    STATUS_OK,
    Endpoint,
    NamedTensors,
    RefitError,
    RefitMismatchError,
    TensorSpec,
    clip,
)

__all__ = ["STATUS_NEW_HANDLES", "PackedEndpoint", "diff_specs"]

# ipc: the sender's tensors moved to new storage; new handles are in the store for this refit.
STATUS_NEW_HANDLES = 2


def diff_specs(sent: Sequence[TensorSpec], local: Sequence[TensorSpec], *, then: str = "", now: str = "") -> list[str]:
    """Human-readable differences between the sender's and a receiver's tensors (empty if none).

    With ``then``/``now`` labels it instead compares one side's tensors over time.
    """
    mine = {s.name: s for s in local}
    theirs = {s.name: s for s in sent}
    a, b = (then, now) if then else ("sender", "receiver")
    out: list[str] = []
    for s in sent:
        m = mine.get(s.name)
        if m is None:
            out.append(
                f"{s.name}: gone since prepare_refit_info()"
                if then
                else f"{s.name}: sent by the trainer, but the receiver has no such tensor"
            )
            continue
        if m.shape != s.shape:
            out.append(f"{s.name}: shape {a} {list(s.shape)} != {b} {list(m.shape)}")
        if m.dtype != s.dtype:
            out.append(f"{s.name}: dtype {a} {s.dtype} != {b} {m.dtype}")
    for m in local:
        if m.name not in theirs:
            out.append(
                f"{m.name}: new since prepare_refit_info()"
                if then
                else f"{m.name}: receiver tensor not sent by the trainer (it would go stale)"
            )
    return out


class PackedEndpoint(Endpoint):
    """Plan, buffers, streams, the handshake and the header of a packed endpoint."""

    def __init__(self, group: StatelessProcessGroup, named_tensors: NamedTensors, channel: str) -> None:
        super().__init__(group, named_tensors, channel)
        self.info: RefitInfo | None = None
        self.plan: list[Bucket | Direct] = []
        self._bufs: list[torch.Tensor] = []
        self._wire: list[torch.Tensor] = []
        self._views: list[list[torch.Tensor]] | None = None
        self._streams: tuple[torch.cuda.Stream, torch.cuda.Stream] | None = None
        self._cuda = group.backend == "nccl"
        # Reused refit header: pinned host copy (no blocking host-to-device copy per refit).
        self._hdr_host: torch.Tensor | None = None
        self._hdr_dev: torch.Tensor | None = None
        self._last_status = STATUS_OK

    # -- helpers

    def _specs_and_tensors(self) -> tuple[list[TensorSpec], Mapping[str, torch.Tensor]]:
        tensors = self._tensors()
        dev = self.group.device
        bad = [f"{n} on {t.device}" for n, t in tensors.items() if t.device != dev]
        if bad:
            raise RefitError(f"rank {self.group.rank}: tensors must be on the group's device {dev}: {clip(bad)}")
        return [TensorSpec.of(n, t) for n, t in tensors.items()], tensors

    def _compile(self, info: RefitInfo) -> None:
        """Precompute everything a refit needs from ``info`` so the hot path is plain lookups."""
        self.info = info
        self.plan = build_plan(info)
        self._fp = info.fingerprint()
        self._names = [t.name for t in info.tensors]
        self._shapes = [torch.Size(t.shape) for t in info.tensors]
        self._dtypes = [t.torch_dtype for t in info.tensors]
        self._bucket_idx = [[i for i, _ in b.entries] for b in self.plan if isinstance(b, Bucket)]
        self._launches = group_directs(self.plan, [t.nbytes for t in info.tensors], info.group_bytes)
        self.release_buffers()

    def _ordered(self, tensors: Mapping[str, torch.Tensor]) -> list[torch.Tensor]:
        """Tensors in ``info`` order, checked against ``info`` (layout may not change after prepare)."""
        assert self.info is not None
        out = []
        for name, shape, dt in zip(self._names, self._shapes, self._dtypes):
            t = tensors.get(name)
            if t is None or t.shape != shape or t.dtype != dt:
                break
            out.append(t)
        if len(out) == len(self._names) and len(tensors) == len(out):
            return out
        problems = diff_specs(
            self.info.tensors,
            [TensorSpec.of(n, t) for n, t in tensors.items()],
            then="at prepare_refit_info()",
            now="now",
        )
        raise RefitMismatchError(
            f"rank {self.group.rank}: tensors changed since prepare_refit_info(): {clip(problems)}"
        )

    def _side_streams(self) -> tuple[torch.cuda.Stream, torch.cuda.Stream]:
        if self._streams is None:
            dev = self.group.device
            self._streams = (torch.cuda.Stream(dev), torch.cuda.Stream(dev))  # type: ignore[no-untyped-call]  # torch.cuda: unannotated
        return self._streams

    def _header_on(
        self, stream: torch.cuda.Stream, version: int = 0, status: int = STATUS_OK, fill: bool = True
    ) -> torch.Tensor:
        """The reusable device header, written on ``stream`` (sender: the values; receiver: zeros).

        Only one refit is in flight per endpoint and each ends with a host sync of the stream
        the header travelled on, so the pinned source is free again by the next call.
        """
        with torch.cuda.stream(stream):
            if self._hdr_dev is None:
                # Made on ``stream``: an initialising kernel on another stream could land after
                # the header written here (a receiver then reads an all-zero header).
                self._hdr_host = torch.zeros(4, dtype=torch.int64, pin_memory=True)
                self._hdr_dev = torch.empty(4, dtype=torch.int64, device=self.group.device)
            if fill:
                assert self._hdr_host is not None  # made together with _hdr_dev
                self._hdr_host.numpy()[:] = (MAGIC, self._fp, version, status)
                self._hdr_dev.copy_(self._hdr_host, non_blocking=True)
            else:
                self._hdr_dev.zero_()
        return self._hdr_dev

    def _check_header(self, header: torch.Tensor) -> int:
        """Receiver: the version in ``header``; raises on an abort or a wrong magic/fingerprint."""
        assert self.info is not None
        magic, fp, version, status = (int(x) for x in header.tolist())
        g = self.group
        src = self.info.src
        self._last_status = status
        if status == STATUS_ABORT:
            why = self._errors_of([src]) or "no reason posted"
            raise RefitError(f"rank {g.rank}: sender rank {src} aborted refit of version {version}: {why}")
        if magic != MAGIC or fp != self._fp:
            msg = (
                f"refit header mismatch (magic {magic:#x}, fingerprint {fp} vs ours "
                f"{self._fp}): sender and receiver prepared different layouts"
            )
            self._publish_error(msg)
            raise RefitError(f"rank {g.rank}: {msg}")
        return version

    def _watch(self) -> str | None:
        """What a peer reported failing in this refit: the sender watches every receiver, a
        receiver the sender."""
        assert self.info is not None  # watched only during a refit, after prepare
        src = self.info.src
        g = self.group
        return self._errors_of([src] if g.rank != src else (r for r in range(g.world_size) if r != src))

    def _peers(self) -> list[int]:
        assert self.info is not None  # asked only after prepare
        return [r for r in range(self.group.world_size) if r != self.info.src]

    def _handshake(self, my_status: str, what: str) -> None:
        """Post this rank's status, wait for everyone's, raise if any rank failed.

        The error lists this rank's own problems first, then every other failing rank's.
        """
        g = self.group
        g.store.set(self._key(self._gen, "status", g.rank), my_status.encode())  # type: ignore[arg-type]  # torch's stub: str only
        g.wait_for_ranks(lambda r: self._key(self._gen, "status", r), range(g.world_size), what)
        others = []
        for r in range(g.world_size):
            st = g.store.get(self._key(self._gen, "status", r)).decode()
            if st != "ok" and r != g.rank:
                others.append(f"rank {r}: {st}")
        if my_status == "ok" and not others:
            return
        mine = [] if my_status == "ok" else [f"this rank: {my_status}"]
        raise RefitMismatchError(
            f"rank {g.rank}: refit handshake failed, no weights were moved. " + " | ".join(mine + others)
        )

    def release_buffers(self) -> None:
        """Free the bucket buffers (they are re-allocated by the next refit)."""
        self._bufs = []
        self._wire = []
        self._views = None
