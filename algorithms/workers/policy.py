"""Policy worker: one DP rank of the trained model, run as a Ray actor.

Each rank holds the policy (``algorithms.models.build_model``), a frozen copy of the initial
weights (the KL reference) and AdamW. Ranks form one ``torch.distributed`` group (gloo on CPU)
for the gradient all-reduce. Every compute method takes the rank's share of the step's batch in
one of two forms, and that is the only place the two transports differ:

* a :class:`~nemo_dataplane.meta.KVBatchMeta` (data plane): the rank fetches its rows with
  :class:`~nemo_dataplane.worker.fetch.WorkerFetcher` and writes results back leader-only;
* a legacy shard (``algorithms.legacy_transport.LegacyShard``, resolved by Ray from the driver's
  ``ray.put``): results go back to the driver as tensors.

Micro-batches come from the driver's plan in both cases, so the arithmetic is identical.
Data-plane modules are imported only when the data plane is enabled.

Rollout fields (one row per sample): ``input_ids`` jagged int64 (prompt + response),
``prompt_len`` int64, ``advantages`` float32, and per-token ``prev_logprobs`` / ``ref_logprobs``
jagged float32 of length ``seq_len - 1`` (position ``t`` scores token ``t + 1``).
"""

from __future__ import annotations

import copy
import time
from collections.abc import Mapping, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from tensordict import TensorDict

from algorithms.faults import InjectedFailure, maybe_fail  # noqa: F401 - InjectedFailure re-exported
from algorithms.metrics import payload_bytes
from nemo_dataplane.codec import jagged_from_rows, jagged_rows
from nemo_dataplane.meta import KVBatchMeta


def pad_float_rows(rows: Sequence[torch.Tensor], length: int) -> torch.Tensor:
    """Right-pad 1-D float rows with 0 to ``[N, length]``."""
    out = torch.zeros(len(rows), length, dtype=torch.float32)
    for i, r in enumerate(rows):
        out[i, : r.numel()] = r
    return out


