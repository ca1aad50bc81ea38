"""Refit receiver inside vLLM's worker: a worker extension (``worker_extension_cls``) reached
through ``LLM.collective_rpc``.

The methods run in the process that holds the model, whether that is the generator itself
(in-process engine) or vLLM's worker process (multiprocess engine, or a GPU worker). There the
weights arrive over the project's ``StatelessProcessGroup`` + ``RefitReceiver`` (gloo on CPU,
NCCL or CUDA IPC on GPU). An engine of one TP rank receives into staging tensors laid out like
the trainer's parameters, which are
installed with the worker's ``reload_weights(..., is_checkpoint_format=True)``: the model's own
``load_weights`` maps the checkpoint names onto vLLM's fused parameters (qkv, gate_up) and
re-runs the post-load processing (the CPU backend repacks linear weights after loading, so a
second plain ``load_weights`` would fail). An engine of several TP ranks (GPU only, unquantized)
receives each rank's shards straight into vLLM's parameters (:mod:`.tp_shards`): nothing to
re-process, and no rank holds a whole copy.

Names are prefixed ``ndp_``: vLLM refuses an extension method that shadows a worker attribute
(its CPU worker already has ``update_weights``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from algorithms.engines.generation.base import RefitSpec
from algorithms.engines.generation.tp_shards import ShardTargets, shard_targets
from nemo_dataplane.distributed.stateless_group import StatelessProcessGroup
from nemo_dataplane.dtypes import check_shape, dtype_from_name
from nemo_dataplane.refit import WeightReceiver, build_weight_receiver

__all__ = ["RefitWorkerExtension", "WORKER_EXTENSION"]

WORKER_EXTENSION = f"{__name__}.RefitWorkerExtension"


class RefitWorkerExtension:
    """Mixed into vLLM's worker class; ``self`` is the worker (``self.device``, ``self.reload_weights``)."""

    _ndp_group: StatelessProcessGroup | None = None
    _ndp_receiver: WeightReceiver | None = None
    _ndp_staging: dict[str, torch.Tensor] | None = None
    _ndp_shards_of: ShardTargets | None = None  # set when each TP rank receives its shards

    def ndp_refit_init(
        self,
        specs: Sequence[tuple[str, Sequence[int], str]],
        host: str,
        port: int,
        world_size: int,
        rank: int,
        spec: RefitSpec | Mapping[str, Any],
    ) -> None:
        """Join the refit group and agree on the layout with the senders, group ranks
        ``0..spec.senders-1`` (collective), through the weight-transfer facade (``spec.transfer``:
        whichever family the trainer sends with). ``specs``: the trainer's parameters (name,
        whole shape, dtype name).

        One TP rank (``spec.tensor_parallel`` 1): joins as ``rank`` and receives whole tensors
        into staging on the worker's device, installed through the model's loader. Several: this
        worker's TP rank ``t`` joins as ``rank + t`` and receives only its shards, into vLLM's own
        parameters (:mod:`.tp_shards`)."""
        spec = RefitSpec.from_dict(spec)  # a multiprocess engine's RPC delivers plain values
        self.ndp_refit_close()
        # The worker's own device: a CUDA worker's refit is NCCL or CUDA IPC (a gloo group then
        # carries control only), both of which write GPU tensors; a CPU worker's is gloo.
        device = torch.device(self.device)  # type: ignore[attr-defined]
        shards: ShardTargets | None = None
        if spec.tensor_parallel > 1:
            shards = self._ndp_shards(specs, world_size, rank, spec, device)
            rank, tensors = shards.rank, shards.tensors
        else:
            tensors = {
                name: torch.empty(
                    check_shape(shape, f"param {name!r} shape"),
                    dtype=dtype_from_name(dtype, f"param {name!r} dtype"),
                    device=device,
                )
                for name, shape, dtype in specs
            }
        group = spec.join(host, port, world_size, rank, device)
        try:
            receiver = build_weight_receiver(
                spec.transfer,
                group,
                tensors,
                senders=spec.senders,
                device=device,
                shards=None if shards is None else shards.layout,
            )
            receiver.prepare_refit_info()
        except BaseException:
            group.destroy()
            raise
        self._ndp_group, self._ndp_receiver, self._ndp_staging = group, receiver, tensors
        self._ndp_shards_of = shards

    def _ndp_shards(
        self,
        specs: Sequence[tuple[str, Sequence[int], str]],
        world_size: int,
        first_rank: int,
        spec: RefitSpec,
        device: torch.device,
    ) -> ShardTargets:
        from vllm.distributed.parallel_state import (  # the worker's own TP group
            get_tensor_model_parallel_rank,
            get_tensor_model_parallel_world_size,
        )

        tp = get_tensor_model_parallel_world_size()
        if tp != spec.tensor_parallel:
            raise RuntimeError(
                f"the refit expects engines of {spec.tensor_parallel} TP ranks, this vLLM engine has {tp}"
            )
        model = self.get_model()  # type: ignore[attr-defined]  # the vLLM worker this class is mixed into
        return shard_targets(
            specs,
            dict(model.named_parameters()),
            senders=spec.senders,
            world_size=world_size,
            first_rank=first_rank,
            tp_rank=get_tensor_model_parallel_rank(),
            tp=tp,
            device=device,
        )

    def ndp_refit_receive(self) -> int:
        """Receive one refit and install it (whole tensors: through the model's loader; TP
        shards: already in place, staged ones copied in); returns the refit's version."""
        if self._ndp_receiver is None or self._ndp_staging is None:
            raise RuntimeError("ndp_refit_receive() before ndp_refit_init()")
        version = int(self._ndp_receiver.receive_weights())
        if self._ndp_shards_of is not None:
            self._ndp_shards_of.install()
            if torch.device(self.device).type == "cuda":  # type: ignore[attr-defined]
                # The next generation may run on another stream than the one the copies were queued on.
                torch.cuda.current_stream().synchronize()
            return version
        self.reload_weights(  # type: ignore[attr-defined]  # the vLLM worker this class is mixed into
            weights_iterator=iter(list(self._ndp_staging.items())),
            is_checkpoint_format=True,
        )
        return version

    def ndp_refit_received(self) -> int:
        """Bytes this worker's refit tensors hold (what each refit brings it; a TP rank's shards)."""
        return sum(t.numel() * t.element_size() for t in (self._ndp_staging or {}).values())

    def ndp_refit_close(self) -> None:
        """Leave the refit group and free the staging tensors (idempotent)."""
        group, self._ndp_group = self._ndp_group, None
        self._ndp_receiver = self._ndp_staging = None
        self._ndp_shards_of = None
        if group is not None:
            try:
                group.destroy()
            except Exception:  # noqa: BLE001 - shutting down
                pass
