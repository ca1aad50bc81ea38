"""algorithms.checkpoint: files are fsync'd before the COMPLETE marker, a truncated file is
reported by its path, and sharded state round-trips while forged metadata is refused."""

from __future__ import annotations

import ast
import os
import pickle
import socket
from pathlib import Path

import pytest
import torch

import algorithms.checkpoint as ckpt
from algorithms.checkpoint import (
    MARKER,
    CheckpointReadError,
    load_driver_state,
    load_sharded,
    load_trusted,
    mark_complete,
    save_driver_state,
    save_file,
    saved_tokenizer,
    step_dir,
)

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def fsyncs(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, bool]]:
    """Every fsync as (the path synced, whether a COMPLETE marker existed at that moment)."""
    calls: list[tuple[str, bool]] = []
    real = os.fsync

    def record(fd: int) -> None:
        path = os.readlink(f"/proc/self/fd/{fd}")
        calls.append((path, (Path(path) / MARKER).exists() or (Path(path).parent / MARKER).exists()))
        real(fd)

    monkeypatch.setattr(ckpt.os, "fsync", record)
    return calls


def test_every_file_and_the_directory_are_fsynced_before_the_marker_and_the_marker_after(
    tmp_path: Path, fsyncs: list[tuple[str, bool]]
) -> None:
    d = step_dir(tmp_path, 3)
    d.mkdir()
    save_file({"w": torch.ones(2)}, d / "policy.pt")  # what a policy rank writes
    save_driver_state(d, 3, {"pos": 1}, {"seed": 0})
    mark_complete(d, 3, root=tmp_path, keep=0)
    before = [p for p, marked in fsyncs if not marked]
    after = [p for p, marked in fsyncs if marked]
    assert str(d / "policy.pt") in before and str(d / "driver.pt") in before
    assert before[-1] == str(d), "the directory is synced last before the marker"
    assert after == [str(d / MARKER), str(d)], "then the marker and the directory"
    assert (d / MARKER).read_text() == "3"


@pytest.mark.parametrize(
    ("path", "function", "writer"),
    [
        ("algorithms/workers/policy.py", "save_checkpoint", "save_file"),  # RNG states
        ("algorithms/engines/training/base.py", "save_state", "save_file"),  # whole state
        ("algorithms/engines/training/fsdp.py", "save_state", "save_sharded"),  # shards
    ],
)
def test_the_policy_ranks_write_their_checkpoint_files_through_the_fsyncing_writers(
    path: str, function: str, writer: str
) -> None:
    # A bare torch.save (or dcp.save) would skip the fsync the marker relies on.
    tree = ast.parse((REPO / path).read_text())
    fn = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == function)
    called = {ast.unparse(c.func) for c in ast.walk(fn) if isinstance(c, ast.Call)}
    assert writer in called and "torch.save" not in called and "dcp.save" not in called


def _sharded_checkpoint(d: Path) -> dict[str, torch.Tensor]:
    """A real torch.distributed.checkpoint directory of a one-rank gloo group."""
    import torch.distributed as dist

    from algorithms.checkpoint import save_sharded

    state = {"model": {"w": torch.arange(6.0).reshape(2, 3)}, "optimizer": {"step": torch.tensor(3.0)}}
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        save_sharded(state, d)
        back = {"model": {"w": torch.zeros(2, 3)}, "optimizer": {"step": torch.tensor(0.0)}}
        load_sharded(back, d)
    finally:
        dist.destroy_process_group()
    return back


def test_sharded_state_round_trips_and_forged_metadata_is_refused_not_executed(tmp_path: Path) -> None:
    back = _sharded_checkpoint(tmp_path / "policy")
    assert torch.equal(back["model"]["w"], torch.arange(6.0).reshape(2, 3)) and float(back["optimizer"]["step"]) == 3
    # A .metadata naming any other global (here os.system, as a forged checkpoint would) is refused.
    marker = tmp_path / "ran"

    class Evil:
        def __reduce__(self):  # noqa: ANN204 - pickle protocol
            return (os.system, (f"touch {marker}",))

    (tmp_path / "policy" / ".metadata").write_bytes(pickle.dumps(Evil()))
    with pytest.raises(pickle.UnpicklingError, match=r"names posix.system|names os.system"):
        load_sharded({"model": {"w": torch.zeros(2, 3)}}, tmp_path / "policy")
    assert not marker.exists(), "the forged metadata ran code"
    with pytest.raises(FileNotFoundError, match="its .metadata is missing"):
        load_sharded({}, tmp_path / "nothing")


@pytest.mark.parametrize("keep", [0, 1, 100])  # bytes kept: empty, cut after the zip header, near-complete
def test_a_truncated_checkpoint_file_is_reported_by_its_path(tmp_path: Path, keep: int) -> None:
    d = step_dir(tmp_path, 1)
    d.mkdir()
    save_driver_state(d, 1, {"pos": 1}, {"seed": 0})
    save_file({"w": torch.randn(64, 64)}, d / "policy.pt")
    for name in ("driver.pt", "policy.pt"):
        f = d / name
        data = f.read_bytes()
        f.write_bytes(data[: keep if keep < 100 else len(data) - 100])
        with pytest.raises(CheckpointReadError, match=f"cannot read checkpoint file '{f}'"):
            load_trusted(f, map_location="cpu")
    with pytest.raises(CheckpointReadError, match="driver.pt"):
        load_driver_state(d)
    with pytest.raises(CheckpointReadError, match="driver.pt"):
        saved_tokenizer(d)


def test_a_missing_file_keeps_its_own_error(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="nothing.pt"):
        load_trusted(tmp_path / "nothing.pt")
