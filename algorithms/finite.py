"""Non-finite values refused: the checks a step runs before any optimizer step.

One NaN reward makes its group's advantages NaN, and one optimizer step on a NaN gradient makes
every weight NaN, silently. So every value the update depends on (rewards, advantages,
behaviour / proximal / reference / current log-probs, the gradient norm) is checked where it is
first seen, and a non-finite one fails the step with :class:`~nemo_dataplane.errors.NonFiniteError`
naming the value, the group(s) and the prompt(s).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from tensordict import TensorDict

from nemo_dataplane.codec import jagged_rows
from nemo_dataplane.errors import NonFiniteError

__all__ = [
    "NonFiniteError",
    "describe_rows",
    "nonfinite_message",
    "nonfinite_rows",
    "refuse_nonfinite",
    "refuse_nonfinite_groups",
]

Decode = Callable[[Sequence[int]], str]

PROMPT_CHARS = 80  # a prompt is quoted up to this many characters
ROWS_NAMED = 3  # rows named in one message; the count says how many more


def nonfinite_rows(values: torch.Tensor, mask: torch.Tensor | None = None) -> list[int]:
    """Indices of the rows of ``values`` (``[N]`` or ``[N, T]``) holding a NaN or infinity where
    ``mask`` (same shape, nonzero: counted) is set; padding outside the mask is ignored."""
    bad = ~torch.isfinite(values.detach())
    if mask is not None:
        bad &= mask.to(torch.bool)
    if bad.dim() > 1:
        bad = bad.flatten(1).any(dim=1)
    return [int(i) for i in bad.nonzero().flatten().tolist()]


def describe_rows(mb: TensorDict, rows: Sequence[int], decode: Decode | None = None) -> str:
    """``group <id>, prompt '<text>'`` for the first rows of ``mb`` (its ``group_id``, and its
    prompt tokens decoded by ``decode``, else their ids), truncated to :data:`PROMPT_CHARS`."""
    ids = jagged_rows(mb["input_ids"]) if "input_ids" in mb.keys() else None
    out = []
    for j in rows[:ROWS_NAMED]:
        gid = int(mb["group_id"][j]) if "group_id" in mb.keys() else "?"
        if ids is None:
            prompt = "?"
        else:
            tokens = ids[j][: int(mb["prompt_len"][j])].tolist()
            prompt = decode(tokens) if decode is not None else str(tokens)
        out.append(f"group {gid}, prompt {prompt[:PROMPT_CHARS]!r}")
    more = f" (and {len(rows) - ROWS_NAMED} more rows)" if len(rows) > ROWS_NAMED else ""
    return "; ".join(out) + more


def refuse_nonfinite(
    what: str, values: torch.Tensor, mb: TensorDict, *, mask: torch.Tensor | None = None, decode: Decode | None = None
) -> None:
    """Raise :class:`NonFiniteError` naming ``what`` and the rows' groups and prompts when a row of
    ``values`` (aligned with ``mb``'s rows) is NaN or infinite where ``mask`` is set."""
    message = nonfinite_message(what, values, mb, mask=mask, decode=decode)
    if message is not None:
        raise NonFiniteError(message)


def nonfinite_message(
    what: str, values: torch.Tensor, mb: TensorDict, *, mask: torch.Tensor | None = None, decode: Decode | None = None
) -> str | None:
    """The message :func:`refuse_nonfinite` would raise, or ``None`` when every value is finite
    (for a caller that must first tell its peers)."""
    rows = nonfinite_rows(values, mask)
    if not rows:
        return None
    return f"{what} is not finite (NaN or infinite) on {len(rows)} row(s): {describe_rows(mb, rows, decode)}"


def refuse_nonfinite_groups(
    what: str,
    values: torch.Tensor,
    group_size: int,
    group_ids: Sequence[int],
    prompts: Sequence[str] = (),
    *,
    rows: Sequence[int] | None = None,
) -> None:
    """Raise :class:`NonFiniteError` when a per-sample value (``[B]``, group-major: sample ``i``
    of the batch is in group ``i // group_size``) is NaN or infinite, naming ``what``, each bad
    group's id and its prompt (``prompts``: one per group where known). ``rows``: the batch rows
    ``values`` stands for (default: all, in order), e.g. the rows dynamic sampling kept."""
    bad = nonfinite_rows(values)
    if not bad:
        return
    index = list(rows) if rows is not None else list(range(values.numel()))
    groups = sorted({index[i] // group_size for i in bad})
    named = []
    for g in groups[:ROWS_NAMED]:
        prompt = repr(prompts[g][:PROMPT_CHARS]) if g < len(prompts) else "unknown"
        named.append(f"group {group_ids[g]}, prompt {prompt}")
    more = f" (and {len(groups) - ROWS_NAMED} more groups)" if len(groups) > ROWS_NAMED else ""
    raise NonFiniteError(f"{what} is not finite (NaN or infinite) for {len(bad)} sample(s): " + "; ".join(named) + more)
