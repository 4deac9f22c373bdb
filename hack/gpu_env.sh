#!/usr/bin/env bash
# On the GPU (device) machine, which has torch/transformers/peft but no internet: install the wheels carried
# in the git-ignored .whl/ into a target dir to put on PYTHONPATH (default /tmp/mc).
#   .whl/*.whl        megatron-core + pydantic (always installed: kora_trainer.config needs pydantic 2.x)
#   .whl/extra/*.whl  Ray's dependencies and cuda-bindings (the engine's word gate), each installed only when the
#                     image lacks the module
#   .whl/extra/ray_min.tar.xz  ray 2.60.0 (cp312) without jars/rllib/tune/train/serve/data/llm: the full
#                     wheel (75.6 MiB) is over what a device call may carry (64 MiB); kora uses Ray core only
# Usage: bash hack/gpu_env.sh [/tmp/mc]; export PYTHONPATH=trainer:engine:tests:/tmp/mc NCCL_NVLS_ENABLE=0
# Making .whl/ on the dev machine: bash hack/gpu_wheels.sh (what it does, by hand:
#   P="--no-deps --only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
#      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any"
#   pip download $P -d .whl megatron-core pydantic pydantic_core annotated-types typing-inspection (the versions:
#     python hack/pins.py --python 3.12 megatron-core pydantic)
#     pydantic-settings python-dotenv
#   pip download $P -d .whl/extra msgpack protobuf jsonschema jsonschema-specifications referencing rpds-py click attrs
#     diffusers==<venv's> aiohttp aiohappyeyeballs aiosignal frozenlist multidict yarl propcache   (the diffusion path)
#   ray: pip download $P ray==<pin>, unpack it KEEPING the file modes (python's zipfile drops them: set each
#   member's mode from external_attr >> 16, or gcs_server/raylet are not executable), delete ray/{jars,rllib,tune,
#   train,serve,data,llm}, and tar -cJf .whl/extra/ray_min.tar.xz ray ray-<pin>.dist-info (about 30 MiB)
set -euo pipefail
target=${1:-/tmp/mc}
mkdir -p "$target"
pip install -q --no-index --no-deps --target "$target" .whl/*.whl
python3 - "$target" <<'PY'
import importlib.util, pathlib, subprocess, sys, tarfile
target = sys.argv[1]
modules = {"attrs": "attr", "click": "click", "jsonschema_specifications": "jsonschema_specifications",
           "jsonschema": "jsonschema", "msgpack": "msgpack", "protobuf": "google.protobuf",
           "referencing": "referencing", "rpds_py": "rpds", "cuda_bindings": "cuda.bindings",
           "cuda_pathfinder": "cuda.pathfinder"}
def missing(module):
    try:
        return importlib.util.find_spec(module) is None
    except ModuleNotFoundError:  # a dotted name whose package is missing
        return True
for wheel in sorted(pathlib.Path(".whl/extra").glob("*.whl")):
    dist = wheel.name.split("-")[0]
    if missing(modules.get(dist, dist)):
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--target", target,
                        str(wheel)], check=True)
        print("installed", wheel.name)
ray = pathlib.Path(".whl/extra/ray_min.tar.xz")
if ray.exists() and importlib.util.find_spec("ray") is None:
    with tarfile.open(ray) as t:
        t.extractall(target, filter="tar")  # keeps the raylet / gcs_server binaries executable
    print("installed ray (core only) from", ray)
PY
