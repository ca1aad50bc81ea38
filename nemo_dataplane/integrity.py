"""Per-row digests of what a put wrote, checked by the gets that read it back.

With ``data_plane.verify_integrity`` the factory's :class:`~nemo_dataplane.observability.ObservedClient`
records, at every put, one 8-byte BLAKE2b digest per row and field (over the dtype, the row's
shape and its bytes; a jagged field's row is its own slice) as the tag ``_integrity:<field>`` of
the row's key, and recomputes them at every get for the fields fetched. Being tags, the digests
travel with the keys through every backend; a row whose bytes changed in the store (or on the
wire) while its tag did not fails the get with :class:`~nemo_dataplane.client.DataIntegrityError`
naming the key and the field.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from nemo_dataplane.codec import is_jagged

__all__ = ["TAG_PREFIX", "mismatches", "row_digests", "tag_name", "with_digests"]

TAG_PREFIX = "_integrity:"


def tag_name(field: str) -> str:
    """The tag that holds ``field``'s digest."""
    return TAG_PREFIX + field


def _digest(dtype: str, shape: tuple[int, ...], data: np.ndarray) -> str:
    h = hashlib.blake2b(digest_size=8)
    h.update(f"{dtype}{shape}".encode())
    h.update(data)
    return h.hexdigest()


def row_digests(t: torch.Tensor) -> list[str]:
    """One hex digest per row of a dense (``t[i]``) or jagged (``[len_i, *rest]``) field."""
    if t.device.type != "cpu":
        t = t.cpu()
    dtype = str(t.dtype).removeprefix("torch.")
    if is_jagged(t):
        values, offsets = t.values().contiguous(), t.offsets().tolist()
        rest = tuple(values.shape[1:])
        per = values[0].numel() * values.element_size() if values.shape[0] else 0
        flat = values.reshape(-1).view(torch.uint8).numpy()
        return [_digest(dtype, (b - a, *rest), flat[a * per : b * per]) for a, b in zip(offsets[:-1], offsets[1:])]
    t = t.contiguous()
    n, rest = t.shape[0], tuple(t.shape[1:])
    flat = t.reshape(-1).view(torch.uint8).numpy()
    per = flat.size // n if n else 0
    return [_digest(dtype, rest, flat[i * per : (i + 1) * per]) for i in range(n)]


def with_digests(columns: Mapping[str, torch.Tensor], tags: Sequence[Mapping[str, Any]] | None,
                 n_rows: int) -> list[dict[str, Any]]:
    """``tags`` (or empty ones) with each field's row digest added under :func:`tag_name`."""
    out = [dict(t) for t in tags] if tags is not None else [{} for _ in range(n_rows)]
    for name, t in columns.items():
        for row, d in zip(out, row_digests(t)):
            row[tag_name(name)] = d
    return out


def mismatches(data: Mapping[str, torch.Tensor], keys: Sequence[str], tags: Sequence[Mapping[str, Any]],
               fields: Sequence[str]) -> list[tuple[str, str, str]]:
    """``(key, field, why)`` for every fetched row whose digest differs from, or lacks, its tag."""
    bad = []
    for name in fields:
        tag = tag_name(name)
        for key, row_tags, got in zip(keys, tags, row_digests(data[name])):
            want = row_tags.get(tag)
            if want is None:
                bad.append((key, name, "no digest was recorded at put"))
            elif want != got:
                bad.append((key, name, f"digest {got} != {want} recorded at put"))
    return bad
