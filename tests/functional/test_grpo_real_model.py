"""End to end with a checkpoint as a user brings one, as docs/grpo_sync.md ("Bring your own model")
walks through it: ``examples/make_tiny_checkpoint.py`` builds a tiny Llama with its own byte-level
BPE tokenizer and JSONL word problems (custom keys); ``grpo_sync`` and ``grpo_async`` (one run
each, side by side) train it with the ``math`` reward, ``policy.precision=bf16``, the data plane
on and ``checkpoint.export_hf=true``; then ``transformers`` loads the export with the saved
policy's logits, and vLLM (CPU) loads it with its tokenizer and generates (skipped without vLLM).
"""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

REPO = Path(__file__).resolve().parents[2]
STEPS = 3
HF_DIRS = ("step_000002", "step_000003", "final")  # checkpoint.every=2, and the last step


def _as_documented(tmp_path: Path) -> tuple[Path, Path]:
    """The walkthrough's first command, verbatim but for the paths."""
    model, data = tmp_path / "model", tmp_path / "problems.jsonl"
    subprocess.run(
        [sys.executable, "examples/make_tiny_checkpoint.py", "--model", str(model), "--problems", str(data)],
        cwd=REPO,
        check=True,
        capture_output=True,
        timeout=300,
    )
    return model, data


def _logits(model_dir: Path, state: dict[str, torch.Tensor] | None, ids: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), local_files_only=True, dtype=torch.bfloat16)
    if state is not None:
        model.load_state_dict(state)
    with torch.no_grad():
        return model.eval()(input_ids=ids).logits


_VLLM_SCRIPT = r"""
import json, os, sys
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
from vllm import LLM, SamplingParams
llm = LLM(model=sys.argv[1], dtype="bfloat16", kv_cache_memory_bytes=64 << 20, enforce_eager=True, max_num_seqs=8)
outs = llm.generate(["What is 3 + 4?"] * 2, SamplingParams(max_tokens=8, temperature=0.0), use_tqdm=False)
print("RESULT", json.dumps([{"text": o.outputs[0].text, "ids": list(o.outputs[0].token_ids)} for o in outs]))
"""


def test_grpo_sync_and_async_train_a_real_checkpoint_in_bf16_and_export_it_for_transformers_and_vllm(
    run_trainers_concurrently: Any, small_overrides: tuple[str, ...], tmp_path: Path
) -> None:
    model, data = _as_documented(tmp_path)
    common = (
        *small_overrides,
        f"trainer.steps={STEPS}",
        f"policy.model.path={model}",
        "policy.model.hf_config=null",
        f"task.dataset={data}",
        "task.prompt_key=question",
        "task.answer_key=gold",
        "task.reward_fn=math",
        "task.val_size=4",
        "policy.precision=bf16",
        "checkpoint.every=2",
        "checkpoint.export_hf=true",
    )
    runs = run_trainers_concurrently(
        [(tmp_path / "sync", common, "grpo_sync"), (tmp_path / "async", common, "grpo_async")], timeout=800
    )
    ids = torch.tensor([[1, *range(40, 52)]])
    initial = _logits(model, None, ids)
    for run in runs:
        assert run.returncode == 0, run.explain()
        rows = run.rows
        assert [r["step"] for r in rows] == list(range(STEPS)), run.explain()
        for r in rows:
            assert math.isfinite(r["reward"]) and 0.0 <= r["reward"] <= 1.0, r
            assert math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) and r["response_len"] > 0, r
            # Sync clears each step's rollouts; async streams the next steps' groups meanwhile.
            assert run is runs[1] or r["keys_outstanding"] == 0, r
        assert run.summary["prompts"] == {"train": 20, "val": 4}
        assert run.summary["keys_leaked_at_exit"] == 0 and run.summary["keys_outstanding_at_exit"] == 0
        hf = run.out_dir / "hf"
        assert sorted(p.name for p in hf.iterdir()) == sorted(HF_DIRS)
        for name in HF_DIRS:
            for f in ("config.json", "model.safetensors", "tokenizer.json", "generation_config.json"):
                assert (hf / name / f).is_file(), (name, f)
            assert json.loads((hf / name / "config.json").read_text())["dtype"] == "bfloat16"
        # The regular checkpoint records the tokenizer it was trained with.
        last = run.out_dir / "checkpoints" / f"step_{STEPS:06d}"
        driver = torch.load(last / "driver.pt", weights_only=False)
        assert driver["tokenizer"]["kind"] == "HFTokenizer" and driver["tokenizer"]["path"] == str(model)
        # transformers loads the final export with the saved policy's logits, which training moved.
        policy = torch.load(last / "policy.pt", weights_only=False)
        assert {t.dtype for t in policy["model"].values()} == {torch.bfloat16}
        assert {m.dtype for m in policy["trained"]["master"]} == {torch.float32}
        exported = _logits(hf / "final", None, ids)
        assert torch.equal(exported, _logits(model, policy["model"], ids))
        assert not torch.equal(exported, initial), "three steps of training changed the policy"

    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vLLM is not installed: the export's vLLM load is not checked")
    proc = subprocess.run(
        [sys.executable, "-c", _VLLM_SCRIPT, str(runs[0].out_dir / "hf" / "final")],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.split("RESULT ", 1)[1])
    assert len(result) == 2 and all(1 <= len(r["ids"]) <= 8 for r in result), result
    assert result[0] == result[1], "greedy: the same prompt gives the same completion"
