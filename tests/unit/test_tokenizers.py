"""The tokenizer interface, its factory and the load-time checks of the run's inputs, on a real
checkpoint built at test time (``make_real_model`` / ``real_model`` in tests/conftest.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from algorithms.config import ConfigError, TrainerConfig, load_config
from algorithms.inputs import check_run_inputs, load_datasets
from algorithms.tasks import CharTokenizer, PromptRecord
from algorithms.tokenizers import HFTokenizer, Tokenizer, build_tokenizer, tokenizer_dir

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "examples" / "configs" / "grpo_tiny.yaml"
QUESTION = "What is 12 + 7?"


def config(model: Path | None = None, *overrides: str) -> TrainerConfig:
    base = [f"policy.model.path={model}", "policy.model.hf_config=null"] if model is not None else []
    return load_config(TINY, [*base, *overrides])


def test_hf_tokenizer_round_trips_a_word_problem_with_its_special_tokens(real_model: Path) -> None:
    tok = HFTokenizer(real_model)
    assert isinstance(tok, Tokenizer) and isinstance(CharTokenizer(), Tokenizer)
    ids = tok.encode(QUESTION)
    assert tok.decode(ids) == QUESTION
    assert len(ids) < len(QUESTION), "the BPE merges apply (not one id per byte)"
    assert all(0 <= i < tok.vocab_size for i in ids)
    specials = {tok.bos_id, tok.eos_id, tok.pad_id}
    assert len(specials) == 3 and not specials & set(ids)
    assert tok.encode_prompt(QUESTION) == [tok.bos_id, *ids]
    # decode stops at the first EOS and drops the other specials
    assert tok.decode([tok.bos_id, *ids, tok.eos_id, *tok.encode(" 19")]) == QUESTION
    assert tok.encode(QUESTION, add_bos=True, add_eos=True) == [tok.bos_id, *ids, tok.eos_id]


def test_pad_falls_back_to_eos_when_the_tokenizer_has_none(make_real_model, tmp_path: Path) -> None:
    tok = HFTokenizer(make_real_model(tmp_path / "m", pad_token=False))
    assert tok.pad_id == tok.eos_id


def test_chat_template_renders_the_system_prompt_and_the_user_turn(real_model: Path) -> None:
    cfg = config(real_model, "task.chat_template=true", "task.system_prompt='Be brief.'")
    tok = build_tokenizer(cfg)
    assert isinstance(tok, HFTokenizer)
    ids = tok.encode_prompt(QUESTION)
    rendered = tok._tok.decode(ids)  # with the special tokens
    assert rendered == "<s><|system|>Be brief.\n<|user|>What is 12 + 7?\n<|assistant|>"
    # Without the template the system prompt is prepended as is, after <bos>.
    plain = build_tokenizer(config(real_model, "task.system_prompt='Be brief. '"))
    assert plain.encode_prompt(QUESTION) == [plain.bos_id, *plain.encode("Be brief. " + QUESTION)]
    char = build_tokenizer(config(None, "task.system_prompt='1+'"))
    assert char.encode_prompt("2=") == char.encode("1+2=", add_bos=True)


def test_chat_template_without_one_is_a_config_error(make_real_model, tmp_path: Path) -> None:
    model = make_real_model(tmp_path / "m", chat_template=False)
    with pytest.raises(ConfigError, match=r"task\.chat_template=true: the tokenizer in .* has no chat template"):
        build_tokenizer(config(model, "task.chat_template=true"))
    with pytest.raises(ConfigError, match=r"task\.chat_template=true needs a Hugging Face tokenizer"):
        build_tokenizer(config(None, "task.chat_template=true"))


def test_the_factory_picks_the_checkpoint_tokenizer_or_the_character_one(make_real_model, tmp_path: Path) -> None:
    model = make_real_model(tmp_path / "m")
    assert tokenizer_dir(config(model)) == str(model)
    assert isinstance(build_tokenizer(config(model)), HFTokenizer)
    assert isinstance(build_tokenizer(config(model, "policy.tokenizer=char")), CharTokenizer)
    assert isinstance(build_tokenizer(config(None)), CharTokenizer)  # random init, auto: char
    # a model directory without a tokenizer: auto is the character tokenizer
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "config.json").write_text((model / "config.json").read_text())
    assert tokenizer_dir(config(bare)) is None
    # an explicit tokenizer directory, for a random-init model: its embedding is sized to it
    cfg = config(None, f"policy.tokenizer={model}")
    tok = build_tokenizer(cfg)
    assert isinstance(tok, HFTokenizer) and tok.vocab_size == HFTokenizer(model).vocab_size
    with pytest.raises(ConfigError, match=r"policy\.tokenizer=.*no tokenizer there"):
        build_tokenizer(config(None, f"policy.tokenizer={bare}"))


def test_a_model_with_fewer_embedding_rows_than_tokens_is_refused_naming_both(make_real_model, tmp_path: Path) -> None:
    model = make_real_model(tmp_path / "small", embedding_rows=300)
    tokens = HFTokenizer(model).vocab_size
    assert tokens > 300
    cfg = config(model)
    train, val = load_datasets(cfg)
    with pytest.raises(ConfigError, match=rf"embedding has 300 rows but the tokenizer .* has {tokens} tokens"):
        check_run_inputs(cfg, train, val)
    # the same for a random-init model whose hf_config states too few rows
    small = config(None, f"policy.tokenizer={model}", "policy.model.hf_config.vocab_size=100")
    with pytest.raises(ConfigError, match=rf"embedding has 100 rows but .* has {tokens} tokens"):
        check_run_inputs(small, train, val)
    assert isinstance(check_run_inputs(config(make_real_model(tmp_path / "ok")), train, val), HFTokenizer)


def test_the_trainer_refuses_before_writing_or_starting_ray(
    make_real_model, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``prepare`` (which the CLI turns into one line and exit 2) checks the inputs before the run
    directory is written or Ray starts."""
    import ray

    from algorithms.grpo_sync import SyncTrainer

    def no_ray(*args: object, **kwargs: object) -> None:  # the session may already run Ray: catch the call
        raise AssertionError("ray.init called before the inputs were checked")

    monkeypatch.setattr(ray, "init", no_ray)
    model = make_real_model(tmp_path / "small", embedding_rows=300)
    cfg = config(model, f"logging.output_dir={tmp_path / 'run'}", "data_plane.enabled=false", "logging.progress=false")
    with pytest.raises(ConfigError, match=r"^policy.model: the model's embedding has 300"):
        SyncTrainer(cfg).run()
    assert not (tmp_path / "run").exists()


