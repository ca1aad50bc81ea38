"""Store adapters behind :class:`nemo_dataplane.DataPlaneClient`, one module or package per backend.

* :mod:`.memory`: ``InMemoryClient``, the in-process reference backend (the executable contract);
* :mod:`.transfer_queue`: ``TransferQueueClient`` (needs ``transferqueue`` and Ray);
* :mod:`.ray_store`: ``RayStoreClient`` (needs Ray);
* shared by the two Ray-backed ones: :mod:`.actor_store` (lifecycle of a store made of named Ray
  actors), :mod:`.chunks` (tensors as Ray objects) and :mod:`.locate` (torch-free row locations).

Every adapter is imported on first access (PEP 562), so importing one adapter module, or the
torch-free actors of the Ray backend inside a fresh Ray worker, loads nothing else.
"""

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover - typing only
    from nemo_dataplane.adapters.memory import InMemoryClient
    from nemo_dataplane.adapters.ray_store.client import RayStoreClient
    from nemo_dataplane.adapters.transfer_queue.client import TransferQueueClient

__all__ = ["InMemoryClient", "RayStoreClient", "TransferQueueClient"]

_WHERE = {
    "InMemoryClient": "memory",
    "TransferQueueClient": "transfer_queue.client",
    "RayStoreClient": "ray_store.client",
}


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        import importlib

        return getattr(importlib.import_module(f"nemo_dataplane.adapters.{_WHERE[name]}"), name)
    raise AttributeError(f"module 'nemo_dataplane.adapters' has no attribute {name!r}")
