"""Store adapters behind :class:`nemo_dataplane.DataPlaneClient`.

Every adapter is imported on first access (PEP 562), so importing one adapter module, or the
torch-free actors of the Ray backend inside a fresh Ray worker, loads nothing else:
``InMemoryClient`` (in-process reference), ``TransferQueueClient`` (needs ``transferqueue`` and
Ray), ``RayStoreClient`` (needs Ray).
"""

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover - typing only
    from nemo_dataplane.adapters.memory import InMemoryClient
    from nemo_dataplane.adapters.ray_store import RayStoreClient
    from nemo_dataplane.adapters.transfer_queue import TransferQueueClient

__all__ = ["InMemoryClient", "RayStoreClient", "TransferQueueClient"]

_WHERE = {"InMemoryClient": "memory", "TransferQueueClient": "transfer_queue", "RayStoreClient": "ray_store"}


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        import importlib

        return getattr(importlib.import_module(f"nemo_dataplane.adapters.{_WHERE[name]}"), name)
    raise AttributeError(f"module 'nemo_dataplane.adapters' has no attribute {name!r}")
