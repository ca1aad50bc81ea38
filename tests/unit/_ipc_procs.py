"""Per-rank bodies of the packed refit's CUDA IPC tests (``test_refit_gpu.py``): pull and push,
handle reuse, setup failures and a failing receiver copy. Kept apart from ``_refit_procs.py``
(the pool, the group bodies and the transport-neutral refit bodies) for the same reason those
live outside the test modules: a spawned child imports them by name."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
from _refit_procs import _bytes, _group, _noncontig, _step_in_place, model_tensors

from nemo_dataplane.refit import RefitError, RefitReceiver, RefitSender


def refit_ipc(
    rank: int, world: int, port: int, versions: tuple[int, ...] = (11, 12), copy_on: str = "src"
) -> dict[str, Any]:
    """transport="ipc": refits with values changing in place (handles opened once and reused),
    then one more refit after the sender's tensors moved to new storage (new handles)."""
    g = _group(rank, world, port, "nccl")
    dev = g.device
    if rank == 0:
        src = model_tensors(0, dev)
        src = {k: (_noncontig(v) if k in ("layers.0.attn.qkv", "layers.0.mlp.up") else v) for k, v in src.items()}
        holder = {"t": src}
        snd = RefitSender(g, lambda: holder["t"], transport="ipc", ipc_direction="pull", ipc_copy_on=copy_on)
        info = snd.prepare_refit_info()
        exported = snd._ipc_keep
        same = []
        for i, v in enumerate(versions):
            _step_in_place(src, i, dev)
            snd.send_weights(v)
            same.append(snd._ipc_keep is exported)
        # New storage for every tensor: the next refit must publish (and receivers open) new handles.
        holder["t"] = {k: v.clone() for k, v in model_tensors(len(versions), dev).items()}
        snd.send_weights(100)
        moved = snd._ipc_keep is not exported
        g.barrier()
        snd.close()
        g.destroy()
        return {"transport": info.transport, "self_transport": snd.transport, "same_handles": same, "reexported": moved}
    dst = {k: torch.zeros_like(v) for k, v in model_tensors(0, dev).items()}
    dst["layers.0.mlp.up"] = _noncontig(dst["layers.0.mlp.up"])
    dst["lm_head.big"] = torch.zeros(2 * dst["lm_head.big"].numel(), device=dev)[::2]
    rcv = RefitReceiver(g, dst)
    rcv.ipc_timing = copy_on == "src"  # exercise the event-timing path too
    info = rcv.prepare_refit_info()
    views = rcv._ipc_views
    got = []
    for i in range(len(versions) + 1):
        v = rcv.receive_weights()
        want = model_tensors(i, torch.device("cpu"))
        wrong = [k for k in want if not torch.equal(_bytes(dst[k]), _bytes(want[k]))]
        got.append({"version": v, "attr_version": rcv.version, "wrong": wrong, "same_views": rcv._ipc_views is views})
    g.barrier()
    out = {
        "refits": got,
        "transport": info.transport,
        "raw": rcv._copier.raw,
        "raw_error": rcv._copier.raw_error,
        "mode": rcv._copier.mode,
        "batch_error": rcv._copier.batch_error,
        "phases": dict(rcv.ipc_phases),
    }
    rcv.close()
    g.destroy()
    return out


