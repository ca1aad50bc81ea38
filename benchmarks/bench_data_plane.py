"""Put+get throughput of one rollout batch: the data-plane backends vs a Ray object-store hand-off.

Batch (rollout-shaped): ``input_ids`` int64 and ``logprobs`` float32, 1024 tokens per sample on
average, either dense ``[B, 1024]`` or jagged (lengths 512..1536, same mean), plus one float32
reward per sample; B = 256, 1024, 4096 (3, 12.6, 50 MB).

What one timed transfer is (median of ``--repeats`` after one warm-up; MB/s = payload / total):

* ``memcpy``: one ``clone()`` of every field in this process (the ceiling: one copy).
* ``memory``: ``InMemoryClient`` put + get in this process.
* ``ray``: driver ``ray.put``s each reader's shard -> each reader actor's method receives its ref
  (Ray resolves it there) and touches every tensor; run twice, without and with
  ``RAY_ENABLE_ZERO_COPY_TORCH_TENSORS=1`` (``ray_zero_copy``; read at Ray start, so that
  variant runs in a subprocess with its own cluster). Zero-copy readers get views of shared
  memory; default readers get private copies.
* ``ray_store``: driver ``RayStoreClient.kv_batch_put`` (``data_plane.backend: ray``, default
  config: rows adopted by the store, private copies on read) -> each reader's attached client
  ``kv_batch_get`` of its shard. ``ray_store_zc_reads``: the same with
  ``ray_store.zero_copy_reads`` (reads share memory like ``ray_zero_copy``).
* ``tq_adapter``: driver ``TransferQueueClient.kv_batch_put`` -> readers' attached adapters.
* ``tq_raw``: TransferQueue's own ``kv_batch_put`` / ``kv_batch_get`` on the same store.
* with ``--compare-plain-wire``: ``tq_adapter_plain`` / ``tq_raw_plain``, the same on a store whose
  ZMQ sockets take any client (no CURVE, no ZAP check: the adapter's benchmark-only switch), in a
  subprocess with its own Ray after the rest; a table sets them beside the authenticated rows.

With R readers (``--readers``, default 1 2 4) every reader reads a disjoint 1/R of the rows at
the same time (DP ranks); the get time is until the last one finished. Every reader call returns
only a byte count, so no result travels back. Put and get are timed separately; the total is
their sum. Ratios are taken against both Ray baselines of the same batch and reader count,
measured in the same run; "best" uses the fastest repeat, which is less sensitive to other load
on a small shared machine (the 1-minute load average is printed and saved).

Also measured:

* tiny-batch latency: put + get of 8 rows by each method next to a plain Ray actor call (the
  floor of any hand-off to another process);
* claim latency (stores): a reader's ``kv_claim`` of one row waits; the driver puts the row
  0.2 s later; the time from the put's return (the row is produced) to the claim's return;
* start-up after Ray: a fresh interpreter that has torch and a running Ray imports the backend
  and creates its store (``bootstrap=True``), then does a first put + get; for both backends,
  median of ``--startup-runs``; TransferQueue both on a plain Ray (``transfer_queue``) and on
  one started as the trainer starts it, its idle workers importing the store actors' modules
  ahead (``tq_as_trainer``).

What bounds each method, with the measurements: ``docs/data-flow.md``.

Usage: ``python benchmarks/bench_data_plane.py [--repeats 5] [--sizes 256 1024 4096] [--readers 1 2 4]``;
``--only-startup [--startup-runs 3]`` measures only the start-up; ``--device cuda [--mb 64 256 1024]``
GPU-resident fields on 2 GPUs (``bench_gpu_resident.py``).
Prints the tables and writes ``benchmarks/results/bench_data_plane.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
os.environ.setdefault("TQ_LOGGING_LEVEL", "ERROR")

import ray  # noqa: E402
import torch  # noqa: E402
from data_plane_children import ray_zero_copy_subprocess, tq_plain_wire_subprocess  # noqa: E402
from data_plane_report import report, report_wire  # noqa: E402
from data_plane_startup import measure_startup, report_startup  # noqa: E402
from tensordict import TensorDict  # noqa: E402

from nemo_dataplane.codec import batch_nbytes, is_jagged  # noqa: E402
from nemo_dataplane.rows import select_rows  # noqa: E402

FIELDS = ["input_ids", "logprobs", "reward"]
RAY_TIMEOUT_S = 300  # bound on every wait for a reader actor
TOKENS = 1024
TINY_ROWS = 8
STORE_ACTOR = "bench.RayStoreIndex"


def make_batch(b: int, layout: str, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
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


def to_wire(batch: Any) -> dict[str, Any]:
    """What a Ray hand-off ships: jagged as (values, offsets)."""
    return {k: (v.values(), v.offsets()) if is_jagged(v) else v for k, v in batch.items()}


def touch(obj: Any) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size() if not is_jagged(obj) else touch(obj.values())
    if isinstance(obj, (tuple, list)):
        return sum(touch(o) for o in obj)
    if isinstance(obj, dict) or hasattr(obj, "items"):
        return sum(touch(v) for _, v in obj.items())
    return 0


class Reader:
    """The consuming process: a DP rank that receives or fetches its shard."""

    def __init__(self, backends: list[str]) -> None:
        torch.set_num_threads(1)
        self.clients: dict[str, Any] = {}
        if "tq" in backends:
            from nemo_dataplane.adapters.transfer_queue.client import TransferQueueClient
            from nemo_dataplane.config import TransferQueueConfig

            self.clients["tq_adapter"] = TransferQueueClient(TransferQueueConfig(op_timeout_s=120), bootstrap=False)
            import transfer_queue as tq

            from nemo_dataplane.adapters.transfer_queue.client import admit_transfer_queue_clients

            admit_transfer_queue_clients()  # the store's wire keys on TransferQueue's own sockets
            tq.init()  # attaches to the same controller; never tq.close() here (it would kill it)
            self.tq = tq
        if "ray_store" in backends:
            from nemo_dataplane.adapters.ray_store.client import RayStoreClient
            from nemo_dataplane.config import RayStoreConfig

            for method, zc in (("ray_store", False), ("ray_store_zc_reads", True)):
                self.clients[method] = RayStoreClient(
                    RayStoreConfig(op_timeout_s=120, zero_copy_reads=zc), bootstrap=False, actor_name=STORE_ACTOR
                )

    def ping(self) -> bool:
        return True

    def ray_handoff(self, batch: dict[str, Any]) -> int:
        return touch(batch)

    def store_get(self, method: str, meta: Any, fields: list[str]) -> int:
        return touch(self.clients[method].kv_batch_get(meta, fields))

    def raw_get(self, keys: list[str], pid: str, fields: list[str]) -> int:
        return touch(self.tq.kv_batch_get(keys=keys, partition_id=pid, select_fields=fields))

    def claim(self, method: str, pid: str, fields: list[str], timeout_s: float) -> tuple[float, int]:
        """One claim of one row, waiting up to ``timeout_s``: when it returned (epoch) and how many rows it got."""
        meta = self.clients[method].kv_claim(pid, "bench", fields, 1, timeout_s)
        return time.time(), len(meta.keys)

    def close(self) -> None:
        for c in self.clients.values():
            c.close()


def timed_pair(
    put: Callable[[], Any], get: Callable[[Any], Any], cleanup: Callable[[Any], Any], repeats: int
) -> tuple[float, float, float]:
    """Median put and get seconds and the fastest put+get; ``put`` returns what ``get`` needs."""
    puts, gets = [], []
    for i in range(repeats + 1):
        t0 = time.perf_counter()
        handle = put()
        t1 = time.perf_counter()
        get(handle)
        t2 = time.perf_counter()
        cleanup(handle)
        if i:  # first round is warm-up
            puts.append(t1 - t0)
            gets.append(t2 - t1)
    return statistics.median(puts), statistics.median(gets), min(p + g for p, g in zip(puts, gets))


def latency(fn: Callable[[], Any], repeats: int) -> tuple[float, float]:
    fn()
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts), min(ts)


def _readers(n: int, backends: list[str]) -> list[Any]:
    actors = [ray.remote(num_cpus=0)(Reader).remote(backends) for _ in range(n)]
    ray.get([a.ping.remote() for a in actors], timeout=RAY_TIMEOUT_S)
    return actors


def _close(actors: list[Any]) -> None:
    try:
        ray.get([a.close.remote() for a in actors], timeout=60)
    finally:
        for a in actors:
            ray.kill(a)


def _gather(refs: list[Any]) -> list[Any]:
    return ray.get(refs, timeout=RAY_TIMEOUT_S)


def _row(
    method: str, b: int, layout: str, readers: int, nbytes: int, put: float, get: float, best: float
) -> dict[str, Any]:
    return {
        "method": method,
        "batch": b,
        "layout": layout,
        "readers": readers,
        "bytes": nbytes,
        "put_s": put,
        "get_s": get,
        "best_s": best,
    }


def bench_ray(sizes: list[int], readers: list[int], repeats: int) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The Ray hand-off: one ``ray.put`` per reader's shard, each reader resolves its ref."""
    actors = _readers(max(readers), [])
    rows = []
    try:
        for b in sizes:
            for layout in ("dense", "jagged"):
                batch = make_batch(b, layout)
                nbytes = batch_nbytes(batch)
                td = TensorDict(batch, batch_size=[b])
                for r in readers:
                    shards = [to_wire(select_rows(td, range(i * b // r, (i + 1) * b // r))) for i in range(r)]
                    put, get, best = timed_pair(
                        lambda: [ray.put(s) for s in shards],
                        lambda refs: _gather([a.ray_handoff.remote(ref) for a, ref in zip(actors, refs)]),
                        lambda refs: None,
                        repeats,
                    )
                    rows.append(_row("ray", b, layout, r, nbytes, put, get, best))
        tiny = to_wire(make_batch(TINY_ROWS, "dense"))
        reader = actors[0]
        lat = {
            "ray_actor_call": latency(lambda: ray.get(reader.ping.remote(), timeout=RAY_TIMEOUT_S), repeats * 4),
            "ray": latency(
                lambda: ray.get(reader.ray_handoff.remote(ray.put(tiny)), timeout=RAY_TIMEOUT_S), repeats * 4
            ),
        }
    finally:
        _close(actors)
    return rows, lat


def bench_local(sizes: list[int], repeats: int) -> list[dict[str, Any]]:
    from nemo_dataplane.adapters.memory import InMemoryClient

    rows = []
    mem = InMemoryClient()
    for b in sizes:
        for layout in ("dense", "jagged"):
            batch = make_batch(b, layout)
            nbytes = batch_nbytes(batch)
            flat = [v.values() if is_jagged(v) else v for v in batch.values()]
            copy, _ = latency(lambda: [t.clone() for t in flat], repeats)
            rows.append(_row("memcpy", b, layout, 1, nbytes, copy, 0.0, copy))
            keys = [f"k{i}" for i in range(b)]
            put, get, best = timed_pair(
                lambda: mem.kv_batch_put(keys, "p", batch),
                lambda meta: mem.kv_batch_get(meta, FIELDS),
                lambda meta: mem.kv_clear(None, "p"),
                repeats,
            )
            rows.append(_row("memory", b, layout, 1, nbytes, put, get, best))
    return rows


def _bench_store(
    method: str, client: Any, actors: list[Any], sizes: list[int], readers: list[int], repeats: int
) -> list[dict[str, Any]]:
    rows = []
    for b in sizes:
        keys = [f"k{i}" for i in range(b)]
        for layout in ("dense", "jagged"):
            batch = make_batch(b, layout)
            nbytes = batch_nbytes(batch)
            for r in readers:
                pid = f"bench-{uuid.uuid4().hex[:6]}"
                put, get, best = timed_pair(
                    lambda: client.kv_batch_put(keys, pid, batch),
                    lambda meta: _gather(
                        [a.store_get.remote(method, m, FIELDS) for a, m in zip(actors, meta.chunk(r))]
                    ),
                    lambda meta: client.kv_clear(None, pid),
                    repeats,
                )
                rows.append(_row(method, b, layout, r, nbytes, put, get, best))
    return rows


def _tiny_store(method: str, client: Any, reader: Any, repeats: int) -> tuple[float, float]:
    tiny = make_batch(TINY_ROWS, "dense")
    keys = [f"t{i}" for i in range(TINY_ROWS)]
    pid = f"tiny-{uuid.uuid4().hex[:6]}"

    def once() -> None:
        meta = client.kv_batch_put(keys, pid, tiny)
        ray.get(reader.store_get.remote(method, meta, FIELDS), timeout=RAY_TIMEOUT_S)

    try:
        return latency(once, repeats * 4)
    finally:
        client.kv_clear(None, pid)


CLAIM_WAIT_S = 0.2  # how long a claim waits before the row it gets is put (past any short poll)


def _claim_latency(method: str, client: Any, reader: Any, repeats: int) -> dict[str, float]:
    """A waiting claim's latency: the reader starts a claim of one row, the driver puts that row
    ``CLAIM_WAIT_S`` later; median and best seconds from the put's return (the row produced and
    visible) and from its start to the claim's return."""
    row = {k: v[:1] for k, v in make_batch(1, "dense").items()}
    pid = f"claim-{uuid.uuid4().hex[:6]}"
    after_put, after_start = [], []
    try:
        for i in range(repeats * 4 + 1):
            ref = reader.claim.remote(method, pid, FIELDS, 30.0)
            time.sleep(CLAIM_WAIT_S)  # the claim is waiting by now (a benchmark's pacing, not a condition)
            t0 = time.time()
            client.kv_batch_put([f"c{i}"], pid, row)
            t1 = time.time()
            returned, n = ray.get(ref, timeout=RAY_TIMEOUT_S)
            if n != 1:
                raise RuntimeError(f"{method}: the claim returned {n} rows for one put")
            if i:  # the first is warm-up
                after_put.append(returned - t1)
                after_start.append(returned - t0)
    finally:
        client.kv_clear(None, pid)
    return {
        "from_put_return_median_s": statistics.median(after_put),
        "from_put_return_best_s": min(after_put),
        "from_put_start_median_s": statistics.median(after_start),
    }


def bench_ray_store(sizes: list[int], readers: list[int], repeats: int) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    from nemo_dataplane.adapters.ray_store.client import RayStoreClient
    from nemo_dataplane.config import RayStoreConfig

    client = RayStoreClient(RayStoreConfig(op_timeout_s=120), bootstrap=True, actor_name=STORE_ACTOR)
    actors: list[Any] = []
    try:
        actors = _readers(max(readers), ["ray_store"])
        rows = _bench_store("ray_store", client, actors, sizes, readers, repeats)
        rows += _bench_store("ray_store_zc_reads", client, actors, sizes, [1], repeats)
        lat = {
            "ray_store": _tiny_store("ray_store", client, actors[0], repeats),
            "claim_ray_store": _claim_latency("ray_store", client, actors[0], repeats),
        }
        client.flush()
        stats = client.stats()
    finally:
        try:
            if actors:
                _close(actors)
        finally:
            client.close()
    return rows, {**lat, "ray_store_stats_at_end": stats}


def bench_tq(
    sizes: list[int], readers: list[int], repeats: int, unit_in_controller: bool | None = None, plain: bool = False
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """``plain``: the store's sockets take any client (the adapter's benchmark-only switch)."""
    from nemo_dataplane.adapters.transfer_queue.client import TransferQueueClient, admit_transfer_queue_clients
    from nemo_dataplane.config import TransferQueueConfig

    cfg = TransferQueueConfig(op_timeout_s=120, unit_in_controller=unit_in_controller)
    client = TransferQueueClient(cfg, bootstrap=True, _plain_wire=plain)
    actors: list[Any] = []
    try:
        import transfer_queue as tq

        admit_transfer_queue_clients()  # the store's wire keys on TransferQueue's own sockets here
        tq.init()  # the driver's raw TQ client attaches to the adapter's store
        actors = _readers(max(readers), ["tq"])
        rows = _bench_store("tq_adapter", client, actors, sizes, readers, repeats)
        for b in sizes:
            keys = [f"k{i}" for i in range(b)]
            for layout in ("dense", "jagged"):
                batch = make_batch(b, layout)
                td = TensorDict(batch, batch_size=[b])
                pid = f"bench-{uuid.uuid4().hex[:6]}"
                put, get, best = timed_pair(
                    lambda: tq.kv_batch_put(keys=keys, partition_id=pid, fields=td),
                    lambda _: ray.get(actors[0].raw_get.remote(keys, pid, FIELDS), timeout=RAY_TIMEOUT_S),
                    lambda _: client.kv_clear(None, pid),
                    repeats,
                )
                rows.append(_row("tq_raw", b, layout, 1, batch_nbytes(batch), put, get, best))
        lat = {
            "tq_adapter": _tiny_store("tq_adapter", client, actors[0], repeats),
            "claim_tq_adapter": _claim_latency("tq_adapter", client, actors[0], repeats),
        }
    finally:
        try:
            if actors:
                _close(actors)
        finally:
            client.close()
    return rows, lat


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--sizes", type=int, nargs="+", default=[256, 1024, 4096])
    ap.add_argument("--readers", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--skip", nargs="*", default=[], choices=["tq", "ray_store", "startup"])
    ap.add_argument("--startup-runs", type=int, default=3, help="fresh interpreters per backend for start-up")
    ap.add_argument("--only-startup", action="store_true", help="measure only the store start-up (no JSON written)")
    ap.add_argument(
        "--unit-in-controller",
        choices=["auto", "on", "off"],
        default="auto",
        help="TransferQueue: storage unit 0 in the controller's process (auto: with one unit)",
    )
    ap.add_argument(
        "--device",
        choices=["cpu", "cuda"],
        default="cpu",
        help="cuda: GPU-resident fields against the host path and a peer copy (bench_gpu_resident.py)",
    )
    ap.add_argument(
        "--compare-plain-wire",
        action="store_true",
        help="TransferQueue: also on a store whose ZMQ sockets take any client (what the CURVE check costs)",
    )
    ap.add_argument("--ray-only", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--tq-plain-only", action="store_true", help=argparse.SUPPRESS)
    args, rest = ap.parse_known_args()
    if args.device == "cuda":
        from bench_gpu_resident import main as gpu_main  # this directory is the script's sys.path[0]

        gpu_main(rest)
        return
    if rest:
        ap.error(f"unrecognized arguments: {' '.join(rest)}")
    if args.only_startup:
        report_startup(measure_startup(args.startup_runs))
        print(f"load average (1 min) at end: {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
        return
    torch.set_num_threads(1)
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    lat: dict[str, Any] = {}
    hosted = {"auto": None, "on": True, "off": False}[args.unit_in_controller]
    try:
        if args.ray_only:  # the zero-copy child: print its rows as one JSON line
            print(json.dumps(bench_ray(args.sizes, args.readers, args.repeats)))
            return
        if args.tq_plain_only:  # the plain-wire child: likewise
            print(json.dumps(bench_tq(args.sizes, args.readers, args.repeats, hosted, plain=True)))
            return
        t_start = time.perf_counter()
        load_start = os.getloadavg()
        rows = bench_local(args.sizes, args.repeats)
        r, lt = bench_ray(args.sizes, args.readers, args.repeats)
        rows += r
        lat.update(lt)
        if "ray_store" not in args.skip:
            r, lt = bench_ray_store(args.sizes, args.readers, args.repeats)
            rows += r
            lat.update(lt)
        if "tq" not in args.skip:
            r, lt = bench_tq(args.sizes, args.readers, args.repeats, hosted)
            rows += r
            lat.update(lt)
    finally:
        ray.shutdown()
    r, lt = ray_zero_copy_subprocess(__file__, args.sizes, args.readers, args.repeats)
    rows += r
    lat.update(lt)
    if args.compare_plain_wire and "tq" not in args.skip:
        r, lt = tq_plain_wire_subprocess(__file__, args.sizes, args.readers, args.repeats, hosted)
        rows += r
        lat.update(lt)
    start = {}
    if "startup" not in args.skip:
        start = measure_startup(args.startup_runs)
    targets = report(rows, lat, start, args.sizes, args.readers)
    wire = report_wire(rows, lat) if args.compare_plain_wire else {}
    out = REPO / "benchmarks" / "results" / "bench_data_plane.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "rows": rows,
                "targets": targets,
                "tiny_latency_s": lat,
                "wire_auth_vs_plain": wire,
                "startup_s": start,
                "repeats": args.repeats,
                "loadavg_1min_start_end": [load_start[0], os.getloadavg()[0]],
                "wall_s": time.perf_counter() - t_start,
                "host": {
                    "platform": platform.platform(),
                    "cpus": os.cpu_count(),
                    "torch": torch.__version__,
                    "ray": ray.__version__,
                },
            },
            indent=2,
        )
    )
    print(
        f"load average (1 min) at start / end: {load_start[0]:.1f} / {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs"
    )
    print(f"wrote {out}  ({time.perf_counter() - t_start:.0f} s)")


if __name__ == "__main__":
    main()
