"""Worker-side helpers: fetch a DP shard under a fetch policy, write results back leader-only."""

from nemo_dataplane.worker.fetch import FetchedBatch, FetchPolicy, WorkerFetcher

__all__ = ["FetchPolicy", "FetchedBatch", "WorkerFetcher"]
