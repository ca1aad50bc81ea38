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
shut down, and the Ray cluster the run started is stopped, every process of it, also when the
start-up was cut short (:mod:`algorithms.cluster`).

The workers' launch and the set-up of their groups are :mod:`algorithms.launch`'s.
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
from algorithms.inputs import check_run_inputs, load_datasets
from algorithms.launch import connect, launch, make_pool
from algorithms.metrics import MetricsLogger, StartupProgress
from algorithms.models import model_files_digest
from algorithms.remote import gather
from algorithms.rollouts import keys_outside_groups, leak_exit
from algorithms.run_dir import (
    MODEL_FILES,
    RunPlan,
    checkpoint_root,
    plan_run_dir,
    plot_title,
    remove_results,
    write_outputs,
)
from algorithms.step import StepResult, Workers, refit, run_idle_ratios
from algorithms.tokenizers import check_tokenizer_record, tokenizer_record
from algorithms.transports import DATA_PLANE_MODULES, Transport, data_plane_modules_loaded, make_transport
from nemo_dataplane.distributed.auth import SECRET_ENV, new_job_secret

__all__ = ["DATA_PLANE_MODULES", "Trainer", "checkpoint_root", "data_plane_modules_loaded"]


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
        self.model_files: dict[str, str] | None = None  # the model files' digest, recorded in checkpoints
        self.workers: Workers | None = None
        self.actors: list[Any] = []
        self.logger: MetricsLogger | None = None
        self.transport: Transport = make_transport(cfg)
        self._transport_started = False
        self._ray_started = False  # this run started its Ray cluster (then it stops it, all of it)
        self._workers_up = False  # every worker answered: they can shut down cleanly
        self.t0 = time.perf_counter()
        self.summary: dict[str, Any] = {"data_plane": cfg.data_plane.enabled, "transport": self.transport.label()}
        self.plan: RunPlan | None = None
        self._pool_logged: dict[str, int] = {}  # the engine pool's totals at the last logged step
        self._datasets: tuple[list[Any], list[Any]] = ([], [])
        self._startup = StartupProgress([], name=self.name, enabled=False)  # run() shows the real one

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
            self.model_files = model_files_digest(self.cfg.policy.model)
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
        """Create the worker actors without waiting for them (:func:`algorithms.launch.launch`);
        :meth:`_connect_workers` waits for them."""
        # The job secret that authenticates rendezvous-store records reaches the workers as an
        # argument of the calls that form the groups: in memory, never through a store nor the
        # runtime_env (Ray logs that to a file). docs/reliability.md, "Trust boundary".
        self._secret = os.environ.get(SECRET_ENV) or new_job_secret()
        self.workers, self.actors = launch(self.cfg, num_collectors, owned_cluster=self._ray_started)

    def _connect_workers(self) -> None:
        """Wait for the workers, form their groups, attach the transport
        (:func:`algorithms.launch.connect`); the summary records where they run."""
        assert self.workers is not None

        def ready() -> None:
            self._workers_up = True  # every worker answered: they can shut down cleanly
            self._startup.phase("groups", "train, store attach, refit")

        placed = connect(self.cfg, self.workers, self.actors, self.transport, self._secret, on_ready=ready)
        # The engines as a pool that survives losing members (algorithms/engine_pool.py).
        self.workers.pool = make_pool(
            self.cfg,
            self.workers,
            self.actors,
            self.transport,
            self._secret,
            local=placed.local,
            owned_cluster=self._ray_started,
            on_join=self._start_replacement,
        )
        self.workers.pool.start_heartbeat()
        self.policy_params = placed.policy_params
        self.summary["worker_nodes"] = placed.nodes
        self.summary["policy_layout"] = placed.layout

    def _start_replacement(self, collector: Any) -> None:
        """What a replacement engine's collector needs once the refit gave it the weights (the
        sync trainer drives it per step: nothing)."""

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
        state = {**self._driver_state(), MODEL_FILES: self.model_files}
        save_driver_state(d, step_done, state, self.cfg.to_dict(), tokenizer=self.tokenizer_record)
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
        store = self.transport.startup_phase
        shown = ["Ray", *([store] if store else []), "workers", "groups", *(["checkpoint"] if resume else []), "refit"]
        startup = self._startup = StartupProgress(shown, name=self.name, enabled=cfg.logging.progress)
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
            startup.phase("Ray")
            self._start_ray()
            marks.append(time.perf_counter())
            self._transport_started = True  # from here on shutdown empties and closes it
            if store:
                startup.phase(store)
            self.transport.start()
            marks.append(time.perf_counter())
            self._launch_workers(self.num_collectors(cfg))
            startup.phase("workers", f"{len(self.actors)} processes")
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
                startup.phase("checkpoint", str(resume))
                notes = gather(
                    [w.load_checkpoint.remote(str(resume)) for w in self.workers.policy],
                    cfg.trainer.startup_timeout_s,
                    "checkpoint load",
                )
                for note in dict.fromkeys(n for n in notes if n):
                    print(f"{self.name}: {note}", file=sys.stderr, flush=True)
                    summary.setdefault("resume_notes", []).append(note)
                self.transport.clear_all()  # rollouts of the interrupted run are regenerated
            startup.phase("refit")
            refit(cfg, self.workers, start)  # the generator starts from exactly the policy's weights
            startup.close(done=True)
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
            # Each engine's GPU memory generating and asleep, from engines that sleep (docs/generation.md).
            handover = gather([g.memory_handover.remote() for g in self.workers.generators], 60, "generator memory")
            if any(h is not None for h in handover):
                summary["generator_memory_handover"] = handover
            polls = gather([c.poll.remote() for c in self.workers.collectors], 60, "collector counters")
            summary["groups_per_engine"] = [int(p.get("groups_written", 0)) for p in polls]
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
            startup.close(done=False)
            if self.workers is not None and self.workers.pool is not None:
                summary.update(self.workers.pool.summary())  # each loss, also of a failed run
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
        # A resume that logged no step of its own leaves the resumed run's summary.json as it was.
        keep = resume is not None and not any(int(r.get("step", -1)) >= plan.start_step for r in rows)
        write_outputs(self.out, rows, summary, name=self.name, wall_s=wall, idle=idle, title=title, keep_summary=keep)
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
            seed, pool = cfg.trainer.seed * 7919 + step, self.workers.pool
            if pool is not None:  # an engine lost since the step's generation is dropped here
                row["val_reward"] = pool.on_any(
                    lambda c: c.validate.remote(val, seed), cfg.trainer.step_timeout_s, "validation", step
                )
            else:
                (row["val_reward"],) = gather(
                    [self.workers.collector.validate.remote(val, seed)], cfg.trainer.step_timeout_s, "validation"
                )
            row["time/validate"] = time.perf_counter() - t
        if self.workers.pool is not None:  # the step's share of the pool's totals (validation's too)
            self.workers.pool.stepped()
            totals = self.workers.pool.counts()
            row.update({k: v - self._pool_logged.get(k, 0) for k, v in totals.items()})
            self._pool_logged = totals
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
                f"transport={self.transport.label()}, "
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
        # Workers that never answered (interrupted or failed start-up) have no groups to leave: their
        # clean-shutdown calls would only wait out their bounds behind the start-up. They are killed.
        graceful = self._workers_up
        if self.workers is not None and self.workers.pool is not None:
            self.workers.pool.close()  # no engine is judged hung while the run takes them down
        if self.workers is not None and ray.is_initialized() and graceful:
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
        if self.workers is not None and ray.is_initialized() and graceful:
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
        self.workers = None
        if self._ray_started:
            self._ray_started = False
            cluster.stop_ray()  # a local cluster's every process, however far its start got
