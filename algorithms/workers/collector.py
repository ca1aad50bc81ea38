"""Rollout collector (Ray actor): asks the generator for samples, scores them, and hands the
batch on without the driver ever holding it on the data-plane path.

* Data plane: rollouts are put straight into the store under
  ``step{step}/g{group}/s{i}`` of the step's partition, tagged ``seq_len``, ``group`` and
  ``weight_version``; the driver gets back the meta plus per-sample rewards.
* Legacy: the rollout ``TensorDict`` itself goes back to the driver through Ray.

Rollout fields: ``input_ids`` jagged int64 (``<bos>`` + prompt + response), ``prompt_len``,
``seq_len``, ``group_id``, ``weight_version`` int64, ``rewards`` float32.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

import ray
import torch
from tensordict import TensorDict

from algorithms.metrics import payload_bytes
from algorithms.workers.policy import InjectedFailure, jagged_from_rows


def rollout_keys(step: int, group_size: int, num_groups: int) -> list[str]:
    """Store keys of one step's rollouts, group-major (the generator's order)."""
    return [f"step{step}/g{g}/s{i}" for g in range(num_groups) for i in range(group_size)]


class RolloutCollector:
    """Args: ``cfg`` (``TrainerConfig.to_dict()``), ``generator`` (the generator actor handle)."""

    def __init__(self, cfg: Mapping[str, Any], generator: Any) -> None:
        from algorithms.tasks import CharTokenizer, resolve_reward_fn

        self.cfg = cfg
        torch.set_num_threads(1)
        self.generator = generator
        self.tokenizer = CharTokenizer()
        self.reward_fn = resolve_reward_fn(cfg["task"]["reward_fn"], cfg["task"]["name"])
        self.timeout_s = float(cfg["trainer"]["step_timeout_s"])
        self.client: Any = None

    def ready(self) -> bool:
        return True

    def attach_data_plane(self, data_plane_cfg: Mapping[str, Any]) -> None:
        """Attach to the driver's store (data-plane path only)."""
        from nemo_dataplane.factory import build_data_plane_client

        self.client = build_data_plane_client(data_plane_cfg, bootstrap=False)

    def _sample(self, records: Sequence[Any], n: int, seed: int, temperature: float | None) -> tuple[list, list, int]:
        prompts = [self.tokenizer.encode_prompt(r.prompt) for r in records]
        ref = self.generator.generate.remote(prompts, n, seed, temperature=temperature)
        responses, _, version = ray.get(ref, timeout=self.timeout_s)
        return prompts, responses, version

    def _score(self, records: Sequence[Any], responses: Sequence[Sequence[int]], n: int) -> list[float]:
        out = []
        for i, resp in enumerate(responses):
            record = records[i // n]
            value = self.reward_fn(record, self.tokenizer.decode(resp))
            try:
                out.append(float(value))
            except (TypeError, ValueError):
                raise TypeError(
                    f"reward_fn returned {value!r} (a {type(value).__name__}) for prompt uid {record.uid}; "
                    "it must return a float"
                ) from None
        return out

    def collect(self, step: int, records: Sequence[Any], seed: int, partition_id: str | None) -> dict[str, Any]:
        """Generate ``generation.n`` responses per record, score them, and deliver the batch.

        Returns ``{"meta": KVBatchMeta}`` (data plane, ``partition_id`` given) or
        ``{"batch": TensorDict}`` (legacy), plus ``rewards`` [B] float32, ``response_len`` (mean),
        ``weight_version``, ``dp_bytes`` (bytes put into the store) and ``generate_s``.
        """
        n = int(self.cfg["generation"]["n"])
        t0 = time.perf_counter()
        prompts, responses, version = self._sample(records, n, seed, None)
        t_gen = time.perf_counter() - t0
        rewards = torch.tensor(self._score(records, responses, n), dtype=torch.float32)
        rows, prompt_len = [], []
        for i, resp in enumerate(responses):
            p = prompts[i // n]
            rows.append(torch.tensor(list(p) + list(resp), dtype=torch.int64))
            prompt_len.append(len(p))
        seq_len = torch.tensor([r.numel() for r in rows], dtype=torch.int64)
        batch = TensorDict(
            {
                "input_ids": jagged_from_rows(rows),
                "prompt_len": torch.tensor(prompt_len, dtype=torch.int64),
                "seq_len": seq_len,
                "group_id": torch.arange(len(rows), dtype=torch.int64) // n,
                "weight_version": torch.full((len(rows),), version, dtype=torch.int64),
                "rewards": rewards,
            },
            batch_size=[len(rows)],
        )
        out: dict[str, Any] = {
            "rewards": rewards,
            "response_len": float(sum(len(r) for r in responses)) / max(len(responses), 1),
            "weight_version": version,
            "generate_s": t_gen,
            "dp_bytes": 0,
        }
        if partition_id is None:
            out["batch"] = batch
        else:
            keys = rollout_keys(step, n, len(records))
            tags = [
                {"seq_len": int(seq_len[i]), "group": int(i // n), "weight_version": int(version)}
                for i in range(len(rows))
            ]
            out["meta"] = self.client.kv_batch_put(keys, partition_id, batch, tags=tags)
            out["dp_bytes"] = payload_bytes(batch)
        fail = self.cfg["debug"]
        if fail.get("fail_in") == "collect" and fail.get("fail_at_step") == step:
            # After the put, so the test sees the driver clear keys a failed step left behind.
            raise InjectedFailure(f"debug.fail_in=collect: injected failure at step {step} in the collector")
        out["put_s"] = time.perf_counter() - t0 - t_gen
        return out

    def validate(self, records: Sequence[Any], seed: int) -> float:
        """Mean reward of one response per held-out record at ``generation.val_temperature``
        (nothing is stored)."""
        if not records:
            return float("nan")
        _, responses, _ = self._sample(records, 1, seed, float(self.cfg["generation"]["val_temperature"]))
        scores = self._score(records, responses, 1)
        return sum(scores) / len(scores)

    def loaded_modules(self) -> list[str]:
        import sys

        return sorted(m for m in sys.modules if m.startswith(("nemo_dataplane", "transfer_queue")))

    def close(self) -> None:
        if self.client is not None:
            self.client.close()
            self.client = None
