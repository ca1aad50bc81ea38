"""Trainer configuration: YAML + dotted command-line overrides -> a validated, typed config.

``load_config(path, overrides)`` merges ``overrides`` (``"grpo.kl_coef=0.01"``) into the YAML with
OmegaConf, then builds :class:`TrainerConfig`. Every section is a frozen dataclass whose
defaults are documented here once; an unknown key, a wrong type or an invalid value raises
:class:`ConfigError` naming the dotted key at fault. The ``data_plane`` section is
:class:`nemo_dataplane.config.DataPlaneConfig`, validated by its own rules.

Sections ``policy``, ``generation``, ``grpo`` and ``task`` hold the learning hyperparameters;
``trainer``, ``checkpoint``, ``refit``, ``ray``, ``logging`` and ``debug`` hold the plumbing.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import torch
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from algorithms.config_sections import (
    AsyncConfig,
    CheckpointConfig,
    DebugConfig,
    GenerationConfig,
    GRPOConfig,
    LoggingConfig,
    PolicyConfig,
    RayConfig,
    RefitConfig,
    TaskConfig,
    TrainerSection,
    VLLMEngineConfig,
)
from algorithms.placement import Placement, placement_of
from algorithms.rewards import BUILTIN_REWARDS
from algorithms.tasks import DATASET_FORMATS
from nemo_dataplane.config import (
    BUILTIN_BACKENDS,
    ConfigError,
    DataPlaneConfig,
    build_config,
    config_key,
    plain,
)
from nemo_dataplane.refit.config import WeightTransferConfig

__all__ = [
    "AsyncConfig",
    "CheckpointConfig",
    "ConfigError",
    "DebugConfig",
    "GRPOConfig",
    "GenerationConfig",
    "LoggingConfig",
    "PolicyConfig",
    "REFIT_GROUP",
    "RayConfig",
    "RefitConfig",
    "TaskConfig",
    "TrainerConfig",
    "TrainerSection",
    "VLLMEngineConfig",
    "check_devices",
    "check_sync_only",
    "load_config",
]

# The refit group's name in its rendezvous store: its senders and receivers join under it, and
# the driver posts its abort there (nemo_dataplane.distributed.abort).
REFIT_GROUP = "refit"


@dataclass(frozen=True)
class TrainerConfig:
    """The whole trainer config (see the module docstring for the sections)."""

    policy: PolicyConfig = field(default_factory=PolicyConfig)
    generation: GenerationConfig = field(default_factory=GenerationConfig)
    grpo: GRPOConfig = field(default_factory=GRPOConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    trainer: TrainerSection = field(default_factory=TrainerSection)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    refit: RefitConfig = field(default_factory=RefitConfig)
    ray: RayConfig = field(default_factory=RayConfig)
    debug: DebugConfig = field(default_factory=DebugConfig)
    data_plane: DataPlaneConfig = field(default_factory=DataPlaneConfig)
    async_: AsyncConfig = field(default_factory=AsyncConfig, metadata={"key": "async"})

    def to_dict(self) -> dict[str, Any]:
        """Plain nested dict; ``TrainerConfig.from_dict(cfg.to_dict()) == cfg``."""
        return plain(
            {
                config_key(f): getattr(self, f.name)
                if not dataclasses.is_dataclass(getattr(self, f.name))
                else dataclasses.asdict(getattr(self, f.name))
                for f in dataclasses.fields(self)
            }
        )

    @property
    def policy_ranks(self) -> int:
        """Policy actors the trainer starts: ``trainer.dp_size`` replicas of ``tensor_parallel_size``."""
        return self.trainer.dp_size * self.policy.tensor_parallel_size

    @property
    def fully_sharded(self) -> bool:
        """``policy.sharding=fsdp``: each policy rank holds ``1 / trainer.dp_size`` of the model."""
        return self.policy.sharding == "fsdp"

    @property
    def refit_mode(self) -> str:
        """``refit.mode`` resolved: ``reshard`` or ``packed``."""
        if self.refit.mode != "auto":
            return self.refit.mode
        sharded = self.policy.tensor_parallel_size > 1 or self.fully_sharded or self.generation.tensor_parallel_size > 1
        return "reshard" if sharded or self.placement.needs_reshard else "packed"

    @property
    def refit_senders(self) -> int:
        """Policy ranks that send each refit, group ranks ``0..n-1`` (group rank = policy rank):
        every rank under ``policy.sharding=fsdp`` (each sends its shards), the first replica's TP
        ranks for another reshard, else policy rank 0 alone (whole weights)."""
        if self.refit_mode != "reshard":
            return 1
        return self.trainer.dp_size if self.fully_sharded else self.policy.tensor_parallel_size

    @property
    def weight_transfer(self) -> WeightTransferConfig:
        """The library's weight-transfer options for this run (``refit.mode`` resolved to a family,
        the senders' split from ``policy.sharding``)."""
        return WeightTransferConfig(
            family=self.refit_mode,
            transport=self.refit.transport,
            bucket_bytes=self.refit.bucket_bytes,
            sender_layout="fsdp" if self.fully_sharded else "tp",
        )

    @property
    def reshard_may_use_ipc(self) -> bool:
        """A resharding refit whose transport may be CUDA IPC (``ipc``, or ``auto`` on one host)."""
        return self.refit_mode == "reshard" and self.refit.transport != "p2p"

    @property
    def placement(self) -> Placement:
        """``generation.placement`` as the object everyone asks (:mod:`algorithms.placement`)."""
        return placement_of(self.generation)

    def policy_gpus_per_rank(self) -> float:
        """GPUs Ray gives each policy rank (0 on CPU)."""
        return self.placement.policy_gpus(self.policy, self.policy_ranks) if self.policy.device == "cuda" else 0.0

    def generator_gpus(self) -> float:
        """GPUs Ray gives each generator actor (0 on CPU)."""
        return self.placement.generator_gpus(self.generation) if self.generation.device == "cuda" else 0.0

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> TrainerConfig:
        """Validate a nested mapping. Raises :class:`ConfigError` naming the dotted key."""
        cfg = build_config(cls, data, "")
        _cross_checks(cfg)
        return cfg


