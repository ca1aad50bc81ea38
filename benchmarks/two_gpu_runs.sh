#!/usr/bin/env bash
# The 2-GPU runs of issues 12 and 13 in one command, each bounded, most informative first
# (device time is short); first run in full on 2x H200 in session 7:
#
#   bash benchmarks/two_gpu_runs.sh OUT_DIR [SECONDS]
#
# 1. ipc_peer_probe.py: which writes into another GPU's IPC memory work, and --rates: how fast
#    each route of a cross-GPU IPC copy runs (issue 12);
# 2. the GPU tests of the reshard, packed refit and Megatron worker (the 2-GPU cases run);
# 3. bench_megatron.py --layout two-gpu: grpo_sync with Megatron TP=2 vs the torch worker (13);
# 4. bench_refit.py --reshard: TP2->TP1 against the NVLink peer copy (12's 1.1x target).
# Each step's output goes to OUT_DIR/<step>.log (and its JSON beside it); a step that runs out
# of its share of SECONDS (default 540) is killed and the next one starts. On the device
# machine: install the carried wheels first (see the device notes in the issue notes).
set -u
out=${1:?usage: two_gpu_runs.sh OUT_DIR [SECONDS]}
total=${2:-540}
mkdir -p "$out"
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export PYTHONUNBUFFERED=1
start=$(date +%s)

cum=0
step() {  # step NAME SHARE_PERCENT CMD...: CMD may run until SHARE% more of the total has passed
    local name=$1 share=$2; shift 2          # (time an earlier step left unused carries over)
    cum=$(( cum + share ))
    local limit=$(( start + total * cum / 100 - $(date +%s) ))
    if (( limit < 10 )); then echo "== $name: skipped (no time left)"; return; fi
    local t0=$(date +%s)
    timeout "$limit" "$@" > "$out/$name.log" 2>&1
    local rc=$?
    echo "== $name: rc=$rc in $(( $(date +%s) - t0 ))s (limit ${limit}s)"
    tail -n 12 "$out/$name.log"
}

step probe 6 python3 benchmarks/ipc_peer_probe.py --json "$out/ipc_peer_probe.json"
step rates 4 python3 benchmarks/ipc_peer_probe.py --rates --json "$out/ipc_peer_rates.json"
step gpu_tests 35 python3 -m pytest -q -x tests/unit/test_sharded_gpu.py tests/unit/test_refit_gpu.py \
    tests/unit/test_megatron_gpu.py
step bench_megatron 35 python3 benchmarks/bench_megatron.py --layout two-gpu --steps 10 --no-resume \
    --json "$out/bench_megatron_2gpu.json"
step bench_refit 20 python3 benchmarks/bench_refit.py --reshard --iters 20 --limit 60 \
    --out "$out/bench_refit_reshard_2gpu.json"
echo "== total $(( $(date +%s) - start ))s"
