"""Put first on PYTHONPATH on the GPU device when SGLang 0.5.17 runs there (hack/gpu_sglang_env.sh).

SGLang 0.5.17 registers Hugging Face configs (qwen3_asr, ...) that the device's newer transformers already has,
and its import dies on the duplicate registration: let its registrations overwrite. Carrying the transformers it
pins (5.12.1) would be the clean fix, but it does not fit the 64 MiB a device call carries beside SGLang and Ray.
"""

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