def _cross_checks(cfg: TrainerConfig) -> None:
    _ = cfg.weight_transfer  # the library's own checks of the refit options (ConfigError names refit.*)
    if not cfg.policy.model:
        raise ConfigError("policy.model is empty: give {arch, hf_config, seed} or {path: /local/hf/dir}")
    if cfg.policy.model.get("path") not in (None, "") and cfg.policy.model.get("hf_config") is not None:
        raise ConfigError(
            "policy.model has both path and hf_config; give one (e.g. add policy.model.hf_config=null "
            "to load policy.model.path)"
        )
    if cfg.policy.model.get("path") not in (None, ""):
        p = Path(str(cfg.policy.model["path"])).expanduser()
        if not (p / "config.json").is_file():
            raise ConfigError(f"policy.model.path={str(p)!r} has no config.json (a local Hugging Face directory)")
    batch = cfg.grpo.prompts_per_step * cfg.generation.n
    if batch < cfg.trainer.dp_size:
        raise ConfigError(
            f"grpo.prompts_per_step * generation.n = {batch} samples cannot feed trainer.dp_size="
            f"{cfg.trainer.dp_size} ranks"
        )
    if cfg.grpo.dynamic_sampling and cfg.generation.n < 2:
        raise ConfigError("grpo.dynamic_sampling needs generation.n >= 2 (groups of one always have equal rewards)")
    for key, val in (("task.dataset", cfg.task.dataset), ("task.val_dataset", cfg.task.val_dataset)):
        if val is not None and not Path(val).expanduser().is_file():
            raise ConfigError(f"{key}={val!r} is not a file")
    if cfg.task.reward_fn is not None and cfg.task.reward_fn not in BUILTIN_REWARDS and ":" not in cfg.task.reward_fn:
        raise ConfigError(
            f"task.reward_fn must be one of {list(BUILTIN_REWARDS)} or look like 'pkg.module:function', "
            f"got {cfg.task.reward_fn!r}"
        )
    for key, val in (("task.dataset", cfg.task.dataset), ("task.val_dataset", cfg.task.val_dataset)):
        if val is not None and Path(val).suffix.lower() not in DATASET_FORMATS:
            raise ConfigError(f"{key}={val!r}: expected a file ending in one of {list(DATASET_FORMATS)}")
    if cfg.debug.fail_in in ("put", "generate", "reward"):
        if cfg.debug.fail_at_group is None:
            raise ConfigError(f"debug.fail_in={cfg.debug.fail_in} needs debug.fail_at_group")
    elif cfg.debug.fail_in is not None and cfg.debug.fail_at_step is None:
        raise ConfigError("debug.fail_in is set but debug.fail_at_step is not")
    if cfg.debug.fail_in in ("store_controller", "store_unit") and not (
        cfg.data_plane.enabled and cfg.data_plane.backend == "transfer_queue"
    ):
        raise ConfigError(f"debug.fail_in={cfg.debug.fail_in} needs data_plane.enabled and backend=transfer_queue")
    _check_max_rows(cfg)
    _check_placement(cfg)  # before the refit checks: its error names the placement
    if cfg.refit.backend == "nccl" and (cfg.policy.device != "cuda" or cfg.generation.device != "cuda"):
        raise ConfigError("refit.backend=nccl needs policy.device=cuda and generation.device=cuda")
    reshard_ipc = cfg.reshard_may_use_ipc
    if cfg.refit.backend == "gloo" and "cuda" in (cfg.policy.device, cfg.generation.device) and not reshard_ipc:
        # The gloo group moves CPU tensors only; both ends hand it their parameters in place.
        key = "policy.device" if cfg.policy.device == "cuda" else "generation.device"
        raise ConfigError(
            f"refit.backend=gloo moves CPU tensors but {key}=cuda: use refit.backend=nccl with "
            "both devices on cuda, refit.mode=reshard with refit.transport=ipc (one host), or "
            "both devices on cpu"
        )
    if cfg.refit.transport == "ipc" and not (
        cfg.refit_mode == "reshard" and cfg.policy.device == "cuda" == cfg.generation.device
    ):
        raise ConfigError(
            "refit.transport=ipc needs refit.mode=reshard (or policy.tensor_parallel_size > 1) "
            "and policy.device=cuda and generation.device=cuda"
        )
    if (
        cfg.refit.backend == "nccl"
        and cfg.generation.device == "cuda"
        and cfg.generation.num_gpus < 1
        and not reshard_ipc
    ):
        # A fractional generator shares a GPU with policy ranks; NCCL refuses two ranks on one device.
        raise ConfigError(
            f"generation.num_gpus={cfg.generation.num_gpus:g} shares a GPU with the policy, which "
            "NCCL cannot refit across: use refit.mode=reshard with refit.transport=ipc"
        )
    quant = cfg.generation.vllm.quantization
    if quant is not None and (cfg.generation.backend != "vllm" or cfg.generation.device != "cuda"):
        raise ConfigError(
            f"generation.vllm.quantization={quant} needs generation.backend=vllm and generation.device=cuda "
            "(the engine runs FP8 weights with vLLM's GPU kernels)"
        )
    if cfg.policy.backend == "torch" and cfg.policy.tensor_parallel_size != 1:
        raise ConfigError(
            f"policy.tensor_parallel_size={cfg.policy.tensor_parallel_size} needs policy.backend=megatron "
            "(the torch worker is data-parallel only)"
        )
    _check_sharding(cfg)
    _check_generation_tp(cfg)
    if cfg.policy.backend == "megatron":
        if cfg.policy.device != "cuda":
            raise ConfigError("policy.backend=megatron needs policy.device=cuda")
        tp = cfg.policy.tensor_parallel_size
        if tp > 1 and cfg.refit_mode != "reshard":
            raise ConfigError(
                f"policy.tensor_parallel_size={tp} needs refit.mode=reshard (or auto): the packed "
                "refit sends whole weights from one rank, which holds 1/TP of them"
            )
    if (
        cfg.policy.dist_backend == "nccl"
        and cfg.policy.device == "cuda"
        and cfg.policy_ranks > 1
        and cfg.policy_gpus_per_rank() <= 0.5
        and cfg.generation.placement != "colocated"  # each rank has a GPU of its own, shared with an engine only
    ):
        # NCCL refuses two ranks of one communicator on one device; above half a GPU each, Ray
        # cannot put two policy ranks on one.
        raise ConfigError(
            f"policy.dist_backend=nccl with {cfg.policy_ranks} policy ranks sharing GPUs (policy."
            f"gpus_per_rank={cfg.policy_gpus_per_rank():g}): give each more than 0.5 or set "
            "policy.dist_backend=gloo"
        )
    if cfg.policy.dist_backend == "nccl" and cfg.policy.device != "cuda":
        raise ConfigError("policy.dist_backend=nccl needs policy.device=cuda")
    if cfg.data_plane.enabled:
        check_backend(cfg.data_plane.backend)


