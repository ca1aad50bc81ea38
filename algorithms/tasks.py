"""Toy verifiable tasks, a character-level tokenizer, reward functions and a resumable prompt iterator.

Everything here is pure Python (no torch, no Ray) so the driver, the workers and the tests can
share it. The built-in tasks are generated from a seed and scored by a pure function; the default
task (``digit_map``) is learnable from a randomly initialised tiny model in a couple of minutes on
a laptop CPU.
"""

from __future__ import annotations

import importlib
import json
import math
import os
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = [
    "BUILTIN_TASKS",
    "CharTokenizer",
    "PromptIterator",
    "PromptRecord",
    "RewardFn",
    "char_match_score",
    "load_jsonl_dataset",
    "make_task_dataset",
    "resolve_reward_fn",
    "reward",
    "task_ignores_eos",
]

# ---------------------------------------------------------------------------------------------
# Tokenizer
# ---------------------------------------------------------------------------------------------

_SPECIALS: tuple[str, ...] = ("<pad>", "<bos>", "<eos>")
# Fixed vocabulary shipped in code: digits, a few letters and symbols. Kept small on purpose: the
# chance of sampling the right character from a random model is ~1/len(vocab), which decides how
# fast a model learns from scratch.
_CHARS: tuple[str, ...] = tuple("0123456789abcdefghij +-*/=<>:,.")


class CharTokenizer:
    """Character-level tokenizer with a fixed vocabulary: ``<pad>`` = 0, ``<bos>`` = 1, ``<eos>`` = 2.

    ``encode`` raises ``ValueError`` naming the character and its position for text outside the
    vocabulary; ``decode`` stops at the first ``<eos>`` and skips ``<pad>``/``<bos>``.
    """

    def __init__(self, chars: Sequence[str] = _CHARS) -> None:
        chars = tuple(chars)
        for c in chars:
            if len(c) != 1:
                raise ValueError(f"CharTokenizer: vocabulary entries must be single characters, got {c!r}")
        if len(set(chars)) != len(chars):
            raise ValueError("CharTokenizer: vocabulary has duplicate characters")
        self._chars = chars
        self._itos: tuple[str, ...] = _SPECIALS + chars
        self._stoi: dict[str, int] = {c: i + len(_SPECIALS) for i, c in enumerate(chars)}

    pad_id: int = 0
    bos_id: int = 1
    eos_id: int = 2

    @property
    def vocab_size(self) -> int:
        return len(self._itos)

    @property
    def chars(self) -> tuple[str, ...]:
        return self._chars

    def encode(self, text: str, *, add_bos: bool = False, add_eos: bool = False) -> list[int]:
        ids: list[int] = [self.bos_id] if add_bos else []
        for pos, c in enumerate(text):
            tok = self._stoi.get(c)
            if tok is None:
                raise ValueError(
                    f"CharTokenizer.encode: character {c!r} at position {pos} of {text!r} is not in the "
                    f"vocabulary {''.join(self._chars)!r}"
                )
            ids.append(tok)
        if add_eos:
            ids.append(self.eos_id)
        return ids

    def encode_prompt(self, text: str) -> list[int]:
        """The canonical model input for a prompt: ``<bos>`` followed by the prompt's characters."""
        return self.encode(text, add_bos=True)

    def decode(self, ids: Sequence[int]) -> str:
        out: list[str] = []
        for i in ids:
            i = int(i)
            if i == self.eos_id:
                break
            if i in (self.pad_id, self.bos_id):
                continue
            if not 0 <= i < len(self._itos):
                raise ValueError(f"CharTokenizer.decode: token id {i} outside [0, {len(self._itos)})")
            out.append(self._itos[i])
        return "".join(out)

    def save(self, directory: str | os.PathLike[str]) -> str:
        """Write ``char_tokenizer.json`` into ``directory``; returns the file path."""
        os.makedirs(directory, exist_ok=True)
        path = os.path.join(directory, "char_tokenizer.json")
        with open(path, "w", encoding="utf-8") as f:
            json.dump({"type": "CharTokenizer", "specials": list(_SPECIALS), "chars": list(self._chars)}, f)
        return path

    @classmethod
    def load(cls, directory: str | os.PathLike[str]) -> CharTokenizer:
        path = os.path.join(directory, "char_tokenizer.json")
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        if data.get("type") != "CharTokenizer" or tuple(data.get("specials", ())) != _SPECIALS:
            raise ValueError(f"CharTokenizer.load: {path} is not a CharTokenizer file with specials {_SPECIALS}")
        return cls(data["chars"])

    def __eq__(self, other: object) -> bool:
        return isinstance(other, CharTokenizer) and other._chars == self._chars

    def __repr__(self) -> str:
        return f"CharTokenizer(vocab_size={self.vocab_size})"


