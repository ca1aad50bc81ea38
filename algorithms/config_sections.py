"""The trainer config's sections: one frozen dataclass per YAML section, each default stated once
and each range check beside it (``__post_init__``; :func:`nemo_dataplane.config.build_config`
names the dotted key). :class:`algorithms.config.TrainerConfig` assembles them and checks what
spans sections.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from nemo_dataplane.config import FieldError, require_positive

__all__ = [
    "AsyncConfig",
    "CheckpointConfig",
    "DebugConfig",
    "GRPOConfig",
    "GenerationConfig",
    "LoggingConfig",
    "PolicyConfig",
    "RayConfig",
    "RefitConfig",
    "TaskConfig",
    "TrainerSection",
    "VLLMEngineConfig",
]


@dataclass(frozen=True)
class PolicyConfig:
    """The trained model and its optimizer.

    ``model`` is passed to ``algorithms.models.build_model``: either ``{"arch", "hf_config",
    "seed"}`` (random init from a transformers config, nothing downloaded) or ``{"path": dir}``
    (a local Hugging Face directory with config.json + safetensors).
    """

    model: Mapping[str, Any] = field(default_factory=dict)
    lr: float = 1e-3
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    max_grad_norm: float = 1.0
    device: Literal["cpu", "cuda"] = "cpu"
    dist_backend: Literal["gloo", "nccl"] = "gloo"  # gradient all-reduce among policy ranks
    # torch: the HF model as built; megatron: Megatron-core GPT (local spec) converted from it
    # (extra `megatron`, CUDA only; docs/megatron.md).
    backend: Literal["torch", "megatron"] = "torch"
    # megatron only: ranks per model replica; the trainer starts trainer.dp_size * this many ranks.
    tensor_parallel_size: int = 1
    # GPUs Ray gives each policy rank (cuda); None: all ranks share one GPU (1 / ranks each).
    gpus_per_rank: float | None = None
    # auto: the Hugging Face tokenizer in policy.model.path if it holds one, else the character
    # tokenizer; char: the character tokenizer; else a local directory holding a HF tokenizer
    # (algorithms/tokenizers.py decides, once).
    tokenizer: str = "auto"
    # fp32 | bf16: the weights' dtype in trainer, generator, refit and export; bf16 trains fp32
    # master weights and AdamW state (algorithms/precision.py decides what each means, once).
    precision: Literal["fp32", "bf16"] = "fp32"
    # torch only. none: every rank holds the whole model, its gradients and AdamW state (gradients
    # averaged by one all-reduce); fsdp: each decoder layer and the root are fully_shard-ed over the
    # policy ranks, so parameters, gradients and optimizer state are split trainer.dp_size ways
    # (docs/sharding.md).
    sharding: Literal["none", "fsdp"] = "none"
    # torch only: recompute each decoder layer's activations in the backward pass instead of
    # keeping them (less memory for long sequences, about a third more compute).
    activation_checkpointing: bool = False
    # The learning rate rises linearly from lr / lr_warmup_steps to lr over this many optimizer
    # steps (0: lr from the first step).
    lr_warmup_steps: int = 0

    def __post_init__(self) -> None:
        if not self.tokenizer:
            raise FieldError("tokenizer", "is empty: give auto, char or a tokenizer directory")
        require_positive(self, "lr", "tensor_parallel_size", "gpus_per_rank")
        require_positive(self, "lr_warmup_steps", allow_zero=True)
        require_positive(self, "max_grad_norm", allow_zero=True)
        if self.gpus_per_rank is not None and self.gpus_per_rank > 1 and self.gpus_per_rank != int(self.gpus_per_rank):
            raise FieldError("gpus_per_rank", f"={self.gpus_per_rank}: above 1 it must be whole")


@dataclass(frozen=True)
class VLLMEngineConfig:
    """vLLM engine settings (``generation.backend=vllm``; docs/generation.md)."""

    # null: policy.precision's dtype (the trainer's weights, which the refit sends); another
    # dtype computes in it, e.g. bfloat16 under fp32 training (log-probs then differ per token).
    dtype: Literal["float32", "bfloat16", "float16"] | None = None
    # KV cache size; explicit because vLLM's CPU default reserves 90% of host memory.
    kv_cache_memory_bytes: int = 256 << 20
    max_num_seqs: int = 256  # sequences decoded together
    enforce_eager: bool = True  # no torch.compile / CUDA graphs (start-up time)
    # false: the engine runs inside the generator process (starts faster on CPU; docs/generation.md).
    multiprocessing: bool = False
    # null: the engine runs the trainer's weights as the refit sends them. fp8 | fp8_block: the
    # trainer quantizes the decoder layers' matrices to FP8 for every refit (one scale per matrix |
    # per 128 x 128 block; about half a bf16 refit's bytes) and the engine runs FP8 weights; GPU
    # only, computing in bf16 or fp16 (algorithms/refit_weights.py, docs/generation.md).
    quantization: Literal["fp8", "fp8_block"] | None = None
    # generation.placement=colocated: what vLLM's sleep mode frees while the trainer works. 1: the
    # KV cache is freed and the weights are kept in host memory (restored before each refit);
    # 2: both freed (nothing copied; the refit rewrites every weight before the engine generates).
    sleep_level: Literal[1, 2] = 1

    def __post_init__(self) -> None:
        require_positive(self, "kv_cache_memory_bytes", "max_num_seqs")


@dataclass(frozen=True)
class GenerationConfig:
    """Sampling on the generation worker."""

    n: int = 8  # responses per prompt (the GRPO group size)
    max_new_tokens: int = 8
    temperature: float = 1.0
    val_temperature: float = 0.0  # 0: greedy validation
    device: Literal["cpu", "cuda"] = "cpu"
    backend: Literal["hf", "vllm"] = "hf"  # the engine: Hugging Face sampler or vLLM (pip extra `vllm`)
    top_p: float = 1.0  # nucleus sampling; < 1 needs backend=vllm
    vllm: VLLMEngineConfig = field(default_factory=VLLMEngineConfig)
    # GPUs Ray gives the generator (cuda); < 1 shares a GPU with policy ranks (refit: reshard/ipc).
    num_gpus: float = 1.0
    # grpo_sync: data-parallel generation engines, each its own actor (and num_gpus); a step's
    # prompts are split over them, every refit reaches all of them in one group operation, and
    # each response is drawn from its own seed where the engine allows it (hf), so the engine
    # count does not change what is sampled. grpo_async: async.num_collectors.
    num_engines: int = 1
    # Several engines (num_engines, or grpo_async's async.num_collectors): an engine found dead
    # (process killed, node lost) is dropped, its groups are generated again by the others, and a
    # replacement is started that joins at the next refit, at most max_replacements times per run
    # (algorithms/engine_pool.py).
    replace_lost: bool = True
    max_replacements: int = 4
    # When a replacement joins: "ready", at the first refit after its start-up finished (training
    # goes on with the survivors meanwhile; a vLLM engine takes tens of seconds to start); "wait",
    # at the first refit after the loss, which waits for it (the engine count is back at once).
    replacement_join: Literal["ready", "wait"] = "ready"
    # Several engines: an engine whose generator does not answer a heartbeat within this many
    # seconds (process wedged or stopped), or draws no token for as long inside a generate call
    # (hf; vLLM's is judged by its answers only), is killed and then dropped as a lost one. 0: off.
    heartbeat_timeout_s: float = 120.0
    # backend=vllm on cuda: each engine is vLLM with this tensor parallelism, one GPU per TP rank
    # (num_gpus must equal it); every TP rank receives only its shards of each refit, written
    # into vLLM's own parameters (refit.mode=reshard; docs/generation.md, "Tensor parallelism").
    tensor_parallel_size: int = 1
    # split: generators on GPUs of their own (generation.num_gpus each). colocated (grpo_sync,
    # backend=vllm): engine i shares policy rank i's GPU (num_engines = the policy's ranks; Ray gives
    # each half of that GPU); vLLM sleeps while the trainer works and wakes for the refit, which
    # is CUDA IPC on the same GPU (docs/generation.md, "Colocated placement").
    placement: Literal["split", "colocated"] = "split"

    def __post_init__(self) -> None:
        require_positive(self, "n", "max_new_tokens", "num_gpus", "num_engines", "tensor_parallel_size")
        require_positive(self, "max_replacements", "heartbeat_timeout_s", allow_zero=True)
        require_positive(self, "temperature", "val_temperature", allow_zero=True)
        if not 0 < self.top_p <= 1:
            raise ValueError(f"generation.top_p must be in (0, 1], got {self.top_p}")
        if self.top_p < 1 and self.backend != "vllm":
            raise ValueError(
                f"generation.top_p={self.top_p} needs generation.backend=vllm (the hf backend "
                "samples the full distribution)"
            )


@dataclass(frozen=True)
class GRPOConfig:
    """The algorithm."""

    prompts_per_step: int = 8
    clip_eps: float = 0.2
    kl_coef: float = 0.0
    normalize_std: bool = True
    dynamic_sampling: bool = False  # drop groups whose rewards are all equal
    loss_agg: Literal["token_mean"] = "token_mean"
    epochs: int = 1  # optimizer passes over each step's batch (>1 makes clipping bite)
    # The most one token's KL estimate (k3) may count: beyond it the token adds this constant and
    # no gradient, so a token the policy has all but ruled out cannot swamp the step
    # (algorithms/grpo.py, policy_loss). null: unclamped.
    kl_clamp: float | None = 10.0
    # The policy loss and the advantage estimator by name (algorithms/losses.py: grpo | dapo |
    # gspo; grpo | rloo). clip_eps_high: dapo's upper clip width (null: clip_eps).
    loss: Literal["grpo", "dapo", "gspo"] = "grpo"
    advantage: Literal["grpo", "rloo"] = "grpo"
    clip_eps_high: float | None = None

    def __post_init__(self) -> None:
        require_positive(self, "prompts_per_step", "clip_eps", "epochs", "kl_clamp", "clip_eps_high")
        require_positive(self, "kl_coef", allow_zero=True)


@dataclass(frozen=True)
class TaskConfig:
    """Prompts and rewards: a built-in task generated from ``seed`` or a dataset file."""

    name: str = "digit_map"
    seed: int = 0
    train_size: int = 2048
    val_size: int = 64
    # A local .jsonl (one object per line) or .parquet file; overrides the built-in task.
    dataset: str | None = None
    val_dataset: str | None = None
    prompt_key: str = "prompt"  # the dataset's field holding the prompt text
    answer_key: str = "answer"  # ... and the reference answer (a string or a number)
    # Put before every prompt: as the system turn with chat_template, else prepended as is.
    system_prompt: str | None = None
    # Render each prompt with the tokenizer's chat template (a HF tokenizer that has one).
    chat_template: bool = False
    # math | exact_match | char_match | "pkg.module:function"; None: the built-in reward of `name`.
    reward_fn: str | None = None
    # Hard bound on one reward call: the function runs in a worker process that is killed past it,
    # and the response scores 0 (counted: `reward_timeouts`; algorithms/reward_pool.py). null: call
    # it in the collector's own process, unbounded.
    reward_timeout_s: float | None = 10.0

    def __post_init__(self) -> None:
        for key in ("prompt_key", "answer_key"):
            if not getattr(self, key):
                raise FieldError(key, "is empty")
        require_positive(self, "train_size", "reward_timeout_s")
        require_positive(self, "val_size", allow_zero=True)


@dataclass(frozen=True)
class TrainerSection:
    """The step loop."""

    steps: int = 60
    seed: int = 1
    dp_size: int = 2
    num_threads: int = 1  # torch threads per worker; 1 makes runs bitwise repeatable
    val_every: int = 10  # 0: no periodic validation
    step_timeout_s: float = 600.0  # bound on every wait for a worker inside a step
    startup_timeout_s: float = 300.0  # bound on worker start-up (model build, groups)
    # How the per-step calls reach the policy ranks (algorithms/dispatch.py): plain actor calls,
    # or one Ray Compiled Graph compiled after the first step (falls back to actor calls if it
    # cannot serve; its idle workers poll, see docs/grpo_sync.md "Dispatch").
    dispatch: Literal["actors", "compiled_graph"] = "actors"
    # compiled_graph only: tear the graph down after this many seconds without a call (its idle
    # ranks stop polling) and recompile it on the next call; null: keep it until shutdown.
    dispatch_idle_teardown_s: float | None = 30.0

    def __post_init__(self) -> None:
        require_positive(
            self, "steps", "dp_size", "num_threads", "step_timeout_s", "startup_timeout_s", "dispatch_idle_teardown_s"
        )
        require_positive(self, "val_every", allow_zero=True)


@dataclass(frozen=True)
class LoggingConfig:
    """What the user sees."""

    output_dir: str = "runs/grpo_tiny"
    progress: bool = True  # tqdm bar on stderr
    tensorboard: bool = False
    plot: bool = True  # reward/loss PNG at the end
    quiet: bool = False  # no per-step lines or banner (the bar and summary stay)
    # true: a fresh run deletes another run's results in output_dir (and its checkpoints) first;
    # false: such a run is refused (algorithms/run_dir.py).
    overwrite: bool = False
    # keys_outstanding is the rollouts' count every step; every this many steps (and at exit) it
    # is a listing of the whole store instead. 0: at exit only.
    audit_every: int = 10
    # The driver serves Prometheus metrics at http://prometheus_host:prometheus_port/metrics
    # (algorithms/exporter.py; needs prometheus-client, extra `metrics`). None: off; 0: a free
    # port, printed at start. The host is loopback unless set otherwise.
    prometheus_port: int | None = None
    prometheus_host: str = "127.0.0.1"
    # Weights & Biases: every step's numbers, as in metrics.jsonl (needs wandb; WANDB_MODE=offline
    # writes the run under output_dir/wandb only).
    wandb: bool = False
    wandb_project: str = "nemo-dataplane"

    def __post_init__(self) -> None:
        require_positive(self, "audit_every", allow_zero=True)
        if self.prometheus_port is not None and not 0 <= self.prometheus_port <= 65535:
            raise FieldError("prometheus_port", f"={self.prometheus_port} is not a TCP port (0-65535; 0 picks one)")


@dataclass(frozen=True)
class CheckpointConfig:
    """Checkpoints: how often, where, how many are kept, and resuming from one.

    A checkpoint holds the policy, optimizer, step, RNG and data position, every ``every`` steps;
    with ``export_hf`` also a Hugging Face directory of the policy (policy rank 0)."""

    every: int = 0  # 0: never
    dir: str | None = None  # None: {logging.output_dir}/checkpoints
    resume: str | None = None  # a checkpoint dir, or "latest" under `dir`
    keep: int = 0  # 0: keep all
    # true: a resume may change the keys algorithms.run_dir.SAFE_ON_RESUME lists (lr, steps, ...);
    # the model, the task and the saved state's layout never change.
    allow_config_change: bool = False
    # Also write the policy (in its precision) and tokenizer as a Hugging Face directory:
    # {logging.output_dir}/hf/step_XXXXXX at each checkpoint and hf/final at the end.
    export_hf: bool = False

    def __post_init__(self) -> None:
        require_positive(self, "every", "keep", allow_zero=True)


@dataclass(frozen=True)
class RefitConfig:
    """Trainer -> generator weights after every step over a stateless process group."""

    backend: Literal["gloo", "nccl"] = "gloo"
    # packed: policy rank 0 broadcasts whole weights (nemo_dataplane/refit/packed/); reshard: every
    # TP rank of the first replica sends its shards to the generator's layout (refit/reshard/);
    # auto: reshard when policy.tensor_parallel_size > 1, else packed.
    mode: Literal["auto", "packed", "reshard"] = "auto"
    # reshard only: ipc (CUDA, one host: copies into the generator's tensors, the group carries
    # control only), p2p (send/recv over the group), auto (ipc where every pair can).
    transport: Literal["auto", "p2p", "ipc"] = "auto"
    bucket_bytes: int = 8 << 20
    host: str = "127.0.0.1"  # used only with a fixed port
    port: int = 0  # 0: policy rank 0 hosts the rendezvous on its node's address and a port it binds
    timeout_s: float = 300.0

    def __post_init__(self) -> None:
        require_positive(self, "bucket_bytes", "timeout_s")
        require_positive(self, "port", allow_zero=True)


@dataclass(frozen=True)
class RayConfig:
    """The Ray cluster the trainer starts (or joins)."""

    address: str | None = None  # None: start a local cluster owned by this run
    num_cpus: int = 8  # logical CPUs of a local cluster; actors ask for fractions of them
    worker_num_cpus: float = 0.0  # per worker actor

    def __post_init__(self) -> None:
        require_positive(self, "num_cpus")
        require_positive(self, "worker_num_cpus", allow_zero=True)


@dataclass(frozen=True)
class AsyncConfig:
    """``grpo_async`` only: how far generation may run ahead of training (YAML key ``async``).

    ``max_staleness`` bounds, in weight versions, how old a trained group may be (0: on-policy);
    admission keeps at most ``(max_staleness + 1) * grpo.prompts_per_step`` groups handed out
    and untrained, and a claimed group older than that is dropped and regenerated.
    ``max_inflight_groups`` (backpressure): groups written and not yet claimed by the trainer
    before a collector waits; ``null`` = ``(max_staleness + 1) * grpo.prompts_per_step``.
    ``groups_per_generation``: groups one generate call draws as one batch. ``auto`` (default):
    a step's groups split evenly over the collectors, ``ceil(prompts_per_step / num_collectors)``,
    within ``max_inflight_groups``, i.e. the sync trainer's batch. Smaller generations draw with
    fresher weights (a refit can land between them) but give the generator smaller batches.
    ``is_cap``/``is_mode``: the off-policy correction's cap on the proximal/behaviour weight and
    whether a weight above it is truncated to the cap or its token masked.
    ``mode``: ``free`` (a group is drawn by whatever weights the generator holds) or
    ``deterministic`` (step ``s``'s groups are drawn by weight version ``max(0, s - max_staleness)``
    exactly, per-sample seeds, canonical order: a run is reproducible bit for bit;
    docs/grpo_async.md). Deterministic mode refuses ``partial_rollout`` and the vLLM backend.
    """

    max_staleness: int = 1
    max_inflight_groups: int | None = None
    groups_per_generation: int | Literal["auto"] = "auto"
    num_collectors: int = 1
    # Generations in flight when new weights arrive stop at a token boundary, keep their tokens
    # and behaviour log-probs, and continue under the new version (docs/grpo_async.md).
    partial_rollout: bool = False
    is_cap: float = 2.0
    is_mode: Literal["truncate", "mask"] = "truncate"
    claim_poll_s: float = 1.0  # longest single claim wait; collectors are checked in between
    mode: Literal["free", "deterministic"] = "free"

    def __post_init__(self) -> None:
        require_positive(self, "num_collectors", "is_cap", "claim_poll_s", "max_inflight_groups")
        if self.mode == "deterministic" and self.partial_rollout:
            raise FieldError(
                "partial_rollout",
                "=true cannot run with async.mode=deterministic: a refit interrupts a generation at a "
                "moment set by timing, so which version draws a token would vary from run to run",
            )
        if self.groups_per_generation != "auto":
            require_positive(self, "groups_per_generation")
        require_positive(self, "max_staleness", allow_zero=True)
        if (
            self.max_inflight_groups is not None
            and self.groups_per_generation != "auto"
            and self.max_inflight_groups < self.groups_per_generation
        ):
            raise FieldError(
                "max_inflight_groups",
                f"={self.max_inflight_groups} is below async.groups_per_generation="
                f"{self.groups_per_generation}: a collector could never write a generation",
            )

    def inflight_groups(self, groups_per_step: int) -> int:
        """Groups written and not yet claimed before a collector waits."""
        return self.max_inflight_groups or (self.max_staleness + 1) * groups_per_step

    def generation_groups(self, groups_per_step: int) -> int:
        """Groups one generate call draws: ``groups_per_generation`` resolved (``auto``: a step's
        groups over the collectors, within the in-flight limit)."""
        if self.groups_per_generation != "auto":
            return self.groups_per_generation
        return min(-(-groups_per_step // self.num_collectors), self.inflight_groups(groups_per_step))


@dataclass(frozen=True)
class DebugConfig:
    """Fault injection and injected delays, for tests.

    :mod:`algorithms.faults`: the named phase fails on ``fail_at_step`` (``put``: the collector's
    write of group ``fail_at_group`` fails half-way, async only), by raising or, with
    ``fail_mode=sigkill``, by the process killing itself, or with ``fail_mode=hang`` by going
    silent (every point is listed in :mod:`algorithms.faults`); ``fail_dispatch_compile``: the
    compiled graph's compile raises as in an unsupported environment, so the run falls back to
    actor calls (``trainer.dispatch=compiled_graph``)."""

    fail_at_step: int | None = None
    fail_in: (
        Literal[
            "collect",
            "generate",
            "logprobs",
            "train",
            "put",
            "reward",
            "generator",
            "refit",
            "store_controller",
            "store_unit",
        ]
        | None
    ) = None
    fail_rank: int = 0
    fail_at_group: int | None = None
    fail_dispatch_compile: bool = False  # trainer.dispatch=compiled_graph: the compile raises (fallback test)
    fail_mode: Literal["raise", "sigkill", "hang"] = "raise"
    fault_marker: str | None = None  # a file the hook writes the injection time to (chaos tests)
    # Injected work (tests of the step accounting): seconds each generate call / each policy
    # train call sleeps, counted as that side's busy time.
    generate_delay_s: float = 0.0
    train_delay_s: float = 0.0
    # Each generate call also sleeps a random time in [0, generate_jitter_s), drawn from its own
    # stream seeded jitter_seed (reproducibility tests: two runs, different timing).
    generate_jitter_s: float = 0.0
    jitter_seed: int = 0
    # Seconds the hf sampler sleeps after every token (a slow generator whose generations a refit
    # can land in the middle of: tests of partial rollouts).
    token_delay_s: float = 0.0

    def __post_init__(self) -> None:
        require_positive(
            self, "generate_delay_s", "train_delay_s", "token_delay_s", "generate_jitter_s", allow_zero=True
        )
