"""A Hugging Face model directory written tensor by tensor, for weights that no rank holds whole.

:class:`HFDirWriter` takes ``(name, tensor)`` pairs in any order on the one rank that writes and
lays them out as ``save_pretrained`` does: ``model.safetensors``, or past ``max_shard_bytes``
``model-0000i-of-0000n.safetensors`` with ``model.safetensors.index.json``, beside
``config.json`` and ``generation_config.json``. At most one shard file's tensors are held at a
time, so an export of a sharded model never needs a full copy on one host.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

__all__ = ["DEFAULT_MAX_SHARD_BYTES", "HFDirWriter"]

DEFAULT_MAX_SHARD_BYTES = 5 << 30  # transformers' own default shard size


class HFDirWriter:
    """Collects tensors into safetensors files of at most ``max_shard_bytes`` (a larger tensor
    gets a file of its own) under ``directory``; :meth:`finish` names the files and writes the
    index and configs. Tensors are copied to the host as they arrive."""

    def __init__(self, directory: str | os.PathLike[str], max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> None:
        if max_shard_bytes <= 0:
            raise ValueError(f"max_shard_bytes must be > 0, got {max_shard_bytes}")
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.max_shard_bytes = max_shard_bytes
        self._pending: dict[str, torch.Tensor] = {}
        self._pending_bytes = 0
        self._parts: list[tuple[Path, list[str]]] = []
        self.total_bytes = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        """Queue ``name``; a repeated name raises ``ValueError`` (a tied weight is written once)."""
        if name in self._pending or any(name in names for _, names in self._parts):
            raise ValueError(f"HFDirWriter: tensor {name!r} added twice")
        t = tensor.detach().to("cpu").contiguous()
        nbytes = t.numel() * t.element_size()
        if self._pending and self._pending_bytes + nbytes > self.max_shard_bytes:
            self._flush()
        self._pending[name] = t
        self._pending_bytes += nbytes
        self.total_bytes += nbytes

    def _flush(self) -> None:
        from safetensors.torch import save_file

        path = self.directory / f".part-{len(self._parts):05d}.safetensors"
        save_file(self._pending, str(path), metadata={"format": "pt"})
        self._parts.append((path, list(self._pending)))
        self._pending, self._pending_bytes = {}, 0

    def finish(self, config: Any, special_ids: Mapping[str, int | None], dtype: torch.dtype) -> str:
        """Write the last file, name the files as ``save_pretrained`` does, and write
        ``config.json`` (``dtype`` as the weights' dtype, ``special_ids`` set) and
        ``generation_config.json``; returns the directory."""
        from transformers import GenerationConfig

        if self._pending or not self._parts:
            self._flush()
        n = len(self._parts)
        weight_map: dict[str, str] = {}
        for i, (path, names) in enumerate(self._parts):
            final = "model.safetensors" if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            os.replace(path, self.directory / final)
            weight_map.update(dict.fromkeys(names, final))
        if n > 1:
            index = {"metadata": {"total_size": self.total_bytes}, "weight_map": dict(sorted(weight_map.items()))}
            (self.directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
        for key, value in special_ids.items():
            setattr(config, key, None if value is None else int(value))
        config.dtype = dtype
        config.save_pretrained(str(self.directory))
        gen = GenerationConfig.from_model_config(config)
        for key, value in special_ids.items():
            setattr(gen, key, None if value is None else int(value))
        gen.save_pretrained(str(self.directory))
        return str(self.directory)
