"""What the sync and async GRPO trainers share: set-up, workers, checkpoints, shutdown, summary.

:class:`Trainer` owns one run: config -> Ray cluster (owned by the run) -> the store (data-plane
path) -> workers (``dp_size * policy.tensor_parallel_size`` policy ranks, one generator,
``async.num_collectors`` rollout
collectors) -> ``_loop`` (the subclass: :mod:`algorithms.grpo_sync` or
:mod:`algorithms.grpo_async`) -> metrics, checkpoints, plot, summary. It makes the run's
choices once: the transport (:func:`algorithms.transports.make_transport`: ``data_plane.enabled``
moves every batch through the store by metadata, else the in-memory baseline, which never
imports a data-plane module), and through the workers' factories the training and generation
engines and the refit family.

Exit status of :meth:`Trainer.run`: 0 on success, 1 when a step or the set-up failed (the
worker's error is printed with its traceback), 2 when the run's inputs fail their checks before
Ray starts (:mod:`algorithms.inputs`; one line, as ``main`` prints for a bad config), 3 when it
finished but left keys no group in flight owns (a leak, :func:`algorithms.rollouts.leak_exit`),
130 on Ctrl-C, 143 on SIGTERM. In every case the store is emptied, the store and the workers are
shut down, and the Ray cluster the run started is stopped, every process of it.
"""

from __future__ import annotations

import json
import os
import random
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import ray
import torch

from algorithms import cluster
from algorithms.checkpoint import load_driver_state, mark_complete, save_driver_state, saved_tokenizer, step_dir
from algorithms.config import TrainerConfig
from algorithms.dispatch import make_dispatcher
from algorithms.inputs import check_run_inputs, load_datasets
from algorithms.metrics import MetricsLogger
from algorithms.remote import gather
from algorithms.replicas import ReplicaDispatch
from algorithms.rollouts import keys_outside_groups, leak_exit
from algorithms.run_dir import RunPlan, checkpoint_root, plan_run_dir, plot_title, remove_results, write_outputs
from algorithms.step import StepResult, Workers, refit, run_idle_ratios
from algorithms.tokenizers import check_tokenizer_record, tokenizer_record
from algorithms.transports import DATA_PLANE_MODULES, Transport, data_plane_modules_loaded, make_transport
from algorithms.workers.collector import RolloutCollector
from algorithms.workers.generator import GeneratorWorker
from algorithms.workers.gpus import ALL_GPUS_ENV
from algorithms.workers.policy import PolicyWorker
from nemo_dataplane.distributed.auth import SECRET_ENV, new_job_secret

__all__ = ["DATA_PLANE_MODULES", "Trainer", "checkpoint_root", "data_plane_modules_loaded"]


def _node_id(actor: Any) -> str:
    """The Ray node an actor runs on (called inside it through ``__ray_call__``)."""
    return ray.get_runtime_context().get_node_id()


