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
import types
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from nemo_dataplane.config import DataPlaneConfig


class ConfigError(ValueError):
    """A config key is unknown, mistyped or invalid; the message names its dotted path."""


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


@dataclass(frozen=True)
class GenerationConfig:
    """Sampling on the generation worker."""

    n: int = 8  # responses per prompt (the GRPO group size)
    max_new_tokens: int = 8
    temperature: float = 1.0
    val_temperature: float = 0.0  # 0: greedy validation
    device: Literal["cpu", "cuda"] = "cpu"


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


@dataclass(frozen=True)
class TaskConfig:
    """Prompts and rewards: a built-in task generated from ``seed`` or a JSONL dataset."""

    name: str = "digit_map"
    seed: int = 0
    train_size: int = 2048
    val_size: int = 64
    dataset: str | None = None  # JSONL with {"prompt", "answer"} per line; overrides the built-in
    val_dataset: str | None = None
    reward_fn: str | None = None  # "pkg.module:function"; None: the built-in reward of `name`


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


@dataclass(frozen=True)
class LoggingConfig:
    """What the user sees."""

    output_dir: str = "runs/grpo_tiny"
    progress: bool = True  # tqdm bar on stderr
    tensorboard: bool = False
    plot: bool = True  # reward/loss PNG at the end
    quiet: bool = False  # no per-step lines or banner (the bar and summary stay)


@dataclass(frozen=True)
class CheckpointConfig:
    """Policy + optimizer + step + RNG + data position, every ``every`` steps."""

    every: int = 0  # 0: never
    dir: str | None = None  # None: {logging.output_dir}/checkpoints
    resume: str | None = None  # a checkpoint dir, or "latest" under `dir`
    keep: int = 0  # 0: keep all


@dataclass(frozen=True)
class RefitConfig:
    """Trainer -> generator weights after every step over a stateless process group."""

    backend: Literal["gloo", "nccl"] = "gloo"
    bucket_bytes: int = 8 << 20
    host: str = "127.0.0.1"  # used only with a fixed port
    port: int = 0  # 0: policy rank 0 hosts the rendezvous on its node's address and a port it binds
    timeout_s: float = 300.0


@dataclass(frozen=True)
class RayConfig:
    """The Ray cluster the trainer starts (or joins)."""

    address: str | None = None  # None: start a local cluster owned by this run
    num_cpus: int = 8  # logical CPUs of a local cluster; actors ask for fractions of them
    worker_num_cpus: float = 0.0  # per worker actor


@dataclass(frozen=True)
class DebugConfig:
    """Fault injection for tests: the named phase raises on ``fail_at_step``."""

    fail_at_step: int | None = None
    fail_in: Literal["collect", "logprobs", "train"] | None = None
    fail_rank: int = 0


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

    def to_dict(self) -> dict[str, Any]:
        """Plain nested dict; ``TrainerConfig.from_dict(cfg.to_dict()) == cfg``."""
        return _plain(dataclasses.asdict(self))

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> TrainerConfig:
        """Validate a nested mapping. Raises :class:`ConfigError` naming the dotted key."""
        cfg = _build(cls, data, "")
        _cross_checks(cfg)
        return cfg


# --------------------------------------------------------------------------- validation
def _plain(x: Any) -> Any:
    if isinstance(x, Mapping):
        return {k: _plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    return x


def _coerce(value: Any, tp: Any, key: str) -> Any:
    origin = typing.get_origin(tp)
    if tp is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for a in args:
            if a is type(None):
                continue
            try:
                return _coerce(value, a, key)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[0] if errors else f"{key}: invalid value {value!r}")
    if origin is Literal:
        allowed = typing.get_args(tp)
        if value not in allowed:
            raise ConfigError(f"{key} must be one of {list(allowed)}, got {value!r}")
        return value
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key} must be true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key} must be an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key} must be a number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{key} must be a string, got {value!r}")
        return value
    if origin is tuple:
        args = typing.get_args(tp)
        if not isinstance(value, Sequence) or isinstance(value, str) or len(value) != len(args):
            raise ConfigError(f"{key} must be a list of {len(args)} values, got {value!r}")
        return tuple(_coerce(v, a, f"{key}[{i}]") for i, (v, a) in enumerate(zip(value, args)))
    if origin in (Mapping, dict) or tp in (dict, Mapping):
        if not isinstance(value, Mapping):
            raise ConfigError(f"{key} must be a mapping, got {value!r}")
        return _plain(value)
    raise ConfigError(f"{key}: unsupported config type {tp!r}")  # pragma: no cover - schema bug


