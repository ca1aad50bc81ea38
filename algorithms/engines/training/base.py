"""The contract every training engine keeps, and the train step they share.

A training engine is what a policy rank computes with: the trained model, a frozen reference
copy (the KL anchor) and the optimizer. It scores micro-batches (per-token log-probs of the
response, optionally entropy), runs the GRPO train step (loss, backward, gradient all-reduce
over the data-parallel group, clipping, optimizer step), and exposes its weights under Hugging
Face names for the refit, with their full (unsharded) shapes for the refit's layout.
:class:`algorithms.workers.policy.PolicyWorker` owns the rank's wiring, groups, batch I/O and
checkpoint files; it never asks which engine it holds.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal

import torch
import torch.distributed as dist
from tensordict import TensorDict

from algorithms.checkpoint import load_trusted, save_file
from algorithms.config import TrainerConfig
from algorithms.finite import Decode, NonFiniteError, nonfinite_message
from algorithms.grpo import masked_sum
from algorithms.losses import PolicyLoss, loss_of
from algorithms.precision import Precision, TrainedWeights, precision_of
from algorithms.replicas import replica_of

__all__ = ["Prepared", "Scored", "TrainingEngine", "Which"]

Which = Literal["policy", "reference"]
Scored = tuple[torch.Tensor, "torch.Tensor | None", torch.Tensor]  # (logprobs, entropy | None, mask), each [n, L - 1]


@dataclass
class Prepared:
    """One micro-batch ready for the loss: its rows and, per scored position ``[n, L - 1]``, the
    response mask, proximal (``old``), reference and behaviour (``None``: on-policy) log-probs,
    and per-row advantages."""

    mb: TensorDict
    mask: torch.Tensor
    old: torch.Tensor
    ref: torch.Tensor
    adv: torch.Tensor
    behaviour: torch.Tensor | None


class TrainingEngine(ABC):
    """Base of the engines. Subclasses set ``model``, ``trained`` (``self.precision.train(model)``,
    before copying the reference), ``ref_model`` and ``optimizer`` (:meth:`_make_optimizer`) and
    implement :meth:`score`, :meth:`named_for_refit` and :meth:`refit_shapes`."""

    name: ClassVar[str]
    model: torch.nn.Module
    ref_model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    trained: TrainedWeights

    def __init__(self, cfg: TrainerConfig, device: torch.device, rank: int = 0, loss: PolicyLoss | None = None) -> None:
        self.cfg = cfg
        # The policy loss this engine minimises (algorithms.losses; None: the run's grpo.loss).
        self.loss: PolicyLoss = loss if loss is not None else loss_of(cfg)
        self.device = device
        self.precision: Precision = precision_of(cfg)
        self.temperature = cfg.generation.temperature or 1.0
        self.dp_group: Any = None  # None: the whole world
        self.tp_group: Any = None  # None: no tensor parallelism
        self.decode: Decode | None = None  # the worker's tokenizer: names prompts in a NonFiniteError
        # This policy rank's place: its DP replica and TP rank (algorithms.replicas).
        self.rank = rank
        self.dp_rank, self.tp_rank = replica_of(rank, cfg.policy.tensor_parallel_size)

    def connect(self, rank: int) -> None:
        """Called once ``torch.distributed`` spans every policy rank: set up the engine's own
        parallel groups (``dp_group``, ``tp_group``) and whatever needs them."""

    def num_params(self) -> int:
        return sum(p.numel() for p in self.model.parameters())

    def _make_optimizer(self) -> torch.optim.Optimizer:
        p = self.cfg.policy
        return torch.optim.AdamW(self.trained.params, lr=p.lr, weight_decay=p.weight_decay, betas=p.betas)

    def optimizer_steps(self) -> int:
        """Optimizer steps taken so far: AdamW's own count, saved and restored with its state
        (a step refused for a non-finite gradient is not counted)."""
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                step = self.optimizer.state.get(p, {}).get("step")
                if step is not None:
                    return int(step)
        return 0

    def learning_rate(self) -> float:
        """The rate of the next optimizer step: ``policy.lr``, ramped linearly over the first
        ``policy.lr_warmup_steps`` steps (from ``lr / lr_warmup_steps``)."""
        p = self.cfg.policy
        if p.lr_warmup_steps == 0:
            return p.lr
        return p.lr * min(1.0, (self.optimizer_steps() + 1) / p.lr_warmup_steps)

    def _step_optimizer(self) -> None:
        # The rate is set from the config every step, so a resume that changes policy.lr uses it.
        lr = self.learning_rate()
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()

    def _freeze_reference(self) -> None:
        self.ref_model.eval()
        for p in self.ref_model.parameters():
            p.requires_grad_(False)

    # ------------------------------------------------------------------ compute
    @abstractmethod
    def score(self, which: Which, mb: TensorDict, entropy: bool) -> Scored:
        """Per-token log-probs (and entropy) of ``mb``'s response tokens under the policy or the
        reference, at the sampling temperature; position ``t`` scores token ``t + 1``."""

    def train_step(self, prepared: Sequence[Prepared], global_tokens: float, behaviour: bool) -> dict[str, float]:
        """``grpo.epochs`` optimizer steps over ``prepared``; returns this rank's share of the loss
        metrics (denominator: ``global_tokens``, the whole step's token count) and ``grad_norm``.

        Raises:
            NonFiniteError: a current log-prob (in the response) or the gradient norm is NaN or
                infinite, on this rank or another; that epoch's optimizer step is skipped and
                the gradients zeroed, so the weights keep their values (earlier epochs of a
                ``grpo.epochs > 1`` step have stepped already).
        """
        g = self.cfg.grpo
        sums = {"loss": 0.0, "pg_loss": 0.0, "kl": 0.0, "clip_frac": 0.0, "entropy": 0.0}
        if behaviour:
            sums.update(is_truncated_frac=0.0, behaviour_kl=0.0)
        grad_norm = 0.0
        for epoch in range(g.epochs):
            self.optimizer.zero_grad(set_to_none=False)
            last = epoch == g.epochs - 1
            bad: str | None = None
            for p in prepared:
                lp, ent, _ = self.score("policy", p.mb, True)
                # Kept, not raised: the other ranks learn of it in the gradient all-reduce, so
                # no rank steps while another refuses.
                bad = bad or nonfinite_message("current log-prob", lp, p.mb, mask=p.mask, decode=self.decode)
                loss, m = self.loss(
                    lp, p.old, p.ref, p.adv, p.mask, global_token_count=global_tokens, behaviour_logprobs=p.behaviour
                )
                loss.backward()
                if last:
                    sums["loss"] += float(loss.detach())
                    for k in (
                        "pg_loss",
                        "kl",
                        "clip_frac",
                        *(("is_truncated_frac", "behaviour_kl") if behaviour else ()),
                    ):
                        sums[k] += float(m[k])
                    assert ent is not None
                    sums["entropy"] += float(masked_sum(ent.detach(), p.mask)) / global_tokens
            grad_norm = self._all_reduce_and_step(bad)
        return {**sums, "grad_norm": grad_norm}

    def _all_reduce_and_step(self, bad: str | None = None) -> float:
        """Sum the gradients over DP, clip, step. ``bad``: this rank's non-finite message, if any.

        Raises:
            NonFiniteError: ``bad`` on any DP rank, or a non-finite gradient norm (checked before
                ``optimizer.step()``, which then never runs; the gradients are zeroed).
        """
        params = self.trained.params  # the model's own, or its float32 masters (bf16)
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        # One more element carries "some rank refused its values": every rank learns it from the
        # same all-reduce, so all of them skip the step together (no replica diverges).
        flag = torch.ones(1, dtype=grads[0].dtype, device=grads[0].device) if bad else grads[0].new_zeros(1)
        flat = torch.cat([*(g.reshape(-1) for g in grads), flag])
        # Sum over DP replicas (the loss is already divided by the global token count).
        dist.all_reduce(flat, group=self.dp_group)
        refused = int(flat[-1].item())
        flat = flat[:-1]
        off = 0
        for p, g in zip(params, grads):
            n = g.numel()
            p.grad = flat[off : off + n].view_as(p).clone()
            off += n
        norm = self._clip(params, flat, self.cfg.policy.max_grad_norm)
        if refused or not torch.isfinite(norm).item():
            self.optimizer.zero_grad(set_to_none=False)  # nothing of this step may reach a later one
            why = bad or (f"{refused} other rank(s) saw a non-finite current log-prob" if refused else None)
            detail = f"; {why}" if why else " (every input of this rank was finite)"
            raise NonFiniteError(f"gradient norm is {float(norm)}: optimizer step skipped, weights unchanged{detail}")
        self._step_optimizer()
        self.trained.publish()
        return float(norm)

    def _clip(self, params: Sequence[torch.nn.Parameter], flat: torch.Tensor, max_norm: float) -> torch.Tensor:
        """The gradient norm, after scaling the gradients to ``max_norm`` (0: no clipping)."""
        if max_norm > 0:
            return torch.nn.utils.clip_grad_norm_(params, max_norm)
        return torch.linalg.vector_norm(flat)

    # ------------------------------------------------------------------ refit
    @abstractmethod
    def named_for_refit(self) -> Iterable[tuple[str, torch.Tensor]]:
        """This rank's weights under the generator's (Hugging Face) names, as live views."""

    @abstractmethod
    def refit_shapes(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """Full (unsharded) shape and dtype of every tensor :meth:`named_for_refit` yields: the
        trainer-side layout every sender builds identically."""

    # ------------------------------------------------------------------ checkpoint
    def state_dict(self) -> dict[str, Any]:
        return {
            "model": self.model.state_dict(),
            "ref_model": self.ref_model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "trained": self.trained.state_dict(),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        self.ref_model.load_state_dict(state["ref_model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.trained.load_state_dict(state.get("trained", {}))

    def _state_file(self) -> str:
        # One file per TP shard (Megatron's local state dicts differ per TP rank).
        return "policy.pt" if self.cfg.policy.tensor_parallel_size == 1 else f"policy_tp{self.tp_rank}.pt"

    def save_state(self, directory: Path) -> None:
        """Write model, reference and optimizer state into the checkpoint ``directory`` (called
        on every rank; collective where the engine's state is sharded). Here: the first
        replica's ranks each write one file of their :meth:`state_dict` (replicas are equal)."""
        if self.dp_rank == 0:
            save_file(self.state_dict(), directory / self._state_file())

    def load_state(self, directory: Path) -> str | None:
        """Read what :meth:`save_state` wrote (every rank; collective where sharded). Returns a
        note for the user when the checkpoint was written under another layout and resharded
        on load, else ``None``."""
        self.load_state_dict(load_trusted(directory / self._state_file(), map_location=self.device))
        return None

    def save_hf(self, directory: str, special_ids: Mapping[str, int | None]) -> bool:
        """Write the policy as a Hugging Face directory (config.json with ``special_ids`` and the
        weights' dtype, safetensors) loadable by ``transformers`` and vLLM. Called on every rank
        (collective where the weights are sharded); returns whether this rank wrote it (one
        does). Engines that cannot raise ``NotImplementedError`` (the config refuses them first)."""
        raise NotImplementedError(f"the {self.name} training engine cannot export a Hugging Face directory")
