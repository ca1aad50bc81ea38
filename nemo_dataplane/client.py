"""`DataPlaneClient`: the one boundary between training code and a key/value store.

Everything above this module (driver helpers, worker fetch, trainers) talks to a store only
through these methods; everything below (adapters) implements them. The in-process
:class:`~nemo_dataplane.adapters.memory.InMemoryClient` is the executable specification: where a
docstring here is ambiguous, its behaviour is the contract, and ``tests/unit/test_conformance.py``
holds every adapter to it.
"""

from __future__ import annotations

import asyncio
import warnings
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any, ClassVar

import torch
from tensordict import TensorDict

from nemo_dataplane.codec import normalize_fields
from nemo_dataplane.errors import NemoDataplaneError
from nemo_dataplane.meta import KVBatchMeta
from nemo_dataplane.timeouts import check_timeout

Fields = TensorDict | Mapping[str, torch.Tensor]


class DataPlaneError(NemoDataplaneError, RuntimeError):
    """A store could not be reached, bootstrapped or used (not a caller mistake)."""


class DataIntegrityError(DataPlaneError):
    """A fetched row's bytes differ from the digest recorded when it was put
    (``data_plane.verify_integrity``); the message names the key and the field."""


class RowIdentityError(DataIntegrityError):
    """A get returned, for some key, a row put for another key (or one without an identity):
    the store misplaced rows (``data_plane.verify_rows``); the message names the keys at fault."""


class StoreFullError(DataPlaneError):
    """A put would exceed a store capacity (``data_plane.max_rows``, or a backend's own byte
    bound such as ``InMemoryClient(max_bytes=...)``); the message names the bound, and nothing of
    the put was written."""


class ClaimsNotSupported(NemoDataplaneError, NotImplementedError):
    """The backend implements the by-key contract (``kv_partitions`` included) but not
    task-mediated claims."""


@dataclass(frozen=True)
class ClaimStatus:
    """Production/consumption of one partition as seen by one task (see :meth:`DataPlaneClient.kv_claim_status`).

    ``rows``: keys in the partition; ``produced``: keys whose named fields are all stored;
    ``claimed``: keys ``task`` has claimed (or marked consumed) that are still in the partition.
    """

    partition_id: str
    task: str
    rows: int
    produced: int
    claimed: int
    claimable: int  # produced and not yet claimed by ``task``


