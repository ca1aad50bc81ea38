"""Packed weight refit: trainer rank ``src`` sends its parameters to every generator rank.

``RefitSender`` / ``RefitReceiver`` tie the pieces of this family together (docs/refit.md):

* ``base.py``: the handshake of ``prepare_refit_info()``, headers (the family-neutral errors
  and header constants are ``refit/protocol.py``);
* ``plan.py``: ``RefitInfo`` and the schedule (buckets of small tensors, large ones on their own);
* ``collective.py``: broadcast or p2p over NCCL / gloo, double-buffered buckets;
* ``cuda_ipc.py``: ``transport="ipc"``, CUDA IPC peer copies on one host.

The shard-to-shard family (trainer and generator sharded differently) is ``refit/reshard/``.
"""

from __future__ import annotations

import json

import torch

from nemo_dataplane.distributed.stateless_group import StatelessProcessGroup
from nemo_dataplane.refit.config import DEFAULT_BUCKET_BYTES_CPU, DEFAULT_BUCKET_BYTES_GPU
from nemo_dataplane.refit.config import PACKED_TRANSPORTS as TRANSPORTS
from nemo_dataplane.refit.copies import ALIGN as _ALIGN
from nemo_dataplane.refit.packed.base import diff_specs
from nemo_dataplane.refit.packed.collective import CollectiveReceiver, CollectiveSender
from nemo_dataplane.refit.packed.cuda_ipc import IPC_COPY_ON, IPC_DIRECTIONS, IpcReceiver, IpcSender
from nemo_dataplane.refit.packed.plan import DEFAULT_GROUP_BYTES, DEFAULT_TRANSPORT_GPU, RefitInfo
from nemo_dataplane.refit.protocol import (
    STATUS_ABORT,
    NamedTensors,
    RefitError,
    RefitMismatchError,
    WeightReceiver,
    WeightSender,
)
from nemo_dataplane.refit.protocol import clip as _clip

__all__ = ["TRANSPORTS", "RefitReceiver", "RefitSender"]


