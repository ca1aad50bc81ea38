"""Weight refit trainer -> generator over a ``StatelessProcessGroup``, in two families.

* ``packed`` (``refit/packed/``): ``RefitSender`` / ``RefitReceiver``: one trainer rank
  holding the whole model sends it to every generator rank.
* ``reshard`` (``refit/reshard/``): ``ReshardSender`` / ``ReshardReceiver``: trainer and
  generator both sharded (by ``Layout``), each rank moving only the bytes it owns.

``protocol.py`` holds what both share (errors, ``TensorSpec``, the refit header's constants)
and ``cuda/`` the CUDA IPC pieces both IPC transports use (docs/refit.md).
"""

from nemo_dataplane.refit.config import DEFAULT_BUCKET_BYTES_CPU, DEFAULT_BUCKET_BYTES_GPU, WeightTransferConfig
from nemo_dataplane.refit.packed import RefitInfo, RefitReceiver, RefitSender
from nemo_dataplane.refit.protocol import RefitError, RefitMismatchError, TensorSpec
from nemo_dataplane.refit.reshard import (
    DEFAULT_FUSIONS,
    DEFAULT_RULES,
    Layout,
    LayoutError,
    Mesh,
    Only,
    Replicate,
    ReshardPlan,
    ReshardPlanError,
    ReshardReceiver,
    ReshardSender,
    Shard,
    build_layout,
    layer_stages,
    plan_reshard,
)

__all__ = [
    "DEFAULT_BUCKET_BYTES_CPU",
    "DEFAULT_BUCKET_BYTES_GPU",
    "DEFAULT_FUSIONS",
    "DEFAULT_RULES",
    "Layout",
    "LayoutError",
    "Mesh",
    "Only",
    "RefitError",
    "RefitInfo",
    "RefitMismatchError",
    "RefitReceiver",
    "RefitSender",
    "Replicate",
    "ReshardPlan",
    "ReshardPlanError",
    "ReshardReceiver",
    "ReshardSender",
    "Shard",
    "TensorSpec",
    "WeightTransferConfig",
    "build_layout",
    "layer_stages",
    "plan_reshard",
]
