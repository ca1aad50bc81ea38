"""The refit group's formation: the policy's senders and every engine's receivers joined in one
stateless group at a fresh rendezvous (a re-formation after an engine was lost or joined is the
same call), with the abort that stops every member's waits in it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from algorithms.config import REFIT_GROUP, TrainerConfig
from algorithms.remote import StepError, gather
from nemo_dataplane.distributed.abort import post_group_abort

__all__ = ["form_refit_group"]


def form_refit_group(
    cfg: TrainerConfig,
    senders: Sequence[Any],
    generators: Sequence[Any],
    host: Any,
    secret: str,
    *,
    local: bool,
    timeout_s: float,
    what: str = "refit group set-up",
) -> Callable[[str], bool]:
    """Form (or re-form) the refit group: ``senders`` are group ranks ``0..len(senders)-1``, the
    ``generators`` the ranks after them (``generation.tensor_parallel_size`` consecutive ranks
    each). ``host`` (policy rank 0) hosts a new rendezvous unless
    ``refit.port`` fixes one (then the first formation only). Members of an earlier group leave it
    first (their ``init_refit`` does), so this is also how the group shrinks and grows.

    Returns ``abort(reason)``: posts ``reason`` as the formed group's abort, so every member
    waiting in it stops at once (a member was found dead meanwhile); a formation that fails
    posts its own before raising, so members still waiting in it stop too.

    Raises:
        StepError: a member failed or the set-up outlasted ``timeout_s`` (named).
    """
    width = cfg.generation.tensor_parallel_size
    world = len(senders) + len(generators) * width
    if cfg.refit.port:
        addr, port = cfg.refit.host, cfg.refit.port
    else:
        (at,) = gather([host.host_rendezvous.remote("refit", world, local)], timeout_s, f"{what}: rendezvous")
        addr, port = at
    names = [f"policy rank {r} (refit sender)" for r in range(len(senders))] + [
        f"generator {i} (refit receiver)" for i in range(len(generators))
    ]

    def abort(reason: str) -> bool:
        return post_group_abort(addr, port, reason, group_name=REFIT_GROUP, secret=secret)

    try:
        gather(
            [
                *(s.init_refit.remote(addr, port, world, secret) for s in senders),
                *(
                    g.init_refit.remote(addr, port, world, len(senders) + i * width, secret)
                    for i, g in enumerate(generators)
                ),
            ],
            timeout_s,
            what,
            names,
        )
    except StepError as e:
        abort(str(e))
        raise
    return abort
