"""The scenarios of ``weight_transfer_conformance`` and the rank processes that run them.

Each scenario body runs in one process per rank: it joins a fresh gloo ``StatelessProcessGroup``,
builds the family's sender (rank 0) or a receiver (the other ranks) with the factory, drives
them, and returns what happened as plain data (exceptions as dicts, so that a third party's
exception types need not pickle). The checks live in ``weight_transfer_conformance``.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib
import multiprocessing
import multiprocessing.connection
import socket
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any, cast

import torch

from nemo_dataplane.distributed.stateless_group import StatelessProcessGroup
from nemo_dataplane.refit.config import WeightTransferConfig
from nemo_dataplane.refit.factory import build_weight_receiver, build_weight_sender

__all__ = [
    "MODEL",
    "VERSIONS",
    "VERSION_AFTER_CLOSE",
    "model_tensors",
    "MISMATCHED",
    "STRIDED_DST",
    "STRIDED_SRC",
    "free_port",
    "rank_processes",
    "shutdown_ranks",
]

HOST = "127.0.0.1"
# name -> (shape, dtype) of the model every scenario moves: Hugging Face-style names, several
# dtypes, an odd row count, a 0-dim scalar.
MODEL: dict[str, tuple[tuple[int, ...], torch.dtype]] = {
    "model.embed_tokens.weight": ((37, 16), torch.bfloat16),
    "model.layers.0.self_attn.q_proj.weight": ((16, 16), torch.bfloat16),
    "model.layers.0.mlp.down_proj.weight": ((16, 24), torch.float32),
    "model.layers.0.input_layernorm.weight": ((16,), torch.float16),
    "model.layers.0.mlp.router.scale": ((), torch.float32),
    "model.layers.0.mlp.quant_zeros": ((21,), torch.int8),
    "model.rotary.positions": ((17,), torch.int64),
    "model.rotary.mask": ((3, 7), torch.bool),
}
# Strided on the sender (a transposed copy's view) and on every receiver respectively.
STRIDED_SRC = "model.layers.0.self_attn.q_proj.weight"
STRIDED_DST = "model.layers.0.mlp.down_proj.weight"
# The parameter each mismatch scenario changes on the last receiver.
MISMATCHED = "model.layers.0.input_layernorm.weight"
VERSIONS = (7, (1 << 40) + 3)  # the second does not fit 32 bits
VERSION_AFTER_CLOSE = 9


def model_tensors(seed: int) -> dict[str, torch.Tensor]:
    """``MODEL`` filled with reproducible random bits (any pattern for floats; 0/1 for bool)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, (shape, dtype) in MODEL.items():
        if dtype == torch.bool:
            out[name] = torch.randint(0, 2, shape, generator=g, dtype=torch.uint8).bool()
            continue
        item = torch.empty((), dtype=dtype).element_size()
        raw = torch.randint(0, 256, (*shape, item), generator=g, dtype=torch.uint8)
        out[name] = raw.view(dtype).reshape(shape)
    return out


