"""Validation and (de)composition of the tensors a batch carries.

What a caller may put (the contract every adapter shares):

* a ``TensorDict`` with ``batch_size == [len(keys)]`` or a mapping ``name -> torch.Tensor``;
* a **dense** field: a tensor whose dim 0 is the batch (``[B]`` is a per-sample scalar);
* a **jagged** field: a ``torch.nested`` tensor of jagged layout, ``[B, j, *rest]``;
* dtypes in :data:`SUPPORTED_DTYPES`.

Anything else raises: ``TypeError`` naming the field for a non-tensor value or an unsupported
dtype/layout, ``ValueError`` naming the field for a wrong batch size. Nothing is converted
silently: what comes back from a get has the dtype, shape and layout that was put.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, cast

import torch
from tensordict import TensorDict

from nemo_dataplane.dtypes import WIRE_DTYPES

# The wire codes live in the dtype table (nemo_dataplane.dtypes); re-exported for codec users.
DTYPE_CODES: tuple[torch.dtype, ...] = WIRE_DTYPES
SUPPORTED_DTYPES: frozenset[torch.dtype] = frozenset(DTYPE_CODES)


def is_jagged(t: torch.Tensor) -> bool:
    """True for a nested tensor of jagged layout."""
    return bool(getattr(t, "is_nested", False)) and t.layout == torch.jagged


def normalize_fields(fields: TensorDict | Mapping[str, Any] | None, n_rows: int) -> dict[str, torch.Tensor]:
    """Check ``fields`` against the put contract and return ``{name: tensor}`` (no copies).

    Raises:
        TypeError: ``fields`` is not a mapping, a value is not a tensor, or its dtype/layout is
            not supported (message names the field).
        ValueError: a field's batch dimension differs from ``n_rows`` (names the field).
    """
    if fields is None:
        return {}
    if isinstance(fields, TensorDict):
        if fields.batch_dims and tuple(fields.batch_size[:1]) != (n_rows,):
            raise ValueError(f"fields.batch_size {list(fields.batch_size)} does not match {n_rows} keys")
        items = list(fields.items(include_nested=False, leaves_only=False))
    elif isinstance(fields, Mapping):
        items = list(fields.items())
    else:
        raise TypeError(f"fields must be a TensorDict or a dict of tensors, got {type(fields).__name__}")
    out: dict[str, torch.Tensor] = {}
    for name, value in items:
        if not isinstance(name, str) or not name:
            raise TypeError(f"field names must be non-empty str, got {name!r}")
        if isinstance(value, TensorDict):
            raise TypeError(f"field {name!r}: nested TensorDicts are not supported; flatten it into named tensors")
        if not isinstance(value, torch.Tensor):
            raise TypeError(
                f"field {name!r}: expected a torch.Tensor, got {type(value).__name__}; "
                "encode strings/lists as tensors (e.g. token ids) before putting them"
            )
        if value.dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"field {name!r}: dtype {value.dtype} is not supported (supported: {_dtype_names()})")
        if getattr(value, "is_nested", False) and not is_jagged(value):
            raise TypeError(f"field {name!r}: nested tensors must use layout=torch.jagged, got {value.layout}")
        if not getattr(value, "is_nested", False) and value.layout != torch.strided:
            raise TypeError(f"field {name!r}: layout {value.layout} is not supported; put a dense or jagged tensor")
        if value.dim() == 0:
            raise ValueError(f"field {name!r}: a 0-d tensor has no batch dimension; use shape [{n_rows}]")
        rows = value.size(0)
        if rows != n_rows:
            raise ValueError(f"field {name!r}: batch dimension is {rows}, expected {n_rows} (one row per key)")
        out[name] = value
    return out


def _dtype_names() -> str:
    return ", ".join(sorted(str(d).replace("torch.", "") for d in SUPPORTED_DTYPES))


def split_rows(t: torch.Tensor) -> list[torch.Tensor]:
    """One view per sample: ``t[i]`` for dense, the i-th component for jagged."""
    return list(t.unbind(0))


def join_rows(name: str, rows: Sequence[torch.Tensor], jagged: bool) -> torch.Tensor:
    """Inverse of :func:`split_rows`: stack dense rows, or build a jagged nested tensor.

    Raises:
        TypeError: rows disagree in dtype (names the field).
        ValueError: dense rows disagree in shape, or jagged rows in anything but dim 0.
    """
    if not rows:
        raise ValueError(f"field {name!r}: no rows to join")
    dtypes = {r.dtype for r in rows}
    if len(dtypes) > 1:
        raise TypeError(f"field {name!r}: rows were stored with different dtypes {sorted(map(str, dtypes))}")
    if jagged:
        trailing = {tuple(r.shape[1:]) for r in rows}
        if any(r.dim() == 0 for r in rows) or len(trailing) > 1:
            raise ValueError(
                f"field {name!r}: rows cannot form one jagged tensor (shapes {[tuple(r.shape) for r in rows[:5]]})"
            )
        lengths = torch.tensor([r.shape[0] for r in rows], dtype=torch.int64)
        offsets = torch.zeros(len(rows) + 1, dtype=torch.int64)
        torch.cumsum(lengths, 0, out=offsets[1:])
        values = torch.cat([r.reshape(r.shape[0], *r.shape[1:]) for r in rows], 0)
        return torch.nested.nested_tensor_from_jagged(values, offsets=offsets)
    shapes = {tuple(r.shape) for r in rows}
    if len(shapes) > 1:
        raise ValueError(
            f"field {name!r}: rows have different shapes {sorted(shapes)[:5]}; put it as a jagged nested tensor"
        )
    return torch.stack(list(rows), 0)


def jagged_from_rows(rows: Sequence[torch.Tensor]) -> torch.Tensor:
    """A jagged nested tensor from 1-D rows (contiguous values + offsets); an empty list gives an
    empty float32 jagged tensor. Unlike :func:`join_rows` it takes rows of any length, including 0."""
    lengths = torch.tensor([r.numel() for r in rows], dtype=torch.int64)
    offsets = torch.zeros(len(rows) + 1, dtype=torch.int64)
    torch.cumsum(lengths, 0, out=offsets[1:])
    values = torch.cat([r.reshape(-1) for r in rows]) if rows else torch.zeros(0)
    return torch.nested.nested_tensor_from_jagged(values, offsets=offsets)


def jagged_rows(t: torch.Tensor) -> list[torch.Tensor]:
    """The rows of a jagged nested tensor (views of its values) or of a dense ``[N, ...]`` tensor."""
    if getattr(t, "is_nested", False):
        values, offsets = t.values(), t.offsets().tolist()  # type: ignore[attr-defined]  # torch's stub lacks the NJT accessor
        return [values[a:b] for a, b in zip(offsets[:-1], offsets[1:])]
    return list(t.unbind(0))


def tensor_nbytes(t: torch.Tensor) -> int:
    """Payload bytes of a dense or jagged tensor (values only, not offsets)."""
    if is_jagged(t):
        v = t.values()
        return v.numel() * v.element_size()
    return t.numel() * t.element_size()


def batch_nbytes(fields: TensorDict | Mapping[str, torch.Tensor] | None) -> int:
    """Total payload bytes of a batch's tensors."""
    if fields is None:
        return 0
    if isinstance(fields, TensorDict):
        # A batch's leaves are tensors; TensorDict types them as tensors or tensor collections.
        leaves = fields.items(include_nested=True, leaves_only=True)
        return sum(tensor_nbytes(cast(torch.Tensor, v)) for _, v in leaves)
    return sum(tensor_nbytes(v) for v in fields.values() if isinstance(v, torch.Tensor))


def bytes_per_sample(t: torch.Tensor) -> float:
    """Mean payload bytes per row (0 for an empty batch)."""
    rows = t.size(0)
    return tensor_nbytes(t) / rows if rows else 0.0


def make_batch(columns: Mapping[str, torch.Tensor], n_rows: int) -> TensorDict:
    """A ``TensorDict`` of batch size ``[n_rows]`` holding ``columns`` as given (no copies)."""
    return TensorDict(dict(columns), batch_size=[n_rows])