class DataPlaneClient(ABC):
    """Abstract key/value store for batches addressed by ``(partition_id, key)``.

    Contract shared by every adapter:

    * ``fields`` is a ``TensorDict`` or a dict of tensors with batch size ``len(keys)``; a jagged
      field is a ``torch.nested`` tensor of jagged layout (see :mod:`nemo_dataplane.codec`).
    * Putting to an existing key upserts: the given fields replace those fields, other fields
      and tags stay; given tags are merged into the key's tags.
    * A key repeated within one call raises ``ValueError``.
    * Reads return rows in the order of the keys asked for, each field with the dtype, shape and
      layout it was put with. ``select_fields`` is always explicit: nothing fetches every field.
    * A missing key or field raises ``KeyError`` naming what is missing; nothing is dropped.
    * ``kv_clear`` of absent keys or an unknown partition is a no-op.
    * A partition exists while it holds at least one key: ``kv_partitions`` lists exactly those.
    * Tags are flat dicts with non-empty ``str`` names. A value is a JSON value: ``None``,
      ``bool``, ``int`` (64-bit signed), ``float`` (NaN and infinities included), ``str``, or a
      ``list`` / ``dict`` (``str`` names) of those, nested. Every backend returns each value as
      given, type included (``1`` stays ``int``, ``True`` stays ``bool``, a list stays a list);
      anything else (a tuple, a tensor, a numpy scalar, bytes) is refused by :func:`check_tags`
      with a ``TypeError`` naming the tag, before anything is written.
    * ``meta.fields`` (of a put, list or claim) is a set of names: each listed once, in no
      particular order. Callers compare it as a set; backends may order it as they like.
    * After ``close()`` every other method (sync, async, claims) raises :class:`DataPlaneError`
      saying the client is closed, without waiting on the store; ``close()`` again does nothing.
    * Lifecycle of a shared store (one that other processes reach): the client that created it
      owns it, and only the owner's ``close()`` tears it down; an attached client's ``close()``
      releases only its own resources, and the store keeps serving every other client. A
      backend built with ``from_config(cfg, bootstrap)`` honours the three modes: ``True``
      creates the store and fails (``DataPlaneError``) if it exists; ``False`` attaches and
      fails (``DataPlaneError``, bounded) if there is nothing to attach to, creating nothing;
      ``"auto"`` attaches, or creates (and then owns) a store that does not exist. Once the
      owner's close has taken effect, attaching fails again.
    * Capacity is counted in keys (rows), every partition together: ``data_plane.max_rows``,
      enforced for every backend by :class:`~nemo_dataplane.wrappers.capacity.CapacityGuard`. A
      backend may also bound the bytes of the tensors it stores (the in-memory ``max_bytes``).
      A put past either bound raises :class:`StoreFullError` and writes nothing.

    Sync methods may be called from any thread; the ``async_`` twins may be gathered
    concurrently on one event loop.
    """

    #: Modules the store's own Ray actors import before they construct. A Ray cluster started for
    #: this store may have its idle worker processes import them ahead (``ray.init``'s
    #: ``preload_python_modules``), so its actors come up sooner. Empty: nothing to preload.
    ACTOR_MODULES: ClassVar[tuple[str, ...]] = ()

    # ------------------------------------------------------------------ by key
    @abstractmethod
    def kv_batch_put(
        self,
        keys: Sequence[str],
        partition_id: str,
        fields: Fields | None,
        tags: Sequence[Mapping[str, Any]] | None = None,
    ) -> KVBatchMeta:
        """Write ``fields`` (and merge ``tags``) for ``keys`` in ``partition_id``.

        Returns:
            A meta of exactly ``keys`` (in order) with their tags after the merge and ``fields``
            naming every field now stored for all of them.

        Raises:
            ValueError: no keys, a repeated key, ``tags`` of the wrong length, a field whose batch
                size is not ``len(keys)``, or neither fields nor tags given.
            TypeError: a non-tensor value or unsupported dtype (names the field).
            StoreFullError: the put would exceed a capacity (nothing was written).
        """

    @abstractmethod
    def kv_batch_get(
        self,
        meta_or_keys: KVBatchMeta | Sequence[str],
        select_fields: Sequence[str],
        partition_id: str | None = None,
    ) -> TensorDict:
        """Read ``select_fields`` of the given keys, rows in the order asked for.

        ``partition_id`` comes from the meta when a meta is given (passing a different one is
        a ``ValueError``) and is required when plain keys are given.

        Raises:
            ValueError: keys without ``partition_id``, empty or repeated ``select_fields``.
            KeyError: keys absent from the partition, or fields absent on some keys (names them).
        """

    @abstractmethod
    def kv_clear(self, keys: Sequence[str] | None, partition_id: str) -> None:
        """Delete ``keys`` (``None``: every key) of ``partition_id``; absent keys are ignored."""

    @abstractmethod
    def kv_list(self, partition_id: str) -> KVBatchMeta:
        """Every key in ``partition_id`` in insertion order, with tags; ``fields`` lists the
        fields stored for every one of them. An unknown partition gives an empty meta."""

    @abstractmethod
    def kv_partitions(self) -> list[str]:
        """Every partition holding at least one key, store-wide (whoever wrote it), each once,
        in no particular order. A partition appears with its first key (a tags-only put counts)
        and is gone once its last key is cleared; reads, lists, clears and claims of an unknown
        partition never create it. With ``kv_list`` this is how a driver finds what a step left
        in the store, and how a capacity is counted."""

    # ------------------------------------------------------ task-mediated claims
    # Streaming consumers (async GRPO's trainer) take rows as producers finish them. A claim is
    # per (partition, task, key): each task sees every produced row at most once, across all
    # clients and processes attached to the store; different tasks are independent. The
    # defaults raise :class:`ClaimsNotSupported`; the by-key methods above never depend on these.
    def kv_claim(
        self,
        partition_id: str,
        task: str,
        fields: Sequence[str],
        batch_size: int,
        timeout_s: float,
    ) -> KVBatchMeta:
        """Claim up to ``batch_size`` rows of ``partition_id`` for ``task``.

        A row is claimable when every field in ``fields`` is stored for it and ``task`` has not
        claimed it (nor marked it consumed). Waits until ``batch_size`` rows are claimable or
        ``timeout_s`` passes, then claims what is claimable (``batch_size`` at most, oldest
        first, i.e. in insertion order of the keys): at the deadline that may be fewer rows, or
        none (an empty meta). ``timeout_s=0`` claims what is ready without waiting. The claim is
        atomic: concurrent claimers of one task never receive the same row. A key cleared and
        put again is a new row (the newest); upserting a claimed key leaves it claimed. Claiming
        from an unknown partition does not create it.

        Returns:
            A meta of the claimed keys in that order, their tags as of the claim,
            ``partition_id`` set and ``fields`` naming (at least) ``fields``.

        Raises:
            ValueError: empty ``task`` or ``fields``, ``batch_size < 1``, a negative, NaN or
                infinite ``timeout_s``.
            ClaimsNotSupported: the backend has no claims.
        """
        raise ClaimsNotSupported(f"{type(self).__name__} does not implement kv_claim (task-mediated claims)")

    def kv_mark_consumed(self, keys: Sequence[str], partition_id: str, task: str) -> None:
        """Record ``keys`` as claimed by ``task`` without reading them (absent keys are ignored)."""
        raise ClaimsNotSupported(f"{type(self).__name__} does not implement kv_mark_consumed")

    def kv_claim_status(self, partition_id: str, task: str, fields: Sequence[str]) -> ClaimStatus:
        """How many rows of ``partition_id`` exist, are produced for ``fields`` and are claimed by
        ``task``. An unknown partition gives all zeros."""
        raise ClaimsNotSupported(f"{type(self).__name__} does not implement kv_claim_status")

    # ------------------------------------------------------------- lifecycle
    def close(self) -> None:
        """Release this client's resources. Shared infrastructure is only shut down by the
        client that created it; calling ``close`` twice is harmless. Afterwards every other
        method raises :class:`DataPlaneError` saying the client is closed."""

    def __enter__(self) -> DataPlaneClient:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # ------------------------------------------------------------ async twins
    # Default twins run the sync call in a worker thread so any adapter is usable from
    # asyncio.gather; adapters with a native async path override them.
    async def async_kv_batch_put(
        self,
        keys: Sequence[str],
        partition_id: str,
        fields: Fields | None,
        tags: Sequence[Mapping[str, Any]] | None = None,
    ) -> KVBatchMeta:
        """Async twin of :meth:`kv_batch_put`."""
        return await asyncio.to_thread(self.kv_batch_put, keys, partition_id, fields, tags)

    async def async_kv_batch_get(
        self,
        meta_or_keys: KVBatchMeta | Sequence[str],
        select_fields: Sequence[str],
        partition_id: str | None = None,
    ) -> TensorDict:
        """Async twin of :meth:`kv_batch_get`."""
        return await asyncio.to_thread(self.kv_batch_get, meta_or_keys, select_fields, partition_id)

    async def async_kv_clear(self, keys: Sequence[str] | None, partition_id: str) -> None:
        """Async twin of :meth:`kv_clear`."""
        await asyncio.to_thread(self.kv_clear, keys, partition_id)

    async def async_kv_list(self, partition_id: str) -> KVBatchMeta:
        """Async twin of :meth:`kv_list`."""
        return await asyncio.to_thread(self.kv_list, partition_id)

    async def async_kv_partitions(self) -> list[str]:
        """Async twin of :meth:`kv_partitions`."""
        return await asyncio.to_thread(self.kv_partitions)

    async def async_kv_claim(
        self, partition_id: str, task: str, fields: Sequence[str], batch_size: int, timeout_s: float
    ) -> KVBatchMeta:
        """Async twin of :meth:`kv_claim`."""
        return await asyncio.to_thread(self.kv_claim, partition_id, task, fields, batch_size, timeout_s)

    async def async_kv_mark_consumed(self, keys: Sequence[str], partition_id: str, task: str) -> None:
        """Async twin of :meth:`kv_mark_consumed`."""
        await asyncio.to_thread(self.kv_mark_consumed, keys, partition_id, task)

    async def async_kv_claim_status(self, partition_id: str, task: str, fields: Sequence[str]) -> ClaimStatus:
        """Async twin of :meth:`kv_claim_status`."""
        return await asyncio.to_thread(self.kv_claim_status, partition_id, task, fields)


