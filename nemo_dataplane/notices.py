"""Two start-up notices of dependencies that say nothing to this library's users, dropped by
their exact text in every process that imports ``nemo_dataplane`` (its ``__init__`` calls
:func:`quiet_known_notices`). Every other message of those loggers still prints.

* Ray, on every local cluster a process starts without ``RAY_AUTH_MODE`` set: "Token
  authentication is enabled for this Ray cluster ...". Ray enables token authentication by
  default either way; the notice only restates that default, once per ``ray.init``.
* torch, the first time a process builds a jagged nested tensor (``nested_tensor_from_jagged``
  asks ``is_fx_tracing()``, which logs a deprecation note meant for callers of that function):
  "is_fx_tracing will return true for both fx.symbolic_trace and torch.export ...". The
  library never calls it; every rollout batch is jagged, so every process would print it.

A logger filter, not a warnings filter or a log level: both are ``logging`` records, and a level
would also hide the loggers' other messages.
"""

from __future__ import annotations

import logging

__all__ = ["KNOWN_NOTICES", "quiet_known_notices"]

# (logger name, start of the message dropped)
KNOWN_NOTICES: tuple[tuple[str, str], ...] = (
    ("ray._private.authentication.authentication_token_setup", "Token authentication is enabled for this Ray cluster"),
    ("torch.fx._symbolic_trace", "is_fx_tracing will return true for both"),
)


class _DropNotice(logging.Filter):
    def __init__(self, prefix: str) -> None:
        super().__init__()
        self.prefix = prefix

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.prefix)


def quiet_known_notices() -> None:
    """Install the filters of :data:`KNOWN_NOTICES` on their loggers; idempotent, and valid
    before or after ray and torch are imported (a logger is the same object either way)."""
    for name, prefix in KNOWN_NOTICES:
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropNotice) and f.prefix == prefix for f in logger.filters):
            logger.addFilter(_DropNotice(prefix))
