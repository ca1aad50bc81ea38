"""Per-rank bodies for the resharding refit tests (``ReshardSender``/``ReshardReceiver``), each
run in a fresh process through ``_refit_procs.run_ranks``; split from ``_refit_procs`` (the
process pool, the stateless-group and packed-refit bodies), which they build on.
"""

from __future__ import annotations

import math
import time
from typing import Any

import torch
from _refit_procs import _bytes, _group, _noncontig, format_exc

from nemo_dataplane.refit import RefitError

# A tiny llama-like model (HF names) with grouped MoE experts, a router and a parameter no rule
# knows ("...router_A_log": moved whole from one sender). Shapes are small and some split
# unevenly (vocab 37 over 2 ranks).
RESHARD_LAYERS = 2


def reshard_shapes(moe: bool = False) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    h, kv, inter, vocab, e = 16, 8, 24, 37, 4
    bf, f32 = torch.bfloat16, torch.float32
    out: dict[str, tuple[tuple[int, ...], torch.dtype]] = {"model.embed_tokens.weight": ((vocab, h), bf)}
    for i in range(RESHARD_LAYERS):
        p = f"model.layers.{i}."
        out.update(
            {
                p + "input_layernorm.weight": ((h,), f32),
                p + "self_attn.q_proj.weight": ((h, h), bf),
                p + "self_attn.k_proj.weight": ((kv, h), bf),
                p + "self_attn.v_proj.weight": ((kv, h), bf),
                p + "self_attn.q_proj.bias": ((h,), bf),
                p + "self_attn.o_proj.weight": ((h, h), bf),
                p + "post_attention_layernorm.weight": ((h,), f32),
            }
        )
        if moe:
            out.update(
                {
                    p + "mlp.gate.weight": ((e, h), bf),
                    p + "mlp.experts.gate_proj": ((e, inter, h), bf),
                    p + "mlp.experts.up_proj": ((e, inter, h), bf),
                    p + "mlp.experts.down_proj": ((e, h, inter), bf),
                }
            )
        else:
            out.update(
                {
                    p + "mlp.gate_proj.weight": ((inter, h), bf),
                    p + "mlp.up_proj.weight": ((inter, h), bf),
                    p + "mlp.down_proj.weight": ((h, inter), bf),
                }
            )
    out["model.layers.0.mlp.router_A_log"] = ((5,), f32)
    out["model.layers.1.self_attn.sinks"] = ((3,), bf)  # odd bytes: later slots must stay aligned
    out["model.norm.weight"] = ((h,), f32)
    out["lm_head.weight"] = ((vocab, h), bf)
    return out


def reshard_full(seed: int, moe: bool = False) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s, generator=gen).to(dt) for n, (s, dt) in reshard_shapes(moe).items()}


