"""Policy worker: one rank of the trained model, run as a Ray actor.

The rank owns its wiring (rank, DP replica and TP rank, the gradient all-reduce group, the refit
group and sender), its batch I/O and its checkpoint files; what it computes with is a training
engine (:mod:`algorithms.engines.training`: the HF model trained with torch, or Megatron-core),
and how its rows arrive is the transport's :class:`~algorithms.transports.BatchIO` (fetched from
the store by metadata, or a shard shipped through Ray). Micro-batches come from the driver's plan
either way, so the arithmetic is identical.

Rollout fields (one row per sample): ``input_ids`` jagged int64 (prompt + response),
``prompt_len`` int64, ``advantages`` float32, and per-token ``prev_logprobs`` / ``ref_logprobs``
jagged float32 of length ``seq_len - 1`` (position ``t`` scores token ``t + 1``).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import ray
import torch
import torch.distributed as dist

from algorithms.checkpoint import load_trusted, save_file
from algorithms.config import REFIT_GROUP, TrainerConfig
from algorithms.engines.training import Prepared, TrainingEngine, build_training_engine
from algorithms.engines.training.base import Which
from algorithms.faults import maybe_fail
from algorithms.finite import NonFiniteError, nonfinite_message
from algorithms.refit_weights import refit_weights
from algorithms.tokenizers import build_tokenizer
from algorithms.transports import BatchIO
from algorithms.workers.gpus import worker_device
from nemo_dataplane.codec import jagged_from_rows, jagged_rows
from nemo_dataplane.distributed.auth import (
    AuthStore,
    authenticated,
    bind_instance,
    host_tcp_store,
    is_loopback,
    job_secret,
)
from nemo_dataplane.distributed.loopback import LOOPBACK_HOST, pin_collectives_to_loopback
from nemo_dataplane.distributed.stateless_group import StatelessProcessGroup
from nemo_dataplane.refit import WeightSender, build_weight_sender


def warm_up_collectives(device: torch.device) -> None:
    """One all-reduce on ``device``: NCCL creates its communicator on the first collective (a
    second or more on GPUs), so start-up pays for it rather than the first step."""
    dist.all_reduce(torch.zeros(1, device=device))


def pad_float_rows(rows: Sequence[torch.Tensor], length: int) -> torch.Tensor:
    """Right-pad 1-D float rows with 0 to ``[N, length]``."""
    out = torch.zeros(len(rows), length, dtype=torch.float32)
    for i, r in enumerate(rows):
        out[i, : r.numel()] = r
    return out


class PolicyWorker:
    """One policy rank. Construct through Ray (``ray.remote(PolicyWorker)``), then form the
    gradient all-reduce group: rank 0's :meth:`host_rendezvous` ``("train", world_size)`` gives the
    address every rank passes to :meth:`join_train_group` (collective); then :meth:`attach` the
    transport's batch I/O and :meth:`init_refit`.

    With ``policy.tensor_parallel_size = tp > 1`` (megatron) rank ``r`` is TP rank ``r % tp`` of
    DP replica ``r // tp`` (``algorithms.replicas``): every rank of a replica gets the same
    batch, the TP leader alone reads it from the store and writes results back, gradients are
    summed over the DP group only and their norm combines the TP shards.

    Args:
        rank, world_size: this rank and the number of policy ranks (``dp * tp``).
        cfg: the trainer config.
    """

    def __init__(self, rank: int, world_size: int, cfg: TrainerConfig) -> None:
        self.rank, self.world_size, self.cfg = rank, world_size, cfg
        torch.set_num_threads(cfg.trainer.num_threads)
        torch.manual_seed(cfg.trainer.seed * 1000 + rank)
        self.device = worker_device(cfg.policy.device)
        self.timeout_s = cfg.trainer.step_timeout_s
        self.tokenizer = build_tokenizer(cfg)
        self.engine: TrainingEngine = build_training_engine(
            cfg, self.device, vocab_size=self.tokenizer.vocab_size, pad_id=self.tokenizer.pad_id, rank=rank
        )
        self.engine.decode = self.tokenizer.decode
        self._stores: dict[str, Any] = {}  # rendezvous stores this rank hosts, by group
        self._io: BatchIO | None = None
        self._refit_group: StatelessProcessGroup | None = None
        self._sender: WeightSender | None = None

    # ---------------------------------------------------------------- set-up
    def ready(self) -> dict[str, int]:
        """Rank and parameter count, once constructed (the driver waits on it, bounded)."""
        return {"rank": self.rank, "params": self.engine.num_params()}

    def host_rendezvous(self, group: str, world_size: int, loopback: bool = False) -> tuple[str, int]:
        """Host the rendezvous store of ``group`` (rank 0 of it): listen on this node's address
        only (``127.0.0.1`` when ``loopback``, for runs whose workers all share this node), on a
        port the OS picks while binding it (no other process can take it in between).

        Returns:
            ``(address, port)`` for the group's other members.
        """
        address = LOOPBACK_HOST if loopback else ray.util.get_node_ip_address()
        store = host_tcp_store(address, 0, world_size, timedelta(seconds=self.timeout_s))
        self._stores[group] = store
        return address, int(store.port)

    def join_train_group(self, address: str, port: int, secret: str | None = None) -> None:
        """Join the gradient all-reduce group at rank 0's rendezvous (collective over all ranks),
        then let the engine build its parallel state over it.

        Its records are authenticated with the job ``secret`` (handed over in this call, in
        memory; ``None``: ``$NEMO_DATAPLANE_SECRET``) and bound to this instance of the group, so
        a process outside the job can neither forge them nor replay records of another run or
        store. A rendezvous on loopback means every rank is on this node: the group's own
        listeners (gloo, NCCL's bootstrap) then stay on loopback too."""
        timeout = timedelta(seconds=self.timeout_s)
        loopback = is_loopback(address)
        if loopback:
            pin_collectives_to_loopback()
        store = self._stores.get("train") or dist.TCPStore(address, port, self.world_size, False, timeout=timeout)
        store = authenticated(
            store, job_secret(secret), where=f"policy train group at {address}:{port}", loopback=loopback
        )
        if isinstance(store, AuthStore):
            base = store
            store = bind_instance(base, "train", self.rank, self.world_size, lambda keys: base.wait(keys, timeout))
        self._stores["train"] = store  # the group keeps using it
        dist.init_process_group(
            backend=self.cfg.policy.dist_backend,
            store=store,
            rank=self.rank,
            world_size=self.world_size,
            timeout=timeout,
        )
        warm_up_collectives(self.device)
        self.engine.connect(self.rank)

    def attach(self, io: BatchIO) -> None:
        """Open the transport's batch I/O on this rank. A replica's TP ranks share its rows: the
        leader reads them (and broadcasts, as the I/O's policy says), only the leader writes back.
        Without TP every rank is its own replica and leader."""
        io.open(self.rank, self.engine.tp_group, self.timeout_s)
        self._io = io

    def init_refit(self, host: str, port: int, world_size: int, secret: str | None = None) -> None:
        """Join the refit group as sender ``rank`` (collective with the generator): policy rank 0
        with whole weights, or with its shards under HF names every TP rank of the first replica
        or (``policy.sharding=fsdp``) every rank (``refit_senders`` of them), the generators
        being the last ranks. ``secret``: the job
        secret its records are authenticated with (as in :meth:`join_train_group`)."""
        r = self.cfg.refit
        if self._refit_group is not None:  # re-formed (an engine was lost): leave the old group first
            self._sender = None
            try:
                self._refit_group.destroy(abort=True)  # a member is lost: never wait on it
            except Exception:  # noqa: BLE001 - a group with a dead member; the new one is what counts
                pass
        self._refit_group = StatelessProcessGroup(
            host,
            port,
            self.rank,  # senders are policy ranks 0..refit_senders-1, in order
            world_size,
            backend=r.backend,
            timeout=r.timeout_s,
            group_name=REFIT_GROUP,
            secret=secret,
            store=self._stores.pop("refit", None),  # hosted by host_rendezvous("refit", ...) if it ran
        )
        # Where the weights live, not the group's device: an ipc refit's control group is gloo.
        dev = torch.device("cuda", torch.cuda.current_device()) if self.device.type == "cuda" else self.device
        # The refit's form (e.g. FP8 bytes plus scales): the layout the generator's engine expects.
        weights, shapes = refit_weights(self.cfg), self.engine.refit_shapes()
        self._sender = build_weight_sender(
            self.cfg.weight_transfer,
            self._refit_group,
            weights.source(self.engine.named_for_refit, shapes),
            senders=self.cfg.refit_senders,
            full_shapes=weights.layout(shapes),
            device=dev,
        )
        self._sender.prepare_refit_info()

    def leave_refit(self) -> None:
        """Leave the refit group after a refit failed (a receiver was lost): aborted, so a
        receiver still waiting in it fails at once; the next :meth:`init_refit` joins a new one."""
        group, self._refit_group, self._sender = self._refit_group, None, None
        if group is not None:
            group.destroy(abort=True)

    def send_weights(self, version: int) -> float:
        """Broadcast the current weights to the generator (collective); returns seconds."""
        if self._sender is None:
            raise RuntimeError(f"policy rank {self.rank}: send_weights() before init_refit()")
        t0 = time.perf_counter()
        self._sender.send_weights(version)
        return time.perf_counter() - t0

    # ------------------------------------------------------------- batches
    def _maybe_fail(self, phase: str, step: int) -> None:
        maybe_fail(self.cfg.debug, phase, step=step, rank=self.rank, what=f"at step {step} on policy rank {self.rank}")

    def _batch_io(self) -> BatchIO:
        if self._io is None:
            raise RuntimeError(f"policy rank {self.rank}: no batch I/O attached")
        return self._io

    def _logprobs(self, models: Sequence[tuple[Which, str]], batch: Any) -> dict[str, Any]:
        """One read, then per-token log-probs of each ``(model, field)``; one write-back of all.

        Raises:
            NonFiniteError: a log-prob of a row is NaN or infinite (names its group and prompt);
                nothing is written back.
        """
        io = self._batch_io()
        t0 = time.perf_counter()
        got = io.load(batch, ["input_ids", "prompt_len", "group_id"])
        t_fetch = time.perf_counter() - t0
        rows: dict[str, list[torch.Tensor]] = {f: [torch.empty(0)] * got.size for _, f in models}
        bad: str | None = None
        with torch.no_grad():
            for mb, pos in zip(got.microbatches, got.positions):
                lens = [r.numel() for r in jagged_rows(mb["input_ids"])]
                width = max(lens) - 1
                valid = torch.arange(width).reshape(1, -1) < (torch.tensor(lens) - 1).reshape(-1, 1)
                for which, f in models:
                    lp = self.engine.score(which, mb, False)[0].float().cpu()
                    # Refused before the write-back: a NaN here would reach every later loss. Raised
                    # after the loop: a sharded engine's forwards are collective, and every rank must
                    # run all of them.
                    bad = bad or nonfinite_message(
                        f"{which} log-prob ({f})", lp[:, :width], mb, mask=valid, decode=self._decode
                    )
                    for j, p in enumerate(pos):
                        rows[f][p] = lp[j, : int(lens[j]) - 1].clone()
        if bad is not None:
            raise NonFiniteError(f"policy rank {self.rank}: {bad}")
        cols = {f: jagged_from_rows(r) for f, r in rows.items()}
        compute_s = time.perf_counter() - t0 - t_fetch
        t1 = time.perf_counter()
        out, written = io.store(batch, cols)
        out.update(
            compute_s=compute_s,
            dp_bytes=got.nbytes + written,
            io_s=t_fetch + time.perf_counter() - t1,  # getting the rows + writing results back
            ops=io.drain_ops(),  # this call's store ops, for the driver (algorithms.telemetry)
        )
        return out

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids)

    def get_logprobs(self, batch: Any, step: int, *, with_reference: bool = False) -> dict[str, Any]:
        """Per-token log-probs of the current policy (``prev_logprobs``) for this rank's rows, and
        with ``with_reference`` also the reference's (``ref_logprobs``) from the same read.

        Returns timings, plus the columns themselves where the transport sends results back in
        the reply (``{"prev_logprobs": jagged [n, seq_len - 1], ...}`` in the shard's order).
        """
        self._maybe_fail("logprobs", step)
        models: list[tuple[Which, str]] = [("policy", "prev_logprobs")]
        if with_reference:
            models.append(("reference", "ref_logprobs"))
        return self._logprobs(models, batch)

    def step_call(self, kind: str, batch: Any, step: int, flag: bool) -> dict[str, Any]:
        """The compiled graph's one entry (``algorithms.dispatch``): ``kind`` ``logprobs`` is
        :meth:`get_logprobs` with ``with_reference=flag``, ``train`` is :meth:`train` with
        ``behaviour=flag``. A graph input is not resolved by Ray as a task argument is: the batch
        I/O resolves it."""
        batch = self._batch_io().resolve(batch)
        if kind == "logprobs":
            return self.get_logprobs(batch, step, with_reference=flag)
        if kind == "train":
            return self.train(batch, step, behaviour=flag)
        raise ValueError(f"policy rank {self.rank}: step_call kind must be 'logprobs' or 'train', got {kind!r}")

    def get_reference_logprobs(self, batch: Any, step: int) -> dict[str, Any]:
        """As :meth:`get_logprobs`, from the frozen initial weights, into ``ref_logprobs``."""
        return self._logprobs([("reference", "ref_logprobs")], batch)

    def train(self, batch: Any, step: int, *, behaviour: bool = False) -> dict[str, Any]:
        """``grpo.epochs`` optimizer steps over this rank's rows; returns loss metrics.

        ``behaviour``: the rows carry the sampler's log-probs (``gen_logprobs``) and the loss
        applies the decoupled-PPO correction with ``prev_logprobs`` as the proximal policy
        (``async.is_cap``, ``async.is_mode``); metrics then include ``is_truncated_frac`` and
        ``behaviour_kl``.

        The loss is the token mean over the *whole* step batch (all ranks): each rank's token
        count is all-reduced first, gradients are summed across ranks. Metrics are this rank's
        share with the same denominator, so the driver sums them over ranks.

        Raises:
            NonFiniteError: an advantage or a proximal / reference / behaviour log-prob (in the
                response) of a row is NaN or infinite on this rank (names its group and prompt)
                or on another (every rank refuses the step together); or the engine refused a
                current log-prob or the gradient norm. No optimizer step runs.
        """
        self._maybe_fail("train", step)
        t0 = time.perf_counter()
        fields = ["input_ids", "prompt_len", "group_id", "advantages", "prev_logprobs", "ref_logprobs"]
        if behaviour:
            fields.append("gen_logprobs")
        got = self._batch_io().load(batch, fields)
        t_fetch = time.perf_counter() - t0
        if self.cfg.debug.train_delay_s:
            time.sleep(self.cfg.debug.train_delay_s)  # injected work (tests of the step accounting)
        prepared = []
        local_tokens = 0
        bad: str | None = None
        for mb in got.microbatches:
            lens = torch.tensor([r.numel() for r in jagged_rows(mb["input_ids"])])
            width = int(lens.max()) - 1
            col = torch.arange(1, width + 1).reshape(1, -1)  # the token each log-prob column scores
            mask = (col >= mb["prompt_len"].reshape(-1, 1)) & (col < lens.reshape(-1, 1))
            mask = mask.float().to(self.device)
            prepared.append(
                Prepared(
                    mb=mb,
                    mask=mask,
                    old=pad_float_rows(jagged_rows(mb["prev_logprobs"]), width).to(self.device),
                    ref=pad_float_rows(jagged_rows(mb["ref_logprobs"]), width).to(self.device),
                    adv=mb["advantages"].float().to(self.device),
                    behaviour=pad_float_rows(jagged_rows(mb["gen_logprobs"]), width).to(self.device)
                    if behaviour
                    else None,
                )
            )
            local_tokens += int(mask.sum().item())
            bad = bad or self._nonfinite_inputs(prepared[-1])
        # The second entry counts ranks with non-finite inputs: all ranks learn it from the
        # all-reduce they run anyway, and refuse together (none waits in a collective for a
        # peer that left, none steps alone).
        counts = torch.tensor([float(local_tokens), float(bad is not None)], dtype=torch.float64, device=self.device)
        dist.all_reduce(counts, group=self.engine.dp_group)  # a replica's TP ranks hold the same rows
        if bad is not None:
            raise NonFiniteError(f"policy rank {self.rank}: {bad}; no optimizer step ran")
        if counts[1].item() > 0:
            raise NonFiniteError(
                f"policy rank {self.rank}: {int(counts[1].item())} other rank(s) refused non-finite inputs; "
                "no optimizer step ran"
            )
        metrics = self.engine.train_step(prepared, max(float(counts[0].item()), 1.0), behaviour)
        self.cfg.placement.after_train_step(prepared)
        return {
            **metrics,
            "tokens": float(local_tokens),
            "io_s": t_fetch,
            "compute_s": time.perf_counter() - t0 - t_fetch,
            "dp_bytes": float(got.nbytes),
            "ops": self._batch_io().drain_ops(),
        }

    def _nonfinite_inputs(self, p: Prepared) -> str | None:
        """The first non-finite input of micro-batch ``p`` (advantages, then the log-probs within
        the response mask), as a message naming its rows' groups and prompts; ``None`` if none."""
        checks = [("advantage", p.adv, None), ("proximal log-prob (prev_logprobs)", p.old, p.mask)]
        checks.append(("reference log-prob (ref_logprobs)", p.ref, p.mask))
        if p.behaviour is not None:
            checks.append(("behaviour log-prob (gen_logprobs)", p.behaviour, p.mask))
        for what, values, mask in checks:
            msg = nonfinite_message(what, values, p.mb, mask=mask, decode=self._decode)
            if msg is not None:
                return msg
        return None

    # ------------------------------------------------------------ checkpoint
    def save_checkpoint(self, path: str) -> None:
        """Model, reference and optimizer state as the engine lays them out (one file per TP rank
        of the first replica, or every rank's shards); every rank its RNG state."""
        d = Path(path)
        d.mkdir(parents=True, exist_ok=True)
        self.engine.save_state(d)
        rng: dict[str, Any] = {"torch": torch.get_rng_state()}
        if torch.cuda.is_available():
            rng["cuda"] = torch.cuda.get_rng_state_all()
        # fsync'd (save_file) before returning: the driver writes the COMPLETE marker after this call.
        save_file(rng, d / f"rng_rank{self.rank}.pt")
        dist.barrier()

    def export_hf(self, path: str) -> str | None:
        """Write the policy (in its precision, safetensors) and the run's tokenizer (its own
        ``save``) into the directory ``path``, loadable by ``transformers`` and vLLM. Called on
        every rank (sharded weights are gathered tensor by tensor); returns ``path`` on the one
        rank that wrote it, ``None`` on the others."""
        tok = self.tokenizer
        ids = {"bos_token_id": tok.bos_id, "eos_token_id": tok.eos_id, "pad_token_id": tok.pad_id}
        if not self.engine.save_hf(path, ids):
            return None
        tok.save(path)
        return path

    def load_checkpoint(self, path: str) -> str | None:
        """Every rank loads its model/optimizer state (as the engine laid it out) and its own RNG
        state; a rank the checkpoint has no RNG state for (it was written with fewer ranks)
        keeps its seeded one. Returns the engine's note on a resharded load (``None``: none)."""
        d = Path(path)
        note = self.engine.load_state(d)
        rng_file = d / f"rng_rank{self.rank}.pt"
        if rng_file.exists():
            rng = load_trusted(rng_file)
            torch.set_rng_state(rng["torch"])
            if "cuda" in rng and torch.cuda.is_available():
                torch.cuda.set_rng_state_all(rng["cuda"])
        return note

    def loaded_modules(self) -> list[str]:
        """Names in this process's ``sys.modules`` under ``nemo_dataplane``/``transfer_queue``
        (the architecture test checks the baseline never loads the data-plane client)."""
        return sorted(m for m in sys.modules if m.startswith(("nemo_dataplane", "transfer_queue")))

    def shutdown(self) -> None:
        """Tear down the groups (best effort; the actor is killed afterwards anyway)."""
        if self._refit_group is not None:
            try:
                self._refit_group.destroy()
            except Exception:  # noqa: BLE001 - shutting down after a failure
                pass
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001
                pass
