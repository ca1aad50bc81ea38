#!/usr/bin/env bash
# The async-GRPO GPU runs in one bounded command (device time is short), most informative first:
#
#   bash benchmarks/gpu_async_runs.sh OUT_DIR [SECONDS] [STEPS...]
#
# STEPS (default: tests toy longtail): tests = the GPU refit tests (the facade's families over
# NCCL and CUDA IPC); toy = bench_grpo_async.py on the tiny config, policy on GPU 0 and the
# generator on GPU 1 over an NCCL refit; longtail = the same on examples/configs/grpo_longtail_gpu.yaml;
# mild = that config on the longtail-mild profile (p99/p50 = 4); twogen = the long tail with two
# collectors whose generators share GPU 1 (half a GPU each, reshard refit over CUDA IPC).
# Each step's output goes to OUT_DIR/<step>.log (its JSON beside it); a step that runs out of its
# share of SECONDS (default 560) is killed and the next one starts. Install the carried wheels first.
set -u
out=${1:?usage: gpu_async_runs.sh OUT_DIR [SECONDS] [STEPS...]}
total=${2:-560}
shift $(( $# >= 2 ? 2 : 1 ))
steps=${*:-tests toy longtail}
mkdir -p "$out"
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1
start=$(date +%s)
n=$(wc -w <<< "$steps")
i=0
gpu=(policy.device=cuda generation.device=cuda refit.backend=nccl trainer.dp_size=1)
for name in $steps; do
    i=$(( i + 1 ))
    limit=$(( (total - ($(date +%s) - start)) / (n - i + 1) ))
    (( limit < 20 )) && { echo "== $name: skipped (no time left)"; continue; }
    case $name in
        tests) cmd=(python3 -m pytest -q -x tests/unit/test_refit_gpu.py tests/unit/test_sharded_gpu.py) ;;
        toy) cmd=(python3 benchmarks/bench_grpo_async.py --profile toy --steps 30 --skip 5 "${gpu[@]}"
                  --out "$out/toy.json") ;;
        longtail) cmd=(python3 benchmarks/bench_grpo_async.py --profile longtail --steps 20 --skip 4
                       --runs async:1 partial:1 partial:2 --config examples/configs/grpo_longtail_gpu.yaml
                       --out "$out/longtail.json") ;;
        mild) cmd=(python3 benchmarks/bench_grpo_async.py --profile longtail-mild --steps 16 --skip 4
                   --runs async:1 partial:2 --config examples/configs/grpo_longtail_gpu.yaml
                   --out "$out/mild.json") ;;
        twogen) cmd=(python3 benchmarks/bench_grpo_async.py --profile longtail --steps 16 --skip 4
                     --runs async:1 partial:2 --config examples/configs/grpo_longtail_gpu.yaml
                     async.num_collectors=2 generation.num_gpus=0.5 refit.mode=reshard refit.transport=ipc
                     refit.backend=gloo --out "$out/twogen.json") ;;
        *) echo "== $name: unknown step"; continue ;;
    esac
    t0=$(date +%s)
    timeout "$limit" "${cmd[@]}" > "$out/$name.log" 2>&1
    echo "== $name: rc=$? in $(( $(date +%s) - t0 ))s (limit ${limit}s)"
    tail -n 14 "$out/$name.log"
done
echo "== total $(( $(date +%s) - start ))s"
