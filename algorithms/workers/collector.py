"""Rollout collector (Ray actor): a producer of scored groups, driven two ways.

* ``collect(jobs, seed, partition)`` (sync): generate the jobs' groups now, deliver, return.
* ``start(partition)`` + ``submit(jobs)`` (async): a background thread takes queued jobs a few
  groups at a time, generates them with whatever weights the generator holds, scores them and
  writes them, for as long as the run lasts. It never waits on the trainer except through
  backpressure: at most ``max_inflight_groups`` groups written and not yet claimed by the
  trainer; beyond that it waits (counted as collector idle seconds).

Delivery: data plane, rows are put into the store under ``v{version}/g{group}/s{i}`` (partition
``rollouts``), tagged ``seq_len``, ``prompt_len``, ``group``, ``weight_version``, ``reward`` and ``handout``;
legacy, the rows wait in this actor's outbox until the driver ``take``s them through Ray.
A put that fails is rolled back (its keys cleared) and its groups reported as failed, so the
trainer never sees part of a group and the prompts are generated again. A put refused because the
store is full (``data_plane.max_rows``) is backpressure in the async producer (it waits for room,
bounded by ``trainer.step_timeout_s``) and an error in the sync ``collect``.

Rollout fields: ``input_ids`` jagged int64 (``<bos>`` + prompt + response), ``prompt_len``,
``seq_len``, ``group_id``, ``weight_version`` int64, ``rewards`` float32, ``gen_logprobs``
jagged float32 of length ``seq_len - 1`` (the sampler's log-prob of token ``t + 1`` at ``t``;
0 over the prompt), the behaviour policy of the off-policy correction.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

import ray
import torch
from tensordict import TensorDict

from algorithms.metrics import payload_bytes
from algorithms.faults import InjectedFailure, maybe_fail
from nemo_dataplane.codec import jagged_from_rows
from nemo_dataplane.rows import select_rows


def rollout_keys(version: int, group_ids: Sequence[int], group_size: int) -> list[str]:
    """Store keys of groups drawn with weight ``version``, group-major (the generator's order)."""
    return [f"v{version}/g{g}/s{i}" for g in group_ids for i in range(group_size)]


class RolloutCollector:
    """Args: ``cfg`` (``TrainerConfig.to_dict()``), ``generator`` (the generator actor handle),
    ``index`` (which collector this is, for messages)."""

    def __init__(self, cfg: Mapping[str, Any], generator: Any, index: int = 0) -> None:
        from algorithms.tasks import CharTokenizer, resolve_reward_fn

        self.cfg = cfg
        torch.set_num_threads(1)
        self.generator = generator
        self.index = index
        self.n = int(cfg["generation"]["n"])
        self.tokenizer = CharTokenizer()
        self.reward_fn = resolve_reward_fn(cfg["task"]["reward_fn"], cfg["task"]["name"])
        self.timeout_s = float(cfg["trainer"]["step_timeout_s"])
        self.client: Any = None
        # async producer state (guarded by _cv)
        self._cv = threading.Condition()
        self._queue: collections.deque[Any] = collections.deque()
        self._outbox: collections.deque[dict[str, Any]] = collections.deque()
        self._failed: list[int] = []
        self._error: str | None = None
        self._stop = False
        self._thread: threading.Thread | None = None
        self._stats = {"idle_s": 0.0, "generate_s": 0.0, "groups_written": 0, "put_failures": 0, "store_full_waits": 0}

    def ready(self) -> bool:
        return True

    def attach_data_plane(self, data_plane_cfg: Mapping[str, Any]) -> None:
        """Attach to the driver's store (data-plane path only)."""
        from nemo_dataplane.factory import build_data_plane_client

        self.client = build_data_plane_client(data_plane_cfg, bootstrap=False)

    # ------------------------------------------------------------------ generation
    def _sample(self, prompts: Sequence[Sequence[int]], n: int, seed: int, temperature: float | None) -> tuple[list, list, int]:
        ref = self.generator.generate.remote(list(prompts), n, seed, temperature=temperature)
        try:
            return ray.get(ref, timeout=self.timeout_s)
        except ray.exceptions.RayActorError as e:
            raise RuntimeError(f"collector {self.index}: the generator died or was lost mid-generation: "
                               f"{type(e).__name__}: {e}") from e

    def _score(self, records: Sequence[Any], responses: Sequence[Sequence[int]], n: int,
               groups: Sequence[int] | None = None) -> list[float]:
        out = []
        for i, resp in enumerate(responses):
            record = records[i // n]
            try:
                # fail_in=reward: the reward call of group fail_at_group raises, as a user's function would
                maybe_fail(self.cfg["debug"], "reward", group=groups[i // n] if groups else None,
                           what=f"in the reward function of group {groups[i // n] if groups else '?'}")
                value = self.reward_fn(record, self.tokenizer.decode(resp))
            except Exception as e:
                raise RuntimeError(
                    f"reward_fn {self.cfg['task']['reward_fn'] or self.cfg['task']['name']!r} raised "
                    f"{type(e).__name__} on prompt uid {record.uid} ({record.prompt[:80]!r}): {e}"
                ) from e
            try:
                out.append(float(value))
            except (TypeError, ValueError):
                raise TypeError(
                    f"reward_fn returned {value!r} (a {type(value).__name__}) for prompt uid {record.uid}; "
                    "it must return a float"
                ) from None
        return out

    def _generate(self, jobs: Sequence[Any], seed: int) -> tuple[TensorDict, list[dict[str, Any]], int, float]:
        """Generate and score ``jobs``: (rows, tags, weight version, mean response length)."""
        n = self.n
        prompts = [self.tokenizer.encode_prompt(j.record.prompt) for j in jobs]
        responses, logprobs, version = self._sample(prompts, n, seed, None)
        rewards = torch.tensor(self._score([j.record for j in jobs], responses, n, [j.group_id for j in jobs]),
                               dtype=torch.float32)
        rows, gen_lp, prompt_len = [], [], []
        for i, (resp, lps) in enumerate(zip(responses, logprobs)):
            p = prompts[i // n]
            rows.append(torch.tensor(list(p) + list(resp), dtype=torch.int64))
            # Aligned like the trainer's log-probs: position t scores token t + 1.
            gen_lp.append(torch.tensor([0.0] * (len(p) - 1) + list(lps), dtype=torch.float32))
            prompt_len.append(len(p))
        seq_len = torch.tensor([r.numel() for r in rows], dtype=torch.int64)
        gids = torch.tensor([j.group_id for j in jobs], dtype=torch.int64).repeat_interleave(n)
        batch = TensorDict(
            {
                "input_ids": jagged_from_rows(rows),
                "prompt_len": torch.tensor(prompt_len, dtype=torch.int64),
                "seq_len": seq_len,
                "group_id": gids,
                "weight_version": torch.full((len(rows),), version, dtype=torch.int64),
                "rewards": rewards,
                "gen_logprobs": jagged_from_rows(gen_lp),
            },
            batch_size=[len(rows)],
        )
        tags = [
            {"seq_len": int(seq_len[i]), "prompt_len": prompt_len[i], "group": int(gids[i]), "weight_version": int(version),
             "reward": float(rewards[i]), "handout": int(jobs[i // n].handout)}
            for i in range(len(rows))
        ]
        mean_len = float(sum(len(r) for r in responses)) / max(len(responses), 1)
        return batch, tags, version, mean_len

    def _put(self, jobs: Sequence[Any], batch: TensorDict, tags: list[dict[str, Any]], version: int, partition_id: str) -> Any:
        """Put the groups' rows; on any failure clear what was written and re-raise."""
        keys = rollout_keys(version, [j.group_id for j in jobs], self.n)
        debug = self.cfg["debug"]
        try:
            if debug.get("fail_in") == "put" and debug.get("fail_at_group") in {j.group_id for j in jobs}:
                half = len(keys) // 2  # half a write lands, then the put fails
                self.client.kv_batch_put(keys[:half], partition_id, select_rows(batch, range(half)), tags=tags[:half])
                raise InjectedFailure(f"debug.fail_in=put: injected failure putting group {debug['fail_at_group']}")
            return self.client.kv_batch_put(keys, partition_id, batch, tags=tags)
        except BaseException:
            try:
                self.client.kv_clear(keys, partition_id)
            except Exception:  # noqa: BLE001 - the put's own error is the one to report
                pass
            raise

    def collect(self, jobs: Sequence[Any], seed: int, partition_id: str | None) -> dict[str, Any]:
        """Sync: generate ``jobs`` (``generation.n`` responses each) and deliver them now.

        Returns ``{"meta": KVBatchMeta}`` (data plane, ``partition_id`` given) or
        ``{"batch": TensorDict}`` (legacy), plus ``rewards`` [B] float32, ``response_len`` (mean),
        ``weight_version``, ``group_ids``, ``dp_bytes`` (bytes put into the store), ``generate_s``.
        """
        t0 = time.perf_counter()
        batch, tags, version, mean_len = self._generate(jobs, seed)
        out: dict[str, Any] = {
            "rewards": batch["rewards"].clone(), "response_len": mean_len, "weight_version": version,
            "group_ids": [j.group_id for j in jobs], "generate_s": time.perf_counter() - t0, "dp_bytes": 0,
        }
        if partition_id is None:
            out["batch"] = batch
        else:
            out["meta"] = self._put(jobs, batch, tags, version, partition_id)
            out["dp_bytes"] = payload_bytes(batch)
        # After the put, so the test sees the driver release keys a failed step left behind.
        step = jobs[0].group_id // len(jobs)
        maybe_fail(self.cfg["debug"], "collect", step=step, what=f"at step {step} in the collector")
        return out

    # ------------------------------------------------------------------ async producer
    def start(self, partition_id: str | None, max_inflight_groups: int, groups_per_generation: int) -> None:
        """Start the producer thread (idempotent). ``partition_id=None``: legacy outbox."""
        if self._thread is not None:
            return
        self._partition = partition_id
        self._max_inflight = int(max_inflight_groups)
        self._chunk = int(groups_per_generation)
        self._thread = threading.Thread(target=self._produce, name=f"collector{self.index}", daemon=True)
        self._thread.start()

    def submit(self, jobs: Sequence[Any]) -> int:
        """Queue jobs (FIFO); returns the queue length."""
        with self._cv:
            self._queue.extend(jobs)
            self._cv.notify_all()
            return len(self._queue)

    def _unconsumed_groups(self) -> int:
        """Groups written and not yet claimed by the trainer (store status, or this outbox)."""
        if self._partition is None:
            return len(self._outbox)
        from algorithms.step import TRAINER_TASK

        st = self.client.kv_claim_status(self._partition, TRAINER_TASK, ["input_ids"])
        return -(-st.claimable // self.n)

    def _produce(self) -> None:
        from algorithms.step import generation_seed

        seed = int(self.cfg["trainer"]["seed"])
        consecutive_failures = 0
        while True:
            with self._cv:
                while not self._queue and not self._stop:
                    self._cv.wait(0.5)
                if self._stop:
                    return
                jobs = [self._queue.popleft() for _ in range(min(self._chunk, len(self._queue)))]
            try:
                t_idle = time.perf_counter()
                pause = 0.005
                while not self._stop and self._unconsumed_groups() + len(jobs) > self._max_inflight:
                    # Backpressure: the trainer has not claimed enough yet. Back off so a long wait
                    # does not keep the store's controller busy answering status requests.
                    time.sleep(pause)
                    pause = min(pause * 2, 0.2)
                self._stats["idle_s"] += time.perf_counter() - t_idle
                if self._stop:
                    return
                t0 = time.perf_counter()
                batch, tags, version, _ = self._generate(jobs, generation_seed(seed, jobs[0].group_id))
                # fail_in=generate: mid-generation, before anything of these groups is written
                maybe_fail(self.cfg["debug"], "generate", group=jobs[0].group_id,
                           what=f"generating group {jobs[0].group_id} in collector {self.index}")
                self._stats["generate_s"] += time.perf_counter() - t0
                if self._partition is None:
                    with self._cv:
                        for g, j in enumerate(jobs):
                            sl = range(g * self.n, (g + 1) * self.n)
                            self._outbox.append({"group_id": j.group_id, "version": version,
                                                 "rows": select_rows(batch, sl), "tags": tags[sl.start:sl.stop]})
                        self._cv.notify_all()
                else:
                    self._put_when_room(jobs, batch, tags, version)
                self._stats["groups_written"] += len(jobs)
                consecutive_failures = 0
            except Exception as e:  # noqa: BLE001 - reported to the driver through stats()
                with self._cv:
                    self._failed.extend(j.group_id for j in jobs)
                    self._stats["put_failures"] += 1
                    consecutive_failures += 1
                    if not isinstance(e, InjectedFailure) or consecutive_failures > 3:
                        self._error = f"collector {self.index}: {type(e).__name__}: {e}"
                        return

    def _put_when_room(self, jobs: Sequence[Any], batch: TensorDict, tags: list[dict[str, Any]], version: int) -> None:
        """Async put; a full store (``data_plane.max_rows``) is backpressure, not an error: wait for
        the trainer to release rows (5 ms doubling to 200 ms, counted in ``store_full_waits`` and
        idle seconds), for at most ``trainer.step_timeout_s``, then report the store full."""
        from nemo_dataplane.wrappers.capacity import StoreFullError

        deadline = time.monotonic() + self.timeout_s
        pause = 0.005
        while True:
            try:
                self._put(jobs, batch, tags, version, self._partition)
                return
            except StoreFullError:
                if self._stop or time.monotonic() + pause > deadline:
                    raise
                self._stats["store_full_waits"] += 1
                t = time.perf_counter()
                time.sleep(pause)
                self._stats["idle_s"] += time.perf_counter() - t
                pause = min(pause * 2, 0.2)

    def take(self, max_groups: int, timeout_s: float) -> list[dict[str, Any]]:
        """Legacy: pop up to ``max_groups`` finished groups, waiting up to ``timeout_s`` for one."""
        deadline = time.monotonic() + timeout_s
        with self._cv:
            while not self._outbox and self._error is None and time.monotonic() < deadline:
                self._cv.wait(max(0.0, min(0.2, deadline - time.monotonic())))
            return [self._outbox.popleft() for _ in range(min(max_groups, len(self._outbox)))]

    def poll(self) -> dict[str, Any]:
        """Failed group ids since the last poll, the producer's error (if it stopped), counters."""
        with self._cv:
            failed, self._failed = self._failed, []
            return {"failed": failed, "error": self._error, "queued": len(self._queue), **self._stats}

    def stop(self, timeout_s: float = 10.0) -> list[int]:
        """Stop the producer (bounded); returns the group ids still queued (never generated)."""
        with self._cv:
            self._stop = True
            left = [j.group_id for j in self._queue]
            self._queue.clear()
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join(timeout_s)
        return left

    def validate(self, records: Sequence[Any], seed: int) -> float:
        """Mean reward of one response per held-out record at ``generation.val_temperature``
        (nothing is stored)."""
        if not records:
            return float("nan")
        prompts = [self.tokenizer.encode_prompt(r.prompt) for r in records]
        responses, _, _ = self._sample(prompts, 1, seed, float(self.cfg["generation"]["val_temperature"]))
        scores = self._score(records, responses, 1)
        return sum(scores) / len(scores)

    def loaded_modules(self) -> list[str]:
        import sys

        return sorted(m for m in sys.modules if m.startswith(("nemo_dataplane", "transfer_queue")))

    def close(self) -> None:
        self.stop(5.0)
        if self.client is not None:
            self.client.close()
            self.client = None
