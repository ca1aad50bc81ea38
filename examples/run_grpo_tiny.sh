#!/usr/bin/env bash
# The README's first command: GRPO on a toy task, every batch moving through TransferQueue.
#   bash examples/run_grpo_tiny.sh [dotted.key=value ...]
# Creates ./.venv when missing (torch==2.13.0 first, so nothing pulls another torch build; then
# the package with its [train] extra), then runs the trainer with the data plane on. Outputs
# (metrics.jsonl, reward_loss.png, checkpoints, summary.json) go to runs/grpo_tiny/.
# For CUDA: install the torch wheel you want into .venv first; this script keeps it.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  echo "[run_grpo_tiny] creating .venv" >&2
  "$PY" -m venv .venv
fi
. .venv/bin/activate
if ! python -c "import torch, ray, transfer_queue, transformers, tensordict, omegaconf, tqdm, matplotlib" 2>/dev/null; then
  echo "[run_grpo_tiny] installing torch==2.13.0, then the package with its [train] extra (quiet)" >&2
  python -m pip install -q --disable-pip-version-check --upgrade pip >/dev/null
  python -c "import torch" 2>/dev/null || python -m pip install -q --disable-pip-version-check torch==2.13.0
  python -m pip install -q --disable-pip-version-check -e ".[train]"
fi
# One thread per process: 2 policy ranks, the generator, the collector and the store share
# the CPU cores; more threads per process only make them fight.
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} RAY_USAGE_STATS_ENABLED=0 RAY_DEDUP_LOGS=0
exec python -m algorithms.grpo_sync --config examples/configs/grpo_tiny.yaml data_plane.enabled=true "$@"
