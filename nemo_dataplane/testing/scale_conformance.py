"""Conformance tests at the sizes training reads: gets of hundreds to thousands of keys.

:class:`ScaleConformance` is a base of :class:`~nemo_dataplane.testing.conformance.DataPlaneConformance`.
A store that is right for a handful of rows can still misplace them in bulk (a batched path
taken above some size, rows spread over several puts, chunks, storage units): 1,500 keys are put
in three puts of different sizes, with dense and jagged columns of several dtypes and empty
rows, then read back many ways: every key in a random order, the same order again, reversed by
plain keys, random subsets of 65 to 1,000 keys in random orders, rows interleaved across the
puts, each with a partial selection of fields, and several gets gathered concurrently on one
event loop. Every row is compared bit for bit; a failure names the read, the field, and the
first row at fault with its key (and, through the ``uid`` column, whose row it got instead).
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Sequence

import torch
from tensordict import TensorDict

from nemo_dataplane.client import DataPlaneClient
from nemo_dataplane.codec import is_jagged
from nemo_dataplane.meta import KVBatchMeta
from nemo_dataplane.testing.fields import assert_same_field, jagged, random_field, rows_of

__all__ = ["ScaleConformance", "assert_rows"]

N_ROWS = 1500
PUTS = (700, 500, 300)  # three puts, so reads cross put (chunk, unit) boundaries
FIELDS = ("uid", "x", "bf", "ids", "hid")


def _columns() -> dict[str, torch.Tensor]:
    """The full 1,500-row batch: ``uid`` is the row's number, the rest random bits."""
    return {
        "uid": torch.arange(N_ROWS, dtype=torch.int64),
        "x": random_field((N_ROWS, 3), torch.float32, seed=11),
        "bf": random_field((N_ROWS, 2), torch.bfloat16, seed=12),
        "ids": jagged([(i * 7) % 13 for i in range(N_ROWS)], seed=13),  # lengths 0..12, empty rows included
        "hid": jagged([(i * 5) % 4 for i in range(N_ROWS)], 2, dtype=torch.float32, seed=14),  # [B, j, 2]
    }


def _row_bits(t: torch.Tensor) -> list[bytes]:
    """Each row's shape and bytes, dense or jagged (to find the rows that differ)."""
    out = []
    for r in t.unbind() if is_jagged(t) else list(t):
        r = r.contiguous()
        raw = r.view(torch.uint8) if r.dtype != torch.bool else r.to(torch.uint8)
        out.append(repr(tuple(r.shape)).encode() + raw.reshape(-1).numpy().tobytes())
    return out


def assert_rows(
    what: str,
    name: str,
    got: torch.Tensor,
    want: torch.Tensor,
    keys: Sequence[str],
    put: tuple[torch.Tensor, Sequence[str]] | None = None,
) -> None:
    """``got`` is ``want`` bit for bit; else fail naming the read, the field and the first row
    at fault with its key, and, given ``put`` (the field as put, and its keys), whose row it holds."""
    try:
        assert_same_field(f"{what}: {name}", got, want)
        return
    except AssertionError as e:
        first = str(e)
    if got.shape[0] != want.shape[0] or is_jagged(got) != is_jagged(want):
        raise AssertionError(first)
    g, w = _row_bits(got), _row_bits(want)
    bad = [i for i in range(len(w)) if g[i] != w[i]]
    if not bad:
        raise AssertionError(first)
    i = bad[0]
    holds = ""
    if put is not None:
        owners = [k for k, b in zip(put[1], _row_bits(put[0])) if b == g[i]]
        holds = f": it holds the row of key {owners[0]!r}" if owners else ": it holds no row that was put"
    raise AssertionError(
        f"{what}: field {name!r}: {len(bad)} of {len(keys)} rows differ; the first is row {i}, key {keys[i]!r}{holds}"
    )


