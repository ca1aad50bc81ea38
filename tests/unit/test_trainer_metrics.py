"""Trainer metrics (JSONL, resume truncation, byte counting, plot, summary) and checkpoint layout."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import pytest
import torch

from algorithms.checkpoint import (
    complete_checkpoints,
    load_driver_state,
    load_trusted,
    mark_complete,
    resolve_resume,
    save_driver_state,
    step_dir,
)
from algorithms.metrics import STEP_KEYS, MetricsLogger, StartupProgress, payload_bytes, plot_metrics, summary_line
from algorithms.rollout_buffer import PromptLedger
from algorithms.tasks import PromptIterator, make_task_dataset
from nemo_dataplane.meta import KVBatchMeta


def test_payload_bytes_counts_tensor_storage_and_jagged_values_plus_offsets() -> None:
    dense = torch.zeros(10, 3, dtype=torch.float32)
    assert payload_bytes(dense) == 120
    jag = torch.nested.nested_tensor_from_jagged(torch.arange(7, dtype=torch.int64), offsets=torch.tensor([0, 3, 7]))
    assert payload_bytes(jag) == 7 * 8 + 3 * 8
    assert payload_bytes({"a": dense, "b": [dense, dense]}) == 360 + len(pickle.dumps("a")) + len(pickle.dumps("b"))
    meta = KVBatchMeta(keys=("k0", "k1"), tags=({}, {}), partition_id="p")
    assert payload_bytes(meta) == len(pickle.dumps(meta, protocol=pickle.HIGHEST_PROTOCOL))


def _row(step: int, reward: float) -> dict:
    return {"step": step, "reward": reward, "loss": 0.5 - reward, "step_s": 0.1, "keys_outstanding": 0}


def test_jsonl_has_every_documented_key_and_resume_truncates_later_steps(tmp_path: Path) -> None:
    log = MetricsLogger(tmp_path, total_steps=4, progress=False)
    for s in range(4):
        log.log_step(_row(s, 0.1 * s))
    log.close()
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == [0, 1, 2, 3]
    assert all(set(STEP_KEYS) <= set(r) for r in lines)
    assert lines[0]["kl"] is None  # absent values are written as null, not dropped

    # A run resumed from the step-2 checkpoint replays steps 2, 3: earlier lines stay, later go.
    log = MetricsLogger(tmp_path, total_steps=4, start_step=2, progress=False)
    assert [r["step"] for r in log.rows] == [0, 1]
    log.log_step(_row(2, 0.9))
    log.close()
    steps = [json.loads(x)["step"] for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert steps == [0, 1, 2]

    # A fresh run owns the file.
    MetricsLogger(tmp_path, total_steps=4, progress=False).close()
    assert (tmp_path / "metrics.jsonl").read_text() == ""


def test_plot_and_summary(tmp_path: Path) -> None:
    rows = [dict(_row(s, 0.2 * s), val_reward=(0.3 if s == 4 else None)) for s in range(5)]
    png = plot_metrics(rows, tmp_path / "p.png")
    assert png is not None and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert plot_metrics([], tmp_path / "none.png") is None
    line = summary_line(rows, wall_s=12.0, status="finished", files=[tmp_path / "metrics.jsonl"])
    assert "finished" in line and "0.200 -> 0.600" in line and "best val reward 0.300" in line


def test_checkpoint_resume_picks_the_newest_complete_one_and_prunes(tmp_path: Path) -> None:
    for s in (2, 4, 6):
        d = step_dir(tmp_path, s)
        d.mkdir(parents=True)
        if s != 6:  # step 6 "crashed" mid-save: no marker
            mark_complete(d, s, root=tmp_path, keep=0)
    assert resolve_resume("latest", tmp_path) == step_dir(tmp_path, 4)
    with pytest.raises(FileNotFoundError, match="no COMPLETE marker"):
        resolve_resume(str(step_dir(tmp_path, 6)), tmp_path)
    with pytest.raises(FileNotFoundError, match="no complete checkpoint"):
        resolve_resume("latest", tmp_path / "empty")
    assert resolve_resume(None, tmp_path) is None
    d8 = step_dir(tmp_path, 8)
    d8.mkdir()
    mark_complete(d8, 8, root=tmp_path, keep=2)
    assert complete_checkpoints(tmp_path) == [step_dir(tmp_path, 4), d8]


class _Payload:
    """What a hostile checkpoint would hold: unpickling it runs ``Path.touch(marker)``."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple:
        return (Path.touch, (self.marker,))