def test_a_prompt_that_does_not_tokenize_is_named_with_its_line_and_field(real_model: Path, tmp_path: Path) -> None:
    data = tmp_path / "d.jsonl"
    data.write_text('{"q": "1+2=", "a": "3"}\n{"q": "What is 1+2?", "a": "3"}\n')
    cfg = config(None, f"task.dataset={data}", "task.prompt_key=q", "task.answer_key=a", "task.val_size=0")
    train, val = load_datasets(cfg)
    assert [r.answer for r in train] == ["3", "3"]
    with pytest.raises(ConfigError, match=r"task\.prompt_key='q': prompt 'What is 1\+2\?' \(.*d\.jsonl:2\)"):
        check_run_inputs(cfg, train, val)
    # the checkpoint's tokenizer takes it
    check_run_inputs(config(real_model, f"task.dataset={data}", "task.prompt_key=q", "task.answer_key=a"), train, val)


def test_a_dataset_row_without_the_key_is_a_config_error_naming_file_line_and_key(tmp_path: Path) -> None:
    data = tmp_path / "d.jsonl"
    data.write_text('{"q": "1=", "a": "1"}\n{"q": "2="}\n')
    cfg = config(None, f"task.dataset={data}", "task.prompt_key=q", "task.answer_key=a")
    with pytest.raises(ConfigError, match=r"task\.dataset=.*d\.jsonl:2: missing key 'a'"):
        load_datasets(cfg)


def test_unknown_reward_and_dataset_format_are_config_errors(tmp_path: Path) -> None:
    csv = tmp_path / "d.csv"
    csv.write_text("prompt,answer\n")
    with pytest.raises(ConfigError, match=r"task\.dataset=.*a file ending in one of \['\.jsonl', '\.parquet'\]"):
        config(None, f"task.dataset={csv}")
    with pytest.raises(ConfigError, match=r"task\.reward_fn must be one of \['math'"):
        config(None, "task.reward_fn=maths")
    assert config(None, "task.reward_fn=math").task.reward_fn == "math"
    cfg = config(None, "task.reward_fn=no_such_module_xyz:f")
    with pytest.raises(ConfigError, match=r"task\.reward_fn='no_such_module_xyz:f': .*cannot import"):
        check_run_inputs(cfg, [PromptRecord("1=", "1", 0)], [])


