"""``algorithms.workers.gpus.worker_device`` off the GPU paths (CUDA calls stubbed where a GPU
would be needed; the GPU path runs in the trainer's GPU runs, ``benchmarks/bench_megatron.py``)."""

from __future__ import annotations

import os

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


def test_own_first_puts_the_assigned_gpu_first_and_keeps_the_others_visible(monkeypatch: pytest.MonkeyPatch) -> None:
    import ray

    monkeypatch.setenv(ALL_GPUS_ENV, "1")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2")
    monkeypatch.setattr(ray, "get_gpu_ids", lambda: [1])  # a colocated engine in GPU 1's bundle
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    current: list[int] = []
    monkeypatch.setattr(torch.cuda, "set_device", current.append)
    assert worker_device("cuda", own_first=True) == torch.device("cuda", 0)
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "1,0,2" and current == [0]
    monkeypatch.setattr(ray, "get_gpu_ids", lambda: [5])
    with pytest.raises(RuntimeError, match="Ray assigned GPU 5, which CUDA_VISIBLE_DEVICES='1,0,2' does not list"):
        worker_device("cuda", own_first=True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    with pytest.raises(RuntimeError, match="after CUDA was initialised"):
        worker_device("cuda", own_first=True)
