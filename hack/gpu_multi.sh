#!/usr/bin/env bash
# Issue 22's runs on a device with 2+ GPUs, in parts that each fit one device call (600 s): the distributed
# trainer's GPU tests and the multi-GPU benches, their output under OUT (the device's $OUT, else /tmp/kora-multi).
# The runs are chosen by what the trainer refuses or skips on fewer GPUs; nothing here runs on CPU.
#
#   bash hack/gpu_multi.sh PART      (carry .whl: hack/gpu_env.sh installs megatron-core and Ray from it)
#
# PART:
#   model-parallel   tests/gpu/test_train_model_parallel_gpu.py: tensor 2, pipeline 2, expert 2 and tensor 2 x
#                    expert 2 through `python -m kora_trainer.train`, Colocate on 2 GPUs, Disaggregated on 3 (skips)
#   -k EXPR          ... the same file narrowed by a pytest -k expression (e.g. "tensor and Colocate")
#   tp               tests/gpu/test_megatron_tp.py, test_megatron_tp_sync.py, test_megatron_tp_checkpoint.py (NCCL)
#   data-parallel    tests/gpu/test_train_data_parallel_gpu.py
#   bench            bench/dp_scaling.py --gpu, bench/gpu_sync.py (2 GPUs), and --tp 2 --engines 1 on 3 GPUs
#   4b [LAYOUT...]   bench/gpu_train.py on the Qwen3-4B-shaped model, Colocate (an engine beside each rank), 3 steps
#                    of MODES (default Merge) per layout: one (1 GPU), tensor, pipeline, data (2 GPUs); default all
#                    four (~2 min each: give two layouts a call); set each layout's loss_curve and gap against one's
#
# Order for a first x2 session (30 device minutes): -k "Colocate and Merge and not EngineMerge", tp, 4b one tensor,
# data-parallel, then the rest of model-parallel by mode; bench last.
# Each part writes OUT/<part>.log; pytest keeps its temp dirs under /tmp/kora-multi-tmp (the engines' logs: grep
# Traceback there on a failure), the benches their JSON under OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
part=${1:?"part: model-parallel | tp | data-parallel | bench | 4b [LAYOUT...] | -k EXPR"}
out=${OUT:-/tmp/kora-multi}
mkdir -p "$out"
bash hack/gpu_env.sh /tmp/mc >/dev/null || exit 1
export PYTHONPATH="$PWD/trainer:$PWD/engine:$PWD/tests:$PWD/hack:/tmp/mc"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
gpus=$(nvidia-smi --query-gpu=name --format=csv,noheader | tee "$out/gpus.txt" | wc -l)
echo "$gpus GPU(s): $(head -1 "$out/gpus.txt")"
tests() { timeout 570 python -m pytest -m gpu -q -p no:cacheprovider -rs --basetemp=/tmp/kora-multi-tmp "$@"; }
case "$part" in
  model-parallel) tests tests/gpu/test_train_model_parallel_gpu.py 2>&1 | tee "$out/model-parallel.log" ;;
  -k) tests tests/gpu/test_train_model_parallel_gpu.py -k "${2:?-k needs an expression}" 2>&1 | tee "$out/model-parallel-k.log" ;;
  tp) tests tests/gpu/test_megatron_tp.py tests/gpu/test_megatron_tp_sync.py tests/gpu/test_megatron_tp_checkpoint.py \
        2>&1 | tee "$out/tp.log" ;;
  data-parallel) tests tests/gpu/test_train_data_parallel_gpu.py 2>&1 | tee "$out/data-parallel.log" ;;
  bench)
    {
      timeout 200 python bench/dp_scaling.py --gpu --out "$out/dp_scaling_gpu.json"
      timeout 200 python bench/gpu_sync.py --out "$out/gpu_sync_x2.json"
      if [ "$gpus" -ge 3 ]; then timeout 180 python bench/gpu_sync.py --tp 2 --engines 1 --out "$out/gpu_sync_tp2_engines1.json"; fi
    } 2>&1 | tee "$out/bench.log" ;;
  4b)
    shift
    layouts=("$@")
    [ ${#layouts[@]} -gt 0 ] || layouts=(one tensor pipeline data)
    for layout in "${layouts[@]}"; do
      case "$layout" in
        one) split=() ; engines=1 ;;
        tensor|pipeline|data) split=(--set "parallelism.$layout=2") ; engines=2 ;;
        *) echo "unknown layout $layout (one | tensor | pipeline | data)" >&2; exit 2 ;;
      esac
      timeout 290 python bench/gpu_train.py --model qwen3-4b --modes "${MODES:-Merge}" --steps 3 \
        --engines "$engines" "${split[@]}" --out "$out/gpu_train_4b_$layout.json" 2>&1 | tee "$out/4b-$layout.log"
    done ;;
  *) echo "unknown part $part" >&2; exit 2 ;;
esac
rc=$?
grep -rh -B2 -A12 Traceback /tmp/kora-multi-tmp 2>/dev/null | head -60 > "$out/tracebacks.txt"
exit "$rc"
