"""``bench_data_plane.py``'s tables and targets: each row's MB/s and its ratios to both Ray
baselines of the same batch and reader count, the targets, the tiny-batch latencies and the
start-up."""

from __future__ import annotations

from typing import Any

from data_plane_startup import report_startup

ORDER = [
    "memcpy",
    "memory",
    "ray",
    "ray_zero_copy",
    "ray_store",
    "ray_store_zc_reads",
    "tq_raw_plain",
    "tq_raw",
    "tq_adapter_plain",
    "tq_adapter",
]

# The table (one run, before this work): tq_adapter / ray_zero_copy MB/s.
BEFORE_VS_ZC = {"256/dense": 0.33, "256/jagged": 0.25, "1024/dense": 0.25, "1024/jagged": 0.20}


def report(
    rows: list[dict[str, Any]], lat: dict[str, Any], start: dict[str, Any], sizes: list[int], readers: list[int]
) -> dict[str, Any]:
    for r in rows:
        r["total_s"] = r["put_s"] + r["get_s"]
        r["mb_s"] = r["bytes"] / 1e6 / r["total_s"]
        r["best_mb_s"] = r["bytes"] / 1e6 / r["best_s"]
    base = {
        (r["method"], r["batch"], r["layout"], r["readers"]): r for r in rows if r["method"] in ("ray", "ray_zero_copy")
    }
    for r in rows:
        k = (r["batch"], r["layout"], r["readers"])
        for m, col in (("ray", "vs_ray"), ("ray_zero_copy", "vs_zc")):
            b = base[(m, *k)]
            r[col] = r["mb_s"] / b["mb_s"]
            r[f"best_{col}"] = r["best_mb_s"] / b["best_mb_s"]
    rows.sort(key=lambda r: (r["readers"], r["batch"], r["layout"], ORDER.index(r["method"])))

    header = (
        f"{'rd':>2} {'batch':>5} {'layout':>6} {'method':>18} {'MB':>6} {'put ms':>7} {'get ms':>7} {'MB/s':>6}"
        f" {'vs ray':>6} {'vs zc':>6} {'best MB/s':>9} {'best vs zc':>10}"
    )
    print(header)
    print("-" * len(header))
    for r in rows:
        print(
            f"{r['readers']:>2} {r['batch']:>5} {r['layout']:>6} {r['method']:>18} {r['bytes'] / 1e6:>6.1f} "
            f"{r['put_s'] * 1e3:>7.1f} {r['get_s'] * 1e3:>7.1f} {r['mb_s']:>6.0f} {r['vs_ray']:>6.2f} "
            f"{r['vs_zc']:>6.2f}"
            f" {r['best_mb_s']:>9.0f} {r['best_vs_zc']:>10.2f}"
        )

    def ratio(method: str, b: int, lay: str, rd: int, col: str) -> float | None:
        hit = [r[col] for r in rows if (r["method"], r["batch"], r["layout"], r["readers"]) == (method, b, lay, rd)]
        return hit[0] if hit else None

    targets: dict[str, Any] = {}
    for rd in readers:
        for b in sizes:
            for lay in ("dense", "jagged"):
                k = f"{b}/{lay}/r{rd}"
                targets[k] = {
                    "ray_store_vs_zc": ratio("ray_store", b, lay, rd, "vs_zc"),
                    "ray_store_zc_reads_vs_zc": ratio("ray_store_zc_reads", b, lay, rd, "vs_zc"),
                    "tq_adapter_vs_ray": ratio("tq_adapter", b, lay, rd, "vs_ray"),
                    "tq_adapter_vs_zc": ratio("tq_adapter", b, lay, rd, "vs_zc"),
                }
                before = BEFORE_VS_ZC.get(f"{b}/{lay}")
                if before is not None and rd == 1:
                    targets[k]["tq_adapter_vs_zc_needed_for_half_gap"] = 1 - (1 - before) / 2
    print(
        "\nTargets (readers=1): ray_store >= 0.9x zero-copy at >= 1024; "
        "tq_adapter >= 1.0x ray and gap to zero-copy halved"
    )
    for k, v in targets.items():
        if k.endswith("/r1"):
            print(f"  {k:>16}: " + ", ".join(f"{n}={x:.2f}" for n, x in v.items() if x is not None))
    print("\nTiny batch (8 rows dense) put + get latency, median / best ms:")
    for name, v in lat.items():
        if isinstance(v, (list, tuple)):
            print(f"  {name:>18}: {v[0] * 1e3:7.2f} / {v[1] * 1e3:7.2f}")
    claims = {k: v for k, v in lat.items() if k.startswith("claim_")}
    if claims:
        print("\nWaiting claim of one row: from the put's return (row produced) to the claim's return, ms:")
        for name, v in claims.items():
            print(
                f"  {name[len('claim_') :]:>18}: median {v['from_put_return_median_s'] * 1e3:7.2f}, best "
                f"{v['from_put_return_best_s'] * 1e3:7.2f} (from the put's start: median "
                f"{v['from_put_start_median_s'] * 1e3:.2f})"
            )
    report_startup(start)
    return targets


def report_wire(rows: list[dict[str, Any]], lat: dict[str, Any]) -> dict[str, Any]:
    """The TransferQueue rows on the authenticated wire beside the same on a plain one (rows as
    :func:`report` left them): median put + get ms each and their ratio; the tiny batch too."""
    by = {(r["method"], r["batch"], r["layout"], r["readers"]): r for r in rows}
    out: dict[str, Any] = {}
    print("\nTransferQueue wire: CURVE + ZAP check (auth) vs plain ZMQ, median put + get ms")
    print(f"{'rd':>2} {'batch':>5} {'layout':>6} {'method':>10} {'plain ms':>9} {'auth ms':>8} {'auth/plain':>10}")
    for (method, b, lay, rd), r in sorted(by.items(), key=lambda kv: (kv[0][3], kv[0][1], kv[0][2], kv[0][0])):
        plain = by.get((f"{method}_plain", b, lay, rd))
        if method not in ("tq_adapter", "tq_raw") or plain is None:
            continue
        ratio = r["total_s"] / plain["total_s"]
        out[f"{method}/{b}/{lay}/r{rd}"] = {"plain_s": plain["total_s"], "auth_s": r["total_s"], "ratio": ratio}
        print(
            f"{rd:>2} {b:>5} {lay:>6} {method:>10} {plain['total_s'] * 1e3:>9.1f} {r['total_s'] * 1e3:>8.1f}"
            f" {ratio:>10.2f}"
        )
    if "tq_adapter" in lat and "tq_adapter_plain" in lat:
        auth, plain = lat["tq_adapter"], lat["tq_adapter_plain"]
        out["tiny_tq_adapter"] = {"plain_s": plain, "auth_s": auth}
        print(
            f"tiny batch (8 rows) tq_adapter put + get, median / best ms: plain {plain[0] * 1e3:.2f} / "
            f"{plain[1] * 1e3:.2f}, auth {auth[0] * 1e3:.2f} / {auth[1] * 1e3:.2f}"
        )
    return out
