"""The multi-LoRA recipe (multiLora.maxAdapters > 0): many LoRA adapters on one frozen base, each with its own
data, reward, batch shape, optimizer and step count.

The loop, top to bottom: the adapters a previous attempt held come back from `adapters/registry.json` (each
from its own checkpoint), those listed in multiLora.adapters are registered, the base is pushed once; then per
round: reconcile (retire what the registry says — DELETE or its numSteps reached — and load what was
registered), keep one generation in flight per adapter, train the batches that are ready — waiting at most
multiLora.maxCoalesceWaitSeconds after the first one for the others, so a small adapter never waits for a big
one — and push only the adapters that stepped (selective sync), each at its own version. With deployment.async
an adapter's next batch is generated while its current one trains, so its rollouts lag its policy by one
version (the clipped ratio against the engine's own log-probs corrects for it); without, each batch comes from
the version just pushed, and the adapters overlap each other's generation and training instead. An adapter's
checkpoint is written every checkpoint.interval of its steps and when it retires, with its HF-PEFT export.

The serving check, per adapter (serving_check.py): each on-policy step of an adapter compares the engines' log-probs
of its sampled tokens with the trainer's for the version the engines claimed; the gap is on its state (GET
/adapter_runs/<name>: servingCheck) and the job's /status servingCheck names the worst adapter of the last train
call (so the operator's PolicyServed condition covers multi-adapter jobs). sync.servedBadStepsToFail bad steps of one
adapter in a row stop the job (PolicyNotServed naming the adapter), as they stop a single-adapter job: an adapter
the engines silently do not serve usually means an engine or a sync path that serves none of them right, and a
retry resumes every adapter from its checkpoint.

Service mode: no adapters in the job: it idles (Running, 0 active) and trains whatever is registered through
`/adapter_runs` (the operator's LoRAAdapter objects) until it is stopped; with adapters given it ends when all
have finished. Events (`<run dir>/events.jsonl`): `adapter_loaded`, `adapter_step` (with its `sync`),
`adapter_checkpoint`, `adapter_retired`, and the `summary`.
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kora_trainer.adapter_runs.api import AdapterRunsAPI
from kora_trainer.adapter_runs.registry import AdapterRegistry, RegistryError
from kora_trainer.config.adapter_runs import AdapterPhase, AdapterSettings
from kora_trainer.orchestration.cluster import launch
from kora_trainer.recipes.base import Clock, EngineWatch, RayJob, RecipeRefused, make_lm_toy
from kora_trainer.serving_check import ServingCheck

if TYPE_CHECKING:
    from kora_trainer.config import TrainerConfig
    from kora_trainer.orchestration.cluster import Job
    from kora_trainer.recorder import StepRecorder

GENERATE_TIMEOUT_S = 900.0  # one adapter batch; the engines' own timeouts are below it
ADAPTER_RESUME = "each adapter from its own newest checkpoint, adapters/<name>/"
IDLE_POLL_S = 1.0  # a service with no adapter wakes this often to check its time limit


@dataclass
class MultiLoRARun:
    job: Job
    cfg: TrainerConfig
    registry: AdapterRegistry
    rec: StepRecorder
    root: str | None
    inflight: dict[str, list[Any]] = field(default_factory=dict)  # adapter -> [batch ref, stats ref]
    steps: dict[str, int] = field(default_factory=dict)  # adapter -> its optimizer steps
    positions: dict[str, int] = field(default_factory=dict)  # adapter -> batches its data has yielded
    rewards: dict[str, list[float]] = field(default_factory=dict)  # adapter -> its reward curve (this process)
    checks: dict[str, ServingCheck] = field(default_factory=dict)  # adapter -> its serving check

    # ---- reconcile: the registry says what to retire and what to load -------------------------------------

    def reconcile(self) -> None:
        for name, phase in self.registry.to_retire():
            self.retire(name, phase)
        for settings in self.registry.to_load():
            self.load(settings)

    def load(self, s: AdapterSettings) -> None:
        import ray  # noqa: PLC0415 - Ray loads when a job runs, not on import

        added = False
        try:
            got = self.job.trainer.all("add_adapter", s, self.root)[0]
            added = True
            rows = ray.get(self.job.rollout.add_adapter.remote(s, got["data_position"], got["step"]))
        except Exception as e:  # its data or reward cannot be read: that adapter fails, the job goes on
            self.registry.finished(s.name, AdapterPhase.FAILED, f"could not start: {e}")
            self.rec.event("adapter_failed", adapter=s.name, error=str(e))
            if added:
                self.job.trainer.all("remove_adapter", s.name)
            return
        self.steps[s.name], self.positions[s.name] = got["step"], got["data_position"]
        self.rewards.setdefault(s.name, [])
        report = self.publish(s.name)
        num_steps = s.steps_for(rows)
        self.registry.loaded(s.name, num_steps, got["step"])
        self.rec.event("adapter_loaded", adapter=s.name, slot=s.slot, rank=s.rank, step=got["step"],
                       num_steps=num_steps, rows=rows, sync=report)
        self.rec.say(f"adapter {s.name}: slot {s.slot}, rank {s.rank}, {num_steps} steps"
                     + (f", resumed at step {got['step']}" if got["step"] else ""))

    def retire(self, name: str, phase: AdapterPhase) -> None:
        """Abort its requests, write its checkpoint and export, clear its slot; its untrained tail is dropped."""
        import ray  # noqa: PLC0415 - Ray loads when a job runs, not on import

        t0 = time.monotonic()
        drained = self.job.trainer.all("retire_on_engines", name)[0]
        self.inflight.pop(name, None)  # its generation returns aborted (or finished): dropped either way
        export = None
        if self.root:
            self.save(name)
            export = self.job.trainer.written("export_adapter", name, self.root, {"phase": str(phase)})
        self.job.trainer.all("remove_adapter", name)
        ray.get(self.job.rollout.remove_adapter.remote(name))
        step = self.steps.pop(name)
        self.positions.pop(name, None)
        why = "its numSteps reached" if phase is AdapterPhase.SUCCEEDED else "deleted"
        self.registry.finished(name, phase, f"{why} at step {step}", export)
        self.rec.event("adapter_retired", adapter=name, phase=str(phase), step=step, export=export,
                       in_flight_left=drained["in_flight_left"], ms=round((time.monotonic() - t0) * 1000, 1))
        self.rec.say(f"adapter {name}: {phase} at step {step}" + (f", exported to {export}" if export else ""))

    # ---- a round: generate, train what is ready, push what stepped ------------------------------------------

    def issue(self, name: str, step: int) -> None:
        self.inflight[name] = self.job.rollout.generate_adapter.options(num_returns=2).remote(name, step)

    def round(self) -> None:
        import ray  # noqa: PLC0415 - Ray loads when a job runs, not on import

        for name in self.registry.active_names():
            if name not in self.inflight and name in self.steps:
                self.issue(name, self.steps[name] + 1)
        if not self.inflight:
            return
        refs = {name: pair[0] for name, pair in self.inflight.items()}
        ready, _ = ray.wait(list(refs.values()), num_returns=1, timeout=GENERATE_TIMEOUT_S)
        if not ready:
            raise RuntimeError(f"no adapter batch generated within {GENERATE_TIMEOUT_S:.0f}s: {sorted(refs)}")
        rest = [r for r in refs.values() if r not in ready]
        if rest:  # the others get a bounded moment to join this train call
            more, _ = ray.wait(rest, num_returns=len(rest), timeout=self.cfg.multi_lora.max_coalesce_wait_seconds)
            ready += more
        batches, stats = {}, {}
        for name, ref in refs.items():
            if ref not in ready:
                continue
            batch, stat = ray.get(self.inflight.pop(name))
            self.positions[name] = stat["data_position"]
            if batch is not None:  # None: aborted (retiring)
                batches[name], stats[name] = batch, stat
                if self.cfg.deployment.async_:  # its next batch generates while this one trains: one version behind
                    self.issue(name, self.steps[name] + 2)
        if batches:
            self.train(batches, stats)

    def train(self, batches: dict[str, Any], stats: dict[str, dict[str, Any]]) -> None:
        measured: list[tuple[ServingCheck, dict[str, Any]]] = []
        for m in self.job.trainer.all("train_adapters", batches)[0]:
            self.steps[m.name] = m.step
            self.rewards[m.name].append(m.reward_mean)
            self.registry.stepped(m.name, m.step, m.reward_mean)
            report = self.publish(m.name)
            self.rec.adapter_stepped(m.as_dict(), stats[m.name]["gen_ms"], report)
            interval = self.cfg.checkpoint.interval
            if self.root and m.step % interval == 0:
                self.save(m.name)
            observed = self.served(m.name, m.step, m.rollout_logp_gap_max)
            if observed is not None:
                measured.append(observed)
        if measured:  # last: a PolicyNotServed leaves every step of the call recorded and checkpointed
            worst, last = max(measured, key=lambda c: (c[1]["badSteps"], c[1]["logpGapMax"]))
            self.rec.progress.update(servingCheck=last)
            worst.verdict(last)

    def served(self, name: str, step: int, gap_max: float | None) -> tuple[ServingCheck, dict[str, Any]] | None:
        """Adapter `name`'s serving check at its `step` (its rollouts came from version step - 1), on its state."""
        sync = self.cfg.sync
        serving = self.checks.setdefault(name, ServingCheck(sync.served_logp_gap_max, sync.served_bad_steps_to_fail,
                                                            adapter=name))
        check = serving.observe(step, step - 1, gap_max, None)
        if check is None:
            return None
        self.registry.served(name, check)
        return serving, check

    def publish(self, name: str) -> dict[str, Any]:
        """Push adapter `name` at its step (every rank takes part: the delta-skip decision is collective)."""
        import ray  # noqa: PLC0415 - Ray loads when a job runs, not on import

        reports = self.job.trainer.all("publish", name)
        feeding = [r for r in reports if r.transport not in ("none", "follower")]
        report = (feeding or reports)[0]
        ray.get(self.job.rollout.published.remote(name, report.adapter_version))
        self.registry.synced(name, report.adapter_version, report.as_dict())
        return {k: report.as_dict()[k] for k in ("pushed", "bytes", "ms", "adapter_version", "checksum", "what",
                                                     "path")}

    def save(self, name: str) -> None:
        t0 = time.monotonic()
        meta = {"base_model": self.cfg.model.path, "sync_mode": "Adapter"}
        path = self.job.trainer.written("save_adapter", name, self.root, self.positions.get(name, 0), meta)
        self.registry.checkpointed(name, path, self.steps[name])
        self.rec.adapter_checkpointed(name, self.steps[name], path, (time.monotonic() - t0) * 1000)


