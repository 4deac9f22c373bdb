#!/usr/bin/env bash
# Make the git-ignored .sgl/site.tar.xz that a GPU device call carries to run real SGLang 0.5.17 (issue 43): the
# last release whose kernels load on the device's torch 2.11 (0.5.18+ pin a newer torch; docs/sglang_builds.md).
# Run here (PyPI reachable); on the device `source hack/gpu_sglang_env.sh` unpacks it.
#
# What goes in: sglang 0.5.17, sglang-kernel 0.4.5, flashinfer-python (pure Python; SGLang imports it), xgrammar
# (imported by SGLang's function-call parsers at start) and the pure-Python packages the device lacks.
# What comes out, so that this tarball + .whl/ (megatron-core, pydantic, Ray without its libraries) + the
# repository fit the 64 MiB one call carries:
#   - FA3 (`flash_ops`), sm100 code, FlashMLA and InfLLM kernels of sglang-kernel: the device is Hopper and the
#     engine runs `--attention-backend triton --sampling-backend pytorch --lora-backend triton`;
#   - flashinfer's `data/` (CUDA sources for its JIT, which those backends never start);
#   - xgrammar's static archive, SGLang's multimodal generation and its gRPC/Rust server cores;
#   - IPython and its stack (jedi alone is 33 MB): `sglang/utils.py` imports `IPython.display` for notebooks, so
#     a two-name stub stands in;
#   - zstandard's CFFI backend (the C one is used), __pycache__ directories.
# Usage: bash hack/sglang_carry.sh [OUTDIR=.sgl]
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-.sgl}
py=${PYTHON:-python3}
mkdir -p "$out/dl"
plat=(--no-deps --only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_34_x86_64
      --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
      --platform manylinux2014_x86_64 --platform manylinux1_x86_64)
"$py" -m pip download -q "${plat[@]}" -d "$out/dl" sglang==0.5.17 sglang-kernel==0.4.5 xgrammar==0.2.1 \
  flashinfer-python==0.6.15.post1 apache-tvm-ffi==0.1.11 openai==2.6.1 soundfile==0.13.1 \
  fastapi uvicorn starlette orjson msgspec partial-json-parser pybase64 setproctitle pyzmq zstandard cffi \
  pycparser gguf python-multipart distro jiter sniffio opentelemetry-api compressed-tensors loguru \
  torch-memory-saver dill
site="$out/site"
rm -rf "$site"
"$py" -m pip install -q "${plat[@]}" --no-compile --target "$site" "$out"/dl/*.whl
rm -rf "$site"/sgl_kernel/sm100 "$site"/flashinfer/data "$site"/sglang/multimodal_gen \
  "$site"/sglang/srt/grpc/_core* "$site"/sglang/srt/multimodal/_core* "$site"/zstandard/_cffi*.so
find "$site" \( -name 'flash_ops*.so' -o -name 'flashmla_ops*.so' -o -name 'infllm_ops*.so' \
  -o -name 'libxgrammar.a' \) -delete
find "$site" -name __pycache__ -type d -prune -exec rm -rf {} +
mkdir -p "$site/IPython"
cat > "$site/IPython/__init__.py" <<'PY'
"""A stand-in: SGLang 0.5.17's sglang/utils.py imports IPython.display for notebook helpers the server never calls."""
PY
cat > "$site/IPython/display.py" <<'PY'
def HTML(*args, **kwargs):  # noqa: N802 - IPython's name
    raise RuntimeError("IPython is not carried to the GPU device (hack/sglang_carry.sh)")


def display(*args, **kwargs):
    raise RuntimeError("IPython is not carried to the GPU device (hack/sglang_carry.sh)")
PY
tar -C "$site" -cf - . | xz -6 -T2 > "$out/site.tar.xz"
du -sh "$out/site.tar.xz"
