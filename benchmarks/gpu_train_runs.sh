#!/usr/bin/env bash
# The sharded trainer's GPU measurements, as docs/sharding.md records them (2 GPUs of one host).
# Run from the repository root on the GPU machine, with the wheels of tools/device-wheels.sh in
# .whl/ (the image has torch, CUDA, NCCL and transformers). OUT: where results go (default
# benchmarks/results). Phases, any subset, in order:
#   bash benchmarks/gpu_train_runs.sh tests bench runs
#     tests  the GPU test modules of the sharded and Megatron engines
#     bench  benchmarks/bench_train_step.py: 1B replicated and sharded, 8B sharded, the 8B refit
#     runs   grpo_llama_1b.yaml, sync and async (partial rollouts), STEPS steps each (default 8):
#            per-step KL, gradient norm and step time from each run's metrics.jsonl
set -uo pipefail
OUT=${OUT:-benchmarks/results}
STEPS=${STEPS:-8}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export HF_HUB_OFFLINE=1 RAY_DEDUP_LOGS=0 RAY_USAGE_STATS_ENABLED=0 TOKENIZERS_PARALLELISM=false
if [ ! -d /tmp/site/ray ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
fi
export PYTHONPATH=/tmp/site:$PWD
[ -f runs/bpe32k/tokenizer.json ] || python3 examples/build_bpe_tokenizer.py --out runs/bpe32k
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpus.txt"
for phase in "$@"; do
  case "$phase" in
    tests)
      python3 -m pytest -q -rs -p no:cacheprovider --durations=10 tests/unit/test_fsdp_gpu.py \
        tests/unit/test_megatron_gpu.py -s 2>&1 | tee "$OUT/tests.log" | grep -vE "Loading weights|it/s\]"
      ;;
    bench)
      python3 benchmarks/bench_train_step.py --device cuda --cases "${CASES:-1b:none,1b:fsdp,8b:fsdp}" \
        --refit "${REFIT:-8b}" --steps "${BENCH_STEPS:-4}" --out "$OUT/bench_train_step.json" 2>&1 \
        | grep -vE "Loading weights|it/s\]" | tee "$OUT/bench.log"
      ;;
    runs)
      for mode in sync async; do
        d=$OUT/run_1b_$mode
        timeout 560 python3 -m algorithms.grpo_$mode --config examples/configs/grpo_llama_1b.yaml \
          trainer.steps="$STEPS" logging.output_dir="$d" logging.overwrite=true logging.progress=false \
          ${RUN_ARGS:-} 2>&1 | grep -vE "Loading weights|it/s\]" | tail -n 25
        python3 - "$d" "$mode" <<'PY' | tee -a "$OUT/runs.txt"
import json, sys
from pathlib import Path
d, mode = Path(sys.argv[1]), sys.argv[2]
rows = [json.loads(l) for l in (d / "metrics.jsonl").read_text().splitlines() if l.strip()] if (d / "metrics.jsonl").exists() else []
s = json.loads((d / "summary.json").read_text()) if (d / "summary.json").exists() else {}
print(f"1b {mode}: status {s.get('status')}, params {s.get('policy_params')}, startup {s.get('startup_s')}")
for r in rows:
    print(f"  step {r['step']:2d} reward {r['reward']:.3f} kl {r['kl']:.4g} grad_norm {r['grad_norm']:.4g} "
          f"entropy {r['entropy']:.3f} step_s {r.get('step_s', 0):.2f} generate {r.get('time/generate')} "
          f"train {r.get('time/train')} refit {r.get('time/refit')}")
PY
      done
      ;;
    *) echo "unknown phase $phase" >&2; exit 2 ;;
  esac
done
