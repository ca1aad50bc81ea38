"""codec: the put contract's validation, row split/join, byte counting."""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict

from nemo_dataplane import codec
from nemo_dataplane.testing.fields import jagged


def test_normalize_accepts_dicts_and_tensordicts_without_copying() -> None:
    x = torch.zeros(3, 2)
    ids = jagged([1, 2, 3])
    out = codec.normalize_fields({"x": x, "ids": ids}, 3)
    assert out["x"] is x and out["ids"] is ids
    td = TensorDict({"x": x}, batch_size=[3])
    assert codec.normalize_fields(td, 3)["x"].data_ptr() == x.data_ptr()
    assert codec.normalize_fields(None, 3) == {}


@pytest.mark.parametrize(
    ("fields", "exc", "match"),
    [
        ({"ok": torch.zeros(3), "bad": [1, 2, 3]}, TypeError, r"field 'bad': expected a torch.Tensor, got list"),
        ({"c": torch.zeros(3, dtype=torch.complex64)}, TypeError, r"field 'c': dtype torch.complex64 is not supported"),
        ({"s": torch.zeros(3, 2).to_sparse()}, TypeError, r"field .s.: layout torch.sparse_coo is not supported"),
        ({"short": torch.zeros(2)}, ValueError, r"field 'short': batch dimension is 2, expected 3"),
        ({"zero_d": torch.tensor(1.0)}, ValueError, r"field 'zero_d': a 0-d tensor"),
        (
            {"nt": torch.nested.nested_tensor([torch.zeros(2), torch.zeros(3), torch.zeros(1)])},
            TypeError,
            "layout=torch.jagged",
        ),
        ({"td": TensorDict({"a": torch.zeros(3)}, batch_size=[3])}, TypeError, r"field 'td': nested TensorDicts"),
        ({1: torch.zeros(3)}, TypeError, "field names must be non-empty str"),
    ],
)
def test_bad_fields_raise_naming_the_field(fields: dict, exc: type[Exception], match: str | None) -> None:
    with pytest.raises(exc, match=match):
        codec.normalize_fields(fields, 3)


def test_tensordict_with_wrong_batch_size_and_non_mapping() -> None:
    with pytest.raises(ValueError, match=r"batch_size \[2\] does not match 3 keys"):
        codec.normalize_fields(TensorDict({"x": torch.zeros(2)}, batch_size=[2]), 3)
    with pytest.raises(TypeError, match="TensorDict or a dict"):
        codec.normalize_fields([torch.zeros(3)], 3)  # type: ignore[arg-type]


def test_split_join_round_trip_dense_and_jagged() -> None:
    dense = torch.arange(12).view(3, 2, 2)
    rows = codec.split_rows(dense)
    assert len(rows) == 3 and torch.equal(codec.join_rows("d", rows, jagged=False), dense)
    j = jagged([2, 0, 3], 4, dtype=torch.float32)
    back = codec.join_rows("j", codec.split_rows(j), jagged=True)
    assert codec.is_jagged(back) and torch.equal(back.offsets(), j.offsets()) and torch.equal(back.values(), j.values())
    eq = codec.join_rows("e", [torch.ones(2), torch.ones(2)], jagged=True)
    assert codec.is_jagged(eq)  # equal lengths still come back jagged when asked


def test_join_rows_errors_name_the_field() -> None:
    with pytest.raises(TypeError, match=r"field 'm': rows were stored with different dtypes"):
        codec.join_rows("m", [torch.zeros(2), torch.zeros(2, dtype=torch.int64)], jagged=False)
    with pytest.raises(ValueError, match=r"field 'm': rows have different shapes"):
        codec.join_rows("m", [torch.zeros(2), torch.zeros(3)], jagged=False)
    with pytest.raises(ValueError, match=r"field 'm': rows cannot form one jagged tensor"):
        codec.join_rows("m", [torch.zeros(2, 3), torch.zeros(2, 4)], jagged=True)
    with pytest.raises(ValueError, match="no rows"):
        codec.join_rows("m", [], jagged=False)


def test_byte_counting() -> None:
    j = jagged([2, 3], 4, dtype=torch.float16)
    assert codec.tensor_nbytes(j) == 5 * 4 * 2  # values only, offsets excluded
    assert codec.tensor_nbytes(torch.zeros(3, 5, dtype=torch.int64)) == 120
    batch = {"j": j, "d": torch.zeros(2, 3, dtype=torch.bool)}
    assert codec.batch_nbytes(batch) == 40 + 6
    assert codec.batch_nbytes(TensorDict({"d": torch.zeros(2, 3)}, batch_size=[2])) == 24
    assert codec.batch_nbytes(None) == 0
    assert codec.bytes_per_sample(j) == 20.0 and codec.bytes_per_sample(torch.zeros(0, 3)) == 0.0


def test_supported_dtypes_and_make_batch() -> None:
    assert torch.bfloat16 in codec.SUPPORTED_DTYPES and torch.complex64 not in codec.SUPPORTED_DTYPES
    td = codec.make_batch({"x": torch.zeros(4, 2), "ids": jagged([1, 2, 3, 4])}, 4)
    assert td.batch_size == torch.Size([4]) and codec.is_jagged(td["ids"])
    assert not codec.is_jagged(torch.zeros(2))
