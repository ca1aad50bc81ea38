"""The one check every timeout argument of the public API goes through.

A NaN compares false with every bound (``nan < 0`` is false, so a ``< 0`` check lets it through
and a deadline of ``now + nan`` is never reached) and an infinite timeout is a wait that never
ends: both are refused here, by name, before any wait starts. A leaf module (no imports from the
library) so the lowest layers can use it.
"""

from __future__ import annotations

import math

__all__ = ["check_timeout"]


def check_timeout(value: object, name: str, *, allow_zero: bool = True) -> float:
    """``value`` as a float number of seconds: finite, ``>= 0`` (``> 0`` when not ``allow_zero``).

    Raises:
        ValueError: naming ``name`` and the value: not a real number (a bool is not one), NaN,
            infinite, negative, or zero where ``allow_zero`` is false.
    """
    # bool is an int subclass; True as "1 second" is a typo, not a timeout.
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number of seconds, got {value!r}")
    seconds = float(value)
    if not math.isfinite(seconds):
        raise ValueError(f"{name} must be a finite number of seconds, got {value!r}")
    if seconds < 0 or (seconds == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"{name} must be {bound} seconds, got {value!r}")
    return seconds
