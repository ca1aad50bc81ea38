"""Rank bodies for the Megatron-core tests (run through ``_refit_procs.run_ranks``)."""

from __future__ import annotations

import os
from typing import Any

import _refit_procs as P
import torch

from algorithms.models import build_model

TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
)
VOCAB = 34  # algorithms.tasks.CharTokenizer


def tiny_hf(seed: int = 0, **over: Any) -> torch.nn.Module:
    return build_model({"arch": "llama", "seed": seed, "hf_config": {**TINY, **over}}, vocab_size=VOCAB)


def refit_tp2_to_tp1(rank: int, world: int, port: int) -> dict[str, Any]:
    """Ranks 0, 1: a TP=2 Megatron trainer's shards (from ``hf_to_mcore``), exported under HF
    names by ``mcore_shard_to_hf``; rank 2: a TP=1 HF generator. Refit twice (seed 0, then 1)."""
    from algorithms.engines.training.mcore_convert import hf_to_mcore, mcore_shard_to_hf, shape_from_hf_config
    from algorithms.engines.training.megatron import hf_full_shapes
    from nemo_dataplane.refit import Mesh, build_layout
    from nemo_dataplane.refit.reshard import ReshardReceiver, ReshardSender

    ref = [tiny_hf(seed) for seed in (0, 1)]
    shape = shape_from_hf_config(ref[0].config)
    shapes = hf_full_shapes(shape)
    gen_model = tiny_hf(seed=5) if rank == 2 else None
    # everything slow (imports, model builds) happens before joining: the CI box is shared
    g = P._group(rank, world, port, "gloo", timeout=60.0)
    if rank < 2:
        train = build_layout(Mesh.of([0, 1], tp=2), shapes)
        mc = hf_to_mcore(ref[0].state_dict(), shape, tp=2, rank=rank)  # what the TP rank's model holds
        snd = ReshardSender(g, lambda: mcore_shard_to_hf(mc, shape, tp=2), train, 4096, direct_bytes=512)
        plan = snd.prepare_refit_info()
        snd.send_weights(1)
        first = snd.bytes_moved
        for k, v in hf_to_mcore(ref[1].state_dict(), shape, tp=2, rank=rank).items():
            mc[k].copy_(v)  # an optimizer step, in place
        snd.send_weights(2)
        return {"sent": [first, snd.bytes_moved], "owned": plan.bytes_from(rank)}
    assert gen_model is not None
    mine = dict(gen_model.named_parameters())
    rcv = ReshardReceiver(g, mine, build_layout(Mesh.of([2], tp=1), shapes))
    rcv.prepare_refit_info()
    wrong = []
    for i in range(2):
        rcv.receive_weights()
        want = ref[i].state_dict()
        wrong.append(sorted(k for k, v in mine.items() if not torch.equal(v.detach(), want[k])))
    return {"wrong": wrong, "names": len(mine)}


# ------------------------------------------------------------------------ GPU (megatron-core)
def _mcore_world(rank: int, world: int, port: int, tp: int) -> torch.device:
    import torch.distributed as dist

    from algorithms.engines.training.megatron import init_parallel

    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    # NCCL refuses two ranks on one device; with fewer GPUs than ranks the ranks share GPUs
    # and Megatron's collectives go over gloo on CUDA tensors instead (slower, same results).
    gpus = torch.cuda.device_count()
    dev = torch.device("cuda", rank % gpus)
    torch.cuda.set_device(dev)
    backend = "nccl" if gpus >= world else "gloo"
    dist.init_process_group(backend, init_method=f"tcp://{P.HOST}:{port}", rank=rank, world_size=world)
    init_parallel(tp, seed=1234)
    return dev


