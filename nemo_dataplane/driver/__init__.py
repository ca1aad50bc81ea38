"""Driver-side helpers: plan DP shards from lengths, fan out per-rank metas, small column I/O.

Nothing here moves bulk tensors through the driver except a ``TensorDict`` fan-out source,
which is written straight to the store.
"""

from nemo_dataplane.driver.columns import read_columns, write_columns
from nemo_dataplane.driver.fan_out import async_fan_out_per_rank_metas, fan_out_per_rank_metas
from nemo_dataplane.driver.planner import Preshards, plan, plan_dynamic, plan_none, plan_sequence_packing
from nemo_dataplane.driver.preshard import driver_balanced_preshards, select_rows, split_microbatches

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
