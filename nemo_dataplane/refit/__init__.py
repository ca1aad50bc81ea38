"""Weight refit trainer -> generator over a ``StatelessProcessGroup``, in two families.

* ``packed`` (``refit/packed/``): ``RefitSender`` / ``RefitReceiver``: one trainer rank
  holding the whole model sends it to every generator rank.
* ``reshard`` (``refit/reshard/``): ``ReshardSender`` / ``ReshardReceiver``: trainer and
  generator both sharded (by ``Layout``), each rank moving only the bytes it owns.

Callers need neither: ``build_weight_sender`` / ``build_weight_receiver`` (``factory.py``)
build either family, or a third party's registered with ``register_weight_transfer``, from a
``WeightTransferConfig`` (``config.py``), as a ``WeightSender`` / ``WeightReceiver``
(``protocol.py``, which also holds what every family shares: errors, ``TensorSpec``, the refit
header's constants). ``cuda/`` holds the CUDA IPC pieces both IPC transports use
(docs/refit.md).
"""

from nemo_dataplane.refit.config import DEFAULT_BUCKET_BYTES_CPU, DEFAULT_BUCKET_BYTES_GPU, WeightTransferConfig
from nemo_dataplane.refit.factory import (
    WeightTransferFamily,
    build_weight_receiver,
    build_weight_sender,
    register_weight_transfer,
    weight_transfer_families,
)
from nemo_dataplane.refit.packed import RefitInfo, RefitReceiver, RefitSender
from nemo_dataplane.refit.protocol import RefitError, RefitMismatchError, TensorSpec, WeightReceiver, WeightSender
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
    "WeightReceiver",
    "WeightSender",
    "WeightTransferConfig",
    "WeightTransferFamily",
    "build_layout",
    "build_weight_receiver",
    "build_weight_sender",
    "layer_stages",
    "plan_reshard",
    "register_weight_transfer",
    "weight_transfer_families",
]