# ---------------------------------------------------------------------------------------------
# Datasets
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PromptRecord:
    """One prompt with its reference answer; ``uid`` is unique within a dataset;
    ``max_new_tokens``: this prompt's own response length limit (``None``: the run's)."""

    prompt: str
    answer: str
    uid: int
    max_new_tokens: int | None = None


# digit_map's fixed target per prompt digit: a permutation of 0-9 with no fixed points, so the
# model cannot score by echoing the prompt.
_DIGIT_MAP: tuple[int, ...] = (7, 3, 9, 5, 0, 8, 1, 4, 6, 2)
_STRING_LEN = 3  # digit-string length of the copy / reverse tasks

# Long-tail profiles: each prompt's response length is drawn from a log-normal whose p99 / p50 is
# the value here, scaled so that p99 is the run's generation.max_new_tokens; responses run to
# their length (EOS is ignored), so the lengths follow the declared distribution whatever the model.
LONGTAIL_P99_OVER_P50: dict[str, float] = {"longtail": 20.0, "longtail-mild": 4.0}
_Z99 = 2.326347874  # the standard normal's 0.99 quantile

BUILTIN_TASKS: tuple[str, ...] = ("digit_map", "copy", "reverse", *LONGTAIL_P99_OVER_P50)


def task_ignores_eos(task: str) -> bool:
    """Whether a task's responses run to their own length limit whatever the model emits."""
    return task in LONGTAIL_P99_OVER_P50


def longtail_length(rng: random.Random, p99_over_p50: float, max_new_tokens: int) -> int:
    """One draw of a long-tail profile's response length, in ``[1, max_new_tokens]``."""
    sigma = math.log(p99_over_p50) / _Z99
    median = max_new_tokens / p99_over_p50
    return max(1, min(max_new_tokens, round(median * math.exp(sigma * rng.gauss(0.0, 1.0)))))


