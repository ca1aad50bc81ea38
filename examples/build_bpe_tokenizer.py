"""Build a 32k-id byte-level BPE tokenizer for the real-size configs; nothing is downloaded.

    python examples/build_bpe_tokenizer.py --out runs/bpe32k          # ~20 s on 2 cores

writes a Hugging Face tokenizer directory (``tokenizer.json``, ``tokenizer_config.json``, special
tokens ``<s>``, ``</s>``, ``<pad>``) with exactly ``--vocab-size`` ids (default 32000, a Llama-2
sized vocabulary), trained on a synthetic English-like corpus drawn from a fixed seed: numbers,
arithmetic, and words made of syllables. Deterministic: the same arguments give the same file.
``examples/configs/grpo_llama_1b.yaml`` and ``grpo_llama_8b.yaml`` name it as
``policy.tokenizer`` (their ``hf_config.vocab_size`` is 32000). Any other HF tokenizer directory
works the same way.
"""

from __future__ import annotations

import argparse
import random
from collections.abc import Iterator
from pathlib import Path

SPECIALS = ["<s>", "</s>", "<pad>"]
_ONSETS = ["", "b", "c", "d", "f", "g", "h", "j", "k", "l", "m", "n", "p", "r", "s", "t", "v", "w", "z"]
_ONSETS += ["bl", "br", "ch", "cl", "cr", "dr", "fl", "fr", "gl", "gr", "pl", "pr", "sh", "sl", "st", "th", "tr"]
_NUCLEI = ["a", "e", "i", "o", "u", "ai", "ea", "ee", "oo", "ou", "ie", "y"]
_CODAS = ["", "", "n", "r", "s", "t", "l", "m", "nd", "st", "ng", "ck", "th", "rd"]


def _word(rng: random.Random) -> str:
    return "".join(rng.choice(_ONSETS) + rng.choice(_NUCLEI) + rng.choice(_CODAS) for _ in range(rng.randint(1, 3)))


def corpus(seed: int = 0, lines: int = 120_000) -> Iterator[str]:
    """Sentences of syllable words, numbers and sums, from ``seed``: enough distinct pieces for
    a 32k vocabulary's merges."""
    rng = random.Random(seed)
    lexicon = [_word(rng) for _ in range(60_000)]
    for i in range(lines):
        kind = i % 4
        if kind == 0:
            a, b = rng.randint(0, 9999), rng.randint(0, 9999)
            yield f"What is {a} + {b}? {a} + {b} = {a + b}. The answer is {a + b}."
        else:
            words = [rng.choice(lexicon) for _ in range(rng.randint(6, 18))]
            if rng.random() < 0.3:
                words.insert(rng.randint(0, len(words)), str(rng.randint(0, 100_000)))
            yield " ".join(words).capitalize() + rng.choice([".", "?", "!", ","])


def build(out: Path, vocab_size: int = 32000, seed: int = 0, lines: int = 120_000) -> Path:
    """Train the tokenizer on ``lines`` sentences and save it as a HF directory under ``out``;
    returns ``out``.

    Raises ``RuntimeError`` if the corpus yields fewer ids than ``vocab_size``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte: any text encodes
        show_progress=False,
    )
    bpe.train_from_iterator(corpus(seed, lines), trainer)
    if bpe.get_vocab_size() != vocab_size:
        raise RuntimeError(f"the corpus gave {bpe.get_vocab_size()} ids, not --vocab-size={vocab_size}")
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    out.mkdir(parents=True, exist_ok=True)
    tok.save_pretrained(str(out))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="the tokenizer directory to write")
    ap.add_argument("--vocab-size", type=int, default=32000)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    path = build(args.out, args.vocab_size, args.seed)
    print(f"wrote a {args.vocab_size}-id BPE tokenizer to {path}")


if __name__ == "__main__":
    main()
