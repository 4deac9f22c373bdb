"""The adapter registry: which adapters a multi-adapter job trains, in which slot, and how far each has got.

The source of truth for both sides: the control plane's `/adapter_runs` routes (api.py) register and retire
adapters through it from their HTTP threads, the driver (recipes/multi_lora.py) reads what to load and what to
retire at each step boundary and reports each adapter's progress back. Everything is under one lock; a
registration or retirement wakes a driver that waits for work (`wait_for_work`).

A slot is taken at registration (so a full job answers 409 at once, not later) and freed only when the
driver has retired the adapter: its requests aborted, its checkpoint and export written, its trainer slot
cleared. With a checkpoint path the registrations are written to `adapters/registry.json` on every change, so
a restarted job registers the same adapters in the same slots again and restores each from its checkpoint.
"""

from __future__ import annotations

import json
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from kora_trainer.config import TrainerConfig, adapter_problems
from kora_trainer.config.adapter_runs import (
    FINISHED,
    AdapterPhase,
    AdapterRunList,
    AdapterRunsState,
    AdapterRunState,
    AdapterRunSummary,
    AdapterSettings,
    resolve,
)
from kora_trainer.config.load import read_hf_config
from kora_trainer.config.sections import AUTO, MAX_SLOTS, POLICY_ADAPTER, AdapterRunConfig
from kora_trainer.config.status import CheckpointProgress, ServingCheckProgress, SyncProgress, rfc3339


