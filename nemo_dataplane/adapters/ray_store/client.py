"""Ray object-store backend: :class:`DataPlaneClient` over Ray's shared-memory object store.

Where the bytes go: each put writes its fields as (at most two) objects ("chunks": the bulk
fields, and the narrow per-sample columns; each field as its rows of that put, dense
``[B, ...]`` or jagged values + offsets) with ``ray.put`` *from the putting process*, one copy
into shared memory. A named metadata actor (:class:`~.actors.StoreIndex`) maps
``(partition, key, field)`` to ``(chunk, row)`` and holds the chunks' refs, tags, partitions and
claims, never tensors. A reader asks it where its rows are and resolves the refs itself: on
the same node that maps the writer's memory, across nodes Ray moves the chunk node to node.
Neither the driver nor the metadata actor touches bulk.

Lifetime: an object in Ray belongs to the process that put it and dies with it. With
``ray_store.adopt_objects`` (default) the index has a keeper actor on the writer's node copy
each chunk, off the put's path, into an object the index owns, so rows outlive their writer
(``flush()`` waits for that; ``close()`` of a writer calls it). ``kv_clear`` drops the index's
refs, which frees the objects. The index itself belongs to the client that created it
(``bootstrap=True``/``"auto"``): its ``close()`` ends the store.

Reads return private copies unless ``ray_store.zero_copy_reads``: then a read of a contiguous run
of one put's rows returns views of the shared object (Ray's own zero-copy semantics; writing
into them corrupts the store for every reader).
"""

from __future__ import annotations

import os
import threading
import uuid
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import ray
from tensordict import TensorDict

from nemo_dataplane.adapters.actor_store import ActorBackedClient, Bootstrap
from nemo_dataplane.adapters.chunks import assemble, bundles, decode, encode
from nemo_dataplane.adapters.ray_store.actors import StoreIndex
from nemo_dataplane.client import (
    ClaimStatus,
    DataPlaneError,
    Fields,
    StoreFullError,
    check_claim_args,
    check_keys,
    check_partition,
    check_put_args,
    check_select_fields,
    check_task,
    resolve_get_target,
)
from nemo_dataplane.codec import make_batch
from nemo_dataplane.config import DataPlaneConfig, RayStoreConfig, config_section
from nemo_dataplane.meta import KVBatchMeta
from nemo_dataplane.timeouts import check_timeout

DEFAULT_ACTOR = "nemo_dataplane.RayStoreIndex"
DEFAULT_NAMESPACE = "nemo_dataplane"


