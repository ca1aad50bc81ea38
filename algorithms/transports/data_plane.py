"""The data-plane transport: rollouts stay in the store; the driver moves metadata.

Collectors put whole groups into the :data:`~algorithms.rollouts.ROLLOUTS` partition; the driver
takes per-row rewards from the rows' tags, writes only the ``advantages`` column
(``write_columns``, bounded by ``data_plane.column_max_bytes_per_sample``), pre-shards and fans
out one :class:`~nemo_dataplane.meta.KVBatchMeta` per DP rank; each rank fetches its rows
(``WorkerFetcher``) and writes its results back leader-only; keys are released one batch at a
time. The async trainer claims groups as task :data:`~algorithms.rollouts.TRAINER_TASK`.

Importing this module loads the data plane (client, factory, adapters on first use); the
baseline transport never imports it.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from tensordict import TensorDict

from algorithms.config import TrainerConfig, check_backend
from algorithms.faults import InjectedFailure
from algorithms.metrics import payload_bytes
from algorithms.rollouts import (
    ROLLOUT_FIELDS,
    ROLLOUTS,
    TRAINER_TASK,
    ClaimedGroup,
    GroupAssembler,
    Job,
    group_from_tags,
    parse_rollout_key,
    rollout_keys,
    rows_from_state,
    rows_state,
)
from algorithms.telemetry import OpLog, OpRecord
from algorithms.transports.base import BatchIO, Loaded, RolloutSink, RolloutSource, Transport
from nemo_dataplane.client import ClaimsNotSupported, DataPlaneClient
from nemo_dataplane.config import DataPlaneConfig, ObservabilityConfig
from nemo_dataplane.driver.columns import write_columns
from nemo_dataplane.driver.fan_out import fan_out_per_rank_metas
from nemo_dataplane.driver.planner import Preshards
from nemo_dataplane.factory import build_data_plane_client, resolve_backend
from nemo_dataplane.meta import KVBatchMeta
from nemo_dataplane.rows import select_rows
from nemo_dataplane.worker.fetch import WorkerFetcher
from nemo_dataplane.wrappers.capacity import StoreFullError

__all__ = ["DataPlaneBatchIO", "DataPlaneSink", "DataPlaneSource", "DataPlaneTransport"]


def _attach(cfg: DataPlaneConfig, ops: OpLog) -> DataPlaneClient:
    """A worker's client of the driver's store (attach only: a worker never creates one), its
    ops recorded in ``ops``."""
    return build_data_plane_client(cfg, bootstrap=False, on_event=ops)


def observed(cfg: DataPlaneConfig) -> DataPlaneConfig:
    """The run's store config with op recording on: every caller's op timings reach the driver
    (metrics.jsonl, the Prometheus endpoint); no per-key byte ledger (the store's own count of
    keys is what the trainer reports)."""
    return dataclasses.replace(cfg, observability=ObservabilityConfig(enabled=True, track_outstanding=False))


class DataPlaneTransport(Transport):
    """The driver's side: owns the store (brought up by :meth:`start`, emptied and closed at the end)."""

    name = "data_plane"
    startup_phase = "store"

    def __init__(self, cfg: TrainerConfig) -> None:
        super().__init__(cfg)
        self.client: DataPlaneClient | None = None
        self.data_plane = observed(cfg.data_plane)
        self._startup: dict[str, float] = {}

    @property
    def store(self) -> DataPlaneClient:
        if self.client is None:
            raise RuntimeError("the data-plane transport is not started")
        return self.client

    def start(self) -> None:
        t0 = time.perf_counter()
        self.client = build_data_plane_client(self.data_plane, bootstrap=True, on_event=self.ops)
        total = time.perf_counter() - t0
        # The phases a backend measured bringing its store up (the TransferQueue adapter's
        # startup_phases; read through any wrapper); the rest is importing it and its checks.
        phases = dict(getattr(self.client, "startup_phases", None) or {})
        measured = phases.get("actors_up_s", 0.0) + phases.get("config_connect_s", 0.0)
        self._startup = {"total_s": total, "import_other_s": max(total - measured, 0.0), **phases}

    def actor_modules(self) -> tuple[str, ...]:
        return resolve_backend(self.data_plane.backend).ACTOR_MODULES

    def startup_detail(self) -> dict[str, float]:
        return dict(self._startup)

    def close(self) -> None:
        client, self.client = self.client, None
        if client is not None:
            client.close()

    def capacity_rows(self) -> int | None:
        return self.cfg.data_plane.max_rows

    def label(self) -> str:
        return f"{self.name} (backend={self.data_plane.backend})"

    def require_claims(self) -> None:
        check_backend(self.data_plane.backend, needs_claims=True)

    def sink(self) -> DataPlaneSink:
        return DataPlaneSink(self.cfg, self.data_plane)

    def batch_io(self) -> DataPlaneBatchIO:
        return DataPlaneBatchIO(self.data_plane)

    def source(self, pool: Any) -> DataPlaneSource:
        return DataPlaneSource(self.store, self.cfg)

    def concat(self, parts: Sequence[Any]) -> KVBatchMeta:
        return KVBatchMeta.concat(list(parts))

    def keep(self, handle: Any, keep_idx: list[int], drop_idx: list[int]) -> Any:
        self.store.kv_clear([handle.keys[i] for i in drop_idx], handle.partition_id)
        return handle.subset(keep_idx)

    def write_advantages(self, handle: Any, advantages: torch.Tensor) -> Any:
        self.driver_bytes += payload_bytes(advantages)
        self.column_bytes = payload_bytes(advantages)
        return write_columns(
            self.store,
            handle,
            {"advantages": advantages},
            max_bytes_per_sample=self.cfg.data_plane.column_max_bytes_per_sample,
        )

    def rank_inputs(self, handle: Any, preshards: Preshards, step: int) -> list[Any]:
        # A meta source is re-sliced without I/O; the keys stay the collector's.
        return fan_out_per_rank_metas(
            self.store, preshards, handle, partition_id=handle.partition_id, key_prefix=f"step{step}"
        )

    def input_bytes(self, inputs: Sequence[Any]) -> int:
        return payload_bytes(list(inputs))

    def absorb(self, handle: Any, preshards: Preshards, field: str, rank_results: Sequence[Mapping[str, Any]]) -> Any:
        return handle.add_fields([field])  # the ranks wrote it back themselves

    def release(self, handle: Any) -> None:
        if len(handle):
            self.store.kv_clear(list(handle.keys), handle.partition_id)

    def outstanding(self, audit: bool = False) -> int:
        """Keys in the store (what it says, not this driver's bookkeeping); 0 when no store came
        up. Every step: the rollouts partition's row count from the store's claim status (no
        tags move); with ``audit``, or where a backend has no claims, a listing of every partition."""
        if self.client is None:
            return 0
        if not audit:
            try:
                return self.client.kv_claim_status(ROLLOUTS, TRAINER_TASK, ["input_ids"]).rows
            except ClaimsNotSupported:
                pass
        return sum(len(self.client.kv_list(p)) for p in self.client.kv_partitions())

    def stored_keys(self) -> dict[str, list[str]]:
        if self.client is None:
            return {}
        return {p: list(self.client.kv_list(p).keys) for p in self.client.kv_partitions()}

    def clear_all(self) -> None:
        if self.client is None:
            return
        for p in self.client.kv_partitions():
            self.client.kv_clear(None, p)

    def snapshot(self, group: ClaimedGroup) -> dict[str, Any]:
        meta = group.rows
        rows = self.store.kv_batch_get(meta, list(ROLLOUT_FIELDS))
        return {"rows": rows_state(rows), "tags": [dict(t) for t in meta.tags]}

    def restore(self, group_id: int, version: int, state: Mapping[str, Any]) -> KVBatchMeta:
        tags = [dict(t) for t in state["tags"]]
        keys = rollout_keys(version, [group_id], len(tags))
        self.store.kv_batch_put(keys, ROLLOUTS, rows_from_state(state["rows"]), tags=tags)
        self.store.kv_mark_consumed(keys, ROLLOUTS, TRAINER_TASK)
        return KVBatchMeta(keys=tuple(keys), tags=tuple(tags), partition_id=ROLLOUTS, fields=ROLLOUT_FIELDS)


