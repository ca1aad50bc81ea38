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

from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["RefitWorkerExtension", "WORKER_EXTENSION"]

WORKER_EXTENSION = f"{__name__}.RefitWorkerExtension"


class RefitWorkerExtension:
    """Mixed into vLLM's worker class; ``self`` is the worker (``self.device``, ``self.reload_weights``)."""

    _ndp_group: Any = None
    _ndp_receiver: Any = None
    _ndp_staging: dict[str, torch.Tensor] | None = None

    def ndp_refit_init(self, specs: Sequence[tuple[str, Sequence[int], str]], host: str, port: int,
                       world_size: int, rank: int, backend: str, timeout_s: float, reshard: bool = False) -> None:
        """Allocate staging tensors ``specs`` (name, shape, dtype name: the trainer's parameters,
        whole), join the refit group and agree on the layout with the sender(s) (collective):
        policy rank 0's whole tensors (``RefitReceiver``), or with ``reshard`` the trainer's TP
        shards from refit ranks ``0..rank-1`` (``ReshardReceiver`` into the staging as one TP=1
        rank; an NCCL group or CUDA IPC keeps the staging on the worker's GPU)."""
        from nemo_dataplane.distributed.stateless_group import StatelessProcessGroup
        from nemo_dataplane.dtypes import check_shape, dtype_from_name

        self.ndp_refit_close()
        own = torch.device(self.device)  # type: ignore[attr-defined]
        device = own if backend == "nccl" or (reshard and own.type == "cuda") else torch.device("cpu")
        staging = {name: torch.empty(check_shape(shape, f"param {name!r} shape"),
                                     dtype=dtype_from_name(dtype, f"param {name!r} dtype"), device=device)
                   for name, shape, dtype in specs}
        group = StatelessProcessGroup(host, port, rank, world_size, backend=backend, timeout=timeout_s,
                                      device=device if backend == "nccl" else None, group_name="refit")
        try:
            if reshard:
                from algorithms.engines.generation.base import GenerationEngine

                receiver: Any = GenerationEngine.reshard_receiver(group, staging, device)
            else:
                from nemo_dataplane.refit.packed import RefitReceiver

                receiver = RefitReceiver(group, staging, src=0)
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
        self.reload_weights(weights_iterator=iter(list(self._ndp_staging.items())),  # type: ignore[attr-defined]
                            is_checkpoint_format=True)
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
