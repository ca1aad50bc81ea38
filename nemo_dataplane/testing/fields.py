"""Field helpers for store tests: jagged and random fields of any dtype, and a bit-exact field
comparison that names the field. Used by the conformance suite and by a backend's own tests."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, cast

import torch
from tensordict import TensorDict

from nemo_dataplane.codec import is_jagged

__all__ = ["assert_same_field", "from_wire", "jagged", "random_field", "rows_of", "to_wire", "unique_keys"]


def jagged(lengths: list[int], *trailing: int, dtype: torch.dtype = torch.int64, seed: int = 0) -> torch.Tensor:
    """A jagged nested tensor ``[len(lengths), j, *trailing]`` of reproducible random values."""
    offsets = torch.zeros(len(lengths) + 1, dtype=torch.int64)
    offsets[1:] = torch.cumsum(torch.tensor(lengths, dtype=torch.int64), 0)
    values = random_field((int(offsets[-1]), *trailing), dtype, seed)
    return torch.nested.nested_tensor_from_jagged(values, offsets=offsets)


def random_field(shape: tuple[int, ...], dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Random bits of ``dtype`` (any bit pattern for floats, incl. NaN payloads; 0/1 for bool)."""
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g, dtype=torch.uint8).bool()
    item = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (*shape, item) if shape else (item,), generator=g, dtype=torch.uint8)
    return raw.view(dtype).reshape(shape)


def _bits(t: torch.Tensor) -> torch.Tensor:
    t = t.contiguous()
    return t.view(torch.uint8) if t.dtype != torch.bool else t.to(torch.uint8)


def assert_same_field(name: str, got: torch.Tensor, want: torch.Tensor) -> None:
    """Bit-exact equality, same dtype, same layout (dense vs jagged), same shape / offsets."""
    assert got.dtype == want.dtype, f"{name}: dtype {got.dtype} != {want.dtype}"
    assert is_jagged(got) == is_jagged(want), f"{name}: jagged={is_jagged(got)}, put jagged={is_jagged(want)}"
    if is_jagged(want):
        go, wo = got.offsets(), want.offsets()  # type: ignore[attr-defined]  # torch's stub lacks the NJT accessor
        assert torch.equal(go - go[0], wo - wo[0]), f"{name}: offsets"
        gv, wv = got.values(), want.values()
        assert gv.shape[1:] == wv.shape[1:], f"{name}: per-token shape {tuple(gv.shape[1:])} != {tuple(wv.shape[1:])}"
        assert torch.equal(_bits(gv), _bits(wv)), f"{name}: values differ"
    else:
        assert got.shape == want.shape, f"{name}: shape {tuple(got.shape)} != {tuple(want.shape)}"
        assert torch.equal(_bits(got), _bits(want)), f"{name}: values differ"


def rows_of(t: torch.Tensor, order: list[int]) -> torch.Tensor:
    """Rows of dense or jagged ``t`` in ``order`` (the test-side reference: index arithmetic on
    the jagged values and offsets, no per-row tensors, so thousands of rows stay cheap)."""
    idx = torch.tensor(order, dtype=torch.int64)
    if not is_jagged(t):
        return t[idx]
    offsets, values = t.offsets(), t.values()  # type: ignore[attr-defined]  # torch's stub lacks the NJT accessors
    starts = offsets[idx]
    lengths = offsets[idx + 1] - starts
    new_offsets = torch.zeros(len(order) + 1, dtype=torch.int64)
    new_offsets[1:] = torch.cumsum(lengths, 0)
    total = int(new_offsets[-1])
    # position j of the result comes from values[starts[row] + (j - new_offsets[row])]
    pos = torch.repeat_interleave(starts - new_offsets[:-1], lengths, output_size=total) + torch.arange(total)
    return torch.nested.nested_tensor_from_jagged(values[pos], offsets=new_offsets)


def unique_keys(n: int, prefix: str = "k") -> list[str]:
    return [f"{prefix}{i}" for i in range(n)]


def to_wire(td: TensorDict) -> dict[str, Any]:
    """Jagged tensors as (values, offsets) so results cross Ray without nested pickling."""
    fields = {k: cast(torch.Tensor, v) for k, v in td.items()}  # a batch's fields are tensors
    return {
        k: (
            ("j", v.values().clone(), v.offsets().clone())  # type: ignore[attr-defined]  # torch's stub: no NJT offsets()
            if is_jagged(v)
            else ("d", v.clone())
        )
        for k, v in fields.items()
    }


def from_wire(data: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    out = {}
    for k, v in data.items():
        out[k] = torch.nested.nested_tensor_from_jagged(v[1], offsets=v[2]) if v[0] == "j" else v[1]
    return out


# ------------------------------------------------------------------ the suite
