"""Process groups outside ``torch.distributed``'s global state (docs/refit.md, section 1)."""

from nemo_dataplane.distributed.auth import StoreAuthError
from nemo_dataplane.distributed.stateless_group import (
    StatelessGroupError,
    StatelessGroupTimeout,
    StatelessProcessGroup,
    Work,
)

__all__ = ["StatelessGroupError", "StoreAuthError", "StatelessGroupTimeout", "StatelessProcessGroup", "Work"]