# ---------------------------------------------------------------- argument checks
# Shared by adapters so every backend rejects bad input with the same words.


def check_partition(partition_id: Any) -> str:
    """Return ``partition_id`` if it is a non-empty str, else raise ``ValueError``."""
    if not isinstance(partition_id, str) or not partition_id:
        raise ValueError(f"partition_id must be a non-empty str, got {partition_id!r}")
    return partition_id


def check_keys(keys: Any, *, allow_empty: bool = False) -> list[str]:
    """Return ``keys`` as a list after checking they are unique non-empty strs.

    Raises:
        ValueError: naming the repeated keys, or when empty and ``allow_empty`` is false.
        TypeError: a key that is not a str.
    """
    if isinstance(keys, str):
        raise TypeError(f"keys must be a sequence of str, got the single str {keys!r}; wrap it in a list")
    key_list: list[str] = list(keys)
    if not key_list and not allow_empty:
        raise ValueError("keys must not be empty")
    for k in key_list:
        if not isinstance(k, str) or not k:
            raise TypeError(f"every key must be a non-empty str, got {k!r}")
    seen: set[str] = set()
    dups = []
    for k in key_list:
        if k in seen:
            dups.append(k)
        else:
            seen.add(k)
    if dups:
        raise ValueError(f"keys repeat within one call: {sorted(set(dups))[:10]}")
    return key_list


