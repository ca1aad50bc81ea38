"""The Hugging Face model trained with PyTorch's FSDP2 (``policy.sharding=fsdp``).

Each decoder layer and then the root are ``fully_shard``-ed over a one-dimensional mesh of every
policy rank, so each rank holds ``1 / trainer.dp_size`` of the parameters (dim 0 of every
tensor, ``torch.chunk`` sizes), of their gradients and of AdamW's state. What stays as in the
replicated engine (:mod:`.hf`): the padded forward, log-probs and entropy, the GRPO loss, the
micro-batch loop of :meth:`TrainingEngine.train_step`. What differs:

* precision: :meth:`algorithms.precision.Precision.fsdp_policy` (bf16: float32 shards are the
  masters, gathered as bfloat16, gradients reduced in float32);
* gradients are reduce-scattered (summed, not averaged: the loss is already divided by the
  whole step's token count) after every micro-batch's backward; the norm and the clipping
  span every shard (one all-reduce of the squared norm, which also carries the non-finite flag);
* the reference is a sharded copy in the weights' dtype (no gradients, no optimizer);
* every forward and backward is collective: every rank runs the same number of micro-batches
  (the driver's plan guarantees equal counts) and no rank leaves the loop early;
* the refit sends each rank's own shards (``refit.mode=reshard`` with the ``fsdp`` sender
  layout): no rank gathers the model;
* checkpoints are ``torch.distributed.checkpoint`` shards (:func:`algorithms.checkpoint.save_sharded`),
  loadable by any number of ranks; the Hugging Face export gathers one tensor at a time onto
  rank 0, which writes it (:class:`~algorithms.engines.training.hf_export.HFDirWriter`).
"""

from __future__ import annotations

import copy
import json
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from algorithms.checkpoint import load_sharded, save_sharded
from algorithms.engines.training.hf import HFTrainingEngine
from algorithms.engines.training.hf_export import HFDirWriter
from algorithms.finite import NonFiniteError
from algorithms.precision import cast_weights

__all__ = ["FSDPTrainingEngine", "local"]

SHARDS_DIR = "policy"  # the checkpoint's sharded state, beside the per-rank RNG files
LAYOUT_FILE = "policy_layout.json"  # how many ranks wrote it (a resume on another count says so)


def local(t: Tensor) -> Tensor:
    """This rank's part of ``t``: a DTensor's local shard, any other tensor itself."""
    to_local = getattr(t, "to_local", None)
    return to_local() if to_local is not None else t


def _full(t: Tensor) -> Tensor:
    """The whole of ``t`` (collective for a DTensor: every rank must ask, in the same order)."""
    full_tensor = getattr(t, "full_tensor", None)
    return full_tensor() if full_tensor is not None else t


