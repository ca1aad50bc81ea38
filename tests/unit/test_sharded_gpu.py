"""Resharding refit on 2 GPUs: CUDA IPC push (ranks sharing a GPU, gloo control group) and NCCL
p2p; skipped without cuda-bindings or 2 GPUs."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

if torch.cuda.device_count() < 2:
    pytest.skip("needs 2 CUDA GPUs", allow_module_level=True)

sys.path.insert(0, str(Path(__file__).parent))
import _refit_procs as P  # noqa: E402

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def pool() -> Iterator[P.Pool]:
    ex = P.Pool(2)
    yield ex
    ex.kill()


@pytest.mark.parametrize(
    ("case", "gpus"),
    [("tp2->tp1", (0, 1, 0)), ("tp1->tp2", (0, 0, 1)), ("dp2tp2->tp2", (0, 1, 0, 1, 0, 1)), ("ep2->ep1", (1, 0, 0))],
    ids=["tp2-tp1", "tp1-tp2", "dp2tp2-tp2", "ep2-ep1"],
)
def test_ipc_reshard_bit_exact_with_shared_gpus(pool: P.Pool, case: str, gpus: tuple[int, ...]) -> None:
    res = P.run_ranks(pool, P.reshard_roundtrip, list(range(len(gpus))), world=len(gpus), port=P.free_port(),
                      case=case, gpus=gpus, transport="ipc", limit=120)
    P.check_reshard(res, case)
    assert {res[r]["transport"] for r in res} == {"ipc"}
    src, _ = P.reshard_layouts(case)
    for s in src.mesh.ranks:  # copy-engine copies, not the torch fallback
        assert res[s]["raw"], res[s]["raw_error"]


def test_nccl_p2p_reshard_bit_exact(pool: P.Pool) -> None:
    pytest.importorskip("nccl.core", reason="nccl4py not installed (pip install 'nemo-dataplane[gpu]')")
    res = P.run_ranks(pool, P.reshard_roundtrip, [0, 1], world=2, port=P.free_port(), case="tp1->tp1",
                      backend="nccl", gpus=(0, 1), transport="p2p", limit=120)
    P.check_reshard(res, "tp1->tp1")
    assert {res[r]["transport"] for r in res} == {"p2p"}
