"""Reward functions: the built-in ones by name, a user's by ``"pkg.module:function"``, and the
check every score passes before it reaches the trainer.

A reward function takes ``(record: PromptRecord, response_text: str)`` and returns a finite real
number. Built-in (``task.reward_fn``): ``math`` (the response's final answer equals the
reference symbolically, by the ``math-verify`` package), ``exact_match`` (the stripped strings are
equal), ``char_match`` (position-wise character agreement, the toy tasks' reward). Pure Python;
``math_verify`` is imported by the ``math`` reward only.
"""

from __future__ import annotations

import importlib
import math
import numbers
import re
import sys
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from algorithms.tasks import BUILTIN_TASKS, PromptRecord
from nemo_dataplane.errors import NonFiniteError

__all__ = [
    "BUILTIN_REWARDS",
    "NonFiniteReward",
    "RewardError",
    "RewardFn",
    "RewardTimeout",
    "char_match_score",
    "checked_reward",
    "exact_match_score",
    "math_score",
    "resolve_reward_fn",
    "reward",
    "unparsable_references",
]

RewardFn = Callable[[PromptRecord, str], float]

BUILTIN_REWARDS: tuple[str, ...] = ("math", "exact_match", "char_match")


class RewardError(RuntimeError):
    """A reward function raised, or returned something other than a finite real number; the
    message names the reward, the prompt (uid, text, source) and the group when known."""


class RewardTimeout(RewardError):
    """A reward call did not answer within ``task.reward_timeout_s`` (its worker process was
    killed: :mod:`algorithms.reward_pool`); :func:`checked_reward` scores it 0."""


class NonFiniteReward(NonFiniteError, RewardError):
    """A reward function returned NaN or an infinity: one of the trainer's non-finite refusals
    (:class:`~nemo_dataplane.errors.NonFiniteError`) and a :class:`RewardError`."""


def char_match_score(answer: str, response: str) -> float:
    """Position-wise character agreement: matches / max(len(answer), len(response)).

    1.0 only for an exact match; a right prefix followed by extra characters gets partial credit,
    which gives a model learning from scratch a gradient towards stopping at ``<eos>``.
    """
    denom = max(len(answer), len(response))
    if denom == 0:
        return 1.0
    return sum(a == b for a, b in zip(answer, response)) / denom


def exact_match_score(answer: str, response: str) -> float:
    """1.0 iff the response equals the answer once both are stripped of surrounding whitespace."""
    return float(response.strip() == answer.strip())


def _math_verify() -> Any:
    try:
        import math_verify
    except ImportError as e:
        raise ImportError(
            "the math reward needs the math-verify package (pip install math-verify, or the `train` extra)"
        ) from e
    return math_verify


def math_score(answer: str, response: str) -> float:
    """1.0 iff the response's final answer (e.g. ``... the answer is 19``, ``\\boxed{19}``) equals
    the reference answer symbolically (``19.0``, ``\\frac{38}{2}`` count), else 0.0; a response
    without a parsable answer scores 0. Raises ``ValueError`` for a reference it cannot parse (the
    data is wrong: every response would score 0).

    ``math-verify`` bounds its parsing with ``SIGALRM``, which only the main thread may use: the
    bound (5 s, where its signal can interrupt the work) applies there and is off in other
    threads. The trainer calls it in a reward worker's main thread, under the hard bound
    ``task.reward_timeout_s`` (:mod:`algorithms.reward_pool`).
    """
    mv = _math_verify()
    limit = _parse_limit()
    gold = mv.parse(answer, parsing_timeout=limit)
    if not gold:
        raise ValueError(f"math reward: cannot parse the reference answer {answer!r}")
    pred = mv.parse(response, parsing_timeout=limit)
    return float(bool(pred) and mv.verify(gold, pred, timeout_seconds=limit))


def _parse_limit() -> int | None:
    """math-verify's parse bound: SIGALRM, which only the main thread may set."""
    return 5 if threading.current_thread() is threading.main_thread() else None


# A plain decimal number (optional sign, thousands commas, fraction digits; ASCII digits, no
# leading zero: math-verify refuses "-01"): math-verify parses every one (tests/unit/
# test_rewards.py checks samples of each form), so the check of a dataset's references skips its
# sympy parse, 2-15 ms an answer.
_PLAIN_NUMBER = re.compile(r"-?(0|[1-9]\d*|[1-9]\d{0,2}(,\d{3})+)(\.\d+)?", re.ASCII)


