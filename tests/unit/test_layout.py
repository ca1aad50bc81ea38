"""Layouts: placements, meshes, the naming rules, fused local tensors, the JSON wire form."""

from __future__ import annotations

import json

import pytest
import torch

from nemo_dataplane.refit.reshard.layout import (
    Fused,
    Layout,
    LayoutError,
    Mesh,
    Only,
    ParamLayout,
    Replicate,
    Shard,
    parse_placement,
)
from nemo_dataplane.refit.reshard.rules import DEFAULT_FUSIONS, build_layout, fuse, layer_stages


def _params() -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    bf = torch.bfloat16
    return {
        "model.embed_tokens.weight": ((37, 8), bf),
        "model.layers.0.self_attn.q_proj.weight": ((8, 8), bf),
        "model.layers.0.self_attn.k_proj.weight": ((4, 8), bf),
        "model.layers.0.self_attn.v_proj.weight": ((4, 8), bf),
        "model.layers.0.self_attn.o_proj.weight": ((8, 8), bf),
        "model.layers.0.input_layernorm.weight": ((8,), torch.float32),
        "model.layers.1.mlp.experts.gate_proj": ((4, 6, 8), bf),
        "model.layers.1.mlp.experts.down_proj": ((4, 8, 6), bf),
        "model.layers.1.mlp.experts.gate_up_proj": ((4, 12, 8), bf),
        "model.layers.1.mlp.router_A_log": ((3,), torch.float32),
        "lm_head.weight": ((37, 8), bf),
    }


def test_placements_parse_back_and_bad_text_is_named() -> None:
    for p in (Shard(0), Shard(2), Replicate(), Only(3)):
        assert parse_placement(str(p)) == p
    with pytest.raises(LayoutError, match="'Shard[(]x[)]'"):
        parse_placement("Shard(x)")


def test_mesh_coordinates_are_row_major_and_checked() -> None:
    m = Mesh.of([10, 11, 12, 13, 14, 15], pp=2, tp=3)
    assert m.coords[10] == (0, 0) and m.coords[12] == (0, 2) and m.coords[13] == (1, 0) and m.coords[15] == (1, 2)
    with pytest.raises(LayoutError, match="need 6 ranks, got 5"):
        Mesh.of(range(5), pp=2, tp=3)
    with pytest.raises(LayoutError, match="appears twice"):
        Mesh.of([0, 0], tp=2)


def test_rules_give_the_expected_placements() -> None:
    stage = layer_stages(2, 2)
    lay = build_layout(Mesh.of(range(8), pp=2, ep=2, tp=2), _params(), stage_of=stage)
    p = {n: ([str(x) for x in v.placements], v.rule) for n, v in lay.params.items()}
    assert p["model.embed_tokens.weight"] == (["Only(0)", "Replicate", "Shard(0)"], "vocab")
    assert p["model.layers.0.self_attn.q_proj.weight"] == (["Only(0)", "Replicate", "Shard(0)"], "column")
    assert p["model.layers.0.self_attn.o_proj.weight"] == (["Only(0)", "Replicate", "Shard(1)"], "row")
    assert p["model.layers.0.input_layernorm.weight"] == (["Only(0)", "Replicate", "Replicate"], "replicate")
    assert p["model.layers.1.mlp.experts.gate_proj"] == (["Only(1)", "Shard(0)", "Shard(1)"], "expert_column")
    assert p["model.layers.1.mlp.experts.down_proj"] == (["Only(1)", "Shard(0)", "Shard(2)"], "expert_row")
    # gate_up rows are [gate; up] per expert: never split over TP
    assert p["model.layers.1.mlp.experts.gate_up_proj"] == (["Only(1)", "Shard(0)", "Replicate"], "expert")
    assert p["model.layers.1.mlp.router_A_log"] == (["Only(1)", "Replicate", "Replicate"], None)
    assert p["lm_head.weight"] == (["Only(1)", "Replicate", "Shard(0)"], "vocab")
    with pytest.raises(LayoutError, match="pass stage_of"):
        build_layout(Mesh.of(range(2), pp=2), _params())