class RefitSender(CollectiveSender, IpcSender, WeightSender):
    """Trainer side: broadcasts ``named_tensors`` from this rank (the group's ``src``).

    Args:
        group: the refit group; this rank is the source.
        named_tensors: name -> tensor (a dict, pairs, or a callable returning either); tensors
            may be non-contiguous; they must keep their layout after ``prepare_refit_info``.
        bucket_bytes: bucket size (default 1 GiB on GPU, 64 MiB on CPU).
        direct_bytes: tensors at least this large skip the buckets and go on their own; ``0``
            sends every tensor on its own. Default: ``0`` on GPU when ``bucket_bytes`` is not
            given (per tensor is faster than packing over NVLink, docs/refit.md section 5),
            otherwise only tensors larger than a bucket.
        group_bytes: on GPU, direct tensors are issued in NCCL groups of about this many bytes.
        transport: ``"broadcast"`` (one broadcast per transfer), ``"p2p"`` (send/recv from the
            source to each receiver; no faster than broadcast over NVLink, docs/refit.md
            section 5), ``"ipc"`` (same host, NCCL group: receivers copy from this process's
            tensors through CUDA IPC handles with copy-engine peer copies; raises if a rank is
            elsewhere or cannot open the handles) or ``"auto"`` (on NCCL with at most
            ``AUTO_IPC_MAX_RECEIVERS`` receivers: ``"ipc"`` when every rank is on this host and
            sees this GPU, falling back to ``DEFAULT_TRANSPORT_GPU`` if setup fails anywhere;
            otherwise ``DEFAULT_TRANSPORT_GPU``; on gloo: broadcast).
            ``self.transport`` holds the one in use after ``prepare_refit_info()``.
        ipc_direction: ``"ipc"``: ``"push"`` (receivers export their tensors once; at
            ``send_weights()`` this process writes into them with copy-engine copies, gated on
            the GPU by every receiver having entered ``receive_weights()`` and finished its
            queued work on them; no host round trip before the first byte moves), ``"pull"``
            (receivers open this process's tensors and copy them out once the refit header
            reached their host) or ``None`` (push where this process sees every receiver's GPU,
            else pull). docs/refit.md, section 3.
        ipc_copy_on: pull only: the receiver issues its copies on a stream of the sender's GPU
            (``"src"``) or of its own (``"dst"``); equally fast (docs/refit.md, section 5).
        channel: store namespace, for several senders on one group.
    """

    def __init__(
        self,
        group: StatelessProcessGroup,
        named_tensors: NamedTensors,
        bucket_bytes: int | None = None,
        *,
        direct_bytes: int | None = None,
        group_bytes: int = DEFAULT_GROUP_BYTES,
        transport: str = "auto",
        ipc_direction: str | None = None,
        ipc_copy_on: str = "src",
        channel: str = "default",
    ) -> None:
        super().__init__(group, named_tensors, channel)
        if transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {TRANSPORTS}, got {transport!r}")
        if transport == "ipc" and not self._cuda:
            raise ValueError("transport='ipc' needs CUDA tensors on an NCCL group (backend='nccl')")
        if ipc_copy_on not in IPC_COPY_ON:
            raise ValueError(f"ipc_copy_on must be one of {IPC_COPY_ON}, got {ipc_copy_on!r}")
        self.ipc_copy_on = ipc_copy_on
        if ipc_direction is not None and ipc_direction not in IPC_DIRECTIONS:
            raise ValueError(f"ipc_direction must be one of {IPC_DIRECTIONS} or None, got {ipc_direction!r}")
        self.ipc_direction = ipc_direction
        self._direction = "pull"
        self._requested = transport
        packed_by_default = bucket_bytes is not None or not self._cuda
        if bucket_bytes is None:
            bucket_bytes = DEFAULT_BUCKET_BYTES_GPU if self._cuda else DEFAULT_BUCKET_BYTES_CPU
        if bucket_bytes < _ALIGN:
            raise ValueError(f"bucket_bytes must be >= {_ALIGN}, got {bucket_bytes}")
        self.bucket_bytes = int(bucket_bytes)
        if direct_bytes is None:
            # GPU default: per-tensor (measured faster than packing on NVLink, docs/refit.md);
            # an explicit bucket_bytes, or CPU, means packing.
            direct_bytes = self.bucket_bytes + 1 if packed_by_default else 0
        self.direct_bytes = int(direct_bytes)
        self.group_bytes = int(group_bytes)
        if transport == "auto":
            transport = DEFAULT_TRANSPORT_GPU if self._cuda else "broadcast"
        self.transport = transport
        self.src = group.rank
        self.version: int | None = None

    def prepare_refit_info(self) -> RefitInfo:
        """Publish names/shapes/dtypes; return once every receiver accepted them (collective).

        Raises ``RefitMismatchError`` listing each receiver's mismatches if any rank rejects.
        """
        g = self.group
        self._gen += 1
        self._drop_ipc()
        self._post_host()
        try:
            specs, tensors = self._specs_and_tensors()
            transport, fallback = self._choose_transport()
            extra: dict[str, object] = {}
            if transport == "ipc":
                extra = {"ipc_fallback": fallback, "ipc_direction": self._direction}
                if self._direction == "pull":
                    extra.update(ipc_copy_on=self.ipc_copy_on)
            info = RefitInfo(
                tuple(specs),
                self.bucket_bytes,
                self.direct_bytes,
                self.src,
                self.group_bytes,
                transport=transport,
                extra=extra,
            )
        except Exception as e:
            # Receivers are waiting on this key; tell them why instead of letting them time out.
            g.store.set(self._key(self._gen, "info"), json.dumps({"error": str(e)}).encode())  # type: ignore[arg-type]  # torch's stub: str only
            raise
        g.store.set(self._key(self._gen, "info"), info.to_bytes())  # type: ignore[arg-type]  # torch's stub: str only
        self._compile(info)
        self._handshake("ok", "refit handshake (waiting for receivers to check the layout)")
        if info.transport == "ipc" and info.extra.get("ipc_direction") == "push":
            self._open_push(self._ordered(tensors))
        elif info.transport == "ipc":
            self._export_ipc(self._ordered(tensors))
        self._connect_p2p()
        # self.info, not info: a failed IPC setup under transport="auto" recompiled it (broadcast).
        assert self.info is not None
        self.transport = self.info.transport
        return self.info

    def send_weights(self, version: int) -> None:
        """Broadcast all tensors, tagged with ``version``; returns when the last byte left (bounded)."""
        if self.info is None:
            raise RefitError(f"rank {self.group.rank}: call prepare_refit_info() before send_weights()")
        self._seq += 1
        if self._push_src is not None:
            with torch.no_grad():
                self._send_push(version)  # checks the tensors itself, after issuing the copies
            self.version = version
            return
        try:
            ordered = self._ordered(self._tensors())
        except Exception as e:
            # Receivers are blocked on the header broadcast: tell them to stop, then raise.
            self._publish_error(str(e))
            self._broadcast_header(version, STATUS_ABORT)
            raise
        try:
            with torch.no_grad():
                if self.info.transport == "ipc":
                    self._send_ipc(ordered, version)
                elif self._cuda:
                    self._send_cuda(ordered, version)
                else:
                    self._send_cpu(ordered, version)
        except Exception as e:
            self._publish_error(f"sender failed during refit of version {version}: {e}")
            raise
        self.version = version


