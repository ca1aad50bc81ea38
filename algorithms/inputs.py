"""The run's inputs, loaded and checked in the driver before Ray starts: prompt datasets, the
tokenizer against the model and the prompts, the prompts and response length against the model's
context, the reward function (importable by the workers, every reference answer scorable), the
model against the generation engine.

Every problem is a :class:`~algorithms.config.ConfigError` naming the key at fault (the trainer
exits 2 with that one line), so a run that cannot work fails in seconds, not after its workers
have started.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from algorithms.cluster import worker_env
from algorithms.config import ConfigError, TrainerConfig
from algorithms.engines.generation import check_generation_config
from algorithms.models import model_config_values
from algorithms.rewards import RewardFn, resolve_reward_fn, unparsable_references
from algorithms.tasks import PromptRecord, load_dataset, make_task_dataset
from algorithms.tokenizers import Tokenizer, build_tokenizer

__all__ = ["CHECKED_PROMPTS", "LONGEST_PROMPTS", "check_run_inputs", "embedding_rows", "load_datasets"]

# Prompts of each dataset tokenized at load: enough to catch a wrong field or tokenizer, few
# enough that a large dataset does not delay the start.
CHECKED_PROMPTS = 8
# The longest prompts (by characters) of each dataset whose token counts bound the prompt length
# checked against the model's context: tokens grow with characters, and a fixed number keeps the
# check's cost (a chat template renders each one) independent of the dataset's size.
LONGEST_PROMPTS = 64
# Rows named in one message about bad records; the count says how many more.
NAMED_ROWS = 5


def _load(cfg: TrainerConfig, key: str, path: str) -> list[PromptRecord]:
    t = cfg.task
    try:
        return load_dataset(path, prompt_key=t.prompt_key, answer_key=t.answer_key)
    except (ValueError, ImportError, OSError) as e:
        keys = f"task.prompt_key={t.prompt_key!r}, task.answer_key={t.answer_key!r}"
        raise ConfigError(f"{key}={path!r} ({keys}): {e}") from e


def load_datasets(cfg: TrainerConfig) -> tuple[list[PromptRecord], list[PromptRecord]]:
    """Train and held-out prompt records: a dataset file (``task.dataset``; held-out = the last
    ``task.val_size`` records unless ``task.val_dataset``) or the built-in task from its seed.
    Raises :class:`ConfigError` naming the key, file, line or row and field of a bad record."""
    t = cfg.task
    max_new = cfg.generation.max_new_tokens
    # The training file first: a key missing from both files is reported for the one the run is about.
    if t.dataset is not None:
        train = _load(cfg, "task.dataset", t.dataset)
    else:
        train = make_task_dataset(t.name, t.seed, t.train_size, max_new)
    if t.val_dataset is not None:
        return train, _load(cfg, "task.val_dataset", t.val_dataset)[: t.val_size]
    if t.dataset is not None:
        split = t.val_size if t.val_size and len(train) > t.val_size else 0
        return (train[:-split], train[-split:]) if split else (train, [])
    return train, make_task_dataset(t.name, t.seed + 1, t.val_size, max_new) if t.val_size else []


def embedding_rows(cfg: TrainerConfig) -> int | None:
    """Rows of the policy's input embedding as its config states them (``policy.model.hf_config``
    or ``config.json`` under ``policy.model.path``), read without building the model; ``None``
    where the config leaves it to the tokenizer (a random-init model without ``vocab_size``)."""
    rows = model_config_values(cfg.policy.model).get("vocab_size")
    return None if rows is None else int(rows)


def _rows(records: Sequence[PromptRecord]) -> str:
    """The first :data:`NAMED_ROWS` records as ``source (answer)``, and how many more."""
    named = ", ".join(f"{r.source or f'uid {r.uid}'} ({r.answer[:40]!r})" for r in records[:NAMED_ROWS])
    return named + (f" and {len(records) - NAMED_ROWS} more" if len(records) > NAMED_ROWS else "")


def _check_references(cfg: TrainerConfig, fn: RewardFn, records: Sequence[PromptRecord]) -> None:
    """Every reference answer the reward cannot score (the ``math`` reward's unparsable ones),
    refused now rather than at the step that first draws it."""
    bad = [records[i] for i in unparsable_references(fn, [r.answer for r in records])]
    if bad:
        key = f"task.reward_fn={cfg.task.reward_fn!r}" if cfg.task.reward_fn else f"task.name={cfg.task.name!r}"
        raise ConfigError(
            f"{key}: the math verifier cannot parse the reference answer (task.answer_key={cfg.task.answer_key!r}) "
            f"of {len(bad)} record(s): {_rows(bad)}; every response to them would fail its step"
        )


def _check_importable_by_workers(cfg: TrainerConfig, fn: RewardFn) -> None:
    """A ``pkg.module:function`` reward is imported again in the collector, whose import path is
    the driver's working directory and ``sys.path`` without the script's own directory
    (:func:`algorithms.cluster.worker_env`): refuse a module the driver found anywhere else."""
    module = sys.modules.get(getattr(fn, "__module__", None) or type(fn).__module__)
    origin = getattr(module, "__file__", None)
    if module is None or origin is None or module.__name__.split(".")[0] == "algorithms":
        return  # the workers run this package's own code: they import it, however it is installed
    roots = [Path(p).resolve() for p in worker_env(cfg)["PYTHONPATH"].split(os.pathsep) if p]
    if not any(Path(origin).resolve().is_relative_to(root) for root in roots):
        raise ConfigError(
            f"task.reward_fn={cfg.task.reward_fn!r}: module {module.__name__!r} was imported from {origin}, "
            "outside the workers' import path (the working directory and sys.path, without the script's "
            "directory): run from the directory that holds its package, add that directory to PYTHONPATH, "
            "or pip install the package"
        )


def _check_context(cfg: TrainerConfig, tok: Tokenizer, datasets: Sequence[Sequence[PromptRecord]]) -> None:
    """The longest prompt plus ``generation.max_new_tokens`` fits the model's
    ``max_position_embeddings`` where its config states one (beyond it a rotary model's positions
    extrapolate silently). The prompt length is measured on each dataset's :data:`LONGEST_PROMPTS`
    longest prompts."""
    values: dict[str, Any] = model_config_values(cfg.policy.model)
    limit = values.get("max_position_embeddings")
    if limit is None:
        return
    where = (
        f"max_position_embeddings={limit} in {cfg.policy.model['path']}/config.json"
        if cfg.policy.model.get("path") not in (None, "")
        else f"policy.model.hf_config.max_position_embeddings={limit}"
    )
    longest, record = 0, None
    for records in datasets:
        for r in sorted(records, key=lambda r: len(r.prompt), reverse=True)[:LONGEST_PROMPTS]:
            n = len(tok.encode_prompt(r.prompt))
            if n > longest:
                longest, record = n, r
    max_new = cfg.generation.max_new_tokens
    if longest + max_new > int(limit):
        assert record is not None
        raise ConfigError(
            f"generation.max_new_tokens={max_new} plus the longest prompt ({longest} tokens, "
            f"{record.source or f'uid {record.uid}'}) exceeds the model's {where}: lower "
            "generation.max_new_tokens or shorten the prompts"
        )


def check_run_inputs(cfg: TrainerConfig, train: Sequence[PromptRecord], val: Sequence[PromptRecord]) -> Tokenizer:
    """Build the run's tokenizer and check, before any worker starts: the model's embedding has a
    row for every token id; the first :data:`CHECKED_PROMPTS` prompts of each dataset tokenize;
    the longest prompt plus ``generation.max_new_tokens`` fits the model's
    ``max_position_embeddings``; the reward function resolves, from a module the workers can
    import, and can score every reference answer (``math``: each one parses); the generation
    engine can run the model (vLLM on CPU: its attention head size); ``prometheus-client`` is
    there if the metrics endpoint is on. Returns the tokenizer. Raises :class:`ConfigError`
    naming both sizes, or the prompt, its source and ``task.prompt_key``, or
    ``generation.max_new_tokens`` and the model's limit, or ``task.reward_fn`` (and the rows at
    fault), or the model key."""
    check_generation_config(cfg)
    tok = build_tokenizer(cfg)
    rows = embedding_rows(cfg)
    if rows is not None and tok.vocab_size > rows:
        raise ConfigError(
            f"policy.model: the model's embedding has {rows} rows but the tokenizer ({tok!r}) has "
            f"{tok.vocab_size} tokens; the embedding needs at least one row per token (see policy.tokenizer)"
        )
    for records in (train, val):
        for r in records[:CHECKED_PROMPTS]:
            try:
                tok.encode_prompt(r.prompt)
            except (ValueError, TypeError) as e:
                raise ConfigError(
                    f"task.prompt_key={cfg.task.prompt_key!r}: prompt {r.prompt[:80]!r} ({r.source or f'uid {r.uid}'}) "
                    f"does not tokenize with {tok!r}: {e}"
                ) from e
    _check_context(cfg, tok, (train, val))
    try:
        fn = resolve_reward_fn(cfg.task.reward_fn, cfg.task.name)
    except (ValueError, ImportError, AttributeError, TypeError) as e:
        key = f"task.reward_fn={cfg.task.reward_fn!r}" if cfg.task.reward_fn else f"task.name={cfg.task.name!r}"
        raise ConfigError(f"{key}: {e}") from e
    _check_importable_by_workers(cfg, fn)
    _check_references(cfg, fn, [*train, *val])
    if cfg.logging.prometheus_port is not None and importlib.util.find_spec("prometheus_client") is None:
        raise ConfigError(
            f"logging.prometheus_port={cfg.logging.prometheus_port}: the endpoint needs prometheus-client "
            "(pip install 'nemo-dataplane[metrics]')"
        )
    if cfg.logging.wandb and importlib.util.find_spec("wandb") is None:
        raise ConfigError("logging.wandb=true needs wandb installed (pip install wandb)")
    return tok
