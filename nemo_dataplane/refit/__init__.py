"""Weight refit trainer -> generator over a ``StatelessProcessGroup``."""

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

__all__ = [
    "DEFAULT_BUCKET_BYTES_CPU",
    "DEFAULT_BUCKET_BYTES_GPU",
    "RefitError",
    "RefitInfo",
    "RefitMismatchError",
    "RefitReceiver",
    "RefitSender",
    "TensorSpec",
]
