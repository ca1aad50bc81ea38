"""Per-rank bodies for the sharded (FSDP2) training engine's tests, each run in a fresh process
through ``_refit_procs.run_ranks``: ranks ``0..world-1`` form the policy's process group (gloo
on CPU, NCCL on GPUs), an optional last rank is the generator that receives the refit.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from _refit_procs import HOST, _bytes

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "examples" / "configs" / "grpo_tiny.yaml"
MODEL = [  # the toy model with more layers and uneven splits (vocab 37 rows over 2 ranks: 19 + 18)
    "policy.model.hf_config.num_hidden_layers=3",
    "policy.model.hf_config.intermediate_size=96",
]


# On GPUs: NCCL among the policy ranks, the refit over CUDA IPC with a gloo group for control.
CUDA = [
    "policy.device=cuda",
    "generation.device=cuda",
    "policy.dist_backend=nccl",
    "policy.gpus_per_rank=1",
    "refit.backend=gloo",
    "refit.mode=reshard",
    "refit.transport=ipc",
]


def make_cfg(sharding: str, world: int, precision: str, device: str = "cpu") -> Any:
    from algorithms.config import load_config

    overrides = [
        *MODEL,
        f"policy.sharding={sharding}",
        f"trainer.dp_size={world}",
        f"policy.precision={precision}",
        "policy.lr=0.01",
        "policy.lr_warmup_steps=2",
        "grpo.kl_coef=0.05",
        "grpo.epochs=1",
        *(CUDA if device == "cuda" else []),
        # The sharded engine also recomputes its layers' activations in backward: the same numbers
        # as the replicated engine, which keeps them.
        *(["policy.activation_checkpointing=true"] if sharding == "fsdp" else []),
    ]
    return load_config(CONFIG, overrides)


def batch(rank: int, step: int, pad_id: int, vocab: int, device: torch.device, n_mb: int = 2) -> list[Any]:
    """``n_mb`` micro-batches of 4 rows (prompt 3 tokens, response 2-6), distinct per rank and step."""
    from tensordict import TensorDict

    from nemo_dataplane.codec import jagged_from_rows

    gen = torch.Generator().manual_seed(1000 * step + 17 * rank)
    out = []
    for _ in range(n_mb):
        lens = torch.randint(5, 10, (4,), generator=gen)
        rows = [torch.randint(3, vocab, (int(n),), generator=gen) for n in lens]
        mb = TensorDict(
            {"input_ids": jagged_from_rows(rows), "prompt_len": torch.full((4,), 3, dtype=torch.int64)},
            batch_size=[4],
        )
        adv = torch.randn(4, generator=gen)
        out.append((mb, adv))
    return out


def prepare(engine: Any, raw: list[Any]) -> tuple[list[Any], float]:
    """The policy worker's preparation: proximal and reference log-probs scored by the engine."""
    from algorithms.engines.training import Prepared

    prepared, tokens = [], 0.0
    with torch.no_grad():
        for mb, adv in raw:
            old, _, mask = engine.score("policy", mb, False)
            ref, _, _ = engine.score("reference", mb, False)
            prepared.append(
                Prepared(mb=mb, mask=mask, old=old.float(), ref=ref.float(), adv=adv.to(mask.device), behaviour=None)
            )
            tokens += float(mask.sum())
    return prepared, tokens