def unparsable_references(fn: RewardFn, answers: Sequence[str]) -> list[int]:
    """Indices of the ``answers`` that reward ``fn`` can never score: for the built-in ``math``
    reward, the reference answers math-verify cannot parse (:func:`math_score` raises on them
    when such a prompt is drawn); empty for every other reward. Each distinct answer is parsed
    once and plain numbers not at all."""
    if not (isinstance(fn, _BuiltinReward) and fn.name == "math"):
        return []
    mv, limit = _math_verify(), _parse_limit()
    verdicts: dict[str, bool] = {}
    for a in answers:
        if a not in verdicts:
            verdicts[a] = _PLAIN_NUMBER.fullmatch(a.strip()) is not None or bool(mv.parse(a, parsing_timeout=limit))
    return [i for i, a in enumerate(answers) if not verdicts[a]]


_SCORES: dict[str, Callable[[str, str], float]] = {
    "math": math_score,
    "exact_match": exact_match_score,
    "char_match": char_match_score,
}


def reward(name: str, record: PromptRecord, response_text: str) -> float:
    """The built-in reward ``name`` (one of :data:`BUILTIN_REWARDS`, or a built-in task, which
    scores by ``char_match``) of ``response_text`` against ``record.answer``."""
    score = _SCORES.get("char_match" if name in BUILTIN_TASKS else name)
    if score is None:
        raise ValueError(f"reward: unknown task {name!r}; built-in rewards are {list(BUILTIN_TASKS + BUILTIN_REWARDS)}")
    return score(record.answer, response_text)


@dataclass(frozen=True)
class _BuiltinReward:
    """Picklable built-in reward bound to a name (a lambda would not survive Ray serialisation)."""

    name: str

    def __call__(self, record: PromptRecord, response_text: str) -> float:
        return reward(self.name, record, response_text)


def resolve_reward_fn(spec: str | None, task: str) -> RewardFn:
    """The reward function for a run: ``spec`` = a built-in name (:data:`BUILTIN_REWARDS`),
    ``"pkg.module:function"``, or ``None`` for the built-in of ``task`` (a built-in task or reward name).

    Raises ``ValueError`` for an unknown name or a malformed spec, ``ImportError`` /
    ``AttributeError`` naming the module / attribute (or the package a built-in needs) when it
    cannot be found, ``TypeError`` when it is not callable.
    """
    name = task if spec in (None, "") else str(spec)
    if name in BUILTIN_REWARDS or (spec in (None, "") and name in BUILTIN_TASKS):
        if name == "math":
            _math_verify()  # a missing package fails now, not at the first step
        return _BuiltinReward(name)
    if spec in (None, ""):
        raise ValueError(f"reward: unknown task {task!r}; built-in rewards are {list(BUILTIN_TASKS + BUILTIN_REWARDS)}")
    if name.count(":") != 1 or not all(name.split(":")):
        raise ValueError(f"reward_fn: expected one of {list(BUILTIN_REWARDS)} or 'pkg.module:function', got {spec!r}")
    module_name, attr = name.split(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ImportError(f"reward_fn {spec!r}: cannot import module {module_name!r}: {e}") from e
    fn: Any = module
    for part in attr.split("."):
        if not hasattr(fn, part):
            raise AttributeError(f"reward_fn {spec!r}: module {module_name!r} has no attribute {attr!r}")
        fn = getattr(fn, part)
    if not callable(fn):
        raise TypeError(f"reward_fn {spec!r}: {attr!r} is not callable")
    return fn


def checked_reward(
    fn: RewardFn, record: PromptRecord, response_text: str, *, name: str, group: int | None = None
) -> float:
    """``fn(record, response_text)`` as a float; raises :class:`RewardError` naming the reward
    ``name``, the prompt and ``group`` when ``fn`` raises or returns anything but a finite real
    number (a NaN or a string would otherwise reach the advantages silently). A call past its time
    limit (:class:`RewardTimeout`) scores 0, with a line on stderr naming the prompt."""
    where = f"prompt uid {record.uid} ({record.prompt[:80]!r}"
    where += (f", {record.source})" if record.source else ")") + ("" if group is None else f" of group {group}")
    try:
        value = fn(record, response_text)
    except RewardTimeout as e:
        print(f"{e} on {where}: scored 0", file=sys.stderr, flush=True)
        return 0.0
    except Exception as e:
        raise RewardError(f"reward_fn {name!r} raised {type(e).__name__} on {where}: {e}") from e
    if not isinstance(value, numbers.Real):
        raise RewardError(
            f"reward_fn {name!r} returned {value!r} (a {type(value).__name__}) on {where}; it must return a real number"
        )
    if not math.isfinite(float(value)):
        raise NonFiniteReward(f"reward_fn {name!r} returned {value!r} on {where}; it must be finite")
    return float(value)