def _check_sharding(cfg: TrainerConfig) -> None:
    """``policy.sharding`` and ``policy.activation_checkpointing`` against the engine and refit."""
    p = cfg.policy
    if p.backend == "megatron":
        if cfg.fully_sharded:
            raise ConfigError(
                "policy.sharding=fsdp needs policy.backend=torch: Megatron shards the model itself "
                "(policy.tensor_parallel_size)"
            )
        if p.activation_checkpointing:
            raise ConfigError("policy.activation_checkpointing=true needs policy.backend=torch")
    if cfg.fully_sharded and p.device == "cuda" and p.dist_backend != "nccl":
        raise ConfigError(
            "policy.sharding=fsdp with policy.device=cuda needs policy.dist_backend=nccl: the shards are "
            "gathered and reduced on the GPUs"
        )
    if cfg.fully_sharded and cfg.refit_mode != "reshard":
        raise ConfigError(
            f"policy.sharding=fsdp needs refit.mode=reshard (or auto), not refit.mode={cfg.refit.mode}: the packed "
            "refit sends whole weights from one rank, which holds 1/trainer.dp_size of them"
        )


def _check_generation_tp(cfg: TrainerConfig) -> None:
    """``generation.tensor_parallel_size`` against the engine, its GPUs, the refit and the model."""
    g = cfg.generation
    tp = g.tensor_parallel_size
    if tp == 1:
        return
    key = f"generation.tensor_parallel_size={tp}"
    if g.backend != "vllm" or g.device != "cuda":
        raise ConfigError(
            f"{key} needs generation.backend=vllm and generation.device=cuda (vLLM's own tensor parallelism)"
        )
    if g.num_gpus != tp:
        raise ConfigError(f"{key} needs generation.num_gpus={tp} (one GPU per TP rank), got {g.num_gpus:g}")
    if cfg.refit_mode != "reshard":
        raise ConfigError(
            f"{key} needs refit.mode=reshard (or auto), not refit.mode={cfg.refit.mode}: each TP rank "
            "receives only its shards, which the packed refit cannot address"
        )
    if g.vllm.quantization is not None:
        raise ConfigError(
            f"{key} with generation.vllm.quantization={g.vllm.quantization}: an FP8 refit is installed "
            "through vLLM's loader from whole tensors; use tensor_parallel_size=1 for FP8 generation"
        )
    hf = cfg.policy.model.get("hf_config") or {}
    for name in ("num_attention_heads", "num_key_value_heads", "intermediate_size"):
        val = hf.get(name, hf.get("num_attention_heads") if name == "num_key_value_heads" else None)
        if val is not None and int(val) % tp:
            raise ConfigError(
                f"policy.model.hf_config.{name}={val} is not divisible by {key}: each TP rank holds "
                "an equal share of it"
            )


