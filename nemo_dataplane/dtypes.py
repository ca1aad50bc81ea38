"""The one table of dtype names a decoder accepts, and checks of decoded shapes and spans.

Records decoded from a store, an object reference or a checkpoint name their dtype as a string
(``"bfloat16"``); every decoder turns it into a ``torch.dtype`` through :func:`dtype_from_name`,
never ``getattr(torch, name)`` (which would hand back any attribute of the torch module a
forged record names). Shapes, sizes and offsets decoded beside it are checked here too, each
error naming the field at fault.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

__all__ = [
    "DTYPES",
    "WIRE_DTYPES",
    "check_lengths",
    "check_shape",
    "check_span",
    "dtype_code",
    "dtype_from_code",
    "dtype_from_name",
    "dtype_name",
    "view_bytes",
]

# Names as ``str(dtype)`` without "torch."; fp8 variants only where this torch build has them.
_NAMES = (
    "bool",
    "uint8",
    "int8",
    "int16",
    "int32",
    "int64",
    "uint16",
    "uint32",
    "uint64",
    "float16",
    "bfloat16",
    "float32",
    "float64",
    "complex64",
    "complex128",
    "float8_e4m3fn",
    "float8_e5m2",
    "float8_e4m3fnuz",
    "float8_e5m2fnuz",
    "float8_e8m0fnu",
)
DTYPES: dict[str, torch.dtype] = {n: dt for n in _NAMES if isinstance(dt := getattr(torch, n, None), torch.dtype)}

# Ordered: a dtype's position is its wire code where tensors travel with a small integer header
# (the worker broadcast). Append only, so both ends of a mixed-version job agree.
WIRE_DTYPES: tuple[torch.dtype, ...] = tuple(
    DTYPES[n] for n in ("bool", "uint8", "int8", "int16", "int32", "int64", "float16", "bfloat16", "float32", "float64")
)


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"`` (the key of :data:`DTYPES`)."""
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: Any, field: str = "dtype", error: type[Exception] = ValueError) -> torch.dtype:
    """The dtype :data:`DTYPES` maps ``name`` to.

    Raises:
        error: ``name`` is not a key of the table (message names ``field`` and the value).
    """
    dt = DTYPES.get(name) if isinstance(name, str) else None
    if dt is None:
        raise error(f"{field}: unknown dtype {name!r} (accepted: {', '.join(DTYPES)})")
    return dt


def dtype_code(dtype: torch.dtype, field: str = "dtype", error: type[Exception] = TypeError) -> int:
    """``dtype``'s wire code (its position in :data:`WIRE_DTYPES`).

    Raises:
        error: ``dtype`` has no wire code (message names ``field``).
    """
    try:
        return WIRE_DTYPES.index(dtype)
    except ValueError:
        raise error(f"{field}: dtype {dtype} has no wire code (accepted: {_wire_names()})") from None


def dtype_from_code(code: Any, field: str = "dtype code", error: type[Exception] = ValueError) -> torch.dtype:
    """The dtype of wire code ``code``: an int in ``[0, len(WIRE_DTYPES))``, nothing else (a
    negative code must not index the table from its end).

    Raises:
        error: ``code`` is not an int in range (message names ``field`` and the value).
    """
    if isinstance(code, bool) or not isinstance(code, int) or not 0 <= code < len(WIRE_DTYPES):
        raise error(f"{field}: unknown dtype code {code!r} (accepted: 0..{len(WIRE_DTYPES) - 1}: {_wire_names()})")
    return WIRE_DTYPES[code]


def _wire_names() -> str:
    return ", ".join(dtype_name(d) for d in WIRE_DTYPES)


def check_shape(shape: Any, field: str = "shape", error: type[Exception] = ValueError) -> tuple[int, ...]:
    """``shape`` as a tuple of non-negative ints.

    Raises:
        error: ``shape`` is not a sequence of non-negative ints (message names ``field``).
    """
    if not isinstance(shape, Iterable) or isinstance(shape, (str, bytes)):
        raise error(f"{field}: shape must be a sequence of ints, got {shape!r}")
    out = tuple(shape)
    if not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in out):
        raise error(f"{field}: shape must hold non-negative ints, got {shape!r}")
    return out


def check_span(offset: Any, nbytes: Any, limit: int, field: str = "span", error: type[Exception] = ValueError) -> None:
    """Check that ``[offset, offset + nbytes)`` lies inside a buffer of ``limit`` bytes.

    Raises:
        error: an int is negative or not an int, or the span ends past ``limit`` (names ``field``).
    """
    for what, v in (("offset", offset), ("size", nbytes)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise error(f"{field}: {what} must be a non-negative int, got {v!r}")
    if offset + nbytes > limit:
        raise error(f"{field}: bytes [{offset}, {offset + nbytes}) run past the buffer's {limit} bytes")


def view_bytes(buf: torch.Tensor, dtype: Any, shape: Any, field: str = "field") -> torch.Tensor:
    """``buf`` (flat ``uint8``) viewed as ``dtype`` of ``shape``, after checking that the dtype
    is in the table, the shape holds non-negative ints and the byte count matches exactly.

    Raises:
        ValueError: any of those fails (message names ``field``).
    """
    dt = dtype_from_name(dtype, f"{field} dtype")
    shp = check_shape(shape, f"{field} shape")
    n = dt.itemsize
    for s in shp:
        n *= s
    if n != buf.numel():
        raise ValueError(f"{field}: {dtype} {list(shp)} needs {n} bytes, the buffer holds {buf.numel()}")
    return buf.view(dt).view(shp)


def check_lengths(lengths: Any, total: int, field: str = "field") -> None:
    """Jagged row lengths: non-negative ints summing to ``total`` (the values' dim 0).

    Raises:
        ValueError: otherwise (message names ``field``).
    """
    ls = [int(x) for x in lengths]
    if any(x < 0 for x in ls) or sum(ls) != total:
        raise ValueError(
            f"{field}: row lengths must be non-negative and sum to {total} values, got {ls[:8]}"
            f"{'...' if len(ls) > 8 else ''} (sum {sum(ls)})"
        )