class Trainer:
    """Owns one run: Ray, the store (data-plane path), the workers, the loop. Use :meth:`run`.

    Subclasses implement :meth:`_loop` (the step loop; returns the exit status) and
    :meth:`_load_driver_state`/:meth:`_driver_state` (what their checkpoints add).
    """

    name = "grpo"

    def __init__(self, cfg: TrainerConfig) -> None:
        self.cfg = cfg
        self.out = Path(cfg.logging.output_dir)
        self.tokenizer_record: dict[str, Any] | None = None  # the run's tokenizer, recorded in checkpoints
        self.workers: Workers | None = None
        self.actors: list[Any] = []
        self.logger: MetricsLogger | None = None
        self.transport: Transport = make_transport(cfg)
        self._transport_started = False
        self._ray_started = False
        self.t0 = time.perf_counter()
        self.summary: dict[str, Any] = {"data_plane": cfg.data_plane.enabled}
        self.plan: RunPlan | None = None
        self._datasets: tuple[list[Any], list[Any]] = ([], [])

    def prepare(self) -> RunPlan:
        """Check the output directory and the checkpoint to resume from (:mod:`algorithms.run_dir`),
        load the datasets and check them against the tokenizer, the model and the reward
        (:mod:`algorithms.inputs`), before anything is written or started; idempotent. Raises
        ``ConfigError`` (the CLI's exit 2)."""
        if self.plan is None:
            plan = plan_run_dir(self.cfg)
            train, val = load_datasets(self.cfg)
            tok = check_run_inputs(self.cfg, train, val)
            if plan.resume is not None:  # the tokenizer the checkpoint was trained with
                check_tokenizer_record(saved_tokenizer(plan.resume), tok, str(plan.resume))
            self.tokenizer_record = tokenizer_record(tok)
            self._datasets = (train, val)
            self.plan = plan
        return self.plan

    # ------------------------------------------------------------------ set-up
    def _start_ray(self) -> None:
        if not ray.is_initialized():
            cfg = self.cfg
            self._ray_started = not cfg.ray.address  # a start cut short by a signal is stopped too
            cluster.start_ray(cfg, self.name, self.num_collectors(cfg), self.transport.actor_modules())

    def _launch_workers(self, num_collectors: int = 1) -> None:
        """Create the worker actors without waiting for them (their processes start and import
        torch side by side); :meth:`_connect_workers` waits for them."""
        cfg = self.cfg
        cpus = cfg.ray.worker_num_cpus
        # The job secret that authenticates rendezvous-store records reaches the workers as an
        # argument of the calls that form the groups: in memory, never through a store nor the
        # runtime_env (Ray logs that to a file). docs/reliability.md, "Trust boundary".
        self._secret = os.environ.get(SECRET_ENV) or new_job_secret()
        # A cluster this run started has worker_env in every process already (start_ray): no
        # runtime_env, so the actors take Ray's prestarted workers.
        env_vars = {} if self._ray_started else cluster.worker_env(cfg)
        ranks = cfg.policy_ranks  # dp * tp, TP innermost (algorithms.replicas)
        gpu_vars = env_vars
        if cfg.reshard_may_use_ipc and cfg.policy.device == cfg.generation.device == "cuda":
            # CUDA IPC across GPUs: senders must see the generator's GPU (algorithms/workers/gpus.py).
            gpu_vars = {**env_vars, ALL_GPUS_ENV: "1"}
        env = {"env_vars": env_vars} if env_vars else None
        gpu_env = {"env_vars": gpu_vars} if gpu_vars else None
        policy_cls = ray.remote(PolicyWorker)
        policy = [
            policy_cls.options(
                num_cpus=cpus, num_gpus=cfg.policy_gpus_per_rank(), runtime_env=gpu_env, name=None
            ).remote(r, ranks, cfg)
            for r in range(ranks)
        ]
        # One generator per collector (its own GPU, a GPU fraction, or CPU); every one receives
        # every refit.
        generators = [
            ray.remote(GeneratorWorker)
            .options(
                num_cpus=cpus,
                num_gpus=cfg.generation.num_gpus if cfg.generation.device == "cuda" else 0,
                runtime_env=gpu_env,
                # A refit must reach a generator that generates (partial) or waits for a version.
                max_concurrency=2 if cfg.async_.partial_rollout or cfg.async_.mode != "free" else 1,
            )
            .remote(cfg)
            for _ in range(num_collectors)
        ]
        # Several concurrent calls: submit/poll/take while the producer thread generates.
        collectors = [
            ray.remote(RolloutCollector)
            .options(num_cpus=0, runtime_env=env, max_concurrency=4)
            .remote(cfg, generators[i], i)
            for i in range(num_collectors)
        ]
        self.actors = [*policy, *generators, *collectors]
        dispatch: Any = make_dispatcher(
            cfg.trainer.dispatch,
            policy,
            fail_compile=cfg.debug.fail_dispatch_compile,
            idle_teardown_s=cfg.trainer.dispatch_idle_teardown_s,
        )
        tp = cfg.policy.tensor_parallel_size
        if tp > 1:
            dispatch = ReplicaDispatch(dispatch, tp)
        # The refit's senders: rank 0 (packed, whole weights) or the first replica's TP ranks.
        senders = policy[: cfg.refit_senders]
        self.workers = Workers(
            policy=policy, generators=generators, collectors=collectors, dispatch=dispatch, refit_senders=senders
        )

    def _connect_workers(self) -> None:
        """Wait for the launched workers, then form the train group, attach the store and form the
        refit group (each bounded by ``trainer.startup_timeout_s``, naming the phase that failed)."""
        cfg = self.cfg
        assert self.workers is not None
        policy, generators, collectors = self.workers.policy, self.workers.generators, self.workers.collectors
        ranks = len(policy)  # dp * tp
        timeout = cfg.trainer.startup_timeout_s
        names = (
            [f"policy{r}" for r in range(ranks)]
            + [f"generator{i}" if i else "generator" for i in range(len(generators))]
            + [f"collector{i}" if i else "collector" for i in range(len(collectors))]
        )
        ready = gather([a.ready.remote() for a in self.actors], timeout, "worker start-up", names)
        self.policy_params = int(ready[0]["params"])
        nodes = gather([a.__ray_call__.remote(_node_id) for a in self.actors], timeout, "worker placement", names)
        self.summary["worker_nodes"] = dict(zip(names, nodes))
        self.summary["policy_layout"] = {
            "dp": cfg.trainer.dp_size,
            "tp": cfg.policy.tensor_parallel_size,
            "sharding": cfg.policy.sharding,
            "refit": cfg.refit_mode,
        }
        # Rendezvous addresses come from the node rank 0 runs on, ports from the process that
        # binds them (workers may sit on other nodes; a port picked here could be taken meanwhile).
        # Every worker on one node: the stores listen on loopback only.
        local = len(set(nodes)) == 1
        (train_at,) = gather(
            [policy[0].host_rendezvous.remote("train", ranks, local)], timeout, "train group rendezvous"
        )
        gather([p.join_train_group.remote(*train_at, self._secret) for p in policy], timeout, "train group set-up")
        io, sink = self.transport.batch_io(), self.transport.sink()
        gather(
            [*(p.attach.remote(io) for p in policy), *(c.attach.remote(sink) for c in collectors)],
            timeout,
            f"{self.transport.name} transport attach",
        )
        senders = self.workers.refit_senders
        world = len(senders) + len(generators)  # the generators are the last refit ranks
        if cfg.refit.port:
            host, port = cfg.refit.host, cfg.refit.port
        else:
            (refit_at,) = gather(
                [policy[0].host_rendezvous.remote("refit", world, local)], timeout, "refit group rendezvous"
            )
            host, port = refit_at
        gather(
            [
                *(s.init_refit.remote(host, port, world, self._secret) for s in senders),
                *(
                    g.init_refit.remote(host, port, world, len(senders) + i, self._secret)
                    for i, g in enumerate(generators)
                ),
            ],
            timeout,
            "refit group set-up",
        )

    # -------------------------------------------------------------- checkpoint
    def _driver_state(self) -> dict[str, Any]:
        """What the subclass's checkpoints hold besides the step (e.g. the data position)."""
        raise NotImplementedError

    def _load_driver_state(self, state: dict[str, Any]) -> None:
        raise NotImplementedError

    def _groups_in_flight(self) -> set[int]:
        """Group ids handed out whose rows may rightly be in the store at exit: the async stream's
        untrained groups; the sync step's while its collector writes them (an interrupt there)."""
        return set()

    def _account_stored_keys(self) -> None:
        """Record the keys in the store before the final clear: ``keys_in_store_at_exit`` (all)
        and ``keys_leaked_at_exit`` (those not rows of a group in flight); name a few leaked."""
        stored = self.transport.stored_keys()
        leaked = keys_outside_groups(stored, self._groups_in_flight())
        self.summary["keys_in_store_at_exit"] = sum(len(keys) for keys in stored.values())
        self.summary["keys_leaked_at_exit"] = len(leaked)
        if leaked:
            print(
                f"{self.name}: {len(leaked)} key(s) leaked: in the store at exit, in no group in flight, e.g. "
                f"{leaked[:5]}",
                file=sys.stderr,
            )

    def _save_checkpoint(self, step_done: int) -> Path:
        """Policy + optimizer (+ RNG) from the ranks, then the driver's state, then the marker:
        a checkpoint without the marker (a crash mid-save) is never resumed from."""
        assert self.workers is not None
        root = checkpoint_root(self.cfg)
        d = step_dir(root, step_done)
        d.mkdir(parents=True, exist_ok=True)
        gather(
            [w.save_checkpoint.remote(str(d)) for w in self.workers.policy],
            self.cfg.trainer.step_timeout_s,
            "checkpoint",
        )
        save_driver_state(d, step_done, self._driver_state(), self.cfg.to_dict(), tokenizer=self.tokenizer_record)
        mark_complete(d, step_done, root=root, keep=self.cfg.checkpoint.keep)
        if self.cfg.checkpoint.export_hf:
            self._export_hf(d.name)
        return d

    def _export_hf(self, name: str) -> None:
        """The policy and tokenizer into ``<output_dir>/hf/<name>`` (HF format): every rank takes
        part (sharded weights are gathered), one writes."""
        assert self.workers is not None
        d = self.out / "hf" / name
        gather([w.export_hf.remote(str(d)) for w in self.workers.policy], self.cfg.trainer.step_timeout_s, "hf export")

    # -------------------------------------------------------------------- run
    def run(self) -> int:
        """Run the whole training; returns the process exit status (see the module docstring).
        Raises ``ConfigError`` (:meth:`prepare`) before anything is written or started."""
        cfg = self.cfg
        plan = self.prepare()
        resume = plan.resume
        t0 = self.t0 = time.perf_counter()
        status, code = "failed", 1
        remove_results(plan.stale, self.name)
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / "config.json").write_text(json.dumps(cfg.to_dict(), indent=2))
        torch.manual_seed(cfg.trainer.seed)
        random.seed(cfg.trainer.seed)
        torch.set_num_threads(cfg.trainer.num_threads)
        summary = self.summary
        cluster.raise_on_sigterm()  # SIGTERM stops the run as Ctrl-C does (exit 143)
        try:
            train, val = self._datasets
            self._init_data(train)
            start = plan.start_step
            if resume is not None:
                self._load_driver_state(load_driver_state(resume)["prompts"])
                summary["resumed_from"] = str(resume)
                print(f"{self.name}: resuming from step {start} ({resume})", file=sys.stderr, flush=True)
            marks = [time.perf_counter()]
            self._start_ray()
            marks.append(time.perf_counter())
            self._transport_started = True  # from here on shutdown empties and closes it
            self.transport.start()
            marks.append(time.perf_counter())
            self._launch_workers(self.num_collectors(cfg))
            self._connect_workers()
            marks.append(time.perf_counter())
            # The store comes up first, then the workers: a store that cannot start fails the run
            # before any worker imports a model, and the whole start-up takes as long either way
            # (it is CPU-bound; docs/data-flow.md, "Start-up"). Detail: the store's own phases.
            phases = {"ray": marks[1] - marks[0], "data_plane": marks[2] - marks[1], "workers": marks[3] - marks[2]}
            detail = self.transport.startup_detail()
            summary["startup_s"] = {**phases, "data_plane_detail": detail} if detail else phases
            assert self.workers is not None
            if resume is not None:
                notes = gather(
                    [w.load_checkpoint.remote(str(resume)) for w in self.workers.policy],
                    cfg.trainer.startup_timeout_s,
                    "checkpoint load",
                )
                for note in dict.fromkeys(n for n in notes if n):
                    print(f"{self.name}: {note}", file=sys.stderr, flush=True)
                    summary.setdefault("resume_notes", []).append(note)
                self.transport.clear_all()  # rollouts of the interrupted run are regenerated
            refit(cfg, self.workers, start)  # the generator starts from exactly the policy's weights
            summary["policy_params"] = self.policy_params
            summary["prompts"] = {"train": len(train), "val": len(val)}
            self.logger = MetricsLogger.for_run(self.out, cfg, start_step=start, policy_params=self.policy_params)
            code = self._loop(start, val)
            if cfg.checkpoint.export_hf and code == 0:
                self._export_hf("final")
            status = "finished"
            summary["generator_versions"] = gather(
                [g.weight_version.remote() for g in self.workers.generators], 60, "generator versions"
            )
            summary["workers_data_plane_modules"] = self._worker_modules()
        except KeyboardInterrupt as e:  # Ctrl-C, or SIGTERM (cluster.Terminated)
            sigterm = isinstance(e, cluster.Terminated)
            status, code = ("terminated (SIGTERM)", cluster.SIGTERM_EXIT) if sigterm else ("interrupted (Ctrl-C)", 130)
            print(f"\n{self.name}: {status}; clearing the store and shutting down workers", file=sys.stderr)
        except Exception as e:  # noqa: BLE001 - reported, then the process exits non-zero
            status, code = "failed", 1
            # The traceback too: the step's own error (with its worker's cause) is what a user debugs.
            traceback.print_exc(file=sys.stderr)
            print(f"{self.name}: error: {e}", file=sys.stderr)
            summary["error"] = str(e)
        finally:
            self._shutdown()
        status, code = leak_exit(status, code, summary)  # _account_stored_keys named the leaked keys
        rows = self.logger.rows if self.logger is not None else []
        if self.logger is not None:
            self.logger.close()
        wall = time.perf_counter() - t0
        idle = run_idle_ratios(rows, self.num_collectors(cfg))
        summary.update(
            **idle,
            status=status,
            exit_code=code,
            wall_s=wall,
            steps=len(rows),
            last=rows[-1] if rows else None,
            driver_data_plane_modules=data_plane_modules_loaded(sys.modules),
        )
        title = plot_title(cfg, self.name, self.transport.name) if cfg.logging.plot else None
        write_outputs(self.out, rows, summary, name=self.name, wall_s=wall, idle=idle, title=title)
        return code

    @classmethod
    def num_collectors(cls, cfg: TrainerConfig) -> int:
        """Rollout collectors, each with its own generator."""
        return 1

    def _init_data(self, train: list[Any]) -> None:
        """Build the prompt source from the training records (before any resume state loads)."""
        raise NotImplementedError

    def _loop(self, start: int, val: list[Any]) -> int:
        raise NotImplementedError

    def _after_step(self, step: int, result: StepResult, val: list[Any]) -> None:
        """Validation, the step's line (and its ops, for the metrics endpoint), the checkpoint:
        the same for every trainer."""
        row = result.row
        assert self.workers is not None
        cfg = self.cfg
        last = step == cfg.trainer.steps - 1
        if val and cfg.trainer.val_every and ((step + 1) % cfg.trainer.val_every == 0 or last):
            t = time.perf_counter()
            (row["val_reward"],) = gather(
                [self.workers.collector.validate.remote(val, cfg.trainer.seed * 7919 + step)],
                cfg.trainer.step_timeout_s,
                "validation",
            )
            row["time/validate"] = time.perf_counter() - t
        row["elapsed_s"] = time.perf_counter() - self.t0  # since the trainer started (incl. start-up)
        assert self.logger is not None
        self.logger.log_step(row, result.ops, result.staleness)
        if not cfg.logging.quiet and not cfg.logging.progress:
            self.logger.write(
                f"step {step}: reward={row['reward']:.3f} loss={row.get('loss')} step_s={row['step_s']:.2f}"
                + (f" val_reward={row['val_reward']:.3f}" if row.get("val_reward") is not None else "")
            )
        if cfg.checkpoint.every and ((step + 1) % cfg.checkpoint.every == 0 or last):
            self._save_checkpoint(step + 1)

    def _banner(self, what: str) -> None:
        cfg = self.cfg
        if not cfg.logging.quiet and self.logger is not None:
            self.logger.write(
                f"{self.name}: {cfg.trainer.steps} steps, dp_size={cfg.trainer.dp_size}, "
                f"transport={self.transport.name}, "
                f"{cfg.grpo.prompts_per_step} prompts x {cfg.generation.n} samples per step{what}, output {self.out}"
            )

    def _worker_modules(self) -> dict[str, list[str]]:
        assert self.workers is not None
        names = [f"policy{r}" for r in range(len(self.workers.policy))] + [
            f"collector{i}" if i else "collector" for i in range(len(self.workers.collectors))
        ]
        actors = [*self.workers.policy, *self.workers.collectors]
        mods = gather([a.loaded_modules.remote() for a in actors], 60, "module report")
        return {n: data_plane_modules_loaded(m) for n, m in zip(names, mods)}

    def _shutdown(self) -> None:
        """Best effort, each part bounded: collectors, the store (emptied), workers, Ray. Safe
        after any failure; a second Ctrl-C or a SIGTERM while it runs is ignored so the store and
        the cluster still go down."""
        with cluster.signals_ignored():
            self._shutdown_parts()

    def _shutdown_parts(self) -> None:
        if self.workers is not None and ray.is_initialized():
            # Producers stop first, so nothing is written after the store is emptied.
            try:
                ray.wait(
                    [c.stop.remote(5.0) for c in self.workers.collectors],
                    num_returns=len(self.workers.collectors),
                    timeout=10,
                )
            except Exception:  # noqa: BLE001 - a dead collector is killed below
                pass
        if self._transport_started:
            try:
                # Counted before the clear, or a leak could never show.
                self._account_stored_keys()
                self.transport.clear_all()
                self.summary["keys_outstanding_at_exit"] = self.transport.outstanding(audit=True)
            except Exception as e:  # noqa: BLE001
                self.summary["keys_outstanding_at_exit"] = -1
                self.summary.setdefault("keys_leaked_at_exit", -1)
                print(f"{self.name}: emptying the store at exit failed: {e!r}", file=sys.stderr)
        if self.workers is not None and ray.is_initialized():
            # The graph's loops run inside the policy actors: tear them down (bounded) while the
            # actors live, before their shutdown calls and the kill. After a failed call through
            # the graph this kills the policy actors after a 1 s grace (their peers' collective would hold
            # them until it timed out), so their shutdown calls below return at once.
            self.workers.dispatch.close(timeout_s=10.0)
            self.summary["dispatch"] = self.workers.dispatch.report()
            # Let workers tear down their process groups and detach from the store before they
            # are killed (an NCCL communicator left half-open can hold the GPU); bounded, since
            # a wedged worker is killed below either way.
            w = self.workers
            refs = (
                [p.shutdown.remote() for p in w.policy]
                + [g.shutdown.remote() for g in w.generators]
                + [c.close.remote() for c in w.collectors]
            )
            try:
                ray.wait(refs, num_returns=len(refs), timeout=10)
            except Exception:  # noqa: BLE001 - a dead actor cannot shut down; it is killed below
                pass
            self.workers = None
        if self._transport_started:
            self._transport_started = False
            try:
                self.transport.close()
            except Exception as e:  # noqa: BLE001
                print(f"{self.name}: closing the {self.transport.name} transport failed: {e}", file=sys.stderr)
        if ray.is_initialized():
            for a in self.actors:
                try:
                    ray.kill(a, no_restart=True)
                except Exception:  # noqa: BLE001 - already dead
                    pass
            self.actors = []
        if self._ray_started:
            self._ray_started = False
            cluster.stop_ray()
