"""The multi-LoRA recipe (multiLora.maxAdapters > 0): many LoRA adapters on one frozen base, each with its own
data, reward, batch shape, optimizer and step count.

The loop, top to bottom: the adapters a previous attempt held come back from `adapters/registry.json` (each
from its own checkpoint), those listed in multiLora.adapters are registered, the base is pushed once; then per
round: reconcile (retire what the registry says — DELETE or its numSteps reached — and load what was
registered) before anything is generated, keep one generation in flight per loaded adapter, its batch streamed
back in units of its streamGroups prompt groups as they complete, train the units that are ready — waiting at
most multiLora.maxCoalesceWaitSeconds after the first one for the other adapters', so a small adapter never waits
for a big one — with gradients accumulating in each adapter's slot across train calls until its batch is in, and
push only the adapters that stepped (selective sync), each at its own version. Progress (groups in, step, data
position, registry state) is committed only after a train call returned. With deployment.async an adapter's next
batch is generated while the end of its current one trains, so its rollouts lag its policy by one version (the
clipped ratio against the engine's own log-probs corrects for it); without, each batch comes from the version just
pushed, and the adapters overlap each other's generation and training instead. An adapter's
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
from kora_trainer.backends.batch import RolloutBatch
from kora_trainer.config.adapter_runs import AdapterPhase, AdapterSettings
from kora_trainer.config.sections import AUTO
from kora_trainer.orchestration.cluster import place, start_models, start_rollout
from kora_trainer.orchestration.slot_sizing import size_slots
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
    inflight: dict[str, Any] = field(default_factory=dict)  # adapter -> its batch's units (a Ray generator)
    steps: dict[str, int] = field(default_factory=dict)  # adapter -> its optimizer steps
    positions: dict[str, int] = field(default_factory=dict)  # adapter -> batches its steps have consumed
    groups: dict[str, int] = field(default_factory=dict)  # adapter -> groups of its current batch trained so far
    calls: dict[str, int] = field(default_factory=dict)  # adapter -> train calls its current batch took so far
    rewards: dict[str, list[float]] = field(default_factory=dict)  # adapter -> its reward curve (this process)
    checks: dict[str, ServingCheck] = field(default_factory=dict)  # adapter -> its serving check
    saved: dict[str, int] = field(default_factory=dict)  # adapter -> the step its newest checkpoint holds

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
        except ray.exceptions.RayActorError:
            raise  # a trainer rank or the rollout manager died (even at creation): the job fails, not this adapter
        except Exception as e:  # its data or reward cannot be read: that adapter fails, the job goes on
            cause = e.cause if isinstance(e, ray.exceptions.RayTaskError) and e.cause else e  # not Ray's traceback
            error = f"{type(cause).__name__}: {cause}"
            self.registry.finished(s.name, AdapterPhase.FAILED, f"could not start: {error}")
            self.rec.event("adapter_failed", adapter=s.name, error=error)
            if added:
                self.job.trainer.all("remove_adapter", s.name)
            return
        self.steps[s.name], self.positions[s.name] = got["step"], got["data_position"]
        if got["step"]:
            self.saved[s.name] = got["step"]  # resumed from that checkpoint
        self.rewards.setdefault(s.name, [])
        report = self.publish(s.name)
        num_steps = s.steps_for(rows)
        lr = self.job.trainer.all("schedule_adapter", s.name, num_steps)[0]
        self.registry.loaded(s.name, num_steps, got["step"])
        self.rec.event("adapter_loaded", adapter=s.name, slot=s.slot, rank=s.rank, step=got["step"],
                       num_steps=num_steps, rows=rows, sync=report, schedule=lr)
        shape = "" if lr["lr_decay_style"] == "constant" else (
            f" to {lr['min_lr']:g} at step {lr['lr_decay_steps']}")
        warmup = f" after {lr['lr_warmup_steps']} warmup steps" if lr["lr_warmup_steps"] else ""
        self.rec.say(f"adapter {s.name}: slot {s.slot}, rank {s.rank}, {num_steps} steps, lr {lr['lr']:g} "
                     f"{lr['lr_decay_style']}{shape}{warmup}"
                     + (f", resumed at step {got['step']}" if got["step"] else ""))

    def retire(self, name: str, phase: AdapterPhase) -> None:
        """Abort its requests, write its checkpoint and export (its last step's: a partly trained batch is not in
        it), clear its slot; its untrained tail and the gradients of a partly trained batch are dropped."""
        import ray  # noqa: PLC0415 - Ray loads when a job runs, not on import

        t0 = time.monotonic()
        # its requests aborted by exact rid from the rollout manager (every build; stock ones have no prefix abort),
        # so the unload that follows does not wait for its generation to run out
        aborted = ray.get(self.job.rollout.abort_adapter.remote(name))
        drained = self.job.trainer.all("retire_on_engines", name)[0]
        self.inflight.pop(name, None)  # its generation returns aborted (or finished): dropped either way
        export = None
        if self.root:
            if self.saved.get(name) != self.steps[name]:  # its last interval's checkpoint may hold this step already
                self.save(name)
            export = self.job.trainer.written("export_adapter", name, self.root, {"phase": str(phase)})
        self.job.trainer.all("remove_adapter", name)
        ray.get(self.job.rollout.remove_adapter.remote(name))
        step = self.steps.pop(name)
        self.positions.pop(name, None)
        self.saved.pop(name, None)
        partial = self.groups.pop(name, 0)  # its partly trained batch went with its slot
        self.calls.pop(name, None)
        why = "its numSteps reached" if phase is AdapterPhase.SUCCEEDED else "deleted"
        self.registry.finished(name, phase, f"{why} at step {step}", export)
        self.rec.event("adapter_retired", adapter=name, phase=str(phase), step=step, export=export,
                       groups_dropped=partial, aborted=aborted,
                       in_flight_left=drained["in_flight_left"], ms=round((time.monotonic() - t0) * 1000, 1))
        self.rec.say(f"adapter {name}: {phase} at step {step}" + (f", exported to {export}" if export else ""))

    # ---- a round: generate, train what is ready, push what stepped ------------------------------------------

    def issue(self, name: str, step: int) -> None:
        """Its batch for `step`, streamed: a Ray generator of its units (AdapterRollouts.units)."""
        self.inflight[name] = self.job.rollout.generate_adapter_units.options(num_returns="streaming").remote(
            name, step)

    def round(self) -> None:
        for name in self.registry.active_names():  # reconcile ran first: only loaded adapters generate
            if name not in self.inflight and name in self.steps:
                self.issue(name, self.steps[name] + 1)
        if not self.inflight:
            return
        units = self.collect()
        batches = {name: RolloutBatch.joined([b for b, _ in got]) for name, got in units.items() if got}
        if batches:
            self.train(batches, {name: got[-1][1] for name, got in units.items() if got})

    def collect(self) -> dict[str, list[tuple[Any, dict[str, Any]]]]:
        """The units generation has completed: wait for the first, then at most maxCoalesceWaitSeconds for the
        other adapters' (so a small adapter never waits for a big one), and take every unit each has ready."""
        import ray  # noqa: PLC0415 - Ray loads when a job runs, not on import

        gens = dict(self.inflight)
        ready, _ = ray.wait(list(gens.values()), num_returns=1, timeout=GENERATE_TIMEOUT_S)
        if not ready:
            raise RuntimeError(f"no adapter's groups generated within {GENERATE_TIMEOUT_S:.0f}s: {sorted(gens)}")
        rest = [g for g in gens.values() if g not in ready]
        if rest:  # the others get a bounded moment to join this train call
            more, _ = ray.wait(rest, num_returns=len(rest), timeout=self.cfg.multi_lora.max_coalesce_wait_seconds)
            ready += more
        return {name: self.drain(name, gen) for name, gen in gens.items() if gen in ready}

    def drain(self, name: str, gen: Any) -> list[tuple[Any, dict[str, Any]]]:
        """Adapter `name`'s units that are ready now, in order. Its last unit ends its generation (with
        deployment.async its next batch starts at once, one version behind); an aborted one (it is retiring)
        drops its whole batch, the part already in its slot too (a later batch starts clean)."""
        import ray  # noqa: PLC0415 - Ray loads when a job runs, not on import

        got: list[tuple[Any, dict[str, Any]]] = []
        while True:
            batch, stat = ray.get(next(gen))
            if batch is None:
                self.inflight.pop(name, None)
                if self.groups.get(name):
                    self.job.trainer.all("drop_adapter_batch", name)
                    self.groups[name] = self.calls[name] = 0
                return []
            got.append((batch, stat))
            if stat["last"]:
                self.inflight.pop(name, None)
                if self.cfg.deployment.async_:  # its next batch generates while this one trains
                    self.issue(name, self.steps[name] + 2)
                return got
            more, _ = ray.wait([gen], num_returns=1, timeout=0)
            if not more:
                return got

    def train(self, batches: dict[str, Any], stats: dict[str, dict[str, Any]]) -> None:
        """One train call over the adapters' units; what it did is committed only once it returned: the groups
        in (`groups`), and for an adapter that stepped its step, data position, registry state, push and
        checkpoint."""
        measured: list[tuple[ServingCheck, dict[str, Any]]] = []
        stepped = self.job.trainer.all("train_adapters", batches)[0]
        for name, batch in batches.items():
            self.groups[name] = self.groups.get(name, 0) + len(batch) // batch.group_size
            self.calls[name] = self.calls.get(name, 0) + 1
        for m in stepped:
            self.steps[m.name] = m.step
            self.positions[m.name] = stats[m.name]["data_position"]
            calls, self.calls[m.name], self.groups[m.name] = self.calls[m.name], 0, 0
            self.rewards[m.name].append(m.reward_mean)
            self.registry.stepped(m.name, m.step, m.reward_mean)
            report = self.publish(m.name)
            self.rec.adapter_stepped({**m.as_dict(), "train_calls": calls}, stats[m.name]["gen_ms"], report)
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
        self.saved[name] = self.steps[name]
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
    if not service:
        raise_if_all_failed(registry)
    return loop


