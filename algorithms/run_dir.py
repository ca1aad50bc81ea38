"""A run's output directory: checked before anything starts, with the checkpoint the run resumes
from (:func:`plan_run_dir`), and what every run leaves there at its end (:func:`write_outputs`).

:func:`plan_run_dir` makes the decision once, from the typed config, and raises
:class:`~nemo_dataplane.config.ConfigError` (the CLI's exit 2, one line) when the run must not
start:

* ``logging.output_dir`` (or ``checkpoint.dir``) already holds another run's results
  (:data:`RESULTS`, ``step_*`` checkpoints) and the run neither resumes (``checkpoint.resume``)
  nor overwrites (``logging.overwrite: true``, which deletes them first);
* ``checkpoint.resume`` names no complete checkpoint (the message says what it found instead);
* the config differs from the one the checkpoint was written under (:func:`config_changes`) in a
  key that is not free to change (:data:`FREE_ON_RESUME`): keys of :data:`SAFE_ON_RESUME` pass
  with ``checkpoint.allow_config_change: true``, any other (the model, the task, anything that
  changes the shapes or the meaning of the saved state) never does;
* the files of ``policy.model.path`` differ from those the checkpoint's run started from (a model
  rewritten in place: :func:`algorithms.models.model_files_digest`, stored in the driver state
  under :data:`MODEL_FILES`).
"""

from __future__ import annotations

import json
import pickle
import shutil
import sys
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from algorithms.checkpoint import load_trusted, resolve_resume
from algorithms.config import ConfigError, TrainerConfig
from algorithms.metrics import plot_metrics, summary_line
from algorithms.models import model_files_digest

__all__ = [
    "FAILED_RESUME_SUMMARY",
    "FREE_ON_RESUME",
    "MODEL_FILES",
    "RESHARDABLE_ON_RESUME",
    "RESULTS",
    "SAFE_ON_RESUME",
    "RunPlan",
    "checkpoint_root",
    "config_changes",
    "existing_results",
    "existing_outputs",
    "plan_run_dir",
    "plot_title",
    "remove_results",
    "write_outputs",
]

# What a run writes into its output directory (besides checkpoints). Another run's copy of any of
# them means the directory is taken; config.json alone is not a result (every run writes it first).
RESULTS: tuple[str, ...] = (
    "metrics.jsonl",
    "summary.json",
    "trained_groups.jsonl",
    "reward_loss.png",
    "tensorboard",
    "hf",  # checkpoint.export_hf
    "summary_failed_resume.json",  # FAILED_RESUME_SUMMARY
)

# Where a resume that logged no step of its own writes its summary: summary.json stays the
# resumed run's.
FAILED_RESUME_SUMMARY = "summary_failed_resume.json"

# The driver state's entry (beside the trainer's data position) holding the digest of the model
# files the run started from.
MODEL_FILES = "model_files"

# Dotted config keys (a key or a whole section) that only say how a run is executed, observed or
# checkpointed, never what it trains: they may differ freely from the checkpoint's config
# (checkpoint.resume itself always does).
FREE_ON_RESUME: tuple[str, ...] = (
    "checkpoint",
    "logging",
    "ray",
    "debug",
    "refit",  # how the same weights reach the generator
    "trainer.dispatch",
    "trainer.dispatch_idle_teardown_s",
    "trainer.step_timeout_s",
    "trainer.startup_timeout_s",
)

# Keys that change how training continues but not the shapes or meaning of the saved state (model,
# optimizer, RNG, data position): they pass with checkpoint.allow_config_change=true. Everything
# not listed here or above is refused: the model (policy.model.*), policy.backend and
# tensor_parallel_size (the checkpoint's layout), trainer.dp_size (one RNG file per rank),
# trainer.seed, the task (task.name, seed, train_size, dataset, reward_fn; generation.max_new_tokens
# shapes the built-in task's prompts), grpo.prompts_per_step and generation.n (what a step and the
# data position mean), async.num_collectors and async.mode (a deterministic checkpoint holds a schedule).
SAFE_ON_RESUME: tuple[str, ...] = (
    "policy.lr",
    "policy.weight_decay",
    "policy.betas",
    "policy.max_grad_norm",
    "policy.device",
    "policy.dist_backend",
    "policy.gpus_per_rank",
    "generation.temperature",
    "generation.val_temperature",
    "generation.top_p",
    "generation.backend",
    "generation.vllm",
    "generation.device",
    "generation.num_gpus",
    "grpo.clip_eps",
    "grpo.kl_coef",
    "grpo.normalize_std",
    "grpo.dynamic_sampling",
    "grpo.loss_agg",
    "grpo.epochs",
    "grpo.loss",
    "grpo.clip_eps_high",
    "grpo.advantage",
    "task.val_size",
    "task.val_dataset",
    "task.reward_timeout_s",
    "trainer.steps",
    "trainer.val_every",
    "trainer.num_threads",
    "async.max_staleness",
    "async.max_inflight_groups",
    "async.groups_per_generation",
    "async.partial_rollout",
    "async.is_cap",
    "async.is_mode",
    "async.claim_poll_s",
    "data_plane",  # the transport and the store; packing changes only the micro-batch split
)


