"""Architecture: the baseline never loads the data plane; layers import downward only, with no
circles; each of the run's choices is read in one place.

The baseline (in-memory) trainer path may use the planners (``nemo_dataplane.driver.planner``/
``preshard``), ``KVBatchMeta``, the distributed groups and refit, but not the store client,
factory, adapters, fan-out, column I/O or worker fetch. Checked two ways: by running the
baseline's code in a fresh interpreter and inspecting ``sys.modules``, and by reading the import
statements (AST) of the modules that make up that path. (The functional baseline run also reports
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
import algorithms.grpo_sync, algorithms.grpo_async, algorithms.trainer, algorithms.step, algorithms.transports.legacy
import algorithms.rollout_buffer
import algorithms.workers.policy, algorithms.workers.generator, algorithms.workers.collector
from algorithms.config import load_config
from algorithms.engines.training.hf import model_inputs
from algorithms.transports import make_transport
from algorithms.transports.legacy import LegacyTransport, concat_batches, legacy_shard
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
t = make_transport(cfg)
assert isinstance(t, LegacyTransport)
io = t.batch_io()
io.open(0, None, 60.0)
batch = t.write_advantages(t.keep(batch, [0, 1, 2, 3], [4, 5, 6, 7]), torch.zeros(4))
pre = t.preshard(batch, 2)
shards = legacy_shard(batch, pre)
results = [{"prev_logprobs": jagged_from_rows([torch.zeros(int(n) - 1) for n in s.data["seq_len"]])} for s in shards]
batch = t.absorb(batch, pre, "prev_logprobs", results)
for s in shards:
    for mb in io.load(s, ["input_ids", "prompt_len"]).microbatches:
        model_inputs(mb, 0, torch.device("cpu"))
print(json.dumps(sorted(m for m in sys.modules if m.startswith(("nemo_dataplane", "transfer_queue")))))
"""


def test_legacy_path_loads_no_data_plane_module_in_a_fresh_interpreter() -> None:
    proc = subprocess.run(
        [sys.executable, "-c", LEGACY_SCRIPT, str(REPO / "examples" / "configs" / "grpo_tiny.yaml")],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    mods = json.loads(proc.stdout.strip().splitlines()[-1])
    assert "nemo_dataplane.driver.preshard" in mods, "the legacy path does use the shared planner"
    assert data_plane_modules_loaded(mods) == [], data_plane_modules_loaded(mods)


def test_the_module_check_detects_a_data_plane_import() -> None:
    # The same inspection must see it when the data-plane path's helpers are imported.
    code = (
        "import json, sys; import algorithms.step; import algorithms.transports.data_plane; "
        "print(json.dumps(sorted(sys.modules)))"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-4000:]
    loaded = data_plane_modules_loaded(json.loads(proc.stdout.strip().splitlines()[-1]))
    assert "nemo_dataplane.driver.fan_out" in loaded and "algorithms.transports.data_plane" in loaded


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
        "algorithms/transports/__init__.py",
        "algorithms/transports/base.py",
        "algorithms/transports/legacy.py",
        "algorithms/rollouts.py",
        "algorithms/remote.py",
        "algorithms/dispatch.py",
        "algorithms/faults.py",
        "algorithms/engines/training/__init__.py",
        "algorithms/engines/training/base.py",
        "algorithms/engines/training/hf.py",
        "algorithms/engines/generation/__init__.py",
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
    tree = ast.parse((REPO / "algorithms" / "transports" / "legacy.py").read_text())
    assert data_plane_modules_loaded(_imports(tree)) == []
    dp = ast.parse((REPO / "algorithms" / "transports" / "data_plane.py").read_text())
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
        "nemo_dataplane/meta.py": (
            "nemo_dataplane.client",
            "nemo_dataplane.adapters",
            "nemo_dataplane.factory",
            "nemo_dataplane.driver",
            "nemo_dataplane.worker",
        ),
        "nemo_dataplane/codec.py": (
            "nemo_dataplane.client",
            "nemo_dataplane.adapters",
            "nemo_dataplane.factory",
            "nemo_dataplane.driver",
            "nemo_dataplane.worker",
        ),
        "nemo_dataplane/config.py": (
            "nemo_dataplane.client",
            "nemo_dataplane.adapters",
            "nemo_dataplane.factory",
            "nemo_dataplane.driver",
            "nemo_dataplane.worker",
        ),
        "nemo_dataplane/client.py": (
            "nemo_dataplane.adapters",
            "nemo_dataplane.factory",
            "nemo_dataplane.driver",
            "nemo_dataplane.worker",
            "nemo_dataplane.wrappers",
        ),
    }
    bad = []
    for path, banned in upper.items():
        for mod in _imports(ast.parse((REPO / path).read_text())):
            if any(mod == b or mod.startswith(b + ".") for b in banned):
                bad.append(f"{path}: {mod}")
    assert bad == []