def make_task_dataset(task: str, seed: int, n: int, max_new_tokens: int = 8) -> list[PromptRecord]:
    """``n`` records of a built-in task drawn from ``seed``; ``uid`` = index.

    Tasks (prompt -> answer): ``digit_map`` ``"4="`` -> ``"0"`` (fixed permutation of the digits);
    ``copy`` ``"381="`` -> ``"381"``; ``reverse`` ``"381="`` -> ``"183"``; ``longtail`` and
    ``longtail-mild`` ``"381="`` -> ``"381381..."``, the digits repeated to the record's own length
    (:func:`longtail_length` of ``max_new_tokens``), scored by character match like the others.
    """
    if task not in BUILTIN_TASKS:
        raise ValueError(f"make_task_dataset: unknown task {task!r}; built-in tasks are {list(BUILTIN_TASKS)}")
    if n < 0:
        raise ValueError(f"make_task_dataset: n must be >= 0, got {n}")
    rng = random.Random(f"{task}:{seed}")
    records: list[PromptRecord] = []
    for uid in range(n):
        if task == "digit_map":
            d = rng.randrange(10)
            records.append(PromptRecord(prompt=f"{d}=", answer=str(_DIGIT_MAP[d]), uid=uid))
        elif task in LONGTAIL_P99_OVER_P50:
            s = "".join(str(rng.randrange(10)) for _ in range(_STRING_LEN))
            length = longtail_length(rng, LONGTAIL_P99_OVER_P50[task], max_new_tokens)
            answer = (s * (length // len(s) + 1))[:length]
            records.append(PromptRecord(prompt=f"{s}=", answer=answer, uid=uid, max_new_tokens=length))
        else:
            s = "".join(str(rng.randrange(10)) for _ in range(_STRING_LEN))
            answer = s if task == "copy" else s[::-1]
            records.append(PromptRecord(prompt=f"{s}=", answer=answer, uid=uid))
    return records


def load_jsonl_dataset(path: str | os.PathLike[str]) -> list[PromptRecord]:
    """Read a JSONL file with one ``{"prompt": str, "answer": str}`` object per line.

    Blank lines are skipped; ``uid`` is the record's index. Raises ``ValueError`` naming the file
    and 1-based line number for invalid JSON, a missing field or a non-string value.
    """
    records: list[PromptRecord] = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: invalid JSON ({e.msg})") from None
            if not isinstance(obj, dict):
                raise ValueError(f"{path}:{lineno}: expected a JSON object, got {type(obj).__name__}")
            for field in ("prompt", "answer"):
                if field not in obj:
                    raise ValueError(f"{path}:{lineno}: missing field {field!r}")
                if not isinstance(obj[field], str):
                    raise ValueError(
                        f"{path}:{lineno}: field {field!r} must be a string, got {type(obj[field]).__name__}"
                    )
            records.append(PromptRecord(prompt=obj["prompt"], answer=obj["answer"], uid=len(records)))
    if not records:
        raise ValueError(f"{path}: no records")
    return records


# ---------------------------------------------------------------------------------------------
# Rewards
# ---------------------------------------------------------------------------------------------

RewardFn = Callable[[PromptRecord, str], float]


def char_match_score(answer: str, response: str) -> float:
    """Position-wise character agreement: matches / max(len(answer), len(response)).

    1.0 only for an exact match; a right prefix followed by extra characters gets partial credit,
    which gives a model learning from scratch a gradient towards stopping at ``<eos>``.
    """
    denom = max(len(answer), len(response))
    if denom == 0:
        return 1.0
    return sum(a == b for a, b in zip(answer, response)) / denom


def reward(task: str, record: PromptRecord, response_text: str) -> float:
    """Built-in reward in [0, 1] for ``task`` (a pure function of its arguments).

    The built-in tasks and ``"char_match"`` (a name for custom JSONL data) use
    :func:`char_match_score`; ``"exact_match"`` gives 1.0 iff the response equals the answer.
    """
    if task == "exact_match":
        return float(response_text == record.answer)
    if task in BUILTIN_TASKS or task == "char_match":
        return char_match_score(record.answer, response_text)
    raise ValueError(
        f"reward: unknown task {task!r}; built-in rewards are {list(BUILTIN_TASKS) + ['char_match', 'exact_match']}"
    )


def resolve_reward_fn(spec: str | None, task: str) -> RewardFn:
    """The reward function for a run: ``spec`` = ``"pkg.module:function"`` or ``None`` for the task's built-in.

    The imported callable must accept ``(record: PromptRecord, response_text: str)`` and return a
    float. Raises ``ValueError`` for a malformed spec, ``ImportError``/``AttributeError`` naming the
    module/attribute when it cannot be found, ``TypeError`` when it is not callable.
    """
    if spec is None or spec == "":
        reward(task, PromptRecord("", "", 0), "")  # validates the task name now, not at the first step
        return _BuiltinReward(task)
    if not isinstance(spec, str) or spec.count(":") != 1:
        raise ValueError(f"reward_fn: expected 'pkg.module:function', got {spec!r}")
    module_name, attr = spec.split(":")
    if not module_name or not attr:
        raise ValueError(f"reward_fn: expected 'pkg.module:function', got {spec!r}")
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


@dataclass(frozen=True)
class _BuiltinReward:
    """Picklable built-in reward bound to a task (a lambda would not survive Ray serialisation)."""

    task: str

    def __call__(self, record: PromptRecord, response_text: str) -> float:
        return reward(self.task, record, response_text)


# ---------------------------------------------------------------------------------------------
# Prompt iterator
# ---------------------------------------------------------------------------------------------


class PromptIterator:
    """Endless, seeded stream of prompt batches: each epoch is a fresh shuffle of ``records``.

    A batch that crosses an epoch boundary is completed from the next epoch's shuffle, so every
    batch has exactly ``batch_size`` records. ``state_dict()`` captures the data position;
    ``load_state_dict`` on an iterator over the same records and seed resumes the identical stream.
    """

    def __init__(self, records: Sequence[PromptRecord], batch_size: int, seed: int) -> None:
        if not records:
            raise ValueError("PromptIterator: records is empty")
        if batch_size < 1:
            raise ValueError(f"PromptIterator: batch_size must be >= 1, got {batch_size}")
        self._records = list(records)
        self.batch_size = batch_size
        self.seed = seed
        self._epoch = 0
        self._pos = 0
        self._order = self._epoch_order(0)

    def _epoch_order(self, epoch: int) -> list[int]:
        order = list(range(len(self._records)))
        random.Random(f"prompts:{self.seed}:{epoch}").shuffle(order)
        return order

    def next_batch(self) -> list[PromptRecord]:
        batch: list[PromptRecord] = []
        while len(batch) < self.batch_size:
            if self._pos == len(self._order):
                self._epoch += 1
                self._pos = 0
                self._order = self._epoch_order(self._epoch)
            take = min(self.batch_size - len(batch), len(self._order) - self._pos)
            batch.extend(self._records[i] for i in self._order[self._pos : self._pos + take])
            self._pos += take
        return batch

    def __iter__(self) -> PromptIterator:
        return self

    def __next__(self) -> list[PromptRecord]:
        return self.next_batch()

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self._epoch, "position": self._pos, "seed": self.seed, "num_records": len(self._records)}

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        for k in ("epoch", "position", "seed", "num_records"):
            if k not in state:
                raise KeyError(f"PromptIterator.load_state_dict: missing {k!r}")
        if state["seed"] != self.seed or state["num_records"] != len(self._records):
            raise ValueError(
                f"PromptIterator.load_state_dict: state is for seed={state['seed']}, "
                f"num_records={state['num_records']}, this iterator has seed={self.seed}, "
                f"num_records={len(self._records)}"
            )
        if not 0 <= state["position"] <= len(self._records):
            raise ValueError(f"PromptIterator.load_state_dict: position {state['position']} out of range")
        self._epoch = int(state["epoch"])
        self._pos = int(state["position"])
        self._order = self._epoch_order(self._epoch)
