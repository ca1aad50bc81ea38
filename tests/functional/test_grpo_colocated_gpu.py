"""grpo_sync with ``generation.placement=colocated`` on 2 GPUs: a policy rank and a vLLM engine on
each, vLLM asleep while the trainer works, the refit over CUDA IPC (docs/generation.md,
"Colocated placement"). Skipped without 2 GPUs or without vLLM's CUDA build.

Checked: the run learns the toy task; each engine's memory handover in the summary shows less GPU
memory in use asleep than generating; a colocated engine SIGKILLed mid-run is replaced on the GPU it
left and the run trains to its last step without a restart.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "unit"))
from _vllm_helpers import skip_unless_gpu_vllm  # noqa: E402

skip_unless_gpu_vllm(2)

pytestmark = pytest.mark.gpu
COLOCATED = (
    "policy.device=cuda",
    "generation.device=cuda",
    "generation.backend=vllm",
    "generation.placement=colocated",
    "trainer.dp_size=2",
    "generation.num_engines=2",
    "policy.dist_backend=nccl",
    # FlashAttention's head size: the toy model's 1 head of 64 (docs/generation.md, "GPU").
    "policy.model.hf_config.num_attention_heads=1",
    "policy.model.hf_config.num_key_value_heads=1",
    "trainer.val_every=0",
)


def test_colocated_sync_on_two_gpus_learns_the_toy_task(run_trainer: Any, tmp_path: Path) -> None:
    run = run_trainer(tmp_path / "colocated", *COLOCATED, "trainer.steps=30", timeout=300)
    assert run.returncode == 0, run.explain()
    rewards = [r["reward"] for r in run.rows]
    print(f"colocated: reward {rewards[0]:.3f} -> {rewards[-1]:.3f}")
    assert len(rewards) == 30 and sum(rewards[-3:]) / 3 > 0.5, rewards
    handovers = run.summary["generator_memory_handover"]  # GPU bytes in use generating, asleep
    print("memory handover (GiB):", [(round(a / 2**30, 2), round(b / 2**30, 2)) for a, b in handovers])
    assert len(handovers) == 2 and all(asleep < awake for awake, asleep in handovers), handovers
    versions = run.summary["generator_versions"]
    assert len(versions) == 2 and versions[0] == versions[1] >= 29, versions  # both refit every step


def test_a_lost_colocated_engine_is_replaced_on_its_gpu(run_trainer: Any, tmp_path: Path) -> None:
    kill = ("debug.fail_in=generator", "debug.fail_at_step=4", "debug.fail_rank=1", "debug.fail_mode=sigkill")
    # The replacement joins once its vLLM engine is up (generation.replacement_join=ready, about
    # 25 s on a GPU): enough steps for it to join and generate.
    run = run_trainer(tmp_path / "lose", *COLOCATED, "trainer.steps=120", "refit.timeout_s=60", *kill, timeout=420)
    assert run.returncode == 0, run.explain()
    s = run.summary
    print({k: s.get(k) for k in ("generators_lost_total", "generators_replaced_total", "groups_requeued_lost_total")})
    print("replacement first generation s:", s.get("replacement_first_generation_s"))
    assert [r["step"] for r in run.rows] == list(range(120)), "every step trained, no resume"
    assert s["generators_lost_total"] == 1 and s["generators_replaced_total"] == 1, s
    assert len(s["replacement_first_generation_s"]) == 1, "the replacement generated on the GPU it took"
    (loss,) = s["generator_losses"]
    trained_s = loss["trained_at"] - loss["seen_at"]
    print(f"loss seen -> generation going on {loss['resumed_s']:.2f} s; -> a step trained {trained_s:.2f} s")
    assert "every GPU of the colocated placement already holds an engine" not in run.stderr
