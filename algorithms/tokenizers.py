"""The run's tokenizer: one interface (:class:`Tokenizer`), two implementations, one factory.

* :class:`~algorithms.tasks.CharTokenizer`: the toy tasks' fixed character vocabulary.
* :class:`HFTokenizer`: a checkpoint's own Hugging Face tokenizer, loaded from a local directory
  (``local_files_only``: nothing is downloaded).

:func:`build_tokenizer` is the one place that chooses between them, from ``policy.tokenizer``
(:func:`tokenizer_dir`); the collector, the policy ranks and the generation engines all call it
and talk to the interface only. The tokenizer also carries the run's prompt format
(``task.system_prompt``, ``task.chat_template``), so :meth:`Tokenizer.encode_prompt` is the
model input for a dataset prompt everywhere.

``transformers`` is imported by :class:`HFTokenizer` only (a char-tokenizer run never loads it here).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from algorithms.config import ConfigError, TrainerConfig
from algorithms.tasks import CharTokenizer

__all__ = [
    "TOKENIZER_FILES",
    "HFTokenizer",
    "NoChatTemplate",
    "Tokenizer",
    "build_tokenizer",
    "check_tokenizer_record",
    "tokenizer_dir",
    "tokenizer_record",
]

# Any one of these in a directory means it holds a Hugging Face tokenizer.
TOKENIZER_FILES: tuple[str, ...] = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


class NoChatTemplate(ValueError):
    """``chat_template`` was asked of a tokenizer that has none."""


@runtime_checkable
class Tokenizer(Protocol):
    """What the trainer needs of a tokenizer.

    ``vocab_size``: ids are in ``[0, vocab_size)`` (the model's embedding needs at least that many
    rows). ``bos_id`` may be ``None`` (a tokenizer without one: prompts start without it);
    ``eos_id`` ends generation; ``pad_id`` fills padding (never scored). ``encode`` maps text to
    ids with no special tokens unless asked; ``encode_prompt`` is the model input for a dataset
    prompt in the run's format; ``decode`` stops at the first ``eos_id`` and drops special tokens.
    ``save`` writes what the tokenizer's own loader reads back; returns the path written.
    """

    @property
    def vocab_size(self) -> int: ...

    @property
    def bos_id(self) -> int | None: ...

    @property
    def eos_id(self) -> int: ...

    @property
    def pad_id(self) -> int: ...

    def encode(self, text: str, *, add_bos: bool = False, add_eos: bool = False) -> list[int]: ...

    def encode_prompt(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def save(self, directory: str | os.PathLike[str]) -> str: ...


class HFTokenizer:
    """A Hugging Face tokenizer from the local directory ``path``.

    Special ids: ``bos_id`` / ``eos_id`` are the tokenizer's; a tokenizer without an EOS token is
    refused (generation could never stop); one without a pad token pads with EOS (padding is
    masked, so the id only has to exist). ``vocab_size`` counts added tokens too.

    Prompts: with ``chat_template`` the prompt is the user turn (after a system turn holding
    ``system_prompt``, if given) rendered by the tokenizer's ``apply_chat_template`` with the
    generation prompt, and the template decides the special tokens; a tokenizer without a chat
    template is refused. Without it the prompt is ``<bos>`` (if the tokenizer has one) followed by
    ``system_prompt + text`` (prepended as is: include your own separator).

    Raises ``ValueError`` naming ``path`` for a directory it cannot load or a tokenizer it refuses
    (:class:`NoChatTemplate` for a missing chat template).
    """

    def __init__(
        self, path: str | os.PathLike[str], *, chat_template: bool = False, system_prompt: str | None = None
    ) -> None:
        from transformers import AutoTokenizer  # slow to import: only a run with a HF tokenizer pays for it

        self.path = os.fspath(path)
        try:
            self._tok: Any = AutoTokenizer.from_pretrained(self.path, local_files_only=True)
        except (OSError, ValueError) as e:
            raise ValueError(f"cannot load a Hugging Face tokenizer from {self.path!r}: {e}") from e
        if self._tok.eos_token_id is None:
            raise ValueError(f"the tokenizer in {self.path!r} has no EOS token: generation could never stop")
        if chat_template and not getattr(self._tok, "chat_template", None):
            raise NoChatTemplate(f"the tokenizer in {self.path!r} has no chat template")
        self.chat_template = chat_template
        self.system_prompt = system_prompt

    @property
    def vocab_size(self) -> int:
        return len(self._tok)

    @property
    def bos_id(self) -> int | None:
        bos = self._tok.bos_token_id
        return None if bos is None else int(bos)

    @property
    def eos_id(self) -> int:
        return int(self._tok.eos_token_id)

    @property
    def pad_id(self) -> int:
        pad = self._tok.pad_token_id
        return self.eos_id if pad is None else int(pad)

    def encode(self, text: str, *, add_bos: bool = False, add_eos: bool = False) -> list[int]:
        ids = [int(i) for i in self._tok.encode(text, add_special_tokens=False)]
        if add_bos and self.bos_id is not None:
            ids.insert(0, self.bos_id)
        if add_eos:
            ids.append(self.eos_id)
        return ids

    def encode_prompt(self, text: str) -> list[int]:
        if not self.chat_template:
            return self.encode((self.system_prompt or "") + text, add_bos=True)
        messages = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        messages.append({"role": "user", "content": text})
        # Rendered to text first: what tokenize=True returns differs across transformers versions.
        rendered = self._tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return [int(i) for i in self._tok.encode(rendered, add_special_tokens=False)]

    def decode(self, ids: Sequence[int]) -> str:
        ids = [int(i) for i in ids]
        if self.eos_id in ids:
            ids = ids[: ids.index(self.eos_id)]
        return str(self._tok.decode(ids, skip_special_tokens=True))

    def save(self, directory: str | os.PathLike[str]) -> str:
        self._tok.save_pretrained(os.fspath(directory))
        return os.fspath(directory)

    def __repr__(self) -> str:
        return f"HFTokenizer({self.path!r}, vocab_size={self.vocab_size})"


def _has_tokenizer(directory: str | os.PathLike[str]) -> bool:
    return any((Path(directory) / name).is_file() for name in TOKENIZER_FILES)


def tokenizer_dir(cfg: TrainerConfig) -> str | None:
    """The Hugging Face tokenizer directory the run uses, or ``None`` for the character tokenizer.

    ``policy.tokenizer``: ``char``: none; a path: that directory (it must hold a tokenizer);
    ``auto``: ``policy.model.path`` if that directory holds a tokenizer, else none.
    Raises :class:`ConfigError` naming ``policy.tokenizer`` for a path without a tokenizer.
    """
    choice = cfg.policy.tokenizer
    if choice == "char":
        return None
    if choice == "auto":
        model_path = cfg.policy.model.get("path")
        return str(model_path) if model_path not in (None, "") and _has_tokenizer(str(model_path)) else None
    path = str(Path(choice).expanduser())
    if not _has_tokenizer(path):
        raise ConfigError(f"policy.tokenizer={choice!r}: no tokenizer there (none of {list(TOKENIZER_FILES)})")
    return path


def build_tokenizer(cfg: TrainerConfig) -> Tokenizer:
    """The run's tokenizer (see :func:`tokenizer_dir`), with the task's prompt format.

    Raises :class:`ConfigError` naming the key at fault: ``policy.tokenizer`` (cannot load),
    ``task.chat_template`` (the tokenizer has no chat template; the character tokenizer never has).
    """
    path = tokenizer_dir(cfg)
    task = cfg.task
    if path is None:
        if task.chat_template:
            raise ConfigError(
                "task.chat_template=true needs a Hugging Face tokenizer with a chat template, but the run uses "
                "the character tokenizer (set policy.tokenizer to a tokenizer directory)"
            )
        return CharTokenizer(system_prompt=task.system_prompt)
    try:
        return HFTokenizer(path, chat_template=task.chat_template, system_prompt=task.system_prompt)
    except NoChatTemplate as e:
        raise ConfigError(f"task.chat_template=true: {e}") from e
    except ValueError as e:
        raise ConfigError(f"policy.tokenizer={cfg.policy.tokenizer!r}: {e}") from e


def tokenizer_record(tok: Tokenizer) -> dict[str, Any]:
    """What identifies ``tok`` for a checkpoint: its kind, where it was loaded from, its size,
    special ids and a digest of its vocabulary (token -> id), as plain values."""
    if isinstance(tok, HFTokenizer):
        vocab: Any = sorted(tok._tok.get_vocab().items())
        source: str | None = tok.path
    else:
        vocab = [tok.decode([i]) for i in range(tok.vocab_size)] if isinstance(tok, CharTokenizer) else None
        source = None
    digest = hashlib.sha256(json.dumps(vocab).encode()).hexdigest() if vocab is not None else None
    return {
        "kind": type(tok).__name__,
        "path": source,
        "vocab_size": tok.vocab_size,
        "special_ids": [tok.bos_id, tok.eos_id, tok.pad_id],
        "vocab_sha256": digest,
    }


def check_tokenizer_record(saved: Mapping[str, Any] | None, tok: Tokenizer, where: str) -> None:
    """Refuse resuming with another tokenizer than the checkpoint ``where`` was trained with
    (``ConfigError`` naming ``policy.tokenizer``); a checkpoint that recorded none passes. The
    path may differ (a moved directory); the vocabulary and special ids may not."""
    if saved is None:
        return
    now = tokenizer_record(tok)
    keys = ("kind", "vocab_size", "special_ids", "vocab_sha256")
    differ = [k for k in keys if saved.get(k) != now[k]]
    if differ:
        raise ConfigError(
            f"policy.tokenizer: the checkpoint {where} was trained with {saved.get('kind')} "
            f"({saved.get('path') or 'built in'}, {saved.get('vocab_size')} tokens) but this run uses {tok!r}; "
            f"they differ in {differ}"
        )