class RegistryError(Exception):
    """A request the registry refuses; `status` is the HTTP code the control plane answers with."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status, self.message = status, message


@dataclass
class _Run:
    settings: AdapterSettings
    config: AdapterRunConfig
    state: dict[str, Any]  # AdapterRunState's fields (snake_case), rebuilt into the model when read
    retire: bool = False  # DELETE asked for it
    loaded: bool = False  # the driver has put it into the trainer

    def model(self) -> AdapterRunState:
        return AdapterRunState(name=self.settings.name, **self.state)


@dataclass
class AdapterRegistry:
    cfg: TrainerConfig
    state_file: Path | None = None  # <checkpoint.path>/adapters/registry.json, or None (not persisted)
    _runs: dict[str, _Run] = field(default_factory=dict)
    _lock: threading.Condition = field(default_factory=threading.Condition)

    @property
    def max_adapters(self) -> int:
        """The slots; maxAdapters auto counts as the most there may be until `size` sets what memory holds."""
        ml = self.cfg.multi_lora
        return MAX_SLOTS if ml.max_adapters == AUTO else ml.slots

    def size(self, cfg: TrainerConfig) -> None:
        """The job's config with maxAdapters auto sized at start (orchestration/slot_sizing.py); refused when the
        adapters registered so far already hold a slot past that count."""
        with self._lock:
            held = sorted(r.state["slot"] for r in self._runs.values() if r.state["slot"] is not None)
            n = cfg.multi_lora.slots
            if held and held[-1] >= n:
                raise RegistryError(409, f"multiLora.maxAdapters auto sized {n} slot(s) from memory, and the "
                                         f"adapters registered hold {len(held)} (slots up to {held[-1]}): list "
                                         "fewer adapters, or set multiLora.maxAdapters to a number")
            self.cfg = cfg

    # ---- the API's side --------------------------------------------------------------------------------

    def register(self, name: str, config: AdapterRunConfig, slot: int | None = None) -> AdapterRunState:
        """Take a slot for `name` (SPEC rule 9 first: 400 with the field and the fix); 409 when the name is
        registered and not finished, or no slot is free. A finished adapter's name may be registered again."""
        alg = self.cfg.algorithm
        problems = adapter_problems(self.cfg, name=name, rank=config.rank,
                                    rollout_batch_size=config.rollout_batch_size or alg.rollout_batch_size,
                                    n_samples_per_prompt=config.n_samples_per_prompt or alg.n_samples_per_prompt,
                                    stream_groups=config.stream_groups, config=config)
        if name in (POLICY_ADAPTER, "state"):  # the single-adapter jobs' engine adapter; a route of the API
            raise RegistryError(400, f"name {name} is reserved: pick another name")
        if problems:
            raise RegistryError(400, "; ".join(f"{p.field}: {p.message}" for p in problems))
        if not Path(config.data.path).is_file():
            raise RegistryError(400, f"data.path {config.data.path} is not a file the trainer can read: point it "
                                     "at a .parquet or .jsonl file inside the job's volume")
        if config.data.image_key is not None and not (read_hf_config(self.cfg.model.path) or {}).get("vision_config"):
            raise RegistryError(400, f"data.imageKey {config.data.image_key}: the job's model {self.cfg.model.path} "
                                     "is not a vision-language model (its config.json has no vision_config): unset "
                                     "data.imageKey, or register the adapter on a job of a VL model")
        with self._lock:
            old = self._runs.get(name)
            if old is not None and AdapterPhase(old.state["phase"]) not in FINISHED:
                raise RegistryError(409, f"adapter {name} is already registered ({old.state['phase']}): DELETE "
                                         f"/adapter_runs/{name} first, or register under another name")
            taken = {r.state["slot"] for r in self._runs.values() if r.state["slot"] is not None}
            free = [s for s in range(self.max_adapters) if s not in taken]
            if slot is None:
                if not free:
                    raise RegistryError(409, f"no free slot: all {self.max_adapters} slots "
                                             "(multiLora.maxAdapters) hold adapters; DELETE one, or raise "
                                             "multiLora.maxAdapters")
                slot = free[0]
            elif slot not in free:
                raise RegistryError(409, f"slot {slot} is not free")
            settings = resolve(self.cfg, name, config, slot)
            self._runs.pop(name, None)  # a finished run of that name is forgotten; registration order is kept
            self._runs[name] = _Run(settings, config, {
                "phase": AdapterPhase.PENDING, "slot": slot, "num_steps": settings.num_steps,
                "message": f"registered {rfc3339()}"})
            self._changed()
            return self._runs[name].model()

    def deregister(self, name: str) -> tuple[int, AdapterRunState]:
        """(202, Retiring) for an active adapter (the driver retires it at its next step boundary; a Pending one
        that never trained is retired at once), (200, its final state) for a finished one, which is forgotten."""
        with self._lock:
            run = self._get(name)
            if AdapterPhase(run.state["phase"]) in FINISHED:
                del self._runs[name]
                self._changed()
                return 200, run.model()
            run.retire = True
            if run.state["phase"] is AdapterPhase.PENDING and not run.loaded:
                run.state.update(phase=AdapterPhase.RETIRED, slot=None, message="deleted before it trained")
            else:
                run.state.update(phase=AdapterPhase.RETIRING, message="deleted: retiring at the next step boundary")
            self._changed()
            return 202, run.model()

    def get(self, name: str) -> AdapterRunState:
        with self._lock:
            return self._get(name).model()

    def listing(self) -> AdapterRunList:
        with self._lock:
            return AdapterRunList(adapters=[AdapterRunSummary(name=n, config=r.config, phase=r.state["phase"])
                                            for n, r in self._runs.items()])

    def state(self) -> AdapterRunsState:
        with self._lock:
            return AdapterRunsState(max_adapters=self.max_adapters, active=self._active(),
                                    adapters=[r.model() for r in self._runs.values()])

    # ---- the driver's side -------------------------------------------------------------------------------

    def to_load(self) -> list[AdapterSettings]:
        """Registered adapters not yet in the trainer, in registration order."""
        with self._lock:
            return [r.settings for r in self._runs.values() if not r.loaded and not r.retire
                    and r.state["phase"] is AdapterPhase.PENDING]

    def loaded(self, name: str, num_steps: int, step: int = 0) -> None:
        """The trainer holds it now (restored at `step` on a resume); it retires at `num_steps`."""
        with self._lock:
            run = self._runs[name]
            run.loaded = True
            run.state.update(phase=AdapterPhase.TRAINING, num_steps=num_steps, step=step, version=step,
                             message="training")
            self._changed()

    def to_retire(self) -> list[tuple[str, AdapterPhase]]:
        """Loaded adapters to retire now, each with the phase it ends in: Retired (DELETE) or Succeeded (its
        numSteps reached)."""
        with self._lock:
            out = []
            for name, r in self._runs.items():
                if not r.loaded or AdapterPhase(r.state["phase"]) in FINISHED:
                    continue
                if r.retire:
                    out.append((name, AdapterPhase.RETIRED))
                elif r.state["num_steps"] is not None and r.state["step"] >= r.state["num_steps"]:
                    out.append((name, AdapterPhase.SUCCEEDED))
            return out

    def stepped(self, name: str, step: int, reward_mean: float) -> None:
        with self._lock:
            self._runs[name].state.update(step=step, reward_mean=reward_mean)

    def synced(self, name: str, version: int, report: dict[str, Any]) -> None:
        with self._lock:
            self._runs[name].state.update(version=version, last_sync=SyncProgress(
                mode=report["mode"], bytes=report["bytes"], milliseconds=report["ms"], adapter_version=version,
                checksum=report["checksum"], time=rfc3339()))

    def served(self, name: str, check: dict[str, Any]) -> None:
        """Its serving check's last measurement (serving_check.ServingCheck.observe)."""
        with self._lock:
            self._runs[name].state.update(serving_check=ServingCheckProgress.model_validate(check))

    def checkpointed(self, name: str, path: str, step: int) -> None:
        with self._lock:
            self._runs[name].state.update(last_checkpoint=CheckpointProgress(path=path, step=step))

    def finished(self, name: str, phase: AdapterPhase, message: str, export_path: str | None = None) -> None:
        """Retired, Succeeded or Failed: its slot is free again."""
        with self._lock:
            run = self._runs[name]
            run.state.update(phase=phase, slot=None, message=message, export_path=export_path)
            run.loaded = False
            self._changed()

    def active_names(self) -> list[str]:
        with self._lock:
            return [n for n, r in self._runs.items() if r.loaded and AdapterPhase(r.state["phase"]) not in FINISHED]

    def active(self) -> int:
        with self._lock:
            return self._active()

    def wait_for_work(self, timeout: float) -> bool:
        """Block until an adapter is to be loaded or retired, or `timeout` passed; True when there is work."""
        with self._lock:
            return self._lock.wait_for(lambda: bool(self._pending_work()), timeout=timeout)

    def all_finished(self) -> bool:
        with self._lock:
            return all(AdapterPhase(r.state["phase"]) in FINISHED for r in self._runs.values())

    # ---- persistence --------------------------------------------------------------------------------------

    def restore(self) -> list[str]:
        """Register the adapters a previous attempt of this job held (state_file), in their slots; returns
        their names. Finished ones are not brought back."""
        if self.state_file is None or not self.state_file.is_file():
            return []
        saved = json.loads(self.state_file.read_text())
        names = []
        for item in saved["adapters"]:
            self.register(item["name"], AdapterRunConfig.model_validate(item["config"]), slot=item["slot"])
            names.append(item["name"])
        return names

    # ---- under the lock -----------------------------------------------------------------------------------

    def _get(self, name: str) -> _Run:
        run = self._runs.get(name)
        if run is None:
            raise RegistryError(404, f"no adapter {name}: GET /adapter_runs lists the registered ones")
        return run

    def _active(self) -> int:
        return sum(1 for r in self._runs.values() if r.state["slot"] is not None)

    def _pending_work(self) -> bool:
        return any((not r.loaded and not r.retire and r.state["phase"] is AdapterPhase.PENDING)
                   or (r.loaded and r.retire) for r in self._runs.values())

    def _changed(self) -> None:
        self._lock.notify_all()
        if self.state_file is None:
            return
        held = [{"name": n, "slot": r.state["slot"], "config": r.config.model_dump(by_alias=True, mode="json",
                                                                                   exclude_none=True)}
                for n, r in self._runs.items() if r.state["slot"] is not None]
        self.state_file.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.state_file.with_suffix(".tmp")
        tmp.write_text(json.dumps({"adapters": held}, indent=1))
        os.replace(tmp, self.state_file)  # a torn write never replaces the good file


def validation_message(e: ValidationError) -> str:
    """A pydantic error as one line naming each field (camelCase, as the caller wrote it) and what is wrong."""
    parts = []
    for err in e.errors():
        where = ".".join(str(x) for x in err["loc"]) or "body"
        parts.append(f"{where}: {err['msg']}")
    return "; ".join(parts)
