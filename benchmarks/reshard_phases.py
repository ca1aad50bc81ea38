"""``bench_refit.py --reshard`` diagnostics: where a resharding refit's time goes.

* **Host phases** (every scenario): each endpoint's opt-in ``timings`` (``refit/reshard/endpoints.py``)
  over the timed refits; per rank, the median duration of each phase and the median time its
  end comes after the first rank's start of that refit (host clocks are one clock: same host).
* **Copies only** (GPU, ``transport="ipc"``, two senders): the senders' copies of one refit,
  issued through their ``IpcPush`` with no control at all (no header, no done ``all_reduce``,
  no readiness), after a barrier, in four ways:

  - ``sender 0 alone`` / ``sender 1 alone``: one sender process copies its shards while the
    other waits in the next barrier;
  - ``both senders, 2 processes``: both at once, as in a refit;
  - ``both shards, 1 process``: sender 0's process issues both senders' copies (it holds a
    copy of sender 1's shards and writes through its own opened views of the receiver),
    every push on its own streams, so one CUDA context runs all of them.

  Wall: first issuing rank's start to the last one's copies done (host, after an event wait).
  If one process issuing everything is near the ceiling while two processes are not, the two
  contexts' time-sharing of the GPU (no MPS) is the cost; if the copies alone are near the
  ceiling in every way, the refit's extra time is host control.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Mapping
from typing import Any

import torch
from refit_model import local_values

from nemo_dataplane.refit.reshard.ipc_push import IpcPush

MODES = ("sender 0 alone", "sender 1 alone", "both senders, 2 processes", "both shards, 1 process")


def phase_durations(marks: Mapping[str, float]) -> dict[str, float]:
    """One refit's ``timings`` entry (phase -> time mark, in order) as seconds per phase, plus ``total``."""
    out: dict[str, float] = {}
    names = list(marks)
    for prev, name in zip(names, names[1:]):
        out[name] = marks[name] - marks[prev]
    out["total"] = marks[names[-1]] - marks[names[0]]
    return out


def phase_table(per_rank: dict[int, list[dict[str, float]]]) -> dict[int, dict[str, tuple[float, float]]]:
    """rank -> phase -> (median duration ms, median end ms after the first rank's start)."""
    n = min(len(v) for v in per_rank.values())
    starts = [min(per_rank[r][i]["start"] for r in per_rank) for i in range(n)]
    out: dict[int, dict[str, tuple[float, float]]] = {}
    for r, marks in per_rank.items():
        durs = [phase_durations(m) for m in marks[:n]]
        out[r] = {}
        for ph in durs[0]:
            end = [(marks[i][ph] if ph != "total" else list(marks[i].values())[-1]) - starts[i] for i in range(n)]
            out[r][ph] = (statistics.median(d[ph] for d in durs) * 1e3, statistics.median(end) * 1e3)
    return out


def print_phase_table(name: str, table: dict[int, dict[str, tuple[float, float]]], roles: dict[int, str]) -> None:
    phases: list[str] = []
    for t in table.values():
        phases += [p for p in t if p not in phases and p != "total"]
    phases.append("total")
    cols = sorted(table)
    print(f"   {name}: host phases, median ms: duration / end after the first rank's start")
    print("   " + f"{'phase':<8}" + "".join(f"  {roles[r]:>22}" for r in cols))
    for ph in phases:
        cells = [f"{table[r][ph][0]:.3f} / {table[r][ph][1]:.3f}" if ph in table[r] else "-" for r in cols]
        print("   " + f"{ph:<8}" + "".join(f"  {c:>22}" for c in cells))


