"""Rollout collector (Ray actor): a producer of scored groups, driven two ways.

* ``collect(jobs, seed)`` (sync): generate the jobs' groups now, deliver, return.
* ``start(...)`` + ``submit(jobs)`` (async): a background thread takes queued jobs a few groups
  at a time, generates them with whatever weights the generator holds, scores them and delivers
  them, for as long as the run lasts. It never waits on the trainer except through backpressure:
  at most ``max_inflight_groups`` groups delivered and not yet taken by the trainer; beyond that
  it waits (counted as collector idle seconds).

Delivery goes through the transport's sink (:class:`algorithms.transports.RolloutSink`,
attached by the driver): into the store, or back to the driver through Ray. A delivery that fails
leaves none of its rows and its groups are reported as failed, so the trainer never sees part of
a group and the prompts are generated again. Rows and tags follow :mod:`algorithms.rollouts`.
"""

from __future__ import annotations

import collections
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any

import ray
import torch
from tensordict import TensorDict

from algorithms.config import TrainerConfig
from algorithms.engines.generation import Rollouts
from algorithms.faults import InjectedFailure, maybe_fail
from algorithms.reward_pool import ResponseScorer
from algorithms.rollouts import Job, Sampled, continuation_seed, generation_seed, rollout_tags, sample_seed
from algorithms.tasks import task_ignores_eos
from algorithms.tokenizers import build_tokenizer
from algorithms.transports import RolloutSink
from algorithms.workers.row_pool import RowPool, batches_by_version
from nemo_dataplane.codec import jagged_from_rows

# Partial rollouts: a generate call also ends once fewer than this share of its responses are
# still running, so finished responses' places go to new prompts instead of idling until the
# longest response is done (the long tail).
PARTIAL_MIN_RUNNING = 0.5
# A generation's rows, tags, the oldest weight version of any token and the mean response length.
Generated = tuple[TensorDict, list[dict[str, Any]], int, float]