def model_inputs(mb: TensorDict, pad_id: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``input_ids [n, L]``, ``attention_mask [n, L]``, ``response_mask [n, L]`` for a micro-batch
    with a jagged ``input_ids`` field and a ``prompt_len`` field (response = positions >= prompt_len)."""
    from algorithms.models import pad_batch

    input_ids, attn = pad_batch(jagged_rows(mb["input_ids"]), pad_id)
    pos = torch.arange(input_ids.shape[1]).unsqueeze(0)
    response = (pos >= mb["prompt_len"].reshape(-1, 1)) & attn.bool()
    return input_ids.to(device), attn.to(device), response.to(device)


class PolicyWorker:
    """One policy rank. Construct through Ray (``ray.remote(PolicyWorker)``), then form the
    gradient all-reduce group: rank 0's :meth:`host_rendezvous` ``("train", world_size)`` gives the
    address every rank passes to :meth:`join_train_group` (collective).

    With ``policy.tensor_parallel_size = tp > 1`` (megatron) rank ``r`` is TP rank ``r % tp`` of
    DP replica ``r // tp`` (``algorithms.replicas``): every rank of a replica gets the same
    batch, the TP leader alone reads it from the store and writes results back, gradients are
    summed over the DP group only and their norm combines the TP shards.

    Args:
        rank, world_size: this rank and the number of policy ranks (``dp * tp``).
        cfg: ``TrainerConfig.to_dict()``.
    """

    def __init__(self, rank: int, world_size: int, cfg: Mapping[str, Any]) -> None:
        from algorithms.models import build_model
        from algorithms.tasks import CharTokenizer

        self.rank, self.world_size, self.cfg = rank, world_size, cfg
        torch.set_num_threads(int(cfg["trainer"]["num_threads"]))
        torch.manual_seed(int(cfg["trainer"]["seed"]) * 1000 + rank)
        pcfg = cfg["policy"]
        from algorithms.workers.gpus import worker_device

        self.device = worker_device(pcfg["device"])
        self.timeout_s = float(cfg["trainer"]["step_timeout_s"])
        self.tokenizer = CharTokenizer()
        self.model = build_model(pcfg["model"], vocab_size=self.tokenizer.vocab_size).to(self.device)
        self.ref_model = copy.deepcopy(self.model).eval()
        for p in self.ref_model.parameters():
            p.requires_grad_(False)
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=pcfg["lr"], weight_decay=pcfg["weight_decay"], betas=tuple(pcfg["betas"])
        )
        self.temperature = float(cfg["generation"]["temperature"]) or 1.0
        self.grpo = cfg["grpo"]
        self.debug = cfg["debug"]
        self.backend = str(pcfg.get("backend", "torch"))
        from algorithms.replicas import replica_of

        self.tp = int(pcfg.get("tensor_parallel_size", 1))
        self.dp_rank, self.tp_rank = replica_of(rank, self.tp)
        self._dp_group: Any = None  # None: the whole world (no TP)
        self._tp_group: Any = None
        self._mc_shape: Any = None
        self._stores: dict[str, Any] = {}  # rendezvous stores this rank hosts, by group
        self._fetcher: Any = None
        self._refit_group: Any = None
        self._sender: Any = None

    def _use_megatron(self, tp: int) -> None:
        """Swap the HF model for Megatron-core GPT models converted from it (same weights), on
        Megatron's parallel state over this worker's world (DP = world / TP)."""
        from algorithms.engines.training import megatron as M
        from algorithms.engines.training.mcore_convert import shape_from_hf_config

        torch.cuda.set_device(self.device if self.device.index is not None else torch.cuda.current_device())
        M.init_parallel(tp, seed=int(self.cfg["trainer"]["seed"]))
        hf_cfg, hf_state = self.model.config, self.model.state_dict()
        self._mc_shape = shape_from_hf_config(hf_cfg)
        self.model = M.build_gpt(hf_cfg, device=self.device)
        M.load_hf(self.model, hf_state, self._mc_shape)
        self.ref_model = M.build_gpt(hf_cfg, device=self.device)
        M.load_hf(self.ref_model, hf_state, self._mc_shape)
        self.ref_model.eval()
        for p in self.ref_model.parameters():
            p.requires_grad_(False)
        pcfg = self.cfg["policy"]
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=pcfg["lr"], weight_decay=pcfg["weight_decay"], betas=tuple(pcfg["betas"])
        )

    def _score(self, model: torch.nn.Module, mb: TensorDict, entropy: bool) -> tuple[torch.Tensor, Any, torch.Tensor]:
        """``(logprobs, entropy | None, mask)`` ``[n, L - 1]`` of one micro-batch: the one place
        the backends differ (torch: padded HF forward; megatron: one packed MCore forward)."""
        if self.backend == "megatron":
            from algorithms.engines.training.megatron import microbatch_logprobs

            return microbatch_logprobs(model, mb["input_ids"], mb["prompt_len"], device=self.device,
                                       temperature=self.temperature, return_entropy=entropy)
        from algorithms.models import sequence_logprobs

        ids, attn, resp = model_inputs(mb, self.tokenizer.pad_id, self.device)
        mask = (resp[:, 1:] & attn[:, 1:].bool()).float()
        if entropy:
            lp, ent = sequence_logprobs(model, ids, attn, resp, return_entropy=True, temperature=self.temperature)
            return lp, ent, mask
        return sequence_logprobs(model, ids, attn, resp, temperature=self.temperature), None, mask

    def _named_for_refit(self) -> Any:
        """Weights under HF names (the generator's): the HF model's own, or the MCore model's
        mapped back (views at TP=1, so nothing is gathered or copied here)."""
        if self.backend == "megatron":
            from algorithms.engines.training.megatron import hf_shards

            return hf_shards(self.model, self._mc_shape).items()
        return self.model.named_parameters()

    # ---------------------------------------------------------------- set-up
    def ready(self) -> dict[str, int]:
        """Rank and parameter count, once constructed (the driver waits on it, bounded)."""
        return {"rank": self.rank, "params": sum(p.numel() for p in self.model.parameters())}

    def host_rendezvous(self, group: str, world_size: int, loopback: bool = False) -> tuple[str, int]:
        """Host the rendezvous store of ``group`` (rank 0 of it): listen on this node's address
        only (``127.0.0.1`` when ``loopback``, for runs whose workers all share this node), on a
        port the OS picks while binding it (no other process can take it in between).

        Returns:
            ``(address, port)`` for the group's other members.
        """
        import ray

        from nemo_dataplane.distributed.auth import host_tcp_store

        address = "127.0.0.1" if loopback else ray.util.get_node_ip_address()
        store = host_tcp_store(address, 0, world_size, timedelta(seconds=self.timeout_s))
        self._stores[group] = store
        return address, int(store.port)

    def join_train_group(self, address: str, port: int) -> None:
        """Join the gradient all-reduce group at rank 0's rendezvous (collective over all ranks).

        Its records are authenticated with the job secret (``$NEMO_DATAPLANE_SECRET``, set by the
        trainer through Ray), so a process outside the job cannot forge them."""
        from nemo_dataplane.distributed.auth import authenticated, is_loopback, job_secret

        timeout = timedelta(seconds=self.timeout_s)
        store = self._stores.get("train") or dist.TCPStore(address, port, self.world_size, False, timeout=timeout)
        store = authenticated(store, job_secret(), where=f"policy train group at {address}:{port}",
                              loopback=is_loopback(address))
        self._stores["train"] = store  # the group keeps using it
        dist.init_process_group(
            backend=self.cfg["policy"]["dist_backend"], store=store, rank=self.rank, world_size=self.world_size,
            timeout=timeout,
        )
        if self.backend == "megatron":  # Megatron's parallel state is built over this group
            self._use_megatron(self.tp)
            if self.tp > 1:
                from megatron.core import parallel_state as ps

                self._dp_group = ps.get_data_parallel_group()
                self._tp_group = ps.get_tensor_model_parallel_group()
                got = (ps.get_data_parallel_rank(), ps.get_tensor_model_parallel_rank())
                if got != (self.dp_rank, self.tp_rank):
                    raise RuntimeError(f"policy rank {self.rank}: Megatron placed it at (dp, tp) = {got}, the driver "
                                       f"at {(self.dp_rank, self.tp_rank)}")

    def attach_data_plane(self, data_plane_cfg: Mapping[str, Any]) -> None:
        """Attach to the driver's store (data-plane path only; the legacy path never calls this)."""
        from nemo_dataplane.factory import build_data_plane_client
        from nemo_dataplane.worker.fetch import WorkerFetcher

        client = build_data_plane_client(data_plane_cfg, bootstrap=False)
        # A replica's TP ranks share its rows: the leader fetches and broadcasts (or each fetches,
        # as data_plane.fetch_policy says), only the leader writes back. Without TP every rank is
        # its own replica and leader.
        replica = {"replica_group": self._tp_group} if self._tp_group is not None else {"replica_ranks": [self.rank]}
        self._fetcher = WorkerFetcher(client, fetch_policy=data_plane_cfg.get("fetch_policy", "auto"),
                                      timeout_s=self.timeout_s, **replica)

    def init_refit(self, host: str, port: int, world_size: int, reshard: bool = False) -> None:
        """Join the refit group (collective with the generator): rank 0 as the source of whole
        weights, or with ``reshard`` every TP rank of the first replica (refit rank = TP rank)
        as a ``ReshardSender`` of its shards under HF names, the generator being rank ``tp``."""
        from nemo_dataplane.distributed.stateless_group import StatelessProcessGroup

        rcfg = self.cfg["refit"]
        self._refit_group = StatelessProcessGroup(
            host, port, self.tp_rank if reshard else 0, world_size, backend=rcfg["backend"],
            timeout=rcfg["timeout_s"], group_name="refit",
            store=self._stores.pop("refit", None),  # hosted by host_rendezvous("refit", ...) if it ran
        )
        if reshard:
            from nemo_dataplane.refit import Mesh, build_layout
            from nemo_dataplane.refit.reshard import ReshardSender

            layout = build_layout(Mesh.of(list(range(self.tp)), tp=self.tp), self._refit_full_shapes())
            # Where the shards live, not the group's device: an ipc refit's control group is gloo.
            dev = torch.device("cuda", torch.cuda.current_device()) if self.device.type == "cuda" else self.device
            self._sender = ReshardSender(self._refit_group, self._named_for_refit, layout,
                                         bucket_bytes=max(int(rcfg["bucket_bytes"]), 256),
                                         transport=rcfg.get("transport", "auto"), device=dev)
        else:
            from nemo_dataplane.refit.packed import RefitSender

            self._sender = RefitSender(self._refit_group, self._named_for_refit, bucket_bytes=rcfg["bucket_bytes"])
        self._sender.prepare_refit_info()

    def _refit_full_shapes(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """Full (unsharded) HF shapes of what :meth:`_named_for_refit` yields: the trainer-side
        layout every sender builds identically."""
        if self.backend == "megatron":
            from algorithms.engines.training.megatron import hf_full_shapes

            names = {n for n, _ in self._named_for_refit()}
            return {n: s for n, s in hf_full_shapes(self._mc_shape).items() if n in names}
        return {n: (tuple(p.shape), p.dtype) for n, p in self.model.named_parameters()}

    def send_weights(self, version: int) -> float:
        """Broadcast the current weights to the generator (collective); returns seconds."""
        t0 = time.perf_counter()
        self._sender.send_weights(version)
        return time.perf_counter() - t0

    # ------------------------------------------------------------- batches
    def _maybe_fail(self, phase: str, step: int) -> None:
        maybe_fail(self.debug, phase, step=step, rank=self.rank, what=f"at step {step} on policy rank {self.rank}")

    def _load(self, batch: Any, fields: Sequence[str]) -> tuple[list[TensorDict], list[list[int]], int, int]:
        """Micro-batches, their positions within the shard, shard size, bytes fetched from the store."""
        if isinstance(batch, KVBatchMeta):
            if self._fetcher is None:
                raise RuntimeError(f"policy rank {self.rank}: got a KVBatchMeta but the data plane is not attached")
            fetched = self._fetcher.fetch(batch, list(fields))
            mbs, plan, n = fetched.microbatches, fetched.plan, len(batch)
            nbytes = payload_bytes(fetched.data)
        else:  # a legacy shard, already resolved by Ray
            mbs, plan, n = batch.microbatches(), batch.plan, batch.data.batch_size[0]
            nbytes = 0
        positions = [list(mb) for mb in plan["microbatches"]] if plan and "microbatches" in plan else [list(range(n))]
        return mbs, positions, n, nbytes

    def _logprobs(self, models: Sequence[tuple[torch.nn.Module, str]], batch: Any) -> dict[str, Any]:
        """One fetch, then per-token log-probs of each ``(model, field)``; one write-back of all."""
        t0 = time.perf_counter()
        mbs, positions, n, in_bytes = self._load(batch, ["input_ids", "prompt_len"])
        t_fetch = time.perf_counter() - t0
        rows: dict[str, list[torch.Tensor]] = {f: [torch.empty(0)] * n for _, f in models}
        with torch.no_grad():
            for mb, pos in zip(mbs, positions):
                lens = [r.numel() for r in jagged_rows(mb["input_ids"])]
                for model, f in models:
                    lp = self._score(model, mb, False)[0].float().cpu()
                    for j, p in enumerate(pos):
                        rows[f][p] = lp[j, : int(lens[j]) - 1].clone()
        cols = {f: jagged_from_rows(r) for f, r in rows.items()}
        out: dict[str, Any] = {"compute_s": time.perf_counter() - t0 - t_fetch, "dp_bytes": in_bytes}
        t1 = time.perf_counter()
        if isinstance(batch, KVBatchMeta):
            self._fetcher.write_back(batch, cols)
            out["dp_bytes"] += sum(payload_bytes(c) for c in cols.values())
        else:
            out.update(cols)
        out["io_s"] = t_fetch + time.perf_counter() - t1  # getting the rows + writing results back
        return out

    def get_logprobs(self, batch: Any, step: int, *, with_reference: bool = False) -> dict[str, Any]:
        """Per-token log-probs of the current policy (``prev_logprobs``) for this rank's rows, and
        with ``with_reference`` also the reference's (``ref_logprobs``) from the same fetch.

        Data plane: written back to the store (leader-only), returns timings.
        Legacy: returns ``{"prev_logprobs": jagged [n, seq_len - 1], ...}`` in the shard's order.
        """
        self._maybe_fail("logprobs", step)
        models = [(self.model, "prev_logprobs")] + ([(self.ref_model, "ref_logprobs")] if with_reference else [])
        return self._logprobs(models, batch)

    def step_call(self, kind: str, batch: Any, step: int, flag: bool) -> dict[str, Any]:
        """The compiled graph's one entry (``algorithms.dispatch``): ``kind`` ``logprobs`` is
        :meth:`get_logprobs` with ``with_reference=flag``, ``train`` is :meth:`train` with
        ``behaviour=flag``. A legacy shard arrives as its ``ObjectRef`` (a graph input is not
        resolved by Ray as a task argument is) and is fetched here, bounded."""
        import ray

        if isinstance(batch, ray.ObjectRef):
            from algorithms.legacy_transport import fetch_shard

            batch = fetch_shard(batch, timeout_s=self.timeout_s)
        if kind == "logprobs":
            return self.get_logprobs(batch, step, with_reference=flag)
        if kind == "train":
            return self.train(batch, step, behaviour=flag)
        raise ValueError(f"policy rank {self.rank}: step_call kind must be 'logprobs' or 'train', got {kind!r}")

    def get_reference_logprobs(self, batch: Any, step: int) -> dict[str, Any]:
        """As :meth:`get_logprobs`, from the frozen initial weights, into ``ref_logprobs``."""
        return self._logprobs([(self.ref_model, "ref_logprobs")], batch)

    def train(self, batch: Any, step: int, *, behaviour: bool = False) -> dict[str, float]:
        """``grpo.epochs`` optimizer steps over this rank's rows; returns loss metrics.

        ``behaviour``: the rows carry the sampler's log-probs (``gen_logprobs``) and the loss
        applies the decoupled-PPO correction with ``prev_logprobs`` as the proximal policy
        (``async.is_cap``, ``async.is_mode``); metrics then include ``is_truncated_frac`` and
        ``behaviour_kl``.

        The loss is the token mean over the *whole* step batch (all ranks): each rank's token
        count is all-reduced first, gradients are summed across ranks. Metrics are this rank's
        share with the same denominator, so the driver sums them over ranks.
        """
        from algorithms.grpo import masked_sum, policy_loss

        self._maybe_fail("train", step)
        t0 = time.perf_counter()
        fields = ["input_ids", "prompt_len", "advantages", "prev_logprobs", "ref_logprobs"]
        if behaviour:
            fields.append("gen_logprobs")
        mbs, _, _, in_bytes = self._load(batch, fields)
        t_fetch = time.perf_counter() - t0
        prepared = []
        local_tokens = 0
        for mb in mbs:
            lens = torch.tensor([r.numel() for r in jagged_rows(mb["input_ids"])])
            width = int(lens.max()) - 1
            col = torch.arange(1, width + 1).reshape(1, -1)  # the token each log-prob column scores
            mask = (col >= mb["prompt_len"].reshape(-1, 1)) & (col < lens.reshape(-1, 1))
            mask = mask.float().to(self.device)
            old = pad_float_rows(jagged_rows(mb["prev_logprobs"]), width).to(self.device)
            ref = pad_float_rows(jagged_rows(mb["ref_logprobs"]), width).to(self.device)
            adv = mb["advantages"].float().to(self.device)
            beh = pad_float_rows(jagged_rows(mb["gen_logprobs"]), width).to(self.device) if behaviour else None
            prepared.append((mb, mask, old, ref, adv, beh))
            local_tokens += int(mask.sum().item())
        counts = torch.tensor([float(local_tokens)], dtype=torch.float64, device=self.device)
        dist.all_reduce(counts, group=self._dp_group)  # a replica's TP ranks hold the same rows
        global_tokens = max(float(counts.item()), 1.0)
        sums = {"loss": 0.0, "pg_loss": 0.0, "kl": 0.0, "clip_frac": 0.0, "entropy": 0.0}
        if behaviour:
            sums.update(is_truncated_frac=0.0, behaviour_kl=0.0)
        acfg = self.cfg["async"]
        grad_norm = 0.0
        epochs = int(self.grpo["epochs"])
        for epoch in range(epochs):
            self.optimizer.zero_grad(set_to_none=False)
            last = epoch == epochs - 1
            for mb, mask, old, ref, adv, beh in prepared:
                lp, ent, _ = self._score(self.model, mb, True)
                loss, m = policy_loss(
                    lp, old, ref, adv, mask, clip_eps=self.grpo["clip_eps"], kl_coef=self.grpo["kl_coef"],
                    loss_agg=self.grpo["loss_agg"], global_token_count=global_tokens,
                    behaviour_logprobs=beh, is_cap=float(acfg["is_cap"]), is_mode=acfg["is_mode"],
                )
                loss.backward()
                if last:
                    sums["loss"] += float(loss.detach())
                    for k in ("pg_loss", "kl", "clip_frac", *(("is_truncated_frac", "behaviour_kl") if behaviour else ())):
                        sums[k] += float(m[k])
                    sums["entropy"] += float(masked_sum(ent.detach(), mask)) / global_tokens
            grad_norm = self._all_reduce_and_step()
        return {
            **sums,
            "grad_norm": grad_norm,
            "tokens": float(local_tokens),
            "io_s": t_fetch,
            "compute_s": time.perf_counter() - t0 - t_fetch,
            "dp_bytes": float(in_bytes),
        }

    def _all_reduce_and_step(self) -> float:
        params = [p for p in self.model.parameters() if p.requires_grad]
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        flat = torch.cat([g.reshape(-1) for g in grads])
        # Sum over DP replicas (the loss is already divided by the global token count).
        dist.all_reduce(flat, group=self._dp_group)
        off = 0
        for p, g in zip(params, grads):
            n = g.numel()
            p.grad = flat[off : off + n].view_as(p).clone()
            off += n
        max_norm = float(self.cfg["policy"]["max_grad_norm"])
        if self._tp_group is not None:
            norm = self._clip_tp(params, max_norm)
        elif max_norm > 0:
            norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        else:
            norm = torch.linalg.vector_norm(flat)
        self.optimizer.step()
        return float(norm)

    def _clip_tp(self, params: Sequence[torch.nn.Parameter], max_norm: float) -> torch.Tensor:
        """The whole model's gradient norm from TP shards (a TP-split parameter contributes its
        shard on every TP rank, a replicated one once), then ``clip_grad_norm_``'s scaling."""
        sq = torch.zeros((), dtype=torch.float32, device=self.device)
        for p in params:
            if getattr(p, "tensor_model_parallel", False) or self.tp_rank == 0:
                sq += p.grad.float().pow(2).sum()
        dist.all_reduce(sq, group=self._tp_group)
        norm = sq.sqrt()
        if max_norm > 0:
            coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
            for p in params:
                p.grad.mul_(coef.to(p.grad.dtype))
        return norm

    # ------------------------------------------------------------ checkpoint
    def _state_file(self) -> str:
        # One file per TP shard (Megatron's local state dicts differ per TP rank).
        return "policy.pt" if self.tp == 1 else f"policy_tp{self.tp_rank}.pt"

    def save_checkpoint(self, path: str) -> None:
        """The first replica's ranks write model, reference and optimizer state (one file per
        TP rank); every rank its RNG state."""
        d = Path(path)
        d.mkdir(parents=True, exist_ok=True)
        if self.dp_rank == 0:
            torch.save(
                {"model": self.model.state_dict(), "ref_model": self.ref_model.state_dict(),
                 "optimizer": self.optimizer.state_dict()},
                d / self._state_file(),
            )
        rng = {"torch": torch.get_rng_state()}
        if torch.cuda.is_available():
            rng["cuda"] = torch.cuda.get_rng_state_all()
        torch.save(rng, d / f"rng_rank{self.rank}.pt")
        dist.barrier()

    def load_checkpoint(self, path: str) -> None:
        """Every rank loads its TP rank's model/optimizer state and its own RNG state."""
        from algorithms.checkpoint import load_trusted

        d = Path(path)
        state = load_trusted(d / self._state_file(), map_location=self.device)
        self.model.load_state_dict(state["model"])
        self.ref_model.load_state_dict(state["ref_model"])
        self.optimizer.load_state_dict(state["optimizer"])
        rng_file = d / f"rng_rank{self.rank}.pt"
        if rng_file.exists():
            rng = load_trusted(rng_file)
            torch.set_rng_state(rng["torch"])
            if "cuda" in rng and torch.cuda.is_available():
                torch.cuda.set_rng_state_all(rng["cuda"])

    def loaded_modules(self) -> list[str]:
        """Names in this process's ``sys.modules`` under ``nemo_dataplane``/``transfer_queue``
        (the architecture test checks the legacy path never loads the data-plane client)."""
        import sys

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
