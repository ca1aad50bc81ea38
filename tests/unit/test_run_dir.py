"""The run directory (algorithms/run_dir.py): a run refuses another run's results unless it resumes
or overwrites; a resume names what it cannot resume from and every config key that may not change;
the CLI reports both as one-line config errors (exit 2); the end-of-run line and the plot."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from algorithms.checkpoint import mark_complete, save_driver_state, step_dir
from algorithms.cli import main
from algorithms.config import ConfigError, TrainerConfig, load_config
from algorithms.grpo_sync import SyncTrainer
from algorithms.metrics import metrics_figure
from algorithms.models import model_files_digest
from algorithms.run_dir import (
    FAILED_RESUME_SUMMARY,
    FREE_ON_RESUME,
    MODEL_FILES,
    SAFE_ON_RESUME,
    checkpoint_root,
    config_changes,
    plan_run_dir,
    plot_title,
    remove_results,
    write_outputs,
)

YAML = Path(__file__).resolve().parents[2] / "examples" / "configs" / "grpo_tiny.yaml"


def _cfg(out: Path, *overrides: str) -> TrainerConfig:
    return load_config(YAML, [f"logging.output_dir={out}", "data_plane.enabled=false", *overrides])


def _checkpoint(cfg: TrainerConfig, step: int = 4) -> Path:
    """A complete checkpoint of ``cfg``'s run (the driver's share; the ranks' files are not read here)."""
    root = checkpoint_root(cfg)
    d = step_dir(root, step)
    d.mkdir(parents=True)
    save_driver_state(d, step, {}, cfg.to_dict())
    mark_complete(d, step, root=root, keep=0)
    return d


def _one_line(e: pytest.ExceptionInfo[ConfigError]) -> str:
    msg = str(e.value)
    assert "\n" not in msg
    return msg


# ----------------------------------------------------------------------------- output directory
def test_a_fresh_run_starts_where_no_step_was_logged(tmp_path: Path) -> None:
    plan = plan_run_dir(_cfg(tmp_path / "new"))
    assert plan.resume is None and plan.start_step == 0 and plan.stale == ()
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "config.json").write_text("{}")  # every run writes it first: not a result
    (tmp_path / "mine" / "stdout.txt").write_text("")
    assert plan_run_dir(_cfg(tmp_path / "mine")).stale == ()
    # A run that failed while setting up: an empty metrics file and a summary of 0 steps.
    (tmp_path / "mine" / "metrics.jsonl").write_text("")
    (tmp_path / "mine" / "summary.json").write_text('{"status": "failed", "exit_code": 1, "steps": 0}')
    assert plan_run_dir(_cfg(tmp_path / "mine")).stale == ()
    (tmp_path / "mine" / "summary.json").write_text('{"status": "finished", "steps": 5}')
    with pytest.raises(ConfigError, match="summary.json"):
        plan_run_dir(_cfg(tmp_path / "mine"))


def test_another_runs_results_are_refused_naming_them_and_the_ways_out(tmp_path: Path) -> None:
    out = tmp_path / "run"
    cfg = _cfg(out)
    out.mkdir()
    (out / "metrics.jsonl").write_text("{}\n")
    (out / "summary.json").write_text("{}")
    _checkpoint(cfg, 20)
    with pytest.raises(ConfigError) as e:
        plan_run_dir(cfg)
    msg = _one_line(e)
    assert "metrics.jsonl" in msg and "summary.json" in msg and "step_000020" in msg
    assert "logging.overwrite=true" in msg and "checkpoint.resume=latest" in msg


def test_checkpoints_alone_in_an_explicit_checkpoint_dir_also_take_the_run(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path / "run", f"checkpoint.dir={tmp_path / 'ckpts'}")
    _checkpoint(cfg, 2)
    with pytest.raises(ConfigError, match="step_000002"):
        plan_run_dir(cfg)