class RolloutCollector:
    """Args: ``cfg`` (the trainer config), ``generator`` (the generator actor handle), ``index``
    (which collector this is, for messages). :meth:`attach` gives it its sink before any delivery."""

    def __init__(self, cfg: TrainerConfig, generator: Any, index: int = 0) -> None:
        self.cfg = cfg
        torch.set_num_threads(1)
        self.generator = generator
        self.index = index
        self.n = cfg.generation.n
        self.tokenizer = build_tokenizer(cfg)
        # The reward under task.reward_timeout_s: its first worker process starts now.
        self.rewards = ResponseScorer(cfg, self.tokenizer.decode)
        self.ignore_eos = task_ignores_eos(cfg.task.name)
        self.timeout_s = cfg.trainer.step_timeout_s
        self.sink: RolloutSink | None = None
        # async producer state (guarded by _cv)
        self._cv = threading.Condition()
        self._queue: collections.deque[Job] = collections.deque()
        self._failed: list[int] = []
        self._error: str | None = None
        self._stop = False
        self._thread: threading.Thread | None = None
        self._max_inflight = 0
        self._chunk = 1
        # idle_s: waiting on backpressure or a full store; generator_busy_s: the generator's own
        # time generating for this collector (cumulative; the driver takes per-step deltas).
        self._stats = dict.fromkeys(
            ("idle_s", "generate_s", "generator_busy_s", "partial_samples", "groups_written", "put_failures"), 0.0
        )

    def ready(self) -> bool:
        """Up once a reward worker is (a reward that cannot load fails the start-up here)."""
        self.rewards.wait_ready(self.cfg.trainer.startup_timeout_s)
        return True

    def attach(self, sink: RolloutSink) -> None:
        """Open the transport's sink in this process (the driver built it)."""
        sink.open()
        self.sink = sink

    def _sink(self) -> RolloutSink:
        if self.sink is None:
            raise RuntimeError(f"collector {self.index}: no sink attached")
        return self.sink

    # ------------------------------------------------------------------ generation
    def _call(
        self,
        prompts: Sequence[Sequence[int]],
        n: int,
        seed: int,
        temperature: float | None,
        limits: Sequence[int] | None,
        interruptible: bool,
        min_running: float = 0.0,
        row_seeds: Sequence[int] | None = None,
        version: int | None = None,
    ) -> tuple[Rollouts, float]:
        ref = self.generator.generate.remote(
            list(prompts),
            n,
            seed,
            temperature=temperature,
            limits=None if limits is None else list(limits),
            ignore_eos=self.ignore_eos,
            interruptible=interruptible,
            min_running=min_running,
            row_seeds=None if row_seeds is None else list(row_seeds),
            version=version,
        )
        try:
            # A version wait is bounded by the same timeout inside the generator.
            return ray.get(ref, timeout=self.timeout_s * (2 if version is not None else 1))
        except ray.exceptions.RayActorError as e:
            raise RuntimeError(
                f"collector {self.index}: the generator died or was lost mid-generation: {type(e).__name__}: {e}"
            ) from e

    def _sample(
        self,
        prompts: Sequence[Sequence[int]],
        n: int,
        seed: int,
        temperature: float | None,
        limits: Sequence[int] | None = None,
        row_seeds: Sequence[int] | None = None,
        version: int | None = None,
    ) -> Sampled:
        """``n`` complete responses per prompt. With ``async.partial_rollout`` a refit may stop the
        generator's call at a token boundary: each unfinished response then goes on from where it
        stopped (its prompt and tokens so far as the new prompt, the rest of its limit) under the
        new weights, until every response is complete; each token keeps the version that drew it.
        ``row_seeds``/``version``: per-response seeds and the exact weight version (deterministic
        mode, where partial rollouts are refused)."""
        partial = self.cfg.async_.partial_rollout
        out, busy = self._call(prompts, n, seed, temperature, limits, partial, row_seeds=row_seeds, version=version)
        tokens = [list(t) for t in out.tokens]
        logprobs = [list(lp) for lp in out.logprobs]
        versions = [[out.version] * len(t) for t in out.tokens]
        pending = [j for j, done in enumerate(out.finished) if not done]
        segment = 0
        while pending:
            segment += 1
            cap = self.cfg.generation.max_new_tokens
            left = [(cap if limits is None else limits[j // n]) - len(tokens[j]) for j in pending]
            more, b = self._call(
                [list(prompts[j // n]) + tokens[j] for j in pending],
                1,
                continuation_seed(seed, segment),
                temperature,
                left,
                True,
            )
            busy += b
            for k, j in enumerate(pending):
                tokens[j] += more.tokens[k]
                logprobs[j] += more.logprobs[k]
                versions[j] += [more.version] * len(more.tokens[k])
            pending = [j for k, j in enumerate(pending) if not more.finished[k]]
        return Sampled(tokens, logprobs, versions, out.version, busy)

    def _limits(self, records: Sequence[Any]) -> list[int] | None:
        """Each prompt's own response limit, where its record has one (long-tail tasks)."""
        if all(r.max_new_tokens is None for r in records):
            return None
        cap = self.cfg.generation.max_new_tokens
        return [cap if r.max_new_tokens is None else min(int(r.max_new_tokens), cap) for r in records]

    def _generate(self, jobs: Sequence[Job], seed: int, row_seeded: bool = False) -> Generated:
        """Generate and score ``jobs``: (rows, tags, the oldest weight version of any token, mean
        response length); the generator's busy seconds are added to ``generator_busy_s``.
        ``row_seeded``: every response from its own seed (deterministic mode always)."""
        prompts = [self.tokenizer.encode_prompt(j.record.prompt) for j in jobs]
        version = jobs[0].version  # deterministic mode: the schedule's version and per-sample seeds
        row_seeds = (
            None
            if version is None and not row_seeded
            else [sample_seed(self.cfg.trainer.seed, j.group_id, i) for j in jobs for i in range(self.n)]
        )
        got = self._sample(
            prompts, self.n, seed, None, self._limits([j.record for j in jobs]), row_seeds=row_seeds, version=version
        )
        with self._cv:
            self._stats["generator_busy_s"] += got.busy_s
        return self._assemble(jobs, prompts, got)

    def _assemble(self, jobs: Sequence[Job], prompts: Sequence[Sequence[int]], got: Sampled) -> Generated:
        """Score ``jobs``' complete responses and lay them out as rollout rows: (rows, tags, the
        oldest weight version of any token, mean response length)."""
        n = self.n
        responses = got.tokens
        version = min([got.first_version, *(v for vs in got.versions for v in vs)])
        with self._cv:
            self._stats["partial_samples"] += sum(len(set(v)) > 1 for v in got.versions)
        rewards = torch.tensor(
            self.rewards.score([j.record for j in jobs], responses, n, [j.group_id for j in jobs]), dtype=torch.float32
        )
        rows, gen_lp, tok_v, prompt_len = [], [], [], []
        for i, (resp, lps, vs) in enumerate(zip(responses, got.logprobs, got.versions)):
            p = prompts[i // n]
            rows.append(torch.tensor(list(p) + list(resp), dtype=torch.int64))
            # Aligned like the trainer's log-probs: position t scores token t + 1.
            gen_lp.append(torch.tensor([0.0] * (len(p) - 1) + list(lps), dtype=torch.float32))
            tok_v.append(torch.tensor([-1] * (len(p) - 1) + list(vs), dtype=torch.int64))
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
                "token_versions": jagged_from_rows(tok_v),
            },
            batch_size=[len(rows)],
        )
        tags = rollout_tags(seq_len.tolist(), prompt_len, jobs, version, rewards.tolist(), n)
        mean_len = float(sum(len(r) for r in responses)) / max(len(responses), 1)
        return batch, tags, version, mean_len

    def collect(self, jobs: Sequence[Job], seed: int, row_seeded: bool = False) -> dict[str, Any]:
        """Sync: generate ``jobs`` (``generation.n`` responses each) and deliver them now
        (``row_seeded``: each response from its own seed, as :meth:`_generate` says).

        Returns ``handle`` (what the driver's transport moves), ``rewards`` [B] float32,
        ``response_len`` (mean), ``weight_version``, ``group_ids``, ``dp_bytes`` (bytes put into
        the store), ``generate_s``, ``generator_busy_s`` (the generator's own time for it).
        """
        t0 = time.perf_counter()
        busy_before = self._stats["generator_busy_s"]
        batch, tags, version, mean_len = self._generate(jobs, seed, row_seeded)
        handle, stored = self._sink().deliver(jobs, batch, tags, version)
        with self._cv:
            self._stats["groups_written"] += len(jobs)
        out: dict[str, Any] = {
            "handle": handle,
            "rewards": batch["rewards"].clone(),
            "response_len": mean_len,
            "weight_version": version,
            "group_ids": [j.group_id for j in jobs],
            "generate_s": time.perf_counter() - t0,
            "dp_bytes": stored,
            "generator_busy_s": self._stats["generator_busy_s"] - busy_before,
            "reward_timeouts": self.rewards.new_timeouts(),
            "ops": self._sink().drain_ops(),
        }
        # After the delivery, so the test sees the driver release keys a failed step left behind.
        step = jobs[0].group_id // self.cfg.grpo.prompts_per_step
        maybe_fail(self.cfg.debug, "collect", step=step, what=f"at step {step} in the collector")
        return out

    # ------------------------------------------------------------------ async producer
    def start(self, max_inflight_groups: int, groups_per_generation: int) -> None:
        """Start the producer thread (idempotent)."""
        if self._thread is not None:
            return
        self._max_inflight = int(max_inflight_groups)
        self._chunk = int(groups_per_generation)
        self._thread = threading.Thread(target=self._produce, name=f"collector{self.index}", daemon=True)
        self._thread.start()

    def submit(self, jobs: Sequence[Job]) -> int:
        """Queue jobs (FIFO); returns the queue length."""
        with self._cv:
            self._queue.extend(jobs)
            self._cv.notify_all()
            return len(self._queue)

    def _stopped(self) -> bool:
        return self._stop

    def _next_jobs(self) -> list[Job]:
        """The next generate call's jobs (caller holds ``_cv``): a whole piece where the schedule
        fixed them (deterministic mode), else up to ``groups_per_generation`` queued ones."""
        piece = self._queue[0].piece
        if piece is None:
            return [self._queue.popleft() for _ in range(min(self._chunk, len(self._queue)))]
        jobs = []
        while self._queue and self._queue[0].piece == piece:
            jobs.append(self._queue.popleft())
        return jobs

    def _produce(self) -> None:
        if self.cfg.async_.partial_rollout:
            self._produce_partial()
            return
        sink = self._sink()
        seed = self.cfg.trainer.seed
        consecutive_failures = 0
        while True:
            with self._cv:
                while not self._queue and not self._stop:
                    self._cv.wait(0.5)
                if self._stop:
                    return
                jobs = self._next_jobs()
            try:
                t_idle = time.perf_counter()
                pause = 0.005
                while not self._stop and sink.unconsumed_groups() + len(jobs) > self._max_inflight:
                    # Backpressure: the trainer has not taken enough yet. Back off so a long wait
                    # does not keep the store's controller busy answering status requests.
                    time.sleep(pause)
                    pause = min(pause * 2, 0.2)
                self._stats["idle_s"] += time.perf_counter() - t_idle
                if self._stop:
                    return
                t0 = time.perf_counter()
                batch, tags, version, _ = self._generate(jobs, generation_seed(seed, jobs[0].group_id))
                # fail_in=generate: mid-generation, before anything of these groups is written
                maybe_fail(
                    self.cfg.debug,
                    "generate",
                    group=jobs[0].group_id,
                    what=f"generating group {jobs[0].group_id} in collector {self.index}",
                )
                self._stats["generate_s"] += time.perf_counter() - t0
                self._stats["idle_s"] += sink.stream(jobs, batch, tags, version, self._stopped)
                self._stats["groups_written"] += len(jobs)
                consecutive_failures = 0
            except Exception as e:  # noqa: BLE001 - reported to the driver through poll()
                with self._cv:
                    self._failed.extend(j.group_id for j in jobs)
                    self._stats["put_failures"] += 1
                    consecutive_failures += 1
                    if not isinstance(e, InjectedFailure) or consecutive_failures > 3:
                        self._error = f"collector {self.index}: {type(e).__name__}: {e}"
                        return

    def _produce_partial(self) -> None:
        """Partial rollouts: one pool of responses in progress (:class:`RowPool`), drawn a stretch
        per generate call. A refit stops the call at a token boundary, and so does the pool
        running low (fewer than ``PARTIAL_MIN_RUNNING`` of its responses): unfinished responses
        then go on in the next call, under whatever weights the generator holds, together with
        new groups taking the places of finished ones. A group is delivered once all its
        responses are complete, every token labelled with the version that drew it."""
        sink = self._sink()
        seed = self.cfg.trainer.seed
        pool = RowPool(self.n)
        calls = 0
        consecutive_failures = 0
        while True:
            with self._cv:
                while not self._queue and not pool.running and not self._stop:
                    self._cv.wait(0.5)
                if self._stop:
                    return
                room = max(0, self._chunk - pool.groups())
                jobs = [self._queue.popleft() for _ in range(min(room, len(self._queue)))]
            # Complete groups leave the pool before they are written: until their write lands
            # they are only here, and a failure must report them with the pool's (else the
            # trainer's ledger waits for them for the rest of the run).
            undelivered: list[int] = []
            unstarted = [j.group_id for j in jobs]  # taken from the queue, not yet in the pool
            try:
                t_idle = time.perf_counter()
                pause = 0.005
                # Backpressure counts new groups only: rows in progress always go on.
                while (
                    not self._stop
                    and jobs
                    and sink.unconsumed_groups() + pool.groups() + len(jobs) > self._max_inflight
                ):
                    if pool.running:  # draw what is in progress; admit the new groups later
                        with self._cv:
                            self._queue.extendleft(reversed(jobs))
                        jobs, unstarted = [], []
                        break
                    time.sleep(pause)
                    pause = min(pause * 2, 0.2)
                self._stats["idle_s"] += time.perf_counter() - t_idle
                if self._stop:
                    return
                t0 = time.perf_counter()
                prompts = [self.tokenizer.encode_prompt(j.record.prompt) for j in jobs]
                limits = self._limits([j.record for j in jobs]) or [self.cfg.generation.max_new_tokens] * len(jobs)
                pool.start(jobs, prompts, limits)
                unstarted = []
                rows = list(pool.running)
                calls += 1
                out, busy = self._call(
                    [r.prefix for r in rows],
                    1,
                    continuation_seed(generation_seed(seed, self.index), calls),
                    None,
                    [r.left for r in rows],
                    True,
                    PARTIAL_MIN_RUNNING,
                )
                with self._cv:
                    self._stats["generator_busy_s"] += busy
                done = pool.absorb(rows, out.tokens, out.logprobs, out.finished, out.version)
                undelivered = [j.group_id for j, _ in done]
                self._stats["generate_s"] += time.perf_counter() - t0
                for jobs_done, prompts_done, got in batches_by_version(done):
                    maybe_fail(
                        self.cfg.debug,
                        "generate",
                        group=jobs_done[0].group_id,
                        what=f"generating group {jobs_done[0].group_id} in collector {self.index}",
                    )
                    batch, tags, version, _ = self._assemble(jobs_done, prompts_done, got)
                    self._stats["idle_s"] += sink.stream(jobs_done, batch, tags, version, self._stopped)
                    self._stats["groups_written"] += len(jobs_done)
                    written = {j.group_id for j in jobs_done}
                    undelivered = [g for g in undelivered if g not in written]
                consecutive_failures = 0
            except Exception as e:  # noqa: BLE001 - reported to the driver through poll()
                with self._cv:
                    # Everything not in the store: the groups in progress, the ones taken from the
                    # queue before they joined the pool (a failed backpressure check), and the
                    # complete ones whose write failed or did not come (a write before it failed).
                    self._failed.extend(sorted({*pool.drop(), *unstarted, *undelivered}))
                    self._stats["put_failures"] += 1
                    consecutive_failures += 1
                    if not isinstance(e, InjectedFailure) or consecutive_failures > 3:
                        self._error = f"collector {self.index}: {type(e).__name__}: {e}"
                        return

    def take(self, max_groups: int, timeout_s: float) -> list[dict[str, Any]]:
        """Pop up to ``max_groups`` finished groups the sink holds here, waiting up to ``timeout_s``
        for one (a sink that delivers to the store holds none)."""
        return self._sink().take(max_groups, timeout_s, lambda: self._error is not None)

    def poll(self) -> dict[str, Any]:
        """Failed group ids since the last poll, the producer's error (if it stopped), counters
        (cumulative: ``reward_timeouts`` counts every call past ``task.reward_timeout_s``)."""
        with self._cv:
            failed, self._failed = self._failed, []
            return {
                "failed": failed,
                "error": self._error,
                "queued": len(self._queue),
                "reward_timeouts": self.rewards.timeouts,
                "ops": self.sink.drain_ops() if self.sink is not None else [],
                **self._stats,
                **(self.sink.stats() if self.sink is not None else {}),
            }

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
        responses = self._sample(prompts, 1, seed, self.cfg.generation.val_temperature, self._limits(records)).tokens
        scores = self.rewards.score(records, responses, 1)
        return sum(scores) / len(scores)

    def loaded_modules(self) -> list[str]:
        return sorted(m for m in sys.modules if m.startswith(("nemo_dataplane", "transfer_queue")))

    def close(self) -> None:
        self.stop(5.0)
        self.rewards.close()
        if self.sink is not None:
            self.sink.close()
            self.sink = None