def raise_if_all_failed(registry: AdapterRegistry) -> None:
    """A job of given adapters that trained none of them (each Failed: its data, reward or start) ends Failed,
    naming each adapter's error, rather than Succeeded with nothing done; one that trained some ends as they did."""
    adapters = registry.state().adapters
    if adapters and all(a.phase is AdapterPhase.FAILED for a in adapters):
        raise RuntimeError("every adapter of multiLora.adapters failed: "
                           + "; ".join(f"{a.name}: {a.message}" for a in adapters))


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
        placed = place(self.cfg)  # the placement group, ready
        if self.cfg.multi_lora.max_adapters == AUTO:  # before the engines start: their LoRA pool is sized at launch
            placed, lines = size_slots(placed)
            rec.event("slots_sized", max_adapters=placed.cfg.multi_lora.max_adapters, arithmetic=lines)
            for line in lines:
                rec.say(line)
            try:
                self.registry.size(placed.cfg)
            except RegistryError as e:
                raise RecipeRefused(e.message) from e
            self.cfg = placed.cfg
        models = start_models(placed, run_dir, self.threads)  # the engines, and the trainer's ranks loading the model
        job = self.ray.job = start_rollout(placed, models)  # the rollout manager; each rank's transport to its engines
        self.loop = run(job, self.cfg, self.registry, rec, root, self.clock)

    def close(self) -> None:
        self.ray.stop()

    def summarize(self, rec: StepRecorder) -> None:
        assert self.loop is not None
        summary(self.loop, rec)
