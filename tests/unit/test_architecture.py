"""Architecture: the legacy path never loads the data plane; layers import downward only.

The legacy trainer path may use the planners (``nemo_dataplane.driver.planner``/``preshard``),
``KVBatchMeta``, the distributed groups and refit, but not the store client, factory,
adapters, fan-out, column I/O or worker fetch. Checked two ways: by running the legacy path's
code in a fresh interpreter and inspecting ``sys.modules``, and by reading the import
statements (AST) of the modules that make up that path. (The functional legacy run also reports
the modules its driver and worker processes loaded; see tests/functional.)
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

# The trainer's own list and check (also behind summary.json), so the two cannot drift.
from algorithms.grpo_sync import data_plane_modules_loaded

REPO = Path(__file__).resolve().parents[2]


# Run in a fresh interpreter: the trainer modules, then the legacy transport end to end (short
# of ray.put) on a real rollout batch, then the policy worker's legacy input handling.
LEGACY_SCRIPT = r"""
import json, sys
import torch
import algorithms.grpo_sync, algorithms.grpo_async, algorithms.trainer, algorithms.step, algorithms.legacy_transport
import algorithms.rollout_buffer
import algorithms.workers.policy, algorithms.workers.generator, algorithms.workers.collector
from algorithms.config import load_config
from algorithms.legacy_transport import LegacyTransport, concat_batches, legacy_shard
from algorithms.workers.policy import model_inputs
from nemo_dataplane.codec import jagged_from_rows
from tensordict import TensorDict

cfg = load_config(sys.argv[1], ["data_plane.enabled=false", "data_plane.packing.micro_batch_size=2"])
rows = [torch.arange(1, 4 + i % 3) for i in range(8)]
batch = TensorDict({
    "input_ids": jagged_from_rows(rows),
    "prompt_len": torch.full((8,), 2, dtype=torch.int64),
    "seq_len": torch.tensor([r.numel() for r in rows]),
    "rewards": torch.tensor([0., 1., 0., 1., 1., 1., 0., 0.]),
}, batch_size=[8])
batch = concat_batches([batch])
t = LegacyTransport(cfg)
batch = t.write_advantages(t.keep(batch, [0, 1, 2, 3], [4, 5, 6, 7]), torch.zeros(4))
pre = t.preshard(batch, 2)
shards = legacy_shard(batch, pre)
results = [{"prev_logprobs": jagged_from_rows([torch.zeros(int(n) - 1) for n in s.data["seq_len"]])} for s in shards]
batch = t.absorb(batch, pre, "prev_logprobs", results)
for s in shards:
    for mb in s.microbatches():
        model_inputs(mb, 0, torch.device("cpu"))
