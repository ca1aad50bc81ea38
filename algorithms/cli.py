"""The trainers' command line: ``python -m algorithms.grpo_sync|grpo_async --config FILE [dotted.key=value ...]``.

Exit status: 0 on success, 1 when a step or the set-up failed, 2 for a bad config (one line naming
the key; also an output directory holding another run's results, or a checkpoint that cannot be
resumed: :mod:`algorithms.run_dir`), 3 when the run finished but leaked keys in the store, 130 on
Ctrl-C, 143 on SIGTERM (after the same shutdown as Ctrl-C's).
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import sys
import typing
from collections.abc import Sequence

from algorithms.config import ConfigError, TrainerConfig, check_devices, load_config
from algorithms.trainer import Trainer

__all__ = ["main"]


# Where every key is documented, with its default and meaning (one table for the whole config).
CONFIG_REFERENCE = 'docs/grpo_sync.md "Config keys" (async: docs/grpo_async.md "Config")'


def _plain(text: str) -> str:
    """Docstring markup as plain text: ``:mod:`x```, ```x``` -> ``x``."""
    return re.sub(r":\w+:`([^`]*)`", r"\1", text).replace("``", "")


def _sections() -> str:
    """One line per config section: its YAML key and its class's one-line summary (the
    docstring's first line, a whole sentence)."""
    hints = typing.get_type_hints(TrainerConfig)
    lines = []
    for f in dataclasses.fields(TrainerConfig):
        doc = _plain((hints[f.name].__doc__ or "").strip().splitlines()[0])
        lines.append(f"  {f.metadata.get('key', f.name):12s} {doc}")
    return "\n".join(lines)


def main(trainer_cls: type[Trainer], argv: Sequence[str] | None = None) -> int:
    """CLI entry point of a trainer; returns the exit status."""
    parser = argparse.ArgumentParser(
        prog=f"python -m algorithms.{trainer_cls.name}",
        description=(trainer_cls.__doc__ or "").strip().splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=f"config sections; every key, its default and meaning: {CONFIG_REFERENCE}\n" + _sections(),
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
    except KeyboardInterrupt:  # while the inputs are checked: nothing was written or started yet
        print(f"\n{trainer_cls.name}: interrupted before the run started", file=sys.stderr)
        return 130
    return trainer.run()
