"""The multi-adapter API on the trainer's control plane (`/adapter_runs`): one model for the trainer that serves
it (kora_trainer/multi_lora/api.py) and the operator that calls it (its LoRAAdapter handler).

    POST   /adapter_runs          AdapterRunRequest {name, config}   201 AdapterRunState
                                  409 no free slot / the name is taken; 400 a bad config (the field and the fix)
    GET    /adapter_runs          AdapterRunList {adapters: [{name, config, phase}]}
    GET    /adapter_runs/state    AdapterRunsState {maxAdapters, active, adapters: [AdapterRunState]}
    GET    /adapter_runs/{name}   AdapterRunState (404 unknown)
    DELETE /adapter_runs/{name}   202 AdapterRunState (Retiring: its requests aborted, its checkpoint and export
                                  written, its slot freed at the trainer's next step boundary); 200 when it had
                                  already finished (the record is forgotten); 404 unknown

Every route takes the control plane's bearer token. An adapter's phases: Pending (registered, not yet in the
trainer) -> Training -> Retiring (its numSteps reached, or DELETE) -> Succeeded (numSteps reached) / Retired
(deleted before) / Failed. A finished adapter keeps its record (and its final state) until DELETE forgets it.
Imports nothing heavy: the operator reads it too.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated, TypeVar

from pydantic import Field

from kora_trainer.config.base import CamelModel
from kora_trainer.config.rules import min_groups_per_dp_split
from kora_trainer.config.sections import ADAPTER_NAME, AdapterRunConfig, AlgorithmSpec, DataSpec, LrDecayStyle
from kora_trainer.config.status import CheckpointProgress, ServingCheckProgress, SyncProgress
from kora_trainer.config.trainer import TrainerConfig


class AdapterPhase(StrEnum):
    PENDING = "Pending"
    TRAINING = "Training"
    RETIRING = "Retiring"
    SUCCEEDED = "Succeeded"
    RETIRED = "Retired"
    FAILED = "Failed"


FINISHED = frozenset({AdapterPhase.SUCCEEDED, AdapterPhase.RETIRED, AdapterPhase.FAILED})


class AdapterRunRequest(CamelModel):
    """POST /adapter_runs: register an adapter into the running job."""

    name: Annotated[str, Field(pattern=ADAPTER_NAME)]
    """Its name: the lora_path on the engines, the request-id prefix `<name>::`, `adapters/<name>/` on disk."""
    config: AdapterRunConfig
    """Its shape, optimizer, data and length."""


class AdapterRunState(CamelModel):
    """One adapter as the trainer sees it."""

    name: str
    """The adapter's name."""
    phase: AdapterPhase
    """Pending, Training, Retiring, Succeeded, Retired or Failed."""
    slot: Annotated[int, Field(ge=0)] | None = None
    """The slot it holds (None once it has freed it)."""
    step: Annotated[int, Field(ge=0)] = 0
    """Its optimizer steps so far (a resumed adapter counts from its checkpoint)."""
    num_steps: Annotated[int, Field(ge=1)] | None = None
    """The step it retires at (None until its data is read, when numEpochs decides it)."""
    reward_mean: float | None = None
    """Mean reward of its last step's samples."""
    version: Annotated[int, Field(ge=0)] = 0
    """Its adapter version the engines serve (its step at its last push)."""
    last_sync: SyncProgress | None = None
    """Its last push to the engines."""
    last_checkpoint: CheckpointProgress | None = None
    """Its last checkpoint (`<checkpoint.path>/adapters/<name>/`)."""
    serving_check: ServingCheckProgress | None = None
    """The serving check of its last on-policy step: the engines' log-probs of its sampled tokens against the
    trainer's for the version the engines claimed (sync.servedLogpGapMax; the job stops after
    sync.servedBadStepsToFail bad steps of one adapter in a row, naming it)."""
    export_path: str | None = None
    """Its HF-PEFT export, once written (at retirement)."""
    message: str = ""
    """Why it is in this phase (the error of a Failed adapter)."""


class AdapterRunSummary(CamelModel):
    name: str
    config: AdapterRunConfig
    phase: AdapterPhase


class AdapterRunList(CamelModel):
    """GET /adapter_runs: the registrations."""

    adapters: list[AdapterRunSummary]