class RefitReceiver(CollectiveReceiver, IpcReceiver, WeightReceiver):
    """Generator side: receives into ``named_tensors`` in place from rank ``src``.

    ``version`` holds the version of the last completed refit (``None`` before the first).
    """

    def __init__(
        self, group: StatelessProcessGroup, named_tensors: NamedTensors, src: int = 0, *, channel: str = "default"
    ) -> None:
        super().__init__(group, named_tensors, channel)
        if src == group.rank:
            raise ValueError(f"RefitReceiver on rank {src}, which is the source; use RefitSender there")
        self.src = src
        self.version: int | None = None

    def prepare_refit_info(self) -> RefitInfo:
        """Read the sender's metadata, check it against our tensors, agree with every rank (collective).

        Raises ``RefitMismatchError`` listing the mismatches (ours and other ranks') before any
        bulk data moves.
        """
        g = self.group
        self._gen += 1
        self._drop_ipc()
        self._post_host()
        key = self._key(self._gen, "info")
        g.wait_for_ranks(lambda r: key, [self.src], f"refit info from sender rank {self.src}")
        raw = g.store.get(key)
        decoded = json.loads(raw)
        if "error" in decoded:
            msg = f"sender rank {self.src} failed to prepare: {decoded['error']}"
            g.store.set(self._key(self._gen, "status", g.rank), msg.encode())  # type: ignore[arg-type]  # torch's stub: str only
            raise RefitError(f"rank {g.rank}: {msg}")
        info = RefitInfo.from_bytes(raw)
        problems: list[str] = []
        try:
            specs, _ = self._specs_and_tensors()
            problems = diff_specs(info.tensors, specs)
        except RefitError as e:
            problems = [str(e)]
        if info.src != self.src:
            problems.insert(0, f"sender is rank {info.src}, receiver expects src={self.src}")
        status = "ok" if not problems else f"{len(problems)} mismatch(es): {_clip(problems)}"
        self._handshake(status, "refit handshake (waiting for every rank to check the layout)")
        self._compile(info)
        if info.transport == "ipc" and info.extra.get("ipc_direction") == "push":
            self._export_push()
        elif info.transport == "ipc":
            self._open_ipc()
        self._connect_p2p()
        # self.info, not info: a failed IPC setup under transport="auto" recompiled it (broadcast).
        assert self.info is not None
        return self.info

    def receive_weights(self) -> int:
        """Receive one refit into our tensors in place; return (and store) its version."""
        if self.info is None:
            raise RefitError(f"rank {self.group.rank}: call prepare_refit_info() before receive_weights()")
        self._seq += 1
        if self._push_tgt is not None:
            with torch.no_grad():
                self.version = self._recv_push()  # checks the tensors itself, after posting ready
            return self.version
        try:
            ordered = self._ordered(self._tensors())
        except RefitMismatchError as e:
            # Nothing was received yet; the sender is told and its send stops at the timeout
            # check instead of hanging.
            self._publish_error(str(e))
            raise
        try:
            with torch.no_grad():
                if self.info.transport == "ipc":
                    version = self._recv_ipc(ordered)
                elif self._cuda:
                    version = self._recv_cuda(ordered)
                else:
                    version = self._recv_cpu(ordered)
        except RefitError:
            raise
        except Exception as e:
            self._publish_error(f"receiver failed: {e}")
            raise
        self.version = version
        return version