def mcore_logits_and_loss(rank: int, world: int, port: int, tp: int) -> dict[str, Any]:
    """HF vs MCore (TP=``tp``) on the same weights and packed batch: logits, log-probs, the GRPO
    loss and its gradients (mapped back to HF names and gathered), and the round trip."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from algorithms.engines.training import megatron as M
    from algorithms.engines.training.mcore_convert import mcore_to_hf, shape_from_hf_config
    from algorithms.grpo import policy_loss
    from algorithms.models import pad_batch, sequence_logprobs

    dev = _mcore_world(rank, world, port, tp)
    try:
        hf = tiny_hf(0).to(dev)
        shape = shape_from_hf_config(hf.config)
        mc = M.build_gpt(hf.config, device=dev)
        M.load_hf(mc, hf.state_dict(), shape)
        g = torch.Generator().manual_seed(7)
        rows = [torch.randint(3, VOCAB, (int(n),), generator=g) for n in (9, 5, 12, 7)]
        prompt_len = torch.tensor([4, 2, 6, 3])
        jag = torch.nested.nested_tensor(rows, layout=torch.jagged)
        # HF, padded
        ids, attn = pad_batch(rows, 0)
        ids, attn = ids.to(dev), attn.to(dev)
        resp = (torch.arange(ids.shape[1], device=dev)[None] >= prompt_len.to(dev)[:, None]) & attn.bool()
        hf_lp = sequence_logprobs(hf, ids, attn, resp)
        mc_lp, _, mask = M.microbatch_logprobs(mc, jag, prompt_len, device=dev)
        # logits, per sequence
        tokens, cu = M.packed_from_jagged(jag)
        with torch.no_grad():
            pl = M.forward_packed(mc, tokens.to(dev), cu.to(dev)).float()
            hl = hf(input_ids=ids, attention_mask=attn).logits.float()
        logit_diff = max(
            float((pl[int(cu[j]) : int(cu[j + 1])] - hl[j, : len(r)]).abs().max()) for j, r in enumerate(rows)
        )
        # loss + grads
        adv = torch.tensor([1.0, -0.5, 0.3, -1.2], device=dev)
        old = (hf_lp.detach() + 0.05 * mask).detach()
        kw = dict(clip_eps=0.2, kl_coef=0.01, global_token_count=float(mask.sum()))
        hf_loss, _ = policy_loss(hf_lp, old, old - 0.1 * mask, adv, mask, **kw)
        mc_loss, _ = policy_loss(mc_lp, old, old - 0.1 * mask, adv, mask, **kw)
        hf_loss.backward()
        mc_loss.backward()
        grads = {n: p.grad for n, p in mc.named_parameters()}
        tp_group = ps.get_tensor_model_parallel_group()
        gathered = [None] * tp
        dist.all_gather_object(gathered, {k: v.cpu() for k, v in grads.items()}, group=tp_group)
        mc_hf_grads = mcore_to_hf(gathered, shape)
        grad_diff = max(float((mc_hf_grads[n] - p.grad.cpu()).abs().max()) for n, p in hf.named_parameters())
        # round trip of the weights
        params = [None] * tp
        dist.all_gather_object(
            params,
            {k: v.detach().cpu() for k, v in mc.state_dict().items() if not k.endswith("_extra_state")},
            group=tp_group,
        )
        back = mcore_to_hf(params, shape)
        exact = all(torch.equal(back[k], v.cpu()) for k, v in hf.state_dict().items())
        return {
            "logit_diff": logit_diff,
            "lp_diff": float((mc_lp - hf_lp).abs().max()),
            "loss": (float(hf_loss), float(mc_loss)),
            "grad_diff": grad_diff,
            "roundtrip_exact": exact,
            "tp": ps.get_tensor_model_parallel_world_size(),
        }
    finally:
        ps.destroy_model_parallel()
        dist.destroy_process_group()


def replica_group_fetch(rank: int, world: int, port: int, sets: int = 3) -> dict[str, Any]:
    """TP=2 (one replica group, DP=1): the TP leader fetches each micro-batch set once from the
    store and broadcasts over Megatron's TP group; both ranks compute log-probs of every
    micro-batch of the driver's plan from the packed rows; the leader alone writes back."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from algorithms.engines.training import megatron as M
    from algorithms.engines.training.mcore_convert import shape_from_hf_config
    from nemo_dataplane.adapters.memory import InMemoryClient
    from nemo_dataplane.codec import jagged_from_rows
    from nemo_dataplane.worker.fetch import WorkerFetcher
    from nemo_dataplane.wrappers.observed import ObservedClient

    dev = _mcore_world(rank, world, port, 2)
    try:
        hf = tiny_hf(0)
        shape = shape_from_hf_config(hf.config)
        mc = M.build_gpt(hf.config, device=dev)
        M.load_hf(mc, hf.state_dict(), shape)
        leader = ps.get_tensor_model_parallel_rank() == 0
        client = ObservedClient(InMemoryClient()) if leader else None
        g = torch.Generator().manual_seed(3)
        metas = []
        for s in range(sets):
            rows = [torch.randint(3, VOCAB, (int(n),), generator=g) for n in (6, 9, 4, 11, 7, 5)]
            if leader:
                meta = client.kv_batch_put(
                    [f"s{s}r{j}" for j in range(6)],
                    f"step{s}",
                    {"input_ids": jagged_from_rows(rows), "prompt_len": torch.full((6,), 3)},
                )
                meta = meta._replace(extra_info={"packing": {"microbatches": [[0, 1, 2], [3, 4, 5]]}})
            metas.append(meta if leader else None)
        if leader:
            client.op_counts.clear()  # count only what the fetch loop does
        obj = [metas]
        dist.broadcast_object_list(
            obj, src=ps.get_tensor_model_parallel_src_rank(), group=ps.get_tensor_model_parallel_group()
        )
        metas = obj[0]
        fetcher = WorkerFetcher(
            client, fetch_policy="leader_broadcast", replica_group=ps.get_tensor_model_parallel_group(), timeout_s=60
        )
        sums = []
        n_mbs = 0
        for meta in metas:
            fetched = fetcher.fetch(meta, ["input_ids", "prompt_len"])
            lps = []
            with torch.no_grad():
                for mb in fetched.microbatches:
                    lp, _, _ = M.microbatch_logprobs(mc, mb["input_ids"], mb["prompt_len"], device=dev)
                    lps.extend(
                        lp[j, : int(mb["input_ids"].offsets()[j + 1] - mb["input_ids"].offsets()[j]) - 1].cpu()
                        for j in range(lp.shape[0])
                    )
                    n_mbs += 1
            sums.append(float(sum(x.sum() for x in lps)))
            fetcher.write_back(meta, {"prev_logprobs": jagged_from_rows(lps)})
        ops = dict(client.op_counts) if leader else {}
        return {"leader": leader, "ops": ops, "sums": sums, "microbatches": n_mbs, "mode": fetcher.fetch_policy}
    finally:
        ps.destroy_model_parallel()
        dist.destroy_process_group()