class DataPlaneSink(RolloutSink):
    """Puts a collector's groups into the store under :func:`~algorithms.rollouts.rollout_keys`.

    A put that fails is rolled back (its keys cleared) so the trainer never sees part of a group.
    In the async stream a put refused because the store is full (``data_plane.max_rows``) is
    backpressure: it waits for the trainer to release rows (5 ms doubling to 200 ms, counted in
    ``store_full_waits``) for at most ``trainer.step_timeout_s``; in a sync delivery it is an error.
    """

    def __init__(self, cfg: TrainerConfig, data_plane: DataPlaneConfig) -> None:
        self.data_plane = data_plane
        self.debug = cfg.debug
        self.n = cfg.generation.n
        self.timeout_s = cfg.trainer.step_timeout_s
        self.client: DataPlaneClient | None = None
        self.ops: OpLog | None = None  # made in the collector's process (a lock does not pickle)
        self.store_full_waits = 0

    def open(self) -> None:
        self.ops = OpLog("collector")
        self.client = _attach(self.data_plane, self.ops)

    def drain_ops(self) -> list[OpRecord]:
        return self.ops.drain() if self.ops is not None else []

    @property
    def store(self) -> DataPlaneClient:
        if self.client is None:
            raise RuntimeError("the collector's data-plane sink is not open")
        return self.client

    def _put(self, jobs: Sequence[Job], batch: TensorDict, tags: list[dict[str, Any]], version: int) -> KVBatchMeta:
        keys = rollout_keys(version, [j.group_id for j in jobs], self.n)
        try:
            # debug.fail_in=put: half of the write lands, then the put fails (tests the rollback).
            # The half lacks input_ids, so no claim can take those rows in the moment before the
            # rollback clears them: a trainer that did would fail its step reading cleared keys.
            if self.debug.fail_in == "put" and self.debug.fail_at_group in {j.group_id for j in jobs}:
                half = len(keys) // 2
                partial = select_rows(batch, range(half)).exclude("input_ids")
                self.store.kv_batch_put(keys[:half], ROLLOUTS, partial, tags=tags[:half])
                raise InjectedFailure(f"debug.fail_in=put: injected failure putting group {self.debug.fail_at_group}")
            return self.store.kv_batch_put(keys, ROLLOUTS, batch, tags=tags)
        except BaseException:
            try:
                self.store.kv_clear(keys, ROLLOUTS)
            except Exception:  # noqa: BLE001 - the put's own error is the one to report
                pass
            raise

    def deliver(
        self, jobs: Sequence[Job], batch: TensorDict, tags: list[dict[str, Any]], version: int
    ) -> tuple[Any, int]:
        return self._put(jobs, batch, tags, version), payload_bytes(batch)

    def stream(
        self,
        jobs: Sequence[Job],
        batch: TensorDict,
        tags: list[dict[str, Any]],
        version: int,
        stopped: Callable[[], bool],
    ) -> float:
        deadline = time.monotonic() + self.timeout_s
        pause, waited = 0.005, 0.0
        while True:
            try:
                self._put(jobs, batch, tags, version)
                return waited
            except StoreFullError:
                if stopped() or time.monotonic() + pause > deadline:
                    raise
                self.store_full_waits += 1
                t = time.perf_counter()
                time.sleep(pause)
                waited += time.perf_counter() - t
                pause = min(pause * 2, 0.2)

    def unconsumed_groups(self) -> int:
        st = self.store.kv_claim_status(ROLLOUTS, TRAINER_TASK, ["input_ids"])
        return -(-st.claimable // self.n)

    def stats(self) -> dict[str, float]:
        return {"store_full_waits": float(self.store_full_waits)}

    def close(self) -> None:
        client, self.client = self.client, None
        if client is not None:
            client.close()


class DataPlaneSource(RolloutSource):
    """Claims rows of the ``rollouts`` partition as task ``trainer`` and assembles whole groups."""

    def __init__(self, client: DataPlaneClient, cfg: TrainerConfig) -> None:
        self.client = client
        self.n = cfg.generation.n
        # Under backpressure at most this many rows can be written and unclaimed, so asking for
        # more would always wait out the timeout.
        self.max_rows = cfg.async_.inflight_groups(cfg.grpo.prompts_per_step) * self.n
        self.assembler = GroupAssembler(self.n)

    def claim(self, need_groups: int, timeout_s: float) -> list[ClaimedGroup]:
        need = min(max(1, need_groups * self.n - len(self.assembler)), self.max_rows)
        meta = self.client.kv_claim(ROLLOUTS, TRAINER_TASK, list(ROLLOUT_FIELDS), need, timeout_s)
        for key, tag in zip(meta.keys, meta.tags):
            self.assembler.add(int(tag["group"]), parse_rollout_key(key).sample, (key, tag))
        out = []
        for gid, items in self.assembler.pop_complete():
            tags = [t for _, t in items]
            rows = KVBatchMeta(
                keys=tuple(k for k, _ in items), tags=tuple(tags), partition_id=ROLLOUTS, fields=ROLLOUT_FIELDS
            )
            out.append(group_from_tags(gid, rows, tags))
        return out

    def drop(self, group: ClaimedGroup) -> None:
        self.client.kv_clear(list(group.rows.keys), ROLLOUTS)

    def discard(self, group_id: int) -> None:
        self.assembler.discard(group_id)

    def partial_rows(self) -> int:
        return len(self.assembler)

    def forget(self, group_ids: Sequence[int]) -> None:
        gone = set(group_ids)
        for gid in gone:
            self.assembler.discard(gid)
        # Claimed or not, produced or not: every key of theirs in the partition.
        keys = [k for k in self.client.kv_list(ROLLOUTS).keys if parse_rollout_key(k).group in gone]
        if keys:
            self.client.kv_clear(keys, ROLLOUTS)


class DataPlaneBatchIO(BatchIO):
    """A rank fetches its meta's rows (``WorkerFetcher``: independently, or one leader per TP group
    fetches and broadcasts, as ``data_plane.fetch_policy`` says) and writes results back
    leader-only."""

    def __init__(self, data_plane: DataPlaneConfig) -> None:
        self.data_plane = data_plane
        self.fetcher: WorkerFetcher | None = None
        self.ops: OpLog | None = None  # made in the rank's process (a lock does not pickle)

    def open(self, rank: int, replica_group: Any, timeout_s: float) -> None:
        self.ops = OpLog("rank")
        replica = {"replica_group": replica_group} if replica_group is not None else {"replica_ranks": [rank]}
        self.fetcher = WorkerFetcher(
            _attach(self.data_plane, self.ops),
            fetch_policy=self.data_plane.fetch_policy,
            timeout_s=timeout_s,
            **replica,
        )

    def drain_ops(self) -> list[OpRecord]:
        return self.ops.drain() if self.ops is not None else []

    def _fetcher(self) -> WorkerFetcher:
        if self.fetcher is None:
            raise RuntimeError("the rank's data-plane reader is not open")
        return self.fetcher

    def load(self, batch: Any, fields: Sequence[str]) -> Loaded:
        fetched = self._fetcher().fetch(batch, list(fields))
        n = len(batch)
        plan = fetched.plan
        positions = [list(mb) for mb in plan["microbatches"]] if plan and "microbatches" in plan else [list(range(n))]
        return Loaded(fetched.microbatches, positions, n, payload_bytes(fetched.data))

    def store(self, batch: Any, columns: Mapping[str, torch.Tensor]) -> tuple[dict[str, Any], int]:
        self._fetcher().write_back(batch, dict(columns))
        return {}, sum(payload_bytes(c) for c in columns.values())

    def close(self) -> None:
        fetcher, self.fetcher = self.fetcher, None
        if fetcher is not None and fetcher.client is not None:
            fetcher.client.close()
