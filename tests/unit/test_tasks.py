"""Tokenizer, built-in tasks, rewards, JSONL and Parquet loading, reward_fn resolution and the prompt iterator."""

from __future__ import annotations

import json
import pickle
import sys
import textwrap
from collections import Counter
from pathlib import Path

import pytest

from algorithms.rewards import char_match_score, resolve_reward_fn, reward
from algorithms.tasks import (
    BUILTIN_TASKS,
    CharTokenizer,
    PromptIterator,
    PromptRecord,
    load_dataset,
    make_task_dataset,
)


def load_jsonl_dataset(path: Path) -> list[PromptRecord]:
    return load_dataset(path, prompt_key="prompt", answer_key="answer")


def test_tokenizer_roundtrip_and_specials(tmp_path: Path) -> None:
    tok = CharTokenizer()
    assert (tok.pad_id, tok.bos_id, tok.eos_id) == (0, 1, 2)
    assert 20 <= tok.vocab_size <= 40
    ids = tok.encode("381=", add_bos=True, add_eos=True)
    assert ids[0] == tok.bos_id and ids[-1] == tok.eos_id and len(ids) == 6
    assert len(set(ids)) == 6 and all(0 <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids) == "381="
    assert tok.encode_prompt("7=") == tok.encode("7=", add_bos=True)
    # decode stops at the first eos and skips pad
    assert tok.decode(tok.encode("12") + [tok.eos_id] + tok.encode("34")) == "12"
    assert tok.decode([tok.pad_id] + tok.encode("5") + [tok.pad_id]) == "5"
    tok.save(tmp_path)
    assert CharTokenizer.load(tmp_path) == tok


def test_tokenizer_errors_name_the_character() -> None:
    tok = CharTokenizer()
    with pytest.raises(ValueError, match=r"'Z' at position 2"):
        tok.encode("12Z")
    with pytest.raises(ValueError, match="token id 99"):
        tok.decode([3, 99])


@pytest.mark.parametrize("task", BUILTIN_TASKS)
def test_datasets_are_seeded_and_correct(task: str) -> None:
    a = make_task_dataset(task, seed=3, n=50)
    assert a == make_task_dataset(task, seed=3, n=50)
    assert a != make_task_dataset(task, seed=4, n=50)
    assert [r.uid for r in a] == list(range(50))
    tok = CharTokenizer()
    for r in a:
        tok.encode(r.prompt + r.answer)  # everything is in the vocabulary
        assert reward(task, r, r.answer) == 1.0
        if task == "copy":
            assert r.prompt == r.answer + "="
        elif task == "reverse":
            assert r.prompt == r.answer[::-1] + "="
    assert len({r.prompt for r in a}) > 5


def test_digit_map_is_a_fixed_derangement() -> None:
    recs = make_task_dataset("digit_map", seed=0, n=200) + make_task_dataset("digit_map", seed=1, n=200)
    mapping: dict[str, set[str]] = {}
    for r in recs:
        mapping.setdefault(r.prompt, set()).add(r.answer)
    assert len(mapping) == 10 and all(len(v) == 1 for v in mapping.values())  # same target across seeds
    targets = {p[0]: next(iter(v)) for p, v in mapping.items()}
    assert sorted(targets.values()) == [str(d) for d in range(10)]
    assert all(p != t for p, t in targets.items())  # echoing the prompt digit never scores
    assert max(Counter(r.prompt for r in recs).values()) < 80  # roughly uniform digits


def test_reward_partial_credit() -> None:
    r = PromptRecord("381=", "381", 0)
    assert reward("copy", r, "381") == 1.0
    assert reward("copy", r, "38") == pytest.approx(2 / 3)
    assert reward("copy", r, "3812") == pytest.approx(3 / 4)
    assert reward("copy", r, "") == 0.0
    assert reward("copy", r, "183") == pytest.approx(1 / 3)
    assert reward("exact_match", r, "38") == 0.0 and reward("exact_match", r, "381") == 1.0
    assert char_match_score("", "") == 1.0
    with pytest.raises(ValueError, match="unknown task 'nope'"):
        reward("nope", r, "381")
    with pytest.raises(ValueError, match="unknown task"):
        make_task_dataset("nope", 0, 3)


def test_load_jsonl(tmp_path: Path) -> None:
    p = tmp_path / "d.jsonl"
    p.write_text(
        json.dumps({"prompt": "12=", "answer": "21"})
        + "\n\n"
        + json.dumps({"prompt": "3=", "answer": "3", "x": 1})
        + "\n"
    )
    recs = load_jsonl_dataset(p)
    assert recs == [PromptRecord("12=", "21", 0), PromptRecord("3=", "3", 1)]
    assert [r.source for r in recs] == [f"{p}:1", f"{p}:3"]


def test_load_jsonl_with_custom_keys_and_numeric_answers(tmp_path: Path) -> None:
    p = tmp_path / "math.jsonl"
    p.write_text(json.dumps({"question": "What is 12 + 7?", "solution": 19}) + "\n")
    recs = load_dataset(p, prompt_key="question", answer_key="solution")
    assert recs == [PromptRecord("What is 12 + 7?", "19", 0)]
    with pytest.raises(ValueError, match=r"math\.jsonl:1: missing key 'prompt'"):
        load_jsonl_dataset(p)


