"""Keeping the collectives' own listeners on loopback when every rank shares one host.

gloo and NCCL listen where their interface settings point, not where the group's rendezvous
store is: gloo on the address the hostname resolves to or ``GLOO_SOCKET_IFNAME``'s interface,
NCCL's bootstrap on the first non-loopback interface or ``NCCL_SOCKET_IFNAME``'s. A group whose
store is hosted on loopback has every rank on this host, so those listeners belong on loopback
too, whatever those variables say:

* :func:`gloo_options` builds a ``ProcessGroupGloo`` device bound to exactly the loopback host;
* :func:`pin_collectives_to_loopback` points this process's gloo and NCCL interface variables at
  the loopback interface, for groups built by ``torch.distributed.init_process_group`` (which
  takes no device) and for NCCL, whose bootstrap reads the variable once per process, at its
  first communicator.
"""

from __future__ import annotations

import datetime
import os
import socket
from typing import Any

import torch.distributed as dist

__all__ = ["LOOPBACK_HOST", "gloo_options", "loopback_interface", "pin_collectives_to_loopback"]

LOOPBACK_HOST = "127.0.0.1"
# The variables the collectives read to choose the interface they listen on.
INTERFACE_VARS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")


def loopback_interface() -> str:
    """The name of this host's loopback interface (``lo`` on Linux, ``lo0`` on macOS).

    Raises:
        OSError: the host has no interface by either name.
    """
    names = [name for _, name in socket.if_nameindex()]
    for name in ("lo", "lo0"):
        if name in names:
            return name
    raise OSError(f"no loopback interface ('lo' or 'lo0') among this host's interfaces {names}")


def pin_collectives_to_loopback() -> dict[str, str]:
    """Set ``GLOO_SOCKET_IFNAME`` and ``NCCL_SOCKET_IFNAME`` to the loopback interface in this
    process (for good: NCCL reads its variable at the process's first communicator, and a torch
    group's NCCL communicator is built lazily at its first collective). Call it only in a
    process whose every group has all its ranks on this host; returns the values set."""
    lo = loopback_interface()
    for var in INTERFACE_VARS:
        os.environ[var] = lo
    return dict.fromkeys(INTERFACE_VARS, lo)


def gloo_options(host: str, timeout: datetime.timedelta) -> Any:
    """Options for a ``ProcessGroupGloo`` whose one device listens on exactly ``host``
    (``GLOO_SOCKET_IFNAME`` and the hostname are not consulted)."""
    # A ProcessGroupGloo._Options (torch's stubs omit the class).
    options = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
    options._timeout = timeout
    return options