def _check_placement(cfg: TrainerConfig) -> None:
    """``generation.placement=colocated`` against the devices, the engine, the engine count and
    the refit (grpo_async refuses it itself: :func:`check_sync_only`)."""
    if cfg.generation.placement != "colocated":
        return
    g, key = cfg.generation, "generation.placement=colocated"
    if cfg.policy.device != "cuda" or g.device != "cuda" or g.backend != "vllm":
        raise ConfigError(
            f"{key} needs policy.device=cuda, generation.device=cuda and generation.backend=vllm "
            "(vLLM's sleep mode hands the GPU's memory to the trainer between generations)"
        )
    if g.tensor_parallel_size != 1:
        raise ConfigError(
            f"{key} with generation.tensor_parallel_size={g.tensor_parallel_size}: each policy rank's "
            "GPU holds one whole engine; use tensor_parallel_size=1"
        )
    if g.num_engines != cfg.policy_ranks:
        raise ConfigError(
            f"{key} puts one engine on each policy rank's GPU: set generation.num_engines="
            f"{cfg.policy_ranks} (the policy's ranks), got {g.num_engines}"
        )
    if cfg.policy.gpus_per_rank is not None or g.num_gpus != 1.0:
        raise ConfigError(
            f"{key} gives each policy rank and its engine half of one GPU: leave policy.gpus_per_rank "
            "and generation.num_gpus unset"
        )
    if cfg.refit.backend != "gloo" or cfg.refit_mode != "reshard" or cfg.refit.transport == "p2p":
        raise ConfigError(
            f"{key} refits over CUDA IPC on the shared GPU, with a gloo group carrying control only (NCCL "
            "refuses two ranks on one GPU): use refit.backend=gloo, refit.mode=reshard (or auto) and "
            "refit.transport=ipc (or auto)"
        )
    if g.vllm.quantization is not None:
        raise ConfigError(
            f"{key} with generation.vllm.quantization={g.vllm.quantization}: an FP8 refit is installed "
            "through vLLM's loader from the packed refit; use placement=split for FP8 generation"
        )


