"""The run's inputs, loaded and checked in the driver before Ray starts: prompt datasets, the
tokenizer against the model and the prompts, the reward function, the model against the
generation engine.

Every problem is a :class:`~algorithms.config.ConfigError` naming the key at fault (the trainer
exits 2 with that one line), so a run that cannot work fails in seconds, not after its workers
have started.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence

from algorithms.config import ConfigError, TrainerConfig
from algorithms.engines.generation import check_generation_config
from algorithms.models import model_config_values
from algorithms.rewards import resolve_reward_fn
from algorithms.tasks import PromptRecord, load_dataset, make_task_dataset
from algorithms.tokenizers import Tokenizer, build_tokenizer

__all__ = ["CHECKED_PROMPTS", "check_run_inputs", "embedding_rows", "load_datasets"]

# Prompts of each dataset tokenized at load: enough to catch a wrong field or tokenizer, few
# enough that a large dataset does not delay the start.
CHECKED_PROMPTS = 8


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
    if t.val_dataset is not None:
        val = _load(cfg, "task.val_dataset", t.val_dataset)[: t.val_size]
    if t.dataset is not None:
        train = _load(cfg, "task.dataset", t.dataset)
        if t.val_dataset is None:
            split = t.val_size if t.val_size and len(train) > t.val_size else 0
            train, val = (train[:-split], train[-split:]) if split else (train, [])
        return train, val
    max_new = cfg.generation.max_new_tokens
    train = make_task_dataset(t.name, t.seed, t.train_size, max_new)
    if t.val_dataset is None:
        val = make_task_dataset(t.name, t.seed + 1, t.val_size, max_new) if t.val_size else []
    return train, val


def embedding_rows(cfg: TrainerConfig) -> int | None:
    """Rows of the policy's input embedding as its config states them (``policy.model.hf_config``
    or ``config.json`` under ``policy.model.path``), read without building the model; ``None``
    where the config leaves it to the tokenizer (a random-init model without ``vocab_size``)."""
    rows = model_config_values(cfg.policy.model).get("vocab_size")
    return None if rows is None else int(rows)


def check_run_inputs(cfg: TrainerConfig, train: Sequence[PromptRecord], val: Sequence[PromptRecord]) -> Tokenizer:
    """Build the run's tokenizer and check, before any worker starts: the model's embedding has a
    row for every token id; the first :data:`CHECKED_PROMPTS` prompts of each dataset tokenize;
    the reward function resolves; the generation engine can run the model (vLLM on CPU: its
    attention head size); ``prometheus-client`` is there if the metrics endpoint is on. Returns
    the tokenizer. Raises :class:`ConfigError` naming both sizes,
    or the prompt, its source and ``task.prompt_key``, or ``task.reward_fn``, or the model key."""
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
    try:
        resolve_reward_fn(cfg.task.reward_fn, cfg.task.name)
    except (ValueError, ImportError, AttributeError, TypeError) as e:
        key = f"task.reward_fn={cfg.task.reward_fn!r}" if cfg.task.reward_fn else f"task.name={cfg.task.name!r}"
        raise ConfigError(f"{key}: {e}") from e
    if cfg.logging.prometheus_port is not None and importlib.util.find_spec("prometheus_client") is None:
        raise ConfigError(
            f"logging.prometheus_port={cfg.logging.prometheus_port}: the endpoint needs prometheus-client "
            "(pip install 'nemo-dataplane[metrics]')"
        )
    if cfg.logging.wandb and importlib.util.find_spec("wandb") is None:
        raise ConfigError("logging.wandb=true needs wandb installed (pip install wandb)")
    return tok
