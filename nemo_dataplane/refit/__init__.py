"""Weight refit trainer -> generator over a ``StatelessProcessGroup``.

``RefitSender`` / ``RefitReceiver``: one trainer rank holding the whole model sends it to every
generator rank. ``ReshardSender`` / ``ReshardReceiver``: trainer and generator both sharded (by
``Layout``), each rank moving only the bytes it owns (docs/refit.md, section 6).
"""

from nemo_dataplane.refit.layout import (
    DEFAULT_FUSIONS,
    DEFAULT_RULES,
    Layout,
    LayoutError,
    Mesh,
    Only,
    Replicate,
    Shard,
    build_layout,
    layer_stages,
)
from nemo_dataplane.refit.packed import (
    DEFAULT_BUCKET_BYTES_CPU,
    DEFAULT_BUCKET_BYTES_GPU,
    RefitError,
    RefitInfo,
    RefitMismatchError,
    RefitReceiver,
    RefitSender,
    TensorSpec,
)
from nemo_dataplane.refit.reshard import ReshardPlan, ReshardPlanError, plan_reshard
from nemo_dataplane.refit.sharded import ReshardReceiver, ReshardSender

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
    "build_layout",
    "layer_stages",
    "plan_reshard",
]
