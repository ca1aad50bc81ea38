"""End to end with a checkpoint as a user brings one: ``grpo_sync`` on a tiny Llama with its own
byte-level BPE tokenizer (built at test time: ``make_real_model`` in tests/conftest.py), word
problems from a JSONL file with custom keys, the ``math`` reward, data plane on."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def test_grpo_sync_trains_a_real_checkpoint_on_word_problems_with_the_math_reward(
    run_trainer, make_real_model, tmp_path: Path
) -> None:
    model = make_real_model(tmp_path / "model")
    data = tmp_path / "problems.jsonl"
    data.write_text(
        "".join(
            json.dumps({"question": f"What is {a} + {b}?", "gold": a + b}) + "\n" for a in range(6) for b in range(4)
        )
    )
    run = run_trainer(
        tmp_path / "run",
        "data_plane.enabled=true",
        "trainer.steps=3",
        f"policy.model.path={model}",
        "policy.model.hf_config=null",
        f"task.dataset={data}",
        "task.prompt_key=question",
        "task.answer_key=gold",
        "task.reward_fn=math",
        "task.val_size=4",
        small=True,
    )
    assert run.returncode == 0, run.explain()
    rows = run.rows
    assert [r["step"] for r in rows] == [0, 1, 2]
    for r in rows:
        assert math.isfinite(r["reward"]) and 0.0 <= r["reward"] <= 1.0, r
        assert math.isfinite(r["loss"]) and r["response_len"] > 0, r
        assert r["keys_outstanding"] == 0 and r["dp_bytes"] > 0, r
    assert rows[-1]["val_reward"] is not None and 0.0 <= rows[-1]["val_reward"] <= 1.0
    assert run.summary["prompts"] == {"train": 20, "val": 4}
    assert run.summary["keys_outstanding_at_exit"] == 0