def megatron_bf16_train_and_export(rank: int, world: int, port: int, tmp: str) -> dict[str, Any]:
    """The Megatron engine in bf16 at TP=``world`` (one replica), built from the same HF weights
    as an HF model in bf16 on each rank: log-probs and the first step's gradient norm against the
    HF model's (the norm combines the TP shards through the float32 masters' layout attributes),
    then two steps, then the HF export, read back and split again into this rank's MCore shard."""
    import torch.distributed as dist

    from algorithms.config import load_config
    from algorithms.engines.training import Prepared, build_training_engine
    from algorithms.engines.training.mcore_convert import hf_to_mcore
    from algorithms.grpo import policy_loss
    from algorithms.models import sequence_logprobs
    from algorithms.precision import PRECISIONS

    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    dev = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(dev)
    from megatron.core import parallel_state as ps

    dist.init_process_group("nccl", init_method=f"tcp://{P.HOST}:{port}", rank=rank, world_size=world)
    try:
        cfg = load_config(
            None,
            [
                *(f"policy.model.hf_config.{k}={v}" for k, v in TINY.items()),
                "policy.model.arch=llama",
                "policy.model.seed=0",
                "policy.backend=megatron",
                f"policy.tensor_parallel_size={world}",
                "policy.precision=bf16",
                "policy.device=cuda",
                "policy.dist_backend=nccl",
                "policy.gpus_per_rank=1",
                "generation.device=cuda",
                "refit.backend=gloo",
                "trainer.dp_size=1",
                "checkpoint.export_hf=true",
                "policy.lr=0.01",
                "grpo.kl_coef=0.01",
            ],
        )
        engine = build_training_engine(cfg, dev, vocab_size=VOCAB, pad_id=0, rank=rank)
        # The same seed on the same device: the weights the engine converted.
        hf = build_model({"arch": "llama", "seed": 0, "hf_config": TINY}, vocab_size=VOCAB, device=dev)
        trained = PRECISIONS["bf16"].train(hf)
        engine.connect(rank)
        out: dict[str, Any] = {
            "param_dtypes": sorted({str(p.dtype) for p in engine.model.parameters()}),
            "master_dtypes": sorted({str(p.dtype) for p in engine.trained.params}),
            "refit_dtypes": sorted({str(d) for _, d in engine.refit_shapes().values()}),
        }
        g = torch.Generator().manual_seed(3)
        rows = [torch.randint(3, VOCAB, (int(n),), generator=g) for n in (9, 5, 12, 7)]
        from tensordict import TensorDict

        from nemo_dataplane.codec import jagged_from_rows

        mb = TensorDict({"input_ids": jagged_from_rows(rows), "prompt_len": torch.tensor([4, 2, 6, 3])}, batch_size=[4])
        with torch.no_grad():
            mc_lp, _, mask = engine.score("policy", mb, False)
        from algorithms.engines.training.hf import model_inputs

        ids, attn, resp = model_inputs(mb, 0, dev)
        hf_lp = sequence_logprobs(hf, ids, attn, resp)
        out["lp_diff"] = float(((mc_lp - hf_lp) * mask).abs().max())
        adv = torch.tensor([1.0, -0.5, 0.3, -1.2], device=dev)
        old = (hf_lp.detach() + 0.05 * mask).detach()
        ref = old - 0.1 * mask
        tokens = float(mask.sum())
        kw = dict(clip_eps=0.2, kl_coef=0.01, global_token_count=tokens, kl_clamp=10.0)
        loss, _ = policy_loss(hf_lp, old, ref, adv, mask, **kw)
        loss.backward()
        out["hf_grad_norm"] = float(torch.sqrt(sum((m.grad.float() ** 2).sum() for m in trained.params)))
        prep = [Prepared(mb=mb, mask=mask, old=old, ref=ref, adv=adv, behaviour=None)]
        before = [p.detach().clone() for p in engine.trained.params]
        steps = [engine.train_step(prep, tokens, False) for _ in range(2)]
        out["grad_norm"] = steps[0]["grad_norm"]
        out["losses"] = [s["loss"] for s in steps]
        out["moved"] = any(not torch.equal(a, b) for a, b in zip(before, engine.trained.params))
        wrote = engine.save_hf(tmp, {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0})
        out["wrote"] = wrote
        dist.barrier()
        from safetensors.torch import load_file

        exported = load_file(f"{tmp}/model.safetensors", device="cpu")
        mine = hf_to_mcore(exported, engine.shape, tp=world, rank=ps.get_tensor_model_parallel_rank())
        own = {k: v.detach().cpu() for k, v in engine.model.state_dict().items() if not k.endswith("_extra_state")}
        out["export_exact"] = sorted(k for k in own if k in mine and not torch.equal(own[k], mine[k])) == []
        out["export_dtypes"] = sorted({str(t.dtype) for t in exported.values()})
        return out
    finally:
        ps.destroy_model_parallel()
        dist.destroy_process_group()
