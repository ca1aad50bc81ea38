"""`driver_balanced_preshards`: plan a step's DP shards once, on the driver, from lengths only."""

from __future__ import annotations

import numbers
from collections.abc import Mapping
from typing import Any

import torch
from tensordict import TensorDict

from nemo_dataplane.config import DataPlaneConfig, PackingConfig, config_section
from nemo_dataplane.driver.planner import Preshards, plan
from nemo_dataplane.meta import KVBatchMeta

__all__ = ["driver_balanced_preshards", "resolve_packing_config"]


def driver_balanced_preshards(
    batch_or_meta: TensorDict | KVBatchMeta,
    dp_world: int,
    packing_config: PackingConfig | DataPlaneConfig | Mapping[str, Any],
    *,
    seq_len_field: str = "seq_len",
) -> Preshards:
    """Plan which samples each of ``dp_world`` ranks trains on and how each rank's share is cut
    into micro-batches, balancing tokens across ranks.

    The planner runs once, here, over sequence lengths only: from a ``KVBatchMeta`` it reads the
    ``seq_len_field`` tag of every key (no store I/O); from a ``TensorDict`` the
    ``seq_len_field`` field (``[B]`` integers).

    Why once, on the driver: every DP rank must step through the same number of micro-batches.
    Training issues a cross-DP collective per micro-batch (gradient all-reduce / reduce-scatter
    in Megatron and FSDP). If each rank packed its own share, a rank holding shorter samples would
    pack them into fewer micro-batches, finish its loop, and move on while its peers sit in the
    next all-reduce waiting for it: the job hangs at the first cross-DP collective until the NCCL
    watchdog kills it. Planning globally with a micro-batch count that is a multiple of
    ``dp_world`` (``bin_count_multiple=dp_world``) rules that out by construction.

    Args:
        packing_config: a :class:`PackingConfig`, a :class:`DataPlaneConfig` (its ``packing``), or
            the ``data_plane.packing`` mapping.

    Raises:
        KeyError: a key lacks the ``seq_len`` tag (names the key), or the batch lacks the field.
        ValueError: a non-integer or negative length (names the key or row), or an infeasible plan.
    """
    cfg = resolve_packing_config(packing_config)
    if isinstance(batch_or_meta, KVBatchMeta):
        seq_lens = _lengths_from_tags(batch_or_meta, seq_len_field)
    elif isinstance(batch_or_meta, TensorDict):
        seq_lens = _lengths_from_field(batch_or_meta, seq_len_field)
    else:
        raise TypeError(
            f"driver_balanced_preshards takes a TensorDict or a KVBatchMeta, got {type(batch_or_meta).__name__}"
        )
    return plan(seq_lens, dp_world, cfg)


def resolve_packing_config(cfg: PackingConfig | DataPlaneConfig | Mapping[str, Any]) -> PackingConfig:
    """A :class:`PackingConfig` from itself, a :class:`DataPlaneConfig` or a ``packing`` mapping."""
    section: PackingConfig = config_section(cfg, "packing", "packing_config")
    return section


def _lengths_from_tags(meta: KVBatchMeta, name: str) -> list[int]:
    out: list[int] = []
    for key, tag in zip(meta.keys, meta.tags):
        if name not in tag:
            raise KeyError(
                f"key {key!r} (partition {meta.partition_id!r}) has no {name!r} tag; every key needs "
                f"{name}=<prompt + response tokens> to be planned (tag it when the rollout is put)"
            )
        out.append(_as_length(tag[name], f"tag {name!r} of key {key!r}"))
    return out


def _lengths_from_field(batch: TensorDict, name: str) -> list[int]:
    if name not in batch.keys():
        raise KeyError(f"batch has no {name!r} field (fields: {sorted(batch.keys())}); add [B] token counts")
    t = batch.get(name)
    if not isinstance(t, torch.Tensor) or getattr(t, "is_nested", False) or t.dim() != 1:
        raise ValueError(f"field {name!r} must be a dense [B] tensor of token counts, got {getattr(t, 'shape', t)}")
    if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
        raise ValueError(f"field {name!r} must hold integers, got dtype {t.dtype}")
    return [_as_length(v, f"{name}[{i}]") for i, v in enumerate(t.tolist())]


def _as_length(value: Any, where: str) -> int:
    if isinstance(value, torch.Tensor):
        value = value.item()
    if (
        isinstance(value, bool)
        or not isinstance(value, numbers.Real)
        or value != value
        or int(value) != value  # type: ignore[call-overload]  # typeshed: Real.__trunc__ is not int-typed
        or value < 0
    ):
        raise ValueError(f"{where} must be a non-negative int, got {value!r}")
    return int(value)  # type: ignore[call-overload, no-any-return]  # as above (so int() is untyped here)
