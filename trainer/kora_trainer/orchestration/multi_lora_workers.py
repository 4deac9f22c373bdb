"""The workers of a multi-adapter job (multiLora.maxAdapters > 0): the trainer ranks with adapter slots and the
rollout manager with per-adapter data. `cluster.start_models` / `start_rollout` pick these classes for such a
job; the driver is recipes/multi_lora.py."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

from kora_trainer.backends.batch import RolloutBatch
from kora_trainer.backends.multi_lora import AdapterStepMetrics, MultiLoRATrainer
from kora_trainer.backends.multi_lora_api import MultiLoRA
from kora_trainer.backends.torch_backend import TorchBackend
from kora_trainer.checkpoint.adapter_slot import adapter_root, load_slot, save_slot
from kora_trainer.checkpoint.peft_export import export_peft
from kora_trainer.checkpoint.precision import torch_dtype
from kora_trainer.config import ConfigError
from kora_trainer.config.adapter_runs import AdapterSettings
from kora_trainer.orchestration.adapter_rollout import UNIT_CALLS_PER_ENGINE, AdapterRollouts
from kora_trainer.orchestration.workers import RolloutWorker, TrainWorker
from kora_trainer.sync.sender import SyncReport
from kora_trainer.sync.slot_sender import rid_prefix


class MultiLoRAWorker(TrainWorker):
    """One trainer rank holding every adapter's slot; every call is made on every rank (collectives)."""

    multi: MultiLoRA

    def setup(self, master_address: str, master_port: int) -> dict[str, Any]:
        info = super().setup(master_address, master_port)
        self.multi = multi_lora_trainer(self.backend)
        return info

    def connect(self, engine_urls: list[str], kind: str, host: str = "127.0.0.1",
                admin_api_key: str | None = None) -> str:
        kind_made = super().connect(engine_urls, kind, host, admin_api_key)
        # the fast path plans one adapter; the slots go over the HTTP routes (selective, per adapter)
        self.sender = self.multi.make_sender(getattr(self.sender, "transport", None))
        return kind_made

    def push_base(self) -> SyncReport:
        report: SyncReport = self.sender.push_base()
        return report

    def add_adapter(self, settings: AdapterSettings, root: str | None) -> dict[str, Any]:
        """Its slot (restored from its checkpoint under root when it has one): {"step", "data_position"}."""
        self.multi.add(settings)
        saved = load_slot(root, settings.name) if root else None
        if saved is None:
            return {"step": 0, "data_position": 0}
        state, position = saved
        self.multi.load_state(settings.name, state)
        return {"step": int(state["step"]), "data_position": position}

    def schedule_adapter(self, name: str, num_steps: int) -> dict[str, Any]:
        """Its learning-rate schedule over its own step count (kept from its checkpoint on a resume)."""
        return self.multi.schedule_adapter(name, num_steps)

    def remove_adapter(self, name: str) -> None:
        self.multi.remove(name)

    def train_adapters(self, batches: dict[str, RolloutBatch]) -> list[AdapterStepMetrics]:
        return self.multi.train(batches)

    def drop_adapter_batch(self, name: str) -> None:
        self.multi.drop_pending(name)

    def publish(self, name: str) -> SyncReport:
        """Push adapter `name` at its step (its version)."""
        config = self.multi.peft_config(name)
        with self.multi.active(name):
            report: SyncReport = self.sender.publish(name, self.multi.step(name), config)
        return report

    def retire_on_engines(self, name: str) -> dict[str, Any]:
        out: dict[str, Any] = self.sender.retire(name)
        return out

    def adapter_logprobs(self, name: str, prompts: list[list[int]], responses: list[list[int]]) -> list[list[float]]:
        return self.multi.logprobs(name, prompts, responses)

    def adapter_factors(self, name: str) -> dict[str, Any]:
        """Its factors (CPU copies), for tests and tools comparing adapters."""
        return {n: t.detach().cpu().clone() for n, t in self.multi.adapter_named(name)}

    def save_adapter(self, name: str, root: str, data_position: int, meta: dict[str, Any]) -> str | None:
        """On every rank (megatron gathers the slot's shards); the path on the rank that wrote, None elsewhere."""
        state = self.multi.state(name)
        if not self.backend.checkpoint_writer:
            return None
        return str(save_slot(root, name, state, data_position, meta, dtype=torch_dtype(self.cfg.checkpoint.dtype)))

    def export_adapter(self, name: str, root: str, meta: dict[str, Any]) -> str | None:
        """Its HF-PEFT export, on every rank as `save_adapter`."""
        s = self.multi.settings(name)
        tensors, config = dict(self.multi.adapter_named(name)), self.multi.peft_config(name)
        if not self.backend.checkpoint_writer:
            return None
        info = {"format": "kora-multi-lora-adapter", "base_model": str(Path(self.cfg.model.path).resolve()),
                "name": name, "step": self.multi.step(name), "rank": s.rank, "alpha": s.alpha,
                "sync_mode": "Adapter", "backend": type(self.backend).__name__, **meta}
        return str(export_peft(adapter_root(root, name), tensors, config, info))


