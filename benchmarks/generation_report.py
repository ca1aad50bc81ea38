"""``bench_generation.py --device cuda``'s tables: tokens/s per response length against the same
size's hf engine, and the refit into vLLM against the copy ceiling.

Re-print a recorded run: ``python benchmarks/generation_report.py benchmarks/recorded/bench_generation_h200.json``
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from generation_cases import GPU_ENGINES


def print_gpu_tables(settings: dict[str, Any], results: list[dict[str, Any]], refit: dict[str, Any]) -> None:
    """The generation table (tok/s per length and x the same size's hf) and the refit table."""
    lengths = settings["lengths"]
    print(
        f"bench_generation --device cuda: {settings['prompts']} prompts x n={settings['n']}, "
        f"lengths {lengths} (ignore_eos), bf16, temperature 1, medians of {settings['repeats']} "
        f"(hf: {settings['hf_repeats']}), {settings['lanes']} lane(s)"
    )
    head = f"{'size':<9} {'engine':<8} {'params':>13} {'start s':>8}"
    for length in lengths:
        head += f" {'tok/s@' + str(length):>11} {'x hf':>6}"
    print(head)
    print("-" * len(head))
    order = {s: i for i, s in enumerate(settings["sizes"])}
    rows = sorted(results, key=lambda r: (order.get(r["size"], 99), GPU_ENGINES.index(r["engine"])))
    base = {r["size"]: r for r in rows if r["engine"] == "hf" and not r.get("error")}
    for r in rows:
        if r.get("error"):
            done = ", ".join(f"{k}: {v['tokens_per_s']:,.0f} tok/s" for k, v in r.get("partial", {}).items())
            print(f"{r['size']:<9} {r['engine']:<8} failed: {r['error']}" + (f" (done: {done})" if done else ""))
            continue
        line = f"{r['size']:<9} {r['engine']:<8} {r['params']:>13,} {r['startup_s']:>8.1f}"
        for length in lengths:
            m = r["lengths"].get(str(length))
            b = base.get(r["size"], {}).get("lengths", {}).get(str(length))
            tps = f"{m['tokens_per_s']:>11,.0f}" if m else f"{'-':>11}"
            x = f"{m['tokens_per_s'] / b['tokens_per_s']:>6.2f}" if m and b else f"{'-':>6}"
            line += f" {tps} {x}"
        print(line)
    if not refit:
        return
    if refit.get("error"):
        print(f"refit: failed: {refit['error']}")
        return
    print(
        f"\nrefit into vLLM: {refit['size']} ({refit['params']:,} parameters, {refit['bytes'] / 1e9:.2f} GB bf16), "
        f"engine start-up {refit['startup_s']:.1f} s"
    )
    head = (
        f"{'route':<6} {'trainer->engine':<16} {'refit ms':>9} {'cold ms':>8} {'GB/s':>6} {'ceiling ms':>11} "
        f"{'GB/s':>6} {'of ceiling':>10}"
    )
    print(head)
    print("-" * len(head))
    for route, m in refit["routes"].items():
        where = f"{m['trainer']}->{m['engine']}"
        print(
            f"{route:<6} {where:<16} {1e3 * m['refit_s']:>9.1f} {1e3 * m['refit_cold_s']:>8.1f} "
            f"{m['refit_gbps']:>6.1f} {1e3 * m['ceiling_s']:>11.2f} {m['ceiling_gbps']:>6.1f} "
            f"{m['ceiling_over_refit']:>10.1%}"
        )


if __name__ == "__main__":
    for path in sys.argv[1:]:
        run = json.loads(Path(path).read_text())
        print_gpu_tables(run["settings"], run["results"], run.get("refit") or {})