def _bits(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().contiguous().reshape(-1)
    return t.to(torch.uint8) if t.dtype == torch.bool else t.view(torch.uint8)


def _wrong(tensors: dict[str, torch.Tensor], seed: int) -> list[str]:
    want = model_tensors(seed)
    return sorted(n for n, w in want.items() if n not in tensors or not torch.equal(_bits(tensors[n]), _bits(w)))


def _error(e: BaseException) -> dict[str, Any]:
    """An exception as plain data (a third party's exception type may not pickle)."""
    return {
        "error": type(e).__name__,
        "mro": [c.__name__ for c in type(e).__mro__],
        "msg": str(e),
        "traceback": "".join(traceback.format_exception(e)),
    }


# ---------------------------------------------------------------- scenario bodies (in the rank processes)


def _sender_tensors(seed: int) -> dict[str, torch.Tensor]:
    t = model_tensors(seed)
    t[STRIDED_SRC] = t[STRIDED_SRC].t().contiguous().t()  # same values, strided storage
    return t


def _receiver_tensors(shapes: dict[str, tuple[tuple[int, ...], torch.dtype]]) -> dict[str, torch.Tensor]:
    out = {n: torch.zeros(s, dtype=dt) for n, (s, dt) in shapes.items()}
    if STRIDED_DST in out and out[STRIDED_DST].dim() == 2:
        rows, cols = out[STRIDED_DST].shape
        out[STRIDED_DST] = torch.zeros(cols, rows, dtype=out[STRIDED_DST].dtype).t()
    return out


def _refill(dst: dict[str, torch.Tensor], seed: int) -> None:
    """Write refit ``seed``'s values into ``dst`` in place, as an optimizer step would."""
    for n, t in model_tensors(seed).items():
        dst[n].copy_(t)


def _roundtrip(rank: int, g: StatelessProcessGroup, cfg: WeightTransferConfig) -> dict[str, Any]:
    """Two refits, close, prepare again, a third refit (receivers record what arrived)."""
    out: dict[str, Any] = {"refits": [], "close": None}
    if rank == 0:
        src = _sender_tensors(0)
        ep: Any = build_weight_sender(cfg, g, src)
    else:
        mine = _receiver_tensors(MODEL)
        ptrs = {n: t.data_ptr() for n, t in mine.items()}
        ep = build_weight_receiver(cfg, g, mine)
    plan = [(v, seed, False) for seed, v in enumerate(VERSIONS)] + [(VERSION_AFTER_CLOSE, len(VERSIONS), True)]
    try:
        ep.prepare_refit_info()
        for version, seed, reprepare in plan:
            if reprepare:
                ep.close()
                ep.prepare_refit_info()
            if rank == 0:
                _refill(src, seed)
                ep.send_weights(version)
                out["refits"].append({"sent": version})
                continue
            got = ep.receive_weights()
            out["refits"].append(
                {
                    "returned": got,
                    "attr": getattr(ep, "version", "missing"),
                    "expected": version,
                    "wrong": _wrong(mine, seed),
                    "moved": sorted(n for n, t in mine.items() if t.data_ptr() != ptrs[n]),
                    "after_close": reprepare,
                }
            )
    except Exception as e:
        out["refits"].append(_error(e))
    try:
        ep.close()
        ep.close()
    except Exception as e:
        out["close"] = _error(e)
    return out


def _mismatch(kind: str) -> Callable[[int, StatelessProcessGroup, WeightTransferConfig], dict[str, Any]]:
    def body(rank: int, g: StatelessProcessGroup, cfg: WeightTransferConfig) -> dict[str, Any]:
        if rank == 0:
            ep: Any = build_weight_sender(cfg, g, _sender_tensors(0))
            mine = None
        else:
            shapes = dict(MODEL)
            if rank == g.world_size - 1:  # the last receiver disagrees; the others are fine
                shape, dtype = shapes.pop(MISMATCHED)
                if kind == "name":
                    shapes[MISMATCHED + "_renamed"] = (shape, dtype)
                elif kind == "shape":
                    shapes[MISMATCHED] = ((shape[0] + 1,), dtype)
                else:
                    shapes[MISMATCHED] = (shape, torch.float32)
            mine = _receiver_tensors(shapes)
            ep = build_weight_receiver(cfg, g, mine)
        out: dict[str, Any] = {"prepare": None}
        try:
            ep.prepare_refit_info()
        except Exception as e:
            out["prepare"] = _error(e)
        if mine is not None:
            out["untouched"] = all(not t.any() for t in mine.values())
        with contextlib.suppress(Exception):
            ep.close()
        return out

    return body


def _abort(rank: int, g: StatelessProcessGroup, cfg: WeightTransferConfig) -> dict[str, Any]:
    """Refit 0; then the sender's tensor changes shape (refit 1 must fail everywhere, changing
    nothing on the receivers); then, restored, refit 2 of new values must arrive."""
    out: dict[str, Any] = {"first": None, "failed": None, "next": None}
    if rank == 0:
        src = _sender_tensors(0)
        holder = {"t": src}
        ep: Any = build_weight_sender(cfg, g, lambda: holder["t"])
    else:
        mine = _receiver_tensors(MODEL)
        ep = build_weight_receiver(cfg, g, mine)
    try:
        ep.prepare_refit_info()
        for i, step in enumerate(("first", "failed", "next")):
            if rank == 0:
                if step == "failed":
                    shape, dtype = MODEL[MISMATCHED]
                    holder["t"] = {**src, MISMATCHED: torch.zeros(shape[0] + 1, dtype=dtype)}
                else:
                    holder["t"] = src
                    _refill(src, i)
            else:
                before = {n: _bits(t).clone() for n, t in mine.items()}
            try:
                if rank == 0:
                    ep.send_weights(10 + i)
                    out[step] = {"version": 10 + i}
                else:
                    out[step] = {"version": ep.receive_weights(), "wrong": _wrong(mine, i)}
            except Exception as e:
                out[step] = _error(e)
                if step != "failed":
                    break
            if rank and step == "failed":
                out[step]["changed"] = sorted(n for n, t in mine.items() if not torch.equal(_bits(t), before[n]))
    except Exception as e:
        out["prepare"] = _error(e)
    with contextlib.suppress(Exception):
        ep.close()
    return out


def _before_prepare(rank: int, g: StatelessProcessGroup, cfg: WeightTransferConfig) -> dict[str, Any]:
    if rank == 0:
        ep: Any = build_weight_sender(cfg, g, _sender_tensors(0))
        call: Callable[[], Any] = lambda: ep.send_weights(1)  # noqa: E731
    else:
        ep = build_weight_receiver(cfg, g, _receiver_tensors(MODEL))
        call = ep.receive_weights
    try:
        call()
        out: dict[str, Any] = {"raised": None}
    except Exception as e:
        out = {"raised": _error(e)}
    with contextlib.suppress(Exception):
        ep.close()
    return out


_BODIES: dict[str, Callable[[int, StatelessProcessGroup, WeightTransferConfig], dict[str, Any]]] = {
    "roundtrip": _roundtrip,
    "mismatch-name": _mismatch("name"),
    "mismatch-shape": _mismatch("shape"),
    "mismatch-dtype": _mismatch("dtype"),
    "abort": _abort,
    "before-prepare": _before_prepare,
}


def _scenario(
    rank: int,
    *,
    name: str,
    world: int,
    port: int,
    config: WeightTransferConfig,
    setup_modules: tuple[str, ...],
    sys_path: list[str],
    timeout: float,
) -> dict[str, Any]:
    for p in sys_path:  # where the setup modules live (e.g. the caller's test directory)
        if p not in sys.path:
            sys.path.append(p)
    for m in setup_modules:
        importlib.import_module(m)
    g = StatelessProcessGroup(HOST, port, rank, world, "gloo", timeout, group_name="conformance")
    try:
        return _BODIES[name](rank, g, config)
    finally:
        with contextlib.suppress(Exception):
            g.destroy()


# ---------------------------------------------------------------- the rank processes


def _serve(conn: multiprocessing.connection.Connection) -> None:
    torch.set_num_threads(1)
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            return
        if msg is None:
            return
        rank, kw = msg
        try:
            reply: tuple[bool, Any] = (True, _scenario(rank, **kw))
        except BaseException as e:  # reported to the parent; the process serves the next scenario
            reply = (False, "".join(traceback.format_exception(e)))
        conn.send(reply)


class _Ranks:
    """``size`` long-lived rank processes, each running one scenario body at a time."""

    def __init__(self, size: int) -> None:
        ctx = multiprocessing.get_context("forkserver")
        # Forked from a server that has imported this module (and torch): a start costs
        # milliseconds, not an interpreter start and a torch import.
        ctx.set_forkserver_preload([__name__])
        self.size = size
        self.alive = True
        self._procs: list[Any] = []
        self._conns: list[multiprocessing.connection.Connection] = []
        for r in range(size):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_serve, args=(child,), daemon=True, name=f"weight-transfer-rank-{r}")
            p.start()
            child.close()
            self._procs.append(p)
            self._conns.append(parent)

    def run(self, world: int, limit: float, kw: dict[str, Any]) -> dict[int, Any]:
        """Each rank's result of one scenario (a dict, or a traceback string if its body raised)."""
        for r in range(world):
            self._conns[r].send((r, kw))
        pending = {self._conns[r]: r for r in range(world)}
        out: dict[int, Any] = {}
        deadline = time.monotonic() + limit
        while pending:
            ready = multiprocessing.connection.wait(list(pending), timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                self.close()
                raise AssertionError(
                    f"scenario {kw['name']!r}: ranks {sorted(pending.values())} still running "
                    f"after {limit:g}s (a hang, or a bounded wait longer than that)"
                )
            for conn in cast("list[multiprocessing.connection.Connection]", ready):  # wait() gives back ours
                r = pending.pop(conn)
                try:
                    ok, payload = conn.recv()
                except EOFError:
                    self.close()
                    raise AssertionError(f"scenario {kw['name']!r}: rank {r}'s process died") from None
                out[r] = payload if ok else f"rank {r} raised outside the checked calls:\n{payload}"
        return out

    def close(self) -> None:
        self.alive = False
        for c in self._conns:
            with contextlib.suppress(Exception):
                c.send(None)
        for p in self._procs:
            p.join(timeout=2)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)


_ranks: _Ranks | None = None


def rank_processes(size: int) -> _Ranks:
    global _ranks
    if _ranks is None or not _ranks.alive or _ranks.size < size:
        if _ranks is not None:
            _ranks.close()
        _ranks = _Ranks(size)
    return _ranks


def shutdown_ranks() -> None:
    """Stop the shared rank processes (also done at interpreter exit)."""
    global _ranks
    if _ranks is not None:
        _ranks.close()
        _ranks = None


atexit.register(shutdown_ranks)


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        port: int = s.getsockname()[1]
        return port