def _no_average(model: torch.nn.Module) -> None:
    """Every ``fully_shard``-ed module of ``model`` sums its gradients over the ranks instead of
    averaging them: the loss is already a share of the whole step's token mean. A plain SUM
    (gloo has no pre-multiplied sum; with a factor of 1 nothing is scaled)."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if not isinstance(module, FSDPModule):
            continue  # each sharded module keeps its own reduction settings
        m: Any = module
        if hasattr(m, "set_force_sum_reduction_for_comms"):
            m.set_force_sum_reduction_for_comms(True)
        if hasattr(m, "set_gradient_divide_factor"):
            m.set_gradient_divide_factor(1.0)
        else:  # torch < 2.8
            m.set_reduce_scatter_divide_factor(1.0)


class FSDPTrainingEngine(HFTrainingEngine):
    """The policy's ``transformers`` model, fully sharded over the policy ranks once
    ``torch.distributed`` spans them (:meth:`connect`); until then each rank holds the float32
    model it built (the same weights on every rank: same config and seed, or the same files)."""

    name = "torch"

    def _setup(self) -> None:
        # Sharding needs the process group: connect() does the rest.
        self._refit_buffers: dict[str, Tensor] = {}
        self._refit_tensors: list[tuple[str, Tensor]] = []
        self._full_shapes = {n: tuple(p.shape) for n, p in self.model.named_parameters()}

    def connect(self, rank: int) -> None:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        world = dist.get_world_size()
        self.mesh = init_device_mesh(self.device.type, (world,), mesh_dim_names=("fsdp",))
        self.dp_group = self.mesh.get_group()
        # The reference: a copy in the weights' dtype, as the replicated engine keeps it.
        self.ref_model = cast_weights(copy.deepcopy(self.model), self.precision.dtype)
        self._freeze_reference()
        policy = self.precision.fsdp_policy()
        for model, mp in ((self.model, policy), (self.ref_model, None)):
            kwargs: dict[str, Any] = {"mesh": self.mesh}
            if mp is not None:
                kwargs["mp_policy"] = mp
            for layer in _decoder_layers(model):
                fully_shard(layer, **kwargs)
            fully_shard(model, **kwargs)
        _no_average(self.model)
        # The float32 shards are what AdamW steps (the masters, under bf16).
        self.trained = self.precision.train_sharded(self.model)
        self.optimizer = self._make_optimizer()
        self._publish()

    # ------------------------------------------------------------------ train
    def _all_reduce_and_step(self, bad: str | None = None) -> float:
        """Gradients are already summed (reduce-scatter in backward): the squared norm over
        every shard and the refusal flag in one all-reduce, clip, step.

        Raises:
            NonFiniteError: as :meth:`TrainingEngine._all_reduce_and_step`.
        """
        params = self.trained.params
        grads = [local(p.grad) for p in params if p.grad is not None]
        acc = torch.zeros(2, dtype=torch.float32, device=self.device)
        if grads:
            acc[0] = torch.stack([g.float().pow(2).sum() for g in grads]).sum()
        if bad:
            acc[1] = 1.0
        dist.all_reduce(acc, group=self.dp_group)
        norm = acc[0].sqrt()
        refused = int(acc[1].item())
        if refused or not torch.isfinite(norm).item():
            self.optimizer.zero_grad(set_to_none=False)
            why = bad or (f"{refused} other rank(s) saw a non-finite current log-prob" if refused else None)
            detail = f"; {why}" if why else " (every input of this rank was finite)"
            raise NonFiniteError(f"gradient norm is {float(norm)}: optimizer step skipped, weights unchanged{detail}")
        max_norm = self.cfg.policy.max_grad_norm
        if max_norm > 0:
            # torch.nn.utils.clip_grad_norm_'s scaling, applied to every shard.
            coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
            for g in grads:
                g.mul_(coef.to(g.dtype))
        self._step_optimizer()
        self._publish()
        return float(norm)

    @torch.no_grad()
    def _publish(self) -> None:
        """Round the float32 shards into the refit's bf16 shards (no-op when the weights' dtype
        is the shards' own): after every optimizer step, as the replicated engine rounds its
        masters into the model, so a refit only moves bytes."""
        dtype = self.precision.dtype
        if not self._refit_tensors:
            # The local shards once: a DTensor's detach()/to_local() per parameter costs tens of
            # microseconds of dispatch (9 ms a refit at 8B); the shards are stepped in place.
            for name, p in self.model.named_parameters():
                shard = local(p.detach())
                if shard.dtype != dtype:
                    self._refit_buffers[name] = torch.empty_like(shard, dtype=dtype)
                self._refit_tensors.append((name, shard))
        for name, shard in self._refit_tensors:
            buf = self._refit_buffers.get(name)
            if buf is not None:
                buf.copy_(shard)

    def _clip(self, params: Sequence[torch.nn.Parameter], flat: Tensor, max_norm: float) -> Tensor:
        raise NotImplementedError("the sharded engine clips in _all_reduce_and_step")

    # ------------------------------------------------------------------ refit
    def named_for_refit(self) -> Iterable[tuple[str, Tensor]]:
        """This rank's shard of every parameter (dim 0, ``torch.chunk`` sizes) in the weights'
        dtype: views of the float32 shards, or (bf16) the bf16 shards :meth:`_publish` keeps
        (``1 / dp_size`` of the model in bf16, rounded after every optimizer step)."""
        return [(name, self._refit_buffers.get(name, shard)) for name, shard in self._refit_tensors]

    def refit_shapes(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        return {n: (shape, self.precision.dtype) for n, shape in self._full_shapes.items()}

    # ------------------------------------------------------------------ checkpoint
    def _sharded_state(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

        return {
            "model": get_model_state_dict(self.model),
            "ref_model": get_model_state_dict(self.ref_model),
            # Tensors only (AdamW's step, moments): the rates come from the config every step.
            "optimizer": get_optimizer_state_dict(self.model, self.optimizer)["state"],
        }

    def save_state(self, directory: Path) -> None:
        """Every rank writes its shards of model, reference and AdamW state into
        ``directory/policy`` (collective); rank 0 records the rank count."""
        save_sharded(self._sharded_state(), directory / SHARDS_DIR)
        if self.rank == 0:
            (directory / LAYOUT_FILE).write_text(json.dumps({"sharding": "fsdp", "ranks": dist.get_world_size()}))

    def load_state(self, directory: Path) -> str | None:
        """Read the shards back, redistributed over this run's ranks (collective); returns a
        note when they were written by another number of ranks."""
        from torch.distributed.checkpoint.state_dict import (
            get_optimizer_state_dict,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        state = self._sharded_state()
        load_sharded(state, directory / SHARDS_DIR)
        set_model_state_dict(self.model, state["model"])
        set_model_state_dict(self.ref_model, state["ref_model"])
        groups = get_optimizer_state_dict(self.model, self.optimizer)["param_groups"]
        set_optimizer_state_dict(self.model, self.optimizer, {"state": state["optimizer"], "param_groups": groups})
        self._publish()
        layout = directory / LAYOUT_FILE
        saved = json.loads(layout.read_text()).get("ranks") if layout.is_file() else None
        world = dist.get_world_size()
        if saved is None or saved == world:
            return None
        return (
            f"the checkpoint's policy shards were written by {saved} rank(s) and are loaded by {world}: model, "
            "reference and optimizer state are redistributed exactly, but micro-batches, gradient sums and the "
            f"RNG state of ranks without a saved one differ, so later steps are not bitwise those of a {saved}-rank run"
        )

    # ------------------------------------------------------------------ export
    def save_hf(self, directory: str, special_ids: Mapping[str, int | None]) -> bool:
        """Gather one tensor at a time (every rank, in the same order) in the weights' dtype;
        rank 0 writes it. A tied weight is written once, under its first name."""
        writer = HFDirWriter(directory) if self.rank == 0 else None
        dtype = self.precision.dtype
        with torch.no_grad():
            for name, p in self.model.named_parameters():  # tied weights come once
                full = _full(p.detach().to(dtype))
                if writer is not None:
                    writer.add(name, full)
                del full
        if writer is None:
            return False
        writer.finish(_hf_config(self.model), special_ids, dtype)
        return True


def _decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The transformer blocks of a ``transformers`` causal LM (``model.model.layers``)."""
    inner: Any = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None:
        raise TypeError(f"policy.sharding=fsdp: {type(model).__name__} has no model.layers to shard one by one")
    return list(layers)


def _hf_config(model: torch.nn.Module) -> Any:
    return copy.deepcopy(model.config)
