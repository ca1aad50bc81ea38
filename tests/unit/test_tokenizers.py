"""The tokenizer interface, its factory and the load-time checks of the run's inputs, on a real
checkpoint built at test time (``make_real_model`` / ``real_model`` in tests/conftest.py)."""

from __future__ import annotations

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