def test_overwrite_lets_the_run_start_and_deletes_exactly_the_old_results(tmp_path: Path) -> None:
    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.jsonl").write_text("{}\n")
    (out / "notes.txt").write_text("the user's own file")
    ckpt = _checkpoint(_cfg(out), 8)
    plan = plan_run_dir(_cfg(out, "logging.overwrite=true"))
    assert plan.resume is None and set(plan.stale) == {out / "metrics.jsonl", ckpt}
    assert (out / "metrics.jsonl").exists(), "planning deletes nothing"
    remove_results(plan.stale, "grpo_sync")
    assert not (out / "metrics.jsonl").exists() and not ckpt.exists()
    assert (out / "notes.txt").exists()
    assert plan_run_dir(_cfg(out)).stale == ()


def test_a_resume_into_its_own_directory_is_not_refused_for_its_results(tmp_path: Path) -> None:
    out = tmp_path / "run"
    cfg = _cfg(out, "trainer.steps=8")
    ckpt = _checkpoint(cfg, 4)
    (out / "metrics.jsonl").write_text("{}\n")
    plan = plan_run_dir(_cfg(out, "trainer.steps=8", "checkpoint.resume=latest"))
    assert plan.resume == ckpt and plan.start_step == 4 and plan.stale == ()


# ----------------------------------------------------------------------------- resume: where from
def test_a_resume_path_that_does_not_exist_says_so(tmp_path: Path) -> None:
    missing = tmp_path / "nope" / "step_000004"
    with pytest.raises(ConfigError) as e:
        plan_run_dir(_cfg(tmp_path / "run", f"checkpoint.resume={missing}"))
    msg = _one_line(e)
    assert "does not exist" in msg and str(missing) in msg and "COMPLETE" not in msg


def test_pointing_at_the_checkpoints_root_suggests_latest_or_a_step_folder(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path / "old")
    newest = _checkpoint(cfg, 4).parent / "step_000006"
    _checkpoint(cfg, 6)
    root = checkpoint_root(cfg)
    with pytest.raises(ConfigError) as e:
        plan_run_dir(_cfg(tmp_path / "new", f"checkpoint.resume={root}"))
    msg = _one_line(e)
    assert "checkpoints root" in msg and "checkpoint.resume=latest" in msg and str(newest) in msg


def test_a_checkpoint_whose_save_did_not_finish_is_refused(tmp_path: Path) -> None:
    d = step_dir(tmp_path / "ckpts", 3)
    d.mkdir(parents=True)
    with pytest.raises(ConfigError, match="no COMPLETE marker"):
        plan_run_dir(_cfg(tmp_path / "run", f"checkpoint.resume={d}"))


# ----------------------------------------------------------------------------- resume: the config
def test_a_resume_with_another_model_is_refused_naming_each_key(tmp_path: Path) -> None:
    ckpt = _checkpoint(_cfg(tmp_path / "old"))
    cfg = _cfg(
        tmp_path / "new",
        f"checkpoint.resume={ckpt}",
        "policy.model.hf_config.num_attention_heads=2",
        "policy.model.hf_config.num_key_value_heads=2",
        "task.name=copy",
    )
    with pytest.raises(ConfigError) as e:
        plan_run_dir(cfg)
    msg = _one_line(e)
    for key in (
        "policy.model.hf_config.num_attention_heads",
        "policy.model.hf_config.num_key_value_heads",
        "task.name",
    ):
        assert key in msg
    assert "'digit_map' -> 'copy'" in msg and "cannot change" in msg


def test_allow_config_change_lets_the_lr_through_but_never_the_model(tmp_path: Path) -> None:
    ckpt = _checkpoint(_cfg(tmp_path / "old"))
    resume = (f"checkpoint.resume={ckpt}", "policy.lr=0.0005", "trainer.steps=90")
    with pytest.raises(ConfigError) as e:
        plan_run_dir(_cfg(tmp_path / "new", *resume))
    msg = _one_line(e)
    assert "policy.lr" in msg and "trainer.steps" in msg and "checkpoint.allow_config_change=true" in msg

    plan = plan_run_dir(_cfg(tmp_path / "new", *resume, "checkpoint.allow_config_change=true"))
    assert plan.resume == ckpt and plan.start_step == 4

    with pytest.raises(ConfigError) as e:
        plan_run_dir(
            _cfg(
                tmp_path / "new",
                *resume,
                "checkpoint.allow_config_change=true",
                "policy.model.hf_config.num_hidden_layers=3",
            )
        )
    msg = _one_line(e)
    assert "policy.model.hf_config.num_hidden_layers (2 -> 3)" in msg and "policy.lr" not in msg


