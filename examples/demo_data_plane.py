"""A data-plane round trip on local Ray + TransferQueue, printing what moved where.

    python examples/demo_data_plane.py [--samples 64] [--dp 2]

1. starts a local Ray cluster and a TransferQueue store (one storage unit, fits 2 CPUs);
2. a "collector" actor puts a rollout-shaped batch (jagged token ids, log-probs, rewards);
   the driver gets back only the meta;
3. the driver balances the batch over ``--dp`` ranks by the ``seq_len`` tags and fans out one
   meta per rank (no tensor I/O);
4. each worker actor fetches its share, computes a per-sample column and writes it back;
5. the driver reads that small column, clears the partition and shows the byte counts.
"""

from __future__ import annotations

import argparse
import os
import pickle
import sys
import time
from pathlib import Path

os.environ.setdefault("TQ_LOGGING_LEVEL", "ERROR")
os.environ.setdefault("RAY_DEDUP_LOGS", "0")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import ray  # noqa: E402
import torch  # noqa: E402

from nemo_dataplane import DataPlaneConfig, KVBatchMeta, build_data_plane_client  # noqa: E402
from nemo_dataplane.codec import batch_nbytes  # noqa: E402
from nemo_dataplane.config import PackingConfig  # noqa: E402
from nemo_dataplane.driver import driver_balanced_preshards, fan_out_per_rank_metas, read_columns  # noqa: E402

PARTITION = "demo"
CONFIG = {"backend": "transfer_queue", "transfer_queue": {"num_storage_units": 1}}


@ray.remote(num_cpus=0)
class Collector:
    """Stands in for the rollout collector: writes rollouts straight into the store."""

    def __init__(self) -> None:
        self.client = build_data_plane_client(CONFIG, bootstrap=False)

    def collect(self, n: int, seed: int) -> tuple[KVBatchMeta, int]:
        g = torch.Generator().manual_seed(seed)
        lens = torch.randint(32, 512, (n,), generator=g)
        ids = torch.nested.nested_tensor(
            [torch.randint(0, 32_000, (int(L),), generator=g) for L in lens], layout=torch.jagged
        )
        logp = torch.nested.nested_tensor([-torch.rand(int(L), generator=g) for L in lens], layout=torch.jagged)
        fields = {"input_ids": ids, "logprobs": logp, "rewards": torch.rand(n, generator=g)}
        tags = [{"seq_len": int(L)} for L in lens]
        meta = self.client.kv_batch_put([f"rollout/{i}" for i in range(n)], PARTITION, fields, tags)
        return meta, batch_nbytes(fields)


@ray.remote(num_cpus=0)
class Worker:
    """Stands in for one DP rank of a policy: fetch its share, write one column back."""

    def __init__(self, rank: int) -> None:
        from nemo_dataplane.worker import WorkerFetcher

        self.rank = rank
        self.fetcher = WorkerFetcher(build_data_plane_client(CONFIG, bootstrap=False), fetch_policy="independent")

    def score(self, meta: KVBatchMeta) -> dict[str, int]:
        batch = self.fetcher.fetch(meta, ["input_ids", "logprobs"])
        logp = batch.data["logprobs"]
        mean_logp = torch.stack([row.mean() for row in logp.unbind()])
        self.fetcher.write_back(meta, {"mean_logprob": mean_logp})
        return {
            "rank": self.rank,
            "samples": len(meta),
            "microbatches": len(batch.microbatches),
            "tokens": int(batch.data["input_ids"].values().numel()),
            "bytes_fetched": batch_nbytes(batch.data),
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=256)
    parser.add_argument("--dp", type=int, default=2)
    args = parser.parse_args()

    t0 = time.perf_counter()
    ray.init(address="local", num_cpus=2, include_dashboard=False, configure_logging=False, log_to_driver=True)
    client = None
    driver_bytes = 0
    try:
        client = build_data_plane_client(DataPlaneConfig.from_dict(CONFIG), bootstrap=True)
        print(f"[demo] Ray + TransferQueue up in {time.perf_counter() - t0:.1f}s")
        collector = Collector.remote()
        meta, payload = ray.get(collector.collect.remote(args.samples, seed=0), timeout=120)
        driver_bytes += len(pickle.dumps(meta))
        print(
            f"[demo] collector put {len(meta)} rollouts ({payload / 1e6:.2f} MB) -> "
            f"driver got a {len(pickle.dumps(meta))} B meta"
        )

        plan = driver_balanced_preshards(meta, args.dp, PackingConfig(mode="sequence", max_tokens_per_microbatch=2048))
        metas = fan_out_per_rank_metas(None, plan, meta, partition_id=PARTITION, key_prefix="demo")
        driver_bytes += sum(len(pickle.dumps(m)) for m in metas)
        workers = [Worker.remote(r) for r in range(args.dp)]
        reports = ray.get([w.score.remote(m) for w, m in zip(workers, metas)], timeout=120)
        for rep in reports:
            print(
                f"[demo] rank {rep['rank']}: {rep['samples']} samples, {rep['tokens']} tokens, "
                f"{rep['microbatches']} micro-batches, fetched {rep['bytes_fetched'] / 1e6:.2f} MB from the store"
            )

        cols = read_columns(client, meta, ["mean_logprob", "rewards"])
        driver_bytes += sum(t.numel() * t.element_size() for t in cols.values())
        print(
            f"[demo] driver read back 2 small columns: mean_logprob[:4]={cols['mean_logprob'][:4].tolist()} "
            f"rewards[:4]={[round(x, 3) for x in cols['rewards'][:4].tolist()]}"
        )
    finally:
        # The store and Ray go down even if clearing fails.
        try:
            if client is not None:
                try:
                    client.kv_clear(None, PARTITION)
                    left = len(client.kv_list(PARTITION))
                finally:
                    client.close()
        finally:
            ray.shutdown()
    print(
        f"[demo] bytes through the driver: {driver_bytes} ({100 * driver_bytes / payload:.2f}% of the "
        f"{payload} B payload); keys left in the store: {left}; total {time.perf_counter() - t0:.1f}s"
    )


if __name__ == "__main__":
    main()
