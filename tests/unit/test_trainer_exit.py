"""What a run's exit reports about the store: keys counted before the final clear (so a leak can
show), and a run that finished but leaked exits 3. The trainer's own shutdown on a real store
client (the in-memory backend; no Ray: no worker was started)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from algorithms.config import load_config
from algorithms.grpo_sync import SyncTrainer
from algorithms.rollouts import LEAK_EXIT, ROLLOUTS, leak_exit
from nemo_dataplane.adapters.memory import InMemoryClient

CONFIG = Path(__file__).resolve().parents[2] / "examples" / "configs" / "grpo_tiny.yaml"


def _trainer_with_store(tmp_path: Path, keys: dict[str, list[str]], in_flight: set[int]) -> SyncTrainer:
    trainer = SyncTrainer(load_config(CONFIG, [f"logging.output_dir={tmp_path}"]))
    client = InMemoryClient()
    for partition, names in keys.items():
        client.kv_batch_put(names, partition, {"x": torch.zeros(len(names), 1)})
    trainer.transport.client = client  # type: ignore[attr-defined]  # the data-plane transport's store
    trainer._transport_started = True
    trainer._collecting = in_flight  # the sync step's groups while its collector writes them
    return trainer


def test_keys_at_exit_are_counted_before_the_clear_and_a_leak_is_named(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    stored = {ROLLOUTS: ["v3/g7/s0", "v3/g7/s1", "v2/g5/s0"], "scratch": ["left-over"]}
    trainer = _trainer_with_store(tmp_path, stored, in_flight={7})
    trainer._shutdown()
    s = trainer.summary
    assert s["keys_in_store_at_exit"] == 4
    assert s["keys_leaked_at_exit"] == 2, "group 5's row and the stray key belong to no group in flight"
    assert s["keys_outstanding_at_exit"] == 0, "then the store was emptied (an audit listing, after the clear)"
    assert trainer.transport.client is None, "and closed"  # type: ignore[attr-defined]
    err = capsys.readouterr().err
    assert "2 key(s) leaked" in err and "v2/g5/s0" in err and "left-over" in err


def test_rows_of_groups_in_flight_are_no_leak(tmp_path: Path) -> None:
    trainer = _trainer_with_store(tmp_path, {ROLLOUTS: ["v3/g7/s0", "v3/g7/s1"]}, in_flight={7})
    trainer._shutdown()
    assert trainer.summary["keys_in_store_at_exit"] == 2 and trainer.summary["keys_leaked_at_exit"] == 0


def test_a_finished_run_that_leaked_exits_3_and_other_exits_keep_their_code() -> None:
    assert leak_exit("finished", 0, {"keys_leaked_at_exit": 2}) == ("finished, but 2 key(s) leaked", LEAK_EXIT)
    assert LEAK_EXIT == 3
    assert leak_exit("finished", 0, {"keys_leaked_at_exit": 0}) == ("finished", 0)
    assert leak_exit("finished", 0, {"keys_leaked_at_exit": -1}) == ("finished", 0), "store gone: nothing counted"
    assert leak_exit("finished", 0, {}) == ("finished", 0)
    assert leak_exit("failed", 1, {"keys_leaked_at_exit": 5}) == ("failed", 1)
    assert leak_exit("interrupted (Ctrl-C)", 130, {"keys_leaked_at_exit": 5}) == ("interrupted (Ctrl-C)", 130)