def check_sync_only(cfg: TrainerConfig) -> None:
    """What only ``grpo_sync`` runs, refused by ``grpo_async`` at config load, naming the key."""
    if cfg.generation.placement == "colocated":
        raise ConfigError(
            "generation.placement=colocated runs with grpo_sync only: asynchronous GRPO generates while "
            "the trainer trains, so each needs its own GPUs (use placement=split)"
        )


def _check_max_rows(cfg: TrainerConfig) -> None:
    """``data_plane.max_rows`` must hold one step's batch, or no step could ever be stored.
    (``grpo_async`` needs a little more: :func:`async_min_rows`, checked by its trainer.)"""
    cap = cfg.data_plane.max_rows
    if cap is None or not cfg.data_plane.enabled:
        return
    batch = cfg.grpo.prompts_per_step * cfg.generation.n
    if cap < batch:
        raise ConfigError(
            f"data_plane.max_rows={cap} is below one step's batch (grpo.prompts_per_step * "
            f"generation.n = {batch} rows): no step could ever be stored"
        )


def async_min_rows(cfg: TrainerConfig) -> int:
    """The least ``data_plane.max_rows`` the async trainer can progress with: while it holds
    ``G - 1`` claimed groups and waits for one more, one collector's put of
    ``async.groups_per_generation`` groups must still fit."""
    G = cfg.grpo.prompts_per_step
    return (G + cfg.async_.generation_groups(G) - 1) * cfg.generation.n


