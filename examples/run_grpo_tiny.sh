#!/usr/bin/env bash
# The README's first command: GRPO on a toy task, every batch moving through TransferQueue.
#   bash examples/run_grpo_tiny.sh [dotted.key=value ...]
# Creates ./.venv when missing (.ci/setup-env train: torch==2.13.0 first, so nothing pulls another
# torch build; then the package with its `train` extra, no test tools, no vLLM), then runs the
# trainer with the data plane on. Outputs (metrics.jsonl, reward_loss.png, checkpoints,
# summary.json) go to runs/grpo_tiny/; a second run there is refused unless it resumes
# (checkpoint.resume=latest) or overwrites (logging.overwrite=true).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash .ci/setup-env train   # ./.venv with torch==2.13.0 first, then .[train]; a no-op once done
. .venv/bin/activate
# One thread per process: 2 policy ranks, the generator, the collector and the store share
# the CPU cores; more threads per process only make them fight.
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} RAY_USAGE_STATS_ENABLED=0 RAY_DEDUP_LOGS=0
# GRPO_TRAINER=grpo_async (examples/run_grpo_async_tiny.sh) runs the asynchronous trainer instead.
trainer=${GRPO_TRAINER:-grpo_sync}
config=examples/configs/grpo_tiny.yaml
[ "$trainer" = grpo_async ] && config=examples/configs/grpo_async_tiny.yaml
exec python -m "algorithms.$trainer" --config "$config" data_plane.enabled=true "$@"