def _jsonl(path: Path, rows: list[dict[str, object]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_every_math_reference_it_cannot_parse_is_refused_before_start_naming_file_and_rows(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Found before Ray starts (exit 2, one line), not at the step that first draws the prompt."""
    import ray

    from algorithms.cli import main
    from algorithms.grpo_sync import SyncTrainer

    rows = [{"q": f"{i}=", "a": str(i)} for i in range(9)]
    rows[2]["a"], rows[6]["a"] = "nineteen", "x^2+1"
    train = _jsonl(tmp_path / "train.jsonl", rows)
    val = _jsonl(tmp_path / "val.jsonl", [{"q": "1=", "a": "one"}, {"q": "2=", "a": "2"}])
    keys = [f"task.dataset={train}", "task.prompt_key=q", "task.answer_key=a", "task.reward_fn=math"]
    cfg = config(None, *keys, f"task.val_dataset={val}")
    with pytest.raises(ConfigError) as e:
        check_run_inputs(cfg, *load_datasets(cfg))
    msg = str(e.value)
    assert msg.startswith("task.reward_fn='math': the math verifier cannot parse the reference answer")
    assert "task.answer_key='a'" in msg and "of 3 record(s)" in msg
    assert f"{train}:3 ('nineteen'), {train}:7 ('x^2+1'), {val}:1 ('one')" in msg
    good = _jsonl(tmp_path / "good.jsonl", [{"q": "1=", "a": "$x^2+1$"}, {"q": "2=", "a": "1,000"}])
    fixed = config(None, *keys[1:], f"task.dataset={good}")
    check_run_inputs(fixed, *load_datasets(fixed))

    def no_ray(*args: object, **kwargs: object) -> None:
        raise AssertionError("ray.init called before the inputs were checked")

    monkeypatch.setattr(ray, "init", no_ray)
    out = tmp_path / "run"
    argv = ["--config", str(TINY), *keys, f"task.val_dataset={val}", f"logging.output_dir={out}"]
    assert main(SyncTrainer, argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "nineteen" in err and not out.exists()


def test_max_new_tokens_past_the_models_context_is_refused_naming_both(real_model: Path, tmp_path: Path) -> None:
    # grpo_tiny's model: max_position_embeddings 64; its prompts ("4=") are <bos> + 2 tokens
    cfg = config(None, "generation.max_new_tokens=62")
    with pytest.raises(ConfigError) as e:
        check_run_inputs(cfg, *load_datasets(cfg))
    assert str(e.value).startswith(
        "generation.max_new_tokens=62 plus the longest prompt (3 tokens, uid "
    ) and "exceeds the model's policy.model.hf_config.max_position_embeddings=64" in str(e.value)
    ok = config(None, "generation.max_new_tokens=61")
    check_run_inputs(ok, *load_datasets(ok))
    # a checkpoint's config.json (max_position_embeddings 256), the longest of a dataset's prompts
    problems = _jsonl(
        tmp_path / "p.jsonl", [{"question": "What is 1 + 2?", "gold": 3}, {"question": QUESTION * 4, "gold": 19}]
    )
    keys = (f"task.dataset={problems}", "task.prompt_key=question", "task.answer_key=gold", "task.val_size=0")
    tok = HFTokenizer(real_model)
    longest = len(tok.encode_prompt(QUESTION * 4))
    cfg = config(real_model, *keys, f"generation.max_new_tokens={257 - longest}")
    limit = r"max_position_embeddings=256 in .*config\.json"
    with pytest.raises(ConfigError, match=rf"\({longest} tokens, .*p\.jsonl:2\) exceeds the model's {limit}"):
        check_run_inputs(cfg, *load_datasets(cfg))
    fits = config(real_model, *keys, f"generation.max_new_tokens={256 - longest}")
    check_run_inputs(fits, *load_datasets(fits))


def test_a_missing_prompt_key_names_the_training_file_first_and_the_keys_the_row_has(tmp_path: Path) -> None:
    rows = [{"question": "1=", "answer": "1"}]
    train, val = _jsonl(tmp_path / "train.jsonl", rows), _jsonl(tmp_path / "val.jsonl", rows)
    cfg = config(None, f"task.dataset={train}", f"task.val_dataset={val}")
    with pytest.raises(ConfigError) as e:
        load_datasets(cfg)
    assert str(e.value).startswith(f"task.dataset={str(train)!r}")
    assert f"{train}:1: missing key 'prompt' (the row has keys ['answer', 'question'])" in str(e.value)


def test_a_reward_module_the_workers_cannot_import_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The collector's import path is the driver's cwd and sys.path without its first entry (the
    directory of the script the driver runs): a module found only there is refused."""
    import sys

    for name in ("script_dir_reward", "path_reward"):
        (tmp_path / f"{name}.py").write_text("def score(record, text):\n    return 1.0\n")
        monkeypatch.delitem(sys.modules, name, raising=False)
    monkeypatch.syspath_prepend(str(tmp_path))  # sys.path[0], as for `python script.py` in tmp_path
    cfg = config(None, "task.reward_fn=script_dir_reward:score")
    with pytest.raises(ConfigError) as e:
        check_run_inputs(cfg, [PromptRecord("1=", "1", 0)], [])
    assert str(e.value).startswith(
        f"task.reward_fn='script_dir_reward:score': module 'script_dir_reward' was imported from {tmp_path}"
    )
    assert "outside the workers' import path" in str(e.value)
    sys.path.insert(1, sys.path.pop(0))  # on PYTHONPATH: the workers see it
    check_run_inputs(config(None, "task.reward_fn=path_reward:score"), [PromptRecord("1=", "1", 0)], [])
