"""Worker-side fetch: how a policy rank gets its DP shard from the store, and writes results back.

A DP shard is shared by a *replica group*: the TP x CP x PP ranks that hold one model replica
and must see identical data. Fetch policies:

* ``independent``: every rank of the group fetches the meta itself (cheapest when the group has
  one rank; with more, the store serves the same bytes several times);
* ``leader_broadcast``: the group's leader (its first rank) fetches once and broadcasts over the
  group's ``torch.distributed`` process group (gloo on CPU, NCCL on GPU). Tensors travel as
  tensors (raw bytes viewed as ``uint8``, headed by a small ``int64`` shape/dtype header; jagged
  fields as values + offsets), never pickled; non-leaders need no store client;
* ``auto``: ``leader_broadcast`` when the group has more than one rank, else ``independent``.

The packing plan comes from the driver (``meta.extra_info["packing"]``) and is re-attached as-is:
re-packing locally could give DP ranks different micro-batch counts (see
:func:`nemo_dataplane.driver.preshard.driver_balanced_preshards`).

Write-back is leader-only under every policy, so each field is written exactly once per key.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, get_args

import torch
import torch.distributed as dist
from tensordict import TensorDict

from nemo_dataplane.client import DataPlaneClient, check_select_fields
from nemo_dataplane.codec import normalize_fields
from nemo_dataplane.config import FetchPolicy
from nemo_dataplane.dtypes import check_shape, dtype_code, dtype_from_code
from nemo_dataplane.meta import KVBatchMeta
from nemo_dataplane.rows import split_microbatches
from nemo_dataplane.timeouts import check_timeout

__all__ = ["FetchPolicy", "FetchedBatch", "WorkerFetcher"]

_OK, _ERROR = 0, 1


@dataclass(frozen=True)
class FetchedBatch:
    """One rank's fetched shard.

    Attributes:
        data: the selected fields, rows in ``meta`` order.
        microbatches: ``data`` cut by the driver's plan (one micro-batch when there is no plan).
        plan: ``meta.extra_info["packing"]`` or ``None``.
        meta: the meta that was fetched.
    """

    data: TensorDict
    microbatches: list[TensorDict]
    plan: dict[str, Any] | None
    meta: KVBatchMeta = field(repr=False)


class WorkerFetcher:
    """Fetch a rank's share of a batch under a fetch policy; write results back leader-only.

    Args:
        client: the store client; may be ``None`` on non-leaders under ``leader_broadcast``.
        fetch_policy: ``independent`` | ``leader_broadcast`` | ``auto``.
        replica_group: the ``torch.distributed`` group of ranks sharing this DP shard
            (``None``: this rank alone).
        replica_ranks: the group's global ranks, leader first (default: the group's ranks).
        timeout_s: bound on each broadcast and each async store op (sync store ops are bounded
            by the client's own op timeout, e.g. ``data_plane.transfer_queue.op_timeout_s``).

    Raises:
        ValueError: an unknown policy, a ``timeout_s`` that is not a finite number > 0, this rank
            missing from ``replica_ranks``, or a rank that must touch the store without a client
            (names the rank).
    """

    def __init__(
        self,
        client: DataPlaneClient | None,
        *,
        fetch_policy: FetchPolicy = "auto",
        replica_group: dist.ProcessGroup | None = None,
        replica_ranks: Sequence[int] | None = None,
        timeout_s: float = 300.0,
    ) -> None:
        if fetch_policy not in get_args(FetchPolicy):
            raise ValueError(f"fetch_policy must be 'independent', 'leader_broadcast' or 'auto', got {fetch_policy!r}")
        self.client = client
        self.replica_group = replica_group
        self.timeout_s = check_timeout(timeout_s, "timeout_s", allow_zero=False)
        if replica_group is not None:
            ranks = list(replica_ranks) if replica_ranks is not None else dist.get_process_group_ranks(replica_group)
            self.rank = dist.get_rank()
            if self.rank not in ranks:
                raise ValueError(f"rank {self.rank} is not in its replica group {ranks}")
            if len(ranks) != dist.get_world_size(replica_group):
                raise ValueError(
                    f"replica_ranks {ranks} do not match the replica group's size {dist.get_world_size(replica_group)}"
                )
        else:
            ranks = list(replica_ranks) if replica_ranks is not None else [0]
            if len(ranks) > 1:
                raise ValueError(f"replica_ranks {ranks} name several ranks but no replica_group was given")
            self.rank = ranks[0]
        self.replica_ranks: tuple[int, ...] = tuple(ranks)
        self.leader_rank = self.replica_ranks[0]
        self.is_leader = self.rank == self.leader_rank
        if fetch_policy == "auto":
            fetch_policy = "leader_broadcast" if len(self.replica_ranks) > 1 else "independent"
        self.fetch_policy: FetchPolicy = fetch_policy
        touches_store = self.is_leader or self.fetch_policy == "independent"
        if touches_store and client is None:
            raise ValueError(
                f"rank {self.rank} fetches from the store under fetch_policy={self.fetch_policy!r} "
                f"(leader={self.is_leader}) but was given client=None"
            )
        self._device = torch.device("cpu")
        if replica_group is not None and dist.get_backend(replica_group) == "nccl":
            self._device = torch.device("cuda", torch.cuda.current_device())

    # ------------------------------------------------------------------ fetch
    def fetch(self, meta: KVBatchMeta, select_fields: Sequence[str]) -> FetchedBatch:
        """Fetch ``select_fields`` of ``meta``'s keys under the policy; every rank of the replica
        group gets identical CPU tensors, rows in ``meta`` order, cut by the driver's plan.

        Under ``leader_broadcast`` every rank of the group must call this with the same meta and
        fields. A leader that fails to fetch tells the others, so they raise too (no hang).
        Store ops are bounded by the client's own op timeout; each broadcast by ``timeout_s``.

        Raises:
            KeyError: missing keys/fields (on the leader; relayed to non-leaders as RuntimeError).
            TimeoutError: a broadcast took longer than ``timeout_s``.
        """
        names = check_select_fields(select_fields)
        if self.fetch_policy == "independent" or len(self.replica_ranks) == 1:  # nobody to broadcast to
            data = self._client().kv_batch_get(meta, names)
        elif self.is_leader:
            try:
                data = self._client().kv_batch_get(meta, names)
                header, payload = self._encode(data, names)
            except BaseException as e:
                self._send_error(f"{type(e).__name__}: {e}")
                raise
            self._send(header, payload)
        else:
            data = self._receive(names)
        return self._finish(meta, data)

    async def async_fetch(self, meta: KVBatchMeta, select_fields: Sequence[str]) -> FetchedBatch:
        """Async twin of :meth:`fetch` (the store op is awaited with a ``timeout_s`` bound; the
        broadcast runs in a worker thread so the event loop stays free)."""
        names = check_select_fields(select_fields)
        if self.fetch_policy == "independent" or len(self.replica_ranks) == 1:  # nobody to broadcast to
            data = await self._async_get(meta, names)
        elif self.is_leader:
            try:
                data = await self._async_get(meta, names)
                header, payload = self._encode(data, names)
            except BaseException as e:
                await asyncio.to_thread(self._send_error, f"{type(e).__name__}: {e}")
                raise
            await asyncio.to_thread(self._send, header, payload)
        else:
            data = await asyncio.to_thread(self._receive, names)
        return self._finish(meta, data)

    def _client(self) -> DataPlaneClient:
        assert self.client is not None  # checked in __init__ for every rank that touches the store
        return self.client

    def _finish(self, meta: KVBatchMeta, data: TensorDict) -> FetchedBatch:
        n = data.batch_size[0] if data.batch_dims else 0
        if n != len(meta):
            raise RuntimeError(f"rank {self.rank}: fetched {n} rows for a meta of {len(meta)} keys")
        plan = (meta.extra_info or {}).get("packing")
        return FetchedBatch(data=data, microbatches=split_microbatches(data, plan), plan=plan, meta=meta)

    async def _async_get(self, meta: KVBatchMeta, names: list[str]) -> TensorDict:
        try:
            return await asyncio.wait_for(self._client().async_kv_batch_get(meta, names), self.timeout_s)
        except asyncio.TimeoutError:
            raise TimeoutError(
                f"rank {self.rank}: fetching {len(meta)} keys of partition {meta.partition_id!r} took over "
                f"{self.timeout_s}s"
            ) from None

    # ------------------------------------------------------------ write-back
    def write_back(self, meta: KVBatchMeta, fields: Mapping[str, torch.Tensor] | TensorDict) -> KVBatchMeta | None:
        """Write ``fields`` (one row per key of ``meta``, meta order) to the store, from the
        replica group's leader only; other ranks return ``None`` without touching the store.

        Returns:
            On the leader, ``meta`` with the fields added; elsewhere ``None``.
        """
        if not self.is_leader:
            return None
        cols = self._check_write(meta, fields)
        assert meta.partition_id is not None  # _check_write() refused a meta without one
        self._client().kv_batch_put(list(meta.keys), meta.partition_id, cols)
        return meta.add_fields(cols)

    async def async_write_back(
        self, meta: KVBatchMeta, fields: Mapping[str, torch.Tensor] | TensorDict
    ) -> KVBatchMeta | None:
        """Async twin of :meth:`write_back`, bounded by ``timeout_s``."""
        if not self.is_leader:
            return None
        cols = self._check_write(meta, fields)
        assert meta.partition_id is not None  # _check_write() refused a meta without one
        try:
            await asyncio.wait_for(
                self._client().async_kv_batch_put(list(meta.keys), meta.partition_id, cols),
                self.timeout_s,
            )
        except asyncio.TimeoutError:
            raise TimeoutError(f"rank {self.rank}: writing {sorted(cols)} back took over {self.timeout_s}s") from None
        return meta.add_fields(cols)

    @staticmethod
    def _check_write(meta: KVBatchMeta, fields: Mapping[str, torch.Tensor] | TensorDict) -> dict[str, torch.Tensor]:
        if meta.partition_id is None:
            raise ValueError("write_back: the meta has no partition_id")
        cols = normalize_fields(fields, len(meta))
        if not cols:
            raise ValueError("write_back: no fields given")
        return cols

    # -------------------------------------------------------------- broadcast
    def _bcast(self, t: torch.Tensor) -> None:
        work = dist.broadcast(t, src=self.leader_rank, group=self.replica_group, async_op=True)
        wait_work(
            work,
            self.timeout_s,
            f"rank {self.rank}: broadcast from replica leader rank {self.leader_rank}",
            on_device=t.is_cuda,
        )

    def _send_header(self, header: list[int]) -> None:
        self._bcast(torch.tensor([len(header)], dtype=torch.int64, device=self._device))
        self._bcast(torch.tensor(header, dtype=torch.int64, device=self._device))

    def _recv_header(self) -> list[int]:
        size = torch.zeros(1, dtype=torch.int64, device=self._device)
        self._bcast(size)
        header = torch.zeros(int(size.item()), dtype=torch.int64, device=self._device)
        self._bcast(header)
        return header.tolist()

    def _send_error(self, message: str) -> None:
        raw = torch.frombuffer(bytearray(message.encode()[:4096] or b"?"), dtype=torch.uint8)
        self._send_header([_ERROR, raw.numel()])
        self._bcast(raw.to(self._device))

    @staticmethod
    def _encode(data: TensorDict, names: list[str]) -> tuple[list[int], list[torch.Tensor]]:
        """Header ``[status, n_rows, n_fields, per field: jagged, dtype code, ndim, *values shape]``
        and the tensors to send (each field's values, then offsets for jagged fields).

        Raises:
            TypeError: a field whose dtype has no wire code (names it).
        """
        n = data.batch_size[0] if data.batch_dims else 0
        header = [_OK, n, len(names)]
        payload: list[torch.Tensor] = []
        for name in names:
            t = data.get(name)
            jagged = bool(getattr(t, "is_nested", False))
            values = t.values() if jagged else t
            code = dtype_code(values.dtype, f"field {name!r}")
            header += [int(jagged), code, values.dim(), *values.shape]
            payload.append(values)
            if jagged:
                payload.append(t.offsets().to(torch.int64))
        return header, payload

    def _send(self, header: list[int], payload: list[torch.Tensor]) -> None:
        self._send_header(header)
        for t in payload:
            if t.numel():
                self._bcast(_as_bytes(t).to(self._device))

    def _receive(self, names: list[str]) -> TensorDict:
        """A non-leader's side of :meth:`_send`: the header, then each field's tensors.

        Raises:
            RuntimeError: the leader relayed its failure, or sent other fields than asked for.
            ValueError: a dtype code, ndim or shape in the header out of range (names the field).
        """
        header = self._recv_header()
        if header[0] == _ERROR:
            raw = torch.zeros(header[1], dtype=torch.uint8, device=self._device)
            self._bcast(raw)
            message = bytes(raw.cpu().tolist()).decode(errors="replace")
            raise RuntimeError(f"rank {self.rank}: replica leader rank {self.leader_rank} failed to fetch: {message}")
        n, n_fields = header[1], header[2]
        if n_fields != len(names):
            raise RuntimeError(
                f"rank {self.rank}: leader rank {self.leader_rank} sent {n_fields} fields, this rank asked for {names}"
            )
        pos = 3
        out: dict[str, torch.Tensor] = {}
        for name in names:
            jagged, code, ndim = header[pos], header[pos + 1], header[pos + 2]
            # Decoded only through the dtype table: DTYPE_CODES[-1] would pick a dtype.
            dtype = dtype_from_code(code, f"rank {self.rank}: field {name!r} dtype code (header[{pos + 1}])")
            if not 0 <= ndim <= len(header) - pos - 3:
                raise ValueError(f"rank {self.rank}: field {name!r} ndim (header[{pos + 2}]): {ndim} out of range")
            shape = check_shape(header[pos + 3 : pos + 3 + ndim], f"rank {self.rank}: field {name!r}")
            pos += 3 + ndim
            values = self._recv_tensor(dtype, shape)
            if jagged:
                offsets = self._recv_tensor(torch.int64, [n + 1])
                out[name] = torch.nested.nested_tensor_from_jagged(values, offsets=offsets)
            else:
                out[name] = values
        return TensorDict(out, batch_size=[n])

    def _recv_tensor(self, dtype: torch.dtype, shape: Sequence[int]) -> torch.Tensor:
        numel = 1
        for d in shape:
            numel *= int(d)
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        buf = torch.empty(nbytes, dtype=torch.uint8, device=self._device)
        if nbytes:
            self._bcast(buf)
        return buf.cpu().view(dtype).reshape(list(shape))


def wait_work(work: Any, timeout_s: float, what: str, *, on_device: bool = False) -> None:
    """Wait for a ``torch.distributed`` work handle, ending within ``timeout_s`` on the host.

    gloo raises from ``wait`` on a timeout or a lost peer (it never returns ``False``); NCCL's
    ``wait`` only orders the current stream after the collective and returns at once, so the
    host-side bound is enforced here by polling ``is_completed`` (``on_device``). After a timeout
    the collective may still be pending: the group is unusable (its owner aborts or exits).

    Raises:
        TimeoutError: not done within ``timeout_s`` (names ``what`` and the bound).
        RuntimeError: the backend reported another failure, e.g. a peer that went away.
        ValueError: ``timeout_s`` is not a finite number > 0.
    """
    timeout_s = check_timeout(timeout_s, "timeout_s", allow_zero=False)
    deadline = time.monotonic() + timeout_s
    try:
        finished = work.wait(timeout=timedelta(seconds=timeout_s))
    except Exception as e:  # noqa: BLE001 - gloo's timeout / peer-loss errors are bare RuntimeErrors
        if "timed out" in str(e).lower() or "timeout" in str(e).lower():
            raise TimeoutError(f"{what} did not finish within {timeout_s:g}s: {e}") from e
        raise RuntimeError(f"{what} failed: {e}") from e
    if finished is False:  # backends that do report a timeout this way
        raise TimeoutError(f"{what} did not finish within {timeout_s:g}s")
    if on_device:
        delay = 1e-4
        while not work.is_completed():
            if time.monotonic() >= deadline:
                raise TimeoutError(f"{what} did not finish within {timeout_s:g}s (device collective still pending)")
            time.sleep(delay)
            delay = min(delay * 2, 0.01)


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A flat ``uint8`` view of ``t``'s bytes (copied only if ``t`` is not contiguous)."""
    return t.contiguous().reshape(-1).view(torch.uint8)
