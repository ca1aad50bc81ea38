"""Layouts for common models from their parameter names: the default sharding rules
(column-, row- and vocab-parallel, replicated, grouped MoE experts), pipeline stages by layer,
and fused local tensors (q/k/v -> qkv, gate/up -> gate_up). ``build_layout`` turns a mesh and a
model's full parameter shapes into a :class:`~nemo_dataplane.refit.reshard.layout.Layout`.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping, Sequence

import torch

from nemo_dataplane.refit.reshard.layout import (
    Fused,
    Layout,
    LayoutError,
    Mesh,
    Only,
    ParamLayout,
    Placement,
    Replicate,
    Shard,
    parse_placement,
)

__all__ = ["DEFAULT_FUSIONS", "DEFAULT_RULES", "build_layout", "fuse", "layer_stages"]


# (regex on the Hugging Face name, rule). First match wins; names matching none get rule None.
DEFAULT_RULES: tuple[tuple[str, str], ...] = (
    (r"\.experts\.(gate_proj|up_proj|w1|w3)(\.weight)?$", "expert_column"),  # [E, out, in]
    (r"\.experts\.(down_proj|w2)(\.weight)?$", "expert_row"),  # [E, out, in]
    # A grouped gate_up is [gate; up] per expert: a TP split along its rows would mix the two
    # halves, so it is only ever split over experts.
    (r"\.experts\.gate_up_proj(\.weight)?$", "expert"),
    (r"\.(q_proj|k_proj|v_proj|gate_proj|up_proj)\.(weight|bias)$", "column"),
    (r"\.(o_proj|down_proj)\.weight$", "row"),
    (r"\.(o_proj|down_proj)\.bias$", "replicate"),
    (r"(^|\.)(embed_tokens|lm_head)\.weight$", "vocab"),
    (r"(norm|layernorm)\.(weight|bias)$", "replicate"),
)

# Local fused name -> its parts, by the last path component before ".weight"/".bias".
DEFAULT_FUSIONS: dict[str, tuple[str, ...]] = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}

_LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def layer_stages(
    num_layers: int, stages: int, *, last: Sequence[str] = ("lm_head.", "model.norm.")
) -> Callable[[str], int]:
    """Stage of a parameter under an even pipeline split of ``num_layers`` layers: layer ``i`` on
    stage ``i * stages // num_layers``, names starting with one of ``last`` on the last stage,
    everything else (embeddings) on stage 0."""
    if num_layers < 1 or stages < 1:
        raise LayoutError(f"layer_stages: num_layers and stages must be >= 1, got {num_layers}, {stages}")

    def stage_of(name: str) -> int:
        m = _LAYER_RE.search(name)
        if m is not None:
            return int(m[1]) * stages // num_layers
        return stages - 1 if name.startswith(tuple(last)) else 0

    return stage_of


def _rule_placements(
    rule: str | None, shape: Sequence[int], dims: Sequence[str], tp: str, ep: str, stage: int | None, pp: str
) -> tuple[Placement, ...]:
    out: list[Placement] = []
    for d in dims:
        if d == pp:
            out.append(Only(stage or 0))
        elif d == tp and rule in ("column", "vocab"):
            out.append(Shard(0))
        elif d == tp and rule == "row":
            out.append(Shard(1) if len(shape) >= 2 else Replicate())
        elif d == tp and rule == "expert_column":
            out.append(Shard(1))
        elif d == tp and rule == "expert_row":
            out.append(Shard(2))
        elif d == ep and rule in ("expert_column", "expert_row", "expert"):
            out.append(Shard(0))
        else:
            out.append(Replicate())
    return tuple(out)


def build_layout(
    mesh: Mesh,
    params: Mapping[str, tuple[Sequence[int], torch.dtype | str]],
    *,
    rules: Sequence[tuple[str, str]] = DEFAULT_RULES,
    tp: str = "tp",
    ep: str = "ep",
    pp: str = "pp",
    stage_of: Callable[[str], int] | None = None,
    fusions: Mapping[str, Sequence[str]] | None = None,
    overrides: Mapping[str, Sequence[str] | None] | None = None,
) -> Layout:
    """A layout from full parameter shapes and naming rules.

    ``params``: HF name -> (full shape, dtype). Rules (first regex match wins): ``column`` and
    ``vocab`` shard dim 0 over ``tp``, ``row`` dim 1; ``expert_column`` / ``expert_row`` (grouped
    ``[E, out, in]`` expert weights) shard dim 0 over ``ep`` and dim 1 / dim 2 over ``tp``;
    ``expert`` only over ``ep``; ``replicate`` nowhere. A parameter no rule matches gets rule
    None: held whole on every rank of its stage, moved whole from one sender. On a mesh with a
    ``pp`` dim, ``stage_of(name)`` gives each parameter's stage (``Only(stage)``; required).
    Mesh dims other than ``tp``/``ep``/``pp`` (data-parallel replicas) are ``Replicate``.
    ``fusions``: local fused names assembled on this side (``DEFAULT_FUSIONS`` for a vLLM-like
    generator; see ``fuse``). ``overrides``: name -> placement strings (rule ``"custom"``), or
    None to force the unknown-rule path for that name.
    """
    if pp in mesh.dims and mesh.size(pp) > 1 and stage_of is None:
        raise LayoutError(f"build_layout: the mesh has a {pp!r} dim of size {mesh.size(pp)}; pass stage_of")
    compiled = [(re.compile(rx), rule) for rx, rule in rules]
    out: dict[str, ParamLayout] = {}
    overrides = overrides or {}
    for name, (shape, dtype) in params.items():
        shape = tuple(int(s) for s in shape)
        dt = dtype if isinstance(dtype, str) else str(dtype).removeprefix("torch.")
        stage = stage_of(name) if stage_of is not None else 0
        if name in overrides:
            given = overrides[name]
            if given is None:
                out[name] = ParamLayout(shape, dt, _rule_placements(None, shape, mesh.dims, tp, ep, stage, pp), None)
            else:
                out[name] = ParamLayout(shape, dt, tuple(parse_placement(x) for x in given), "custom")
            continue
        rule = next((r for rx, r in compiled if rx.search(name)), None)
        out[name] = ParamLayout(shape, dt, _rule_placements(rule, shape, mesh.dims, tp, ep, stage, pp), rule)
    fused = fuse(out, fusions) if fusions else {}
    return Layout(mesh, out, fused)


def fuse(
    params: Mapping[str, ParamLayout] | Iterable[str],
    fusions: Mapping[str, Sequence[str]] = DEFAULT_FUSIONS,
    dim: int = 0,
    exclude: str | None = r"\.experts\.",
) -> dict[str, Fused]:
    """Fused local tensors for every complete group of ``fusions`` among ``params``' names.

    ``{"qkv_proj": ("q_proj", "k_proj", "v_proj")}`` turns ``...self_attn.q_proj.weight``,
    ``k_proj``, ``v_proj`` into ``...self_attn.qkv_proj.weight`` = their local shards
    concatenated along ``dim`` (on a TP rank: its q rows, then its k rows, then its v rows,
    as vLLM's ``QKVParallelLinear`` holds them). Groups missing a part are left unfused, and
    so are names matching ``exclude`` (grouped experts: their gate/up concatenate along dim 1).
    """
    skip = re.compile(exclude) if exclude else None
    names = {n for n in params if skip is None or not skip.search(n)}
    out: dict[str, Fused] = {}
    for fused_name, parts in fusions.items():
        first = parts[0]
        rx = re.compile(rf"^(.*(?:^|\.)){re.escape(first)}(\.[A-Za-z_]+)?$")
        for n in sorted(names):
            m = rx.match(n)
            if m is None:
                continue
            prefix, suffix = m[1], m[2] or ""
            group = [f"{prefix}{p}{suffix}" for p in parts]
            if all(g in names for g in group):
                out[f"{prefix}{fused_name}{suffix}"] = Fused(dim, tuple(group))
    return out
