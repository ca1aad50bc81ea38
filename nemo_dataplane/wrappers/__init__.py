"""Clients that wrap a :class:`~nemo_dataplane.client.DataPlaneClient` and change one thing.

* :mod:`.base`: :class:`ForwardingClient`, which forwards every call; the others override only
  what they change;
* :mod:`.identity`: :class:`RowIdentityCheck` (``data_plane.verify_rows``, default on: every get
  checks each row is the row of the key asked for);
* :mod:`.capacity`: :class:`CapacityGuard` (``data_plane.max_rows``; a put past it raises
  :class:`StoreFullError`);
* :mod:`.integrity`: :class:`IntegrityCheck` (``data_plane.verify_integrity``: per-row digests
  sealed at put, checked at get);
* :mod:`.gpu_resident`: :class:`GpuResidentClient` (``data_plane.gpu_fields``: CUDA tensors of
  those fields stay on their GPU, the store holds CUDA IPC handles);
* :mod:`.observed`: :class:`ObservedClient` (``observability.enabled``: one :class:`OpEvent` per
  op, bytes outstanding, snapshots).

The factory composes them as
``ObservedClient(GpuResidentClient(IntegrityCheck(CapacityGuard(RowIdentityCheck(backend)))))``, each
only when its key is set (see :func:`~nemo_dataplane.factory.build_data_plane_client`). Names
resolve on first access (PEP 562).
"""

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover - typing only
    from nemo_dataplane.wrappers.base import ForwardingClient
    from nemo_dataplane.wrappers.capacity import CapacityGuard, StoreFullError
    from nemo_dataplane.wrappers.gpu_resident import GpuResidentClient
    from nemo_dataplane.wrappers.identity import RowIdentityCheck
    from nemo_dataplane.wrappers.integrity import IntegrityCheck
    from nemo_dataplane.wrappers.observed import ObservedClient, OpEvent, Outstanding

__all__ = [
    "CapacityGuard",
    "ForwardingClient",
    "GpuResidentClient",
    "IntegrityCheck",
    "ObservedClient",
    "OpEvent",
    "Outstanding",
    "RowIdentityCheck",
    "StoreFullError",
]

_WHERE = {
    "ForwardingClient": "base",
    "CapacityGuard": "capacity",
    "StoreFullError": "capacity",
    "GpuResidentClient": "gpu_resident",
    "IntegrityCheck": "integrity",
    "ObservedClient": "observed",
    "OpEvent": "observed",
    "Outstanding": "observed",
    "RowIdentityCheck": "identity",
}


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        import importlib

        return getattr(importlib.import_module(f"nemo_dataplane.wrappers.{_WHERE[name]}"), name)
    raise AttributeError(f"module 'nemo_dataplane.wrappers' has no attribute {name!r}")