# With policy.sharding=fsdp (in the checkpoint's config and this one: a change of sharding is
# refused) the policy's state is saved as shards that any number of ranks can load
# (torch.distributed.checkpoint): the rank count may change like the keys above.
RESHARDABLE_ON_RESUME: tuple[str, ...] = ("trainer.dp_size",)


def checkpoint_root(cfg: TrainerConfig) -> Path:
    """Where the run's checkpoints go: ``checkpoint.dir``, else ``<output_dir>/checkpoints``."""
    return Path(cfg.checkpoint.dir or Path(cfg.logging.output_dir) / "checkpoints")


@dataclass(frozen=True)
class RunPlan:
    """What :func:`plan_run_dir` decided: the checkpoint to resume from (``None``: a fresh run)
    and its step, and the previous run's results a fresh run with ``logging.overwrite`` deletes."""

    resume: Path | None = None
    start_step: int = 0
    stale: tuple[Path, ...] = field(default_factory=tuple)


def _is_result(p: Path) -> bool:
    """A run that logged no step leaves nothing to protect: its empty JSONL files and a summary of
    0 steps do not take the directory, so a run that failed while setting up can simply be rerun."""
    if p.suffix == ".jsonl":
        return p.stat().st_size > 0
    if p.name == "summary.json":
        try:
            return bool(json.loads(p.read_text()).get("steps", 1))
        except (OSError, ValueError, AttributeError):  # unreadable: someone's results all the same
            return True
    return True


def existing_results(cfg: TrainerConfig) -> list[Path]:
    """Another run's results where this run would write: :data:`RESULTS` in the output directory
    (see :func:`_is_result`), then the ``step_*`` folders (complete or not) under the checkpoint root."""
    out = Path(cfg.logging.output_dir)
    found = [out / name for name in RESULTS if (out / name).exists() and _is_result(out / name)]
    return found + sorted(checkpoint_root(cfg).glob("step_*"))


def existing_outputs(out: str | Path, names: tuple[str, ...] = ("metrics.jsonl", "summary.json")) -> list[Path]:
    """The files of ``names`` that exist in ``out`` (what a summary line may point at)."""
    return [Path(out) / n for n in names if (Path(out) / n).exists()]


def plot_title(cfg: TrainerConfig, trainer: str, transport: str) -> str:
    """The plot's title: the run (output directory), the trainer, the transport (and store) and
    the training and generation engines."""
    store = f" ({cfg.data_plane.backend})" if transport == "data_plane" else ""
    return (
        f"{cfg.logging.output_dir}: {trainer}, transport {transport}{store}, "
        f"policy {cfg.policy.backend}, generation {cfg.generation.backend}"
    )


def write_outputs(
    out: Path,
    rows: Sequence[Mapping[str, Any]],
    summary: Mapping[str, Any],
    *,
    name: str,
    wall_s: float,
    idle: Mapping[str, float],
    title: str | None,
    keep_summary: bool = False,
) -> None:
    """What every run leaves, whatever its status: ``reward_loss.png`` (when steps were logged and
    ``title`` is given; a plot that fails is reported, never fails the run), ``summary.json``,
    then the summary line on stdout, naming only outputs that exist. ``keep_summary`` (a resume
    that logged no step of its own): an existing ``summary.json`` is left as it is and this
    summary goes to :data:`FAILED_RESUME_SUMMARY` instead (said on stderr)."""
    if rows and title is not None:
        try:
            plot_metrics(rows, out / "reward_loss.png", title)
        except Exception as e:  # noqa: BLE001 - a plot must not turn a good run into a failure
            print(f"{name}: could not write the plot: {e}", file=sys.stderr)
    target = "summary.json"
    if keep_summary and (out / target).exists():
        target = FAILED_RESUME_SUMMARY
        print(
            f"{name}: the resume logged no step: its summary is {out / target}; "
            "summary.json is still the resumed run's",
            file=sys.stderr,
        )
    (out / target).write_text(json.dumps(summary, indent=2, default=str))
    status = str(summary.get("status"))
    files = existing_outputs(out, ("metrics.jsonl", target))
    print(summary_line(rows, wall_s=wall_s, status=status, files=files, name=name, idle=idle), flush=True)


def remove_results(paths: Sequence[Path], name: str) -> None:
    """Delete a previous run's results (``logging.overwrite``), saying so on stderr when there
    were any; a path already gone is fine."""
    if paths:
        print(
            f"{name}: logging.overwrite=true: deleting the previous run's results {[str(p) for p in paths]}",
            file=sys.stderr,
        )
    for p in paths:
        if p.is_dir():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)


def _flatten(data: Mapping[str, Any], prefix: str = "") -> Iterator[tuple[str, Any]]:
    for k, v in data.items():
        key = f"{prefix}{k}"
        if isinstance(v, Mapping) and v:
            yield from _flatten(v, key + ".")
        else:
            yield key, v


def _under(key: str, prefixes: tuple[str, ...]) -> bool:
    return any(key == p or key.startswith(p + ".") for p in prefixes)


