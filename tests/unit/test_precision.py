"""``policy.precision`` (algorithms/precision.py), the Hugging Face export (``checkpoint.export_hf``)
and the checks made at config load: bf16 weights with float32 masters and AdamW state, an export
``transformers`` loads with the trained logits, the tokenizer a checkpoint records, vLLM's CPU
head sizes refused before anything starts."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from algorithms.config import ConfigError, load_config
from algorithms.precision import PRECISIONS, precision_of
from algorithms.tasks import CharTokenizer
from algorithms.tokenizers import build_tokenizer, check_tokenizer_record, tokenizer_record
from algorithms.workers.policy import PolicyWorker

REPO = Path(__file__).resolve().parents[2]
TINY = [
    "policy.model.arch=llama",
    "policy.model.seed=0",
    "policy.model.hf_config.hidden_size=32",
    "policy.model.hf_config.intermediate_size=64",
    "policy.model.hf_config.num_hidden_layers=1",
    "policy.model.hf_config.num_attention_heads=1",
    "policy.model.hf_config.num_key_value_heads=1",
    "policy.model.hf_config.max_position_embeddings=64",
]


def _own_model(path: Path) -> list[str]:
    return [f"policy.model.path={path}", "policy.model.hf_config=null"]


def test_precision_is_fp32_by_default_and_megatron_takes_bf16_and_export() -> None:
    cfg = load_config(None, TINY)
    assert cfg.policy.precision == "fp32" and cfg.checkpoint.export_hf is False
    assert precision_of(cfg) == PRECISIONS["fp32"] and PRECISIONS["bf16"].dtype_name == "bfloat16"
    with pytest.raises(ConfigError, match="policy.precision"):
        load_config(None, [*TINY, "policy.precision=fp16"])
    mega = [*TINY, "policy.backend=megatron", "policy.device=cuda", "generation.device=cuda", "refit.backend=nccl"]
    both = load_config(None, [*mega, "policy.precision=bf16", "checkpoint.export_hf=true"])
    assert precision_of(both).dtype == torch.bfloat16 and both.checkpoint.export_hf


def test_sharded_precision_keeps_float32_shards_as_masters() -> None:
    bf16 = PRECISIONS["bf16"]
    assert PRECISIONS["fp32"].fsdp_policy() is None
    policy = bf16.fsdp_policy()
    assert policy.param_dtype == torch.bfloat16 and policy.reduce_dtype == torch.float32
    model = torch.nn.Linear(4, 3)
    trained = bf16.train_sharded(model)
    assert not trained.master and {p.dtype for p in trained.params} == {torch.float32}
    assert all(a is b for a, b in zip(trained.params, model.parameters())), "the shards themselves are stepped"


def test_bf16_keeps_the_rotary_frequencies_float32_as_transformers_loads_them(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    from algorithms.models import build_model, save_pretrained_dir

    model = build_model(dict(load_config(None, TINY).policy.model), vocab_size=20)
    PRECISIONS["bf16"].train(model)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert {b.dtype for b in model.buffers()} == {torch.float32}, "rounded, they would misplace long positions"
    save_pretrained_dir(model, tmp_path / "m")
    loaded = AutoModelForCausalLM.from_pretrained(str(tmp_path / "m"), local_files_only=True, dtype=torch.bfloat16)
    for (n, a), (_, b) in zip(loaded.named_buffers(), model.named_buffers()):
        assert a.dtype == b.dtype and torch.equal(a, b), n


def test_bf16_gradients_accumulate_into_fp32_masters_and_the_step_publishes_them_rounded() -> None:
    from algorithms.models import build_model

    model = build_model(dict(load_config(None, TINY).policy.model), vocab_size=20)
    initial = [p.detach().clone() for p in model.parameters()]
    trained = PRECISIONS["bf16"].train(model)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert all(torch.equal(m, p) for m, p in zip(trained.params, initial)), "masters keep the fp32 init"
    ids = torch.tensor([[1, 5, 7, 3, 2]])
    grads = []
    for _ in range(2):  # two micro-batches
        model(input_ids=ids).logits.float().square().mean().backward()
        grads.append([m.grad.clone() for m in trained.params])
        assert all(p.grad is None for p in model.parameters()), "the bf16 gradient moved to the master"
    assert all(g.dtype == torch.float32 for g in grads[1])
    assert all(torch.allclose(b, 2 * a, rtol=1e-2, atol=1e-6) for a, b in zip(grads[0], grads[1]))
    opt = torch.optim.AdamW(trained.params, lr=1e-2)
    opt.step()
    trained.publish()
    assert all(torch.equal(p, m.to(torch.bfloat16)) for p, m in zip(model.parameters(), trained.params))
    assert not all(torch.equal(m, p) for m, p in zip(trained.params, initial)), "the step moved the masters"
    # A checkpoint holds the masters; loading restores them and the model's weights from them.
    state = trained.state_dict()
    other_model = build_model(dict(load_config(None, TINY).policy.model), vocab_size=20)
    other = PRECISIONS["bf16"].train(other_model)
    other.load_state_dict(state)
    assert all(torch.equal(a, b) for a, b in zip(other.params, trained.params))
    assert all(torch.equal(a, b) for a, b in zip(other_model.parameters(), model.parameters()))


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_the_hf_export_loads_in_transformers_with_the_trained_logits(
    precision: str, make_real_model: Any, tmp_path: Path
) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = make_real_model(tmp_path / "model")
    cfg = load_config(None, [*_own_model(model_dir), f"policy.precision={precision}"])
    ranks = [PolicyWorker(r, 2, cfg) for r in range(2)]
    w = ranks[0]
    with torch.no_grad():  # trained weights, not the checkpoint's
        for m in w.engine.trained.params:
            m.add_(torch.randn(m.shape, generator=torch.Generator().manual_seed(0)) * 0.05)
    w.engine.trained.publish()
    out = tmp_path / "hf"
    assert ranks[1].export_hf(str(out)) is None and not out.exists(), "rank 1 writes nothing"
    assert w.export_hf(str(out)) == str(out)
    assert (out / "model.safetensors").is_file() and (out / "tokenizer.json").is_file()
    config = json.loads((out / "config.json").read_text())
    dtype = PRECISIONS[precision].dtype
    assert config["dtype"] == PRECISIONS[precision].dtype_name
    tok = w.tokenizer
    assert (config["eos_token_id"], config["pad_token_id"]) == (tok.eos_id, tok.pad_id)
    loaded = AutoModelForCausalLM.from_pretrained(str(out), local_files_only=True, dtype=dtype).eval()
    assert AutoTokenizer.from_pretrained(str(out)).encode("What is 3 + 4?") == tok.encode("What is 3 + 4?")
    ids = torch.tensor([tok.encode_prompt("What is 3 + 4?")])
    trained_model = w.engine.model.eval()
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=ids).logits, trained_model(input_ids=ids).logits)


def test_the_char_tokenizer_exports_its_own_file(tmp_path: Path) -> None:
    w = PolicyWorker(0, 1, load_config(None, TINY))
    w.export_hf(str(tmp_path / "hf"))
    assert (tmp_path / "hf" / "config.json").is_file()
    assert CharTokenizer.load(tmp_path / "hf").chars == w.tokenizer.chars  # type: ignore[attr-defined]


def test_a_checkpoint_of_another_tokenizer_is_refused_naming_policy_tokenizer(
    make_real_model: Any, tmp_path: Path
) -> None:
    hf = build_tokenizer(load_config(None, _own_model(make_real_model(tmp_path / "m"))))
    char = build_tokenizer(load_config(None, TINY))
    saved = tokenizer_record(hf)
    assert saved["kind"] == "HFTokenizer" and saved["vocab_sha256"]
    check_tokenizer_record(saved, hf, "ckpt")  # the same one passes
    check_tokenizer_record(None, char, "ckpt")  # a checkpoint that recorded none passes
    with pytest.raises(ConfigError, match=r"policy.tokenizer: the checkpoint ckpt was trained with HFTokenizer"):
        check_tokenizer_record(saved, char, "ckpt")
    moved = {**saved, "path": "/elsewhere"}
    check_tokenizer_record(moved, hf, "ckpt")  # a moved directory with the same vocabulary passes


_HEAD_SIZE_SCRIPT = r"""
import sys
from algorithms.config import ConfigError, load_config
from algorithms.inputs import check_run_inputs, load_datasets
cfg = load_config(None, sys.argv[1:])
try:
    check_run_inputs(cfg, *load_datasets(cfg))
    print("accepted")
except ConfigError as e:
    print("refused:", e)
print("vllm imported:", "vllm" in sys.modules)
"""


def test_a_head_size_vllms_cpu_attention_cannot_run_is_refused_at_load_without_importing_vllm() -> None:
    def check(*overrides: str) -> str:
        proc = subprocess.run(
            [sys.executable, "-c", _HEAD_SIZE_SCRIPT, *TINY, "generation.backend=vllm", *overrides],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        return proc.stdout

    out = check("policy.model.hf_config.num_attention_heads=2", "policy.model.hf_config.num_key_value_heads=2")
    assert "refused: policy.model.hf_config.num_attention_heads: attention head size 16" in out, out
    assert "vllm imported: False" in out, out
    assert "accepted" in check(), "head size 32 runs"
