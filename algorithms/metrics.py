"""What the user sees: progress bar, per-step JSONL, TensorBoard mirror, PNG plot, summary line.

Also :func:`payload_bytes`, the one way the trainer counts bytes that cross a process boundary
(tensors by their storage, everything else by its pickled size), used for both "data-plane
bytes moved" and "bytes through the driver" so the two transports are measured alike.
"""

from __future__ import annotations

import json
import math
import pickle
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TextIO

import torch
from tensordict import TensorDictBase

from algorithms.config import TrainerConfig
from algorithms.exporter import PrometheusExporter
from algorithms.precision import precision_of
from algorithms.telemetry import OpRecord

# Keys every step line carries (absent values are written as null), in display order.
STEP_KEYS: tuple[str, ...] = (
    "step",
    "reward",
    "loss",
    "pg_loss",
    "kl",
    "entropy",
    "clip_frac",
    "grad_norm",
    "response_len",
    "samples",
    "samples_dropped",
    "tokens",
    "tokens_per_s",
    "step_s",
    "dp_bytes",
    "driver_bytes",
    "keys_outstanding",
    "trainer_idle_ratio",
    "generator_idle_ratio",
    "weight_version",
    "val_reward",
)


def payload_bytes(obj: Any) -> int:
    """Bytes ``obj`` occupies on the wire: tensor storage for tensors (a jagged tensor counts its
    values and offsets), recursively through dicts/lists/TensorDicts, pickled size otherwise."""
    if isinstance(obj, torch.Tensor):
        if getattr(obj, "is_nested", False) and obj.layout == torch.jagged:
            return payload_bytes(obj.values()) + payload_bytes(obj.offsets())  # type: ignore[attr-defined]  # NJT
        return obj.numel() * obj.element_size()
    if isinstance(obj, TensorDictBase):
        return sum(payload_bytes(v) for v in obj.values(include_nested=True, leaves_only=True))
    if isinstance(obj, Mapping):
        return sum(len(pickle.dumps(k)) + payload_bytes(v) for k, v in obj.items())
    if isinstance(obj, (list, tuple)) and any(isinstance(v, (torch.Tensor, Mapping)) for v in obj):
        return sum(payload_bytes(v) for v in obj)
    if hasattr(obj, "data") and hasattr(obj, "plan") and isinstance(obj.data, TensorDictBase):
        return payload_bytes(obj.data) + len(pickle.dumps(obj.plan))  # a legacy shard
    try:
        return len(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))
    except Exception:  # noqa: BLE001 - unpicklable handles carry no payload worth counting
        return 0


def _fmt(x: Any) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        if math.isnan(x):
            return "nan"
        return f"{x:.4g}"
    return str(x)


class StartupProgress:
    """The run's start-up on the progress display (a tqdm bar on stderr, before the steps' bar):
    how many of ``phases`` are done, the one under way and the time since the start. Nothing is
    shown when ``enabled`` is false. :meth:`close` is idempotent."""

    def __init__(self, phases: Sequence[str], *, name: str, enabled: bool, stream: TextIO | None = None) -> None:
        self.phases = list(phases)
        self._bar: Any = None
        if enabled:
            from tqdm import tqdm  # extra `train`, loaded only when asked for

            self._bar = tqdm(
                total=len(self.phases),
                desc=f"{name} start-up",
                bar_format="{desc}: {n_fmt}/{total_fmt} phases [{elapsed}]{postfix}",
                file=stream or sys.stderr,
                dynamic_ncols=True,
                leave=True,
            )

    def phase(self, name: str, detail: str = "") -> None:
        """Phase ``name`` (one of ``phases``) begins: those before it are done."""
        if self._bar is None:
            return
        self._bar.n = self.phases.index(name)
        self._bar.set_postfix_str(f"{name}{': ' + detail if detail else ''} ...", refresh=True)

    def close(self, done: bool) -> None:
        """End the display: every phase done (``done``), or the start-up cut short where it was."""
        if self._bar is None:
            return
        if done:
            self._bar.n = len(self.phases)
            self._bar.set_postfix_str("done", refresh=True)
        self._bar.close()
        self._bar = None


