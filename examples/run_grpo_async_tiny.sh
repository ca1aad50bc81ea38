#!/usr/bin/env bash
# Asynchronous GRPO on the toy task: rollouts stream through TransferQueue while the policy trains.
#   bash examples/run_grpo_async_tiny.sh [dotted.key=value ...]
# Same set-up as run_grpo_tiny.sh (fresh clone: creates ./.venv); outputs go to runs/grpo_async_tiny/.
GRPO_TRAINER=grpo_async exec bash "$(dirname "${BASH_SOURCE[0]}")/run_grpo_tiny.sh" "$@"
