"""Non-finite values refused (issue 25, item 4).

Timeouts: a NaN passes a ``< 0`` check and makes a deadline that is never reached; an infinite
timeout never ends. Every public timeout goes through ``nemo_dataplane.timeouts.check_timeout``
(the claim conformance suite holds every backend to it; the other entry points are here).

Training values: a NaN reward, advantage, log-prob or gradient fails the step with a
``NonFiniteError`` naming the group and the prompt, before any optimizer step; the weights keep
their values. Run on a real in-process policy rank (one rank, gloo) of the tiny config.
"""

from __future__ import annotations

import dataclasses
import sys
import typing
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from tensordict import TensorDict

from algorithms.config import load_config
from algorithms.metrics import PhaseTimer
from algorithms.remote import gather
from algorithms.rewards import RewardError, checked_reward
from algorithms.rollouts import RolloutBatch
from algorithms.step import Workers, train_on_batch
from algorithms.tasks import PromptRecord
from algorithms.transports.legacy import LegacyBatchIO, LegacyTransport, legacy_shard
from algorithms.workers.policy import PolicyWorker
from nemo_dataplane.codec import jagged_from_rows, jagged_rows
from nemo_dataplane.config import ConfigError
from nemo_dataplane.distributed.stateless_group import StatelessProcessGroup
from nemo_dataplane.distributed.work import call_with_deadline
from nemo_dataplane.driver.preshard import driver_balanced_preshards
from nemo_dataplane.errors import NemoDataplaneError, NonFiniteError
from nemo_dataplane.timeouts import check_timeout
from nemo_dataplane.worker.fetch import WorkerFetcher, wait_work

sys.path.insert(0, str(Path(__file__).parent))
import _refit_procs as P  # noqa: E402

CONFIG = Path(__file__).resolve().parents[2] / "examples" / "configs" / "grpo_tiny.yaml"
NON_FINITE = [float("nan"), float("inf"), float("-inf")]


# ----------------------------------------------------------------------------- timeouts
@pytest.mark.parametrize("bad", [*NON_FINITE, -1.0, True, None, "5"])
def test_check_timeout_refuses_non_finite_negative_and_non_numbers_by_name(bad: Any) -> None:
    with pytest.raises(ValueError, match="^my_timeout must be"):
        check_timeout(bad, "my_timeout")


def test_check_timeout_passes_finite_seconds_and_zero_only_where_allowed() -> None:
    assert check_timeout(0, "t") == 0.0 and check_timeout(2, "t") == 2.0 and check_timeout(0.5, "t") == 0.5
    with pytest.raises(ValueError, match="t must be > 0 seconds, got 0"):
        check_timeout(0, "t", allow_zero=False)


@pytest.mark.parametrize("bad", NON_FINITE)
def test_stateless_group_refuses_a_non_finite_timeout_at_construction_and_per_call(bad: float) -> None:
    with pytest.raises(ValueError, match="^timeout must be a finite number"):
        StatelessProcessGroup(P.HOST, P.free_port(), 0, 1, "gloo", timeout=bad)
    with StatelessProcessGroup(P.HOST, P.free_port(), 0, 1, "gloo", timeout=5) as g:
        with pytest.raises(ValueError, match="^timeout must be a finite number"):
            g.barrier(timeout=bad)
        with pytest.raises(ValueError, match="^timeout must be a finite number"):
            g.wait_for_ranks(lambda r: f"never/{r}", [0], "a wait", timeout=bad)
        g.barrier(timeout=5)  # the refused calls left the group usable


@pytest.mark.parametrize("bad", NON_FINITE)
def test_worker_fetch_waits_and_deadline_calls_refuse_a_non_finite_timeout(bad: float) -> None:
    called = []
    with pytest.raises(ValueError, match="^timeout must be a finite number"):
        call_with_deadline(lambda: called.append(1), bad, "call")
    assert called == [], "refused before the call started"
    with pytest.raises(ValueError, match="^timeout_s must be a finite number"):
        wait_work(object(), bad, "a broadcast")
    with pytest.raises(ValueError, match="^timeout_s must be a finite number"):
        WorkerFetcher(None, fetch_policy="independent", timeout_s=bad)
    with pytest.raises(ValueError, match="^timeout_s must be a finite number"):
        gather([], bad, "a step")


