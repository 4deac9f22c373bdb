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

Streaming: an adapter's batch comes back in units of its streamGroups prompt groups (`units`, a generator the
driver reads as a Ray streaming call), each yielded, scored, as soon as its samples are in, in prompt order. The
batch goes out as calls of at most streamGroups prompts, all at once (the engine batches them together), so a unit
moves on when its own requests are answered — except where the run claims exact resume (reproducible rollouts:
checkpoint.path set, deployment.async off): there the calls stay as the rollout manager cuts a whole step (one per
engine when there is one), because which of an adapter's calls an engine batches together would otherwise depend on
timing, and the reference engine's forward is not batch-invariant at fp32 rounding; the units of a call then move on
together. A unit any of whose requests was aborted (its adapter is retiring) comes back as None and ends the batch:
its tail is dropped.
"""

from __future__ import annotations

import queue
import threading
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
from kora_trainer.wire.engine_client import GenerateOutput

# threads and connections for this many calls to one engine at once (all adapters): a streamed batch goes out as
# calls of streamGroups prompts, all at once, so that the engine batches across units and adapters as it batched
# whole batches
UNIT_CALLS_PER_ENGINE = 32


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

    def units(self, name: str, step: int) -> Iterator[tuple[RolloutBatch | None, dict[str, Any]]]:
        """Adapter `name`'s batch for its step `step`, yielded in units of its streamGroups prompt groups as their
        samples come back, in prompt order (so what the trainer sums, and in which order, does not depend on
        which call finished first); the stats of each say `last` on the batch's last unit. (None, stats): its
        requests were aborted (it is retiring) and the rest of the batch is dropped."""
        t0 = time.monotonic()
        a = self.adapters[name]
        s, r = a.settings, self.rollout
        rows = next(a.batches)
        a.position += 1
        version = a.version  # before the requests go out (see the module docstring)
        prompts, images, image_data = a.prompts.build(rows)  # a VL adapter's placeholders expanded
        g = s.n_samples_per_prompt
        ids, params = r.requests(prompts, g, s.seed, step)
        answers: queue.SimpleQueue[tuple[int, list[GenerateOutput]] | BaseException | dict[str, str]] = \
            queue.SimpleQueue()

        # a call per unit, all out at once; a run claiming exact resume keeps a whole step's calls (module doc)
        unit_calls = {} if r.seeded else {"chunk_prompts": s.stream_groups, "in_flight": len(prompts)}

        def spread() -> None:  # on its own thread: the calls' answers reach this generator as they come
            try:
                answers.put(r.spread(step, ids, params, g, lora_path=name, rid_prefix=rid_prefix(name),
                                     image_data=image_data, **unit_calls,
                                     on_chunk=lambda first, outs: answers.put((first, outs)))[1])
            except BaseException as e:  # handed to the consumer, which raises it
                answers.put(e)

        threading.Thread(target=spread, name=f"generate-{name}", daemon=True).start()
        outs: list[GenerateOutput | None] = [None] * len(ids)
        engines_out: dict[str, str] | None = None
        for lo in range(0, len(prompts), s.stream_groups):
            hi = min(lo + s.stream_groups, len(prompts))
            last = hi == len(prompts)
            while any(o is None for o in outs[lo * g:hi * g]) or (last and engines_out is None):
                got = answers.get()
                if isinstance(got, BaseException):
                    raise got
                if isinstance(got, dict):
                    engines_out = got
                else:
                    outs[got[0] * g:got[0] * g + len(got[1])] = got[1]
            unit = [o for o in outs[lo * g:hi * g] if o is not None]
            stats = {"adapter": name, "gen_ms": round((time.monotonic() - t0) * 1000, 1), "data_position": a.position,
                     "groups": hi - lo, "last": last, "engines_out": engines_out or {}}
            if any((o.finish_reason or {}).get("type") == "abort" for o in unit):
                yield None, {**stats, "aborted": True}
                return
            engine = [o.weight_version if self.engine_tags else None for o in unit]
            tags: list[str | None] = [v if v is not None and v.isdigit() else str(version) for v in engine]
            yield r.scored(rows[lo:hi], prompts[lo:hi], unit, g, a.reward, tags,
                           None if images is None else images[lo:hi]), stats
