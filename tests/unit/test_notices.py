"""Dependency notices dropped in the library's processes (nemo_dataplane/notices.py): exactly the
known ones, by their text; every other message of the same loggers still comes through."""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

import pytest

from nemo_dataplane.notices import KNOWN_NOTICES


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@pytest.mark.parametrize(("logger", "prefix"), KNOWN_NOTICES)
def test_the_known_notices_are_dropped_and_nothing_else(logger: str, prefix: str) -> None:
    import nemo_dataplane  # noqa: F401 - importing the package installs the filters

    log = logging.getLogger(logger)
    # A handler of its own: torch's and Ray's loggers do not propagate to the root's.
    seen = _Records()
    log.addHandler(seen)
    try:
        log.warning(prefix + " ... (the notice)")
        log.warning("another warning of the same logger")
    finally:
        log.removeHandler(seen)
    assert seen.messages == ["another warning of the same logger"]


def test_a_process_that_builds_jagged_tensors_prints_no_fx_tracing_notice() -> None:
    # A fresh interpreter: the notice is logged once per process, at its first jagged tensor.
    script = (
        "import torch\n"
        "from nemo_dataplane.codec import jagged_from_rows\n"
        "jagged_from_rows([torch.arange(3), torch.arange(2)])\n"
        "print('built')\n"
    )
    repo = Path(__file__).resolve().parents[2]
    proc = subprocess.run([sys.executable, "-c", script], cwd=repo, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0 and "built" in proc.stdout, proc.stderr[-2000:]
    assert "is_fx_tracing" not in proc.stderr, proc.stderr[-2000:]
