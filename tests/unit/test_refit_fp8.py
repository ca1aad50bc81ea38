"""FP8 refits on the CPU: the quantizer's error bound, the layout both ends build, a real gloo
refit of FP8 bytes plus scales (bit-exact, twice, into staging laid out as the vLLM worker lays
it out), a mismatch of forms named at the handshake, the engine's first checkpoint in the refit's
form, and the config errors. The engine side on GPUs: test_refit_fp8_gpu.py."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from algorithms.config import ConfigError, load_config
from algorithms.models import build_model
from algorithms.refit_weights import RefitWeights, form_of, fp8_targets, refit_weights
from nemo_dataplane.refit.fp8 import FP8_MAX, Fp8Scheme, Fp8Source, dequantize, fp8_layout

sys.path.insert(0, str(Path(__file__).parent))
import _fp8_procs as F  # noqa: E402
import _refit_procs as P  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "examples" / "configs" / "grpo_tiny.yaml"
GPU_VLLM = ["generation.backend=vllm", "generation.device=cuda", "policy.device=cuda", "refit.backend=nccl"]


@pytest.fixture(scope="module")
def pool() -> Any:
    ex = P.Pool()
    yield ex
    ex.kill()


@pytest.mark.parametrize("block", [None, (128, 128), (4, 8)])
def test_quantized_weights_dequantize_within_e4m3_precision(block: tuple[int, int] | None) -> None:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(300, 260, generator=g) * torch.logspace(-3, 1, 260)  # columns over 4 decades
    w[7] = 0.0  # an all-zero row (and, block-wise, all-zero blocks)
    scheme = Fp8Scheme(block)
    q, scale = scheme.quantize(w.bfloat16())
    assert q.dtype == torch.float8_e4m3fn and q.shape == w.shape
    assert tuple(scale.shape) == scheme.scale_shape(w.shape) and scale.dtype == torch.float32
    deq = dequantize(q, scale, block)
    ref = w.bfloat16().float()
    bound = ref.abs() / 16 + float(scale.amax()) * 2.0**-9  # 3 mantissa bits; the subnormal step
    assert bool(((deq - ref).abs() <= bound).all())
    assert bool((deq[7] == 0).all())
    # Each scale maps its tile's largest magnitude onto the format's largest value.
    assert float(q.float().abs().amax()) == FP8_MAX
    if block is not None:
        rows, cols = block
        tile = ref[:rows, :cols].abs().amax()
        assert torch.allclose(scale[0, 0], tile / FP8_MAX)


def test_the_layout_puts_each_scale_after_its_matrix_and_keeps_the_rest() -> None:
    shapes = {"a.weight": ((300, 260), torch.bfloat16), "b": ((5,), torch.float32), "c.weight": ((8, 8), "bfloat16")}
    per_tensor = fp8_layout(shapes, ["a.weight", "c.weight"], Fp8Scheme())
    assert list(per_tensor.items()) == [
        ("a.weight", ((300, 260), "float8_e4m3fn")),
        ("a.weight_scale", ((1,), "float32")),
        ("b", ((5,), "float32")),
        ("c.weight", ((8, 8), "float8_e4m3fn")),
        ("c.weight_scale", ((1,), "float32")),
    ]
    blocks = fp8_layout(shapes, ["a.weight"], Fp8Scheme((128, 128)))
    assert blocks["a.weight_scale_inv"] == ((3, 3), "float32") and "c.weight_scale_inv" not in blocks
    with pytest.raises(ValueError, match="'b' has shape"):
        fp8_layout(shapes, ["b"], Fp8Scheme())
    with pytest.raises(ValueError, match="nope"):
        fp8_layout(shapes, ["nope"], Fp8Scheme())


def test_the_targets_are_the_decoder_layers_matrices_and_the_source_reuses_its_buffers() -> None:
    hf = {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 2}
    model = build_model({"arch": "llama", "seed": 0, "hf_config": hf}, vocab_size=40)
    shapes = {n: (p.shape, p.dtype) for n, p in model.named_parameters()}
    targets = fp8_targets(shapes)
    projections = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    assert targets == [
        f"model.layers.{i}.{'self_attn' if p[0] in 'qkvo' else 'mlp'}.{p}.weight" for i in range(2) for p in projections
    ]
    source = RefitWeights(Fp8Scheme()).source(model.named_parameters, shapes)
    first = dict(source())  # type: ignore[operator]
    assert list(first) == list(RefitWeights(Fp8Scheme()).layout(shapes))
    q_name = "model.layers.1.self_attn.q_proj.weight"
    with torch.no_grad():
        model.get_parameter(q_name).mul_(3.0)
    second = dict(source())  # type: ignore[operator]
    # The same buffers (a transport that mapped them once sees every refit), with new contents.
    assert second[q_name].data_ptr() == first[q_name].data_ptr()
    assert torch.allclose(second[q_name + "_scale"], 3.0 * Fp8Scheme().quantize(model.get_parameter(q_name) / 3)[1])
    assert second["model.embed_tokens.weight"] is model.get_parameter("model.embed_tokens.weight")
    with pytest.raises(ValueError, match="not among the sender's weights"):
        dict(Fp8Source({"x": torch.ones(2, 2)}, ["y"], Fp8Scheme())())


@pytest.mark.parametrize("form", ["fp8", "fp8_block"])
def test_an_fp8_refit_over_gloo_is_bit_exact_twice_at_about_half_the_bf16_bytes(pool: P.Pool, form: str) -> None:
    res = P.run_ranks(pool, F.fp8_refit, [0, 1], world=2, port=P.free_port(), send=form, expect=form)
    assert not isinstance(res[1], BaseException), P.format_exc(res[1])
    assert not isinstance(res[0], BaseException), P.format_exc(res[0])
    refits = res[1]["refits"]
    assert [r["version"] for r in refits] == [1, 2]
    assert [r["wrong"] for r in refits] == [[], []], refits
    assert all(0 < r["err_over_bound"] <= 1.0 for r in refits), refits
    assert len(res[1]["fp8"]) == 14  # 7 projections x 2 layers
    bf16 = P.run_ranks(pool, F.fp8_refit, [0, 1], world=2, port=P.free_port(), send=None, expect=None)
    assert [r["wrong"] for r in bf16[1]["refits"]] == [[], []]
    ratio = res[0]["bytes"] / bf16[0]["bytes"]
    # The matrices halve; the embeddings and LM head (vocab 34 x 128 each) stay bf16.
    assert 0.5 < ratio < 0.62, ratio


def test_a_receiver_expecting_another_form_is_named_at_the_handshake(pool: P.Pool) -> None:
    res = P.run_ranks(pool, F.fp8_refit, [0, 1], world=2, port=P.free_port(), send="fp8_block", expect="fp8")
    for r in (0, 1):
        assert res[r]["error"] == "RefitMismatchError", res[r]
    msg = res[1]["msg"]
    assert "model.layers.0.self_attn.q_proj.weight_scale_inv: sent by the trainer" in msg
    assert "model.layers.0.self_attn.q_proj.weight_scale: receiver tensor not sent" in msg
    assert res[1]["untouched"]


def test_the_engines_first_checkpoint_is_in_the_refit_form(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    from algorithms.engines.generation.vllm import _to_refit_form
    from algorithms.models import save_pretrained_dir

    hf = {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 1, "num_attention_heads": 2}
    model = build_model({"arch": "llama", "seed": 0, "hf_config": hf}, vocab_size=40).to(torch.bfloat16)
    weights = RefitWeights(Fp8Scheme((128, 128)))
    save_pretrained_dir(model, tmp_path)
    _to_refit_form(str(tmp_path), weights)
    state = load_file(tmp_path / "model.safetensors")
    layout = weights.layout({n: (p.shape, p.dtype) for n, p in model.named_parameters()})
    assert {n: (tuple(t.shape), str(t.dtype).removeprefix("torch.")) for n, t in state.items()} == layout
    assert json.loads((tmp_path / "config.json").read_text())["quantization_config"] == {
        "quant_method": "fp8",
        "activation_scheme": "dynamic",
        "weight_block_size": [128, 128],
    }


def test_the_config_refuses_what_an_fp8_refit_cannot_serve_naming_the_key() -> None:
    from algorithms.engines.generation import check_generation_config

    with pytest.raises(ConfigError, match="generation.vllm.quantization=fp8 needs generation.backend=vllm"):
        load_config(TINY, ["generation.vllm.quantization=fp8"])
    base = [*GPU_VLLM, "policy.model.hf_config.num_attention_heads=2", "policy.model.hf_config.num_key_value_heads=2"]
    cfg = load_config(TINY, [*base, "generation.vllm.quantization=fp8"])
    with pytest.raises(ConfigError, match="bfloat16 or float16, got float32: set generation.vllm.dtype"):
        check_generation_config(cfg)
    cfg = load_config(TINY, [*base, "generation.vllm.quantization=fp8", "policy.precision=bf16"])
    check_generation_config(cfg)
    assert refit_weights(cfg) == RefitWeights(Fp8Scheme())
    cfg = load_config(TINY, [*base, "generation.vllm.quantization=fp8_block", "generation.vllm.dtype=bfloat16"])
    with pytest.raises(
        ConfigError, match="whole 128-row blocks; policy.model has .*'num_attention_heads \\* head_dim': 64"
    ):
        check_generation_config(cfg)
    assert refit_weights(load_config(TINY)) == RefitWeights() == form_of(None)
    with pytest.raises(ValueError, match="generation.vllm.quantization must be one of"):
        form_of("int4")
