"""The sharded training engine on 2 GPUs (NCCL among the policy ranks, the refit over CUDA IPC
into a generator on the second GPU): the CPU module's checks (``test_fsdp.py``) on the devices
users run. Skips without 2 CUDA devices.

Tolerances against the replicated engine are the CPU module's, widened for GPU kernels, which
reduce in another order when the shapes differ (a sharded all-gather vs a whole tensor): fp32
1e-4, bf16 5e-3 relative on a step's metrics; the refit and the checkpoint stay bit-exact.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
import _fsdp_procs as F  # noqa: E402
import _refit_procs as P  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices"),
]

TOLERANCE = {"fp32": 1e-4, "bf16": 5e-3}
WORLD = 2


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_fsdp_on_two_gpus_matches_the_replicated_engine_refits_bit_exact_and_exports(
    pool: P.Pool, tmp_path: Path, precision: str
) -> None:
    res = P.run_ranks(
        pool,
        F.train_and_compare,
        list(range(WORLD + 1)),
        limit=300,
        world=WORLD,
        port=P.free_port(),
        refit_port=P.free_port(),
        tmp=str(tmp_path),
        precision=precision,
        backend="nccl",
        device="cuda",
    )
    for r, out in res.items():
        assert not isinstance(out, BaseException), f"rank {r}:\n{P.format_exc(out)}"
    worst = 0.0
    for r in range(WORLD):
        for a, b in zip(res[r]["history"]["fsdp"], res[r]["history"]["none"]):
            for key in ("loss", "pg_loss", "kl", "entropy", "grad_norm"):
                worst = max(worst, abs(a[key] - b[key]) / max(1.0, abs(b[key])))
    print(
        f"{precision}: worst relative metric difference {worst:.3g}, weights {res[0]['weight_diff']:.3g}, "
        f"export logits {res[0]['export_diff']:.3g}"
    )
    assert worst <= TOLERANCE[precision]
    assert all(res[r]["resumed_equal"] for r in range(WORLD)), "a reloaded checkpoint repeats the step bitwise"
    got, want = F.unpack(res[WORLD]["got"]), F.unpack(res[0]["sent"])
    assert res[WORLD]["version"] == 5 and F.bitwise_equal(got, want) == []
    assert [res[r]["wrote"] for r in range(WORLD)] == [True, False]
    assert res[0]["export_diff"] <= (1e-4 if precision == "fp32" else 2e-2)
