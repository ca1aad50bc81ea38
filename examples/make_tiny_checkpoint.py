"""Build a checkpoint as a user brings one, and word problems to train it on; nothing is downloaded.

    python examples/make_tiny_checkpoint.py --model runs/byo/model --problems runs/byo/problems.jsonl

writes into ``--model`` a byte-level BPE tokenizer trained on arithmetic word problems (``<s>``,
``</s>``, ``<pad>``, a chat template) and a randomly initialised 1-layer Llama beside it (hidden
32, one attention head of 32: a head size vLLM's CPU attention runs), and into ``--problems``
JSONL word problems ``{"question": "What is 3 + 4?", "gold": 7}``. Deterministic: the same
arguments give the same files. ``docs/grpo_sync.md`` ("Bring your own model") walks through
training on them; the tests build their checkpoints with :func:`build_tiny_checkpoint`.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

# Word problems the BPE tokenizer is trained on (the problems file is drawn from the same family).
ARITHMETIC_CORPUS: tuple[str, ...] = tuple(
    f"What is {a} + {b}? Let's add: {a} + {b} = {a + b}. The answer is {a + b}."
    for a in range(30)
    for b in range(0, 30, 3)
)
# A minimal chat template: one turn per message, then the assistant's turn to answer.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def build_tiny_checkpoint(
    directory: Path,
    *,
    embedding_rows: int | None = None,
    chat_template: bool = True,
    pad_token: bool = True,
    num_attention_heads: int = 1,
) -> Path:
    """Write a HF checkpoint into ``directory``: the BPE tokenizer (``<pad>`` unless
    ``pad_token=False``; the chat template unless ``chat_template=False``) and a 1-layer Llama of
    hidden size 32 with ``num_attention_heads`` heads, whose embedding has ``embedding_rows`` rows
    (default: one per token). Returns ``directory``."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    specials = ["<s>", "</s>", *(["<pad>"] if pad_token else [])]
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()  # every byte: any text encodes
    trainer = trainers.BpeTrainer(
        vocab_size=320, special_tokens=specials, initial_alphabet=alphabet, show_progress=False
    )
    bpe.train_from_iterator(ARITHMETIC_CORPUS, trainer)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=bpe, bos_token="<s>", eos_token="</s>", **({"pad_token": "<pad>"} if pad_token else {})
    )
    if chat_template:
        tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(str(directory))
    config = LlamaConfig(
        vocab_size=embedding_rows or len(tok),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_attention_heads,
        max_position_embeddings=256,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        LlamaForCausalLM(config).save_pretrained(str(directory))
    return directory


def write_word_problems(path: Path, *, count: int = 24) -> Path:
    """``count`` JSONL word problems ``{"question": "What is a + b?", "gold": a + b}``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    rows = [{"question": f"What is {i // 4} + {i % 4}?", "gold": i // 4 + i % 4} for i in range(count)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, required=True, help="directory for the tokenizer and model")
    parser.add_argument("--problems", type=Path, help="JSONL file of word problems to write")
    args = parser.parse_args()
    build_tiny_checkpoint(args.model)
    print(f"checkpoint: {args.model}")
    if args.problems is not None:
        write_word_problems(args.problems)
        print(f"problems: {args.problems}")


if __name__ == "__main__":
    main()