def refit_push(rank: int, world: int, port: int, versions: tuple[int, ...] = (21, 22)) -> dict[str, Any]:
    """transport="ipc", ipc_direction="push": the sender writes into the receiver's exported
    tensors (strided sources and destinations, 0-dim, empty, bf16/fp8/bool). Refits with values
    changing in place, one after the sender's tensors moved (a new plan, no new handles), then
    the receiver reallocates a tensor: both sides raise, the group stays usable, and after a new
    prepare the next refit works."""
    g = _group(rank, world, port, "nccl")
    dev = g.device
    n = len(versions)
    if rank == 0:
        src = model_tensors(0, dev)
        src = {k: (_noncontig(v) if k in ("layers.0.attn.qkv", "layers.0.mlp.up") else v) for k, v in src.items()}
        holder = {"t": src}
        snd = RefitSender(g, lambda: holder["t"], transport="ipc", ipc_direction="push")
        snd.ipc_timing = True
        info = snd.prepare_refit_info()
        for i, v in enumerate(versions):
            _step_in_place(src, i, dev)
            snd.send_weights(v)
        # New storage, some of it strided in a different way: a new copy plan, same handles.
        fresh = model_tensors(n, dev)
        holder["t"] = {
            k: (_noncontig(v) if k in ("embed.weight", "layers.0.mlp.down_fp8") else v.clone())
            for k, v in fresh.items()
        }
        snd.send_weights(100)
        refused: dict[str, Any] = {"error": None}
        try:
            snd.send_weights(101)  # the receiver's tensor moved: it refuses, we hear it
        except RefitError as e:
            refused = {"error": type(e).__name__, "msg": str(e)}
        snd.prepare_refit_info()
        holder["t"] = {k: v.clone() for k, v in model_tensors(n + 1, dev).items()}
        snd.send_weights(102)
        phases = dict(snd.ipc_phases)
        g.barrier()
        snd.close()
        out = {
            "transport": info.transport,
            "direction": info.extra.get("ipc_direction"),
            "closed": snd._push_src is None,
            "refused": refused,
            "phases": phases,
            "mode": snd._copier.mode,
            "batch_error": snd._copier.batch_error,
        }
        g.destroy()
        return out
    dst = {k: torch.zeros_like(v) for k, v in model_tensors(0, dev).items()}
    dst["layers.0.mlp.up"] = _noncontig(dst["layers.0.mlp.up"])
    dst["lm_head.big"] = torch.zeros(2 * dst["lm_head.big"].numel(), device=dev)[::2]
    rcv = RefitReceiver(g, lambda: dst)
    info = rcv.prepare_refit_info()
    got = []

    def check(i: int) -> None:
        v = rcv.receive_weights()
        want = model_tensors(i, torch.device("cpu"))
        wrong = [k for k in want if not torch.equal(_bytes(dst[k]), _bytes(want[k]))]
        got.append({"version": v, "attr_version": rcv.version, "wrong": wrong})

    for i in range(n + 1):
        check(i)
    dst["layers.0.norm"] = torch.zeros_like(dst["layers.0.norm"])  # reallocated after prepare
    moved: dict[str, Any] = {"error": None}
    try:
        rcv.receive_weights()
    except Exception as e:
        moved = {"error": type(e).__name__, "msg": str(e)}
    rcv.prepare_refit_info()
    check(n + 1)
    g.barrier()
    rcv.close()
    g.destroy()
    return {"refits": got, "transport": info.transport, "direction": info.extra.get("ipc_direction"), "moved": moved}


def refit_push_waits_for_receiver(rank: int, world: int, port: int) -> dict[str, Any]:
    """Push must not write while the receiver's queued work still reads its tensors: the
    receiver queues a long GPU sleep and a snapshot of its weights on its current stream, then
    calls receive_weights(); the sender sends at once. The snapshot must hold the old weights."""
    g = _group(rank, world, port, "nccl")
    dev = g.device
    old = torch.full((1 << 20,), 1.0, device=dev)
    if rank == 0:
        w = {"w": old.clone()}
        snd = RefitSender(g, w, transport="ipc", ipc_direction="push")
        snd.prepare_refit_info()
        snd.send_weights(1)
        g.barrier()
        w["w"].fill_(2.0)
        torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        snd.send_weights(2)
        out = {"send_s": time.perf_counter() - t0}
        g.barrier()
        snd.close()
        g.destroy()
        return out
    w = {"w": torch.zeros_like(old)}
    rcv = RefitReceiver(g, w)
    rcv.prepare_refit_info()
    rcv.receive_weights()
    g.barrier()
    torch.cuda._sleep(1_000_000_000)  # 0.5-1 s of GPU time (1e9 cycles)
    snap = w["w"].clone()  # queued behind the sleep, on the current stream
    version = rcv.receive_weights()
    out = {"version": version, "snap": sorted(set(snap.cpu().tolist())), "after": sorted(set(w["w"].cpu().tolist()))}
    g.barrier()
    rcv.close()
    g.destroy()
    return out


