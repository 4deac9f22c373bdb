#!/usr/bin/env bash
# A/B of trainer code on one GPU in ONE device call (device timings compare only within a call: rerun the baseline
# beside the candidate). Each tree is a copy of trainer/, tests/ and bench/ at a git ref, git-ignored (ab-*/) and
# carried to the device (about 4 MiB each; the carry limit is 64 MiB with .whl/).
#   on the dev machine:  bash hack/gpu_ab.sh make NAME [REF]      # ab-NAME/ from REF (default HEAD); edit it freely
#   on the device:       bash hack/gpu_ab.sh run TREE...          # "." is the working tree; with carry [".whl", "ab-NAME"]
# `run` installs .whl/ (hack/gpu_env.sh), then runs `bench/gpu_train.py` from each tree in turn (GPU_AB_ARGS,
# default: qwen3-4b, EngineMerge, 6 steps; GPU_AB_TIMEOUT seconds each, default 150) and prints each run's ratios,
# steady pushes and push phases; the result JSON and log of each run land in $OUT. GPU_AB_ENV=0 skips the install
# and PYTHON picks the interpreter (a CPU smoke here: GPU_AB_ARGS="--model toy --device cpu --backend torch
# --max-new-tokens 8 --modes EngineMerge --steps 4").
set -euo pipefail
cd "$(dirname "$0")/.."
case "${1:-}" in
make)
    name=${2:?NAME}; ref=${3:-HEAD}
    rm -rf "ab-$name" && mkdir "ab-$name"
    git archive "$ref" trainer tests bench | tar -x -C "ab-$name"
    echo "ab-$name from $(git rev-parse --short "$ref")"
    ;;
run)
    shift
    out=${OUT:-/tmp/gpu_ab}; mkdir -p "$out"
    [ "${GPU_AB_ENV:-1}" = 0 ] || bash hack/gpu_env.sh /tmp/mc1 | tail -1
    export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
    args=${GPU_AB_ARGS:---model qwen3-4b --modes EngineMerge --steps 6}
    for tree in "$@"; do
        root=$(cd "$tree" && pwd); tag=$(basename "$root")-$SECONDS
        # shellcheck disable=SC2086
        PYTHONPATH=$root/trainer:$root/engine:$root/tests:/tmp/mc1 timeout "${GPU_AB_TIMEOUT:-150}" "${PYTHON:-python}" "$root/bench/gpu_train.py" \
            $args --workdir /tmp/kgt --out "$out/$tag.json" > "$out/$tag.log" 2>&1 || echo "$tag: exit $?"
        "${PYTHON:-python}" - "$out/$tag.json" <<'PY'
import json, pathlib, statistics, sys
f = pathlib.Path(sys.argv[1])
if not f.exists():
    sys.exit(f"{f.name}: no result")
r = json.loads(f.read_text())
print(f.name, r.get("device"), r.get("ratios"))
for mode, m in r["modes"].items():
    later = m.get("steps", [])[1:]
    if not later:
        continue
    print(f"  {mode} pushes", [s["sync_ms"] for s in m["steps"]])
    keys = sorted({k for s in later for k in s.get("sync_phases", {}) if k != "verify_ms"})
    print("  phase medians", {k: round(statistics.median(s["sync_phases"][k] for s in later
                                                          if k in s["sync_phases"]), 3) for k in keys})
PY
    done
    ;;
*)
    sed -n '2,9p' "$0"; exit 2
    ;;
esac