def check_select_fields(select_fields: Any) -> list[str]:
    """Return ``select_fields`` as a list of unique names, or raise ``ValueError``/``TypeError``."""
    if select_fields is None:
        raise ValueError("select_fields is required: name the fields to read (nothing fetches every field)")
    if isinstance(select_fields, str):
        select_fields = [select_fields]
    names = list(select_fields)
    if not names:
        raise ValueError("select_fields must name at least one field")
    for n in names:
        if not isinstance(n, str) or not n:
            raise TypeError(f"select_fields entries must be non-empty str, got {n!r}")
    if len(set(names)) != len(names):
        raise ValueError(f"select_fields repeats a name: {names}")
    return names


CLAIM_METHODS = ("kv_claim", "kv_mark_consumed", "kv_claim_status")


def claims_not_implemented(cls: type[DataPlaneClient]) -> list[str]:
    """The claim methods ``cls`` leaves to the ABC's defaults (which raise
    :class:`ClaimsNotSupported`); empty when it implements all of them."""
    return [m for m in CLAIM_METHODS if getattr(cls, m) is getattr(DataPlaneClient, m)]


def check_task(task: Any) -> str:
    """Return ``task`` if it is a non-empty str, else raise ``ValueError`` (claims' task name)."""
    if not isinstance(task, str) or not task:
        raise ValueError(f"task must be a non-empty str, got {task!r}")
    return task


def check_claim_args(task: Any, fields: Any, batch_size: Any, timeout_s: Any) -> tuple[str, list[str], int, float]:
    """Validate :meth:`DataPlaneClient.kv_claim`'s arguments (same words for every backend)."""
    check_task(task)
    names = check_select_fields(fields)
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be an int >= 1, got {batch_size!r}")
    return task, names, batch_size, check_timeout(timeout_s, "timeout_s")


_TAG_SCALARS = (type(None), bool, int, float, str)
_INT64 = (-(2**63), 2**63 - 1)
TAG_VALUES = "None, bool, int (64-bit), float, str, or a list / dict (str names) of those"


