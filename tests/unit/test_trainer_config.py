"""Trainer config: YAML + dotted overrides -> validated TrainerConfig, errors name the dotted key."""

from __future__ import annotations

from pathlib import Path

import pytest

from algorithms.config import ConfigError, TrainerConfig, load_config

REPO = Path(__file__).resolve().parents[2]
YAML = REPO / "examples" / "configs" / "grpo_tiny.yaml"


def test_shipped_config_loads_and_runs_on_the_data_plane() -> None:
    cfg = load_config(YAML)
    assert cfg.data_plane.enabled is True
    assert cfg.data_plane.backend == "transfer_queue"
    assert cfg.trainer.dp_size == 2
    assert cfg.refit.backend == "gloo"
    assert cfg.policy.model.get("hf_config") or cfg.policy.model.get("path")


def test_overrides_are_typed_and_win_over_the_yaml() -> None:
    cfg = load_config(YAML, ["trainer.steps=3", "grpo.kl_coef=0.05", "data_plane.enabled=false",
                             "data_plane.packing.micro_batch_size=2", "task.reward_fn=mypkg.rewards:score"])
    assert cfg.trainer.steps == 3 and isinstance(cfg.trainer.steps, int)
    assert cfg.grpo.kl_coef == 0.05
    assert cfg.data_plane.enabled is False
    assert cfg.data_plane.packing.micro_batch_size == 2
    assert cfg.task.reward_fn == "mypkg.rewards:score"


def test_an_int_is_accepted_for_a_float_key() -> None:
    cfg = load_config(YAML, ["policy.lr=1"])
    assert cfg.policy.lr == 1.0 and isinstance(cfg.policy.lr, float)


@pytest.mark.parametrize(
    ("override", "needle"),
    [
        ("grpo.kl_coeff=0.1", "grpo.kl_coeff"),  # unknown key
        ("trainer.stepz=3", "trainer.stepz"),
        ("bogus.section=1", "bogus"),
        ("trainer.steps=abc", "trainer.steps"),  # wrong type
        ("trainer.steps=1.5", "trainer.steps"),
        ("data_plane.enabled=maybe", "data_plane.enabled"),
        ("refit.backend=mpi", "refit.backend"),  # not an allowed value
        ("trainer.steps=0", "trainer.steps"),  # out of range
        ("grpo.clip_eps=-0.1", "grpo.clip_eps"),
        ("refit.timeout_s=0", "refit.timeout_s"),
        ("trainer.dp_size=1000", "trainer.dp_size"),  # cannot feed the ranks
        ("data_plane.packing.micro_batch_size=0", "data_plane.packing.micro_batch_size"),
        ("data_plane.fetch_polcy=auto", "data_plane.fetch_polcy"),
        ("task.reward_fn=no_colon", "task.reward_fn"),
        ("refit.backend=nccl", "refit.backend=nccl"),  # needs cuda devices
        ("debug.fail_in=train", "debug.fail_at_step"),
        ("policy.model.path=/nonexistent/model", "policy.model.hf_config=null"),  # both given
        ("generation.backend=sglang", "generation.backend"),
        ("generation.top_p=0", "generation.top_p"),
        ("generation.top_p=0.9", "generation.backend=vllm"),  # the hf sampler has no top-p
        ("generation.vllm.kv_cache_memory_bytes=0", "generation.vllm.kv_cache_memory_bytes"),
        ("generation.vllm.dtype=int8", "generation.vllm.dtype"),
        ("generation.vllm.multiproc=true", "generation.vllm.multiproc"),
    ],
)
def test_bad_values_name_the_dotted_key(override: str, needle: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(YAML, [override])
    assert needle in str(info.value)


def test_malformed_override_is_rejected() -> None:
    with pytest.raises(ConfigError, match="dotted.key=value"):
        load_config(YAML, ["trainer.steps"])


def test_missing_config_file_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="nope.yaml"):
        load_config(tmp_path / "nope.yaml")


def test_vllm_backend_settings_load() -> None:
    cfg = load_config(YAML, ["generation.backend=vllm", "generation.top_p=0.9", "generation.vllm.multiprocessing=true",
                             "generation.vllm.kv_cache_memory_bytes=1048576"])
    assert cfg.generation.backend == "vllm" and cfg.generation.top_p == 0.9
    assert cfg.generation.vllm.multiprocessing is True and cfg.generation.vllm.kv_cache_memory_bytes == 1 << 20
    assert load_config(YAML).generation.backend == "hf", "hf stays the default"


def test_dict_round_trip_is_lossless() -> None:
    cfg = load_config(YAML, ["trainer.steps=7", "debug.fail_at_step=2", "debug.fail_in=collect"])
    assert TrainerConfig.from_dict(cfg.to_dict()) == cfg


def test_dataset_path_must_exist_and_jsonl_is_accepted(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="task.dataset"):
        load_config(YAML, [f"task.dataset={tmp_path / 'missing.jsonl'}"])
    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": "1=", "answer": "2"}\n')
    assert load_config(YAML, [f"task.dataset={data}"]).task.dataset == str(data)


def test_cli_returns_2_and_names_the_key_on_a_bad_config(capsys: pytest.CaptureFixture[str]) -> None:
    from algorithms.grpo_sync import main

    assert main(["--config", str(YAML), "grpo.nope=1"]) == 2
    assert "grpo.nope" in capsys.readouterr().err


def test_model_path_must_be_a_local_hf_dir(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="policy.model.path=.*no config.json"):
        load_config(YAML, [f"policy.model.path={tmp_path}", "policy.model.hf_config=null"])
    (tmp_path / "config.json").write_text("{}")
    cfg = load_config(YAML, [f"policy.model.path={tmp_path}", "policy.model.hf_config=null"])
    assert cfg.policy.model["path"] == str(tmp_path)


def test_the_gpu_layout_validates() -> None:
    cfg = load_config(YAML, ["policy.device=cuda", "generation.device=cuda", "refit.backend=nccl",
                             "trainer.dp_size=1"])
    assert (cfg.policy.device, cfg.generation.device, cfg.refit.backend) == ("cuda", "cuda", "nccl")
    with pytest.raises(ConfigError, match="policy.dist_backend=nccl needs policy.device=cuda"):
        load_config(YAML, ["policy.dist_backend=nccl"])