def test_every_float_key_of_the_trainer_config_refuses_nan_and_inf() -> None:
    # Walks the config's dataclasses, so a float key added later is held to it too.
    def keys(obj: Any, prefix: str) -> list[tuple[str, str]]:
        hints = typing.get_type_hints(type(obj))
        out: list[tuple[str, str]] = []
        for f in dataclasses.fields(obj):
            value, tp = getattr(obj, f.name), str(hints[f.name])
            if dataclasses.is_dataclass(value):
                out += keys(value, f"{prefix}{f.name.rstrip('_')}.")
            elif ("float" in tp and "Literal" not in tp) or tp == "<class 'float'>":
                out.append((prefix + f.name, tp))
        return out

    found = keys(load_config(CONFIG, []), "")
    assert ("trainer.step_timeout_s", "<class 'float'>") in found and len(found) > 20
    for key, tp in found:
        for value in (".nan", ".inf", "-.inf"):
            override = f"{key}=[{value},{value}]" if "tuple" in tp else f"{key}={value}"
            with pytest.raises(ConfigError, match="must be a finite number"):
                load_config(CONFIG, [override])


# ----------------------------------------------------------------------------- training values
def test_a_nan_reward_is_a_non_finite_error_naming_the_prompt_and_group() -> None:
    rec = PromptRecord(uid=3, prompt="What is 12 + 7?", answer="19")
    with pytest.raises(NonFiniteError, match=r"returned nan on prompt uid 3 \('What is 12 \+ 7\?'.* of group 11") as e:
        checked_reward(lambda r, t: float("nan"), rec, "19", name="mine", group=11)
    assert isinstance(e.value, RewardError) and isinstance(e.value, NemoDataplaneError)


def _nan_reward(record: PromptRecord, text: str) -> float:
    return float("nan")


def _score_in_a_worker(record: PromptRecord) -> float:
    """As the collector scores a response: in a Ray worker, through the check."""
    return checked_reward(_nan_reward, record, "19", name="nan_reward", group=2)


def test_a_workers_non_finite_reward_prints_whole_from_the_worker_frame_on(ray_session: Any) -> None:
    """Ray returns the worker's exception without its traceback; the step's error is chained to
    the worker's own traceback, so the printed error starts where the reward was checked."""
    import traceback

    from algorithms.remote import StepError, WorkerTraceback

    rec = PromptRecord(uid=3, prompt="What is 12 + 7?", answer="19")
    ref = ray_session.remote(num_cpus=0)(_score_in_a_worker).remote(rec)
    with pytest.raises(StepError) as e:
        gather([ref], 60, "step 0 collect")
    cause = e.value.__cause__
    assert isinstance(cause, NonFiniteError) and isinstance(cause.__cause__, WorkerTraceback)
    printed = "".join(traceback.format_exception(e.value))
    first = printed.splitlines()[0]
    assert first.startswith("algorithms.remote.WorkerTraceback") and "direct cause" not in first
    worker_part = printed.split("The above exception was the direct cause")[0]
    assert "ray::_score_in_a_worker() (pid=" in worker_part  # the worker, then its frames
    assert 'test_nonfinite.py", line' in worker_part and 'rewards.py", line' in worker_part
    assert "raise NonFiniteReward" in worker_part and "\x1b[" not in worker_part
    assert printed.rstrip().endswith("of group 2; it must be finite")


@pytest.fixture(scope="module")
def worker():
    cfg = load_config(CONFIG, ["data_plane.enabled=false", "grpo.epochs=1", "data_plane.packing.micro_batch_size=2"])
    w = PolicyWorker(0, 1, cfg)
    w.join_train_group(*w.host_rendezvous("train", 1, loopback=True))
    w.attach(LegacyBatchIO(60.0))
    yield w, cfg
    w.shutdown()
    assert not dist.is_initialized()