def _hand_rule(name: str) -> str:
    """The sharding rule of a name, written out by hand (independent of layout.py)."""
    if ".experts." in name:
        return "expert_row" if "down_proj" in name else "expert_column"
    if any(f".{k}." in name for k in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")):
        return "column"
    if any(f".{k}.weight" in name for k in ("o_proj", "down_proj")):
        return "row"
    if "embed_tokens" in name or "lm_head" in name:
        return "column"
    return "whole"  # norms (replicated), the router and the unknown parameter


def _hand_stage(name: str, pp: int) -> int:
    if ".layers." in name:
        return int(name.split(".layers.")[1].split(".")[0]) * pp // RESHARD_LAYERS
    return pp - 1 if name.startswith(("model.norm.", "lm_head.")) else 0


def hand_shards(
    full: dict[str, torch.Tensor],
    *,
    tp: int = 1,
    tpr: int = 0,
    ep: int = 1,
    epr: int = 0,
    pp: int = 1,
    ppr: int = 0,
    fsdp: int = 1,
    fsdpr: int = 0,
    fused: bool = False,
) -> dict[str, torch.Tensor]:
    """What a rank at (tp rank, ep rank, pp stage, fsdp rank) holds, by torch.chunk, with
    vLLM-style fused qkv / gate_up (its q rows, k rows, v rows) when ``fused``; a fully sharded
    rank holds chunk ``fsdpr`` of every tensor's dim 0, whatever its name."""
    out: dict[str, torch.Tensor] = {}
    for n, t in full.items():
        if _hand_stage(n, pp) != ppr:
            continue
        if fsdp > 1:
            out[n] = t.chunk(fsdp, 0)[fsdpr].clone()
            continue
        rule = _hand_rule(n)
        if rule == "column":
            t = t.chunk(tp, 0)[tpr]
        elif rule == "row":
            t = t.chunk(tp, 1)[tpr]
        elif rule == "expert_column":
            t = t.chunk(ep, 0)[epr].chunk(tp, 1)[tpr]
        elif rule == "expert_row":
            t = t.chunk(ep, 0)[epr].chunk(tp, 2)[tpr]
        out[n] = t.clone()
    if fused:
        for n in list(out):
            for first, parts, name in (
                (".q_proj.weight", (".q_proj.weight", ".k_proj.weight", ".v_proj.weight"), ".qkv_proj.weight"),
                (".gate_proj.weight", (".gate_proj.weight", ".up_proj.weight"), ".gate_up_proj.weight"),
            ):
                if n.endswith(first):
                    pre = n[: -len(first)]
                    out[pre + name] = torch.cat([out.pop(pre + p) for p in parts])
    return out


# name -> (senders: mesh dims, receivers: mesh dims, moe, receiver fusions); ranks: senders first.
RESHARD_CASES: dict[str, tuple[dict[str, int], dict[str, int], bool, bool]] = {
    "tp2->tp1": ({"tp": 2}, {"tp": 1}, False, True),
    "tp1->tp2": ({"tp": 1}, {"tp": 2}, False, True),
    "dp2tp2->tp2": ({"dp": 2, "tp": 2}, {"tp": 2}, False, True),
    "pp2->pp1": ({"pp": 2}, {"tp": 1}, False, False),
    "ep2->ep1": ({"ep": 2}, {"ep": 1}, True, False),
    "tp1->tp1": ({"tp": 1}, {"tp": 1}, False, True),  # 2 ranks: the NCCL p2p case on 2 GPUs
    # A fully sharded trainer (dim 0 of every tensor) into a vLLM-like TP=2 generator.
    "fsdp2->tp2": ({"fsdp": 2}, {"tp": 2}, False, True),
}


def reshard_layouts(case: str, *, extra_receiver_param: bool = False) -> tuple[Any, Any]:
    from nemo_dataplane.refit.reshard.layout import Mesh
    from nemo_dataplane.refit.reshard.rules import DEFAULT_FUSIONS, build_layout, layer_stages

    sdims, rdims, moe, fused = RESHARD_CASES[case]
    ns, nr = math.prod(sdims.values()), math.prod(rdims.values())
    shapes = reshard_shapes(moe)
    stage = layer_stages(RESHARD_LAYERS, sdims.get("pp", 1))
    if "fsdp" in sdims:
        from nemo_dataplane.refit.reshard.facade import FSDP_RULES

        src = build_layout(Mesh.of(range(ns), **sdims), shapes, rules=FSDP_RULES, tp="fsdp")
    else:
        src = build_layout(Mesh.of(range(ns), **sdims), shapes, stage_of=stage)
    rshapes = dict(shapes)
    if extra_receiver_param:
        rshapes["model.layers.1.self_attn.q_norm.weight"] = ((16,), torch.float32)
    dst = build_layout(Mesh.of(range(ns, ns + nr), **rdims), rshapes, fusions=DEFAULT_FUSIONS if fused else None)
    return src, dst


def _coords_of(layout: Any, rank: int) -> dict[str, int]:
    return dict(zip(layout.mesh.dims, layout.mesh.coords[rank]))


def _hand_for(layout: Any, rank: int, full: dict[str, torch.Tensor], fused: bool) -> dict[str, torch.Tensor]:
    c = _coords_of(layout, rank)
    sizes = dict(zip(layout.mesh.dims, layout.mesh.sizes))
    return hand_shards(
        full,
        tp=sizes.get("tp", 1),
        tpr=c.get("tp", 0),
        ep=sizes.get("ep", 1),
        epr=c.get("ep", 0),
        pp=sizes.get("pp", 1),
        ppr=c.get("pp", 0),
        fsdp=sizes.get("fsdp", 1),
        fsdpr=c.get("fsdp", 0),
        fused=fused,
    )


def reshard_roundtrip(
    rank: int,
    world: int,
    port: int,
    case: str,
    versions: tuple[int, ...] = (7, 8),
    bucket_bytes: int = 1024,
    direct_bytes: int | None = 512,
    backend: str = "gloo",
    gpus: tuple[int, ...] | None = None,
    transport: str = "auto",
    timings: bool = False,
    done: str | None = None,
    delay_cycles: int = 0,
    open_mode: str | None = None,
) -> dict[str, Any]:
    """Refit ``case`` twice with different values; receivers compare bit patterns with the
    hand-sharded unsharded weights (on their current stream, right after the refit returned)
    and report what they received. ``gpus``: each rank's CUDA device (tensors there; ranks may
    share one with a gloo group and transport="ipc"). ``timings``: turn the endpoint's phase
    timing on and report its marks (else report that nothing was recorded). ``done``: the ipc
    done signal to use (default: the endpoint's). ``delay_cycles``: each sender queues a GPU
    sleep of that many cycles on its current stream before each refit, so its copies start
    late; a receiver reports whether its current stream still had work pending when the refit
    returned (``pending_at_return``). ``open_mode``: ``"torch"`` has senders open receivers on
    another GPU with torch's IPC open (``ipc_map_peers=False``) instead of mapping them."""
    from nemo_dataplane.refit.reshard import ReshardReceiver, ReshardSender

    dev = torch.device("cpu")
    if gpus is not None:
        torch.cuda.set_device(gpus[rank])
        dev = torch.device("cuda", gpus[rank])
    g = _group(rank, world, port, backend, gpu=None if gpus is None else gpus[rank])
    src, dst = reshard_layouts(case)
    moe, fused = RESHARD_CASES[case][2], RESHARD_CASES[case][3]
    out: dict[str, Any] = {}
    if rank in src.mesh.coords:
        mine = {k: v.to(dev) for k, v in _hand_for(src, rank, reshard_full(0, moe), False).items()}
        # A strided source exercises packing from views.
        mine = {k: (_noncontig(v) if k.endswith("o_proj.weight") else v) for k, v in mine.items()}
        ep: Any = ReshardSender(
            g,
            lambda: mine,
            src,
            bucket_bytes,
            direct_bytes=direct_bytes,
            transport=transport,
            device=dev,
            ipc_map_peers=open_mode != "torch",
        )
        plan = ep.prepare_refit_info()
        if timings:
            ep.timings = []
        if done is not None:
            ep.done = done
        sent = []
        for i, v in enumerate(versions):
            if i:
                fresh = _hand_for(src, rank, reshard_full(i, moe), False)
                for k in mine:
                    mine[k].copy_(fresh[k])
            if delay_cycles:
                torch.cuda._sleep(delay_cycles)  # the copies wait for the current stream
            ep.send_weights(v)
            sent.append(ep.bytes_moved)
        out.update(sent=sent, plan_bytes_from=plan.bytes_from(rank))
        if ep._push is not None:  # ipc: whether the copies went out raw, and how (placement)
            out.update(
                raw=ep._push.raw,
                raw_error=ep._push.raw_error,
                pitched=ep._push.pitched,
                copies_used=ep._push.copies_used,
                mapped=ep._push.mapped,
                map_error=ep._push.map_error,
            )
    else:
        shards = _hand_for(dst, rank, reshard_full(0, moe), fused)
        mine = {k: torch.zeros_like(v, device=dev) for k, v in shards.items()}
        mine = {k: (_noncontig(v) if k.endswith("down_proj.weight") else v) for k, v in mine.items()}
        ep = ReshardReceiver(g, mine, dst, device=dev)
        plan = ep.prepare_refit_info()
        if timings:
            ep.timings = []
        if done is not None:
            ep.done = done
        refits = []
        for i in range(len(versions)):
            v = ep.receive_weights()
            pending = None
            if gpus is not None:
                probe = torch.cuda.Event()
                probe.record()
                pending = not probe.query()
            want = _hand_for(dst, rank, reshard_full(i, moe), fused)
            wrong = sorted(k for k in want if not torch.equal(_bytes(mine[k]), _bytes(want[k])))
            refits.append(
                {
                    "version": v,
                    "wrong": wrong,
                    "received": ep.bytes_moved,
                    "pending_at_return": pending,
                    "owned": sum(t.numel() * t.element_size() for t in want.values()),
                    "names": sorted(mine),
                }
            )
        out.update(
            refits=refits,
            plan_bytes_to=plan.bytes_to(rank),
            staging=ep._exchange.staging_bytes if ep._exchange is not None else 0,
        )
    out["timings"] = None if ep.timings is None else [list(m.items()) for m in ep.timings]
    out["done"] = getattr(ep, "done", None)
    if getattr(ep, "_push", None) is not None:  # ipc: a peer of this rank on another GPU
        out["cross_gpu"] = ep._push.cross_gpu
    out.update(
        fallback=list(plan.fallback),
        fingerprint=plan.fingerprint,
        transport=ep.transport,
        senders_by_param={p.param: sorted({q.src for q in plan.pieces if q.param == p.param}) for p in plan.pieces},
    )
    g.barrier()
    ep.close()
    g.barrier()
    g.destroy()
    return out


def check_timings(res: dict[int, Any], phases: dict[str, list[str]], refits: int) -> None:
    """Every rank recorded ``refits`` refits, each with ``phases[role]`` in order, non-decreasing
    marks, and a later refit after an earlier one."""
    for r, out in res.items():
        role = "send" if "sent" in out else "recv"
        marks = out["timings"]
        assert marks is not None and len(marks) == refits, (r, marks)
        for m in marks:
            assert [k for k, _ in m] == ["start", *phases[role]], (r, m)
            ts = [t for _, t in m]
            assert ts == sorted(ts), (r, m)
        assert marks[1][0][1] >= marks[0][-1][1], (r, marks)


def check_reshard(res: dict[int, Any], case: str) -> None:
    """What every ``reshard_roundtrip`` must show (CPU and GPU tests)."""
    for r, out in res.items():
        assert not isinstance(out, BaseException), f"rank {r}:\n{format_exc(out)}"
    src, dst = reshard_layouts(case)
    assert len({res[r]["fingerprint"] for r in res}) == 1, "every rank must compute the same plan"
    received = 0
    for r in dst.mesh.ranks:
        out = res[r]
        assert [x["version"] for x in out["refits"]] == [7, 8]
        assert [x["wrong"] for x in out["refits"]] == [[], []], (r, out["refits"])
        for x in out["refits"]:
            assert x["received"] == x["owned"] == out["plan_bytes_to"], (r, x)
        received += out["refits"][0]["received"]
        assert out["staging"] <= 2 * (1024 + 16 * len(src.mesh.ranks)), out["staging"]  # 2 rounds (ipc: 0)
        names = out["refits"][0]["names"]
        fused = RESHARD_CASES[case][3]
        assert ("model.layers.0.self_attn.qkv_proj.weight" in names) == fused, names
        assert ("model.layers.1.mlp.gate_up_proj.weight" in names) == fused, names
    sent = [res[s]["sent"] for s in src.mesh.ranks]
    assert all(a == b == res[s]["plan_bytes_from"] for (a, b), s in zip(sent, src.mesh.ranks)), sent
    assert sum(a for a, _ in sent) == received, (sent, received)
    if "fsdp" in src.mesh.dims:
        # every parameter, unknown names included, is split by dim 0: each arrives from both
        assert res[dst.mesh.ranks[0]]["fallback"] == []
        assert res[dst.mesh.ranks[0]]["senders_by_param"]["model.layers.0.mlp.router_A_log"] == [0, 1]
    else:
        # the parameter no rule knows arrived whole from one sender
        assert "model.layers.0.mlp.router_A_log" in res[dst.mesh.ranks[0]]["fallback"]
        assert res[dst.mesh.ranks[0]]["senders_by_param"]["model.layers.0.mlp.router_A_log"] == [0]
    if case == "dp2tp2->tp2":  # both data-parallel replicas of the trainer send
        assert all(res[s]["sent"][0] > 0 for s in src.mesh.ranks)


def reshard_failures(rank: int, world: int, port: int, what: str) -> dict[str, Any]:
    """``what="missing"``: a receiver parameter no sender has: prepare fails everywhere naming
    it. ``what="abort"``: sender rank 1's tensor changes shape after prepare: every rank raises
    before any bulk moves and the next refit (layout restored) works."""
    from nemo_dataplane.refit.reshard import ReshardReceiver, ReshardSender

    g = _group(rank, world, port, "gloo", timeout=10.0)
    src, dst = reshard_layouts("tp2->tp1", extra_receiver_param=what == "missing")
    full = reshard_full(0)
    sender = rank in src.mesh.coords
    layout = src if sender else dst
    mine = _hand_for(layout, rank, full, not sender)
    if not sender:
        mine = {k: torch.zeros_like(v) for k, v in mine.items()}
        if what == "missing":
            mine["model.layers.1.self_attn.q_norm.weight"] = torch.zeros(16)
    holder = {"t": mine}
    ep: Any = ReshardSender(g, lambda: holder["t"], layout, 1024) if sender else ReshardReceiver(g, mine, layout)
    out: dict[str, Any] = {}
    try:
        ep.prepare_refit_info()
        out["prepare"] = None
    except RefitError as e:
        out["prepare"] = {"error": type(e).__name__, "msg": str(e)}
        g.destroy()
        return out
    if rank == 1:
        holder["t"] = {**mine, "model.norm.weight": torch.zeros(17)}
    try:
        ep.send_weights(3) if sender else ep.receive_weights()
        out["abort"] = None
    except RefitError as e:
        out["abort"] = {"error": type(e).__name__, "msg": str(e)}
    if not sender:
        out["untouched"] = all(bool((t == 0).all()) for t in mine.values())
    holder["t"] = mine
    if sender:
        ep.send_weights(4)
    else:
        out["next_version"] = ep.receive_weights()
        want = _hand_for(layout, rank, full, True)
        out["wrong"] = sorted(k for k in want if not torch.equal(_bytes(mine[k]), _bytes(want[k])))
    g.barrier()
    g.destroy()
    return out


def reshard_ipc_failure(rank: int, world: int, port: int, what: str, timeout: float = 6.0) -> dict[str, Any]:
    """TP=2 -> TP=1 over CUDA IPC on GPU 0 (3 processes), ``done="event"``. Refit 3: sender
    rank 1 fails: ``what="raise"``: its copies cannot be enqueued (injected error);
    ``"silent"``: it returns after the header without copying or signalling (as if it died
    there). Every rank reports what refit 3 raised and how long it took; then refit 4 (new
    values) runs normally and the receiver compares its bits."""
    from nemo_dataplane.refit.reshard import ReshardReceiver, ReshardSender

    torch.cuda.set_device(0)
    dev = torch.device("cuda", 0)
    g = _group(rank, world, port, "gloo", timeout=timeout)
    src, dst = reshard_layouts("tp2->tp1")
    sender = rank in src.mesh.coords
    layout = src if sender else dst
    mine = {k: v.to(dev) for k, v in _hand_for(layout, rank, reshard_full(0), not sender).items()}
    if not sender:
        mine = {k: torch.zeros_like(v) for k, v in mine.items()}
    ep: Any = (
        ReshardSender(g, mine, layout, transport="ipc", device=dev)
        if sender
        else ReshardReceiver(g, mine, layout, device=dev)
    )
    ep.prepare_refit_info()
    ep.done = "event"
    out: dict[str, Any] = {}
    if rank == 1:
        if what == "raise":
            real = ep._push.issue

            def broken(*_: Any, **__: Any) -> Any:
                ep._push.issue = real
                raise RuntimeError("injected: copies refused")

            ep._push.issue = broken
        else:
            real_done = ep._event_done

            def silent(*_: Any, **__: Any) -> None:
                ep._event_done = real_done

            ep._event_done = silent
    t0 = time.monotonic()
    try:
        ep.send_weights(3) if sender else ep.receive_weights()
        out["first"] = None
    except Exception as e:
        out["first"] = {"error": type(e).__name__, "msg": str(e)}
    out["first_s"] = time.monotonic() - t0
    if what == "silent" and sender:
        time.sleep(timeout)  # the receiver spends the group timeout in refit 3: do not outwait it in 4's header
    fresh = _hand_for(layout, rank, reshard_full(1), not sender)
    if sender:
        for k in mine:
            mine[k].copy_(fresh[k])
        ep.send_weights(4)
    else:
        out["next_version"] = ep.receive_weights()
        out["wrong"] = sorted(k for k in fresh if not torch.equal(_bytes(mine[k]), _bytes(fresh[k])))
    g.barrier()
    ep.close()
    g.barrier()
    g.destroy()
    return out


def facade_reshard(rank: int, world: int, port: int, versions: tuple[int, ...] = (7, 8)) -> dict[str, Any]:
    """TP=2 -> TP=1 through the facade, as the trainer uses it: ranks 0 and 1 pass their TP
    shards (HF names, hand-sharded) with the full shapes; rank 2 passes whole tensors. The
    receiver compares its bits with the unsharded weights after each refit."""
    from nemo_dataplane.refit import WeightTransferConfig, build_weight_receiver, build_weight_sender

    cfg = WeightTransferConfig(family="reshard", bucket_bytes=1024, direct_bytes=512)
    g = _group(rank, world, port, "gloo")
    shapes = reshard_shapes()
    out: dict[str, Any] = {}
    if rank < 2:
        mine = hand_shards(reshard_full(0), tp=2, tpr=rank)
        ep: Any = build_weight_sender(cfg, g, mine, senders=2, full_shapes=shapes)
        ep.prepare_refit_info()
        for i, v in enumerate(versions):
            if i:
                for k, t in hand_shards(reshard_full(i), tp=2, tpr=rank).items():
                    mine[k].copy_(t)
            ep.send_weights(v)
        out["sent"] = ep.bytes_moved
    else:
        mine = {n: torch.zeros(s, dtype=dt) for n, (s, dt) in shapes.items()}
        ep = build_weight_receiver(cfg, g, mine, senders=2)
        ep.prepare_refit_info()
        out["refits"] = []
        for i in range(len(versions)):
            v = ep.receive_weights()
            want = reshard_full(i)
            out["refits"].append(
                {"version": v, "wrong": sorted(k for k in want if not torch.equal(_bytes(mine[k]), _bytes(want[k])))}
            )
    out["kind"] = type(ep).__name__
    g.barrier()
    ep.close()
    g.destroy()
    return out
