"""Checkpoint layout and the driver's share of it.

A checkpoint is a directory ``<root>/step_XXXXXX`` (XXXXXX = steps completed) holding

* ``policy.pt`` — policy, reference and AdamW state (and the fp32 master weights with
  ``policy.precision=bf16``) (written by policy rank 0; DP ranks are identical;
  with TP > 1 one ``policy_tp{t}.pt`` per TP rank);
* ``rng_rank{r}.pt`` — each policy rank's RNG state;
* ``driver.pt`` — steps completed, prompt-iterator position, the driver's torch/Python RNG states,
  the config it was written under and which tokenizer the run used (a resume with another one is
  refused);
* ``COMPLETE`` — written last: a directory without it (a crash mid-save) is never resumed from.

Every file is read with ``torch.load(..., weights_only=True)`` (:func:`load_trusted`): tensors,
plain containers and numbers, plus the classes in :data:`SAFE_GLOBALS` (the prompt records a
driver state holds). A checkpoint naming any other Python object is refused, not executed.
"""

from __future__ import annotations

import pickle
import random
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from algorithms.tasks import PromptRecord

MARKER = "COMPLETE"


def _safe_globals() -> list[Any]:
    return [PromptRecord]


def load_trusted(path: str | Path, **kwargs: Any) -> Any:
    """``torch.load(path, weights_only=True)`` allowing only :func:`_safe_globals`' classes.

    Raises:
        pickle.UnpicklingError: the file names another global (an arbitrary object); the
            message names the file.
    """
    try:
        with torch.serialization.safe_globals(_safe_globals()):
            return torch.load(path, weights_only=True, **kwargs)
    except pickle.UnpicklingError as e:
        raise pickle.UnpicklingError(
            f"refusing to load checkpoint file {str(path)!r}: it holds objects "
            f"other than tensors, containers and {_safe_globals()} ({e})"
        ) from e


def step_dir(root: str | Path, steps_done: int) -> Path:
    return Path(root) / f"step_{steps_done:06d}"


def complete_checkpoints(root: str | Path) -> list[Path]:
    """Complete checkpoints under ``root``, oldest first."""
    return sorted(p for p in Path(root).glob("step_*") if (p / MARKER).exists())


def save_driver_state(
    d: Path,
    steps_done: int,
    prompts_state: Mapping[str, Any],
    config: Mapping[str, Any],
    *,
    tokenizer: Mapping[str, Any] | None = None,
) -> None:
    """Write ``driver.pt``; ``tokenizer``: the run's tokenizer record
    (:func:`algorithms.tokenizers.tokenizer_record`), which a resume checks its own against."""
    torch.save(
        {
            "step": steps_done,
            "prompts": dict(prompts_state),
            "torch_rng": torch.get_rng_state(),
            "python_rng": random.getstate(),
            "config": dict(config),
            "tokenizer": None if tokenizer is None else dict(tokenizer),
        },
        d / "driver.pt",
    )


def mark_complete(d: Path, steps_done: int, *, root: str | Path, keep: int) -> None:
    """Write the marker, then drop all but the newest ``keep`` complete checkpoints (0: keep all)."""
    (d / MARKER).write_text(str(steps_done))
    if keep:
        for old in complete_checkpoints(root)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)


def resolve_resume(spec: str | None, root: str | Path) -> Path | None:
    """The checkpoint to resume from: ``None``, ``"latest"`` under ``root``, or a directory.

    Raises:
        FileNotFoundError: no complete checkpoint matches; the message says what is there
            instead (nothing, a checkpoints root, a checkpoint without its marker).
    """
    if not spec:
        return None
    if spec == "latest":
        done = complete_checkpoints(root)
        if not done:
            raise FileNotFoundError(f"checkpoint.resume=latest: no complete checkpoint under {root}")
        return done[-1]
    d = Path(spec)
    if not d.exists():
        raise FileNotFoundError(f"checkpoint.resume={spec!r} does not exist")
    steps = sorted(d.glob("step_*"))
    if steps:
        raise FileNotFoundError(
            f"checkpoint.resume={spec!r} is a checkpoints root, not a checkpoint: give checkpoint.resume=latest "
            f"(with checkpoint.dir={spec}) or one of its step_* folders, e.g. {steps[-1]}"
        )
    if not (d / MARKER).exists():
        raise FileNotFoundError(
            f"checkpoint.resume={spec!r} is not a complete checkpoint (no {MARKER} marker: its save did not finish)"
        )
    return d


def saved_tokenizer(d: Path) -> dict[str, Any] | None:
    """The tokenizer record checkpoint ``d`` was written with (``None``: it recorded none), read
    without touching any RNG state."""
    record = load_trusted(d / "driver.pt").get("tokenizer")
    return None if record is None else dict(record)


def load_driver_state(d: Path) -> dict[str, Any]:
    """Read ``driver.pt`` and restore the driver's RNG states; returns the state dict."""
    state = load_trusted(d / "driver.pt")
    torch.set_rng_state(state["torch_rng"])
    random.setstate(state["python_rng"])
    return state
