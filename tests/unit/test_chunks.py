"""Chunks (adapters/chunks.py, adapters/locate.py) and the row helpers they stand on
(rows.take_rows / concat_rows): encode -> decode round trips, and assembling rows located by
runs or per-row arrays across chunks, checked against a per-row reference. No Ray needed."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from nemo_dataplane.adapters.chunks import assemble, bundles, decode, encode, rows_of
from nemo_dataplane.adapters.locate import MAX_RUNS, where_of
from nemo_dataplane.codec import SUPPORTED_DTYPES
from nemo_dataplane.rows import concat_rows, take_rows
from nemo_dataplane.testing.fields import assert_same_field, jagged, random_field


def _reference(parts: list[torch.Tensor], picks: list[tuple[int, int]]) -> torch.Tensor:
    rows = [list(p.unbind()) if p.is_nested else list(p) for p in parts]
    picked = [rows[c][r] for c, r in picks]
    if any(p.is_nested for p in parts):
        return torch.nested.as_nested_tensor([x if x.dim() else x.view(1) for x in picked], layout=torch.jagged)
    return torch.stack(picked)


@pytest.mark.parametrize("dtype", sorted(SUPPORTED_DTYPES, key=str))
def test_encode_decode_round_trips_every_dtype_and_layout(dtype: torch.dtype) -> None:
    for t in (random_field((5, 3), dtype), random_field((5,), dtype), jagged([2, 0, 4, 1, 3], 2, dtype=dtype)):
        values, offsets = decode(encode(t))
        got = values if offsets is None else torch.nested.nested_tensor_from_jagged(values, offsets=offsets)
        assert_same_field(str(dtype), got, t)
    # a jagged view into a larger buffer ships only its rows, with offsets from 0
    sliced = take_rows(*(lambda t: (t.values(), t.offsets()))(jagged([3, 1, 2, 5])), range(1, 3), copy=False)
    enc = encode(sliced)
    assert enc[3].tolist() == [0, 1, 3] and enc[1] == (3,)


@pytest.mark.parametrize("scatter", [False, True])
def test_assemble_across_chunks_matches_per_row_reference(scatter: bool) -> None:
    g = torch.Generator().manual_seed(0)
    parts = [jagged(torch.randint(0, 6, (n,), generator=g).tolist(), 2, dtype=torch.float16, seed=n) for n in (7, 5, 9)]
    dense = [random_field((n, 3), torch.int32, seed=n) for n in (7, 5, 9)]
    picks = [(c, r) for c, n in enumerate((7, 5, 9)) for r in range(n)]
    if scatter:
        picks = [picks[i] for i in torch.randperm(len(picks), generator=g).tolist()]
    else:
        picks = picks[2:6] + picks[12:17]  # two runs across two chunks
    where = where_of(np.array([c for c, _ in picks]), np.array([r for _, r in picks]))
    assert where[0] == ("rows" if scatter else "runs")
    objs = [{"j": encode(j), "d": encode(d)} for j, d in zip(parts, dense)]
    for name, src in (("j", parts), ("d", dense)):
        got = assemble(name, where, lambda c, f: decode(objs[c][f]), copy=True)
        assert_same_field(name, got, _reference(src, picks))


def test_where_of_compacts_runs_and_falls_back_to_rows() -> None:
    assert where_of(np.array([0, 0, 0, 1, 1]), np.array([3, 4, 5, 0, 1])) == ("runs", [(0, 3, 3), (1, 0, 2)])
    assert where_of(np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)) == ("runs", [])
    scattered = np.arange(2 * MAX_RUNS + 2)[::-1].copy()
    assert where_of(np.zeros_like(scattered), scattered)[0] == "rows"


def test_single_run_is_a_view_unless_copied_and_rows_of_splits_rows() -> None:
    t = torch.arange(12.0).view(4, 3)
    view = take_rows(t, None, range(1, 3), copy=False)
    assert view.data_ptr() == t[1].data_ptr()
    assert take_rows(t, None, range(1, 3), copy=True).data_ptr() != t[1].data_ptr()
    assert take_rows(t, None, torch.tensor([3, 0]), copy=False).tolist() == [t[3].tolist(), t[0].tolist()]
    j = jagged([2, 0, 3])
    assert [r.tolist() for r in rows_of((j.values(), j.offsets()))] == [r.tolist() for r in j.unbind()]


def test_concat_rows_checks_what_can_join() -> None:
    mixed = concat_rows("x", [torch.ones(2, 3), jagged([1, 2], dtype=torch.float32)])
    assert mixed.is_nested and mixed.offsets().tolist() == [0, 3, 6, 7, 9]
    with pytest.raises(TypeError, match="'x'"):
        concat_rows("x", [torch.ones(2, 3), torch.ones(2, 3, dtype=torch.int64)])
    with pytest.raises(ValueError, match="'x'.*jagged"):
        concat_rows("x", [torch.ones(2, 3), torch.ones(2, 4)])


def test_a_put_is_at_most_two_chunks_bulk_and_narrow() -> None:
    small = {"a": torch.zeros(4, 3), "r": torch.zeros(4)}
    assert [list(b) for b in bundles(small)] == [["a", "r"]]
    big = {
        "ids": torch.zeros(1024, 1024, dtype=torch.int64),
        "r": torch.zeros(1024),
        "n": torch.zeros(1024, 8, dtype=torch.int64),
    }
    assert [sorted(b) for b in bundles(big)] == [["ids"], ["n", "r"]]
