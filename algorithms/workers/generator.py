"""Generation worker (Ray actor): owns the generation engine ``generation.backend`` names
(``algorithms.engines.generation``: ``hf`` or ``vllm``), refreshed by refit after every step.

Sampling is seeded per call (``seed``), so a step's rollouts depend only on the weights and the
seed, never on what ran before; that is what makes the data-plane and legacy runs, and a resumed
run, sample the same tokens.
"""

from __future__ import annotations

import random
import time
from collections.abc import Sequence

import ray
import torch

from algorithms.config import TrainerConfig
from algorithms.engines.generation import RefitSpec, Rollouts, SamplingSpec, build_engine
from algorithms.faults import maybe_fail
from algorithms.workers.gpus import worker_device

__all__ = ["HEALTH_GROUP", "GeneratorWorker"]

# The Ray concurrency group (one thread of its own) the heartbeat runs on: created with it by
# algorithms.launch.generator_actor.
HEALTH_GROUP = "health"


class GeneratorWorker:
    """Samples ``n`` responses per prompt; receives weights over the stateless refit group.

    Args:
        cfg: the trainer config.
        index: which engine this is (the ``debug.fail_rank`` of the generator's fault points).
    """

    def __init__(self, cfg: TrainerConfig, index: int = 0) -> None:
        self.cfg = cfg
        self.index = index
        self._joined = False
        torch.set_num_threads(cfg.trainer.num_threads)
        # Makes Ray's GPU current where all are visible; colocated, that GPU becomes cuda:0, the
        # one vLLM's in-process worker takes, and the policy's GPUs stay visible (IPC events).
        self.device = worker_device(cfg.generation.device, own_first=cfg.placement.engine_gpu_first)
        self.engine = build_engine(cfg)
        self._jitter = random.Random(cfg.debug.jitter_seed)  # debug.generate_jitter_s's own stream
        self._generating_since: float | None = None  # inside a generate call, past any version wait

    def ready(self) -> bool:
        return True

    @ray.method(concurrency_group=HEALTH_GROUP)
    def heartbeat(self) -> float | None:
        """Seconds this generator has drawn nothing inside a generate call (since the call's start
        or its engine's last token, whichever is later); ``None``: nothing to judge (no call in
        flight, a refit holds the engine, or an engine that marks only a call's start and end).
        Runs on its own thread (``HEALTH_GROUP``), so it answers while a generation runs; a
        process that cannot answer it is wedged (the trainer's watch, ``algorithms.engine_pool``)."""
        since = self._generating_since
        if since is None or not self.engine.beats_per_token:
            return None
        refitting, last = self.engine.progress()
        return None if refitting else time.monotonic() - max(since, last)

    def init_refit(self, host: str, port: int, world_size: int, rank: int, secret: str | None = None) -> None:
        """Join the refit group as its receiver ``rank`` (with ``generation.tensor_parallel_size`` > 1
        its TP ranks are ``rank`` and the ones after it; collective with the policy's senders,
        group ranks ``0..refit_senders-1``); ``secret``: the job secret, handed over in memory
        (``None``: ``$NEMO_DATAPLANE_SECRET``). A member of an earlier refit group leaves it
        first: this is how the group is re-formed after an engine was lost."""
        c = self.cfg
        self._current_device()
        if self._joined:
            self.engine.close_refit()
        self._joined = True
        self.engine.init_refit(
            host,
            port,
            world_size,
            rank,
            RefitSpec(
                backend=c.refit.backend,
                timeout_s=c.refit.timeout_s,
                transfer=c.weight_transfer,
                senders=c.refit_senders,
                secret=secret,
                tensor_parallel=c.generation.tensor_parallel_size,
            ),
        )

    def receive_weights(self, version: int | None = None) -> tuple[int, float, float]:
        """Receive one refit (collective); returns ``(version, seconds receiving, seconds waited for
        a generation in flight first)``. ``version``: the one the trainer sends (only the fault
        hook reads it; the received header is what counts). With
        ``async.partial_rollout`` it stops a generation in flight at its next token boundary (the
        actor then serves two calls at once); else it waits for that generation to end."""
        maybe_fail(
            self.cfg.debug, "refit", step=version, rank=self.index, what=f"in the generator before refit {version}"
        )
        self._current_device()
        t0 = time.perf_counter()
        version = self.engine.receive_weights(interrupt=self.cfg.async_.partial_rollout)
        waited = self.engine.last_refit_wait_s
        return version, time.perf_counter() - t0 - waited, waited

    def generate(
        self,
        prompt_ids: Sequence[Sequence[int]],
        n: int,
        seed: int,
        *,
        temperature: float | None = None,
        limits: Sequence[int] | None = None,
        ignore_eos: bool = False,
        interruptible: bool = False,
        min_running: float = 0.0,
        row_seeds: Sequence[int] | None = None,
        version: int | None = None,
    ) -> tuple[Rollouts, float]:
        """``len(prompt_ids) * n`` responses (group-major) with the log-prob of each sampled token
        under the sampling distribution and the weight version that drew them all (a refit lands
        between calls, or with ``interruptible`` ends one early: unfinished responses come back
        as far as they got), and the seconds this generator was busy with the call (its own
        time, not its caller's wait for it, nor a wait for ``version``).
        ``limits``/``ignore_eos``/``min_running``/``row_seeds``: as ``SamplingSpec``; ``version``: draw
        with exactly that weight version, waiting for it (deterministic async mode)."""
        self._current_device()
        d = self.cfg.debug
        if d.generate_jitter_s:
            time.sleep(self._jitter.uniform(0.0, d.generate_jitter_s))
        if version is not None:  # a wait, not busy time
            self.engine.wait_for_version(int(version), self.cfg.trainer.step_timeout_s)
        self._generating_since = time.monotonic()
        try:
            t0 = time.perf_counter()
            if d.generate_delay_s:
                time.sleep(d.generate_delay_s)
            g = self.cfg.generation
            spec = SamplingSpec(
                max_new_tokens=g.max_new_tokens,
                temperature=float(g.temperature if temperature is None else temperature),
                top_p=g.top_p,
                seed=int(seed),
                limits=None if limits is None else tuple(int(m) for m in limits),
                ignore_eos=ignore_eos,
                min_running=min_running,
                row_seeds=None if row_seeds is None else tuple(int(s) for s in row_seeds),
            )
            out = self.engine.generate(prompt_ids, n, spec, interruptible=interruptible, version=version)
            # fail_in=generator: inside the call, its tokens drawn and not returned
            maybe_fail(
                self.cfg.debug,
                "generator",
                step=out.version,
                rank=self.index,
                what=f"in the generator generating with weight version {out.version}",
            )
            return out, time.perf_counter() - t0
        finally:
            self._generating_since = None

    def _current_device(self) -> None:
        # With partial rollouts calls arrive on several threads, and a new thread's current GPU
        # is the first visible one, not necessarily this actor's.
        if self.device.type == "cuda" and self.device.index is not None:
            torch.cuda.set_device(self.device)

    def busy(self) -> bool:
        """Whether a generation or a refit holds the engine now."""
        return self.engine.busy

    def memory_handover(self) -> tuple[int, int] | None:
        """The engine's GPU bytes in use generating and asleep at its first sleep (colocated), or None."""
        return self.engine.memory_handover

    def weight_version(self) -> int:
        """The version of the last refit installed (``-1``: the initial weights)."""
        return self.engine.weight_version

    def shutdown(self) -> None:
        self.engine.shutdown()