class AdapterRunsState(CamelModel):
    """GET /adapter_runs/state: every adapter's state and the slots."""

    max_adapters: Annotated[int, Field(ge=0)]
    """Slots in all."""
    active: Annotated[int, Field(ge=0)]
    """Adapters holding a slot (Pending, Training, Retiring)."""
    adapters: list[AdapterRunState]
    """Every adapter the trainer knows, finished ones too, in registration order."""


class AdapterSettings(CamelModel):
    """An adapter's config with the job's defaults filled in: what the trainer and the rollout manager run."""

    name: str
    slot: Annotated[int, Field(ge=0)]
    rank: Annotated[int, Field(ge=1)]
    alpha: float
    lr: float
    rollout_batch_size: Annotated[int, Field(ge=1)]
    n_samples_per_prompt: Annotated[int, Field(ge=1)]
    data: DataSpec
    num_steps: Annotated[int, Field(ge=1)] | None
    num_epochs: Annotated[int, Field(ge=1)] | None
    seed: int
    stream_groups: Annotated[int, Field(ge=1)] = 1  # groups per unit into training, at most rolloutBatchSize
    lr_decay_style: LrDecayStyle = LrDecayStyle.CONSTANT
    min_lr: float = 0.0
    lr_warmup_steps: Annotated[int, Field(ge=0)] = 0
    lr_decay_steps: Annotated[int, Field(ge=1)] | None = None  # None: its step count

    def schedule(self, alg: AlgorithmSpec, num_steps: int) -> AlgorithmSpec:
        """The job's AlgorithmSpec with this adapter's rate and schedule, decaying over its own `num_steps` unless
        it (or the job) sets lrDecaySteps: what algorithm/lr_schedule.py reads for its steps."""
        return alg.model_copy(update={
            "lr": self.lr, "lr_decay_style": self.lr_decay_style, "min_lr": self.min_lr,
            "lr_warmup_steps": self.lr_warmup_steps, "lr_decay_steps": self.lr_decay_steps or num_steps,
            "num_steps": num_steps})

    @property
    def global_batch_size(self) -> int:
        """Samples per optimizer step of this adapter (its gradient is scaled by 1 / this)."""
        return self.rollout_batch_size * self.n_samples_per_prompt

    @property
    def unit_samples(self) -> int:
        """Samples per unit of streaming into training (the last unit of a batch may be smaller)."""
        return self.stream_groups * self.n_samples_per_prompt

    def steps_for(self, rows: int) -> int:
        """Its numSteps, or numEpochs (default 1) x rows // rolloutBatchSize when unset."""
        if self.num_steps is not None:
            return self.num_steps
        return max(1, (self.num_epochs or 1) * rows // self.rollout_batch_size)


def resolve(cfg: TrainerConfig, name: str, config: AdapterRunConfig, slot: int) -> AdapterSettings:
    alg = cfg.algorithm
    rollout_batch_size = config.rollout_batch_size or alg.rollout_batch_size
    n_samples_per_prompt = config.n_samples_per_prompt or alg.n_samples_per_prompt
    fewest = min_groups_per_dp_split(n_samples_per_prompt, cfg.parallelism.data)
    return AdapterSettings(
        name=name, slot=slot, rank=config.rank, alpha=config.alpha if config.alpha is not None else cfg.lora.alpha,
        lr=config.lr if config.lr is not None else alg.lr,
        rollout_batch_size=rollout_batch_size, n_samples_per_prompt=n_samples_per_prompt,
        data=config.data, num_steps=config.num_steps, num_epochs=config.num_epochs,
        seed=config.seed if config.seed is not None else alg.seed,
        stream_groups=min(config.stream_groups or fewest, rollout_batch_size),
        lr_decay_style=_default(config.lr_decay_style, alg.lr_decay_style),
        min_lr=_default(config.min_lr, alg.min_lr), lr_warmup_steps=_default(config.lr_warmup_steps,
                                                                             alg.lr_warmup_steps),
        lr_decay_steps=_default(config.lr_decay_steps, alg.lr_decay_steps))


_T = TypeVar("_T")


def _default(value: _T | None, job: _T) -> _T:
    return job if value is None else value
