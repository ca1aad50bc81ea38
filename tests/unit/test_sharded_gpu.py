"""Resharding refit on GPUs: CUDA IPC push (ranks sharing a GPU, gloo control group; one case on
one GPU) and NCCL p2p; skipped without CUDA, the 2-GPU cases without 2 GPUs."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

sys.path.insert(0, str(Path(__file__).parent))
import _refit_procs as P  # noqa: E402

pytestmark = pytest.mark.gpu
two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")


@pytest.fixture(scope="module")
def pool() -> Iterator[P.Pool]:
    ex = P.Pool(2)
    yield ex
    ex.kill()


@pytest.mark.parametrize(
    ("case", "gpus"),
    [pytest.param("tp2->tp1", (0, 1, 0), marks=two_gpus), pytest.param("tp1->tp2", (0, 0, 1), marks=two_gpus),
     pytest.param("dp2tp2->tp2", (0, 1, 0, 1, 0, 1), marks=two_gpus),
     pytest.param("ep2->ep1", (1, 0, 0), marks=two_gpus),
     ("tp2->tp1", (0, 0, 0))],
    ids=["tp2-tp1", "tp1-tp2", "dp2tp2-tp2", "ep2-ep1", "tp2-tp1-one-gpu"],
)
def test_ipc_reshard_bit_exact_with_shared_gpus(pool: P.Pool, case: str, gpus: tuple[int, ...]) -> None:
    res = P.run_ranks(pool, P.reshard_roundtrip, list(range(len(gpus))), world=len(gpus), port=P.free_port(),
                      case=case, gpus=gpus, transport="ipc", limit=120, timings=True)
    P.check_reshard(res, case)
    P.check_timings(res, {"send": ["check", "header", "issue", "copies", "done"],
                          "recv": ["check", "ready", "header", "done", "scatter"]}, refits=2)
    assert {res[r]["transport"] for r in res} == {"ipc"}
    src, _ = P.reshard_layouts(case)
    for s in src.mesh.ranks:  # copy-engine copies, not the torch fallback
        assert res[s]["raw"], res[s]["raw_error"]


@two_gpus
def test_nccl_p2p_reshard_bit_exact(pool: P.Pool) -> None:
    pytest.importorskip("nccl.core", reason="nccl4py not installed (pip install 'nemo-dataplane[gpu]')")
    res = P.run_ranks(pool, P.reshard_roundtrip, [0, 1], world=2, port=P.free_port(), case="tp1->tp1",
                      backend="nccl", gpus=(0, 1), transport="p2p", limit=120)
    P.check_reshard(res, "tp1->tp1")
    assert {res[r]["transport"] for r in res} == {"p2p"}