print(json.dumps(sorted(m for m in sys.modules if m.startswith(("nemo_dataplane", "transfer_queue")))))
"""


def test_legacy_path_loads_no_data_plane_module_in_a_fresh_interpreter() -> None:
    proc = subprocess.run(
        [sys.executable, "-c", LEGACY_SCRIPT, str(REPO / "examples" / "configs" / "grpo_tiny.yaml")],
        cwd=REPO, capture_output=True, text=True, timeout=180,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    mods = json.loads(proc.stdout.strip().splitlines()[-1])
    assert "nemo_dataplane.driver.preshard" in mods, "the legacy path does use the shared planner"
    assert data_plane_modules_loaded(mods) == [], data_plane_modules_loaded(mods)


def test_the_module_check_detects_a_data_plane_import() -> None:
    # The same inspection must see it when the data-plane path's helpers are imported.
    code = ("import json, sys; import algorithms.step; from nemo_dataplane.driver import fan_out_per_rank_metas; "
            "print(json.dumps(sorted(sys.modules)))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "nemo_dataplane.driver.fan_out" in data_plane_modules_loaded(json.loads(proc.stdout.strip().splitlines()[-1]))


def _imports(node: ast.AST) -> list[str]:
    out: list[str] = []
    for n in ast.walk(node):
        if isinstance(n, ast.Import):
            out += [a.name for a in n.names]
        elif isinstance(n, ast.ImportFrom) and n.module and n.level == 0:
            out.append(n.module)
            out += [f"{n.module}.{a.name}" for a in n.names]
    return out


def _module_level_imports(tree: ast.Module) -> list[str]:
    out: list[str] = []
    for n in tree.body:
        if isinstance(n, (ast.Import, ast.ImportFrom)):
            out += _imports(n)
        elif isinstance(n, ast.If) and not (isinstance(n.test, ast.Name) and n.test.id == "TYPE_CHECKING"):
            out += _imports(n)
    return out


@pytest.mark.parametrize(
    "path",
    [
        "algorithms/legacy_transport.py",
        "algorithms/step.py",
        "algorithms/grpo_sync.py",
        "algorithms/grpo_async.py",
        "algorithms/trainer.py",
        "algorithms/rollout_buffer.py",
        "algorithms/workers/policy.py",
        "algorithms/workers/generator.py",
        "algorithms/workers/collector.py",
        "nemo_dataplane/__init__.py",
        "nemo_dataplane/driver/__init__.py",
        "nemo_dataplane/driver/planner.py",
        "nemo_dataplane/driver/preshard.py",
    ],
)
def test_modules_on_the_legacy_path_import_no_data_plane_module_at_load_time(path: str) -> None:
    tree = ast.parse((REPO / path).read_text())
    assert data_plane_modules_loaded(_module_level_imports(tree)) == []


def test_legacy_transport_imports_no_data_plane_module_anywhere_in_its_module() -> None:
    # Not only at load time: no function of the legacy module imports the data plane either.
    tree = ast.parse((REPO / "algorithms" / "legacy_transport.py").read_text())
    assert data_plane_modules_loaded(_imports(tree)) == []
    (dp,) = [n for n in ast.parse((REPO / "algorithms" / "step.py").read_text()).body
             if isinstance(n, ast.ClassDef) and n.name == "DataPlaneTransport"]
    assert data_plane_modules_loaded(_imports(dp)), "sanity: the data-plane transport does use fan-out/columns"


def test_the_library_never_imports_the_trainers() -> None:
    offenders = []
    for f in sorted((REPO / "nemo_dataplane").rglob("*.py")):
        for mod in _imports(ast.parse(f.read_text())):
            if mod == "algorithms" or mod.startswith("algorithms."):
                offenders.append(f"{f.relative_to(REPO)}: {mod}")
    assert offenders == []


def test_lower_layers_do_not_import_upper_ones() -> None:
    # meta/codec/config < client < adapters < wrappers < factory < driver/worker
    upper = {
        "nemo_dataplane/meta.py": ("nemo_dataplane.client", "nemo_dataplane.adapters", "nemo_dataplane.factory",
                                   "nemo_dataplane.driver", "nemo_dataplane.worker"),
        "nemo_dataplane/codec.py": ("nemo_dataplane.client", "nemo_dataplane.adapters", "nemo_dataplane.factory",
                                    "nemo_dataplane.driver", "nemo_dataplane.worker"),
        "nemo_dataplane/config.py": ("nemo_dataplane.client", "nemo_dataplane.adapters", "nemo_dataplane.factory",
                                     "nemo_dataplane.driver", "nemo_dataplane.worker"),
        "nemo_dataplane/client.py": ("nemo_dataplane.adapters", "nemo_dataplane.factory", "nemo_dataplane.driver",
                                     "nemo_dataplane.worker", "nemo_dataplane.wrappers"),
    }
    bad = []
    for path, banned in upper.items():
        for mod in _imports(ast.parse((REPO / path).read_text())):
            if any(mod == b or mod.startswith(b + ".") for b in banned):
                bad.append(f"{path}: {mod}")
    assert bad == []