class ScaleConformance:
    """Large reads; see the module docstring. Needs ``client`` and ``pid`` fixtures."""

    @staticmethod
    def _put_all(client: DataPlaneClient, pid: str) -> tuple[KVBatchMeta, dict[str, torch.Tensor], list[str]]:
        cols = _columns()
        keys = [f"r{i:04d}" for i in range(N_ROWS)]
        metas, start = [], 0
        for size in PUTS:
            idx = list(range(start, start + size))
            part = {name: rows_of(t, idx) for name, t in cols.items()}
            metas.append(client.kv_batch_put(keys[start : start + size], pid, part, tags=[{"n": i} for i in idx]))
            start += size
        return KVBatchMeta.concat(metas), cols, keys

    @staticmethod
    def _check(
        what: str,
        out: TensorDict,
        order: list[int],
        names: Sequence[str],
        cols: dict[str, torch.Tensor],
        keys: list[str],
    ) -> None:
        asked = [keys[i] for i in order]
        assert set(out.keys()) == set(names), f"{what}: fields {sorted(out.keys())}, asked for {sorted(names)}"
        assert out.batch_size == torch.Size([len(order)]), f"{what}: batch size {out.batch_size}, asked {len(order)}"
        if "uid" in names and out["uid"].shape == (len(order),):
            wrong = [(i, u) for i, u in enumerate(out["uid"].tolist()) if u != order[i]]
            examples = "; ".join(
                f"row {i}, key {asked[i]!r}, holds the row of key "
                + (repr(keys[u]) if 0 <= u < len(keys) else f"<none: uid {u}>")
                for i, u in wrong[:3]
            )
            assert not wrong, f"{what}: {len(wrong)} of {len(order)} rows came back for other keys: {examples}"
        for name in names:
            assert_rows(what, name, out[name], rows_of(cols[name], order), asked, (cols[name], keys))

    def test_large_gets_return_every_row_in_the_order_asked(self, client: DataPlaneClient, pid: str) -> None:
        meta, cols, keys = self._put_all(client, pid)
        assert meta.keys == tuple(keys)
        rng = random.Random(20240611)
        everything = list(range(N_ROWS))
        shuffled = rng.sample(everything, N_ROWS)
        a, b, c = PUTS[0], PUTS[0] + PUTS[1], N_ROWS
        interleaved = [i for trio in zip(range(0, a), range(a, b), range(b, c)) for i in trio]
        reads: list[tuple[str, list[int], list[str], bool]] = [
            (f"all {N_ROWS} keys in a random order, every field", shuffled, list(FIELDS), True),
            (f"all {N_ROWS} keys in the same random order again", shuffled, list(FIELDS), True),
            (f"all {N_ROWS} keys reversed, by plain keys", everything[::-1], ["uid", "ids", "x"], False),
            ("rows of the three puts interleaved", interleaved, ["hid", "uid"], True),
        ]
        for size, names in ((65, ["x"]), (200, ["ids", "bf"]), (513, ["hid"]), (1000, ["uid", "x", "hid"])):
            reads.append((f"{size} random keys in a random order", rng.sample(everything, size), names, bool(size % 2)))
        for what, order, names, by_meta in reads:
            if by_meta:
                out = client.kv_batch_get(meta.subset(order), names)
            else:
                out = client.kv_batch_get([keys[i] for i in order], names, partition_id=pid)
            self._check(what, out, order, names, cols, keys)

    def test_large_async_gets_gathered_concurrently(self, client: DataPlaneClient, pid: str) -> None:
        meta, cols, keys = self._put_all(client, pid)
        rng = random.Random(7)
        orders = [rng.sample(range(N_ROWS), size) for size in (1200, 400, 97, 800)]
        selections = [["uid", "ids"], ["x", "hid"], ["bf"], ["uid", "hid", "x"]]

        async def reads() -> list[TensorDict]:
            return list(
                await asyncio.gather(
                    *(client.async_kv_batch_get(meta.subset(o), s) for o, s in zip(orders, selections))
                )
            )

        for i, (out, order, names) in enumerate(zip(asyncio.run(reads()), orders, selections)):
            self._check(f"concurrent async get {i} of {len(order)} keys", out, order, names, cols, keys)

    def test_large_upserts_keep_rows_with_their_keys(self, client: DataPlaneClient, pid: str) -> None:
        _, cols, keys = self._put_all(client, pid)
        # Upsert a new column on a shuffled half of the keys, in that order, then read it back.
        rng = random.Random(3)
        half = rng.sample(range(N_ROWS), N_ROWS // 2)
        cols["tenfold"] = (torch.arange(N_ROWS, dtype=torch.int64) * 10 + 1).view(-1, 1).repeat(1, 2)
        client.kv_batch_put([keys[i] for i in half], pid, {"tenfold": cols["tenfold"][half]})
        order = rng.sample(half, len(half))
        out = client.kv_batch_get([keys[i] for i in order], ["tenfold", "uid", "ids"], partition_id=pid)
        self._check("a read of the upserted half", out, order, ["tenfold", "uid", "ids"], cols, keys)

    def test_a_large_claim_is_the_oldest_rows_and_reads_back_as_such(self, claims: tuple[DataPlaneClient, str]) -> None:
        client, pid = claims
        _, cols, keys = self._put_all(client, pid)
        claimed = client.kv_claim(pid, "scale", ["ids", "x"], 1000, 0)
        assert claimed.keys == tuple(keys[:1000]), "a 1000-row claim is not the oldest rows in insertion order"
        out = client.kv_batch_get(claimed.reorder(list(range(999, -1, -1))), ["ids", "uid"])
        self._check("a 1000-row claim read back reversed", out, list(range(999, -1, -1)), ["ids", "uid"], cols, keys)
