"""Shared bits of the TransferQueue workarounds: reserved tag, log and thread hygiene (quirks 3, 6)."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch

BACKEND = "SimpleStorage"
# Reserved per-key tag recording how each field was put (quirk 4); never shown to callers.
LAYOUT_TAG = "__nd_layout__"


def public_tags(custom_meta: Mapping[str, Any]) -> dict[str, Any]:
    """A key's tags without the adapter's reserved :data:`LAYOUT_TAG`."""
    return {k: v for k, v in custom_meta.items() if k != LAYOUT_TAG}


def quiet_logs(level: int = logging.ERROR) -> None:
    """Raise every ``transfer_queue.*`` logger in this process to ``level``.

    TransferQueue sets a level on each module logger at import time, so the parent logger's
    level alone would not reach them.
    """
    for name in list(logging.Logger.manager.loggerDict):
        if name == "transfer_queue" or name.startswith("transfer_queue."):
            logging.getLogger(name).setLevel(level)


@contextmanager
def preserve_torch_threads() -> Iterator[None]:
    """Restore ``torch.get_num_threads()`` of the calling thread on exit (quirk 3)."""
    before = torch.get_num_threads()
    try:
        yield
    finally:
        if torch.get_num_threads() != before:
            torch.set_num_threads(before)


def loop_thread(name: str) -> tuple[asyncio.AbstractEventLoop, threading.Thread]:
    """A private event loop running in a daemon thread (the sync API's home)."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name=name, daemon=True)
    thread.start()
    return loop, thread
