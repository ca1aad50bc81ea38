"""The reshard family: trainer and generator both sharded (by ``Layout``), each rank moving only
the bytes it owns (docs/refit.md, section 6).

``layout.py`` describes one side's sharding, ``plan.py`` computes who sends which slice to
whom, ``endpoints.py`` holds ``ReshardSender`` / ``ReshardReceiver``; their transports are
``p2p.py`` (send/recv over the group) and ``ipc_push.py`` + ``pitched.py`` (CUDA IPC copies)
with ``ipc_control.py`` (the IPC setup and per-refit signals).
"""

from nemo_dataplane.refit.reshard.endpoints import DEFAULT_DIRECT_BYTES, ReshardReceiver, ReshardSender, phase_durations
from nemo_dataplane.refit.reshard.layout import (
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
from nemo_dataplane.refit.reshard.plan import ReshardPlan, ReshardPlanError, plan_reshard

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
    "phase_durations",
    "plan_reshard",
]
