"""Refit receiver inside vLLM's worker: a worker extension (``worker_extension_cls``) reached
through ``LLM.collective_rpc``.

The methods run in the process that holds the model, whether that is the generator itself
(in-process engine) or vLLM's worker process (multiprocess engine, or a GPU worker). There the
weights arrive over the project's ``StatelessProcessGroup`` + ``RefitReceiver`` (gloo on CPU,
NCCL or CUDA IPC on GPU) into staging tensors laid out like the trainer's parameters, and are
installed with the worker's ``reload_weights(..., is_checkpoint_format=True)``: the model's own
``load_weights`` maps the checkpoint names onto vLLM's fused parameters (qkv, gate_up) and
re-runs the post-load processing (the CPU backend repacks linear weights after loading, so a
second plain ``load_weights`` would fail).

Names are prefixed ``ndp_``: vLLM refuses an extension method that shadows a worker attribute
(its CPU worker already has ``update_weights``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from algorithms.engines.generation.base import RefitSpec
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

    def ndp_refit_init(
        self,
        specs: Sequence[tuple[str, Sequence[int], str]],
        host: str,
        port: int,
        world_size: int,
        rank: int,
        spec: RefitSpec | Mapping[str, Any],
    ) -> None:
        """Allocate staging tensors ``specs`` (name, shape, dtype name: the trainer's parameters,
        whole) on the worker's device, join the refit group as receiver ``rank`` and agree on the
        layout with the senders, group ranks ``0..spec.senders-1`` (collective), through the
        weight-transfer facade (``spec.transfer``: whichever family the trainer sends with)."""
        spec = RefitSpec.from_dict(spec)  # a multiprocess engine's RPC delivers plain values
        self.ndp_refit_close()
        # The worker's own device: a CUDA worker's refit is NCCL or CUDA IPC (a gloo group then
        # carries control only), both of which write GPU tensors; a CPU worker's is gloo.
        device = torch.device(self.device)  # type: ignore[attr-defined]
        staging = {
            name: torch.empty(
                check_shape(shape, f"param {name!r} shape"),
                dtype=dtype_from_name(dtype, f"param {name!r} dtype"),
                device=device,
            )
            for name, shape, dtype in specs
        }
        group = spec.join(host, port, world_size, rank, device)
        try:
            receiver = build_weight_receiver(spec.transfer, group, staging, senders=spec.senders, device=device)
            receiver.prepare_refit_info()
        except BaseException:
            group.destroy()
            raise
        self._ndp_group, self._ndp_receiver, self._ndp_staging = group, receiver, staging

    def ndp_refit_receive(self) -> int:
        """Receive one refit into the staging tensors, install it through the model's loader;
        returns the refit's version."""
        if self._ndp_receiver is None or self._ndp_staging is None:
            raise RuntimeError("ndp_refit_receive() before ndp_refit_init()")
        version = int(self._ndp_receiver.receive_weights())
        self.reload_weights(  # type: ignore[attr-defined]  # the vLLM worker this class is mixed into
            weights_iterator=iter(list(self._ndp_staging.items())),
            is_checkpoint_format=True,
        )
        return version

    def ndp_refit_close(self) -> None:
        """Leave the refit group and free the staging tensors (idempotent)."""
        group, self._ndp_group = self._ndp_group, None
        self._ndp_receiver = self._ndp_staging = None
        if group is not None:
            try:
                group.destroy()
            except Exception:  # noqa: BLE001 - shutting down
                pass
