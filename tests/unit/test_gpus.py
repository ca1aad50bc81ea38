"""``algorithms.workers.gpus.worker_device`` off the GPU paths (the GPU path runs in the trainer's
GPU runs, ``benchmarks/bench_megatron.py``)."""

from __future__ import annotations

import pytest
import torch

from algorithms.workers.gpus import ALL_GPUS_ENV, worker_device


def test_cpu_workers_stay_on_cpu_whatever_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ALL_GPUS_ENV, "1")
    assert worker_device("cpu") == torch.device("cpu")


def test_without_all_gpus_visible_cuda_is_rays_narrowed_device(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ALL_GPUS_ENV, raising=False)
    dev = worker_device("cuda")
    assert dev.type == "cuda" and dev.index is None  # Ray's CUDA_VISIBLE_DEVICES picked the GPU


def test_all_gpus_visible_without_a_ray_gpu_names_the_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    import ray

    monkeypatch.setenv(ALL_GPUS_ENV, "1")
    monkeypatch.setattr(ray, "get_gpu_ids", lambda: [])  # an actor that asked Ray for no GPU
    with pytest.raises(RuntimeError, match=f"{ALL_GPUS_ENV}=1 but Ray assigned this actor no GPU"):
        worker_device("cuda")