def register_given(cfg: TrainerConfig, registry: AdapterRegistry, restored: list[str]) -> None:
    """multiLora.adapters, except those a previous attempt already brought back (restored)."""
    for a in cfg.multi_lora.adapters:
        if a.name not in restored:
            registry.register(a.name, a.config())


def adapter_registry(cfg: TrainerConfig, root: str | None) -> AdapterRegistry:
    """A multi-adapter job's registry (adapter_runs/registry.py): the adapters a previous attempt held (from
    `<checkpoint.path>/adapters/registry.json`), then those the job lists."""
    registry = AdapterRegistry(cfg, Path(root) / "adapters" / "registry.json" if root else None)
    register_given(cfg, registry, registry.restore())
    return registry


def run(job: Job, cfg: TrainerConfig, registry: AdapterRegistry, rec: StepRecorder, root: str | None,
        clock: Clock) -> MultiLoRARun:
    """Until every given adapter finished (service mode: until --time-limit, less the shutdown, is spent)."""
    service = not cfg.multi_lora.adapters
    watch = EngineWatch.of_ray_engines(job, cfg, rec, resume=ADAPTER_RESUME)
    with watch("the push of the base"):
        base = job.trainer.all("push_base")[0]
    rec.event("start", multi_lora=True, service=service, max_adapters=cfg.multi_lora.max_adapters,
              engines=len(job.engines), transport=job.transport, sync=base.as_dict(), world=len(job.trainer.actors))
    rec.progress.update(phase="Running", activeAdapters=registry.active())
    loop = MultiLoRARun(job, cfg, registry, rec, root)
    while clock.fits():
        with watch(f"a round of adapters {', '.join(sorted(loop.steps)) or '(none loaded yet)'}"):
            loop.reconcile()
            rec.progress.update(activeAdapters=registry.active(), step=sum(loop.steps.values()))
            if not loop.steps:
                if not service and registry.all_finished():
                    break
                registry.wait_for_work(IDLE_POLL_S)
                continue
            loop.round()
    for name in list(loop.steps) if root else []:  # stopped with adapters still training: keep where they are
        loop.save(name)
    return loop


