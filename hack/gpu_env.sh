#!/usr/bin/env bash
# On the GPU (device) machine, which has torch/transformers/peft but no internet: install the wheels carried
# in the git-ignored .whl/ into a target dir to put on PYTHONPATH (default /tmp/mc).
#   .whl/*.whl        megatron-core + pydantic (always installed: kora_trainer.config needs pydantic 2.x)
#   .whl/extra/*.whl  Ray's dependencies, each installed only when the image lacks the module
#   .whl/extra/ray_min.tar.xz  ray 2.60.0 (cp312) without jars/rllib/tune/train/serve/data/llm: the full
#                     wheel (75.6 MiB) is over what a device call may carry (64 MiB); kora uses Ray core only
# Usage: bash hack/gpu_env.sh [/tmp/mc]; export PYTHONPATH=trainer:tests:/tmp/mc NCCL_NVLS_ENABLE=0
set -euo pipefail
target=${1:-/tmp/mc}
mkdir -p "$target"
pip install -q --no-index --no-deps --target "$target" .whl/*.whl
python3 - "$target" <<'PY'
import importlib.util, pathlib, subprocess, sys, tarfile
target = sys.argv[1]
modules = {"attrs": "attr", "click": "click", "jsonschema_specifications": "jsonschema_specifications",
           "jsonschema": "jsonschema", "msgpack": "msgpack", "protobuf": "google.protobuf",
           "referencing": "referencing", "rpds_py": "rpds"}
for wheel in sorted(pathlib.Path(".whl/extra").glob("*.whl")):
    dist = wheel.name.split("-")[0]
    if importlib.util.find_spec(modules.get(dist, dist)) is None:
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--target", target,
                        str(wheel)], check=True)
        print("installed", wheel.name)
ray = pathlib.Path(".whl/extra/ray_min.tar.xz")
if ray.exists() and importlib.util.find_spec("ray") is None:
    with tarfile.open(ray) as t:
        t.extractall(target, filter="tar")  # keeps the raylet / gcs_server binaries executable
    print("installed ray (core only) from", ray)
PY
