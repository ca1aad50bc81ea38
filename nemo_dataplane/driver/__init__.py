"""Driver-side helpers: plan DP shards from lengths, fan out per-rank metas, small column I/O.

Nothing here moves bulk tensors through the driver except a ``TensorDict`` fan-out source,
which is written straight to the store.
"""

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover - typing only
    from nemo_dataplane.driver.columns import read_columns, write_columns
    from nemo_dataplane.driver.fan_out import async_fan_out_per_rank_metas, fan_out_per_rank_metas
    from nemo_dataplane.driver.planner import Preshards, plan, plan_dynamic, plan_none, plan_sequence_packing
    from nemo_dataplane.driver.preshard import driver_balanced_preshards
    from nemo_dataplane.rows import select_rows, split_microbatches

# Names resolve on first access (PEP 562), so importing the planner or preshard alone (the legacy
# transport does) does not load fan-out or column I/O, which need the store client.
_WHERE = {
    "read_columns": "columns",
    "write_columns": "columns",
    "async_fan_out_per_rank_metas": "fan_out",
    "fan_out_per_rank_metas": "fan_out",
    "Preshards": "planner",
    "plan": "planner",
    "plan_dynamic": "planner",
    "plan_none": "planner",
    "plan_sequence_packing": "planner",
    "driver_balanced_preshards": "preshard",
    "select_rows": "nemo_dataplane.rows",
    "split_microbatches": "nemo_dataplane.rows",
}

__all__ = [
    "Preshards",
    "async_fan_out_per_rank_metas",
    "driver_balanced_preshards",
    "fan_out_per_rank_metas",
    "plan",
    "plan_dynamic",
    "plan_none",
    "plan_sequence_packing",
    "read_columns",
    "select_rows",
    "split_microbatches",
    "write_columns",
]


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        import importlib

        where = _WHERE[name]
        module = where if "." in where else f"nemo_dataplane.driver.{where}"
        return getattr(importlib.import_module(module), name)
    raise AttributeError(f"module 'nemo_dataplane.driver' has no attribute {name!r}")