GROUP_IDS = [5, 7]  # two groups of 2 samples
PROMPTS = ["12+7=", "abc + 3 ="]


def _batch(w: PolicyWorker) -> TensorDict:
    """Four rows (two groups), log-probs as the current policy scores them (finite)."""
    g = torch.Generator().manual_seed(0)
    rows, prompt_len = [], []
    for i in range(4):
        p = [*w.tokenizer.encode_prompt(PROMPTS[i // 2])]
        rows.append(torch.tensor(p + torch.randint(3, 20, (3 + i,), generator=g).tolist()))
        prompt_len.append(len(p))
    batch = TensorDict(
        {
            "input_ids": jagged_from_rows(rows),
            "prompt_len": torch.tensor(prompt_len),
            "seq_len": torch.tensor([r.numel() for r in rows]),
            "group_id": torch.tensor(GROUP_IDS).repeat_interleave(2),
            "advantages": torch.tensor([1.0, -1.0, 0.5, -0.5]),
            "rewards": torch.tensor([1.0, 0.0, 1.0, 0.0]),
        },
        batch_size=[4],
    )
    zeros = jagged_from_rows([torch.zeros(r.numel() - 1) for r in rows])
    batch.set("prev_logprobs", zeros)
    batch.set("ref_logprobs", zeros.clone())
    return batch


def _shard(batch: TensorDict, cfg: Any) -> Any:
    (shard,) = legacy_shard(batch, driver_balanced_preshards(batch, 1, cfg.data_plane.packing))
    return shard


def _weights(w: PolicyWorker) -> list[torch.Tensor]:
    return [p.detach().clone() for p in w.engine.trained.params]


def _unchanged(w: PolicyWorker, before: list[torch.Tensor]) -> bool:
    return all(torch.equal(a, b) for a, b in zip(before, w.engine.trained.params))


def _set_row(batch: TensorDict, field: str, row: int, value: float) -> None:
    rows = jagged_rows(batch[field])
    rows[row] = rows[row].clone()
    rows[row][-1] = value  # the last position scores a response token: inside the loss mask
    batch.set(field, jagged_from_rows(rows))


def _prompt_of(w: PolicyWorker, batch: TensorDict, row: int) -> str:
    return w.tokenizer.decode(jagged_rows(batch["input_ids"])[row][: int(batch["prompt_len"][row])].tolist())


def test_finite_inputs_do_train_so_unchanged_weights_below_mean_a_refusal(worker) -> None:
    w, cfg = worker
    before = _weights(w)
    w.train(_shard(_batch(w), cfg), 0)
    assert not _unchanged(w, before)


@pytest.mark.parametrize(
    ("field", "what"),
    [
        ("advantages", "advantage"),
        ("prev_logprobs", "proximal log-prob"),
        ("ref_logprobs", "reference log-prob"),
        ("gen_logprobs", "behaviour log-prob"),
    ],
)
@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_a_non_finite_input_fails_train_naming_group_and_prompt_weights_unchanged(
    worker, field: str, what: str, value: float
) -> None:
    w, cfg = worker
    batch = _batch(w)
    behaviour = field == "gen_logprobs"
    if behaviour:
        batch.set("gen_logprobs", batch["prev_logprobs"].clone())
    if field == "advantages":
        batch["advantages"][2] = value
    else:
        _set_row(batch, field, 2, value)
    before, adam = _weights(w), {k: v["step"].clone() for k, v in w.engine.optimizer.state.items()}
    with pytest.raises(NonFiniteError) as e:
        w.train(_shard(batch, cfg), 1, behaviour=behaviour)
    msg = str(e.value)
    assert what in msg and "group 7" in msg and repr(_prompt_of(w, batch, 2)[:80]) in msg, msg
    assert "no optimizer step ran" in msg
    assert _unchanged(w, before)
    assert {k: v["step"] for k, v in w.engine.optimizer.state.items()} == adam, "AdamW did not step either"


def test_a_nan_current_logprob_is_refused_before_the_optimizer_step(worker, monkeypatch) -> None:
    w, cfg = worker
    batch = _batch(w)
    real = w.engine.score

    def score(which: Any, mb: TensorDict, entropy: bool) -> Any:
        lp, ent, mask = real(which, mb, entropy)
        hit = (mb["group_id"] == 5).nonzero().flatten()
        if len(hit):  # a real tensor in the graph: the backward runs through it
            j = int(hit[0])
            lp = lp.clone()
            lp[j, jagged_rows(mb["input_ids"])[j].numel() - 2] = float("nan")  # its last response token
        return lp, ent, mask

    monkeypatch.setattr(w.engine, "score", score)
    before = _weights(w)
    with pytest.raises(NonFiniteError) as e:
        w.train(_shard(batch, cfg), 2)
    msg = str(e.value)
    assert "optimizer step skipped" in msg and "current log-prob" in msg and "group 5" in msg, msg
    assert repr(_prompt_of(w, batch, 0)[:80]) in msg
    assert _unchanged(w, before)
    assert all(p.grad is None or not p.grad.any() for p in w.engine.trained.params), "gradients zeroed"
    # The log-prob phase refuses it too, before anything is written back.
    with pytest.raises(NonFiniteError, match=r"policy log-prob \(prev_logprobs\) is not finite .*group 5"):
        w.get_logprobs(_shard(batch, cfg), 2)


def test_a_nan_gradient_is_refused_before_the_optimizer_step(worker) -> None:
    w, cfg = worker
    param = next(p for p in w.engine.model.parameters() if p.requires_grad)
    hook = param.register_hook(lambda grad: grad * float("nan"))  # a real NaN gradient
    before = _weights(w)
    try:
        with pytest.raises(NonFiniteError, match=r"gradient norm is nan: optimizer step skipped, weights unchanged"):
            w.train(_shard(_batch(w), cfg), 3)
    finally:
        hook.remove()
    assert _unchanged(w, before)
    w.train(_shard(_batch(w), cfg), 4)  # the rank trains on once the cause is gone
    assert not _unchanged(w, before)


class _InProcess(LegacyTransport):
    """The baseline transport without Ray's object store; records releases."""

    released = 0

    def rank_inputs(self, handle: Any, preshards: Any, step: int) -> list[Any]:
        return legacy_shard(handle, preshards)

    def release(self, handle: Any) -> None:
        self.released += 1


class _Dispatch:
    def __init__(self, w: PolicyWorker) -> None:
        self.w, self.calls = w, 0

    def call(self, kind: str, inputs: list[Any], step: int, flag: bool, timeout_s: float, what: str) -> list[Any]:
        self.calls += 1
        return [self.w.step_call(kind, inputs[0], step, flag)]


@pytest.mark.parametrize(
    ("rewards", "what"),
    [
        ([1.0, 0.0, float("nan"), 0.0], "reward"),
        # Finite rewards whose group mean overflows float32: the advantages come out NaN.
        ([1.0, 0.0, 3e38, 3e38 * 0.9], "advantage"),
    ],
)
def test_a_non_finite_reward_or_advantage_fails_the_step_naming_group_and_prompt(
    worker, rewards: list[float], what: str
) -> None:
    w, cfg = worker
    batch = _batch(w)
    del batch["advantages"]
    transport, dispatch = _InProcess(cfg), _Dispatch(w)
    workers = Workers(policy=[w], generators=[], collectors=[], dispatch=dispatch)
    rb = RolloutBatch(
        handle=batch,
        rewards=torch.tensor(rewards),
        group_size=2,
        group_ids=GROUP_IDS,
        versions=[0, 0],
        response_len=3.0,
        prompts=PROMPTS,
    )
    before = _weights(w)
    with pytest.raises(NonFiniteError, match=rf"step 9: {what} is not finite .*group 7, prompt 'abc \+ 3 ='"):
        train_on_batch(cfg, workers, transport, rb, 9, PhaseTimer(), behaviour=False)
    assert dispatch.calls == 0, "refused on the driver, before any rank computed"
    assert transport.released == 1, "a failed step leaves no keys behind"
    assert _unchanged(w, before)
