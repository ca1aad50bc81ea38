"""Refit options: each default and each set of choices stated once, for every family.

The families import their defaults and choices from here; nothing here imports a family.
"""

from __future__ import annotations

__all__ = [
    "DEFAULT_BUCKET_BYTES_CPU",
    "DEFAULT_BUCKET_BYTES_GPU",
    "PACKED_TRANSPORTS",
    "RESHARD_TRANSPORTS",
]

# Staging per bucket when none is given: GPU memory is plentiful next to a model, host memory
# of a CPU (gloo) refit less so.
DEFAULT_BUCKET_BYTES_GPU = 1 << 30
DEFAULT_BUCKET_BYTES_CPU = 64 << 20

# transport= choices. packed: "broadcast" (one broadcast per transfer), "p2p" (send/recv from
# the source to each receiver), "ipc" (CUDA IPC peer copies on one host), "auto" (ipc where
# possible, else broadcast). reshard: "p2p" (send/recv over the group), "ipc" (copy-engine
# copies into the receivers' exported tensors), "auto" (ipc where every pair can, else p2p).
PACKED_TRANSPORTS = ("auto", "broadcast", "p2p", "ipc")
RESHARD_TRANSPORTS = ("auto", "p2p", "ipc")
