"""Column I/O for the driver: read and write small per-sample values (rewards, advantages).

The driver legitimately needs a few scalars per sample; it must never pull token ids or
log-probs. Both helpers refuse any field wider than ``max_bytes_per_sample`` (default 64, from
``data_plane.column_max_bytes_per_sample``) so bulk cannot leak into the driver by accident.

How the read guard works without fetching the bulk first: the store keeps no per-field size, so
:func:`read_columns` first reads the requested fields of **one** key (a probe costing one small
round trip) and refuses before fetching the rest if that row is too wide. Rows can differ in
width only for jagged fields, so the full answer is checked again before it is returned: a
jagged field that is narrow on the probed key but wide elsewhere is still refused (after one
fetch), never returned.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from tensordict import TensorDict

from nemo_dataplane.client import DataPlaneClient, check_select_fields
from nemo_dataplane.codec import is_jagged, normalize_fields
from nemo_dataplane.meta import KVBatchMeta

__all__ = ["DEFAULT_MAX_BYTES_PER_SAMPLE", "max_row_bytes", "read_columns", "write_columns"]

DEFAULT_MAX_BYTES_PER_SAMPLE = 64


def max_row_bytes(t: torch.Tensor) -> int:
    """Payload bytes of the widest row of ``t`` (dense: every row; jagged: the longest one)."""
    if t.size(0) == 0:
        return 0
    if is_jagged(t):
        offsets = t.offsets()  # type: ignore[attr-defined]  # torch's stub lacks the NJT accessor
        longest = int((offsets[1:] - offsets[:-1]).max().item())
        row_elems = longest
        for d in t.values().shape[1:]:
            row_elems *= int(d)
        return row_elems * t.values().element_size()
    return (t.numel() // t.size(0)) * t.element_size()


def _refuse_wide(name: str, nbytes: int, limit: int, where: str) -> None:
    if nbytes > limit:
        raise ValueError(
            f"field {name!r} is {nbytes} bytes/sample ({where}), above the driver column limit of {limit} "
            "bytes/sample: driver column I/O is for small per-sample values (rewards, advantages); move bulk "
            "through the workers, or raise data_plane.column_max_bytes_per_sample (max_bytes_per_sample=)"
        )


def _check_limit(limit: int) -> int:
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
        raise ValueError(f"max_bytes_per_sample must be an int >= 1, got {limit!r}")
    return limit


def read_columns(
    client: DataPlaneClient,
    meta: KVBatchMeta,
    fields: Sequence[str],
    *,
    max_bytes_per_sample: int = DEFAULT_MAX_BYTES_PER_SAMPLE,
) -> dict[str, torch.Tensor]:
    """Read small per-sample ``fields`` of ``meta``'s keys, rows in ``meta`` order.

    Raises:
        ValueError: a field is wider than ``max_bytes_per_sample`` (names it, its bytes/sample,
            the limit and the config key that raises it); nothing is returned.
        KeyError: keys or fields missing in the store (from the client).
    """
    limit = _check_limit(max_bytes_per_sample)
    names = check_select_fields(fields)
    if len(meta) == 0:
        return {}
    probe = client.kv_batch_get(meta.subset([0]), names)
    for name in names:
        _refuse_wide(name, max_row_bytes(probe.get(name)), limit, f"probed on key {meta.keys[0]!r}")
    data = probe if len(meta) == 1 else client.kv_batch_get(meta, names)
    out: dict[str, torch.Tensor] = {}
    for name in names:
        t = data.get(name)
        _refuse_wide(name, max_row_bytes(t), limit, "widest row of the batch")
        out[name] = t
    return out


def write_columns(
    client: DataPlaneClient,
    meta: KVBatchMeta,
    columns: Mapping[str, torch.Tensor] | TensorDict,
    *,
    max_bytes_per_sample: int = DEFAULT_MAX_BYTES_PER_SAMPLE,
) -> KVBatchMeta:
    """Write small per-sample ``columns`` (one row per key, ``meta`` order) for ``meta``'s keys.

    Every check runs before any I/O, so a refused call writes nothing.

    Returns:
        ``meta`` with the written fields added to ``fields`` (tags and ``extra_info`` kept).

    Raises:
        ValueError: a column wider than ``max_bytes_per_sample`` (names it), a wrong row count,
            or an empty ``columns``.
        TypeError: a non-tensor column (from the codec).
    """
    limit = _check_limit(max_bytes_per_sample)
    if meta.partition_id is None:
        raise ValueError("write_columns: the meta has no partition_id")
    cols = normalize_fields(columns, len(meta))
    if not cols:
        raise ValueError("write_columns: no columns given")
    for name, t in cols.items():
        _refuse_wide(name, max_row_bytes(t), limit, "widest row written")
    client.kv_batch_put(list(meta.keys), meta.partition_id, cols)
    return meta.add_fields(cols)