def multi_lora_trainer(backend: Any) -> MultiLoRA:
    """The slot trainer (backends/multi_lora_api.MultiLoRA) for the backend this rank built."""
    if isinstance(backend, TorchBackend):
        return MultiLoRATrainer(backend)
    from kora_trainer.backends.megatron.backend import MegatronBackend  # noqa: PLC0415 - the megatron backend's modules only when chosen
    from kora_trainer.backends.megatron.multi_lora import MegatronMultiLoRATrainer  # noqa: PLC0415 - the megatron backend's modules only when chosen

    if isinstance(backend, MegatronBackend):
        return MegatronMultiLoRATrainer(backend)
    raise ConfigError([f"multiLora.maxAdapters {backend.cfg.multi_lora.max_adapters}: no adapter slots on the "
                       f"{type(backend).__name__}: set backend: torch or backend: megatron"])


class AdapterRolloutWorker(RolloutWorker):
    """The rollout manager with per-adapter data; its calls run concurrently (one Ray thread each), so the
    adapters generate at once and a retirement's abort reaches requests that are in flight."""

    def __init__(self, cfg: Any, engine_urls: list[str], api_key: str | None = None,
                 admin_api_key: str | None = None):
        super().__init__(cfg, engine_urls, api_key, admin_api_key, calls_per_engine=UNIT_CALLS_PER_ENGINE)
        self.adapters = AdapterRollouts(self.rollout)

    def add_adapter(self, settings: AdapterSettings, position: int, version: int) -> int:
        self.rollout.rids.open(rid_prefix(settings.name))  # a name retired before may be registered again
        return self.adapters.add(settings, position, version)

    def abort_adapter(self, name: str) -> dict[str, Any]:
        """Abort adapter `name`'s requests in flight, each by its exact rid, and send no more of them (its
        generation in flight returns aborted), before the trainer unloads it (SlotSender.retire): a stock build
        (0.5.17, 0.5.23) has no abort by rid prefix, and its unload would otherwise wait for those requests to run
        out, holding every other adapter's load and unload behind its LoRA update lock (config/sglang_builds.py's
        docstring has the lines). Runs beside the generation (the actor's max_concurrency)."""
        return self.rollout.abort_prefix(rid_prefix(name))

    def remove_adapter(self, name: str) -> None:
        self.adapters.remove(name)

    def published(self, name: str, version: int) -> None:
        self.adapters.published(name, version)

    def generate_adapter_units(self, name: str, step: int) -> Iterator[tuple[RolloutBatch | None, dict[str, Any]]]:
        """Its batch in units as they complete (AdapterRollouts.units); call with num_returns="streaming"."""
        yield from self.adapters.units(name, step)