def test_a_sharded_checkpoint_may_resume_on_another_rank_count_a_replicated_one_may_not(tmp_path: Path) -> None:
    sharded = _checkpoint(_cfg(tmp_path / "old", "policy.sharding=fsdp"))
    more = (f"checkpoint.resume={sharded}", "policy.sharding=fsdp", "trainer.dp_size=4")
    with pytest.raises(ConfigError, match=r"trainer.dp_size \(2 -> 4\).*checkpoint.allow_config_change=true"):
        plan_run_dir(_cfg(tmp_path / "new", *more))
    assert plan_run_dir(_cfg(tmp_path / "new", *more, "checkpoint.allow_config_change=true")).resume == sharded
    replicated = _checkpoint(_cfg(tmp_path / "old2"))
    with pytest.raises(ConfigError, match=r"trainer.dp_size \(2 -> 4\).*cannot change"):
        plan_run_dir(
            _cfg(
                tmp_path / "new2",
                f"checkpoint.resume={replicated}",
                "trainer.dp_size=4",
                "checkpoint.allow_config_change=true",
            )
        )
    with pytest.raises(ConfigError, match=r"policy.sharding \('fsdp' -> 'none'\).*cannot change"):
        plan_run_dir(_cfg(tmp_path / "new3", f"checkpoint.resume={sharded}", "checkpoint.allow_config_change=true"))


def test_where_and_how_a_run_is_observed_may_change_freely(tmp_path: Path) -> None:
    ckpt = _checkpoint(_cfg(tmp_path / "old"))
    cfg = _cfg(
        tmp_path / "new",
        f"checkpoint.resume={ckpt}",
        "logging.plot=false",
        "checkpoint.every=3",
        "trainer.dispatch=compiled_graph",
        "refit.bucket_bytes=4096",
    )
    assert plan_run_dir(cfg).resume == ckpt


def test_the_key_lists_name_real_config_keys_and_do_not_overlap() -> None:
    keys = {k for k, _ in _flat_keys(TrainerConfig().to_dict())}
    for prefix in (*FREE_ON_RESUME, *SAFE_ON_RESUME):
        assert any(k == prefix or k.startswith(prefix + ".") for k in keys), prefix
    assert not set(FREE_ON_RESUME) & set(SAFE_ON_RESUME)
    # A stored config lacking a key (written before it existed) compares as its default.
    stored = TrainerConfig().to_dict()
    del stored["logging"]["overwrite"], stored["grpo"]["epochs"]
    assert config_changes(stored, TrainerConfig().to_dict()) == {}


def _flat_keys(d: dict, prefix: str = "") -> list[tuple[str, object]]:
    out: list[tuple[str, object]] = []
    for k, v in d.items():
        out += _flat_keys(v, f"{prefix}{k}.") if isinstance(v, dict) and v else [(f"{prefix}{k}", v)]
    return out


