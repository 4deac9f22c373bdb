#!/usr/bin/env bash
# Make the git-ignored .whl/ that hack/gpu_env.sh installs on the GPU (device) machine, which has torch,
# transformers and peft but no package index. cp312 wheels, since the device's python is 3.12.
# Usage (on the dev machine, which reaches PyPI): bash hack/gpu_wheels.sh; then carry [".whl"] on the device call.
# Versions: constraints.txt's pins for Python 3.12 (hack/pins.py), the one source of truth; tests/unit/test_pins.py
# fails if a version is written here.
set -euo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-python3}
pin() { "$py" hack/pins.py --python 3.12 "$@"; }
megatron=$(pin megatron-core)
ray=$(pin ray)
plat=(--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any)
mkdir -p .whl/extra
"$py" -m pip download -q "${plat[@]}" --no-deps -d .whl "$megatron"
# pydantic resolves its own pydantic_core, annotated-types and typing-inspection
"$py" -m pip download -q "${plat[@]}" -d .whl $(pin pydantic pydantic-settings)
"$py" -m pip download -q "${plat[@]}" --no-deps -d .whl/extra msgpack protobuf jsonschema jsonschema-specifications \
    referencing rpds-py click attrs "$(pin cuda-bindings)" cuda-pathfinder
# (re)made when missing or of another version than the pin
if ! tar -tJf .whl/extra/ray_min.tar.xz "ray-${ray#ray==}.dist-info/METADATA" >/dev/null 2>&1; then
    tmp=$(mktemp -d)
    "$py" -m pip download -q "${plat[@]}" --no-deps -d "$tmp" "$ray"
    # python's zipfile drops file modes: set each member's from external_attr, or gcs_server/raylet don't run
    "$py" - "$tmp" <<'PY'
import pathlib, shutil, sys, zipfile
tmp = pathlib.Path(sys.argv[1])
wheel = next(tmp.glob("ray-*.whl"))
out = tmp / "unpacked"
with zipfile.ZipFile(wheel) as z:
    for info in z.infolist():
        path = pathlib.Path(z.extract(info, out))
        mode = info.external_attr >> 16
        if mode and path.is_file():
            path.chmod(mode)
for heavy in ("jars", "rllib", "tune", "train", "serve", "data", "llm"):
    shutil.rmtree(out / "ray" / heavy, ignore_errors=True)
PY
    tar -C "$tmp/unpacked" -cJf .whl/extra/ray_min.tar.xz ray "ray-${ray#ray==}.dist-info"
    rm -rf "$tmp"
fi
# typing_extensions ships with the device's torch: keep only what gpu_env.sh installs
rm -f .whl/typing_extensions-*.whl
du -sh .whl
