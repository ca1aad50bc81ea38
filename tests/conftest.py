"""Session fixtures: one local Ray cluster and one TransferQueue store for the whole test run.

* ``ray_session``: Ray started once with 2 CPUs (the CI machine) and no dashboard; shut down at
  session end. Every test that needs Ray shares it.
* ``tq_client``: a bootstrapped :class:`TransferQueueClient` on that cluster, under
  TransferQueue's default controller name so ``transfer_queue.init()`` in an actor attaches to
  the same store. Tests must use their own partition ids and clear them.
* ``ray_store_client``: a bootstrapped :class:`RayStoreClient` (the ``ray`` backend) on that
  cluster, under its default index name so workers attach with ``bootstrap=False``.
* ``plasma_mib``: a function returning the MiB of Ray's object store in use.
* ``memory_client``: a fresh :class:`InMemoryClient` per test.
* ``store``: ``(client, partition_id)``, parametrized over the in-memory store and ``tq_client``,
  with a fresh partition (named after the test module) that is cleared afterwards.
* ``pool``: worker processes (module scope) for the rank bodies in ``tests/unit/_refit_procs.py``.
* ``make_real_model(dir, ...)``: a checkpoint as a user brings one, built at test time (nothing is
  downloaded): a byte-level BPE tokenizer trained on arithmetic word problems and a tiny Llama
  saved beside it; ``real_model``: one under ``tmp_path``.

Nothing here is importable as ``tests.*`` (TransferQueue's wheel ships a top-level ``tests``
package); pytest runs with ``--import-mode=importlib``.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

# Must be set before Ray starts: actors spawned by the fixtures inherit it, and TransferQueue
# reads it at import time.
os.environ.setdefault("TQ_LOGGING_LEVEL", "ERROR")
os.environ.setdefault("RAY_DEDUP_LOGS", "1")

RAY_NUM_CPUS = 2


@pytest.fixture(scope="session")
def ray_session() -> Iterator[Any]:
    """Ray initialized in this process (2 CPUs, no dashboard) for the whole session."""
    import ray

    started = False
    if not ray.is_initialized():
        # address="local": a cluster of this session's own. Without it ray.init() attaches to
        # whatever /tmp/ray/ray_current_cluster names, e.g. a functional run's cluster still
        # shutting down, and then refuses num_cpus (CI failed so once).
        ray.init(
            address="local",
            num_cpus=RAY_NUM_CPUS,
            include_dashboard=False,
            log_to_driver=True,
            configure_logging=False,
        )
        started = True
    yield ray
    if started and ray.is_initialized():
        ray.shutdown()


@pytest.fixture(scope="session")
def tq_client(ray_session: Any) -> Iterator[Any]:
    """A real TransferQueue store (1 storage unit, fractional CPUs) shared by the session."""
    from nemo_dataplane.adapters.transfer_queue.client import TransferQueueClient
    from nemo_dataplane.config import TransferQueueConfig

    client = TransferQueueClient(
        TransferQueueConfig(num_storage_units=1, bootstrap_timeout_s=60, op_timeout_s=60),
        bootstrap=True,
    )
    yield client
    client.close()


@pytest.fixture(scope="session")
def ray_store_client(ray_session: Any) -> Iterator[Any]:
    """A Ray object-store backend (metadata actor under its default name) shared by the session."""
    from nemo_dataplane.adapters.ray_store.client import RayStoreClient
    from nemo_dataplane.config import RayStoreConfig

    client = RayStoreClient(RayStoreConfig(bootstrap_timeout_s=60, op_timeout_s=60), bootstrap=True)
    yield client
    client.close()


@pytest.fixture(scope="session")
def plasma_mib(ray_session: Any) -> Any:
    """``plasma_mib()``: MiB of Ray's object store in use across the cluster (Ray's own stats)."""
    import re

    from ray._private.internal_api import memory_summary

    def used() -> int:
        text = memory_summary(ray_session.get_runtime_context().gcs_address, stats_only=True)
        return int(re.search(r"Plasma memory usage (\d+) MiB", text).group(1))  # type: ignore[union-attr]

    return used


@pytest.fixture
def memory_client() -> Iterator[Any]:
    from nemo_dataplane.adapters.memory import InMemoryClient

    client = InMemoryClient()
    yield client
    client.close()


@pytest.fixture(params=["memory", "transfer_queue"])
def store(request: pytest.FixtureRequest) -> Iterator[tuple[Any, str]]:
    """A client (in-memory, or the session's TransferQueue store) and a fresh partition; the
    partition is cleared afterwards."""
    from nemo_dataplane.adapters.memory import InMemoryClient

    client = InMemoryClient() if request.param == "memory" else request.getfixturevalue("tq_client")
    pid = f"{Path(str(request.node.fspath)).stem}-{uuid.uuid4().hex[:8]}"
    yield client, pid
    client.kv_clear(None, pid)


@pytest.fixture(scope="module")
def pool() -> Iterator[Any]:
    """Worker processes for the rank bodies of ``tests/unit/_refit_procs.py``, killed after the
    module. The module that uses it has put ``tests/unit`` on ``sys.path`` (never a package)."""
    import _refit_procs

    ex = _refit_procs.Pool(4)
    yield ex
    ex.kill()


# --------------------------------------------------------------------------- a real checkpoint
# Word problems the BPE tokenizer is trained on (and the functional test's prompts are drawn from).
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


def build_real_model(
    directory: Path, *, embedding_rows: int | None = None, chat_template: bool = True, pad_token: bool = True
) -> Path:
    """Write a HF checkpoint into ``directory``: a byte-level BPE tokenizer (``<s>``, ``</s>``,
    ``<pad>`` unless ``pad_token=False``; the chat template unless ``chat_template=False``) and a
    1-layer Llama (hidden 32, 2 heads) whose embedding has ``embedding_rows`` rows (default: one
    per token). Deterministic: the same arguments give the same files."""
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
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=256,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        LlamaForCausalLM(config).save_pretrained(str(directory))
    return directory


@pytest.fixture(scope="session")
def make_real_model() -> Any:
    """:func:`build_real_model`, for tests that need a variant (too few embedding rows, no pad
    token, no chat template) or their own directory."""
    return build_real_model


@pytest.fixture
def real_model(tmp_path: Path) -> Path:
    """A checkpoint directory (tokenizer + tiny Llama) under ``tmp_path``."""
    return build_real_model(tmp_path / "model")