def global_tokens(local: float, device: torch.device) -> float:
    t = torch.tensor([local], dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return float(t.item())


def full_weights(engine: Any, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Every parameter whole, on the host, in ``dtype`` (collective for the sharded engine)."""
    out = {}
    for name, p in engine.model.named_parameters():
        t = p.detach()
        t = t.full_tensor() if hasattr(t, "full_tensor") else t
        out[name] = t.to(dtype).cpu().clone()
    return out


def portable(obj: Any) -> bytes:
    """``obj`` as ``torch.save`` bytes: tensors sent through a pipe would travel as shared-memory
    handles that die with the rank's process."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def unpack(data: bytes) -> Any:
    return torch.load(io.BytesIO(data), weights_only=True)


def _init(rank: int, world: int, port: int, backend: str, device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=f"tcp://{HOST}:{port}", rank=rank, world_size=world)


def _engine(cfg: Any, rank: int, device: torch.device) -> Any:
    from algorithms.engines.training import build_training_engine
    from algorithms.tokenizers import build_tokenizer

    tok = build_tokenizer(cfg)
    e = build_training_engine(cfg, device, vocab_size=tok.vocab_size, pad_id=tok.pad_id, rank=rank)
    e.connect(rank)
    return e, tok


def train_and_compare(
    rank: int,
    world: int,
    port: int,
    refit_port: int,
    tmp: str,
    precision: str,
    steps: int = 3,
    backend: str = "gloo",
    device: str = "cpu",
) -> dict[str, Any]:
    """Policy ranks (``rank < world``): the sharded and the replicated engine take the same
    ``steps`` steps on the same rows (their per-step metrics come back); then the sharded one is
    checkpointed, steps once more, reloads and repeats that step (both results come back), refits
    the generator rank (``rank == world``) from its shards and exports a Hugging Face directory
    that rank 0 loads with ``transformers`` and scores against the sharded model."""
    from algorithms.engines.training.fsdp import FSDPTrainingEngine
    from algorithms.precision import PRECISIONS

    dev = torch.device(device, min(rank, world - 1)) if device == "cuda" else torch.device("cpu")
    dtype = PRECISIONS[precision].dtype
    if rank == world:  # the generator: on the last policy rank's GPU
        if dev.type == "cuda":
            torch.cuda.set_device(dev)
        return _receive(world, refit_port, precision, dev)
    _init(rank, world, port, backend, dev)
    out: dict[str, Any] = {}
    try:
        cfg = make_cfg("fsdp", world, precision, device)
        sharded, tok = _engine(cfg, rank, dev)
        assert isinstance(sharded, FSDPTrainingEngine)
        replicated, _ = _engine(make_cfg("none", world, precision, device), rank, dev)
        out["local_params"] = sum(p.to_local().numel() for p in sharded.model.parameters())
        out["params"] = sharded.num_params()
        history: dict[str, list[dict[str, float]]] = {"fsdp": [], "none": []}
        vocab = tok.vocab_size
        for step in range(steps):
            raw = batch(rank, step, tok.pad_id, vocab, dev)
            for name, engine in (("fsdp", sharded), ("none", replicated)):
                prepared, local = prepare(engine, raw)
                m = engine.train_step(prepared, global_tokens(local, dev), False)
                history[name].append({**m, "lr": engine.learning_rate(), "steps": engine.optimizer_steps()})
        out["history"] = history
        a = full_weights(sharded, torch.float32)  # the float32 shards: the masters
        masters = dict(zip((n for n, _ in replicated.model.named_parameters()), replicated.trained.params))
        out["weight_diff"] = max(float((a[n] - masters[n].detach().cpu()).abs().max()) for n in a)
        # Checkpoint, one more step, reload, the same step again: bitwise the same.
        ck = Path(tmp) / "ckpt"
        ck.mkdir(parents=True, exist_ok=True)
        sharded.save_state(ck)
        dist.barrier()
        saved = full_weights(sharded, torch.float32)  # collective: every rank gathers
        out["saved"] = portable(saved) if rank == 0 else None
        raw = batch(rank, steps, tok.pad_id, vocab, dev)
        runs = []
        for _ in range(2):
            prepared, local = prepare(sharded, raw)
            m = sharded.train_step(prepared, global_tokens(local, dev), False)
            runs.append((m, full_weights(sharded, torch.float32)))
            out["note"] = sharded.load_state(ck)
        out["resumed_equal"] = runs[0][0] == runs[1][0] and all(
            torch.equal(runs[0][1][n], runs[1][1][n]) for n in runs[0][1]
        )
        # Refit from the shards (senders = every policy rank), then the export.
        out["sent"] = portable(_send(sharded, cfg, rank, world, refit_port, dtype, dev))
        hf = Path(tmp) / "hf"
        wrote = sharded.save_hf(
            str(hf), {"bos_token_id": tok.bos_id, "eos_token_id": tok.eos_id, "pad_token_id": tok.pad_id}
        )
        out["wrote"] = wrote
        dist.barrier()
        ids = torch.tensor([[tok.bos_id, 5, 9, 11, 4, 7]], device=dev)
        with torch.no_grad():
            trained = sharded.model(input_ids=ids).logits.float().cpu()  # collective: every rank
        if rank == 0:
            from transformers import AutoModelForCausalLM

            loaded = AutoModelForCausalLM.from_pretrained(str(hf), local_files_only=True, dtype=dtype).to(dev).eval()
            with torch.no_grad():
                exported = loaded(input_ids=ids).logits.float().cpu()
            out["export_diff"] = float((exported - trained).abs().max())
            out["export_files"] = sorted(p.name for p in hf.iterdir())
        return out
    finally:
        dist.destroy_process_group()


def _send(
    engine: Any, cfg: Any, rank: int, world: int, port: int, dtype: torch.dtype, dev: torch.device
) -> dict[str, torch.Tensor]:
    """Send one refit from this rank's shards; return the whole weights the generator should
    hold (from rank 0; ``{}`` elsewhere). Collective over the policy group first (the gather)."""
    from nemo_dataplane.distributed.stateless_group import StatelessProcessGroup
    from nemo_dataplane.refit import build_weight_sender

    want = full_weights(engine, dtype)
    g = StatelessProcessGroup(HOST, port, rank, world + 1, "gloo", 60.0, group_name="refit")
    try:
        s = build_weight_sender(
            cfg.weight_transfer, g, engine.named_for_refit, senders=world, full_shapes=engine.refit_shapes(), device=dev
        )
        s.prepare_refit_info()
        s.send_weights(5)
        s.close()
    finally:
        g.destroy()
    return want if rank == 0 else {}


def _receive(world: int, port: int, precision: str, dev: torch.device) -> dict[str, Any]:
    """The generator: whole tensors of the model's shapes on ``dev``, written by the refit."""
    from algorithms.models import build_model
    from algorithms.precision import PRECISIONS
    from algorithms.tokenizers import build_tokenizer
    from nemo_dataplane.distributed.stateless_group import StatelessProcessGroup
    from nemo_dataplane.refit import build_weight_receiver

    cfg = make_cfg("fsdp", world, precision, dev.type)
    tok = build_tokenizer(cfg)
    model = build_model(dict(cfg.policy.model), vocab_size=tok.vocab_size).to(dev, PRECISIONS[precision].dtype)
    tensors = dict(model.named_parameters())
    for t in tensors.values():
        t.data.zero_()
    g = StatelessProcessGroup(HOST, port, world, world + 1, "gloo", 60.0, group_name="refit")
    try:
        r = build_weight_receiver(cfg.weight_transfer, g, tensors, senders=world, device=dev)
        r.prepare_refit_info()
        version = r.receive_weights()
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)  # ipc: valid on this stream, now on the host's view too
        r.close()
    finally:
        g.destroy()
    return {"version": version, "got": portable({n: t.detach().cpu().clone() for n, t in tensors.items()})}


def load_elsewhere(rank: int, world: int, port: int, tmp: str, precision: str) -> dict[str, Any]:
    """A sharded engine on ``world`` ranks loads a checkpoint written by another rank count:
    its whole weights and the note come back (rank 0)."""
    dev = torch.device("cpu")
    _init(rank, world, port, "gloo", dev)
    try:
        engine, _ = _engine(make_cfg("fsdp", world, precision), rank, dev)
        note = engine.load_state(Path(tmp) / "ckpt")
        weights = full_weights(engine, torch.float32)  # collective
        steps = engine.optimizer_steps()
        return {"note": note, "weights": portable(weights) if rank == 0 else None, "steps": steps}
    finally:
        dist.destroy_process_group()


def bitwise_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    """Names whose bytes differ (or that only one side has)."""
    bad = sorted(set(a) ^ set(b))
    bad += [n for n in sorted(set(a) & set(b)) if not torch.equal(_bytes(a[n]), _bytes(b[n]))]
    return bad
