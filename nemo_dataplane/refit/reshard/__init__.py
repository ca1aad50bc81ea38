"""The reshard family: trainer and generator both sharded (by ``Layout``), each rank moving only
the bytes it owns (docs/refit.md, section 6).

``layout.py`` describes one side's sharding (``rules.py`` builds it for common models),
``plan.py`` computes who sends which slice to whom, ``endpoints.py`` holds ``ReshardSender`` /
``ReshardReceiver``; their transports are ``p2p.py`` (send/recv over the group) and
``ipc_push.py`` + ``pitched.py`` (CUDA IPC copies) with ``ipc_control.py`` (the IPC setup and
per-refit signals).
"""

from nemo_dataplane.refit.reshard.endpoints import DEFAULT_DIRECT_BYTES, ReshardReceiver, ReshardSender
from nemo_dataplane.refit.reshard.layout import Layout, LayoutError, Mesh, Only, Replicate, Shard
from nemo_dataplane.refit.reshard.plan import ReshardPlan, ReshardPlanError, plan_reshard
from nemo_dataplane.refit.reshard.rules import DEFAULT_FUSIONS, DEFAULT_RULES, build_layout, layer_stages

__all__ = [
    "DEFAULT_DIRECT_BYTES",
    "DEFAULT_FUSIONS",
    "DEFAULT_RULES",
    "Layout",
    "LayoutError",
    "Mesh",
    "Only",
    "Replicate",
    "ReshardPlan",
    "ReshardPlanError",
    "ReshardReceiver",
    "ReshardSender",
    "Shard",
    "build_layout",
    "layer_stages",
    "plan_reshard",
]