# ----------------------------------------------------------------------------- resume: the model's files
def _model_dir(root: Path, tensor_bytes: int = 1024) -> Path:
    """A Hugging Face model directory as far as the resume reads it: config.json and one
    safetensors file (header + data)."""
    import struct

    root.mkdir(parents=True)
    (root / "config.json").write_text('{"model_type": "llama", "vocab_size": 64, "max_position_embeddings": 64}')
    header = json.dumps({"w": {"dtype": "F32", "shape": [tensor_bytes // 4], "data_offsets": [0, tensor_bytes]}})
    data = struct.pack("<Q", len(header)) + header.encode() + bytes(range(256)) * (tensor_bytes // 256)
    (root / "model.safetensors").write_bytes(data)
    return root


def test_a_resume_whose_model_was_rewritten_in_place_is_refused_naming_the_path_and_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The driver state holds the digest of the model files the run started from; a resume whose
    files differ stops before Ray starts (exit 2), leaving the run's summary.json as it was."""
    import ray

    model = _model_dir(tmp_path / "model")
    base = ("policy.model.hf_config=null", f"policy.model.path={model}")
    old = _cfg(tmp_path / "run", *base)
    root = checkpoint_root(old)
    d = step_dir(root, 2)
    d.mkdir(parents=True)
    save_driver_state(d, 2, {MODEL_FILES: model_files_digest(old.policy.model)}, old.to_dict())
    mark_complete(d, 2, root=root, keep=0)
    resume = _cfg(tmp_path / "run", *base, "checkpoint.resume=latest")
    assert plan_run_dir(resume).start_step == 2

    weights = model / "model.safetensors"
    saved = weights.read_bytes()
    weights.write_bytes(saved[:-1] + bytes([saved[-1] ^ 1]))  # the same size, one weight byte flipped
    with pytest.raises(ConfigError) as e:
        plan_run_dir(resume)
    msg = _one_line(e)
    assert f"the model files under policy.model.path={str(model)!r} differ" in msg
    assert "model.safetensors (changed)" in msg and "config.json" not in msg
    (model / "model-00002.safetensors").write_bytes(b"x")
    (model / "config.json").write_text((model / "config.json").read_text().replace("}", ', "x": 1}', 1))
    with pytest.raises(ConfigError, match=r"config\.json \(changed\), model-00002\.safetensors \(new\)"):
        plan_run_dir(resume)

    def no_ray(*args: object, **kwargs: object) -> None:
        raise AssertionError("ray.init called before the resume was checked")

    monkeypatch.setattr(ray, "init", no_ray)
    (tmp_path / "run" / "summary.json").write_text('{"status": "finished", "steps": 2}')
    argv = ["--config", str(YAML), "data_plane.enabled=false", *base, f"logging.output_dir={tmp_path / 'run'}"]
    assert _sync_main([*argv, "checkpoint.resume=latest"]) == 2
    assert "policy.model.path" in capsys.readouterr().err
    assert (tmp_path / "run" / "summary.json").read_text() == '{"status": "finished", "steps": 2}'
    # a checkpoint written before the digest was recorded is not checked
    save_driver_state(d, 2, {}, old.to_dict())
    assert plan_run_dir(resume).start_step == 2


def test_a_large_weights_file_is_digested_from_its_header_and_sampled_blocks(tmp_path: Path) -> None:
    """Above 4 MiB: the whole safetensors header, 64 blocks of 64 KiB spread over the file and its
    last block; a byte between the blocks is not read (the documented limit)."""
    import struct

    root = tmp_path / "m"
    root.mkdir()
    (root / "config.json").write_text("{}")
    header = json.dumps({"w": {"dtype": "F32", "shape": [2 << 20], "data_offsets": [0, 8 << 20]}}).encode()
    data = bytearray(struct.pack("<Q", len(header)) + header + bytes(8 << 20))
    size = len(data)
    weights = root / "model.safetensors"

    def digest_after(offset: int) -> str:
        changed = bytearray(data)
        changed[offset] ^= 0xFF
        weights.write_bytes(changed)
        return model_files_digest({"path": str(root)})["model.safetensors"]

    weights.write_bytes(data)
    first = model_files_digest({"path": str(root)})
    assert set(first) == {"config.json", "model.safetensors"} and first["model.safetensors"].startswith(f"{size}:")
    block = size * 17 // 64
    for offset in (10, (1 << 20) - 1, block, block + (1 << 16) - 1, size - 1):  # header, head, a block, the tail
        assert digest_after(offset) != first["model.safetensors"], offset
    assert digest_after(block + (1 << 16) + 10) == first["model.safetensors"]
    assert model_files_digest({"arch": "llama", "hf_config": {}}) is None


def test_a_resume_that_logged_no_step_keeps_the_resumed_runs_summary(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    previous = '{"status": "finished", "steps": 4}'
    (tmp_path / "summary.json").write_text(previous)
    failed = {"status": "failed", "exit_code": 1, "error": "step 4 collect: boom"}
    write_outputs(tmp_path, [], failed, name="grpo_sync", wall_s=3.0, idle={}, title=None, keep_summary=True)
    assert (tmp_path / "summary.json").read_text() == previous
    assert json.loads((tmp_path / FAILED_RESUME_SUMMARY).read_text())["error"] == "step 4 collect: boom"
    out = capsys.readouterr()
    assert str(tmp_path / FAILED_RESUME_SUMMARY) in out.out and "summary.json is still the resumed run's" in out.err
    # nothing to keep: the summary goes where it always does
    (tmp_path / "summary.json").unlink()
    write_outputs(tmp_path, [], failed, name="grpo_sync", wall_s=3.0, idle={}, title=None, keep_summary=True)
    assert json.loads((tmp_path / "summary.json").read_text())["status"] == "failed"


# ----------------------------------------------------------------------------- the CLI
def test_the_cli_reports_a_resume_error_as_one_line_and_exits_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "ckpts" / "step_000004"
    argv = ["--config", str(YAML), f"logging.output_dir={tmp_path / 'run'}", f"checkpoint.resume={missing}"]
    assert _sync_main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith("grpo_sync: config error:") and "does not exist" in err
    assert not (tmp_path / "run").exists(), "nothing is written before the check"


def test_the_cli_refuses_a_taken_output_dir_with_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "summary.json").write_text('{"status": "finished", "steps": 3}')
    assert _sync_main(["--config", str(YAML), f"logging.output_dir={tmp_path / 'run'}"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "summary.json" in err and "logging.overwrite" in err


def test_a_ctrl_c_while_the_inputs_are_checked_exits_130_with_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def interrupted(self: SyncTrainer) -> None:  # e.g. parsing a large dataset's reference answers
        raise KeyboardInterrupt

    monkeypatch.setattr(SyncTrainer, "prepare", interrupted)
    assert _sync_main(["--config", str(YAML), f"logging.output_dir={tmp_path / 'run'}"]) == 130
    assert capsys.readouterr().err.strip() == "grpo_sync: interrupted before the run started"
    assert not (tmp_path / "run").exists()


def test_help_points_to_the_config_reference(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        _sync_main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "docs/grpo_sync.md" in out and "logging" in out and "checkpoint" in out


def _sync_main(argv: list[str]) -> int:
    return main(SyncTrainer, argv)


# ----------------------------------------------------------------------------- what a run leaves
def test_the_failure_line_names_only_files_that_exist(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    summary = {"status": "failed", "exit_code": 1}
    write_outputs(tmp_path, [], summary, name="grpo_sync", wall_s=3.0, idle={}, title="t")
    line = capsys.readouterr().out.strip()
    assert line.startswith("grpo_sync failed: 0 steps")
    assert str(tmp_path / "summary.json") in line and "metrics.jsonl" not in line
    assert not (tmp_path / "reward_loss.png").exists(), "no steps, no plot"


def test_the_plot_has_a_title_and_kl_and_pg_loss_panels_and_staleness_only_for_async() -> None:
    import matplotlib.pyplot as plt

    sync_rows = [
        {"step": s, "reward": 0.1 * s, "loss": 1.0 - s * 0.1, "pg_loss": -0.1 * s, "kl": 0.01 * s} for s in range(4)
    ]
    fig = metrics_figure(sync_rows, "runs/x: grpo_sync, transport legacy")
    try:
        assert fig._suptitle is not None and fig._suptitle.get_text() == "runs/x: grpo_sync, transport legacy"
        titles = [ax.get_title() for ax in fig.axes if ax.get_visible()]
        assert titles == ["reward", "loss", "pg_loss", "KL"]
        kl = next(ax for ax in fig.axes if ax.get_title() == "KL")
        assert list(kl.lines[0].get_ydata()) == [r["kl"] for r in sync_rows]
    finally:
        plt.close(fig)
    async_rows = [dict(r, staleness_mean=0.5, staleness_max=1) for r in sync_rows]
    fig = metrics_figure(async_rows)
    try:
        assert [ax.get_title() for ax in fig.axes if ax.get_visible()][-1] == "staleness"
        assert fig._suptitle is None
    finally:
        plt.close(fig)


def test_the_plot_title_names_the_run_the_trainer_the_transport_and_the_engines(tmp_path: Path) -> None:
    title = plot_title(_cfg(tmp_path / "run"), "grpo_async", "legacy")
    assert str(tmp_path / "run") in title and "grpo_async" in title and "legacy" in title
    assert "policy torch" in title and "generation hf" in title
