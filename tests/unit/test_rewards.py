"""Built-in rewards (math, exact_match, char_match), their resolution by name, and the check that
fails a step on a raising, non-finite or non-number reward, naming the prompt and group."""

from __future__ import annotations

import pickle

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from algorithms.rewards import (
    _PLAIN_NUMBER,
    BUILTIN_REWARDS,
    RewardError,
    checked_reward,
    exact_match_score,
    math_score,
    resolve_reward_fn,
    unparsable_references,
)
from algorithms.tasks import PromptRecord

REC = PromptRecord("What is 12 + 7?", "19", 3, source="data.jsonl:4")


@pytest.mark.parametrize(
    ("response", "score"),
    [
        ("Adding them: 12 + 7 = 19, so the answer is 19", 1.0),
        ("the answer is 18", 0.0),
        ("\\boxed{19}", 1.0),
        ("We get $\\frac{38}{2}$", 1.0),
        ("19.0", 1.0),
        ("I do not know", 0.0),
        ("", 0.0),
    ],
)
def test_math_reward_compares_the_final_answer_symbolically(response: str, score: float) -> None:
    assert resolve_reward_fn("math", "digit_map")(REC, response) == score


def test_math_reward_refuses_a_reference_it_cannot_parse() -> None:
    with pytest.raises(ValueError, match="cannot parse the reference answer 'nineteen'"):
        math_score("nineteen", "19")


def test_every_reference_answer_the_math_reward_cannot_parse_is_found() -> None:
    answers = ["19", "nineteen", "19", "\\frac{1}{2}", "x^2+1", "$x^2+1$", "1,000", "-3.5", " 7 ", "nineteen"]
    math = resolve_reward_fn("math", "digit_map")
    assert unparsable_references(math, answers) == [1, 4, 9]
    for i in (1, 4):  # what the check refuses, the reward raises on when such a prompt is drawn
        with pytest.raises(ValueError, match="cannot parse the reference answer"):
            math_score(answers[i], "19")
    for i in (0, 3, 5, 6, 7, 8):
        assert math_score(answers[i], f"the answer is {answers[i].strip()}") == 1.0
    # by task name too; no other reward has references it cannot score
    assert unparsable_references(resolve_reward_fn(None, "math"), ["nineteen"]) == [0]
    assert unparsable_references(resolve_reward_fn("exact_match", "digit_map"), answers) == []
    assert unparsable_references(resolve_reward_fn(None, "digit_map"), answers) == []


@settings(max_examples=100, deadline=None)
@given(st.from_regex(_PLAIN_NUMBER, fullmatch=True), st.sampled_from(["", " ", "\n"]))
def test_every_plain_number_the_check_does_not_parse_is_one_math_verify_parses(number: str, pad: str) -> None:
    """The check skips math-verify for plain numbers: each one must be an answer it parses."""
    import math_verify

    assert math_verify.parse(pad + number + pad, parsing_timeout=5), number
    # Other scripts' digits and leading zeros go through the parse ("-01" does not parse).
    assert not any(_PLAIN_NUMBER.fullmatch(s) for s in ("\u0661\u0662", "-01", "007"))


def test_math_reward_works_off_the_main_thread() -> None:
    # The collector scores in a producer thread, where math-verify's SIGALRM bound cannot run.
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(1) as ex:
        assert ex.submit(math_score, "19", "the answer is 19").result() == 1.0
        assert ex.submit(math_score, "19", "the answer is 18").result() == 0.0


def test_builtin_rewards_by_name() -> None:
    assert set(BUILTIN_REWARDS) == {"math", "exact_match", "char_match"}
    assert exact_match_score("19", "  19\n") == 1.0 and exact_match_score("19", "190") == 0.0
    char = resolve_reward_fn("char_match", "digit_map")
    assert char(PromptRecord("p", "381", 0), "38") == pytest.approx(2 / 3)
    # by task name when reward_fn is unset, and picklable (they ship to Ray workers)
    assert pickle.loads(pickle.dumps(resolve_reward_fn(None, "exact_match")))(REC, " 19 ") == 1.0
    assert pickle.loads(pickle.dumps(resolve_reward_fn("math", "copy")))(REC, "19") == 1.0
    with pytest.raises(ValueError, match="expected one of"):
        resolve_reward_fn("maths", "copy")


def _nan(record: PromptRecord, text: str) -> float:
    return float("nan")


def _raises(record: PromptRecord, text: str) -> float:
    raise KeyError("no score")


@pytest.mark.parametrize(
    ("fn", "match"),
    [
        (_nan, r"returned nan on prompt uid 3 \('What is 12 \+ 7\?', data\.jsonl:4\) of group 11; it must be finite"),
        (lambda r, t: float("inf"), r"returned inf on prompt uid 3 .* of group 11"),
        (_raises, r"reward_fn 'mine' raised KeyError on prompt uid 3 \('What is 12 \+ 7\?'.* of group 11: 'no score'"),
        (lambda r, t: "1.0", r"returned '1.0' \(a str\) on prompt uid 3 .*must return a real number"),
        (lambda r, t: None, r"returned None \(a NoneType\)"),
    ],
)
def test_a_bad_reward_fails_naming_the_prompt_and_group(fn, match: str) -> None:
    with pytest.raises(RewardError, match=match):
        checked_reward(fn, REC, "19", name="mine", group=11)


def test_a_good_reward_passes_through_as_a_float() -> None:
    import numpy as np

    assert checked_reward(lambda r, t: np.float32(0.5), REC, "x", name="mine") == 0.5
    assert checked_reward(lambda r, t: 1, REC, "x", name="mine") == 1.0
    with pytest.raises(RewardError, match=r"on prompt uid 3 \('What is 12 \+ 7\?', data\.jsonl:4\): "):
        checked_reward(_raises, REC, "x", name="mine")  # no group: none named