def config_changes(stored: Mapping[str, Any], current: Mapping[str, Any]) -> dict[str, tuple[Any, Any]]:
    """Dotted keys whose values differ between two ``TrainerConfig.to_dict()`` trees, as
    ``{key: (stored, current)}``, leaving out :data:`FREE_ON_RESUME`. A key the stored config
    lacks (written before the key existed) counts as its default."""
    old = dict(_flatten(stored))
    for k, v in _flatten(TrainerConfig().to_dict()):
        # A default the stored tree lacks, unless it holds that mapping's entries (policy.model.*).
        if k not in old and not any(s.startswith(k + ".") for s in old):
            old[k] = v
    new = dict(_flatten(current))
    missing = object()
    return {
        k: (old.get(k), new.get(k))
        for k in sorted(old.keys() | new.keys())
        if not _under(k, FREE_ON_RESUME) and old.get(k, missing) != new.get(k, missing)
    }


def _describe(changes: Mapping[str, tuple[Any, Any]]) -> str:
    def short(v: Any) -> str:
        s = repr(v)
        return s if len(s) <= 40 else s[:37] + "..."

    return ", ".join(f"{k} ({short(a)} -> {short(b)})" for k, (a, b) in changes.items())


def _resolve(cfg: TrainerConfig) -> Path | None:
    """``checkpoint.resume`` resolved; its errors become one-line config errors."""
    try:
        return resolve_resume(cfg.checkpoint.resume, checkpoint_root(cfg))
    except FileNotFoundError as e:
        raise ConfigError(str(e)) from e


def plan_run_dir(cfg: TrainerConfig) -> RunPlan:
    """Decide whether this run may start in its output directory, and from which checkpoint.

    Reads only (it deletes nothing; :func:`remove_results` does, for the returned ``stale``).

    Raises:
        ConfigError: the directory holds another run's results (names them), the checkpoint to
            resume from is missing or incomplete, or the config changed in a key that may not
            change on resume (names each key with its stored and current values).
    """
    resume = _resolve(cfg)
    if resume is None:
        found = existing_results(cfg)
        if not found:
            return RunPlan()
        if cfg.logging.overwrite:
            return RunPlan(stale=tuple(found))
        out = Path(cfg.logging.output_dir)
        names = [str(p.relative_to(out)) if p.is_relative_to(out) else str(p) for p in found]
        raise ConfigError(
            f"logging.output_dir={str(out)!r} holds another run's results ({', '.join(names)}): resume it "
            "with checkpoint.resume=latest, pick another logging.output_dir, or set logging.overwrite=true "
            "to delete them"
        )
    try:
        state = load_trusted(resume / "driver.pt")
    except (OSError, RuntimeError, pickle.UnpicklingError) as e:  # missing, truncated or refused
        raise ConfigError(f"checkpoint.resume={str(resume)!r}: cannot read driver.pt: {e}") from e
    changes = config_changes(state.get("config") or {}, cfg.to_dict())
    allowed = cfg.checkpoint.allow_config_change
    safe_keys = SAFE_ON_RESUME + RESHARDABLE_ON_RESUME if cfg.fully_sharded else SAFE_ON_RESUME
    unsafe = {k: v for k, v in changes.items() if not _under(k, safe_keys)}
    safe = {k: v for k, v in changes.items() if k not in unsafe and not allowed}
    where = f"checkpoint.resume={str(resume)!r}: the config differs from the checkpoint's in"
    if unsafe:
        also = f"; {', '.join(safe)} would also need checkpoint.allow_config_change=true" if safe else ""
        raise ConfigError(
            f"{where} {_describe(unsafe)}: the model, the task and the saved state's meaning cannot change "
            f"on resume{also} (docs/grpo_sync.md, 'Checkpoint and resume')"
        )
    if safe:
        raise ConfigError(
            f"{where} {_describe(safe)}: set checkpoint.allow_config_change=true to resume with them "
            "(docs/grpo_sync.md, 'Checkpoint and resume')"
        )
    _check_model_files(cfg, resume, (state.get("prompts") or {}).get(MODEL_FILES))
    return RunPlan(resume=resume, start_step=int(state["step"]))


def _check_model_files(cfg: TrainerConfig, resume: Path, saved: Mapping[str, str] | None) -> None:
    """Refuse a resume whose ``policy.model.path`` files changed since the checkpoint's run
    started (a checkpoint that recorded none is not checked)."""
    if saved is None:
        return
    current = model_files_digest(cfg.policy.model) or {}
    changed = sorted(n for n in saved.keys() | current.keys() if saved.get(n) != current.get(n))
    if changed:
        state = {n: "new" if n not in saved else "gone" if n not in current else "changed" for n in changed}
        what = ", ".join(f"{n} ({how})" for n, how in state.items())
        raise ConfigError(
            f"checkpoint.resume={str(resume)!r}: the model files under policy.model.path="
            f"{str(cfg.policy.model.get('path'))!r} differ from those the checkpoint's run started from: {what}; "
            "resume with the model it was trained from, or start a new run (logging.overwrite=true or another "
            "logging.output_dir)"
        )
