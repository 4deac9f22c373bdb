"""Multi-LoRA rollouts: each adapter its own prompts, reward, batch shape and request ids, on the job's engines.

Each adapter reads its own dataset in its own seeded order (its `seed`), asks for `nSamplesPerPrompt` samples
of each of its `rolloutBatchSize` prompts under its own name (`lora_path=<name>`), with request ids
`<name>::<uuid>` (so retiring it aborts exactly its requests), spread over the engines by the rollout manager's
balancing (rollout_manager.Rollout.spread). With reproducible rollouts each sample's sampling_seed is a function
of (its adapter's seed, its adapter step, prompt, sample) only: what an adapter generates does not depend on
which adapters run beside it.

Versions: a rollout is tagged with the adapter version the engine served when the engine says (the weight-update
group route publishes each version with its tag); with the in-memory route (Colocate), which has no version, with
the version the driver last published before the request was sent — a request racing a publish is tagged with the
older one, a lag, never a false "current".

A batch any of whose requests was aborted (its adapter is retiring) comes back as None: its tail is dropped.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from kora_trainer.algorithm.rewards import RewardFn, reward_fn
from kora_trainer.backends.batch import RolloutBatch
from kora_trainer.config.adapter_runs import AdapterSettings
from kora_trainer.config.sglang_builds import effective_build
from kora_trainer.orchestration.data import Row, batches, load_rows
from kora_trainer.orchestration.rollout_manager import Prompts, Rollout
from kora_trainer.orchestration.workers import transport_kind
from kora_trainer.sync.slot_sender import rid_prefix


@dataclass
class _Adapter:
    settings: AdapterSettings
    rows: list[Row]
    batches: Iterator[list[Row]]
    reward: RewardFn
    prompts: Prompts  # its rows -> prompt ids (and images, when its data.imageKey is set)
    position: int = 0  # batches taken
    version: int = 0  # the version last published (set by the driver)


class AdapterRollouts:
    def __init__(self, rollout: Rollout):
        self.rollout = rollout
        self.adapters: dict[str, _Adapter] = {}
        # Only the weight-update group's route versions each adapter on the engine; after an in-memory load the
        # engine reports its one server-wide version (the base push's), which says nothing of the adapter; so does
        # an SGLang build (per-adapter versions are kora's extension: config/sglang_builds.py)
        self.engine_tags = transport_kind(rollout.cfg) == "distributed" and effective_build(rollout.cfg) is None

    def add(self, settings: AdapterSettings, position: int = 0, version: int = 0) -> int:
        """Its data loaded and fast-forwarded to `position` batches (a checkpoint's); returns its row count."""
        d = settings.data
        rows = load_rows(d.path, d.input_key, d.label_key, d.image_key)
        prompts = Prompts(self.rollout.cfg.model.path, d.image_key, self.rollout.tokenizer,
                          f"adapter {settings.name}'s data.imageKey")
        a = _Adapter(settings, rows, batches(rows, settings.rollout_batch_size, settings.seed), reward_fn(d), prompts,
                     version=version)
        while a.position < position:
            next(a.batches)
            a.position += 1
        self.adapters[settings.name] = a
        return len(rows)

    def remove(self, name: str) -> None:
        self.adapters.pop(name, None)

    def published(self, name: str, version: int) -> None:
        self.adapters[name].version = version

    def position(self, name: str) -> int:
        return self.adapters[name].position

    def generate(self, name: str, step: int) -> tuple[RolloutBatch | None, dict[str, Any]]:
        """Adapter `name`'s batch for its step `step` (None: aborted, it is retiring)."""
        t0 = time.monotonic()
        a = self.adapters[name]
        s, r = a.settings, self.rollout
        rows = next(a.batches)
        a.position += 1
        version = a.version  # before the requests go out (see the module docstring)
        prompts, images, image_data = a.prompts.build(rows)  # a VL adapter's placeholders expanded
        g = s.n_samples_per_prompt
        ids, params = r.requests(prompts, g, s.seed, step)
        outs, out_engines = r.spread(step, ids, params, g, lora_path=name, rid_prefix=rid_prefix(name),
                                     image_data=image_data)
        stats = {"adapter": name, "gen_ms": round((time.monotonic() - t0) * 1000, 1), "data_position": a.position,
                 "engines_out": out_engines}
        if any((o.finish_reason or {}).get("type") == "abort" for o in outs):
            return None, {**stats, "aborted": True}
        engine = [o.weight_version if self.engine_tags else None for o in outs]
        tags: list[str | None] = [v if v is not None and v.isdigit() else str(version) for v in engine]
        batch = r.scored(rows, prompts, outs, g, a.reward, tags, images)
        return batch, stats
