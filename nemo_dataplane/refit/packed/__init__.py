"""The packed family: one trainer rank holding the whole model sends it to every generator rank.

``RefitSender`` / ``RefitReceiver`` (``endpoints.py``) over broadcast / p2p collectives
(``collective.py``) or same-host CUDA IPC copies (``cuda_ipc.py``); ``RefitInfo`` and the bucket
schedule are ``plan.py``, the handshake and header ``base.py`` (docs/refit.md, sections 1-5).
"""

from nemo_dataplane.refit.packed.base import diff_specs
from nemo_dataplane.refit.packed.cuda_ipc import AUTO_IPC_MAX_RECEIVERS, AUTO_PICKS_IPC, IPC_COPY_ON, IPC_DIRECTIONS
from nemo_dataplane.refit.packed.endpoints import TRANSPORTS, RefitReceiver, RefitSender
from nemo_dataplane.refit.packed.plan import (
    DEFAULT_GROUP_BYTES,
    DEFAULT_TRANSPORT_GPU,
    Bucket,
    Direct,
    RefitInfo,
    build_plan,
    group_directs,
)

__all__ = [
    "AUTO_IPC_MAX_RECEIVERS",
    "AUTO_PICKS_IPC",
    "DEFAULT_GROUP_BYTES",
    "DEFAULT_TRANSPORT_GPU",
    "IPC_COPY_ON",
    "IPC_DIRECTIONS",
    "TRANSPORTS",
    "Bucket",
    "Direct",
    "RefitInfo",
    "RefitReceiver",
    "RefitSender",
    "build_plan",
    "diff_specs",
    "group_directs",
]