def copies_only(
    rank: int,
    world: int,
    tp_train: int,
    ctl: Any,
    ep: Any,
    src: Any,
    tensors: dict[str, torch.Tensor],
    dev: torch.device,
    warmup: int,
    iters: int,
    sync: Any,
    check: Any,
) -> dict[str, Any] | None:
    """The copies-only modes (module doc); collective over every rank. Rank 0 returns
    mode -> results; a rank's failure is reported, never left for the others to wait out."""
    err: list[str] = []
    push = ep._push if rank < tp_train else None
    extra: tuple[IpcPush, dict[str, torch.Tensor]] | None = None
    if rank == 0:
        try:
            shards1 = local_values(src, 1, dev)
            p1 = IpcPush(ep.reshard_plan, 1, True, src.local_tensors(1), dev)
            p1.use_views(push.views)
            extra = (p1, shards1)
        except Exception as e:
            err.append(f"rank 0 could not set up sender 1's copies: {e!r}")
    if push is not None:
        push.timing = False
    out: dict[str, Any] = {}
    for m, mode in enumerate(MODES):
        jobs: list[tuple[IpcPush, dict[str, torch.Tensor]]] = []
        if (m == 0 and rank == 0) or (m == 1 and rank == 1) or (m == 2 and rank < tp_train):
            jobs = [(push, tensors)]
        elif m == 3 and rank == 0 and extra is not None:
            jobs = [(push, tensors), extra]
        walls: list[float] = []
        per_rank: dict[int, list[list[float]]] = {}
        for i in range(warmup + iters):
            if rank >= tp_train:
                for t in tensors.values():
                    t.zero_()
            sync()
            rec = None
            if jobs:
                try:
                    rec = _issue_all(jobs, dev)
                except Exception as e:
                    err.append(f"rank {rank}, {mode}: {e!r}")
                    jobs = []
            ctl.store.set(f"bench/copies/{m}/{i}/{rank}", json.dumps(rec).encode())
            if rank == 0:
                ctl.wait_for_ranks(lambda r: f"bench/copies/{m}/{i}/{r}", range(world), f"copies-only {mode}")
                recs = {r: json.loads(ctl.store.get(f"bench/copies/{m}/{i}/{r}")) for r in range(world)}
                recs = {r: v for r, v in recs.items() if v is not None}
                if recs and i >= warmup:
                    walls.append(max(v[2] for v in recs.values()) - min(v[0] for v in recs.values()))
                    for r, v in recs.items():
                        per_rank.setdefault(r, []).append(v)
        ok = None
        sync()  # every sender's copies done
        if rank >= tp_train and m >= 2:
            ep._push.scatter()
            ok = bool(check())
        ctl.store.set(f"bench/copies/{m}/ok/{rank}", json.dumps([ok, err]).encode())
        if rank == 0:
            ctl.wait_for_ranks(lambda r: f"bench/copies/{m}/ok/{r}", range(world), f"copies-only {mode} results")
            res = [json.loads(ctl.store.get(f"bench/copies/{m}/ok/{r}")) for r in range(world)]
            oks = [x[0] for x in res if x[0] is not None]
            out[mode] = {
                "median_ms": statistics.median(walls) * 1e3 if walls else None,
                "best_ms": min(walls) * 1e3 if walls else None,
                "correct": all(oks) if oks else None,
                "issue_ms": {r: statistics.median(v[1] - v[0] for v in vs) * 1e3 for r, vs in per_rank.items()},
                "gpu_ms": {r: statistics.median(v[3] for v in vs) for r, vs in per_rank.items()},
                "errors": sorted({e for x in res for e in x[1]}),
            }
        sync()
    del extra
    torch.cuda.empty_cache()
    return out if rank == 0 else None


def _issue_all(jobs: list[tuple[IpcPush, dict[str, torch.Tensor]]], dev: torch.device) -> list[float]:
    """Issue every job's copies, each from its own stream (so one process's pushes do not
    queue behind each other), and wait: [t_start, t_issued, t_done] (host s) and GPU ms."""
    cur = torch.cuda.current_stream(dev)
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    sides = [torch.cuda.Stream(dev) for _ in jobs]
    t0 = time.perf_counter()
    e0.record(cur)
    for (p, t), s in zip(jobs, sides):
        s.wait_stream(cur)
        with torch.cuda.stream(s), torch.no_grad():
            p.issue(t)
    for s in sides:
        cur.wait_stream(s)
    e1.record(cur)
    t1 = time.perf_counter()
    e1.synchronize()
    t2 = time.perf_counter()
    return [t0, t1, t2, e0.elapsed_time(e1)]


def print_copies(res: dict[str, Any], ceiling_ms: float | None) -> None:
    print("   copies only (no control; wall = first start to last copies done, host):")
    print(
        f"   {'mode':<27}  {'median ms':>9}  {'best ms':>8}  {'x ceiling':>9}  correct  "
        f"{'issue ms (host) per rank':>24}  GPU ms per rank"
    )
    for mode, v in res.items():
        if v["median_ms"] is None:
            print(f"   {mode:<27}  failed: {v['errors']}")
            continue
        x = f"{v['median_ms'] / ceiling_ms:.3f}" if ceiling_ms else "-"
        iss = ", ".join(f"{r}: {t:.2f}" for r, t in sorted(v["issue_ms"].items()))
        gpu = ", ".join(f"{r}: {t:.2f}" for r, t in sorted(v["gpu_ms"].items()))
        print(
            f"   {mode:<27}  {v['median_ms']:>9.2f}  {v['best_ms']:>8.2f}  {x:>9}  {str(v['correct']):<7}  "
            f"{iss:>24}  {gpu}" + (f"  errors: {v['errors']}" if v["errors"] else "")
        )
