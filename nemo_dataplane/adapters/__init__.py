"""Store adapters behind :class:`nemo_dataplane.DataPlaneClient`.

``InMemoryClient`` (in-process reference) is always importable. ``TransferQueueClient`` needs
``transferqueue`` and Ray, so it is imported on first access.
"""

from typing import Any

from nemo_dataplane.adapters.memory import InMemoryClient

__all__ = ["InMemoryClient", "TransferQueueClient"]


def __getattr__(name: str) -> Any:
    if name == "TransferQueueClient":
        from nemo_dataplane.adapters.transfer_queue import TransferQueueClient

        return TransferQueueClient
    raise AttributeError(f"module 'nemo_dataplane.adapters' has no attribute {name!r}")
