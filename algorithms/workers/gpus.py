"""Which GPU a worker actor uses.

Ray normally narrows each GPU actor's ``CUDA_VISIBLE_DEVICES`` to the GPU(s) it was given, so
every actor sees its GPU as ``cuda:0``. A CUDA IPC refit needs more: a sender opens the
generator's memory, so it must see the generator's GPU too (``nemo_dataplane.refit.cuda.ipc``
refuses otherwise, naming ``CUDA_VISIBLE_DEVICES``). For that layout the trainer starts the
policy and generator actors with :data:`ALL_GPUS_ENV` set (every GPU visible) and each actor
makes the GPU Ray assigned it current (:func:`worker_device`).
"""

from __future__ import annotations

import os

import ray
import torch

# Ray's own switch: when "1" in an actor's environment, Ray leaves CUDA_VISIBLE_DEVICES alone.
ALL_GPUS_ENV = "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"


def worker_device(kind: str, *, own_first: bool = False) -> torch.device:
    """The device of a worker configured with ``kind`` (``"cpu"`` or ``"cuda"``). With every GPU
    visible, the GPU Ray assigned this actor becomes the current one and is returned by index;
    otherwise ``cuda`` (Ray's narrowing already made the right GPU the only one).

    ``own_first`` (every GPU visible; call before this process initialises CUDA): the assigned
    GPU is put first in ``CUDA_VISIBLE_DEVICES``, the others after it, and ``cuda:0`` is returned:
    for a library that takes the first GPU it sees (vLLM's in-process worker) in a process that
    must still see its peers' GPUs (their CUDA IPC events)."""
    if kind != "cuda":
        return torch.device("cpu")
    if os.environ.get(ALL_GPUS_ENV) == "1":
        ids = ray.get_gpu_ids()
        if not ids:
            raise RuntimeError(f"{ALL_GPUS_ENV}=1 but Ray assigned this actor no GPU (ask for num_gpus > 0)")
        if own_first:
            return _own_gpu_first(str(ids[0]))
        index = int(ids[0])
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    return torch.device("cuda")


def _own_gpu_first(own: str) -> torch.device:
    if torch.cuda.is_initialized():
        raise RuntimeError("worker_device(own_first=True) after CUDA was initialised: the GPU order is fixed by then")
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    order = visible.split(",") if visible else [str(i) for i in range(torch.cuda.device_count())]
    if own not in order:
        raise RuntimeError(f"Ray assigned GPU {own}, which CUDA_VISIBLE_DEVICES={visible!r} does not list")
    os.environ["CUDA_VISIBLE_DEVICES"] = ",".join([own, *(d for d in order if d != own)])
    torch.cuda.set_device(0)
    return torch.device("cuda", 0)
