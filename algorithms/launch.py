"""The run's worker actors: launched side by side, then wired together.

:func:`launch` creates, without waiting for any of them (their processes start and import torch
at the same time), ``trainer.dp_size * policy.tensor_parallel_size`` policy ranks (TP innermost,
:mod:`algorithms.replicas`), one generator per collector and the collectors, and the per-rank
dispatcher. :func:`connect` then waits for them, forms the train group, attaches the transport's
sides and forms the refit group: each phase bounded by ``trainer.startup_timeout_s`` and named
when it fails. The job secret that authenticates the groups' rendezvous records travels as an
argument of those calls, in memory (``docs/reliability.md``, "Trust boundary").
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import ray

from algorithms.cluster import worker_env
from algorithms.config import TrainerConfig
from algorithms.dispatch import make_dispatcher
from algorithms.engine_pool import EnginePool, Spawned
from algorithms.placement import Slots
from algorithms.refit_group import form_refit_group
from algorithms.remote import gather
from algorithms.replicas import ReplicaDispatch
from algorithms.step import Workers
from algorithms.transports import Transport
from algorithms.workers.collector import RolloutCollector
from algorithms.workers.generator import HEALTH_GROUP, GeneratorWorker
from algorithms.workers.gpus import ALL_GPUS_ENV
from algorithms.workers.policy import PolicyWorker

__all__ = ["Placed", "connect", "engine_actors", "generator_actor", "launch", "make_pool"]


@dataclass(frozen=True)
class Placed:
    """What :func:`connect` learned: the policy's parameter count, each actor's Ray node (by
    name), and the policy's layout (dp, tp, sharding, refit family)."""

    policy_params: int
    nodes: dict[str, str]
    layout: dict[str, Any]
    local: bool  # every worker on this node (the groups' rendezvous listen on loopback)


def _node_id(actor: Any) -> str:
    """The Ray node an actor runs on (called inside it through ``__ray_call__``)."""
    return ray.get_runtime_context().get_node_id()


def launch(cfg: TrainerConfig, num_collectors: int, *, owned_cluster: bool) -> tuple[Workers, list[Any]]:
    """Create the actors; returns the run's :class:`~algorithms.step.Workers` and every actor
    (policy ranks, generators, collectors, in that order). ``owned_cluster``: the run started
    its cluster with the workers' environment in every process (``worker_env``), so the actors
    need no ``runtime_env`` and take Ray's prestarted workers."""
    cpus = cfg.ray.worker_num_cpus
    ranks = cfg.policy_ranks  # dp * tp, TP innermost (algorithms.replicas)
    _, gpu_env = _envs(cfg, owned_cluster)
    slots = cfg.placement.slots(ranks, cpus)
    policy_cls = ray.remote(PolicyWorker)
    policy = [
        policy_cls.options(
            num_cpus=cpus,
            num_gpus=cfg.policy_gpus_per_rank(),
            runtime_env=gpu_env,
            name=None,
            scheduling_strategy=slots.policy(r),
        ).remote(r, ranks, cfg)
        for r in range(ranks)
    ]
    # One generator per collector (its own GPU, a GPU fraction, or CPU; colocated: its policy
    # rank's GPU); every one receives every refit.
    engines = [
        engine_actors(cfg, i, owned_cluster=owned_cluster, slots=slots, live=list(range(i)))
        for i in range(num_collectors)
    ]
    generators = [g for g, _ in engines]
    collectors = [c for _, c in engines]
    dispatch: Any = make_dispatcher(
        cfg.trainer.dispatch,
        policy,
        fail_compile=cfg.debug.fail_dispatch_compile,
        idle_teardown_s=cfg.trainer.dispatch_idle_teardown_s,
    )
    tp = cfg.policy.tensor_parallel_size
    if tp > 1:
        dispatch = ReplicaDispatch(dispatch, tp)
    # The refit's senders: rank 0 (packed, whole weights), the first replica's TP ranks, or every
    # rank of a fully sharded policy.
    senders = policy[: cfg.refit_senders]
    workers = Workers(
        policy=policy,
        generators=generators,
        collectors=collectors,
        dispatch=dispatch,
        refit_senders=senders,
        slots=slots,
    )
    return workers, [*policy, *generators, *collectors]


def _envs(
    cfg: TrainerConfig, owned_cluster: bool, *, generator: bool = False
) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """The ``runtime_env`` of CPU-side and GPU-side actors (``None``: the cluster's own);
    ``generator``: the GPU-side one is a generator's."""
    env_vars = {} if owned_cluster else worker_env(cfg)
    gpu_vars = env_vars
    # vLLM's TP workers are processes of their own that take GPUs 0..tp-1 of what they see: only
    # Ray's narrowing puts them on the generator's GPUs (the refit then goes over NCCL, p2p).
    narrowed = generator and cfg.generation.tensor_parallel_size > 1
    if cfg.reshard_may_use_ipc and cfg.policy.device == cfg.generation.device == "cuda" and not narrowed:
        # CUDA IPC across GPUs: senders must see the generator's GPU (algorithms/workers/gpus.py).
        gpu_vars = {**env_vars, ALL_GPUS_ENV: "1"}
    return ({"env_vars": env_vars} if env_vars else None), ({"env_vars": gpu_vars} if gpu_vars else None)