def test_driver_state_with_a_ledger_round_trips_under_weights_only(tmp_path: Path) -> None:
    records = make_task_dataset("digit_map", 0, 16)
    ledger = PromptLedger(PromptIterator(records, 1, seed=3))
    jobs = ledger.admit(3)
    ledger.requeue(jobs[1].group_id)  # one retry, two in flight: records (dataclasses) in the state
    torch.manual_seed(11)
    expected_draw = torch.rand(3)
    torch.manual_seed(11)
    save_driver_state(tmp_path, 5, ledger.state_dict(), {"grpo": {"n": 4}, "x": [1, 2.5, None]})
    torch.rand(7)  # move the RNG on; the load must bring it back
    state = load_driver_state(tmp_path)
    assert state["step"] == 5 and state["config"] == {"grpo": {"n": 4}, "x": [1, 2.5, None]}
    assert state["prompts"] == ledger.state_dict()
    assert torch.equal(torch.rand(3), expected_draw)
    resumed = PromptLedger(PromptIterator(records, 1, seed=3))
    resumed.load_state_dict(state["prompts"])
    assert [j.record for j in resumed.admit(4)] == [*(j.record for j in jobs), ledger.stream.next_batch()[0]]


def test_a_checkpoint_holding_an_arbitrary_object_is_refused_unexecuted(tmp_path: Path) -> None:
    marker = tmp_path / "executed"
    for name in ("driver.pt", "policy.pt"):
        torch.save({"step": 1, "prompts": {}, "evil": _Payload(marker)}, tmp_path / name)
        with pytest.raises(pickle.UnpicklingError, match=f"refusing to load checkpoint file .*{name}"):
            load_trusted(tmp_path / name)
    with pytest.raises(pickle.UnpicklingError, match="driver.pt"):
        load_driver_state(tmp_path)
    assert not marker.exists(), "the payload ran"


def test_the_start_up_shows_each_phase_as_it_begins_and_where_it_was_cut_short() -> None:
    import io

    phases = ["Ray", "store", "workers", "groups", "refit"]
    out = io.StringIO()
    shown = StartupProgress(phases, name="grpo_sync", enabled=True, stream=out)
    shown.phase("Ray")
    assert "grpo_sync start-up: 0/5 phases" in out.getvalue() and "Ray ..." in out.getvalue()
    shown.phase("workers", "4 processes")
    assert out.getvalue().rstrip("\r\n").split("\r")[-1].startswith("grpo_sync start-up: 2/5 phases")
    assert "workers: 4 processes ..." in out.getvalue()
    shown.close(done=False)  # an interrupt in the workers' start-up: the display stays where it was
    last = out.getvalue().rstrip("\r\n").split("\r")[-1]
    assert "2/5 phases" in last and "workers: 4 processes" in last
    shown.close(done=True)  # idempotent
    done = StartupProgress(phases, name="grpo_sync", enabled=True, stream=(out := io.StringIO()))
    done.phase("refit")
    done.close(done=True)
    assert out.getvalue().rstrip("\r\n").split("\r")[-1].startswith("grpo_sync start-up: 5/5 phases")
    quiet = StartupProgress(phases, name="grpo_sync", enabled=False, stream=(out := io.StringIO()))
    quiet.phase("Ray")
    quiet.close(done=True)
    assert out.getvalue() == ""
