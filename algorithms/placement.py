"""``generation.placement``: where the engines sit against the policy ranks, decided once.

:func:`placement_of` reads the key (``TrainerConfig.placement`` calls it); everything after
asks the :class:`Placement` it returns: launch (each actor's GPU share, Ray's scheduling), the
policy rank (what it hands back after a step), the generator (which GPU is its ``cuda:0``) and
the vLLM engine (whether and how deeply it sleeps). ``split``: engines on GPUs of their own
(``generation.num_gpus`` each). ``colocated``: engine ``i`` shares policy rank ``i``'s GPU, half
each; it sleeps while the trainer works (docs/generation.md, "Colocated placement").
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import MutableSequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from algorithms.config_sections import GenerationConfig, PolicyConfig

__all__ = ["COLOCATED_SHARE", "Colocated", "Colocation", "Placement", "Slots", "Split", "placement_of"]

COLOCATED_SHARE = 0.5  # of a GPU, to a colocated policy rank and to its engine each


class Slots:
    """Where Ray puts a run's actors: a scheduling strategy per policy rank and per engine
    (``None``: Ray chooses)."""

    def policy(self, rank: int) -> Any:
        return None

    def engine(self, index: int, live: list[int]) -> Any:
        """Engine ``index``'s strategy; ``live``: the engines (ids) up or starting."""
        return None


@dataclass
class Colocation(Slots):
    """A Ray placement group of one bundle per policy rank, each one GPU; policy rank ``i`` and
    the engine in slot ``i`` take half of bundle ``i`` each, so Ray puts both on that bundle's
    GPU. ``slots``: engine id -> bundle (a replacement takes the slot of the engine it replaces:
    the one no live engine holds)."""

    group: Any  # ray.util.placement_group.PlacementGroup
    slots: dict[int, int] = field(default_factory=dict)

    @classmethod
    def reserve(cls, ranks: int, worker_num_cpus: float) -> Colocation:
        from ray.util.placement_group import placement_group  # colocated runs only

        cpus = 2 * worker_num_cpus  # the rank's and its engine's
        bundle = {"GPU": 1.0, **({"CPU": cpus} if cpus else {})}
        # STRICT_PACK: one node, so every sender reaches every engine over CUDA IPC.
        return cls(placement_group([dict(bundle) for _ in range(ranks)], strategy="STRICT_PACK"))

    def strategy(self, bundle: int) -> Any:
        """Ray's scheduling strategy that places an actor in ``bundle``."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        return PlacementGroupSchedulingStrategy(placement_group=self.group, placement_group_bundle_index=bundle)

    def take(self, engine: int, live: list[int]) -> int:
        """The bundle of engine ``engine``: the lowest one no engine in ``live`` holds."""
        held = {self.slots[i] for i in live if i in self.slots}
        free = [b for b in range(self.group.bundle_count) if b not in held]
        if not free:
            raise RuntimeError(f"engine {engine}: every GPU of the colocated placement already holds an engine")
        self.slots[engine] = free[0]
        return free[0]

    def policy(self, rank: int) -> Any:
        return self.strategy(rank)

    def engine(self, index: int, live: list[int]) -> Any:
        return self.strategy(self.take(index, live))


class Placement(ABC):
    """What the placement decides, for those who act on it."""

    name: ClassVar[str]
    # The engine's own GPU becomes its cuda:0 while every other GPU stays visible (vLLM's
    # in-process worker takes cuda:0; the policy's GPUs must stay open for IPC events).
    engine_gpu_first: ClassVar[bool]
    # The refit must reshard (a same-GPU CUDA IPC push into the engine's staging tensors).
    needs_reshard: ClassVar[bool]

    @abstractmethod
    def policy_gpus(self, policy: PolicyConfig, ranks: int) -> float:
        """GPUs Ray gives each of ``ranks`` policy ranks on CUDA."""

    @abstractmethod
    def generator_gpus(self, generation: GenerationConfig) -> float:
        """GPUs Ray gives each generator actor on CUDA."""

    @abstractmethod
    def sleep_level(self, generation: GenerationConfig) -> int | None:
        """vLLM's sleep level after each generation (``None``: it never sleeps)."""

    @abstractmethod
    def slots(self, ranks: int, worker_num_cpus: float) -> Slots:
        """Reserve what the run's actors need (before any is created)."""

    def after_train_step(self, scratch: MutableSequence[Any]) -> None:
        """The policy rank's step is done; ``scratch``: what the step prepared (its micro-batches)."""


class Split(Placement):
    name = "split"
    engine_gpu_first = False
    needs_reshard = False

    def policy_gpus(self, policy: PolicyConfig, ranks: int) -> float:
        return policy.gpus_per_rank if policy.gpus_per_rank is not None else 1.0 / ranks

    def generator_gpus(self, generation: GenerationConfig) -> float:
        return generation.num_gpus

    def sleep_level(self, generation: GenerationConfig) -> int | None:
        return None

    def slots(self, ranks: int, worker_num_cpus: float) -> Slots:
        return Slots()


class Colocated(Placement):
    name = "colocated"
    engine_gpu_first = True
    needs_reshard = True

    def policy_gpus(self, policy: PolicyConfig, ranks: int) -> float:
        return COLOCATED_SHARE

    def generator_gpus(self, generation: GenerationConfig) -> float:
        return COLOCATED_SHARE

    def sleep_level(self, generation: GenerationConfig) -> int | None:
        return generation.vllm.sleep_level

    def slots(self, ranks: int, worker_num_cpus: float) -> Slots:
        return Colocation.reserve(ranks, worker_num_cpus)

    def after_train_step(self, scratch: MutableSequence[Any]) -> None:
        import torch

        # The engine sharing this GPU wakes its KV cache next: hand back the blocks the step
        # cached (activations, gradients' scratch) instead of keeping them for the next step.
        scratch.clear()
        torch.cuda.empty_cache()


_PLACEMENTS: dict[str, type[Placement]] = {p.name: p for p in (Split, Colocated)}


def placement_of(generation: GenerationConfig) -> Placement:
    """The :class:`Placement` ``generation.placement`` names."""
    return _PLACEMENTS[generation.placement]()
