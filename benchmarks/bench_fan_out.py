"""Fan-out + fetch of one step: data plane vs the legacy transport, DP = 1, 2, 4, 8 rank actors.

What one timed step is, on each path (the rollout batch already exists before the clock starts):

* data plane: the collector has put the rollouts into TransferQueue and handed the driver their
  ``KVBatchMeta`` (keys + ``seq_len`` tags). Driver: ``driver_balanced_preshards`` over the tags,
  ``fan_out_per_rank_metas`` (meta source: re-sliced, no I/O), one ``.remote(meta)`` per rank;
  each rank actor fetches its share from the store (``WorkerFetcher``, independent policy), cuts
  the driver's micro-batches and acks with a few ints.
* legacy: the driver holds the rollout ``TensorDict``. Driver: the same preshard over the
  ``seq_len`` field, ``legacy_shard`` (driver slices every rank's rows), ``ship_shards``
  (``ray.put`` per rank), one ``.remote(ref)`` per rank; each rank ``ray.get``s its shard, cuts
  micro-batches, acks.

Driver bytes = serialized size (``ray.cloudpickle``) of everything the driver receives (the
rollout meta / rollout batch from the collector, the acks) and sends (the metas / the shards).
Both paths run in the same process on the same Ray cluster, interleaved, median of ``--repeats``.

Usage: ``python benchmarks/bench_fan_out.py [--samples 256] [--repeats 15] [--dp 1 2 4 8] [--storage-units 1]``.
Prints a table and writes ``benchmarks/results/bench_fan_out.json``.
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
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import ray  # noqa: E402
import torch  # noqa: E402
from tensordict import TensorDict  # noqa: E402

from algorithms.legacy_transport import legacy_shard, ship_shards  # noqa: E402
from nemo_dataplane.codec import batch_nbytes  # noqa: E402
from nemo_dataplane.config import PackingConfig, TransferQueueConfig  # noqa: E402
from nemo_dataplane.driver import driver_balanced_preshards, fan_out_per_rank_metas  # noqa: E402

FIELDS = ["input_ids", "logprobs"]


class RankActor:
    """One simulated DP rank: attaches to the store, fetches or receives its shard, acks."""

    def __init__(self) -> None:
        from nemo_dataplane.adapters.transfer_queue.client import TransferQueueClient
        from nemo_dataplane.worker.fetch import WorkerFetcher

        torch.set_num_threads(1)
        self.client = TransferQueueClient(TransferQueueConfig(op_timeout_s=120), bootstrap=False)
        self.fetcher = WorkerFetcher(self.client, fetch_policy="independent", timeout_s=120)

    def ready(self) -> bool:
        return True

    def dp_step(self, meta: Any, fields: list[str]) -> dict[str, Any]:
        t0 = time.perf_counter()
        got = self.fetcher.fetch(meta, fields)
        fetch_ms = (time.perf_counter() - t0) * 1e3
        return {
            "rows": len(meta),
            "microbatches": len(got.microbatches),
            "bytes": batch_nbytes(got.data),
            "fetch_ms": fetch_ms,
        }

    def legacy_step(self, shard: Any) -> dict[str, int]:
        mbs = shard.microbatches()  # Ray resolved the ObjectRef argument: ray.get happened here
        return {"rows": shard.data.batch_size[0], "microbatches": len(mbs), "bytes": batch_nbytes(shard.data)}

    def close(self) -> None:
        self.client.close()


def make_batch(n: int, lo: int, hi: int, seed: int) -> TensorDict:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(lo, hi + 1, (n,), generator=g)
    offsets = torch.zeros(n + 1, dtype=torch.int64)
    offsets[1:] = torch.cumsum(lens, 0)
    total = int(offsets[-1])
    return TensorDict(
        {
            "input_ids": torch.nested.nested_tensor_from_jagged(
                torch.randint(0, 150_000, (total,), generator=g), offsets=offsets
            ),
            "logprobs": torch.nested.nested_tensor_from_jagged(
                torch.randn(total, generator=g), offsets=offsets.clone()
            ),
            "seq_len": lens,
        },
        batch_size=[n],
    )


def nbytes(obj: Any) -> int:
    return len(ray.cloudpickle.dumps(obj))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=256)
    ap.add_argument("--min-len", type=int, default=256)
    ap.add_argument("--max-len", type=int, default=2048)
    ap.add_argument("--dp", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--max-tokens-per-microbatch", type=int, default=8192)
    ap.add_argument("--storage-units", type=int, default=1, help="TransferQueue storage units (0.5 CPU each)")
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "bench_fan_out.json"))
    args = ap.parse_args()

    os.environ.setdefault("TQ_LOGGING_LEVEL", "ERROR")
    from nemo_dataplane.adapters.transfer_queue.client import TransferQueueClient

    load_start = os.getloadavg()[0]
    t_boot = time.perf_counter()
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    client = None
    actors: list[Any] = []
    try:
        client = TransferQueueClient(
            TransferQueueConfig(num_storage_units=args.storage_units, op_timeout_s=120), bootstrap=True
        )
        env = {"env_vars": {"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "TQ_LOGGING_LEVEL": "ERROR"}}
        actor_cls = ray.remote(num_cpus=0, runtime_env=env)(RankActor)
        actors = [actor_cls.remote() for _ in range(max(args.dp))]
        ray.get([a.ready.remote() for a in actors], timeout=300)
        boot_s = time.perf_counter() - t_boot

        cfg = PackingConfig(mode="sequence", max_tokens_per_microbatch=args.max_tokens_per_microbatch)
        batch = make_batch(args.samples, args.min_len, args.max_len, seed=0)
        payload = batch_nbytes(batch.select(*FIELDS))
        pid = f"bench-{uuid.uuid4().hex[:6]}"
        # The collector's put (not the driver's, not timed): rollouts land in the store with tags.
        rollout_meta = client.kv_batch_put(
            [f"rollout/{i}" for i in range(args.samples)],
            pid,
            batch.select(*FIELDS),
            tags=[{"seq_len": int(s)} for s in batch["seq_len"]],
        )
        rollout_batch = batch.select(*FIELDS, "seq_len")

        rows: list[dict[str, Any]] = []
        for dp in args.dp:
            ranks = actors[:dp]
            times: dict[str, list[float]] = {
                "data_plane": [],
                "legacy": [],
                "dp_driver": [],
                "dp_fetch": [],
                "legacy_driver": [],
            }
            drv: dict[str, int] = {}
            for rep in range(args.repeats + 1):  # first round is warm-up

                def run_data_plane() -> tuple[float, float, list[dict[str, Any]]]:
                    t0 = time.perf_counter()
                    pre = driver_balanced_preshards(rollout_meta, dp, cfg)
                    metas = fan_out_per_rank_metas(None, pre, rollout_meta, partition_id=pid, key_prefix="unused")
                    t_driver = time.perf_counter() - t0
                    acks = ray.get([a.dp_step.remote(m, FIELDS) for a, m in zip(ranks, metas)], timeout=300)
                    t_all = time.perf_counter() - t0
                    assert sum(a["rows"] for a in acks) == args.samples
                    assert len({a["microbatches"] for a in acks}) == 1
                    drv["data_plane"] = (
                        nbytes(rollout_meta) + sum(nbytes(m) for m in metas) + sum(nbytes(a) for a in acks)
                    )
                    return t_all, t_driver, acks

                def run_legacy() -> tuple[float, float, list[dict[str, Any]]]:
                    t0 = time.perf_counter()
                    pre = driver_balanced_preshards(rollout_batch, dp, cfg)
                    shards = legacy_shard(rollout_batch, pre)
                    refs = ship_shards(shards)
                    t_driver = time.perf_counter() - t0
                    acks = ray.get([a.legacy_step.remote(ref) for a, ref in zip(ranks, refs)], timeout=300)
                    t_all = time.perf_counter() - t0
                    drv["legacy"] = (
                        nbytes(rollout_batch) + sum(nbytes(s) for s in shards) + sum(nbytes(a) for a in acks)
                    )
                    return t_all, t_driver, acks

                # Alternate which path goes first so neither always runs on a warmer machine.
                if rep % 2 == 0:
                    t_dp, t_dp_driver, acks = run_data_plane()
                    t_legacy, t_legacy_driver, acks_l = run_legacy()
                else:
                    t_legacy, t_legacy_driver, acks_l = run_legacy()
                    t_dp, t_dp_driver, acks = run_data_plane()
                # Same rows and micro-batches on both paths (legacy shards also carry seq_len).
                assert [a["bytes"] for a in acks_l] == [a["bytes"] + 8 * a["rows"] for a in acks]
                assert [a["microbatches"] for a in acks_l] == [a["microbatches"] for a in acks]
                if rep:
                    times["data_plane"].append(t_dp)
                    times["legacy"].append(t_legacy)
                    times["dp_driver"].append(t_dp_driver)
                    times["legacy_driver"].append(t_legacy_driver)
                    times["dp_fetch"].append(max(a["fetch_ms"] for a in acks) / 1e3)
            med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
            rows.append(
                {
                    "dp": dp,
                    "payload_bytes": payload,
                    "microbatches_per_rank": acks[0]["microbatches"],
                    "data_plane_ms": med["data_plane"],
                    "legacy_ms": med["legacy"],
                    "ratio_dp_over_legacy": med["data_plane"] / med["legacy"],
                    # Median of per-repeat ratios: each pair ran back to back, so load drift on a
                    # shared machine cancels better than in the ratio of medians.
                    "paired_ratio_dp_over_legacy": statistics.median(
                        d / lg for d, lg in zip(times["data_plane"], times["legacy"])
                    ),
                    "data_plane_driver_plan_fan_out_ms": med["dp_driver"],
                    "data_plane_slowest_rank_fetch_ms": med["dp_fetch"],
                    "legacy_driver_shard_put_ms": med["legacy_driver"],
                    "data_plane_driver_bytes": drv["data_plane"],
                    "data_plane_driver_pct_payload": 100.0 * drv["data_plane"] / payload,
                    "legacy_driver_bytes": drv["legacy"],
                    "legacy_driver_pct_payload": 100.0 * drv["legacy"] / payload,
                    "data_plane_ms_all": [t * 1e3 for t in times["data_plane"]],
                    "legacy_ms_all": [t * 1e3 for t in times["legacy"]],
                }
            )
        client.kv_clear(None, pid)
    finally:
        for a in actors:
            try:
                ray.get(a.close.remote(), timeout=30)
            except Exception:  # noqa: BLE001 - best-effort teardown
                pass
            ray.kill(a)
        if client is not None:
            client.close()
        ray.shutdown()

    header = (
        f"bench_fan_out: {args.samples} samples, seq_len {args.min_len}..{args.max_len}, fields {FIELDS} "
        f"(payload {payload / 2**20:.2f} MiB), packing=sequence/{args.max_tokens_per_microbatch}, "
        f"{args.storage_units} TQ storage unit(s), "
        f"median of {args.repeats}, {os.cpu_count()} CPUs, load avg {load_start:.1f}->{os.getloadavg()[0]:.1f}, "
        f"boot {boot_s:.0f}s"
    )
    cols = [
        "DP",
        "mb/rank",
        "data plane ms",
        "(driver / slowest fetch)",
        "legacy ms",
        "(driver shard+put)",
        "ratio dp/legacy (paired)",
        "driver bytes dp",
        "% payload",
        "driver bytes legacy",
        "% payload",
    ]
    table = [header, "| " + " | ".join(cols) + " |", "|" + "|".join("---" for _ in cols) + "|"]
    for r in rows:
        table.append(
            f"| {r['dp']} | {r['microbatches_per_rank']} | {r['data_plane_ms']:.1f} | "
            f"{r['data_plane_driver_plan_fan_out_ms']:.1f} / {r['data_plane_slowest_rank_fetch_ms']:.1f} | "
            f"{r['legacy_ms']:.1f} | {r['legacy_driver_shard_put_ms']:.1f} | "
            f"{r['ratio_dp_over_legacy']:.2f} ({r['paired_ratio_dp_over_legacy']:.2f}) | "
            f"{r['data_plane_driver_bytes']:,} | {r['data_plane_driver_pct_payload']:.3f}% | "
            f"{r['legacy_driver_bytes']:,} | {r['legacy_driver_pct_payload']:.1f}% |"
        )
    print("\n".join(table))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "args": vars(args),
                "machine": {
                    "cpus": os.cpu_count(),
                    "python": platform.python_version(),
                    "torch": torch.__version__,
                    "load_avg_start_end": [load_start, os.getloadavg()[0]],
                },
                "rows": rows,
                "table": table,
            },
            indent=2,
        )
    )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