def summary(loop: MultiLoRARun, rec: StepRecorder) -> dict[str, Any]:
    """The last line of stdout and of the event file: each adapter's steps and reward curve in this process."""
    states = {a.name: a for a in loop.registry.state().adapters}
    adapters = {}
    for name, curve in loop.rewards.items():
        st = states.get(name)
        adapters[name] = {
            "phase": str(st.phase) if st else None, "steps": len(curve), "step": st.step if st else None,
            "reward_first": round(statistics.fmean(curve[:10]), 4) if curve else None,
            "reward_last": round(statistics.fmean(curve[-10:]), 4) if curve else None,
            "reward_curve": [round(x, 3) for x in curve], "export": st.export_path if st else None}
    out = {"event": "summary", "multi_lora": True, "adapters": adapters, "wall_s": rec.wall_s()}
    rec.event("summary", **{k: v for k, v in out.items() if k != "event"})
    rec.say(json.dumps(out))
    return out


class MultiLoRA:
    """The recipe (recipes/base.Recipe) of a job with multiLora.maxAdapters > 0: its registry, served on the control
    plane's /adapter_runs, says which adapters train."""

    def __init__(self, cfg: TrainerConfig, clock: Clock, threads: int = 1):
        self.cfg, self.clock, self.threads = cfg, clock, threads
        self.ray = RayJob()
        self.registry: AdapterRegistry | None = None
        self.loop: MultiLoRARun | None = None

    def make_toy(self) -> None:
        make_lm_toy(self.cfg, self.threads)

    def total_steps(self) -> int:
        return 0  # each adapter counts its own

    def serving_check(self) -> None:
        return None  # one per adapter (MultiLoRARun.served)

    def control_routes(self, root: str | None) -> AdapterRunsAPI:
        try:
            self.registry = adapter_registry(self.cfg, root)
        except RegistryError as e:  # an adapter of multiLora.adapters the registry refuses (e.g. its data file)
            raise RecipeRefused(f"multiLora.adapters: {e.message}") from e
        return AdapterRunsAPI(self.registry)

    def train(self, rec: StepRecorder, root: str | None, run_dir: Path) -> None:
        assert self.registry is not None, "control_routes makes the registry"
        self.ray.connect()
        job = self.ray.job = launch(self.cfg, run_dir, threads=self.threads)  # placement, models, rollout manager
        self.loop = run(job, self.cfg, self.registry, rec, root, self.clock)

    def close(self) -> None:
        self.ray.stop()

    def summarize(self, rec: StepRecorder) -> None:
        assert self.loop is not None
        summary(self.loop, rec)
