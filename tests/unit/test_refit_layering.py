"""The refit package imports downward only and in no circle (every import counts: function-local
and ``TYPE_CHECKING`` ones too), and keeps each module under 500 lines.

Layers, bottom up: ``config``, ``copies`` and ``protocol`` (family-neutral) < ``cuda/`` (CUDA IPC
pieces) < the families ``packed/`` and ``reshard/`` (never each other) < ``factory`` < the
package's ``__init__``. No module below the package imports the package itself.
"""

from __future__ import annotations

import ast
from pathlib import Path

REFIT = Path(__file__).resolve().parents[2] / "nemo_dataplane" / "refit"
PKG = "nemo_dataplane.refit"


def _name(path: Path) -> str:
    rel = path.relative_to(REFIT).with_suffix("")
    parts = [p for p in rel.parts if p != "__init__"]
    return ".".join([PKG, *parts])


MODULES = {_name(p): p for p in sorted(REFIT.rglob("*.py"))}


def _edges(path: Path) -> set[str]:
    """Refit modules ``path`` imports, anywhere in it (``from pkg import sub`` names ``pkg.sub``)."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            assert node.level == 0, f"{path}: use absolute imports"
            subs = [f"{node.module}.{a.name}" for a in node.names if f"{node.module}.{a.name}" in MODULES]
            out |= set(subs) if len(subs) == len(node.names) else {node.module, *subs}
    return {m for m in out if m == PKG or m.startswith(PKG + ".")}


GRAPH = {m: _edges(p) for m, p in MODULES.items()}


def _group(module: str) -> str:
    rest = module[len(PKG) + 1 :]
    return rest.split(".")[0] if rest else "__init__"


def test_no_import_circle() -> None:
    state: dict[str, int] = {}
    cycles: list[list[str]] = []

    def visit(m: str, stack: list[str]) -> None:
        state[m] = 1
        for n in sorted(GRAPH.get(m, ())):
            if state.get(n) == 1:
                cycles.append(stack[stack.index(n) :] + [n])
            elif n not in state:
                visit(n, stack + [n])
        state[m] = 2

    for m in sorted(GRAPH):
        if m not in state:
            visit(m, [m])
    assert cycles == []


def test_imports_go_downward_only() -> None:
    # What each group may import (besides itself); the package __init__ may import anything.
    allowed = {
        "config": set(),
        "copies": set(),
        "protocol": set(),
        "fp8": {"protocol"},  # a form of the sender's tensors, for any family
        "cuda": {"copies"},
        "packed": {"config", "copies", "protocol", "cuda"},
        "reshard": {"config", "copies", "protocol", "cuda"},
        "factory": {"config", "protocol", "packed", "reshard"},
    }
    bad = []
    for m, deps in GRAPH.items():
        group = _group(m)
        if group == "__init__":
            continue
        for d in deps:
            if d == PKG:
                bad.append(f"{m} imports the package {PKG} itself")
            elif _group(d) != group and _group(d) not in allowed[group]:
                bad.append(f"{m} imports {d}")
    assert bad == []


def test_every_refit_module_is_under_500_lines() -> None:
    long = {m: n for m, p in MODULES.items() if (n := len(p.read_text().splitlines())) > 500}
    assert long == {}


def test_the_checker_sees_function_local_and_type_checking_imports(tmp_path: Path) -> None:
    f = tmp_path / "x.py"
    f.write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from nemo_dataplane.refit.packed import plan\n"
        "def f():\n    from nemo_dataplane.refit.reshard.plan import ReshardPlan\n"
    )
    assert _edges(f) == {"nemo_dataplane.refit.packed.plan", "nemo_dataplane.refit.reshard.plan"}
