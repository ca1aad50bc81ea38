"""The vLLM engine's settings (algorithms/engines/generation/vllm_settings.py), chosen from the
device, compute dtype and head size, and the config-load errors for what vLLM cannot run. No GPU
and no vLLM needed: the check runs before anything starts (the GPU tests hold the tables equal to
vLLM's backends)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from algorithms.config import ConfigError, load_config
from algorithms.engines.generation import check_generation_config
from algorithms.engines.generation.vllm_settings import CPU_HEAD_SIZES, choose_settings

REPO = Path(__file__).resolve().parents[2]


def _model(heads: int, hidden: int = 64) -> list[str]:
    return [
        "policy.model.arch=llama",
        "policy.model.seed=0",
        f"policy.model.hf_config.hidden_size={hidden}",
        "policy.model.hf_config.intermediate_size=64",
        "policy.model.hf_config.num_hidden_layers=1",
        f"policy.model.hf_config.num_attention_heads={heads}",
        f"policy.model.hf_config.num_key_value_heads={heads}",
        "policy.model.hf_config.max_position_embeddings=64",
    ]


GPU = ["policy.device=cuda", "generation.device=cuda", "refit.backend=nccl", "generation.backend=vllm"]


def _check(*overrides: str) -> None:
    check_generation_config(load_config(None, list(overrides)))


@pytest.mark.parametrize(
    ("device", "dtype", "head", "backend"),
    [
        ("cuda", "bfloat16", 64, "FLASH_ATTN"),
        ("cuda", "float16", 128, "FLASH_ATTN"),
        ("cuda", "bfloat16", 256, "FLASH_ATTN"),
        ("cuda", "float32", 64, "TRITON_ATTN"),  # FlashAttention has no fp32 kernel
        ("cuda", "bfloat16", 36, "TRITON_ATTN"),  # not a multiple of 8: FlashAttention refuses it
        ("cuda", "bfloat16", 512, "TRITON_ATTN"),  # above FlashAttention 3's 256
        ("cpu", "float32", 32, "CPU_ATTN"),
        ("cpu", "bfloat16", 128, "CPU_ATTN"),
    ],
)
def test_the_attention_backend_follows_device_dtype_and_head_size(
    device: str, dtype: str, head: int, backend: str
) -> None:
    assert choose_settings(device, dtype, head, multiprocessing=False).attention_backend == backend


def test_the_engine_sets_its_process_mode_and_sampler() -> None:
    gpu = choose_settings("cuda", "bfloat16", 64, multiprocessing=False)
    assert gpu.env == {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    assert gpu.env_defaults == {"VLLM_USE_FLASHINFER_SAMPLER": "0"}  # a user's own setting wins
    cpu = choose_settings("cpu", "float32", 32, multiprocessing=True)
    assert cpu.env == {"VLLM_ENABLE_V1_MULTIPROCESSING": "1"}
    assert cpu.env_defaults == {"VLLM_CPU_OMP_THREADS_BIND": "nobind"}


def test_unsupported_head_sizes_and_dtypes_are_refused_naming_the_key() -> None:
    # fp32 on GPU runs on Triton only, which needs 32 and above; bf16 would run 16 on FlashAttention.
    with pytest.raises(
        ConfigError, match=r"num_attention_heads: attention head size 16 .* generation\.vllm\.dtype=bfloat16"
    ):
        choose_settings("cuda", "float32", 16, multiprocessing=False)
    # No backend takes 20 in any dtype: only the head size can change.
    with pytest.raises(ConfigError, match=r"num_attention_heads: attention head size 20 ") as e:
        choose_settings("cuda", "bfloat16", 20, multiprocessing=False)
    assert "dtype=" not in str(e.value)
    with pytest.raises(ConfigError, match=r"policy\.precision: vLLM's GPU attention computes in"):
        choose_settings("cuda", "float64", 64, multiprocessing=False, dtype_key="policy.precision")
    with pytest.raises(
        ConfigError, match=r"generation\.vllm\.multiprocessing=true is not supported with generation\.device=cuda"
    ):
        choose_settings("cuda", "bfloat16", 64, multiprocessing=True)
    with pytest.raises(ConfigError, match=r"generation\.device must be one of"):
        choose_settings("tpu", "bfloat16", 64, multiprocessing=False)
    assert 48 not in CPU_HEAD_SIZES
    with pytest.raises(
        ConfigError,
        match=r"attention head size 48 in float32 \(generation\.vllm\.dtype\) is not supported by vLLM's CPU",
    ):
        choose_settings("cpu", "float32", 48, multiprocessing=False)


def test_a_gpu_config_vllm_cannot_run_is_refused_at_load() -> None:
    """The whole path a run takes before any worker starts (``check_run_inputs`` calls this)."""
    _check(*_model(heads=1), *GPU, "policy.precision=bf16")  # head 64, bf16: FlashAttention
    _check(*_model(heads=1), *GPU)  # head 64, fp32: Triton
    # 4 heads of 16 in fp32 (policy.precision's default): refused, naming the head count and
    # the dtype's key that would fix it.
    with pytest.raises(
        ConfigError,
        match=r"num_attention_heads: attention head size 16 in float32 \(policy\.precision\).*"
        r"generation\.vllm\.dtype=bfloat16",
    ):
        _check(*_model(heads=4), *GPU)
    # The engine's own dtype, when set, is the key named.
    with pytest.raises(
        ConfigError, match=r"head size 16 in float32 \(generation\.vllm\.dtype\).*generation\.vllm\.dtype=bfloat16"
    ):
        _check(*_model(heads=4), *GPU, "policy.precision=bf16", "generation.vllm.dtype=float32")
    _check(*_model(heads=4), *GPU, "generation.vllm.dtype=bfloat16")
    with pytest.raises(ConfigError, match=r"generation\.vllm\.multiprocessing"):
        _check(*_model(heads=1), *GPU, "generation.vllm.multiprocessing=true")
    # The HF engine takes any of these.
    _check(*_model(heads=4), "policy.device=cuda", "generation.device=cuda", "refit.backend=nccl")


def test_the_settings_module_imports_no_vllm() -> None:
    """Config load must not pay vLLM's ~10 s import (nor need it installed)."""
    tree = ast.parse((REPO / "algorithms/engines/generation/vllm_settings.py").read_text())
    names = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    names += [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    assert not [m for m in names if m.split(".")[0] == "vllm"], names
