"""The trainers' command line: ``python -m algorithms.grpo_sync|grpo_async --config FILE [dotted.key=value ...]``.

Exit status: 0 on success, 1 when a step or the set-up failed, 2 for a bad config (one line naming
the key; also an output directory holding another run's results, or a checkpoint that cannot be
resumed: :mod:`algorithms.run_dir`), 3 when the run finished but leaked keys in the store, 130 on
Ctrl-C, 143 on SIGTERM (after the same shutdown as Ctrl-C's).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import typing
from collections.abc import Sequence

from algorithms.config import ConfigError, TrainerConfig, check_devices, load_config
from algorithms.trainer import Trainer

__all__ = ["main"]


def _sections() -> str:
    """One line per config section: its YAML key and the first line of its docstring."""
    hints = typing.get_type_hints(TrainerConfig)
    lines = []
    for f in dataclasses.fields(TrainerConfig):
        doc = (hints[f.name].__doc__ or "").strip().splitlines()[0]
        lines.append(f"  {f.metadata.get('key', f.name):12s} {doc}")
    return "\n".join(lines)


def main(trainer_cls: type[Trainer], argv: Sequence[str] | None = None) -> int:
    """CLI entry point of a trainer; returns the exit status."""
    parser = argparse.ArgumentParser(
        prog=f"python -m algorithms.{trainer_cls.name}",
        description=(trainer_cls.__doc__ or "").strip().splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="config sections (each key documented in algorithms/config_sections.py and docs/grpo_sync.md):\n"
        + _sections(),
    )
    parser.add_argument("--config", help="YAML config (examples/configs/*.yaml)")
    parser.add_argument("overrides", nargs="*", help="dotted.key=value overrides, e.g. trainer.steps=10")
    args = parser.parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
        check_devices(cfg, generators=trainer_cls.num_collectors(cfg))
        trainer = trainer_cls(cfg)
        trainer.prepare()  # the output directory and the checkpoint to resume from
    except (ConfigError, FileNotFoundError) as e:
        print(f"{trainer_cls.name}: config error: {e}", file=sys.stderr)
        return 2
    return trainer.run()
