"""The one dtype table and the field checks every decoder uses; forged records are refused."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch

from nemo_dataplane.adapters.chunks import decode, encode
from nemo_dataplane.dtypes import (
    DTYPES,
    WIRE_DTYPES,
    check_shape,
    check_span,
    dtype_code,
    dtype_from_code,
    dtype_from_name,
    view_bytes,
)
from nemo_dataplane.refit.cuda.ipc import _check_view
from nemo_dataplane.refit.packed import RefitInfo
from nemo_dataplane.refit.protocol import RefitError, TensorSpec
from nemo_dataplane.refit.reshard.layout import Layout, LayoutError

FORGED = ["Tensor", "load", "__class__", "nn", "float33", "", None, 3]


def test_table_holds_dtypes_only_and_round_trips_names() -> None:
    assert all(isinstance(d, torch.dtype) for d in DTYPES.values())
    for d in DTYPES.values():
        assert dtype_from_name(str(d).removeprefix("torch.")) is d
    assert {"bfloat16", "float32", "int64", "bool", "uint8"} <= set(DTYPES)


@pytest.mark.parametrize("name", FORGED)
def test_a_forged_dtype_name_is_refused_naming_the_field(name: object) -> None:
    with pytest.raises(ValueError, match="col 'x' dtype: unknown dtype"):
        dtype_from_name(name, "col 'x' dtype")


def test_forged_dtype_in_each_decoder() -> None:
    enc = encode(torch.arange(4, dtype=torch.int32))
    with pytest.raises(ValueError, match="chunk field dtype: unknown dtype 'Tensor'"):
        decode(("Tensor", *enc[1:]))
    info = RefitInfo((TensorSpec("w", (2, 2), "float32"),), 1 << 20, 1 << 20, 0)
    doc = json.loads(info.to_bytes())
    assert RefitInfo.from_bytes(info.to_bytes()) == info
    doc["tensors"][0][2] = "load"
    with pytest.raises(RefitError, match=r"tensors\[0\] \('w'\) dtype: unknown dtype 'load'"):
        RefitInfo.from_bytes(json.dumps(doc).encode())
    doc["tensors"][0][2], doc["tensors"][0][1] = "float32", [2, -1]
    with pytest.raises(RefitError, match=r"tensors\[0\] \('w'\) shape: .*non-negative"):
        RefitInfo.from_bytes(json.dumps(doc).encode())
    doc["tensors"][0][1], doc["bucket_bytes"] = [2, 2], -5
    with pytest.raises(RefitError, match="bucket_bytes"):
        RefitInfo.from_bytes(json.dumps(doc).encode())
    layout = {
        "mesh": {"dims": ["dp"], "sizes": [1], "ranks": [0]},
        "params": {"w": {"shape": [4], "dtype": "__class__", "placements": ["R"], "rule": None}},
    }
    with pytest.raises(LayoutError, match="layout param 'w' dtype: unknown dtype '__class__'"):
        Layout.from_dict(layout)


def test_shapes_spans_and_byte_counts_are_checked() -> None:
    assert check_shape([2, 0, 3]) == (2, 0, 3)
    for bad in ([2, -1], [2.0], "23", [True]):
        with pytest.raises(ValueError, match="f: shape"):
            check_shape(bad, "f")
    check_span(4, 4, 8)
    with pytest.raises(ValueError, match="v: bytes \\[4, 12\\) run past"):
        check_span(4, 8, 8, "v")
    buf = torch.from_numpy(np.zeros(12, dtype=np.uint8))
    assert view_bytes(buf, "int32", (3,)).shape == (3,)
    with pytest.raises(ValueError, match="c: int32 \\[4\\] needs 16 bytes, the buffer holds 12"):
        view_bytes(buf, "int32", (4,), "c")
    ok = {
        "tensor_size": (2, 3),
        "tensor_stride": (3, 1),
        "tensor_offset": 0,
        "dtype": torch.float32,
        "storage_size_bytes": 24,
    }
    _check_view(ok)
    with pytest.raises(ValueError, match="tensor view: bytes"):
        _check_view({**ok, "tensor_offset": 1})  # one element past the storage
    with pytest.raises(ValueError, match="tensor_stride"):
        _check_view({**ok, "tensor_stride": (3,)})


def test_wire_codes_round_trip_and_out_of_range_codes_are_refused() -> None:
    assert [dtype_from_code(dtype_code(d)) for d in WIRE_DTYPES] == list(WIRE_DTYPES)
    for bad in (-1, len(WIRE_DTYPES), True, 1.0, "5"):
        with pytest.raises(ValueError, match=rf"field 'x' code: unknown dtype code {re.escape(repr(bad))}"):
            dtype_from_code(bad, "field 'x' code")
