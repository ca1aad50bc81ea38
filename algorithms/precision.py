"""Training precision (``policy.precision``): the one place that says what each setting means.

* ``fp32``: the model, its gradients and AdamW's state are float32.
* ``bf16``: the model's weights are bfloat16, so its forward and backward run in bfloat16; the
  optimizer steps float32 *master* copies of the weights with float32 state, each micro-batch's
  bfloat16 gradients are accumulated into float32 master gradients as they are produced, and
  after every optimizer step the masters are rounded back into the model's weights. The frozen
  reference is a bfloat16 copy. The generator holds the same bfloat16 weights (hf engine: its
  model; vLLM: ``dtype=bfloat16``), so it samples from exactly the model the trainer scores, and
  a refit sends the model's bfloat16 weights as they are: half the bytes of fp32, no cast.
  Floating *buffers* (the rotary frequencies) stay float32 (:func:`cast_weights`), as
  ``transformers`` loads a bf16 checkpoint and vLLM computes them: rounded to bfloat16 they
  would misplace positions more the longer the sequence.

Under ``policy.sharding=fsdp`` the same meaning is kept with FSDP2's own machinery
(:meth:`Precision.fsdp_policy`): each rank's float32 shards *are* the master weights and
AdamW's state, ``fully_shard`` gathers them rounded to bfloat16 for the forward and backward,
and reduces the gradients in float32 into float32 shard gradients; the buffers stay float32 and
the reference is a bfloat16 copy, so a sharded and an unsharded run compute the same forward.

Chosen over autocast with float32 weights: there the generator's bfloat16 model and the
trainer's autocast forward would be two different models, and every refit would cast.

:func:`precision_of` is the only reader of the key; everything else asks the :class:`Precision`
it returns (its ``dtype``) or the :class:`TrainedWeights` built by :meth:`Precision.train`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from algorithms.config import TrainerConfig

__all__ = ["PRECISIONS", "Precision", "TrainedWeights", "cast_weights", "precision_of"]


# Attributes Megatron-core sets on a parameter to describe its tensor-parallel split.
_LAYOUT_ATTRS = ("tensor_model_parallel", "partition_dim", "partition_stride", "sequence_parallel", "shared")


@torch.no_grad()
def cast_weights(model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """``model``'s floating parameters to ``dtype`` in place (as ``model.to(dtype)``), its floating
    buffers left float32 (as ``from_pretrained(dtype=...)`` leaves them); returns ``model``."""
    for param in model.parameters():
        if param.is_floating_point():
            param.data = param.data.to(dtype)
    return model


class TrainedWeights:
    """The parameters an optimizer steps for ``model``: its own (``master=False``), or float32
    master copies of them (``master=True``; the model is cast to ``dtype`` in place).

    Contract: after every ``backward`` the master gradients (``params``' ``.grad``) hold the sum
    of the model's gradients so far (the model's own ``.grad`` is left ``None``); after the
    optimizer steps ``params``, :meth:`publish` writes them into the model's weights.
    """

    def __init__(self, model: torch.nn.Module, dtype: torch.dtype, master: bool) -> None:
        model_params = [p for p in model.parameters() if p.requires_grad]
        self.master = master
        if not master:
            self.params: list[torch.nn.Parameter] = model_params
            self._pairs: list[tuple[torch.nn.Parameter, torch.nn.Parameter]] = []
            return
        # Masters from the float32 values the model was built with, before rounding to dtype;
        # they keep the attributes that say how a parameter is split (Megatron's TP layout, which
        # the gradient norm reads).
        self.params = [torch.nn.Parameter(p.detach().float().clone()) for p in model_params]
        for p, m in zip(model_params, self.params):
            for attr in _LAYOUT_ATTRS:
                if hasattr(p, attr):
                    setattr(m, attr, getattr(p, attr))
        cast_weights(model, dtype)
        self._pairs = list(zip(model_params, self.params))
        for p, m in self._pairs:
            p.register_post_accumulate_grad_hook(self._accumulate_into(m))

    @staticmethod
    def _accumulate_into(m: torch.nn.Parameter) -> Any:
        # Accumulating in float32 keeps many micro-batches' small gradients from rounding away.
        def hook(p: torch.Tensor) -> None:
            assert p.grad is not None
            g = p.grad.float()
            m.grad = g if m.grad is None else m.grad.add_(g)
            p.grad = None

        return hook

    @torch.no_grad()
    def publish(self) -> None:
        """Round the masters into the model's weights (no-op without masters)."""
        for p, m in self._pairs:
            p.copy_(m)

    def state_dict(self) -> dict[str, Any]:
        """The masters (empty without): the checkpoint needs them, the model holds them rounded."""
        return {"master": [m.detach() for m in self.params]} if self.master else {}

    @torch.no_grad()
    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore the masters; a checkpoint without them (written in fp32) takes the model's
        loaded weights as masters."""
        if not self.master:
            return
        saved = state.get("master")
        for i, (p, m) in enumerate(self._pairs):
            m.copy_(saved[i] if saved is not None else p.float())
        self.publish()


@dataclass(frozen=True)
class Precision:
    """One ``policy.precision`` setting: the weights' dtype (trainer, generator, refit, export)
    and whether the optimizer steps float32 masters."""

    name: str
    dtype: torch.dtype
    master: bool

    @property
    def dtype_name(self) -> str:
        """``float32`` | ``bfloat16``: the name vLLM and ``config.json`` use."""
        return str(self.dtype).removeprefix("torch.")

    def train(self, model: torch.nn.Module) -> TrainedWeights:
        """Make ``model`` (float32, as built) trainable in this precision; returns what the
        optimizer steps."""
        return TrainedWeights(model, self.dtype, self.master)

    def train_sharded(self, model: torch.nn.Module) -> TrainedWeights:
        """What the optimizer steps for ``model`` sharded under :meth:`fsdp_policy`: its own
        float32 shards, which are the master weights (nothing is cast or copied)."""
        return TrainedWeights(model, torch.float32, master=False)

    def fsdp_policy(self) -> Any:
        """FSDP2's ``MixedPrecisionPolicy`` for a sharded float32 model: with masters, gather the
        shards in ``dtype`` and reduce gradients in float32; without, nothing to change (``None``)."""
        if not self.master:
            return None
        from torch.distributed.fsdp import MixedPrecisionPolicy

        return MixedPrecisionPolicy(param_dtype=self.dtype, reduce_dtype=torch.float32)


PRECISIONS: dict[str, Precision] = {
    "fp32": Precision("fp32", torch.float32, master=False),
    "bf16": Precision("bf16", torch.bfloat16, master=True),
}


def precision_of(cfg: TrainerConfig) -> Precision:
    """The run's precision (``policy.precision``)."""
    return PRECISIONS[cfg.policy.precision]
