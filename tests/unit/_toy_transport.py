"""A third-party weight-transfer family written against the facade alone, registered at import.

Imported by name in the conformance suite's rank processes (``setup_modules``), so it lives
outside the test modules. ``toy`` is a complete, simple implementation (a broadcast per tensor
over the group, names/shapes/dtypes agreed through the store); the other variants each break
one contract on purpose, to show the suite catches it:

* ``toy-int32-version``: the refit header is int32, so a version beyond 32 bits comes back wrong;
* ``toy-lossy``: floating-point weights travel as float16, so their bits change;
* ``toy-names-only``: the handshake compares names only, so a shape or dtype mismatch is not
  refused at prepare.
"""

from __future__ import annotations

import json
from typing import Any

import torch

from nemo_dataplane.distributed.stateless_group import StatelessProcessGroup
from nemo_dataplane.refit import (
    RefitError,
    RefitMismatchError,
    WeightReceiver,
    WeightSender,
    WeightTransferConfig,
    register_weight_transfer,
)
from nemo_dataplane.refit.protocol import NamedTensors, current_tensors, reusable

FLAWS = {"toy": None, "toy-int32-version": "int32_version", "toy-lossy": "lossy", "toy-names-only": "names_only"}
_ABORT = 1


def _specs(tensors: dict[str, torch.Tensor]) -> dict[str, list[Any]]:
    return {n: [list(t.shape), str(t.dtype)] for n, t in sorted(tensors.items())}


class _ToyEndpoint:
    def __init__(self, group: StatelessProcessGroup, named_tensors: NamedTensors, flaw: str | None) -> None:
        self.group = group
        self.source = reusable(named_tensors)
        self.flaw = flaw
        self.specs: dict[str, list[Any]] | None = None
        self.version: int | None = None
        self._gen = 0

    def _key(self, *parts: object) -> str:
        return "/".join([self.group.prefix, "toy", str(self._gen), *map(str, parts)])

    def _agree(self, problems: list[str]) -> None:
        g = self.group
        g.store.set(self._key("status", g.rank), json.dumps(problems).encode())
        g.wait_for_ranks(lambda r: self._key("status", r), range(g.world_size), "toy handshake")
        found = [f"rank {r}: {p}" for r in range(g.world_size) for p in json.loads(g.store.get(self._key("status", r)))]
        if found:
            self.specs = None
            raise RefitMismatchError(f"rank {g.rank}: toy handshake failed: {'; '.join(found)}")

    def _header(self, version: int, status: int) -> torch.Tensor:
        header = torch.tensor([version, status], dtype=torch.int64)
        return header.to(torch.int32) if self.flaw == "int32_version" else header  # int32 wraps silently

    def close(self) -> None:
        self.specs = None


class ToySender(_ToyEndpoint, WeightSender):
    def prepare_refit_info(self) -> dict[str, list[Any]]:
        self._gen += 1
        self.specs = _specs(current_tensors(self.source))
        self.group.store.set(self._key("specs"), json.dumps(self.specs).encode())
        self._agree([])
        return self.specs

    def send_weights(self, version: int) -> None:
        if self.specs is None:
            raise RefitError(f"rank {self.group.rank}: prepare_refit_info() first")
        tensors = current_tensors(self.source)
        changed = _specs(tensors) != self.specs
        g = self.group
        g.broadcast(self._header(version, _ABORT if changed else 0), 0)
        g.synchronize()
        if changed:
            raise RefitMismatchError(f"rank {g.rank}: tensors changed since prepare_refit_info()")
        for name in self.specs:
            g.broadcast(tensors[name].contiguous(), 0)
        g.synchronize()
        self.version = version


class ToyReceiver(_ToyEndpoint, WeightReceiver):
    def prepare_refit_info(self) -> dict[str, list[Any]]:
        self._gen += 1
        g = self.group
        g.wait_for_ranks(lambda r: self._key("specs"), [0], "toy specs")
        sent = json.loads(g.store.get(self._key("specs")))
        mine = _specs(current_tensors(self.source))
        if self.flaw == "names_only":
            problems = [f"{n}: names differ" for n in sorted(set(sent) ^ set(mine))]
        else:
            problems = [
                f"{n}: sender {sent.get(n)} != receiver {mine.get(n)}"
                for n in sorted(set(sent) | set(mine))
                if sent.get(n) != mine.get(n)
            ]
        self.specs = sent
        self._agree(problems)
        return sent

    def receive_weights(self) -> int:
        if self.specs is None:
            raise RefitError(f"rank {self.group.rank}: prepare_refit_info() first")
        g = self.group
        header = self._header(0, 0)
        g.broadcast(header, 0)
        g.synchronize()
        version, status = (int(x) for x in header.tolist())
        if status == _ABORT:
            raise RefitError(f"rank {g.rank}: the sender aborted refit {version}")
        tensors = current_tensors(self.source)
        for name, (shape, _) in self.specs.items():
            dst = tensors[name]
            tmp = torch.empty(shape, dtype=dst.dtype)
            g.broadcast(tmp, 0)
            g.synchronize()
            if self.flaw == "lossy" and tmp.is_floating_point():
                tmp = tmp.to(torch.float16).to(dst.dtype)
            dst.copy_(tmp)
        self.version = version
        return version


def _sender(
    config: WeightTransferConfig,
    group: StatelessProcessGroup,
    named_tensors: NamedTensors,
    *,
    senders: int,
    full_shapes: Any,
    device: Any,
) -> ToySender:
    return ToySender(group, named_tensors, FLAWS[config.family])


def _receiver(
    config: WeightTransferConfig,
    group: StatelessProcessGroup,
    named_tensors: NamedTensors,
    *,
    senders: int,
    device: Any,
) -> ToyReceiver:
    return ToyReceiver(group, named_tensors, FLAWS[config.family])


for _name in FLAWS:
    register_weight_transfer(_name, _sender, _receiver, transports=("auto",), replace=True)