def test_boxes_follow_torch_chunk_including_uneven_splits() -> None:
    lay = build_layout(Mesh.of([4, 5, 6], tp=3), _params())
    full = torch.arange(37 * 8).reshape(37, 8)
    for r, chunk in zip((4, 5, 6), full.chunk(3, 0)):
        (lo, hi), (clo, chi) = lay.box("model.embed_tokens.weight", r)
        assert torch.equal(full[lo:hi, clo:chi], chunk)
    assert lay.box("model.layers.0.self_attn.o_proj.weight", 6) == ((0, 8), (6, 8))


def test_fused_local_tensors_hold_each_parts_shard_in_order() -> None:
    params = _params()
    lay = build_layout(Mesh.of([0, 1], tp=2), params, fusions=DEFAULT_FUSIONS)
    assert set(lay.fused) == {"model.layers.0.self_attn.qkv_proj.weight"}  # experts are never fused
    lt = lay.local_tensors(1)["model.layers.0.self_attn.qkv_proj.weight"]
    assert lt.shape == (8, 8) and lt.fuse_dim == 0
    assert [(p.split(".")[-2], box, off) for p, box, off in lt.parts] == [
        ("q_proj", ((4, 8), (0, 8)), 0),
        ("k_proj", ((2, 4), (0, 8)), 4),
        ("v_proj", ((2, 4), (0, 8)), 6),
    ]
    assert "model.layers.0.self_attn.q_proj.weight" not in lay.local_tensors(1)
    # an incomplete group stays unfused
    assert fuse(["a.q_proj.weight", "a.k_proj.weight"]) == {}


def test_json_roundtrip_and_fingerprint() -> None:
    lay = build_layout(Mesh.of(range(4), pp=2, tp=2), _params(), stage_of=layer_stages(2, 2), fusions=DEFAULT_FUSIONS)
    back = Layout.from_json(lay.to_json())
    assert back == lay and back.fingerprint == lay.fingerprint
    json.loads(lay.to_json())  # plain JSON, nothing pickled
    other = build_layout(
        Mesh.of([0, 2, 1, 3], pp=2, tp=2), _params(), stage_of=layer_stages(2, 2), fusions=DEFAULT_FUSIONS
    )
    assert other.fingerprint != lay.fingerprint
    with pytest.raises(LayoutError, match="missing or wrong field 'params'"):
        Layout.from_dict({"mesh": {"dims": ["tp"], "sizes": [1], "ranks": [0]}})


def test_bad_layouts_name_the_parameter() -> None:
    mesh = Mesh.of([0, 1], tp=2)
    with pytest.raises(LayoutError, match="'w': its rule is unknown .* not Shard[(]0[)]"):
        Layout(mesh, {"w": ParamLayout((4,), "float32", (Shard(0),), None)})
    with pytest.raises(LayoutError, match="'w': Only[(]2[)] but mesh dim 'tp' has size 2"):
        Layout(mesh, {"w": ParamLayout((4,), "float32", (Only(2),), "custom")})
    with pytest.raises(LayoutError, match="'w': Shard[(]1[)] .* has 1 dims"):
        Layout(mesh, {"w": ParamLayout((4,), "float32", (Shard(1),), "custom")})
    with pytest.raises(LayoutError, match="fused 'f': part 'b' is not a parameter"):
        Layout(mesh, {"a": ParamLayout((4,), "float32", (Replicate(),), "x")}, {"f": Fused(0, ("a", "b"))})
    with pytest.raises(LayoutError, match="unknown dtype 'float7'"):
        Layout(mesh, {"w": ParamLayout((4,), "float7", (Replicate(),), "x")})


def test_overrides_set_or_drop_a_rule() -> None:
    lay = build_layout(
        Mesh.of([0, 1], tp=2),
        _params(),
        overrides={"model.layers.0.self_attn.o_proj.weight": None, "model.layers.1.mlp.router_A_log": ["Shard(0)"]},
    )
    assert lay.params["model.layers.0.self_attn.o_proj.weight"].rule is None
    assert lay.params["model.layers.0.self_attn.o_proj.weight"].placements == (Replicate(),)
    assert lay.params["model.layers.1.mlp.router_A_log"].placements == (Shard(0),)
