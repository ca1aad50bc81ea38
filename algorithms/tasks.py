"""Toy verifiable tasks, a character-level tokenizer, prompt datasets and a resumable prompt iterator.

Everything here is pure Python (no torch, no Ray) so the driver, the workers and the tests can
share it. The built-in tasks are generated from a seed and scored by character match
(:mod:`algorithms.rewards`); the default task (``digit_map``) is learnable from a randomly
initialised tiny model in a couple of minutes on a laptop CPU. A dataset is a local JSONL or
Parquet file (:func:`load_dataset`).
"""

from __future__ import annotations

import json
import math
import os
import random
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "BUILTIN_TASKS",
    "DATASET_FORMATS",
    "CharTokenizer",
    "PromptIterator",
    "PromptRecord",
    "load_dataset",
    "make_task_dataset",
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
    """Character-level tokenizer with a fixed vocabulary: ``<pad>`` = 0, ``<bos>`` = 1, ``<eos>`` = 2
    (an :class:`algorithms.tokenizers.Tokenizer`; ``system_prompt``: text put before every prompt).

    ``encode`` raises ``ValueError`` naming the character and its position for text outside the
    vocabulary; ``decode`` stops at the first ``<eos>`` and skips ``<pad>``/``<bos>``.
    """

    def __init__(self, chars: Sequence[str] = _CHARS, *, system_prompt: str | None = None) -> None:
        chars = tuple(chars)
        for c in chars:
            if len(c) != 1:
                raise ValueError(f"CharTokenizer: vocabulary entries must be single characters, got {c!r}")
        if len(set(chars)) != len(chars):
            raise ValueError("CharTokenizer: vocabulary has duplicate characters")
        self._chars = chars
        self._itos: tuple[str, ...] = _SPECIALS + chars
        self._stoi: dict[str, int] = {c: i + len(_SPECIALS) for i, c in enumerate(chars)}
        self.system_prompt = system_prompt

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
        """The canonical model input for a prompt: ``<bos>``, then ``system_prompt`` (if any,
        prepended as is), then the prompt's characters."""
        return self.encode((self.system_prompt or "") + text, add_bos=True)

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
        return (
            isinstance(other, CharTokenizer)
            and other._chars == self._chars
            and other.system_prompt == self.system_prompt
        )

    def __repr__(self) -> str:
        return f"CharTokenizer(vocab_size={self.vocab_size})"


# ---------------------------------------------------------------------------------------------
# Datasets
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PromptRecord:
    """One prompt with its reference answer; ``uid`` is unique within a dataset;
    ``max_new_tokens``: this prompt's own response length limit (``None``: the run's);
    ``source``: where it was read from (``None`` for generated tasks)."""

    prompt: str
    answer: str
    uid: int
    max_new_tokens: int | None = None
    # Where the record was read (file:line or file row i), for messages; not part of its identity.
    source: str | None = field(default=None, compare=False)


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


DATASET_FORMATS: tuple[str, ...] = (".jsonl", ".parquet")


def load_dataset(path: str | os.PathLike[str], *, prompt_key: str, answer_key: str) -> list[PromptRecord]:
    """Prompt records from a local JSONL (one object per line, blank lines skipped) or Parquet file,
    picked by the file's suffix (:data:`DATASET_FORMATS`).

    Each row's ``prompt_key`` must be a string and its ``answer_key`` a string or a number (kept
    as its text, e.g. ``19`` -> ``"19"``); other keys are ignored. ``uid`` is the record's index;
    ``source`` is where it came from (``file:line`` for JSONL, 1-based; ``file row i`` for Parquet,
    0-based). Raises ``ValueError`` naming the file, the line or row and the key for invalid JSON,
    a missing key (listing the keys the row has), a null or a value of the wrong type, and for a
    file without records; ``ImportError`` naming ``pyarrow`` and how to install it when a Parquet
    file is given and the package is missing.
    """
    suffix = Path(path).suffix.lower()
    if suffix == ".jsonl":
        rows = _jsonl_rows(path)
    elif suffix == ".parquet":
        rows = _parquet_rows(path, (prompt_key, answer_key))
    else:
        raise ValueError(f"{path}: unknown dataset format {suffix!r}; expected one of {list(DATASET_FORMATS)}")
    records: list[PromptRecord] = []
    for where, row in rows:
        prompt = _value(row, prompt_key, where, (str,), "a string")
        answer = _value(row, answer_key, where, (str, int, float), "a string or a number")
        records.append(PromptRecord(prompt=str(prompt), answer=str(answer), uid=len(records), source=where))
    if not records:
        raise ValueError(f"{path}: no records")
    return records


def _jsonl_rows(path: str | os.PathLike[str]) -> Iterator[tuple[str, dict[str, Any]]]:
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: invalid JSON ({e.msg})") from None
            if not isinstance(obj, dict):
                raise ValueError(f"{where}: expected a JSON object, got {type(obj).__name__}")
            yield where, obj


def _parquet_rows(path: str | os.PathLike[str], keys: Sequence[str]) -> Iterator[tuple[str, dict[str, Any]]]:
    try:
        import pyarrow.parquet as pq  # optional: only Parquet datasets need it
    except ImportError as e:
        raise ImportError(
            f"{path}: reading a Parquet dataset needs the pyarrow package (in the train extra: "
            "pip install -e '.[train]', or pip install pyarrow)"
        ) from e
    names = pq.read_schema(path).names
    for key in keys:
        if key not in names:
            raise ValueError(f"{path} row 0: missing key {key!r} (the file's columns are {names})")
    table = pq.read_table(path, columns=list(dict.fromkeys(keys)))
    for i, row in enumerate(table.to_pylist()):
        yield f"{path} row {i}", row


def _value(row: Mapping[str, Any], key: str, where: str, types: tuple[type, ...], what: str) -> Any:
    if key not in row:
        raise ValueError(f"{where}: missing key {key!r} (the row has keys {sorted(row)})")
    if row[key] is None:
        raise ValueError(f"{where}: missing key {key!r} (its value is null)")
    value = row[key]
    if not isinstance(value, types) or isinstance(value, bool):  # a bool is an int to Python, not an answer
        raise ValueError(f"{where}: key {key!r} must be {what}, got {type(value).__name__}")
    return value


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
