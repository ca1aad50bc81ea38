"""Checkpoint layout and the driver's share of it.

A checkpoint is a directory ``<root>/step_XXXXXX`` (XXXXXX = steps completed) holding

* ``policy.pt`` — policy, reference and AdamW state (and the fp32 master weights with
  ``policy.precision=bf16``) (written by policy rank 0; DP ranks are identical;
  with TP > 1 one ``policy_tp{t}.pt`` per TP rank); with ``policy.sharding=fsdp`` instead
  ``policy/``, the same state as ``torch.distributed.checkpoint`` shards (:func:`save_sharded`:
  every rank writes its own, any number of ranks can read them back);
* ``rng_rank{r}.pt`` — each policy rank's RNG state;
* ``driver.pt`` — steps completed, prompt-iterator position, the driver's torch/Python RNG states,
  the config it was written under and which tokenizer the run used (a resume with another one is
  refused);
* ``COMPLETE`` — written last: a directory without it (a crash mid-save) is never resumed from.

Every file is written through :func:`save_file` (``fsync`` of the file and of the directory), and
:func:`mark_complete` fsyncs the directory before the marker and the marker after it: a marker
that survives a power loss never stands beside a file whose bytes did not.

Every file is read with ``torch.load(..., weights_only=True)`` (:func:`load_trusted`): tensors,
plain containers and numbers, plus the classes in :data:`SAFE_GLOBALS` (the prompt records a
driver state holds). A checkpoint naming any other Python object is refused, not executed; a
file that cannot be read (truncated, corrupt) raises :class:`CheckpointReadError` naming it.
Sharded state (:func:`load_sharded`) holds tensors only; its ``.metadata`` (a pickle, in
``torch.distributed.checkpoint``'s format) is read by an unpickler that admits that format's own
record classes, torch's sizes and dtypes, and nothing else.
"""

from __future__ import annotations

import os
import pickle
import random
import shutil
import zipfile
from collections.abc import Mapping
from pathlib import Path
from typing import IO, Any

import torch

from algorithms.tasks import PromptRecord

MARKER = "COMPLETE"


class CheckpointReadError(RuntimeError):
    """A checkpoint file exists but cannot be read (truncated, corrupt); the message names it."""


def _safe_globals() -> list[Any]:
    return [PromptRecord]


def load_trusted(path: str | Path, **kwargs: Any) -> Any:
    """``torch.load(path, weights_only=True)`` allowing only :func:`_safe_globals`' classes.

    Raises:
        pickle.UnpicklingError: the file names another global (an arbitrary object); the
            message names the file.
        CheckpointReadError: the file cannot be read (truncated, corrupt: torch's own error would
            not say which file); the message names it and keeps torch's.
        FileNotFoundError, PermissionError, IsADirectoryError: as raised (they name the file).
    """
    try:
        with torch.serialization.safe_globals(_safe_globals()):
            return torch.load(path, weights_only=True, **kwargs)
    except (FileNotFoundError, PermissionError, IsADirectoryError):
        raise
    except pickle.UnpicklingError as e:
        if not zipfile.is_zipfile(path):
            # torch.save writes a zip; a file cut short in its first bytes is read as a legacy
            # pickle and fails to unpickle: that is corruption, not a forged object.
            raise _unreadable(path, e) from e
        raise pickle.UnpicklingError(
            f"refusing to load checkpoint file {str(path)!r}: it holds objects "
            f"other than tensors, containers and {_safe_globals()} ({e})"
        ) from e
    except (RuntimeError, EOFError, ValueError, OSError) as e:
        # A zip cut short: RuntimeError "failed finding central directory"; an empty file:
        # EOFError; a short member: OSError EINVAL. None of them names the file.
        raise _unreadable(path, e) from e


def _unreadable(path: str | Path, e: BaseException) -> CheckpointReadError:
    return CheckpointReadError(
        f"cannot read checkpoint file {str(path)!r} (truncated or corrupt? a save cut short leaves "
        f"its step without the {MARKER} marker): {type(e).__name__}: {e}"
    )


