"""Backends for tests, importable by path (``data_plane.backend: "_backends:Name"``) once this
directory is on ``sys.path`` (the test module inserts it; Ray workers inherit the path).

* ``ByKeyOnly``: the reference store with the ABC's claim defaults back (a backend without claims).
* ``SharedMemory``: the reference store shared by every client of one process under one name
  (``backend_kwargs: {name: ...}``), with the bootstrap modes of a shared store: what the
  trainer's driver and an in-process "rank" need to see the same rows without Ray.
* ``RotatingSharedMemory``: ``SharedMemory`` whose gets of more than 64 keys come back rotated
  by one row (a store that misplaces rows in bulk).
* ``Incomplete``: a ``DataPlaneClient`` subclass missing ``kv_partitions``.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import torch
from tensordict import TensorDict

from nemo_dataplane.adapters.memory import InMemoryClient
from nemo_dataplane.client import DataPlaneClient, DataPlaneError
from nemo_dataplane.meta import KVBatchMeta
from nemo_dataplane.wrappers.base import ForwardingClient


class ByKeyOnly(InMemoryClient):
    """The reference store with the ABC's claim defaults back: a backend without claims."""

    kv_claim = DataPlaneClient.kv_claim  # type: ignore[assignment]
    kv_mark_consumed = DataPlaneClient.kv_mark_consumed  # type: ignore[assignment]
    kv_claim_status = DataPlaneClient.kv_claim_status  # type: ignore[assignment]


class _Rotating(InMemoryClient):
    def kv_batch_get(
        self, meta_or_keys: KVBatchMeta | Sequence[str], select_fields: Sequence[str], partition_id: str | None = None
    ) -> TensorDict:
        out = super().kv_batch_get(meta_or_keys, select_fields, partition_id)
        n = out.batch_size[0]
        return out[torch.roll(torch.arange(n), 1)] if n > 64 else out


_STORES: dict[str, InMemoryClient] = {}
_LOCK = threading.Lock()


class SharedMemory(ForwardingClient):
    """One in-process store per name, reached by every client built with that name."""

    STORE: type[InMemoryClient] = InMemoryClient

    def __init__(self, name: str = "shared", bootstrap: bool | str = "auto") -> None:
        with _LOCK:
            store = _STORES.get(name)
            if store is None and bootstrap is False:
                raise DataPlaneError(f"no shared memory store named {name!r} to attach to")
            if store is not None and bootstrap is True:
                raise DataPlaneError(f"a shared memory store named {name!r} exists already")
            self.owns_store = store is None
            if store is None:
                store = _STORES[name] = self.STORE()
        super().__init__(store)
        self.name = name
        self._closed = False  # an attached client's close leaves the store to its owner

    @classmethod
    def from_config(cls, cfg: Any, bootstrap: bool | str = "auto") -> SharedMemory:
        return cls(**dict(cfg.backend_kwargs), bootstrap=bootstrap)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self.owns_store:
            with _LOCK:
                _STORES.pop(self.name, None)
            self.inner.close()


class RotatingSharedMemory(SharedMemory):
    STORE = _Rotating


class Incomplete(DataPlaneClient):  # type: ignore[misc]  # deliberately abstract: kv_partitions is missing
    def kv_batch_put(self, keys: Any, partition_id: Any, fields: Any, tags: Any = None) -> Any: ...

    def kv_batch_get(self, meta_or_keys: Any, select_fields: Any, partition_id: Any = None) -> Any: ...

    def kv_clear(self, keys: Any, partition_id: Any) -> None: ...

    def kv_list(self, partition_id: Any) -> Any: ...