# ----------------------------------------------------------------------------- import circles
def _module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _runtime_imports(tree: ast.Module, package: str, modules: set[str] = frozenset()) -> list[str]:
    """Every import the module can run (function-local ones included; ``if TYPE_CHECKING:``
    blocks are not run), relative imports resolved against ``package``."""
    out: list[str] = []

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and isinstance(child.test, ast.Name) and child.test.id == "TYPE_CHECKING":
                continue
            if isinstance(child, ast.Import):
                out.extend(a.name for a in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    base = ".".join(
                        package.split(".")[: len(package.split(".")) - child.level + 1] + ([base] if base else [])
                    )
                # `from a.b import c, d`: a.b.c / a.b.d where they are modules, else a names of a.b.
                out.extend(f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in child.names)
            visit(child)

    visit(tree)
    return out


def _import_graph(roots: tuple[str, ...]) -> dict[str, set[str]]:
    files = [f for r in roots for f in sorted((REPO / r).rglob("*.py"))]
    names = {_module_name(f): f for f in files}
    graph: dict[str, set[str]] = {}
    for name, f in names.items():
        package = name if f.name == "__init__.py" else name.rsplit(".", 1)[0]
        # Only modules of the repo; a package's own __init__, run first by Python when one of its
        # submodules is imported, is not counted (an __init__ re-exporting its submodules would
        # otherwise be a circle with each of them).
        graph[name] = {
            m for m in _runtime_imports(ast.parse(f.read_text()), package, set(names)) if m in names and m != name
        }
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def strong(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            strong(v)
    return out


def test_no_import_circle_among_modules_counting_function_local_imports() -> None:
    assert _cycles(_import_graph(("algorithms", "nemo_dataplane"))) == []


def test_the_circle_check_finds_a_circle_made_by_a_local_import() -> None:
    graph = {"a": {"b"}, "b": set(), "c": {"a"}}
    assert _cycles(graph) == []
    tree = ast.parse("def f():\n    import a\n")
    graph["b"] = {m for m in _runtime_imports(tree, "") if m in graph}
    graph["a"] = {"b"}
    assert _cycles(graph) == [["a", "b"]]


# ----------------------------------------------------------------------------- one decision in one place
# Each choice of the run is read from the config in exactly one module (config validation aside):
# everything after it talks to the interface that module returns.
DECISIONS = {
    ("data_plane", "enabled"): {"algorithms/transports/__init__.py", "algorithms/trainer.py"},  # trainer: summary only
    # run_dir: the plot's title names the engines, nothing is decided there.
    ("policy", "backend"): {"algorithms/engines/training/__init__.py", "algorithms/run_dir.py"},
    ("generation", "backend"): {"algorithms/engines/generation/__init__.py", "algorithms/run_dir.py"},
    ("policy", "tokenizer"): {"algorithms/tokenizers.py"},
    ("policy", "precision"): {"algorithms/precision.py"},
    # launch: the summary's layout only (the config's fully_sharded answers everyone else).
    ("policy", "sharding"): {"algorithms/engines/training/__init__.py", "algorithms/launch.py"},
    ("vllm", "quantization"): {"algorithms/refit_weights.py"},
    # Read only by algorithms.placement.placement_of, from the section TrainerConfig.placement
    # hands it: launch's GPU shares and slots, the engine's sleep level and GPU order and the
    # policy's cache release ask the Placement it returns (no `cfg.generation.placement` anywhere).
    ("generation", "placement"): set(),
}


def _attribute_reads(tree: ast.Module) -> set[tuple[str, str]]:
    return {
        (n.value.attr, n.attr)
        for n in ast.walk(tree)
        if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Attribute)
    }


def test_each_choice_is_read_in_one_module() -> None:
    where: dict[tuple[str, str], set[str]] = {k: set() for k in DECISIONS}
    for f in sorted((REPO / "algorithms").rglob("*.py")):
        rel = str(f.relative_to(REPO))
        if rel in ("algorithms/config.py", "algorithms/config_sections.py"):
            continue
        reads = _attribute_reads(ast.parse(f.read_text()))
        for key in DECISIONS:
            if key in reads:
                where[key].add(rel)
    assert where == DECISIONS


# A family, engine or backend compared by name outside the one module that chooses it is the
# same `if` written a second time.
CONFIG = {"algorithms/config.py", "algorithms/config_sections.py"}  # validation reads every choice
CHOICE_NAMES = {
    "packed": CONFIG,
    "reshard": CONFIG,
    "megatron": {*CONFIG, "algorithms/engines/training/__init__.py"},
    "fsdp": {*CONFIG, "algorithms/engines/training/__init__.py"},
    "vllm": {*CONFIG, "algorithms/engines/generation/__init__.py"},
    "hf": {*CONFIG, "algorithms/engines/generation/__init__.py"},
    "char": {*CONFIG, "algorithms/tokenizers.py"},
    "fp32": {*CONFIG, "algorithms/precision.py"},
    "bf16": {*CONFIG, "algorithms/precision.py"},
}


def test_no_family_engine_or_backend_is_compared_by_name_outside_its_factory() -> None:
    where: dict[str, set[str]] = {k: set() for k in CHOICE_NAMES}
    for f in sorted((REPO / "algorithms").rglob("*.py")):
        rel = str(f.relative_to(REPO))
        for n in ast.walk(ast.parse(f.read_text())):
            if isinstance(n, ast.Compare):
                for c in (n.left, *n.comparators):
                    if isinstance(c, ast.Constant) and c.value in CHOICE_NAMES:
                        where[c.value].add(rel)
    assert {k: v - CHOICE_NAMES[k] for k, v in where.items()} == {k: set() for k in CHOICE_NAMES}


def test_every_module_is_under_500_lines_or_says_why_at_its_top() -> None:
    long = {}
    for f in sorted([*(REPO / "algorithms").rglob("*.py"), *(REPO / "nemo_dataplane").rglob("*.py")]):
        text = f.read_text()
        n = len(text.splitlines())
        if n > 500 and "\nSize: " not in text[:3000]:
            long[str(f.relative_to(REPO))] = n
    assert long == {}, "split by responsibility, or say at the top why it cannot be"