def _build(cls: type, data: Any, path: str) -> Any:
    if data is None:
        data = {}
    if not isinstance(data, Mapping):
        raise ConfigError(f"{path or 'config'} must be a mapping, got {data!r}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(data) - set(names))
    if unknown:
        dotted = [f"{path}.{k}" if path else str(k) for k in unknown]
        raise ConfigError(f"unknown config key(s) {dotted}; known under {path or 'the top level'}: {names}")
    kwargs: dict[str, Any] = {}
    for name, value in data.items():
        key = f"{path}.{name}" if path else name
        tp = hints[name]
        if dataclasses.is_dataclass(tp):
            kwargs[name] = _build(tp, value, key)
        else:
            kwargs[name] = _coerce(value, tp, key)
    try:
        return cls(**kwargs)
    except (ValueError, TypeError) as e:  # the section's own checks (data_plane.* name their key)
        msg = str(e)
        raise ConfigError(msg if path and path in msg else f"{path or 'config'}: {msg}") from e


def _positive(value: float, key: str, *, allow_zero: bool = False) -> None:
    if value < 0 or (value == 0 and not allow_zero):
        raise ConfigError(f"{key} must be {'>= 0' if allow_zero else '> 0'}, got {value}")


def _cross_checks(cfg: TrainerConfig) -> None:
    _positive(cfg.trainer.steps, "trainer.steps")
    _positive(cfg.trainer.dp_size, "trainer.dp_size")
    _positive(cfg.trainer.num_threads, "trainer.num_threads")
    _positive(cfg.trainer.val_every, "trainer.val_every", allow_zero=True)
    _positive(cfg.trainer.step_timeout_s, "trainer.step_timeout_s")
    _positive(cfg.trainer.startup_timeout_s, "trainer.startup_timeout_s")
    _positive(cfg.generation.n, "generation.n")
    _positive(cfg.generation.max_new_tokens, "generation.max_new_tokens")
    _positive(cfg.generation.temperature, "generation.temperature", allow_zero=True)
    _positive(cfg.generation.val_temperature, "generation.val_temperature", allow_zero=True)
    _positive(cfg.grpo.prompts_per_step, "grpo.prompts_per_step")
    _positive(cfg.grpo.clip_eps, "grpo.clip_eps")
    _positive(cfg.grpo.kl_coef, "grpo.kl_coef", allow_zero=True)
    _positive(cfg.grpo.epochs, "grpo.epochs")
    _positive(cfg.policy.lr, "policy.lr")
    _positive(cfg.policy.max_grad_norm, "policy.max_grad_norm", allow_zero=True)
    _positive(cfg.task.train_size, "task.train_size")
    _positive(cfg.task.val_size, "task.val_size", allow_zero=True)
    _positive(cfg.checkpoint.every, "checkpoint.every", allow_zero=True)
    _positive(cfg.checkpoint.keep, "checkpoint.keep", allow_zero=True)
    _positive(cfg.refit.bucket_bytes, "refit.bucket_bytes")
    _positive(cfg.refit.port, "refit.port", allow_zero=True)
    _positive(cfg.refit.timeout_s, "refit.timeout_s")
    _positive(cfg.ray.num_cpus, "ray.num_cpus")
    _positive(cfg.ray.worker_num_cpus, "ray.worker_num_cpus", allow_zero=True)
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
    if cfg.task.reward_fn is not None and ":" not in cfg.task.reward_fn:
        raise ConfigError(f"task.reward_fn must look like 'pkg.module:function', got {cfg.task.reward_fn!r}")
    if cfg.debug.fail_in is not None and cfg.debug.fail_at_step is None:
        raise ConfigError("debug.fail_in is set but debug.fail_at_step is not")
    if cfg.refit.backend == "nccl" and (cfg.policy.device != "cuda" or cfg.generation.device != "cuda"):
        raise ConfigError("refit.backend=nccl needs policy.device=cuda and generation.device=cuda")
    if cfg.policy.dist_backend == "nccl" and cfg.policy.device != "cuda":
        raise ConfigError("policy.dist_backend=nccl needs policy.device=cuda")


# --------------------------------------------------------------------------- loading
def load_config(path: str | Path | None = None, overrides: Sequence[str] = ()) -> TrainerConfig:
    """Read YAML ``path`` (optional), apply ``overrides`` (``dotted.key=value``), validate.

    Raises:
        ConfigError: a malformed override, an unknown key or an invalid value (names the key).
        FileNotFoundError: ``path`` does not exist.
    """
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    base = OmegaConf.create({})
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
    return TrainerConfig.from_dict(data or {})