class RayStoreClient(ActorBackedClient):
    """:class:`DataPlaneClient` whose tensors live in Ray's object store.

    Args:
        config: the ``data_plane.ray_store`` section (or a whole ``DataPlaneConfig``).
        bootstrap: ``"auto"`` attaches to the named index actor or creates it; ``True`` creates
            it (error if it exists); ``False`` only attaches (what worker actors use).
        actor_name / namespace: the index actor to attach to or create.

    Raises:
        DataPlaneError: nothing to attach to (``bootstrap=False``), an index already exists
            (``bootstrap=True``), or it did not answer within ``bootstrap_timeout_s``.
    """

    BACKEND = "ray"
    SECTION = "ray_store"
    NAME_KWARG = "actor_name"
    WHAT = "Ray store index"

    def __init__(
        self,
        config: RayStoreConfig | DataPlaneConfig | Mapping[str, Any] | None = None,
        bootstrap: Bootstrap = "auto",
        actor_name: str = DEFAULT_ACTOR,
        namespace: str = DEFAULT_NAMESPACE,
    ) -> None:
        self.cfg: RayStoreConfig = RayStoreConfig() if config is None else config_section(config, "ray_store", "config")
        self._index: Any = None
        self._lock = threading.Lock()
        self._commits: dict[Any, str] = {}  # commit replies not yet checked -> what the put was
        self._writer = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self._index = self._open(bootstrap, actor_name, namespace, log_to_driver=False)
        self._node = ray.get_runtime_context().get_node_id()

    # ------------------------------------------------------------- bootstrap
    def _create(self) -> Any:
        self._index = (
            ray.remote(StoreIndex)
            .options(name=self.actor_name, namespace=self.namespace, num_cpus=self.cfg.index_num_cpus)
            .remote(lock_timeout_s=self.cfg.op_timeout_s, adopt=self.cfg.adopt_objects)
        )
        self.owns_store = True
        return self._attach(self._index)

    def _attach(self, handle: Any) -> Any:
        where = f"{self.actor_name!r} in Ray namespace {self.namespace!r}"
        try:
            ray.get(handle.ready.remote(), timeout=self.cfg.bootstrap_timeout_s)
        except ray.exceptions.GetTimeoutError:
            raise DataPlaneError(
                f"the Ray store index {where} did not answer within bootstrap_timeout_s="
                f"{self.cfg.bootstrap_timeout_s}s (is the cluster out of CPUs or the process that creates it stuck?)"
            ) from None
        except ray.exceptions.RayActorError as e:
            raise DataPlaneError(f"the Ray store index {where} died: {e}") from None
        return handle

    # ------------------------------------------------------------- lifecycle
    def flush(self, timeout_s: float | None = None) -> int:
        """Wait until every row this client put is owned by the store (``adopt_objects``), and
        check the put commits not yet checked; returns how many chunks are still owned by this
        process (0 unless a keeper failed or ``timeout_s`` passed).

        Raises:
            DataPlaneError: an earlier put's commit was refused by the index.
            ValueError: ``timeout_s`` is negative, NaN or infinite.
        """
        if timeout_s is not None:
            timeout_s = check_timeout(timeout_s, "timeout_s")
        self._check_open()
        return self._flush(timeout_s)

    def _flush(self, timeout_s: float | None) -> int:
        timeout = self.cfg.op_timeout_s if timeout_s is None else timeout_s
        self._check_commits(wait=True)
        return int(self._call("flush", "*", 0, self._index.flush.remote(self._writer, timeout), timeout + 5))

    def _disconnect(self) -> None:
        """A writer waits (bounded) until its rows are owned by the store before it detaches."""
        if self.owns_store or not ray.is_initialized():
            return  # the owner's teardown frees every object anyway
        try:
            left = self._flush(None)
            if left:
                warnings.warn(
                    f"RayStoreClient.close: {left} chunk(s) put by this process are not owned by the store "
                    "and will be lost when it exits",
                    RuntimeWarning,
                    stacklevel=3,
                )
        except Exception as e:  # noqa: BLE001 - closing must not raise; the store may be gone
            warnings.warn(f"RayStoreClient.close: flush failed: {e}", RuntimeWarning, stacklevel=3)

    def _teardown(self) -> None:
        """The creator kills the index, which frees every object."""
        if self.owns_store and self._index is not None and ray.is_initialized():
            try:
                ray.kill(self._index)
            except Exception:  # noqa: BLE001 - already dead
                pass
        self.owns_store = False

    def stats(self) -> dict[str, int]:
        """The index's counts: partitions, rows, chunks, and chunks still owned by their writer."""
        self._check_open()
        return dict(ray.get(self._index.stats.remote(), timeout=self.cfg.op_timeout_s))

    # ----------------------------------------------------------- op plumbing
    def _call(self, op: str, partition_id: str, n_keys: int, ref: Any, timeout_s: float | None = None) -> Any:
        """Wait for an index reply (bounded) and turn ``("error", kind, msg)`` into the exception."""
        timeout = self.cfg.op_timeout_s if timeout_s is None else timeout_s
        try:
            reply = ray.get(ref, timeout=timeout)
        except ray.exceptions.GetTimeoutError:
            raise TimeoutError(
                f"Ray store {op} on partition {partition_id!r} ({n_keys} keys) did not finish within {timeout}s"
            ) from None
        except ray.exceptions.RayActorError as e:
            raise DataPlaneError(f"Ray store {op} on partition {partition_id!r}: the index actor died: {e}") from None
        if isinstance(reply, tuple) and reply and reply[0] == "error":
            _, kind, msg = reply
            raise {"KeyError": KeyError, "ValueError": ValueError}.get(kind, DataPlaneError)(msg)
        return reply

    def _check_commits(self, wait: bool) -> None:
        """Raise for a put whose (unawaited) commit the index refused; forget the accepted ones."""
        with self._lock:
            pending = list(self._commits)
        if not pending:
            return
        timeout = self.cfg.op_timeout_s if wait else 0
        ready, _ = ray.wait(pending, num_returns=len(pending), timeout=timeout, fetch_local=True)
        failed = []
        for ref in ready:
            with self._lock:
                what = self._commits.pop(ref, "?")
            try:
                reply = ray.get(ref, timeout=self.cfg.op_timeout_s)
            except ray.exceptions.RayError as e:
                reply = ("error", "DataPlaneError", str(e))
            if reply[0] == "error":
                failed.append(f"{what}: {reply[2]}")
        if failed:
            raise DataPlaneError(f"{len(failed)} earlier put(s) were not stored: {failed[:3]}")

    # ------------------------------------------------------------------- put
    def kv_batch_put(
        self,
        keys: Sequence[str],
        partition_id: str,
        fields: Fields | None,
        tags: Sequence[Mapping[str, Any]] | None = None,
    ) -> KVBatchMeta:
        self._check_open()
        keys, pid, columns, tag_list = check_put_args(keys, partition_id, fields, tags)
        self._check_commits(wait=False)
        txn = uuid.uuid4().hex
        # The index locks the keys and merges tags while this process writes the chunks.
        begun = self._index.begin.remote(txn, pid, keys, tag_list, list(columns))
        try:
            chunks = [
                (list(group), ray.put({n: encode(group[n].detach()) for n in group})) for group in bundles(columns)
            ]
        except (ray.exceptions.ObjectStoreFullError, ray.exceptions.OutOfDiskError) as e:
            # Ray's own bound: the object store is full and spilling cannot take the chunk.
            # The chunks already put are unreferenced once this frame is gone: nothing stays.
            self._index.abort.remote(txn)
            raise StoreFullError(
                f"Ray store put of {len(keys)} key(s) to {pid!r} (e.g. {keys[0]!r}): the Ray object store "
                f"is full and cannot spill ({type(e).__name__}); nothing of the put was written"
            ) from None
        except BaseException:
            self._index.abort.remote(txn)
            raise
        # Not awaited: anyone who touches these keys waits for it at the index (see
        # actors.py); a refusal surfaces at the next put or flush().
        committed = self._index.commit.remote(txn, chunks, self._writer, self._node)
        with self._lock:
            self._commits[committed] = f"put of {len(keys)} key(s) to {pid!r} (e.g. {keys[0]!r})"
        _, merged, common = self._call("kv_batch_put", pid, len(keys), begun)
        return KVBatchMeta(keys=tuple(keys), tags=merged, partition_id=pid, fields=common)

    # ------------------------------------------------------------------- get
    def kv_batch_get(
        self,
        meta_or_keys: KVBatchMeta | Sequence[str],
        select_fields: Sequence[str],
        partition_id: str | None = None,
    ) -> TensorDict:
        self._check_open()
        keys, pid = resolve_get_target(meta_or_keys, partition_id)
        names = check_select_fields(select_fields)
        if not keys:
            return TensorDict({}, batch_size=[0])
        _, where, refs = self._call("kv_batch_get", pid, len(keys), self._index.resolve.remote(pid, keys, names))
        cids = list(refs)
        try:
            objs = ray.get([refs[c] for c in cids], timeout=self.cfg.op_timeout_s)
        except ray.exceptions.GetTimeoutError:
            raise TimeoutError(
                f"Ray store kv_batch_get on partition {pid!r} ({len(keys)} keys): its objects did not arrive within "
                f"op_timeout_s={self.cfg.op_timeout_s}s"
            ) from None
        except (ray.exceptions.OwnerDiedError, ray.exceptions.ObjectLostError) as e:
            raise DataPlaneError(
                f"rows of partition {pid!r} were lost: the process that put them died before the store owned them "
                f"(data_plane.ray_store.adopt_objects={self.cfg.adopt_objects}): {type(e).__name__}"
            ) from None
        chunks = dict(zip(cids, objs))
        copy = not self.cfg.zero_copy_reads
        columns = {name: assemble(name, where[name], lambda cid, f: decode(chunks[cid][f]), copy) for name in names}
        return make_batch(columns, len(keys))

    # ----------------------------------------------------------- clear / list
    def kv_clear(self, keys: Sequence[str] | None, partition_id: str) -> None:
        self._check_open()
        pid = check_partition(partition_id)
        key_list = None if keys is None else check_keys(keys, allow_empty=True)
        if key_list == []:
            return
        self._call("kv_clear", pid, -1 if key_list is None else len(key_list), self._index.clear.remote(pid, key_list))

    def kv_list(self, partition_id: str) -> KVBatchMeta:
        self._check_open()
        pid = check_partition(partition_id)
        _, keys, tags, fields = self._call("kv_list", pid, 0, self._index.list.remote(pid))
        return KVBatchMeta(keys=keys, tags=tags, partition_id=pid, fields=fields)

    def kv_partitions(self) -> list[str]:
        self._check_open()
        return list(self._call("kv_partitions", "*", 0, self._index.partitions.remote()))

    # ---------------------------------------------------------------- claims
    def kv_claim(
        self, partition_id: str, task: str, fields: Sequence[str], batch_size: int, timeout_s: float
    ) -> KVBatchMeta:
        self._check_open()
        pid = check_partition(partition_id)
        task, names, batch_size, timeout_s = check_claim_args(task, fields, batch_size, timeout_s)
        ref = self._index.claim.remote(pid, task, names, batch_size, timeout_s)
        # The index bounds the wait by timeout_s; op_timeout_s covers getting the answer back.
        _, keys, tags, common = self._call("kv_claim", pid, batch_size, ref, timeout_s + self.cfg.op_timeout_s)
        return KVBatchMeta(keys=keys, tags=tags, partition_id=pid, fields=common)

    def kv_mark_consumed(self, keys: Sequence[str], partition_id: str, task: str) -> None:
        self._check_open()
        pid = check_partition(partition_id)
        task = check_task(task)
        key_list = check_keys(keys, allow_empty=True)
        if key_list:
            self._call("kv_mark_consumed", pid, len(key_list), self._index.mark_consumed.remote(pid, task, key_list))

    def kv_claim_status(self, partition_id: str, task: str, fields: Sequence[str]) -> ClaimStatus:
        self._check_open()
        pid = check_partition(partition_id)
        task = check_task(task)
        names = check_select_fields(fields)
        _, rows, produced, claimed, claimable = self._call(
            "kv_claim_status", pid, 0, self._index.claim_status.remote(pid, task, names)
        )
        return ClaimStatus(pid, task, rows, produced, claimed, claimable)
