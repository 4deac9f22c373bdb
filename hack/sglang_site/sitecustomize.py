"""Put first on PYTHONPATH on the GPU device when SGLang 0.5.17 runs there (hack/gpu_sglang_env.sh).

1. SGLang 0.5.17 registers Hugging Face configs (qwen3_asr, ...) that the device's newer transformers already has,
   and its import dies on the duplicate registration: let its registrations overwrite. Carrying the transformers it
   pins (5.12.1) would be the clean fix, but it does not fit the 64 MiB a device call carries beside SGLang and Ray.
2. sglang-kernel 0.4.5 hands bf16/fp16 RMSNorm (and top-k renorm) to flashinfer, whose kernels are JIT-built from
   CUDA sources the carry leaves out (hack/sglang_carry.sh: 77 MB of them); with `_has_flashinfer` false it runs its
   own compiled kernels (`_rmsnorm_internal`), which it already uses for fp32 and under torch.compile.
"""

import importlib.abc
import importlib.util
import sys
from types import ModuleType
from typing import Any

try:
    from transformers.models.auto import auto_factory, configuration_auto

    _register_config = configuration_auto._LazyConfigMapping.register
    _register_model = auto_factory._LazyAutoMapping.register
    configuration_auto._LazyConfigMapping.register = (  # type: ignore[method-assign]
        lambda self, key, value, exist_ok=False: _register_config(self, key, value, exist_ok=True))
    auto_factory._LazyAutoMapping.register = (  # type: ignore[method-assign]
        lambda self, key, value, exist_ok=False: _register_model(self, key, value, exist_ok=True))
except Exception as e:  # a machine without transformers: nothing to patch
    print("sitecustomize (kora, SGLang on the device):", e)

_WITHOUT_FLASHINFER = frozenset({"sgl_kernel.elementwise", "sgl_kernel.sampling"})


class _KernelsWithoutFlashinfer(importlib.abc.MetaPathFinder):
    """Sets `_has_flashinfer = False` in the sgl_kernel modules above right after they are executed."""

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name not in _WITHOUT_FLASHINFER:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_module(module: ModuleType) -> None:
            run(module)
            module._has_flashinfer = False  # type: ignore[attr-defined]

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


sys.meta_path.insert(0, _KernelsWithoutFlashinfer())
