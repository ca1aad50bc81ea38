"""tensordict's torch.compile marks wait for torch._dynamo (nemo_dataplane/compile_marks.py):
importing tensordict after nemo_dataplane does not load torch._dynamo, and once it loads, the
same functions carry the same marks as in a process that imported tensordict alone."""

from __future__ import annotations

import json
import subprocess
import sys

# Runs in a fresh interpreter (an import hook and import order are per process).
_PROBE = r"""
import json, sys, time
first = sys.argv[1] == "nemo_dataplane"
cpu = time.process_time()
if first:
    import nemo_dataplane
import pkgutil, importlib, tensordict
for m in pkgutil.walk_packages(tensordict.__path__, "tensordict."):
    try:
        importlib.import_module(m.name)
    except Exception:  # optional extras (e.g. tensordict.nn's backends) may be absent
        pass
dynamo_before = "torch._dynamo" in sys.modules
cpu = time.process_time() - cpu
if first:
    from nemo_dataplane.compile_marks import pending_marks
    n_pending = len(pending_marks())
import torch._dynamo
from torch._dynamo import trace_rules
allowed, constant = [], []
for name, mod in sorted(sys.modules.items()):
    if not name.startswith("tensordict") or mod is None:
        continue
    for attr, v in sorted(vars(mod).items()):
        if id(v) in trace_rules._allowed_callable_ids:
            allowed.append(f"{name}.{attr}")
        if callable(v) and vars(v).get("_dynamo_marked_constant", False) if hasattr(v, "__dict__") else False:
            constant.append(f"{name}.{attr}")
out = {"dynamo_before": dynamo_before, "cpu_s": cpu, "allowed": allowed, "constant": constant}
if first:
    out["pending_before"] = n_pending
    out["pending_after"] = len(pending_marks())
    import torch.compiler
    out["compiler_restored"] = torch.compiler.allow_in_graph.__module__ == "torch.compiler"
print(json.dumps(out))
"""


def _probe(first: str) -> dict:
    out = subprocess.run([sys.executable, "-c", _PROBE, first], capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_tensordict_imports_without_dynamo_and_gets_the_same_marks_once_dynamo_loads() -> None:
    alone = _probe("tensordict")
    deferred = _probe("nemo_dataplane")
    # Alone, tensordict loads torch._dynamo at import (that is what the hook saves).
    assert alone["dynamo_before"] is True
    assert deferred["dynamo_before"] is False
    assert deferred["pending_before"] > 0 and deferred["pending_after"] == 0
    assert deferred["compiler_restored"] is True
    # The same functions are marked, the same way, once torch._dynamo is loaded.
    assert alone["allowed"] and alone["constant"], alone
    assert deferred["allowed"] == alone["allowed"]
    assert deferred["constant"] == alone["constant"]


def test_a_worker_module_loaded_by_name_as_ray_loads_an_actor_class_keeps_dynamo_out() -> None:
    # Ray imports an actor's module by its name, before anything else of ours: the collector's
    # module imports tensordict at its top, so without ``algorithms`` importing nemo_dataplane
    # first every collector process paid torch._dynamo's import.
    probe = (
        "import sys, importlib; importlib.import_module(sys.argv[1]); "
        "print([m for m in sys.modules if m.startswith('torch._dynamo')][:1])"
    )
    for module in ("algorithms.workers.collector", "algorithms.workers.policy", "algorithms.workers.generator"):
        out = subprocess.run([sys.executable, "-c", probe, module], capture_output=True, text=True, timeout=240)
        assert out.returncode == 0, out.stderr[-3000:]
        assert out.stdout.strip().splitlines()[-1] == "[]", f"{module} loaded torch._dynamo"
