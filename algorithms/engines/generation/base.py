"""The contract every generation engine keeps, and the bookkeeping they share.

An engine samples ``n`` responses per token-id prompt and returns, with each response, the
log-prob of every sampled token under the distribution it was drawn from (the behaviour
log-probs). It takes weights from the trainer as a receiver on a ``StatelessProcessGroup``
(``init_refit`` once, ``receive_weights`` per refit) and reports the weight version that drew
every batch.

One version per batch: ``generate`` and ``receive_weights`` exclude each other (one lock), so a
refit is only ever installed between two generations and a batch is labelled with the version
that produced all of it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from algorithms.config import REFIT_GROUP, TrainerConfig
from nemo_dataplane.distributed.stateless_group import StatelessProcessGroup
from nemo_dataplane.refit import WeightTransferConfig

__all__ = ["BACKENDS", "GenerationEngine", "RefitSpec", "Rollouts", "SamplingSpec"]

BACKENDS = ("hf", "vllm")


@dataclass(frozen=True)
class SamplingSpec:
    """How to sample one batch. ``temperature == 0``: greedy; ``top_p == 1``: the full distribution.

    ``limits``: each prompt's own token limit (``<= max_new_tokens``; ``None``: ``max_new_tokens``
    for all); ``ignore_eos``: responses run to their limit whatever the model emits;
    ``min_running``: an interruptible generation also stops once fewer than this fraction of
    its responses are still running (partial rollouts refill the places of finished ones);
    ``row_seeds``: one seed per response (group-major), each response drawn from its own stream
    (``seed`` is then unused), so its tokens do not depend on the batch it shares.
    """

    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int = 0
    limits: tuple[int, ...] | None = None
    ignore_eos: bool = False
    min_running: float = 0.0
    row_seeds: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if not self.max_new_tokens >= 1:  # NaN too
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not 0.0 <= self.min_running < 1.0:
            raise ValueError(f"min_running must be in [0, 1), got {self.min_running}")
        if self.limits is not None and any(not 1 <= m <= self.max_new_tokens for m in self.limits):
            raise ValueError(f"limits must be in [1, max_new_tokens={self.max_new_tokens}], got {self.limits}")
        if not self.temperature >= 0:  # NaN too
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")


@dataclass(frozen=True)
class RefitSpec:
    """How an engine joins the refit: the group's ``backend`` and its bound on every wait
    (``timeout_s``), the weight-transfer options (``transfer``: the family and its transport),
    and how many group ranks send (``senders``: ranks ``0..senders-1``; the engine is one of the
    others). ``secret``: the job secret the group's records are authenticated with, carried in
    memory only (``None``: ``$NEMO_DATAPLANE_SECRET``); never shown in a repr.
    ``tensor_parallel``: group ranks per engine (its TP ranks, from the rank it joins as; every
    engine of the group has as many)."""

    backend: str
    timeout_s: float
    transfer: WeightTransferConfig
    senders: int
    secret: str | None = dataclasses.field(default=None, repr=False)
    tensor_parallel: int = 1

    def join(self, host: str, port: int, world_size: int, rank: int, device: Any = None) -> StatelessProcessGroup:
        """Join the refit group at ``host:port`` as ``rank`` (collective): this spec's backend,
        bound and secret; ``device``: the CUDA device of an nccl group (ignored otherwise)."""
        return StatelessProcessGroup(
            host,
            port,
            rank,
            world_size,
            backend=self.backend,
            timeout=self.timeout_s,
            device=device if self.backend == "nccl" else None,
            group_name=REFIT_GROUP,
            secret=self.secret,
        )

    def to_dict(self) -> dict[str, Any]:
        """Plain values, for a transport that carries no classes (vLLM's worker RPC)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: RefitSpec | Mapping[str, Any]) -> RefitSpec:
        if isinstance(data, RefitSpec):
            return data
        return cls(
            backend=str(data["backend"]),
            timeout_s=float(data["timeout_s"]),
            transfer=WeightTransferConfig.from_dict(data["transfer"]),
            senders=int(data["senders"]),
            secret=data.get("secret"),
            tensor_parallel=int(data.get("tensor_parallel", 1)),
        )


@dataclass(frozen=True)
class Rollouts:
    """``len(prompts) * n`` responses, group-major (prompt ``i``'s at ``[i * n, (i + 1) * n)``), the
    log-prob of each sampled token (same lengths), the weight version that drew them all (``-1``
    before the first refit: the initial weights), and per response whether it is complete (it
    emitted EOS or reached its limit) or was interrupted by a refit."""

    tokens: list[list[int]]
    logprobs: list[list[float]]
    version: int
    finished: list[bool]


class GenerationEngine(ABC):
    """Base of the engines; subclasses implement ``_generate``, ``_init_refit``,
    ``_receive_weights`` and ``_shutdown``."""

    name: ClassVar[str]
    #: Whether the engine marks its progress token by token (``_beat``) while it generates, so a
    #: generation that stopped making progress shows in :meth:`progress`. ``False``: only the
    #: start and end of a generation are marked.
    beats_per_token: ClassVar[bool] = True

    def __init__(self) -> None:
        # One generation or refit at a time (_hold); a refit can interrupt a generation.
        self._cond = threading.Condition()
        self._busy = False
        self._refits_waiting = 0
        self._interrupt = threading.Event()
        self.last_refit_wait_s = 0.0  # how long the last refit waited for a generation to end or stop
        self._version = -1
        self._refit_ready = False
        self._closed = False
        # An engine that hands its GPU memory over between generations (colocated vLLM): the GPU's
        # bytes in use while it generated and once it slept, at its first sleep; None otherwise.
        self.memory_handover: tuple[int, int] | None = None
        self._refitting = False
        self._progress_at = time.monotonic()  # the last token drawn, or a generation's start or end

    def _beat(self) -> None:
        """Mark progress: a token (or an engine step) was drawn."""
        self._progress_at = time.monotonic()

    def progress(self) -> tuple[bool, float]:
        """``(refitting, monotonic time of the last progress)``: a refit holds the engine now
        (bounded by the refit's own timeout), and when the engine last drew a token or started
        or ended a generation. Safe from any thread."""
        return self._refitting, self._progress_at

    @classmethod
    def check_config(cls, cfg: TrainerConfig) -> None:
        """Refuse a config this engine cannot run (``ConfigError`` naming the key), without
        building anything; called in the driver before any worker starts."""

    @property
    def weight_version(self) -> int:
        """Version of the last refit installed (``-1``: none yet)."""
        return self._version

    @property
    def busy(self) -> bool:
        """Whether a generation or a refit holds the engine now."""
        with self._cond:
            return self._busy

    @contextlib.contextmanager
    def _hold(self, refit: bool) -> Iterator[None]:
        """The engine for one generation or refit. A refit waiting for the engine goes before any
        generation that asks after it (a collector's next call must not slip in between)."""
        with self._cond:
            if refit:
                self._refits_waiting += 1
            try:
                while self._busy or (not refit and self._refits_waiting):
                    self._cond.wait()
            finally:
                if refit:
                    self._refits_waiting -= 1
            self._busy = True
            self._refitting = refit
        self._beat()
        try:
            yield
        finally:
            self._beat()
            with self._cond:
                self._busy = self._refitting = False
                self._cond.notify_all()

    def generate(
        self,
        prompt_ids: Sequence[Sequence[int]],
        n: int,
        spec: SamplingSpec,
        *,
        interruptible: bool = False,
        version: int | None = None,
        timeout_s: float | None = None,
    ) -> Rollouts:
        """Sample ``n`` responses per prompt. A response ends with the EOS token when the model
        emitted it (unless ``spec.ignore_eos``), else it has exactly its limit of tokens. Seeded:
        the same weights, prompts and ``spec`` give the same tokens on one machine.

        ``interruptible``: a refit asked for with ``receive_weights(interrupt=True)`` stops the
        generation at the next token boundary; the responses not complete then come back as far
        as they got (``Rollouts.finished`` false), all drawn by ``Rollouts.version``.

        ``version``: draw with exactly this weight version: wait (up to ``timeout_s``) until it is
        installed; raise ``RuntimeError`` if a newer one already is, or the wait runs out.
        """
        self._check_open()
        if n < 1:
            raise ValueError(f"generate: n must be >= 1, got {n}")
        prompts = [list(map(int, p)) for p in prompt_ids]
        for i, p in enumerate(prompts):
            if not p:
                raise ValueError(f"generate: prompt {i} is empty (prepend <bos>)")
        if spec.limits is not None and len(spec.limits) != len(prompts):
            raise ValueError(f"generate: {len(spec.limits)} limits for {len(prompts)} prompts")
        if spec.row_seeds is not None and len(spec.row_seeds) != len(prompts) * n:
            raise ValueError(f"generate: {len(spec.row_seeds)} row seeds for {len(prompts)} prompts x n={n}")
        if not prompts:
            return Rollouts([], [], self._version, [])
        stop = self._interrupt.is_set if interruptible else None
        if version is not None:
            self.wait_for_version(int(version), timeout_s)
        with self._hold(refit=False):
            if version is not None and self._version != version:
                raise RuntimeError(f"{self.name} engine: asked for weight version {version}, holds {self._version}")
            version = self._version
            tokens, logprobs, finished = self._generate(prompts, n, spec, stop)
        if len(tokens) != len(prompts) * n or len(logprobs) != len(tokens) or len(finished) != len(tokens):
            raise RuntimeError(
                f"{self.name} engine returned {len(tokens)} responses / {len(logprobs)} log-prob rows / "
                f"{len(finished)} finished flags for {len(prompts)} prompts x n={n}"
            )
        for i, (t, lp) in enumerate(zip(tokens, logprobs)):
            limit = spec.max_new_tokens if spec.limits is None else spec.limits[i // n]
            if len(t) != len(lp) or len(t) > limit:
                raise RuntimeError(
                    f"{self.name} engine: response {i} has {len(t)} tokens and {len(lp)} log-probs (its limit: {limit})"
                )
        return Rollouts(tokens, logprobs, version, finished)

    def wait_for_version(self, version: int, timeout_s: float | None) -> None:
        """Return once weight ``version`` is installed (bounded by ``timeout_s``).

        Raises:
            RuntimeError: a newer version is installed already, or the wait ran out.
        """
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._cond:
            while self._version < version:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise RuntimeError(
                        f"{self.name} engine: weight version {version} did not arrive within {timeout_s:g}s "
                        f"(holds {self._version})"
                    )
                self._cond.wait(left if left is None else min(left, 1.0))
            if self._version > version:
                raise RuntimeError(
                    f"{self.name} engine: asked for weight version {version}, already holds the newer {self._version}"
                )

    def init_refit(self, host: str, port: int, world_size: int, rank: int, spec: RefitSpec) -> None:
        """Join the refit group at ``host:port`` as receiver ``rank`` and agree on the layout
        (collective with the senders' ``prepare_refit_info``): group ranks ``0..spec.senders-1``
        are the trainer's senders, whatever the weight-transfer family (``spec.transfer``). A
        name, shape or dtype mismatch raises ``RefitMismatchError`` naming the parameter(s)."""
        self._check_open()
        with self._hold(refit=True):
            self._refit_ready = False
            self._init_refit(host, int(port), int(world_size), int(rank), spec)
            self._refit_ready = True

    def receive_weights(self, *, interrupt: bool = False) -> int:
        """Receive and install one refit (collective with the sender's ``send_weights``); returns
        its version, which labels every later generation. It waits for a generation in progress
        to end, or with ``interrupt`` stops an interruptible one at its next token boundary."""
        self._check_open()
        if not self._refit_ready:
            raise RuntimeError(f"{self.name} engine: receive_weights() before init_refit()")
        if interrupt:
            self._interrupt.set()
        asked = time.perf_counter()
        try:
            with self._hold(refit=True):
                self.last_refit_wait_s = time.perf_counter() - asked
                self._interrupt.clear()
                self._version = int(self._receive_weights())
                return self._version
        finally:
            self._interrupt.clear()

    def close_refit(self) -> None:
        """Leave the refit group, after any generation or refit in progress (idempotent); a later
        ``init_refit`` joins a new one. On NCCL the trainer's ranks destroy their ends of the
        group at the same time (NCCL destroys a node's communicators together)."""
        self._check_open()
        with self._hold(refit=True):
            self._refit_ready = False
            self._close_refit()

    @abstractmethod
    def _close_refit(self) -> None: ...

    def shutdown(self) -> None:
        """Leave the refit group and stop the engine (idempotent; best effort after a failure)."""
        if self._closed:
            return
        self._closed = True
        self._shutdown()

    def __enter__(self) -> GenerationEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"{self.name} engine is shut down")

    @abstractmethod
    def _generate(
        self, prompts: list[list[int]], n: int, spec: SamplingSpec, should_stop: Callable[[], bool] | None
    ) -> tuple[list[list[int]], list[list[float]], list[bool]]:
        """Tokens, per-token log-probs and finished flags, group-major; stops at the first token
        boundary at which ``should_stop()`` is true."""

    @abstractmethod
    def _init_refit(self, host: str, port: int, world_size: int, rank: int, spec: RefitSpec) -> None:
        """Create the group and the receiver (``nemo_dataplane.refit.build_weight_receiver``) and
        run its ``prepare_refit_info``."""

    @abstractmethod
    def _receive_weights(self) -> int:
        """Receive one refit, install it, return its version."""

    @abstractmethod
    def _shutdown(self) -> None:
        """Release the group and the engine."""
