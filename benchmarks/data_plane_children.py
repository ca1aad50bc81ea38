"""``bench_data_plane.py``'s runs in a child interpreter with a Ray of its own: the zero-copy Ray
hand-off (``RAY_ENABLE_ZERO_COPY_TORCH_TENSORS`` is read at Ray start) and TransferQueue on a
plain wire (``--compare-plain-wire``: a second ``tq.init()`` in one process would reuse the
first store's stale globals)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]


def _child(
    script: str, flags: list[str], sizes: list[int], readers: list[int], repeats: int, env: dict[str, str]
) -> Any:
    """``script`` run with ``flags`` (its own Ray); what it printed as its last JSON line."""
    env = dict(env)
    env.pop("RAY_ADDRESS", None)
    cmd = [
        sys.executable,
        script,
        *flags,
        "--repeats",
        str(repeats),
        "--sizes",
        *map(str, sizes),
        "--readers",
        *map(str, readers),
    ]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=1200)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(flags)} run failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def ray_zero_copy_subprocess(
    script: str, sizes: list[int], readers: list[int], repeats: int
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    env = {**os.environ, "RAY_ENABLE_ZERO_COPY_TORCH_TENSORS": "1"}
    rows, lat = _child(script, ["--ray-only"], sizes, readers, repeats, env)
    for r in rows:
        r["method"] = "ray_zero_copy"
    return rows, {"ray_zero_copy": lat["ray"]}


def tq_plain_wire_subprocess(
    script: str, sizes: list[int], readers: list[int], repeats: int, unit_in_controller: bool | None
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """``bench_tq`` on a store without wire keys, renamed ``*_plain``."""
    hosted = {None: "auto", True: "on", False: "off"}[unit_in_controller]
    flags = ["--tq-plain-only", "--unit-in-controller", hosted]
    rows, lat = _child(script, flags, sizes, readers, repeats, dict(os.environ))
    for r in rows:
        r["method"] += "_plain"
    return rows, {f"{k}_plain": v for k, v in lat.items()}
