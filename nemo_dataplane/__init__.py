"""nemo-dataplane: move RL batches by metadata through a key/value store; refit weights over
stateless process groups.

Public names are re-exported here; everything else is imported from its layer's module
(``nemo_dataplane.driver``, ``nemo_dataplane.worker``, ``nemo_dataplane.refit``, ...).
"""

from typing import TYPE_CHECKING, Any

from nemo_dataplane.compile_marks import defer_tensordict_compile_marks
from nemo_dataplane.notices import quiet_known_notices

# Every process of the library and its trainers imports this package first: two dependency
# notices that concern none of them are dropped here, once (nemo_dataplane/notices.py says which),
# and tensordict's torch.compile marks wait for torch._dynamo (compile_marks.py says why).
quiet_known_notices()
defer_tensordict_compile_marks()

if TYPE_CHECKING:  # pragma: no cover - typing only
    from nemo_dataplane.client import (
        ClaimsNotSupported,
        ClaimStatus,
        DataIntegrityError,
        DataPlaneClient,
        DataPlaneError,
    )
    from nemo_dataplane.config import DataPlaneConfig, PackingConfig, TransferQueueConfig
    from nemo_dataplane.errors import NemoDataplaneError
    from nemo_dataplane.factory import build_data_plane_client
    from nemo_dataplane.meta import KVBatchMeta

# Public names resolve on first access (PEP 562): code that needs only the planners or the meta
# (the legacy transport) does not load the store client, the factory or the adapters.
_WHERE = {
    "ClaimStatus": "client",
    "ClaimsNotSupported": "client",
    "DataPlaneClient": "client",
    "DataPlaneError": "client",
    "DataIntegrityError": "client",
    "DataPlaneConfig": "config",
    "PackingConfig": "config",
    "TransferQueueConfig": "config",
    "build_data_plane_client": "factory",
    "KVBatchMeta": "meta",
    "NemoDataplaneError": "errors",
}

__all__ = [
    "ClaimStatus",
    "ClaimsNotSupported",
    "DataPlaneClient",
    "DataIntegrityError",
    "DataPlaneConfig",
    "DataPlaneError",
    "KVBatchMeta",
    "NemoDataplaneError",
    "PackingConfig",
    "TransferQueueConfig",
    "build_data_plane_client",
]


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        import importlib

        return getattr(importlib.import_module(f"nemo_dataplane.{_WHERE[name]}"), name)
    raise AttributeError(f"module 'nemo_dataplane' has no attribute {name!r}")
