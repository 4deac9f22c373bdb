# Source on the GPU device (bash): unpack the carried .sgl/site.tar.xz (hack/sglang_carry.sh) into /tmp/sgl, install
# .whl/ (hack/gpu_wheels.sh) into /tmp/mc, and export what SGLang 0.5.17 and the trainer need there:
#   source hack/gpu_sglang_env.sh && python -m pytest -m sglang tests/gpu/test_train_sglang.py
# The device has torch 2.11, transformers and peft but no package index; calls carry [".sgl", ".whl"].
[ -d /tmp/sgl/sglang ] || { mkdir -p /tmp/sgl && tar -xJf .sgl/site.tar.xz -C /tmp/sgl; } || return 1
[ -d /tmp/mc/megatron ] || bash hack/gpu_env.sh /tmp/mc || return 1
# hack/sglang_site first (its sitecustomize lets SGLang's config registrations through the device's transformers);
# absolute paths: the trainer starts its ranks and engines as subprocesses of Ray workers
export PYTHONPATH=$PWD/hack/sglang_site:$PWD/trainer:$PWD/engine:$PWD/tests:$PWD/tests/e2e:/tmp/mc:/tmp/sgl
# flashinfer's kernels are JIT-built from the sources the carry leaves out: SGLang must not reach for them
export SGLANG_IS_FLASHINFER_AVAILABLE=false
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