def _tag_value_problem(value: Any) -> str | None:
    """Why ``value`` is not a tag value (see the contract), or ``None``."""
    kind = type(value)
    if kind in _TAG_SCALARS:
        if kind is int and not _INT64[0] <= value <= _INT64[1]:
            return f"the int {value} does not fit in 64 bits"
        return None
    if kind is list:
        for item in value:
            if (why := _tag_value_problem(item)) is not None:
                return why
        return None
    if kind is dict:
        for name, item in value.items():
            if type(name) is not str:
                return f"a dict inside it has the non-str name {name!r}"
            if (why := _tag_value_problem(item)) is not None:
                return why
        return None
    return f"{kind.__module__}.{kind.__qualname__} is not a tag value ({TAG_VALUES})"


def check_tags(tags: Any, n_keys: int) -> list[dict[str, Any]] | None:
    """Return ``tags`` as a list of dicts of length ``n_keys`` (or ``None``).

    Raises:
        ValueError: not one dict per key.
        TypeError: a dict that is not one, a tag name that is not a non-empty ``str``, or a value
            that is not a tag value (see :class:`DataPlaneClient`); names the key's index and
            the tag.
    """
    if tags is None:
        return None
    tags = list(tags)
    if len(tags) != n_keys:
        raise ValueError(f"tags must hold one dict per key: got {len(tags)} for {n_keys} keys")
    out: list[dict[str, Any]] = []
    for i, t in enumerate(tags):
        if not isinstance(t, Mapping):
            raise TypeError(f"tags[{i}] must be a dict, got {type(t).__name__}")
        row = dict(t)
        for name, value in row.items():
            if type(name) is not str or not name:
                raise TypeError(f"tags[{i}]: a tag name must be a non-empty str, got {name!r}")
            if type(value) in _TAG_SCALARS and type(value) is not int:
                continue  # the common case, kept cheap (puts carry thousands of tags)
            if (why := _tag_value_problem(value)) is not None:
                raise TypeError(f"tags[{i}][{name!r}]: {why}")
        out.append(row)
    return out


def check_put_args(
    keys: Any, partition_id: Any, fields: Any, tags: Any
) -> tuple[list[str], str, dict[str, torch.Tensor], list[dict[str, Any]] | None]:
    """Validate :meth:`DataPlaneClient.kv_batch_put`'s arguments (same words for every backend):
    returns ``(keys, partition_id, columns, tags)`` with ``fields`` as one column per field of
    ``len(keys)`` rows (:func:`~nemo_dataplane.codec.normalize_fields`).

    Raises:
        ValueError / TypeError: naming the argument at fault, or neither fields nor tags given.
    """
    keys = check_keys(keys)
    partition_id = check_partition(partition_id)
    tag_list = check_tags(tags, len(keys))
    columns = normalize_fields(fields, len(keys))
    if not columns and tag_list is None:
        raise ValueError("kv_batch_put needs fields or tags (got neither)")
    return keys, partition_id, columns, tag_list


def resolve_get_target(meta_or_keys: KVBatchMeta | Sequence[str], partition_id: str | None) -> tuple[list[str], str]:
    """Turn ``kv_batch_get``'s first two arguments into ``(keys, partition_id)``.

    Raises:
        ValueError: plain keys without ``partition_id``, or a meta with a different partition.
    """
    if isinstance(meta_or_keys, KVBatchMeta):
        meta_pid = meta_or_keys.partition_id
        if meta_pid is None and partition_id is None:
            raise ValueError("kv_batch_get: the meta has no partition_id; pass partition_id=")
        if partition_id is not None and meta_pid is not None and partition_id != meta_pid:
            raise ValueError(f"kv_batch_get: partition_id={partition_id!r} contradicts the meta's {meta_pid!r}")
        return list(meta_or_keys.keys), check_partition(meta_pid or partition_id)
    if partition_id is None:
        raise ValueError("kv_batch_get by keys needs partition_id (only a KVBatchMeta carries its own)")
    return check_keys(meta_or_keys, allow_empty=True), check_partition(partition_id)


def add_error_note(error: BaseException, note: str) -> None:
    """Attach ``note`` to ``error`` (e.g. a clean-up that also failed) without replacing it:
    ``error.add_note`` on Python >= 3.11, a ``RuntimeWarning`` before that."""
    if hasattr(error, "add_note"):
        error.add_note(note)
    else:
        warnings.warn(note, RuntimeWarning, stacklevel=3)