def refit_ipc_setup_fails(rank: int, world: int, port: int, direction: str, transport: str) -> dict[str, Any]:
    """The receiver's half of the CUDA IPC setup fails (injected: pull, it cannot open the
    sender's handles; push, it cannot export its own). ``transport="auto"`` must fall back to
    broadcast on every rank and still refit bit-exactly; ``"ipc"`` must fail on every rank,
    naming the rank and the reason, with no weights moved."""
    from nemo_dataplane.refit.cuda import ipc as ipc_mod

    g = _group(rank, world, port, "nccl")
    dev = g.device
    undo: list[Callable[[], None]] = []

    def injected(*_: Any, **__: Any) -> Any:
        raise RuntimeError("injected: IPC not permitted here")

    if rank != 0:
        target = (ipc_mod, "open_tensors") if direction == "pull" else (ipc_mod.PushTargets, "blob")
        saved = getattr(*target)
        setattr(*target, injected)
        undo.append(lambda: setattr(*target, saved))
    try:
        if rank == 0:
            ep: RefitSender | RefitReceiver = RefitSender(
                g, model_tensors(0, dev), transport=transport, ipc_direction=direction
            )
        else:
            dst = {k: torch.zeros_like(v) for k, v in model_tensors(0, dev).items()}
            ep = RefitReceiver(g, dst)
        try:
            info = ep.prepare_refit_info()
        except RefitError as e:
            out: dict[str, Any] = {"error": type(e).__name__, "msg": str(e)}
            if rank != 0:
                out["untouched"] = all(bool((t == 0).all()) for t in dst.values())
            return out
        out = {"error": None, "transport": info.transport, "reason": ep.ipc_fallback_reason}
        if rank == 0:
            ep.send_weights(5)
        else:
            out["version"] = ep.receive_weights()
            want = model_tensors(0, torch.device("cpu"))
            out["wrong"] = [k for k in want if not torch.equal(_bytes(dst[k]), _bytes(want[k]))]
        ep.close()
        return out
    finally:
        for f in undo:
            f()
        g.barrier()
        g.destroy()


def refit_pull_receiver_copy_fails(rank: int, world: int, port: int) -> dict[str, Any]:
    """Pull: the receiver fails to issue its copies in one refit (injected). Both sides raise
    (the sender hears it through the ack, with the receiver's reason); the next refit works."""
    g = _group(rank, world, port, "nccl")
    dev = g.device
    out: dict[str, Any] = {}
    if rank == 0:
        src = model_tensors(0, dev)
        ep = RefitSender(g, src, transport="ipc", ipc_direction="pull")
        ep.prepare_refit_info()
        try:
            ep.send_weights(1)
            out["error"] = None
        except RefitError as e:
            out.update(error=type(e).__name__, msg=str(e))
        _step_in_place(src, 1, dev)
        ep.send_weights(2)
    else:
        dst = {k: torch.zeros_like(v) for k, v in model_tensors(0, dev).items()}
        ep = RefitReceiver(g, dst)
        ep.prepare_refit_info()
        copier = ep._copier
        real = copier.issue

        def broken(*_: Any, **__: Any) -> None:
            raise RuntimeError("injected: copy refused")

        copier.issue = broken
        try:
            ep.receive_weights()
            out["error"] = None
        except RefitError as e:
            out.update(error=type(e).__name__, msg=str(e))
        finally:
            copier.issue = real
        out["next_version"] = ep.receive_weights()
        want = model_tensors(1, torch.device("cpu"))
        out["wrong"] = [k for k in want if not torch.equal(_bytes(dst[k]), _bytes(want[k]))]
    g.barrier()
    ep.close()
    g.destroy()
    return out
