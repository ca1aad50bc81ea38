"""Trainer config: YAML + dotted overrides -> validated TrainerConfig, errors name the dotted key."""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

import pytest

from algorithms.config import ConfigError, TrainerConfig, check_devices, load_config

REPO = Path(__file__).resolve().parents[2]
YAML = REPO / "examples" / "configs" / "grpo_tiny.yaml"
sys.path.insert(0, str(Path(__file__).parent))  # the test backends (_backends.py) by path


def test_shipped_config_loads_and_runs_on_the_data_plane() -> None:
    cfg = load_config(YAML)
    assert cfg.data_plane.enabled is True
    assert cfg.data_plane.backend == "transfer_queue"
    assert cfg.trainer.dp_size == 2
    assert cfg.refit.backend == "gloo"
    assert cfg.policy.model.get("hf_config") or cfg.policy.model.get("path")


def test_overrides_are_typed_and_win_over_the_yaml() -> None:
    cfg = load_config(
        YAML,
        [
            "trainer.steps=3",
            "grpo.kl_coef=0.05",
            "data_plane.enabled=false",
            "data_plane.packing.micro_batch_size=2",
            "task.reward_fn=mypkg.rewards:score",
        ],
    )
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
        ("trainer.dispatch=compiled", "trainer.dispatch"),
        ("trainer.dispatch_idle_teardown_s=0", "trainer.dispatch_idle_teardown_s"),
        ("trainer.dispatch_idle_teardown_s=-5", "trainer.dispatch_idle_teardown_s"),
        ("trainer.dispatch_idle_teardown_s=soon", "trainer.dispatch_idle_teardown_s"),
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
        ("trainer.step_timeout_s=.nan", "trainer.step_timeout_s must be a finite number"),  # non-finite
        ("trainer.startup_timeout_s=.inf", "trainer.startup_timeout_s must be a finite number"),
        ("async.claim_poll_s=nan", "async.claim_poll_s"),
        ("policy.lr=-.inf", "policy.lr"),
        ("data_plane.transfer_queue.op_timeout_s=.inf", "data_plane.transfer_queue.op_timeout_s"),
        ("policy.gpus_per_rank=2.5", "policy.gpus_per_rank=2.5: above 1 it must be whole"),
        ("async.max_staleness=-1", "async.max_staleness must be >= 0"),
    ],
)
def test_bad_values_name_the_dotted_key(override: str, needle: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(YAML, [override])
    assert needle in str(info.value)


def test_dispatch_defaults_to_actor_calls_and_accepts_the_compiled_graph() -> None:
    assert load_config(YAML).trainer.dispatch == "actors"
    cfg = load_config(YAML, ["trainer.dispatch=compiled_graph", "debug.fail_dispatch_compile=true"])
    assert (cfg.trainer.dispatch, cfg.debug.fail_dispatch_compile) == ("compiled_graph", True)
    assert cfg.trainer.dispatch_idle_teardown_s == 30.0  # bounds an idle graph's polling by default
    cfg = load_config(YAML, ["trainer.dispatch=compiled_graph", "trainer.dispatch_idle_teardown_s=null"])
    assert cfg.trainer.dispatch_idle_teardown_s is None  # null: the graph stays up until shutdown
    assert load_config(YAML, ["trainer.dispatch_idle_teardown_s=5"]).trainer.dispatch_idle_teardown_s == 5.0


def test_malformed_override_is_rejected() -> None:
    with pytest.raises(ConfigError, match="dotted.key=value"):
        load_config(YAML, ["trainer.steps"])


def test_missing_config_file_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="nope.yaml"):
        load_config(tmp_path / "nope.yaml")


def test_vllm_backend_settings_load() -> None:
    cfg = load_config(
        YAML,
        [
            "generation.backend=vllm",
            "generation.top_p=0.9",
            "generation.vllm.multiprocessing=true",
            "generation.vllm.kv_cache_memory_bytes=1048576",
        ],
    )
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
    cfg = load_config(YAML, ["policy.device=cuda", "generation.device=cuda", "refit.backend=nccl", "trainer.dp_size=1"])
    assert (cfg.policy.device, cfg.generation.device, cfg.refit.backend) == ("cuda", "cuda", "nccl")
    with pytest.raises(ConfigError, match="policy.dist_backend=nccl needs policy.device=cuda"):
        load_config(YAML, ["policy.dist_backend=nccl"])