def fsync_dir(d: str | Path) -> None:
    """``fsync`` the directory ``d``: its entries (the names of files just written) reach disk."""
    fd = os.open(d, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_file(obj: Any, path: str | Path) -> None:
    """``torch.save(obj, path)``, then ``fsync`` of the file and of its directory, so the file is
    on disk before anyone writes the :data:`MARKER` that vouches for it."""
    path = Path(path)
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    fsync_dir(path.parent)


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
    save_file(
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
    """Write the marker, then drop all but the newest ``keep`` complete checkpoints (0: keep all).

    Every file of ``d`` was fsync'd by its writer (:func:`save_file`); the directory is fsync'd
    again before the marker (its entries, whoever wrote them), then the marker and the directory.
    """
    fsync_dir(d)
    with open(d / MARKER, "w") as f:
        f.write(str(steps_done))
        f.flush()
        os.fsync(f.fileno())
    fsync_dir(d)
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


# What torch.distributed.checkpoint's .metadata pickle may name: its own records, torch's sizes,
# dtypes, layouts and memory formats, and a path. Not BytesStorageMetadata: sharded state is
# tensors only, and a byte item would be read back with torch.load(weights_only=False).
_DCP_RECORDS = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata",
        "MetadataIndex",
        "StorageMeta",
        "TensorProperties",
        "TensorStorageMetadata",
        "ChunkStorageMetadata",
        "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "pathlib": {"PosixPath", "PurePosixPath"},
    "pathlib._local": {"PosixPath", "PurePosixPath"},
    "collections": {"OrderedDict"},
}


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, f: IO[bytes], where: str) -> None:
        super().__init__(f)
        self.where = where

    def find_class(self, module: str, name: str) -> Any:
        if name in _DCP_RECORDS.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and (
            name == "Size" or isinstance(getattr(torch, name, None), (torch.dtype, torch.layout, torch.memory_format))
        ):
            return getattr(torch, name)
        raise pickle.UnpicklingError(
            f"refusing to load sharded checkpoint metadata {self.where!r}: it names {module}.{name}, which is not "
            "a torch.distributed.checkpoint record"
        )


def _read_metadata(directory: Path) -> Any:
    """``directory/.metadata`` through :class:`_MetadataUnpickler` (errors name the file)."""
    path = directory / ".metadata"
    try:
        with open(path, "rb") as f:
            return _MetadataUnpickler(f, str(path)).load()
    except (FileNotFoundError, PermissionError, pickle.UnpicklingError):
        raise
    except (EOFError, ValueError, OSError, AttributeError, ImportError, TypeError) as e:
        raise _unreadable(path, e) from e


def _safe_reader(directory: Path) -> Any:
    from torch.distributed.checkpoint import FileSystemReader

    class SafeReader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            metadata = _read_metadata(Path(self.path))
            if getattr(metadata, "storage_meta", None) is None:
                from torch.distributed.checkpoint.metadata import StorageMeta

                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return SafeReader(str(directory))


def save_sharded(state: dict[str, Any], directory: Path) -> None:
    """``torch.distributed.checkpoint.save`` of ``state`` (nested dicts of tensors and DTensors
    only) into ``directory``, fsync'd (collective: every rank of the default group calls it)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    directory.mkdir(parents=True, exist_ok=True)
    try:
        dcp.save(state, storage_writer=dcp.FileSystemWriter(str(directory), sync_files=True))
    except CheckpointException as e:  # a BaseException: would slip past every `except Exception`
        raise _first_failure(e, f"cannot write the sharded checkpoint {str(directory)!r}") from None
    fsync_dir(directory)


def load_sharded(state: dict[str, Any], directory: Path) -> None:
    """Fill ``state`` (the same nesting :func:`save_sharded` wrote, this run's shapes and
    placements) in place from ``directory``, resharding to this run's ranks (collective).

    Raises:
        pickle.UnpicklingError: the metadata names anything but the format's own records.
        CheckpointReadError: the metadata cannot be read (truncated, corrupt).
        FileNotFoundError: ``directory`` holds no sharded checkpoint.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    if not (directory / ".metadata").is_file():
        raise FileNotFoundError(f"no sharded checkpoint in {str(directory)!r} (its .metadata is missing)")
    _read_metadata(directory)  # refused here, naming the file, before the reader's wrapper hides why
    try:
        dcp.load(state, storage_reader=_safe_reader(directory))
    except CheckpointException as e:  # a BaseException: would slip past every `except Exception`
        raise _first_failure(e, f"cannot read the sharded checkpoint {str(directory)!r}") from None


def _first_failure(e: Any, what: str) -> Exception:
    """The error of the first failed rank inside ``torch.distributed.checkpoint``'s wrapper: our
    own refusals as they are, anything else as :class:`CheckpointReadError` saying ``what``."""
    failures = sorted(e.failures.items())
    for _, (exc, _) in failures:
        seen: BaseException | None = exc
        while seen is not None:  # the reader's error, possibly re-raised as another by the planner
            if isinstance(seen, (pickle.UnpicklingError, CheckpointReadError, FileNotFoundError, PermissionError)):
                return seen
            seen = seen.__cause__ or seen.__context__
    detail = "; ".join(f"rank {r}: {type(exc).__name__}: {exc}" for r, (exc, _) in failures[:4])
    return CheckpointReadError(f"{what}: {detail}")
