"""Stopping a group's waits from outside it: an abort record in its rendezvous store.

A member that dies while the others wait on it through the store (the rendezvous, a refit's
handshake, a status it never posts) is otherwise found only when their wait runs out, minutes
later. Whoever learns of the death first (a driver that saw the process go, or a member) posts
``spg/<group>/abort`` with the reason; every wait of :class:`StatelessProcessGroup` looks for
it at its watch cadence and stops with :class:`StatelessGroupError` quoting the reason.

The record is authenticated like every other (the job secret, not bound to a group instance:
the poster is not a member), so a process without the secret cannot forge a reason; its mere
presence still stops the waits, which any process that reaches the store could achieve anyway
by deleting the group's keys.
"""

from __future__ import annotations

import datetime

import torch.distributed as dist

from nemo_dataplane.distributed.auth import AuthStore, authenticated, is_loopback, job_secret

__all__ = ["abort_key", "post_group_abort", "posted_abort"]


def abort_key(prefix: str) -> str:
    """The abort record's key of the group whose keys live under ``prefix`` (``spg/<name>``)."""
    return f"{prefix}/abort"


def posted_abort(store: dist.Store, prefix: str) -> str | None:
    """The reason posted in ``store`` for the group under ``prefix``, or ``None`` if none was.

    Raises:
        StoreAuthError: the record exists but was not written with this job's secret.
    """
    key = abort_key(prefix)
    if not store.check([key]):
        return None
    # Written by a non-member: authenticated with the secret alone, not this group's instance.
    reader = store.bound(b"") if isinstance(store, AuthStore) else store
    return bytes(reader.get(key)).decode(errors="replace")


def post_group_abort(
    host: str,
    port: int,
    reason: str,
    *,
    group_name: str = "default",
    secret: bytes | str | None = None,
    timeout: float = 5.0,
) -> bool:
    """Post ``reason`` as the abort of group ``group_name`` whose rendezvous store listens at
    ``host:port``: its members' waits stop within a watch period (0.1 s). Returns whether it
    was posted; a store that is gone (its host, the group's rank 0, ended) returns ``False``,
    since then the members' store waits fail by themselves. Never raises for an unreachable
    store: it is called on error paths, where the error being handled is the one that counts.
    """
    try:
        inner = dist.TCPStore(
            host, int(port), None, False, timeout=datetime.timedelta(seconds=timeout), wait_for_workers=False
        )
        store = authenticated(
            inner, job_secret(secret), where=f"group {group_name!r} abort at {host}:{port}", loopback=is_loopback(host)
        )
        store.set(abort_key(f"spg/{group_name}"), reason.encode())  # type: ignore[arg-type]  # torch's stub: str only
    except Exception:  # noqa: BLE001 - see the docstring: unreachable means nothing waits there
        return False
    return True