@pytest.mark.parametrize(
    ("overrides", "needle"),
    [
        (["policy.backend=jax"], "policy.backend"),
        (["policy.tensor_parallel_size=2"], "policy.tensor_parallel_size=2 needs policy.backend=megatron"),
        (["policy.backend=megatron"], "policy.backend=megatron needs policy.device=cuda"),
        (["policy.tensor_parallel_size=0"], "policy.tensor_parallel_size must be > 0"),
    ],
)
def test_policy_backend_is_validated(overrides: list[str], needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        load_config(YAML, overrides)


@pytest.mark.parametrize(
    ("overrides", "needle"),
    [
        (["policy.sharding=zero3"], "policy.sharding"),
        (["policy.sharding=fsdp", "refit.mode=packed"], "policy.sharding=fsdp needs refit.mode=reshard"),
        (
            ["policy.sharding=fsdp", "policy.backend=megatron", "policy.device=cuda", "generation.device=cuda"],
            "policy.sharding=fsdp needs policy.backend=torch",
        ),
        (
            [
                "policy.activation_checkpointing=true",
                "policy.backend=megatron",
                "policy.device=cuda",
                "generation.device=cuda",
                "refit.backend=nccl",
            ],
            "policy.activation_checkpointing=true needs policy.backend=torch",
        ),
        (["policy.lr_warmup_steps=-1"], "policy.lr_warmup_steps must be >= 0"),
        (["grpo.kl_clamp=0"], "grpo.kl_clamp must be > 0"),
        (["grpo.kl_clamp=-1.5"], "grpo.kl_clamp must be > 0"),
    ],
)
def test_sharding_and_stability_keys_are_validated_naming_the_key(overrides: list[str], needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        load_config(YAML, overrides)


def test_fsdp_sends_every_ranks_shards_through_the_resharding_refit() -> None:
    cfg = load_config(YAML, ["policy.sharding=fsdp", "trainer.dp_size=3", "grpo.prompts_per_step=6"])
    assert cfg.fully_sharded and cfg.refit_mode == "reshard" and cfg.refit_senders == 3
    assert cfg.weight_transfer.family == "reshard" and cfg.weight_transfer.sender_layout == "fsdp"
    plain = load_config(YAML, [])
    assert not plain.fully_sharded and plain.refit_senders == 1 and plain.weight_transfer.sender_layout == "tp"
    assert load_config(YAML, ["grpo.kl_clamp=null"]).grpo.kl_clamp is None
    fp8 = [
        "policy.device=cuda",
        "policy.dist_backend=nccl",
        "policy.gpus_per_rank=1",
        "generation.device=cuda",
        "generation.backend=vllm",
        "policy.precision=bf16",
    ]
    with pytest.raises(ConfigError, match=r"trainer.dp_size with policy.sharding=fsdp"):
        from algorithms.refit_weights import check_quantization

        check_quantization(
            load_config(
                YAML, [*fp8, "policy.sharding=fsdp", "refit.transport=ipc", "generation.vllm.quantization=fp8"]
            ),
            "bfloat16",
        )


def test_megatron_backend_accepted_on_cuda() -> None:
    cfg = load_config(
        YAML,
        [
            "policy.backend=megatron",
            "policy.device=cuda",
            "policy.dist_backend=nccl",
            "policy.gpus_per_rank=1",
            "generation.device=cuda",
            "refit.backend=nccl",
        ],
    )
    assert cfg.policy.backend == "megatron" and cfg.policy.tensor_parallel_size == 1
    assert cfg.refit_mode == "packed" and cfg.policy_ranks == cfg.trainer.dp_size


def test_megatron_tp_layouts() -> None:
    """TP=2 takes dp*tp ranks and the reshard refit; one GPU for all of it needs gloo for the TP
    collectives and an IPC refit into a generator that shares the GPU."""
    from algorithms.config import check_devices

    one_gpu = [
        "policy.backend=megatron",
        "policy.device=cuda",
        "policy.tensor_parallel_size=2",
        "trainer.dp_size=1",
        "generation.device=cuda",
        "generation.num_gpus=0.5",
        "policy.gpus_per_rank=0.25",
    ]
    cfg = load_config(YAML, one_gpu + ["refit.transport=ipc"])
    assert (cfg.policy_ranks, cfg.refit_mode, cfg.policy_gpus_per_rank()) == (2, "reshard", 0.25)
    check_devices(cfg, cuda_devices=1)
    with pytest.raises(ConfigError, match=r"need 3 CUDA devices \(2 policy rank\(s\) x policy.gpus_per_rank=1"):
        check_devices(load_config(YAML, one_gpu[:-2] + ["policy.gpus_per_rank=1"]), cuda_devices=1)
    with pytest.raises(ConfigError, match=r"policy.dist_backend=nccl with 2 policy ranks sharing GPUs"):
        load_config(YAML, one_gpu + ["policy.dist_backend=nccl"])
    with pytest.raises(ConfigError, match=r"tensor_parallel_size=2 needs refit.mode=reshard"):
        load_config(YAML, one_gpu[:-2] + ["refit.backend=nccl", "refit.mode=packed"])
    with pytest.raises(ConfigError, match=r"generation.num_gpus=0.5 shares a GPU with the policy"):
        load_config(
            YAML,
            [
                "policy.device=cuda",
                "generation.device=cuda",
                "refit.backend=nccl",
                "generation.num_gpus=0.5",
                "trainer.dp_size=1",
            ],
        )
    with pytest.raises(ConfigError, match=r"refit.transport=ipc needs refit.mode=reshard"):
        load_config(YAML, ["refit.transport=ipc"])
    with pytest.raises(ConfigError, match=r"policy.gpus_per_rank must be > 0"):
        load_config(YAML, one_gpu[:-1] + ["policy.gpus_per_rank=0"])


# ------------------------------------------------------------ configs that cannot work (issue 14, item 8)
def test_memory_backend_with_the_multi_process_trainer_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"data_plane.backend=memory is one private store per process"):
        load_config(YAML, ["data_plane.backend=memory"])
    # the legacy path never builds a client, so the key is inert there
    assert load_config(YAML, ["data_plane.backend=memory", "data_plane.enabled=false"]).data_plane.backend == "memory"


@pytest.mark.parametrize(
    ("backend", "needle"),
    [
        ("no_such_pkg.sub:Client", r"data_plane.backend='no_such_pkg.sub:Client': cannot import 'no_such_pkg.sub'"),
        ("nemo_dataplane.meta:NoSuchClass", r"data_plane.backend='nemo_dataplane.meta:NoSuchClass'.*no attribute"),
        (
            "nemo_dataplane.meta:KVBatchMeta",
            r"data_plane.backend='nemo_dataplane.meta:KVBatchMeta'.*not a .*DataPlaneClient",
        ),
        ("redis", r"data_plane.backend='redis' is neither a built-in backend"),
    ],
)
def test_unusable_backend_path_is_refused_at_load_naming_it(backend: str, needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        load_config(YAML, [f"data_plane.backend={backend}"])


def test_a_backend_class_missing_abstract_methods_is_refused_at_load_naming_them() -> None:
    with pytest.raises(
        ConfigError, match=r"data_plane.backend='_backends:Incomplete': Incomplete does not implement kv_partitions"
    ):
        load_config(YAML, ["data_plane.backend=_backends:Incomplete"])


def test_structural_backend_problems_exit_2_with_one_line_before_anything_starts(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from algorithms.cli import main
    from algorithms.grpo_async import AsyncTrainer
    from algorithms.grpo_sync import SyncTrainer

    def run(trainer: Any, backend: str) -> list[str]:
        code = main(
            trainer, ["--config", str(YAML), f"data_plane.backend={backend}", "logging.output_dir=/nonexistent/x"]
        )
        assert code == 2
        return capsys.readouterr().err.strip().splitlines()

    (line,) = run(SyncTrainer, "_backends:Incomplete")
    assert line.startswith("grpo_sync: config error: data_plane.backend='_backends:Incomplete'")
    # A store without claims serves the sync trainer, not the async one (it claims groups as produced).
    assert load_config(YAML, ["data_plane.backend=_backends:ByKeyOnly"]).data_plane.backend.endswith("ByKeyOnly")
    (line,) = run(AsyncTrainer, "_backends:ByKeyOnly")
    assert line.startswith(
        "grpo_async: config error: data_plane.backend='_backends:ByKeyOnly': ByKeyOnly has no claims"
    )
    assert "kv_claim, kv_mark_consumed, kv_claim_status not implemented" in line
    # Several engines: grpo_sync's key; the async trainer has one engine per collector.
    code = main(AsyncTrainer, ["--config", str(YAML), "generation.num_engines=2", "logging.output_dir=/nonexistent/x"])
    assert code == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "generation.num_engines=2 sets grpo_sync's engines" in line and "async.num_collectors" in line
    assert SyncTrainer.num_collectors(load_config(YAML, ["generation.num_engines=3"])) == 3


def test_the_run_names_its_transport_and_backend() -> None:
    from algorithms.grpo_sync import SyncTrainer

    assert SyncTrainer(load_config(YAML)).summary["transport"] == "data_plane (backend=transfer_queue)"
    custom = load_config(YAML, ["data_plane.backend=nemo_dataplane.adapters.memory:InMemoryClient"])
    assert (
        SyncTrainer(custom).summary["transport"] == "data_plane (backend=nemo_dataplane.adapters.memory:InMemoryClient)"
    )
    legacy = load_config(YAML, ["data_plane.enabled=false", "data_plane.packing.micro_batch_size=2"])
    assert SyncTrainer(legacy).summary["transport"] == "legacy"


def test_a_custom_backend_class_that_imports_is_accepted() -> None:
    cfg = load_config(YAML, ["data_plane.backend=nemo_dataplane.adapters.memory:InMemoryClient"])
    assert cfg.data_plane.backend.endswith(":InMemoryClient")


def test_cuda_layout_on_a_machine_without_cuda_is_refused_for_a_local_cluster() -> None:
    from algorithms.config import check_devices

    gpu = load_config(YAML, ["policy.device=cuda", "generation.device=cuda", "refit.backend=nccl"])
    with pytest.raises(ConfigError, match=r"policy.device=cuda but this machine has no CUDA device"):
        check_devices(gpu, cuda_devices=0)
    check_devices(gpu, cuda_devices=2)  # fits
    check_devices(
        load_config(
            YAML, ["policy.device=cuda", "generation.device=cuda", "refit.backend=nccl", "ray.address=10.0.0.1:6379"]
        ),
        cuda_devices=0,
    )  # remote: not ours to see
    with pytest.raises(ConfigError, match=r"need 2 CUDA devices .* this machine has 1"):
        check_devices(gpu, cuda_devices=1)


def test_a_gloo_refit_with_a_cuda_end_is_refused_at_load_naming_the_device_key() -> None:
    with pytest.raises(ConfigError, match=r"refit.backend=gloo moves CPU tensors but generation.device=cuda"):
        load_config(YAML, ["generation.device=cuda"])
    with pytest.raises(ConfigError, match=r"refit.backend=gloo moves CPU tensors but policy.device=cuda"):
        load_config(YAML, ["policy.device=cuda", "refit.backend=gloo"])


def test_the_cli_refuses_before_ray_starts(capsys: pytest.CaptureFixture[str]) -> None:
    import ray

    from algorithms.cli import main
    from algorithms.grpo_async import AsyncTrainer

    # Another test of the session may have left Ray up in this process; what matters is that the
    # refusal changes nothing (when it was down, it stays down: nothing started it).
    was_up = ray.is_initialized()
    assert main(AsyncTrainer, ["--config", str(YAML), "data_plane.backend=memory"]) == 2
    assert "data_plane.backend=memory" in capsys.readouterr().err
    if not __import__("torch").cuda.is_available():
        assert main(AsyncTrainer, ["--config", str(YAML), "policy.device=cuda"]) == 2
        assert "policy.device=cuda" in capsys.readouterr().err
    assert ray.is_initialized() == was_up


def test_groups_per_generation_auto_is_a_steps_groups_over_the_collectors_within_the_inflight_limit() -> None:
    def resolved(*overrides: str) -> int:
        cfg = load_config(YAML, list(overrides))
        return cfg.async_.generation_groups(cfg.grpo.prompts_per_step)

    assert load_config(YAML, []).async_.groups_per_generation == "auto"
    assert resolved("grpo.prompts_per_step=32") == 32  # one collector: the sync trainer's batch
    assert resolved("grpo.prompts_per_step=32", "async.num_collectors=3") == 11  # ceil(32 / 3)
    assert resolved("grpo.prompts_per_step=32", "async.max_inflight_groups=12") == 12  # the in-flight limit
    assert resolved("grpo.prompts_per_step=32", "async.groups_per_generation=8") == 8  # given: kept
    with pytest.raises(ConfigError, match="async.groups_per_generation"):
        load_config(YAML, ["async.groups_per_generation=0"])
    with pytest.raises(ConfigError, match="async.groups_per_generation"):
        load_config(YAML, ["async.groups_per_generation=most"])
    with pytest.raises(ConfigError, match="async.max_inflight_groups=2 is below async.groups_per_generation=8"):
        load_config(YAML, ["async.max_inflight_groups=2", "async.groups_per_generation=8"])


@pytest.mark.parametrize(
    ("name", "params", "two_gpus", "four_gpus"),
    [
        ("grpo_llama_1b.yaml", 1.104e9, [], ["trainer.dp_size=2", "policy.gpus_per_rank=1", "policy.sharding=fsdp"]),
        (
            "grpo_llama_8b.yaml",
            7.242e9,
            [],
            ["policy.gpus_per_rank=1", "generation.num_gpus=1", "refit.backend=nccl", "refit.transport=auto"],
        ),
    ],
)
def test_the_real_size_configs_are_the_sizes_they_say_and_fit_their_layouts(
    name: str, params: float, two_gpus: list[str], four_gpus: list[str]
) -> None:
    from algorithms.config import check_devices
    from algorithms.models import build_model

    path = YAML.parent / name
    cfg = load_config(path, two_gpus)
    model = build_model(dict(cfg.policy.model), vocab_size=32000, device="meta")
    assert abs(sum(p.numel() for p in model.parameters()) - params) < 1e6
    assert cfg.policy.precision == "bf16" and cfg.policy.lr <= 1e-5 and cfg.policy.lr_warmup_steps > 0
    assert cfg.grpo.kl_clamp is not None
    check_devices(cfg, cuda_devices=2)
    with pytest.raises(ConfigError, match="this machine has 1"):
        check_devices(cfg, cuda_devices=1)
    four = load_config(path, four_gpus)
    assert four.fully_sharded and four.refit_senders == 2
    check_devices(four, cuda_devices=4, generators=2)


def test_the_shipped_tokenizer_builder_makes_exactly_the_ids_asked_for(tmp_path: Path) -> None:
    import importlib.util

    from algorithms.tokenizers import build_tokenizer

    spec = importlib.util.spec_from_file_location("bpe", YAML.parents[1] / "build_bpe_tokenizer.py")
    assert spec is not None and spec.loader is not None
    bpe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bpe)
    out = bpe.build(tmp_path / "tok", vocab_size=2000, lines=4000)
    tok = build_tokenizer(load_config(YAML, [f"policy.tokenizer={out}"]))
    assert tok.vocab_size == 2000 and tok.decode(tok.encode("What is 381 + 12?")) == "What is 381 + 12?"
    assert len({tok.bos_id, tok.eos_id, tok.pad_id}) == 3
    again = bpe.build(tmp_path / "tok2", vocab_size=2000, lines=4000)
    assert (Path(again) / "tokenizer.json").read_bytes() == (out / "tokenizer.json").read_bytes(), "deterministic"


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_sections_built_directly_refuse_non_finite_bounds_naming_the_field(value: float) -> None:
    """Built without YAML (whose loader refuses non-finite numbers), every ``require_positive``
    field and the sampling spec refuse NaN and infinity, naming the field."""
    from algorithms.config_sections import AsyncConfig, RefitConfig, TrainerSection
    from algorithms.engines.generation.base import SamplingSpec
    from nemo_dataplane.config import FieldError

    for make, field in (
        (lambda: TrainerSection(step_timeout_s=value), "step_timeout_s"),
        (lambda: RefitConfig(timeout_s=value), "timeout_s"),
        (lambda: AsyncConfig(claim_poll_s=value), "claim_poll_s"),
    ):
        with pytest.raises(FieldError, match=rf"^{field} must be a finite number"):
            make()
    with pytest.raises(ValueError, match="temperature must be >= 0, got nan"):
        SamplingSpec(max_new_tokens=4, temperature=float("nan"))


# ----------------------------------------------------------------------------- the reference
def _cells(cell: str) -> list[str]:
    """A default cell's comma-separated entries (commas inside brackets stay)."""
    out, depth, cur = [], 0, ""
    for ch in cell:
        depth += ch in "[{" and 1 or (-1 if ch in "]}" else 0)
        if ch == "," and depth == 0:
            out.append(cur.strip())
            cur = ""
        else:
            cur += ch
    return [*out, cur.strip()] if cur.strip() else out


def _table(doc: Path, heading: str) -> dict[str, str]:
    """``{dotted key: its default as written}`` of the table under ``heading`` (a row's further
    keys are relative to its first key's section: `policy.lr`, `weight_decay`)."""
    text = doc.read_text().split(f"\n## {heading}", 1)[1].split("\n## ", 1)[0]
    rows: dict[str, str] = {}
    for line in text.splitlines():
        if not line.startswith("| `"):
            continue
        key_cell, default_cell = line.split(" | ")[0][2:], line.split(" | ")[1]
        keys, prefix = [], ""
        for item in re.findall(r"`([^`]+)`", key_cell):
            if "." in item:
                prefix = item.rsplit(".", 1)[0]
                keys.append(item)
            else:
                keys.append(f"{prefix}.{item}")
        defaults = _cells(default_cell)
        rows.update(zip(keys, defaults + [""] * (len(keys) - len(defaults))))
    return rows


def _written(value: object) -> str:
    """A default as the tables write it."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_written(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_written(v)}" for k, v in value.items()) + "}"
    return str(value)


def _flat(d: dict, prefix: str = "") -> list[tuple[str, object]]:
    out: list[tuple[str, object]] = []
    for k, v in d.items():
        nested = isinstance(v, dict) and v and k != "model"
        out += _flat(v, f"{prefix}{k}.") if nested else [(f"{prefix}{k}", v)]
    return out


def test_every_config_key_is_in_the_docs_table_with_its_default() -> None:
    """docs/grpo_sync.md "Config keys" lists every key with the default it takes when left out
    (the async section: docs/grpo_async.md); a key added without a row fails here."""
    async_table = _table(REPO / "docs" / "grpo_async.md", "Config (`async` section)")
    table = {
        **_table(REPO / "docs" / "grpo_sync.md", "Config keys"),
        **{k: v for k, v in async_table.items() if k.startswith("async.")},
    }
    missing, wrong = [], []
    for key, value in _flat(TrainerConfig().to_dict()):
        if key not in table:
            missing.append(key)
        elif key != "policy.model" and table[key].strip("`") != _written(value):
            wrong.append((key, table[key], _written(value)))
    assert missing == [] and wrong == []
    assert table["policy.model"] == "required"


def test_help_names_where_keys_are_documented_and_each_section_in_a_whole_sentence(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from algorithms.cli import CONFIG_REFERENCE, main
    from algorithms.grpo_sync import SyncTrainer

    with pytest.raises(SystemExit):
        main(SyncTrainer, ["--help"])
    out = capsys.readouterr().out
    assert CONFIG_REFERENCE in out
    for doc, heading in re.findall(r'(docs/\S+\.md) "([^"]+)"', CONFIG_REFERENCE):
        assert f"\n## {heading}" in (REPO / doc).read_text(), (doc, heading)
    sections = out.split(CONFIG_REFERENCE, 1)[1].strip().splitlines()
    assert [line.split()[0] for line in sections] == [k for k in TrainerConfig().to_dict()]
    for line in sections:
        assert line.rstrip().endswith((".", ")")) and "``" not in line and ":mod:" not in line, line


_VLLM_GPU = ["policy.device=cuda", "generation.device=cuda", "generation.backend=vllm", "refit.backend=nccl"]


@pytest.mark.parametrize(
    ("overrides", "needle"),
    [
        (["generation.tensor_parallel_size=0"], "generation.tensor_parallel_size must be > 0"),
        (["generation.tensor_parallel_size=2"], "needs generation.backend=vllm and generation.device=cuda"),
        ([*_VLLM_GPU, "generation.tensor_parallel_size=2"], r"needs generation.num_gpus=2 \(one GPU per TP rank\)"),
        (
            [*_VLLM_GPU, "generation.tensor_parallel_size=2", "generation.num_gpus=2", "refit.mode=packed"],
            "needs refit.mode=reshard",
        ),
        (
            [*_VLLM_GPU, "generation.tensor_parallel_size=3", "generation.num_gpus=3"],
            "policy.model.hf_config.num_attention_heads=4 is not divisible by generation.tensor_parallel_size=3",
        ),
    ],
)
def test_generation_tensor_parallelism_is_checked_naming_the_key(overrides: list[str], needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        load_config(YAML, overrides)


def test_generation_tensor_parallelism_resolves_the_refit_to_reshard() -> None:
    cfg = load_config(YAML, [*_VLLM_GPU, "generation.tensor_parallel_size=2", "generation.num_gpus=2"])
    assert cfg.refit_mode == "reshard" and cfg.weight_transfer.family == "reshard" and cfg.refit_senders == 1


_COLOCATED = [
    "policy.device=cuda",
    "generation.device=cuda",
    "generation.backend=vllm",
    "generation.placement=colocated",
]


@pytest.mark.parametrize(
    ("overrides", "needle"),
    [
        (
            ["generation.placement=colocated"],
            "needs policy.device=cuda, generation.device=cuda and generation.backend=vllm",
        ),
        (_COLOCATED, r"set generation.num_engines=2 \(the policy's ranks\), got 1"),
        ([*_COLOCATED, "generation.num_engines=2", "refit.backend=nccl"], "NCCL refuses two ranks on one GPU"),
        ([*_COLOCATED, "generation.num_engines=2", "refit.mode=packed"], "refit.mode=reshard"),
        ([*_COLOCATED, "generation.num_engines=2", "refit.transport=p2p"], "refit.transport=ipc"),
        ([*_COLOCATED, "generation.num_engines=2", "generation.num_gpus=0.5"], "leave policy.gpus_per_rank"),
        (
            [*_COLOCATED, "generation.num_engines=2", "generation.tensor_parallel_size=2", "generation.num_gpus=2"],
            "use tensor_parallel_size=1",
        ),
        (
            [*_COLOCATED, "generation.num_engines=2", "generation.vllm.sleep_level=3"],
            r"sleep_level must be one of \[1, 2\]",
        ),
    ],
)
def test_the_colocated_placement_is_checked_naming_the_key(overrides: list[str], needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        load_config(YAML, overrides)


def test_the_colocated_placement_halves_each_gpu_and_refits_over_ipc_with_gloo_control() -> None:
    cfg = load_config(YAML, [*_COLOCATED, "generation.num_engines=2", "policy.dist_backend=nccl"])
    assert cfg.placement.name == "colocated" and cfg.policy_gpus_per_rank() == cfg.generator_gpus() == 0.5
    assert cfg.placement.engine_gpu_first and cfg.placement.sleep_level(cfg.generation) == 1
    assert cfg.refit_mode == "reshard" and cfg.refit.backend == "gloo" and cfg.weight_transfer.transport == "auto"
    check_devices(cfg, cuda_devices=2, generators=2)  # two ranks and two engines on two GPUs
    with pytest.raises(ConfigError, match="need 2 CUDA devices"):
        check_devices(cfg, cuda_devices=1, generators=2)
    split = load_config(YAML, ["policy.device=cuda", "generation.device=cuda", "refit.backend=nccl"])
    assert split.placement.name == "split" and split.refit_mode == "packed" and split.generator_gpus() == 1.0
    assert not split.placement.engine_gpu_first and split.placement.sleep_level(split.generation) is None
    assert split.placement.slots(2, 0.0).engine(0, []) is None  # Ray chooses


def test_grpo_async_refuses_the_colocated_placement_at_config_load(capsys: pytest.CaptureFixture[str]) -> None:
    from algorithms.cli import main
    from algorithms.grpo_async import AsyncTrainer

    # ray.address set: the devices are the remote cluster's, so the placement is what is refused
    args = [*_COLOCATED, "generation.num_engines=2", "ray.address=127.0.0.1:1", "logging.output_dir=/nonexistent/x"]
    assert main(AsyncTrainer, ["--config", str(YAML), *args]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "generation.placement=colocated runs with grpo_sync only" in line


def test_a_colocated_engine_takes_the_gpu_no_live_engine_holds() -> None:
    from algorithms.placement import Colocation

    class Group:
        bundle_count = 3

    c = Colocation(Group())
    assert [c.take(i, list(range(i))) for i in range(3)] == [0, 1, 2]
    # engine 1 lost: its replacement (id 3) takes GPU 1; then engine 0 lost while 3 starts: id 4 takes 0
    assert c.take(3, [0, 2]) == 1
    assert c.take(4, [2, 3]) == 0
    with pytest.raises(RuntimeError, match="engine 5: every GPU of the colocated placement already holds an engine"):
        c.take(5, [2, 3, 4])
