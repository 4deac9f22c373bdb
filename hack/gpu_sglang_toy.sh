#!/usr/bin/env bash
# On the GPU device (issue 43): the real trainer with real SGLang 0.5.17 on the toy, Merge and Adapter side by side
# (two pytest processes on one GPU: each SGLang takes --mem-fraction-static 0.3, so both fit; their ~2.5 min
# Triton start overlaps), KORA_SGLANG_TEST_STEPS steps each. What each test measured, its reward/gap curves and
# SGLang's logs land under $OUT (the device tool brings that folder back).
#   call 1, carry [".sgl/site.tar.xz"]: mkdir -p /tmp/sgl && tar -xJf .sgl/site.tar.xz -C /tmp/sgl
#   call 2, carry [".whl"]:             bash hack/gpu_sglang_toy.sh
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-/tmp/kora-sglang-toy}
mkdir -p "$out"
[ -d /tmp/sgl/sglang ] || { echo "unpack .sgl/site.tar.xz into /tmp/sgl first (call 1)" >&2; exit 3; }
# shellcheck source=/dev/null
source hack/gpu_sglang_env.sh || exit 4
export KORA_MEGATRON_REPORT=$out/report.jsonl KORA_SGLANG_TEST_STEPS=${KORA_SGLANG_TEST_STEPS:-100}
pids=()
for mode in ${MODES:-Merge Adapter}; do
  timeout "${TEST_TIMEOUT_S:-560}" python3 -m pytest -m sglang tests/gpu/test_train_sglang.py -k "$mode" -q \
    -p no:cacheprovider --basetemp="/tmp/kora-ht-$mode" -o addopts="" -W ignore >"$out/pytest-$mode.log" 2>&1 &
  pids+=($!)
done
rc=0
for pid in "${pids[@]}"; do wait "$pid" || rc=1; done
for mode in ${MODES:-Merge Adapter}; do
  mkdir -p "$out/$mode"
  find "/tmp/kora-ht-$mode" \( -name 'curve-*.json' -o -name 'engine-*.log' -o -name out.log -o -name events.jsonl \) \
    -exec cp {} "$out/$mode/" \; 2>/dev/null
  tail -n 3 "$out/pytest-$mode.log"
done
exit "$rc"
