"""Cost of the checks on what a get returns: ``data_plane.verify_rows`` (each row's key identity,
on by default) and ``data_plane.verify_integrity`` (per-row digests of every field), each vs off.

Batch as in ``bench_data_plane.py``: ``input_ids`` int64 and ``logprobs`` float32, 1024 tokens
per sample (dense ``[B, 1024]`` or jagged, lengths 512..1536), one float32 reward; B = 1024
(12.6 MB). One timed transfer = ``kv_batch_put`` of the batch + ``kv_batch_get`` of every field
by its meta, through :class:`ObservedClient` around the bare backend (``off``), around
:class:`RowIdentityCheck` (``rows``) and around :class:`IntegrityCheck` (``digests``), on the
in-process ``memory`` backend (where the checks are the largest share), the real TransferQueue
backend and the ``ray`` backend (local Ray). The modes alternate repeat by repeat, so all see the
same machine load; the ratio of each mode's median to ``off``'s is its cost.

Usage: ``python benchmarks/bench_integrity.py [--repeats 7] [--rows 1024] [--backends memory transfer_queue ray]``.
Prints a table and writes ``benchmarks/results/bench_integrity.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("TQ_LOGGING_LEVEL", "ERROR")

import torch  # noqa: E402

from nemo_dataplane.codec import batch_nbytes  # noqa: E402
from nemo_dataplane.wrappers.identity import RowIdentityCheck  # noqa: E402
from nemo_dataplane.wrappers.integrity import IntegrityCheck  # noqa: E402
from nemo_dataplane.wrappers.observed import ObservedClient  # noqa: E402

TOKENS = 1024
FIELDS = ["input_ids", "logprobs", "reward"]


def make_batch(b: int, layout: str) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    reward = torch.randn(b, generator=g)
    if layout == "dense":
        return {
            "input_ids": torch.randint(0, 50_000, (b, TOKENS), generator=g),
            "logprobs": torch.randn(b, TOKENS, generator=g),
            "reward": reward,
        }
    lengths = torch.randint(TOKENS // 2, TOKENS + TOKENS // 2 + 1, (b,), generator=g)
    offsets = torch.zeros(b + 1, dtype=torch.int64)
    offsets[1:] = torch.cumsum(lengths, 0)
    n = int(offsets[-1])
    nt = torch.nested.nested_tensor_from_jagged
    return {
        "input_ids": nt(torch.randint(0, 50_000, (n,), generator=g), offsets=offsets),
        "logprobs": nt(torch.randn(n, generator=g), offsets=offsets.clone()),
        "reward": reward,
    }


def _backend(name: str) -> Any:
    if name == "memory":
        from nemo_dataplane.adapters.memory import InMemoryClient

        return InMemoryClient()
    import ray

    if not ray.is_initialized():
        ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    if name == "ray":
        from nemo_dataplane.adapters.ray_store.client import RayStoreClient

        return RayStoreClient(bootstrap=True)
    from nemo_dataplane.adapters.transfer_queue.client import TransferQueueClient
    from nemo_dataplane.config import TransferQueueConfig

    return TransferQueueClient(TransferQueueConfig(num_storage_units=1), bootstrap=True)


def _once(client: ObservedClient, batch: dict[str, torch.Tensor], rows: int, tag: str) -> float:
    keys = [f"{tag}-{i}" for i in range(rows)]
    t0 = time.perf_counter()
    meta = client.kv_batch_put(keys, "bench", batch)
    client.kv_batch_get(meta, FIELDS)
    dt = time.perf_counter() - t0
    client.kv_clear(None, "bench")
    return dt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--rows", type=int, default=1024)
    ap.add_argument("--backends", nargs="+", default=["memory", "transfer_queue", "ray"])
    args = ap.parse_args()
    results = []
    for backend in args.backends:
        raw = _backend(backend)
        clients = {
            "off": ObservedClient(raw),
            "rows": ObservedClient(RowIdentityCheck(raw)),
            "digests": ObservedClient(IntegrityCheck(raw)),
        }
        for layout in ("dense", "jagged"):
            batch = make_batch(args.rows, layout)
            times: dict[str, list[float]] = {mode: [] for mode in clients}
            for mode, c in clients.items():  # warm-up
                _once(c, batch, args.rows, f"w{mode}")
            for r in range(args.repeats):
                for mode, c in clients.items():
                    times[mode].append(_once(c, batch, args.rows, f"{mode}{r}"))
            med = {mode: statistics.median(t) for mode, t in times.items()}
            results.append(
                {
                    "backend": backend,
                    "layout": layout,
                    "rows": args.rows,
                    "mb": batch_nbytes(batch) / 1e6,
                    **{f"{mode}_ms": m * 1e3 for mode, m in med.items()},
                    "ratio_rows_off": med["rows"] / med["off"],
                    "ratio_digests_off": med["digests"] / med["off"],
                    "best_ratio_rows": min(times["rows"]) / min(times["off"]),
                    "best_ratio_digests": min(times["digests"]) / min(times["off"]),
                }
            )
        raw.close()
    print(f"put + get of {args.rows} rows, median of {args.repeats} (load avg {os.getloadavg()[0]:.1f})")
    cols = ("off ms", "rows ms", "rows/off", "dig. ms", "dig./off")
    print(f"{'backend':16} {'layout':7} {'MB':>6} " + " ".join(f"{c:>8}" for c in cols))
    for r in results:
        print(
            f"{r['backend']:16} {r['layout']:7} {r['mb']:6.1f} {r['off_ms']:8.1f} {r['rows_ms']:8.1f} "
            f"{r['ratio_rows_off']:8.3f} {r['digests_ms']:8.1f} {r['ratio_digests_off']:8.2f}"
        )
    out = Path(__file__).resolve().parent / "results" / "bench_integrity.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(
        json.dumps({"load_avg_1m": os.getloadavg()[0], "repeats": args.repeats, "results": results}, indent=2)
    )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
