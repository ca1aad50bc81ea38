"""GPU-resident rollout fields against the host path and a plain peer copy (one node, 2 GPUs).

A putter actor on GPU 0 puts a dense float32 batch (256 rows) that lives on its GPU; a reader
actor on GPU 1 gets it into its own GPU memory. On a host of one GPU the reader is another
process on GPU 0 and the "peer copy" a copy within that GPU: the store's per-op times still
compare, the ratios to the copy do not. Three ways, each timed end to end (put + get,
the reader's copy synchronised) and as GB/s of the payload:

* ``peer_copy``: the ideal, one process copying GPU 0 -> GPU 1 (``tensor.to("cuda:1")``);
* ``gpu_resident``: ``data_plane.gpu_fields`` (the store holds CUDA IPC handles; the reader's
  get is one peer copy from the putter's memory);
* ``host``: the same store without it: the putter copies to the host and puts, the reader gets
  and copies to its GPU.

Usage (2 GPUs; 1 for the per-op times): ``python benchmarks/bench_data_plane.py --device cuda [--mb 64 256 1024]
[--storage-units N]``
(or this file directly); ``--storage-units 1`` puts the store's one unit in its controller, so each
op is one call. Writes ``benchmarks/results/bench_gpu_resident[_unitsN].json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

import ray
import torch

REPO = Path(__file__).resolve().parents[1]
ROWS = 256


@ray.remote(num_cpus=0.5)
class _Putter:
    def __init__(self, gpu_fields: list[str]) -> None:
        from nemo_dataplane.factory import build_data_plane_client

        torch.cuda.set_device(0)
        self.c = build_data_plane_client({"backend": "transfer_queue", "gpu_fields": gpu_fields}, bootstrap=False)

    def put(self, mb: int, tag: str, host: bool) -> tuple[Any, float]:
        x = torch.randn(ROWS, mb * 2**20 // 4 // ROWS, device="cuda:0")
        torch.cuda.synchronize()
        t = time.perf_counter()
        field = x.cpu() if host else x
        meta = self.c.kv_batch_put([f"{tag}_{i}" for i in range(ROWS)], "bench", {"lp": field})
        return meta, time.perf_counter() - t

    def clear(self, meta: Any) -> None:
        self.c.kv_clear(list(meta.keys), "bench")


@ray.remote(num_cpus=0.5)
class _Reader:
    def __init__(self, gpu_fields: list[str]) -> None:
        from nemo_dataplane.factory import build_data_plane_client

        torch.cuda.set_device(_reader_gpu())
        self.c = build_data_plane_client({"backend": "transfer_queue", "gpu_fields": gpu_fields}, bootstrap=False)

    def get(self, meta: Any) -> tuple[float, str]:
        t = time.perf_counter()
        x = self.c.kv_batch_get(meta, ["lp"], "bench")["lp"].to(f"cuda:{_reader_gpu()}")
        torch.cuda.synchronize(_reader_gpu())
        return time.perf_counter() - t, str(x.device)


def _reader_gpu() -> int:
    return min(1, torch.cuda.device_count() - 1)


def peer_copy_s(mb: int, repeats: int) -> float:
    x = torch.randn(ROWS, mb * 2**20 // 4 // ROWS, device="cuda:0")
    y = x.to(f"cuda:{_reader_gpu()}")
    out = []
    for _ in range(repeats):
        torch.cuda.synchronize(0)
        t = time.perf_counter()
        y.copy_(x)
        torch.cuda.synchronize(_reader_gpu())
        out.append(time.perf_counter() - t)
    return statistics.median(out)


def run(mbs: list[int], repeats: int, storage_units: int | None = None) -> dict[str, Any]:
    from nemo_dataplane.factory import build_data_plane_client

    os.environ.pop("CUDA_VISIBLE_DEVICES", None)
    ray.init(address="local", num_cpus=8, num_gpus=0, include_dashboard=False, log_to_driver=False)
    # One unit: the controller holds it and each op is one call to it.
    store = {"backend": "transfer_queue", "transfer_queue": {"num_storage_units": storage_units}}
    owner = build_data_plane_client(store, bootstrap=True)
    ways = {"gpu_resident": ["lp"], "host": []}
    actors = {w: (_Putter.remote(f), _Reader.remote(f)) for w, f in ways.items()}
    rows = []
    try:
        for mb in mbs:
            row: dict[str, Any] = {"mb": mb, "peer_copy_s": peer_copy_s(mb, repeats)}
            for way, (p, r) in actors.items():
                put_s, get_s = [], []
                for k in range(repeats + 1):  # the first is a warm-up (handles opened, buffers)
                    meta, tp = ray.get(p.put.remote(mb, f"{way}{mb}_{k}", way == "host"))
                    tg, dev = ray.get(r.get.remote(meta))
                    assert dev == f"cuda:{_reader_gpu()}", dev
                    ray.get(p.clear.remote(meta))
                    if k:
                        put_s.append(tp)
                        get_s.append(tg)
                row[f"{way}_put_s"], row[f"{way}_get_s"] = statistics.median(put_s), statistics.median(get_s)
                row[f"{way}_s"] = row[f"{way}_put_s"] + row[f"{way}_get_s"]
            gb = mb / 1024
            for way in ("peer_copy", *ways):
                row[f"{way}_gbps"] = gb / row[f"{way}_s"]
            row["gpu_resident_x_peer"] = row["peer_copy_s"] / row["gpu_resident_s"]
            row["gpu_resident_x_host"] = row["host_s"] / row["gpu_resident_s"]
            rows.append(row)
            print(
                f"{mb:>6} MB: peer copy {row['peer_copy_gbps']:.1f} GB/s | gpu_resident {row['gpu_resident_gbps']:.1f}"
                f" GB/s (put {row['gpu_resident_put_s'] * 1e3:.1f} + get {row['gpu_resident_get_s'] * 1e3:.1f} ms)"
                f" = {row['gpu_resident_x_peer']:.2f}x peer | host {row['host_gbps']:.2f} GB/s"
                f" (put {row['host_put_s'] * 1e3:.0f} + get {row['host_get_s'] * 1e3:.0f} ms);"
                f" gpu_resident {row['gpu_resident_x_host']:.1f}x host",
                flush=True,
            )
    finally:
        owner.close()
        ray.shutdown()
    return {
        "rows": rows,
        "device": torch.cuda.get_device_name(0),
        "gpus": torch.cuda.device_count(),
        "repeats": repeats,
        "storage_units": storage_units or "auto",
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mb", type=int, nargs="+", default=[64, 256, 1024])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--storage-units", type=int, default=None, help="the store's units (default: sized to the CPUs)")
    ap.add_argument("--out", type=Path, default=None, help="the JSON (default: benchmarks/results/...)")
    args, _ = ap.parse_known_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench_gpu_resident needs a CUDA GPU (2 on one host for the peer-copy ratios)")
    out = run(args.mb, args.repeats, args.storage_units)
    units = f"_units{args.storage_units}" if args.storage_units else ""
    path = args.out or REPO / "benchmarks" / "results" / f"bench_gpu_resident{units}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=2))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