def check_backend(backend: str, *, needs_claims: bool = False) -> None:
    """Refuse a data-plane backend the trainer cannot use, naming ``data_plane.backend``: the
    in-process ``memory`` store, and a custom class that does not import, is not a
    ``DataPlaneClient``, leaves abstract methods unimplemented or (``needs_claims``: the async
    trainer) has no claims (:func:`nemo_dataplane.factory.resolve_backend` decides)."""
    if backend == "memory":
        raise ConfigError(
            "data_plane.backend=memory is one private store per process, but the trainer's driver, "
            "policy ranks and collectors are separate processes (Ray actors) and would each see an "
            "empty store; use data_plane.backend=transfer_queue or a shared 'pkg.module:Class' backend"
        )
    if backend in BUILTIN_BACKENDS:
        # Known by name (each has claims): importing transfer_queue (and Ray) just to validate a
        # config would slow every load, and a missing dependency is reported by the factory with
        # an install hint.
        return
    from nemo_dataplane.factory import resolve_backend  # only on the data-plane path

    try:
        resolve_backend(backend, needs_claims=needs_claims)
    except (ImportError, ValueError) as e:
        msg = str(e)
        raise ConfigError(msg if "data_plane.backend" in msg else f"data_plane.backend={backend!r}: {msg}") from e


def check_devices(cfg: TrainerConfig, cuda_devices: int | None = None, generators: int = 1) -> None:
    """Refuse, before Ray starts, CUDA placements that a local cluster cannot satisfy.

    Only for a cluster this run starts itself (``ray.address`` unset): a remote cluster's GPUs are
    not visible from the driver. ``cuda_devices``: the count to check against (default: this
    machine's); ``generators``: how many generator actors the trainer starts (one per collector).
    Raises :class:`ConfigError` naming the key at fault.
    """
    if cfg.ray.address:
        return
    if cuda_devices is None:
        cuda_devices = torch.cuda.device_count()
    for key, device in (("policy.device", cfg.policy.device), ("generation.device", cfg.generation.device)):
        if device == "cuda" and cuda_devices == 0:
            raise ConfigError(f"{key}=cuda but this machine has no CUDA device (and ray.address is unset)")
    if cfg.refit.backend == "nccl" and cuda_devices < 1:
        raise ConfigError("refit.backend=nccl needs CUDA devices; this machine has none")
    need = cfg.policy_ranks * cfg.policy_gpus_per_rank()
    need += generators * cfg.generator_gpus()
    if need > cuda_devices + 1e-9:
        raise ConfigError(
            f"policy.device={cfg.policy.device} and generation.device={cfg.generation.device} need "
            f"{math.ceil(need - 1e-9)} CUDA devices ({cfg.policy_ranks} policy rank(s) x policy.gpus_per_rank="
            f"{cfg.policy_gpus_per_rank():g} + {generators} generator(s) x generation.num_gpus="
            f"{cfg.generator_gpus():g}); this machine has "
            f"{cuda_devices}"
        )


# --------------------------------------------------------------------------- loading
def load_config(path: str | Path | None = None, overrides: Sequence[str] = ()) -> TrainerConfig:
    """Read YAML ``path`` (optional), apply ``overrides`` (``dotted.key=value``), validate.

    Raises:
        ConfigError: a malformed override, an unknown key or an invalid value (names the key).
        FileNotFoundError: ``path`` does not exist.
    """
    base: Any = OmegaConf.create({})
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise FileNotFoundError(f"config file {str(p)!r} not found")
        base = OmegaConf.load(p)
    for item in overrides:
        if "=" not in item or item.startswith("="):
            raise ConfigError(f"override {item!r} must look like dotted.key=value")
    try:
        merged = OmegaConf.merge(base, OmegaConf.from_dotlist(list(overrides)))
        data = OmegaConf.to_container(merged, resolve=True)
    except OmegaConfBaseException as e:
        raise ConfigError(f"cannot apply overrides {list(overrides)}: {e}") from e
    if data is not None and not isinstance(data, Mapping):
        raise ConfigError(f"the config must be a mapping of sections, got {type(data).__name__}")
    return TrainerConfig.from_dict(cast(Mapping[str, Any], data or {}))
