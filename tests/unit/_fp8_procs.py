"""Per-rank body for the FP8 refit test over gloo (``test_refit_fp8.py``), run in a fresh
process through ``_refit_procs.run_ranks``; split from ``_refit_procs`` (the process pool, the
stateless-group and packed-refit bodies), whose group helpers it uses.
"""

from __future__ import annotations

from typing import Any

import torch
from _refit_procs import _bytes, _group


def fp8_refit(rank: int, world: int, port: int, send: str | None, expect: str | None) -> dict[str, Any]:
    """The vLLM test model's weights refit over gloo in the form ``send`` (a
    ``generation.vllm.quantization`` value) into staging laid out for ``expect``, as the vLLM
    worker allocates it; twice, the weights changing in between. The receiver returns, per
    refit, the names whose bytes differ from its own quantization of the weights it expects and
    the worst error of dequantizing against them; or the handshake's error."""
    from algorithms.models import build_model
    from algorithms.refit_weights import form_of
    from algorithms.tasks import CharTokenizer
    from nemo_dataplane.refit import WeightTransferConfig, build_weight_receiver, build_weight_sender
    from nemo_dataplane.refit.fp8 import dequantize

    cfg = {
        "arch": "llama",
        "seed": 0,
        "hf_config": {
            "hidden_size": 128,
            "intermediate_size": 320,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "max_position_embeddings": 64,
        },
    }
    model = build_model(cfg, vocab_size=CharTokenizer().vocab_size).to(torch.bfloat16)
    shapes = {n: (p.shape, p.dtype) for n, p in model.named_parameters()}
    g = _group(rank, world, port, "gloo")
    try:
        if rank == 0:
            weights = form_of(send)
            snd = build_weight_sender(
                WeightTransferConfig(),
                g,
                weights.source(model.named_parameters, shapes),
                full_shapes=weights.layout(shapes),
            )
            try:
                snd.prepare_refit_info()
            except Exception as e:  # noqa: BLE001 - reported
                return {"error": type(e).__name__, "msg": str(e)}
            for step in range(2):
                with torch.no_grad():
                    for p in model.parameters():
                        p.mul_(1.5 + step)
                snd.send_weights(step + 1)
            g.barrier()
            return {"bytes": weights.nbytes(shapes)}
        weights = form_of(expect)
        layout = weights.layout(shapes)
        staging = {n: torch.zeros(s, dtype=getattr(torch, d)) for n, (s, d) in layout.items()}
        rcv = build_weight_receiver(WeightTransferConfig(), g, staging)
        try:
            rcv.prepare_refit_info()
        except Exception as e:  # noqa: BLE001 - reported
            return {
                "error": type(e).__name__,
                "msg": str(e),
                "untouched": all(bool((t == 0).all()) for t in staging.values()),
            }
        out = []
        for step in range(2):
            version = rcv.receive_weights()
            with torch.no_grad():
                for p in model.parameters():
                    p.mul_(1.5 + step)
            want = weights.checkpoint(dict(model.named_parameters()))
            wrong = [n for n in layout if not torch.equal(_bytes(staging[n]), _bytes(want[n]))]
            scheme = weights.scheme
            err = 0.0
            if scheme is not None:
                for n, p in model.named_parameters():
                    if staging[n].dtype == torch.float8_e4m3fn:
                        scale = staging[scheme.scale_name(n)]
                        deq = dequantize(staging[n], scale, scheme.block)
                        # e4m3: 3 mantissa bits, so within 1/16 of the value (+ the subnormal step).
                        bound = p.float().abs() / 16 + scale.float().amax() * 2.0**-9
                        err = max(err, float(((deq - p.float()).abs() / bound).max()))
            out.append({"version": version, "wrong": wrong, "err_over_bound": err})
        g.barrier()
        return {"refits": out, "fp8": sorted(n for n, t in staging.items() if t.dtype == torch.float8_e4m3fn)}
    finally:
        g.destroy()
