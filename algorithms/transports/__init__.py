"""How rollouts move: chosen once, here, from ``data_plane.enabled``.

* :mod:`.data_plane`: rollouts stay in the store (TransferQueue by default), the driver moves
  metadata, workers read and write the rows themselves;
* :mod:`.legacy`: the in-memory baseline; the driver holds every batch and ships shards through
  Ray. It never loads a module of :data:`DATA_PLANE_MODULES`.

Everything after :func:`make_transport` talks to the interfaces of :mod:`.base`.
"""

from __future__ import annotations

from collections.abc import Iterable

from algorithms.config import TrainerConfig
from algorithms.transports.base import BatchIO, Loaded, RolloutSink, RolloutSource, Transport

__all__ = [
    "DATA_PLANE_MODULES",
    "BatchIO",
    "Loaded",
    "RolloutSink",
    "RolloutSource",
    "Transport",
    "data_plane_modules_loaded",
    "make_transport",
]

# Modules the baseline must never load (checked by tests/unit/test_architecture.py and reported
# in summary.json).
DATA_PLANE_MODULES: tuple[str, ...] = (
    "transfer_queue",
    "nemo_dataplane.client",
    "nemo_dataplane.factory",
    "nemo_dataplane.wrappers",
    "nemo_dataplane.adapters",
    "nemo_dataplane.driver.fan_out",
    "nemo_dataplane.driver.columns",
    "nemo_dataplane.worker.fetch",
    "algorithms.transports.data_plane",
)


def data_plane_modules_loaded(modules: Iterable[str]) -> list[str]:
    """The entries of ``modules`` that belong to the data plane (see :data:`DATA_PLANE_MODULES`)."""
    return sorted(m for m in modules if any(m == d or m.startswith(d + ".") for d in DATA_PLANE_MODULES))


def make_transport(cfg: TrainerConfig) -> Transport:
    """The transport ``data_plane.enabled`` picks (nothing is started yet: :meth:`Transport.start`)."""
    # The data-plane boundary: only a run that uses the store imports its modules.
    if cfg.data_plane.enabled:
        from algorithms.transports.data_plane import DataPlaneTransport

        return DataPlaneTransport(cfg)
    from algorithms.transports.legacy import LegacyTransport

    return LegacyTransport(cfg)
