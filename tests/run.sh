#!/usr/bin/env bash
# The README's test command: installs what it needs (./.venv), checks lint, format and types, then
# runs the whole suite on CPU.
# GPU tests skip cleanly without a GPU. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash .ci/setup-env test   # .[train,test] and the vllm extra (the vLLM tests run)
. .venv/bin/activate
# One thread per process keeps Ray actors, TransferQueue and the trainer's workers from
# oversubscribing a 2-core machine; tests that need another setting set it themselves.
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
export RAY_DEDUP_LOGS=0 RAY_USAGE_STATS_ENABLED=0
# The rules as code first (pyproject.toml): lint, format, types; then the suite.
python -m ruff check .
python -m ruff format --check .
python -m mypy
python -m pytest -q --durations=15 "$@"
