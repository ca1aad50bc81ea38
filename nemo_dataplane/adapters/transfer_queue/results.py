"""What the TransferQueue adapter hands back, in the layout each field was put with: the
reserved :data:`LAYOUT_TAG` on every key (``{field: "dense" | "jagged"}``), the metas a put
returns, the batches a get assembles from the units' columns, and the errors naming the keys
or fields at fault. Pure functions; :mod:`.client` runs the ops."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from tensordict import TensorDict

from nemo_dataplane.adapters.transfer_queue import compat
from nemo_dataplane.codec import is_jagged, make_batch
from nemo_dataplane.errors import NemoDataplaneError
from nemo_dataplane.meta import KVBatchMeta

LAYOUT_TAG = compat.LAYOUT_TAG


def field_order(fields: list[str], first_key_meta: Mapping[str, Any]) -> list[str]:
    """``fields`` in the order they were first put on the first key (the reference client's
    order); fields without a layout entry (written by other clients) keep their place at the end."""
    layout = first_key_meta.get(LAYOUT_TAG, {})
    common = set(fields)
    return [f for f in layout if f in common] + [f for f in fields if f not in layout]


public_tags = compat.public_tags


def layout_of(columns: Mapping[str, torch.Tensor]) -> dict[str, str]:
    return {name: ("jagged" if is_jagged(t) else "dense") for name, t in columns.items()}


def jagged_in(layout: Mapping[str, str]) -> set[str]:
    return {name for name, how in layout.items() if how == "jagged"}


def put_meta(
    keys: list[str],
    partition_id: str,
    columns: Mapping[str, torch.Tensor],
    stored_tags: list[dict[str, Any]],
    before_fields: list[str],
) -> KVBatchMeta:
    """What a put returns: the keys' public tags and every field they hold now."""
    known = field_order(before_fields + [f for f in columns if f not in before_fields], stored_tags[0])
    return KVBatchMeta(
        keys=tuple(keys),
        tags=tuple([public_tags(cm) for cm in stored_tags]),
        partition_id=partition_id,
        fields=tuple(known),
    )


def not_there(missing: list[str], partition_id: str) -> KeyError:
    return KeyError(f"{len(missing)} key(s) not in partition {partition_id!r}: {missing[:10]}")


class NotProduced(NemoDataplaneError, KeyError):
    """Every key was put with the field, yet its rows are not produced now: a clear has begun
    (it zeroes production before it removes keys) or a put over them has not finished."""


def cleared_meanwhile(keys: list[str], partition_id: str) -> KeyError:
    return KeyError(
        f"{len(keys)} key(s) of partition {partition_id!r} were cleared (or are being put again) while "
        f"being read: {keys[:10]}"
    )


def check_stored(
    names: list[str], stored: list[str], keys: list[str], tags: Sequence[Mapping[str, Any]], partition_id: str
) -> None:
    """Raises ``KeyError`` naming the first of ``names`` not stored for every key
    (:class:`NotProduced` when every key's tags say it was put with it)."""
    have = set(stored)
    for name in names:
        if name not in have:
            lacking = [k for k, cm in zip(keys, tags) if name not in cm.get(LAYOUT_TAG, {})]
            where = f"e.g. {lacking[:5]}" if lacking else "(some keys lack it)"
            raise (KeyError if lacking else NotProduced)(
                f"field {name!r} is not stored for {len(lacking) or 'some'} key(s) in partition "
                f"{partition_id!r}, {where}"
            )


def columns_batch(
    cols: Mapping[str, compat.Column | torch.Tensor],
    names: list[str],
    keys: list[str],
    tags: Sequence[Mapping[str, Any]],
) -> TensorDict:
    columns = {
        name: col
        if isinstance(col, torch.Tensor)  # already in the layout it was put with
        else assemble(name, col, [cm.get(LAYOUT_TAG, {}).get(name) for cm in tags])
        for name, col in ((n, cols[n]) for n in names)
    }
    return make_batch(columns, len(keys))


def assemble(name: str, col: compat.Column, layouts: list[str | None]) -> torch.Tensor:
    """One field in the layout it was put with, from a :class:`~.compat.Column` (no per-row ops).

    Raises:
        ValueError: dense rows of different shapes, or scalar rows asked to be jagged.
    """
    if any(lay == "jagged" for lay in layouts):
        jagged = True
    elif all(lay == "dense" for lay in layouts):
        jagged = False
    else:  # written by another TransferQueue client: TransferQueue's own rule (scalars dense)
        jagged = not (col.lengths is None and col.values.dim() == 1)
    if not jagged:
        if col.lengths is not None:
            raise ValueError(f"field {name!r}: rows have different shapes; put it as a jagged nested tensor")
        return col.values
    try:
        rag = col.ragged()
    except ValueError as e:
        raise ValueError(f"field {name!r}: {e}") from None
    assert rag.lengths is not None
    offsets = torch.zeros(rag.lengths.numel() + 1, dtype=torch.int64)
    torch.cumsum(rag.lengths, 0, out=offsets[1:])
    return torch.nested.nested_tensor_from_jagged(rag.values, offsets=offsets)