class MetricsLogger:
    """Writes one JSON line per step to ``metrics.jsonl`` (appending on resume), mirrors scalars
    to TensorBoard when asked, and drives a tqdm bar (stderr) with reward, loss and step time.

    Contract: :meth:`log_step` takes the step's flat dict of scalars; ``close`` is idempotent.
    """

    def __init__(
        self,
        output_dir: str | Path,
        *,
        total_steps: int,
        start_step: int = 0,
        progress: bool = True,
        tensorboard: bool = False,
        stream: TextIO | None = None,
        exporter: PrometheusExporter | None = None,
        wandb_run: Any = None,
    ) -> None:
        self.exporter = exporter
        self._wandb = wandb_run
        self.output_dir = Path(output_dir)
        self.output_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.output_dir / "metrics.jsonl"
        if start_step == 0 and self.path.exists():
            self.path.unlink()  # a fresh run owns the file; a resumed one appends
        elif start_step > 0 and self.path.exists():
            self._truncate_after(start_step)
        self._file: TextIO | None = self.path.open("a", encoding="utf-8")
        self.rows: list[dict[str, Any]] = self._read_rows()
        self._tb = None
        if tensorboard:
            # tensorboard (extra `train`) is loaded only when asked for.
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=str(self.output_dir / "tensorboard"))
        self._bar = None
        if progress:
            from tqdm import tqdm  # extra `train`, loaded only when asked for

            self._bar = tqdm(
                total=total_steps,
                initial=start_step,
                desc="grpo",
                unit="step",
                file=stream or sys.stderr,
                dynamic_ncols=True,
                leave=True,
            )

    def _read_rows(self) -> list[dict[str, Any]]:
        if not self.path.exists():
            return []
        return [json.loads(line) for line in self.path.read_text(encoding="utf-8").splitlines() if line.strip()]

    def _truncate_after(self, start_step: int) -> None:
        # A resumed run replays steps after its checkpoint: drop lines the crashed run wrote past it.
        keep = [r for r in self._read_rows() if r.get("step", -1) < start_step]
        self.path.write_text("".join(json.dumps(r) + "\n" for r in keep), encoding="utf-8")

    @classmethod
    def for_run(cls, out: Path, cfg: TrainerConfig, *, start_step: int, policy_params: int) -> MetricsLogger:
        """The logger a trainer run's config asks for, with its Prometheus endpoint if
        ``logging.prometheus_port`` is set (announced on stderr)."""
        lg = cfg.logging
        exporter = None
        if lg.prometheus_port is not None:
            item = torch.empty(0, dtype=precision_of(cfg).dtype).element_size()
            exporter = PrometheusExporter(lg.prometheus_host, lg.prometheus_port, refit_bytes=policy_params * item)
            print(f"prometheus: serving {exporter.url}", file=sys.stderr, flush=True)
        run = None
        if lg.wandb:
            import wandb  # optional: checked before Ray starts (algorithms.inputs)

            run = wandb.init(project=lg.wandb_project, dir=str(out), config=cfg.to_dict(), name=Path(out).name)
        return cls(
            out,
            total_steps=cfg.trainer.steps,
            start_step=start_step,
            progress=lg.progress,
            tensorboard=lg.tensorboard,
            exporter=exporter,
            wandb_run=run,
        )

    def log_step(self, row: Mapping[str, Any], ops: Sequence[OpRecord] = (), staleness: Sequence[int] = ()) -> None:
        """Record one step (JSONL line, TensorBoard and W&B scalars, bar update, the Prometheus series:
        ``ops`` and ``staleness`` feed its histograms only)."""
        if self.exporter is not None:
            self.exporter.observe(row, ops, staleness)
        full = {k: row.get(k) for k in STEP_KEYS}
        full.update({k: v for k, v in row.items() if k not in full})
        self.rows.append(full)
        assert self._file is not None, "MetricsLogger is closed"
        self._file.write(json.dumps(full) + "\n")
        self._file.flush()
        step = int(row["step"])
        scalars = {k: v for k, v in full.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        if self._tb is not None:
            for k, v in scalars.items():
                if k != "step":
                    self._tb.add_scalar(k.replace(".", "/"), v, step)
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log(scalars, step=step)
        if self._bar is not None:
            extra = f" stale={_fmt(full['staleness_mean'])}" if full.get("staleness_mean") is not None else ""
            self._bar.set_postfix_str(
                f"reward={_fmt(full['reward'])} loss={_fmt(full['loss'])} step_s={_fmt(full['step_s'])}{extra}",
                refresh=False,
            )
            self._bar.update(1)

    def write(self, msg: str) -> None:
        """Print a line without breaking the bar."""
        if self._bar is not None:
            self._bar.write(msg, file=sys.stderr)
        else:
            print(msg, file=sys.stderr, flush=True)

    def close(self) -> None:
        """Close every sink (idempotent): the endpoint's port is free once this returns."""
        sinks = (self.exporter, self._bar, self._tb, self._file)
        run, self._wandb = self._wandb, None
        self.exporter = self._bar = self._tb = self._file = None
        if run is not None:
            run.finish()
        for sink in sinks:
            if sink is not None:
                sink.close()


# The plot's panels after the reward: (title, [(metric key, line label)]); a panel is drawn only
# when one of its metrics was logged (staleness: async runs).
PLOT_PANELS: tuple[tuple[str, tuple[tuple[str, str], ...]], ...] = (
    ("loss", (("loss", "loss"),)),
    ("pg_loss", (("pg_loss", "policy-gradient loss"),)),
    ("KL", (("kl", "KL to the reference"), ("behaviour_kl", "behaviour KL"))),
    ("staleness", (("staleness_mean", "mean"), ("staleness_max", "max"))),
)


def metrics_figure(rows: Sequence[Mapping[str, Any]], title: str | None = None) -> Any:
    """A matplotlib figure of ``rows`` (non-empty): train/validation reward, then each
    :data:`PLOT_PANELS` panel whose metrics were logged; ``title`` is the figure's title."""
    # matplotlib (extra `train`) is slow to import and needed only here, at the end of a run.
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def series(key: str) -> list[float]:
        return [math.nan if r.get(key) is None else float(r[key]) for r in rows]

    steps = [r["step"] for r in rows]
    logged = {k for r in rows for k, v in r.items() if v is not None}
    panels = [(name, [(k, label) for k, label in lines if k in logged]) for name, lines in PLOT_PANELS]
    panels = [(name, lines) for name, lines in panels if lines]
    ncols = min(3, 1 + len(panels))
    nrows = -(-(1 + len(panels)) // ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(4.5 * ncols, 3.6 * nrows), squeeze=False)
    flat = list(axes.flat)
    ax_r = flat[0]
    ax_r.plot(steps, series("reward"), label="train reward")
    val = [(r["step"], r["val_reward"]) for r in rows if r.get("val_reward") is not None]
    if val:
        ax_r.plot([s for s, _ in val], [v for _, v in val], "o-", label="validation reward")
    ax_r.set_title("reward")
    ax_r.set_ylabel("mean reward")
    ax_r.set_ylim(-0.05, 1.05)
    for ax, (name, lines) in zip(flat[1:], panels):
        for key, label in lines:
            ax.plot(steps, series(key), label=label)
        ax.set_title(name)
        ax.set_ylabel(name)
    for ax in flat[: 1 + len(panels)]:
        ax.set_xlabel("step")
        ax.legend()
    for ax in flat[1 + len(panels) :]:
        ax.set_visible(False)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return fig


def plot_metrics(rows: Sequence[Mapping[str, Any]], path: str | Path, title: str | None = None) -> Path | None:
    """Write :func:`metrics_figure` as a PNG at ``path``; None (nothing written) if no rows."""
    if not rows:
        return None
    import matplotlib.pyplot as plt

    fig = metrics_figure(rows, title)
    out = Path(path)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def summary_line(
    rows: Sequence[Mapping[str, Any]],
    *,
    wall_s: float,
    status: str,
    files: Sequence[str | Path] = (),
    name: str = "grpo_sync",
    idle: Mapping[str, float] | None = None,
) -> str:
    """One line for the end of a run: status, steps, reward first->last, best validation, the
    run's idle ratios (``idle``), time (and for async runs the staleness and stale groups
    dropped), then ``files``: the caller passes only files that exist."""
    where = f"; outputs: {', '.join(str(f) for f in files)}" if files else ""
    if not rows:
        return f"{name} {status}: 0 steps in {wall_s:.1f}s{where}"
    first, last = rows[0], rows[-1]
    head = min(3, len(rows))
    r0 = sum(r["reward"] for r in rows[:head]) / head
    r1 = sum(r["reward"] for r in rows[-head:]) / head
    vals = [r["val_reward"] for r in rows if r.get("val_reward") is not None]
    best = f", best val reward {max(vals):.3f}" if vals else ""
    stale = ""
    if any(r.get("staleness_max") is not None for r in rows):
        stale = (
            f", staleness max {max(r.get('staleness_max') or 0 for r in rows)}, "
            f"stale groups dropped {sum(r.get('groups_dropped_stale') or 0 for r in rows)}"
        )
    ratios = ""
    if idle:
        ratios = f", idle: trainer {idle['trainer_idle_ratio']:.2f}, generator {idle['generator_idle_ratio']:.2f}"
    return (
        f"{name} {status}: steps {first['step']}..{last['step']}, mean reward {r0:.3f} -> {r1:.3f} "
        f"(first/last {head} steps){best}, loss {_fmt(last.get('loss'))}, "
        f"max keys outstanding {max((r.get('keys_outstanding') or 0) for r in rows)}{stale}{ratios}, "
        f"{wall_s:.1f}s wall{where}"
    )


class PhaseTimer:
    """Accumulates seconds per named phase: ``with timer("train"): ...``."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    def __call__(self, name: str) -> _Phase:
        return _Phase(self, name)


class _Phase:
    def __init__(self, timer: PhaseTimer, name: str) -> None:
        self.timer, self.name = timer, name

    def __enter__(self) -> None:
        self.t0 = time.perf_counter()

    def __exit__(self, *exc: object) -> None:
        self.timer.seconds[self.name] = self.timer.seconds.get(self.name, 0.0) + time.perf_counter() - self.t0
