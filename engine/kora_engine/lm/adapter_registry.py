"""Which adapters the engine serves, under which names — with SGLang's load/unload semantics.

sglang 0.5.23 (`sglang/srt/lora/lora_manager.py`, `lora_registry.py`, TM `_resolve_lora_path`):
- loading a name that is already loaded fails: "Failed to load LoRA adapter <name> because it is
  already loaded" (replace = unload then load);
- unloading an unknown name fails: "LoRA with name <name> does not exist. Loaded LoRAs: …";
- unload is not permanent: a later request naming an unloaded adapter silently reloads it from its
  original path; only a name that was never loaded is an error ("Got LoRA adapter that has never
  been loaded: …"). An adapter that came over the wire has no path to reload from, so naming it
  after its unload is an error here ⚠ (0.5.23 would try to load the path "__tensor__").
- kora's `upsert` (the `/load_lora_adapter_from_distributed` extension) replaces the adapter
  under a name atomically, loaded or not; requests already admitted keep the old object.

Several adapters are served at once, each its own immutable object: publishing a new version of one
(upsert) is one dict assignment under `_lock` — no pause, no engine lock, so the other adapters' requests
never wait for it; a request holds the object it resolved at admission (sglang-miles #38165's versioned
publication); unloading one name leaves the others serving, and a retired name can be loaded again.
"""

from __future__ import annotations

import dataclasses
import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import Any

import torch

from kora_engine.lm.lora_adapters import LoRAAdapter, build_adapter, read_peft_dir
from kora_engine.lm.model import EngineModel

WIRE_SOURCES = ("__tensor__", "__distributed__")


# Fault injection for the serving check's test (tests/e2e/test_policy_served.py), off unless set: the adapter
# of this name loses its weights at load (every load path), while the load is acknowledged (checksum, version
# tag) as usual, so its requests are served by the base model under the adapter's version: the silent drop of
# sglang#30499 (LoRA weights on some layers dropped at load), made whole. No real route can make the reference
# engine keep serving the base: the trainer's every push reloads the adapter.
DROP_ADAPTER_ENV = "KORA_ENGINE_FAULT_DROP_ADAPTER"


class AdapterRegistry:
    def __init__(self, engine: EngineModel):
        self.engine = engine
        self._adapters: dict[str, LoRAAdapter] = {}
        self._ref_cache: dict[str, str] = {}  # every name ever loaded -> its source (never shrinks)
        self._lock = threading.Lock()
        # run before every lookup: publish what a colocated trainer wrote into this engine's memory since
        # (colocated_routes.ColocatedRoutes.publish_rung: its doorbell)
        self.before_lookup: Callable[[], None] | None = None

    def loaded(self) -> dict[str, str]:
        with self._lock:
            return {name: a.source for name, a in self._adapters.items()}

    def versions(self) -> dict[str, dict[str, str | None]]:
        """Each loaded adapter's current object: source, weight_version, lora_id (GET /kora/state)."""
        if self.before_lookup is not None:
            self.before_lookup()
        with self._lock:
            return {name: {"source": a.source, "version": a.version, "lora_id": a.lora_id}
                    for name, a in self._adapters.items()}

    def get(self, name: str) -> LoRAAdapter | None:
        return self._adapters.get(name)

    def _build(self, name: str, source: str, config: dict[str, Any], named: Iterable[tuple[str, torch.Tensor]],
               version: str | None = None) -> LoRAAdapter:
        e = self.engine
        return build_adapter(name, source, config, named, e.model, e.dtype, e.device, e.max_lora_rank, version)

    def _register(self, adapter: LoRAAdapter, upsert: bool = False) -> None:
        with self._lock:
            if not upsert and adapter.name in self._adapters:
                raise ValueError(f"Failed to load LoRA adapter {adapter.name} because it is already loaded")
            if adapter.name == os.environ.get(DROP_ADAPTER_ENV):  # the fault: its weights dropped at load
                adapter = dataclasses.replace(adapter, weights={}, params={})
            self._adapters[adapter.name] = adapter
            self._ref_cache[adapter.name] = adapter.source

    def _check_new(self, name: str) -> None:
        if name in self._adapters:
            raise ValueError(f"Failed to load LoRA adapter {name} because it is already loaded")

    def load_from_dir(self, name: str, path: str) -> LoRAAdapter:
        self._check_new(name)
        config, named = read_peft_dir(path)
        adapter = self._build(name, path, config, named)
        self._register(adapter)
        return adapter

    def load_from_tensors(self, name: str, config: dict[str, Any],
                          named: list[tuple[str, torch.Tensor]]) -> LoRAAdapter:
        self._check_new(name)
        adapter = self._build(name, "__tensor__", config, named)
        self._register(adapter)
        return adapter

    def upsert(self, name: str, config: dict[str, Any], named: list[tuple[str, torch.Tensor]],
               version: str | None) -> LoRAAdapter:
        adapter = self._build(name, "__distributed__", config, named, version)
        self._register(adapter, upsert=True)
        return adapter

    def upsert_built(self, adapter: LoRAAdapter) -> None:
        """`upsert` of an adapter object made elsewhere (kora's fast sync wraps a ring slot's views)."""
        self._register(adapter, upsert=True)

    def unload(self, name: str) -> None:
        with self._lock:
            if name not in self._adapters:
                names = OrderedDict.fromkeys(self._adapters).keys()  # prints odict_keys([...]) like SGLang
                raise ValueError(f"LoRA with name {name} does not exist. Loaded LoRAs: {names}")
            del self._adapters[name]

    def resolve(self, name: str | None) -> LoRAAdapter | None:
        """The adapter a request names, admitted now (None = the base model)."""
        if name is None:
            return None
        if self.before_lookup is not None:
            self.before_lookup()
        adapter = self._adapters.get(name)
        if adapter is not None:
            return adapter
        source = self._ref_cache.get(name)
        if source is None:
            raise ValueError(f"Got LoRA adapter that has never been loaded: {name}\n"
                             f"All loaded adapters: {dict(self._ref_cache).keys()}.")
        if source in WIRE_SOURCES:
            raise ValueError(f"LoRA adapter {name} was unloaded and was loaded from tensors ({source}); "
                             "it cannot be reloaded implicitly: load it again.")
        try:
            return self.load_from_dir(name, source)  # SGLang's "Reloading evicted adapter"
        except ValueError:
            adapter = self._adapters.get(name)  # a concurrent request reloaded it first
            if adapter is None:
                raise
            return adapter