def test_load_parquet_with_custom_keys_and_a_missing_key(tmp_path: Path) -> None:
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    p = tmp_path / "d.parquet"
    pq.write_table(pa.table({"question": ["What is 1 + 2?", "What is 3 + 4?"], "gold": ["3", "7"], "x": [1, 2]}), p)
    recs = load_dataset(p, prompt_key="question", answer_key="gold")
    assert recs == [PromptRecord("What is 1 + 2?", "3", 0), PromptRecord("What is 3 + 4?", "7", 1)]
    assert recs[1].source == f"{p} row 1"
    with pytest.raises(ValueError, match=r"d\.parquet row 0: missing key 'answer' \(the file's columns are"):
        load_dataset(p, prompt_key="question", answer_key="answer")
    pq.write_table(pa.table({"question": ["a", None], "gold": ["1", "2"]}), p)
    with pytest.raises(ValueError, match=r"d\.parquet row 1: missing key 'question'"):
        load_dataset(p, prompt_key="question", answer_key="gold")


def test_parquet_without_pyarrow_names_the_package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # import pyarrow now raises ImportError
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    with pytest.raises(ImportError, match="needs the pyarrow package"):
        load_dataset(tmp_path / "d.parquet", prompt_key="prompt", answer_key="answer")


def test_a_resumed_iterator_over_a_loaded_dataset_gives_the_same_stream(tmp_path: Path) -> None:
    p = tmp_path / "d.jsonl"
    p.write_text("".join(json.dumps({"q": f"{i}=", "a": str(i)}) + "\n" for i in range(7)))
    recs = load_dataset(p, prompt_key="q", answer_key="a")
    it = PromptIterator(recs, batch_size=3, seed=1)
    it.next_batch()
    state = json.loads(json.dumps(it.state_dict()))
    expect = [it.next_batch() for _ in range(3)]
    again = PromptIterator(load_dataset(p, prompt_key="q", answer_key="a"), batch_size=3, seed=1)
    again.load_state_dict(state)
    assert [again.next_batch() for _ in range(3)] == expect


@pytest.mark.parametrize(
    ("lines", "match"),
    [
        (['{"prompt": "1", "answer": "2"}', "{bad json"], r"d\.jsonl:2: invalid JSON"),
        (['{"prompt": "1"}'], r":1: missing key 'answer'"),
        (['{"prompt": 1, "answer": "2"}'], r":1: key 'prompt' must be a string, got int"),
        (['{"prompt": "1", "answer": true}'], r":1: key 'answer' must be a string or a number, got bool"),
        (["[1, 2]"], r":1: expected a JSON object"),
        ([""], "no records"),
    ],
)
def test_load_jsonl_errors_name_the_line(tmp_path: Path, lines: list[str], match: str) -> None:
    p = tmp_path / "d.jsonl"
    p.write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError, match=match):
        load_jsonl_dataset(p)


def test_resolve_reward_fn(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    rec = PromptRecord("12=", "12", 0)
    builtin = resolve_reward_fn(None, "copy")
    assert builtin(rec, "1") == 0.5
    assert pickle.loads(pickle.dumps(builtin))(rec, "12") == 1.0  # ships to Ray workers
    with pytest.raises(ValueError, match="unknown task"):
        resolve_reward_fn(None, "nope")

    (tmp_path / "my_rewards_mod.py").write_text(
        textwrap.dedent(
            """
            def length_reward(record, text):
                return float(len(text) == len(record.answer))
            NOT_CALLABLE = 3
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    fn = resolve_reward_fn("my_rewards_mod:length_reward", "copy")
    assert fn(rec, "99") == 1.0 and fn(rec, "9") == 0.0
    with pytest.raises(ValueError, match="pkg.module:function"):
        resolve_reward_fn("my_rewards_mod.length_reward", "copy")
    with pytest.raises(ImportError, match="cannot import module 'no_such_mod_xyz'"):
        resolve_reward_fn("no_such_mod_xyz:f", "copy")
    with pytest.raises(AttributeError, match="has no attribute 'missing'"):
        resolve_reward_fn("my_rewards_mod:missing", "copy")
    with pytest.raises(TypeError, match="not callable"):
        resolve_reward_fn("my_rewards_mod:NOT_CALLABLE", "copy")
    sys.modules.pop("my_rewards_mod", None)


def test_prompt_iterator_epochs_and_resume() -> None:
    recs = make_task_dataset("copy", seed=0, n=10)
    it = PromptIterator(recs, batch_size=4, seed=7)
    batches = [it.next_batch() for _ in range(5)]  # 20 records = exactly 2 epochs
    assert all(len(b) == 4 for b in batches)
    flat = [r.uid for b in batches for r in b]
    assert sorted(flat[:10]) == list(range(10)) and sorted(flat[10:]) == list(range(10))
    assert flat[:10] != flat[10:]  # reshuffled per epoch
    assert flat[:10] != list(range(10))

    it2 = PromptIterator(recs, batch_size=4, seed=7)
    assert [r.uid for r in next(iter(it2))] == flat[:4]  # same seed, same stream
    it2.next_batch()
    state = it2.state_dict()
    expect = [[r.uid for r in it2.next_batch()] for _ in range(3)]  # crosses the epoch boundary
    it3 = PromptIterator(recs, batch_size=4, seed=7)
    it3.load_state_dict(json.loads(json.dumps(state)))  # state survives JSON
    assert [[r.uid for r in it3.next_batch()] for _ in range(3)] == expect
    assert expect == [flat[8:12], flat[12:16], flat[16:20]]

    with pytest.raises(ValueError, match="seed=7"):
        PromptIterator(recs, batch_size=4, seed=8).load_state_dict(state)
    with pytest.raises(ValueError, match="batch_size"):
        PromptIterator(recs, batch_size=0, seed=0)
