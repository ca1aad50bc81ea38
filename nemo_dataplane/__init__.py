"""nemo-dataplane: move RL batches by metadata through a key/value store; refit weights over
stateless process groups.

Public names are re-exported here; everything else is imported from its layer's module
(``nemo_dataplane.driver``, ``nemo_dataplane.worker``, ``nemo_dataplane.refit``, ...).
"""

from nemo_dataplane.client import DataPlaneClient, DataPlaneError
from nemo_dataplane.config import DataPlaneConfig, PackingConfig, TransferQueueConfig
from nemo_dataplane.factory import build_data_plane_client
from nemo_dataplane.meta import KVBatchMeta

__all__ = [
    "DataPlaneClient",
    "DataPlaneConfig",
    "DataPlaneError",
    "KVBatchMeta",
    "PackingConfig",
    "TransferQueueConfig",
    "build_data_plane_client",
]