def generator_actor(cfg: TrainerConfig, index: int, *, owned_cluster: bool, strategy: Any = None) -> Any:
    """Create engine ``index``'s generator actor (not waited for), as every run creates it;
    ``strategy``: Ray's scheduling strategy (colocated: its policy rank's bundle)."""
    _, gpu_env = _envs(cfg, owned_cluster, generator=True)
    return (
        # Its heartbeat runs on a thread of its own, beside a generation (workers/generator.py).
        ray.remote(concurrency_groups={HEALTH_GROUP: 1})(GeneratorWorker)  # type: ignore[call-overload]  # ray's overloads omit concurrency_groups
        .options(
            num_cpus=cfg.ray.worker_num_cpus,
            num_gpus=cfg.generator_gpus(),
            runtime_env=gpu_env,
            scheduling_strategy=strategy,
            # A refit must reach a generator that generates (partial) or waits for a version.
            max_concurrency=2 if cfg.async_.partial_rollout or cfg.async_.mode != "free" else 1,
        )
        .remote(cfg, index)
    )


def engine_actors(
    cfg: TrainerConfig,
    index: int,
    *,
    owned_cluster: bool,
    slots: Slots | None = None,
    live: list[int] | None = None,
) -> tuple[Any, Any]:
    """Create engine ``index``'s generator and the collector that drives it (not waited for);
    ``slots`` (the run's, from its placement) place the generator, knowing ``live`` (the engine ids
    up or starting)."""
    env, _ = _envs(cfg, owned_cluster)
    strategy = (slots or Slots()).engine(index, live or [])
    generator = generator_actor(cfg, index, owned_cluster=owned_cluster, strategy=strategy)
    # Several concurrent calls: submit/poll/take while the producer thread generates.
    collector = (
        ray.remote(RolloutCollector)
        .options(num_cpus=0, runtime_env=env, max_concurrency=4)
        .remote(cfg, generator, index)
    )
    return generator, collector


def make_pool(
    cfg: TrainerConfig,
    workers: Workers,
    actors: list[Any],
    transport: Transport,
    secret: str,
    *,
    local: bool,
    owned_cluster: bool,
    on_join: Callable[[Any], None] | None = None,
) -> EnginePool:
    """The run's engines as a pool that can lose members (:mod:`algorithms.engine_pool`): a
    replacement is created like the first engines, attached to ``transport``'s sink and added to
    ``actors`` (so shutdown reaches it); the refit group is re-formed over the same senders;
    ``on_join(collector)``: after the refit that gave a replacement its weights (async: start it)."""

    def spawn(index: int) -> Spawned:
        # pool.holding: the lost engine is dropped first, so its slot is free.
        g, c = engine_actors(cfg, index, owned_cluster=owned_cluster, slots=workers.slots, live=pool.holding)
        actors.extend([g, c])
        starting = [g.ready.remote(), c.ready.remote(), c.attach.remote(transport.sink())]
        return Spawned(g, c, starting, time.perf_counter())

    def reform(generators: list[Any]) -> None:
        workers.abort_refit = form_refit_group(
            cfg,
            workers.refit_senders,
            generators,
            workers.policy[0],
            secret,
            local=local,
            # Past the group's own bound: a formation that lost a member ends (its members' calls
            # time out) before the next one is asked of them.
            timeout_s=max(cfg.trainer.startup_timeout_s, cfg.refit.timeout_s) + 30,
            what="refit group re-formed",
        )

    pool = EnginePool(cfg, workers.generators, workers.collectors, spawn, reform, on_join)
    return pool


def connect(
    cfg: TrainerConfig,
    workers: Workers,
    actors: list[Any],
    transport: Transport,
    secret: str,
    *,
    on_ready: Callable[[], None] = lambda: None,
) -> Placed:
    """Wait for the launched ``actors`` (``on_ready`` is called once every one answered), then
    form the train group, attach ``transport``'s batch I/O and sink, and form the refit group.

    Raises:
        StepError: a worker failed or a phase outlasted ``trainer.startup_timeout_s`` (named).
    """
    policy, generators, collectors = workers.policy, workers.generators, workers.collectors
    ranks = len(policy)  # dp * tp
    timeout = cfg.trainer.startup_timeout_s
    names = (
        [f"policy{r}" for r in range(ranks)]
        + [f"generator{i}" if i else "generator" for i in range(len(generators))]
        + [f"collector{i}" if i else "collector" for i in range(len(collectors))]
    )
    ready = gather([a.ready.remote() for a in actors], timeout, "worker start-up", names)
    on_ready()
    nodes = gather([a.__ray_call__.remote(_node_id) for a in actors], timeout, "worker placement", names)
    # Rendezvous addresses come from the node rank 0 runs on, ports from the process that binds
    # them (workers may sit on other nodes; a port picked here could be taken meanwhile). Every
    # worker on one node: the stores listen on loopback only.
    local = len(set(nodes)) == 1
    (train_at,) = gather([policy[0].host_rendezvous.remote("train", ranks, local)], timeout, "train group rendezvous")
    gather([p.join_train_group.remote(*train_at, secret) for p in policy], timeout, "train group set-up")
    io, sink = transport.batch_io(), transport.sink()
    gather(
        [*(p.attach.remote(io) for p in policy), *(c.attach.remote(sink) for c in collectors)],
        timeout,
        f"{transport.name} transport attach",
    )
    workers.abort_refit = form_refit_group(
        cfg, workers.refit_senders, generators, policy[0], secret, local=local, timeout_s=timeout
    )
    layout = {
        "dp": cfg.trainer.dp_size,
        "tp": cfg.policy.tensor_parallel_size,
        "sharding": cfg.policy.sharding,
        "refit": cfg.refit_mode,
    }
    return Placed(int(ready[0]["params"]), dict(zip(names, nodes)), layout, local)
