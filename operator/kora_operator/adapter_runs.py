"""A LoRAAdapter on its job's trainer: the `/adapter_runs` calls (kora_trainer/config/adapter_runs.py declares the
routes and their models, for the trainer that serves them and for us) and, pure, the adapter's status and
conditions from the trainer's state of it.

The calls go to the job's control plane with the job's token, as GET /status does (progress.py); a trainer that
cannot be reached, or refuses the token, raises ProgressUnavailable. Answers the routes give on purpose (404
unknown, 409 no free slot / name taken, 400 a bad config with the field and the fix) come back as values.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from kora_operator.conditions import Cond
from kora_operator.progress import ProgressUnavailable, call
from kora_operator.reasons import ConditionStatus, ConditionType, Reason
from kora_trainer.config.adapter_runs import AdapterPhase, AdapterRunsState, AdapterRunState
from kora_trainer.config.sections import AdapterRunConfig

PATH = "/adapter_runs"
M = TypeVar("M", bound=BaseModel)


@dataclass(frozen=True)
class Refused:
    """A 4xx answer of the /adapter_runs routes: its code and the trainer's message."""

    code: int
    message: str

    @property
    def no_free_slot(self) -> bool:
        return self.code == 409 and "no free slot" in self.message


class AdapterRuns:
    """The `/adapter_runs` routes of one trainer's control plane."""

    def __init__(self, url: str, token: str, timeout: float) -> None:
        self.url, self._token, self.timeout = url, token, timeout

    def _call(self, method: str, path: str, body: Any = None) -> tuple[int, Any]:
        return call(self.url, PATH + path, self._token, self.timeout, method=method, body=body)

    def state(self) -> AdapterRunsState:
        """GET /adapter_runs/state."""
        code, data = self._call("GET", "/state")
        if code != 200:
            raise ProgressUnavailable(f"the trainer at {self.url} answered {code} to GET {PATH}/state: "
                                      f"{_message(data)} (is the job a multi-adapter one, multiLora.maxAdapters > 0?)")
        return _parse(AdapterRunsState, data, f"{PATH}/state")

    def register(self, name: str, config: AdapterRunConfig) -> AdapterRunState | Refused:
        """POST /adapter_runs: the adapter's state (Pending, in its slot), or what the trainer refused and why."""
        body = {"name": name, "config": config.model_dump(by_alias=True, mode="json", exclude_none=True)}
        code, data = self._call("POST", "", body)
        if code == 201:
            return _parse(AdapterRunState, data, PATH)
        return Refused(code, _message(data))

    def get(self, name: str) -> AdapterRunState | None:
        """GET /adapter_runs/{name}; None when the trainer does not know it."""
        code, data = self._call("GET", f"/{name}")
        if code == 404:
            return None
        if code != 200:
            raise ProgressUnavailable(f"the trainer at {self.url} answered {code} to GET {PATH}/{name}: "
                                      f"{_message(data)}")
        return _parse(AdapterRunState, data, f"{PATH}/{name}")

    def delete(self, name: str) -> int:
        """DELETE /adapter_runs/{name}: 202 (retiring at the next step boundary), 200 (it had finished and is
        forgotten now) or 404 (unknown)."""
        code, data = self._call("DELETE", f"/{name}")
        if code not in (200, 202, 404):
            raise ProgressUnavailable(f"the trainer at {self.url} answered {code} to DELETE {PATH}/{name}: "
                                      f"{_message(data)}")
        return code


def _message(data: Any) -> str:
    return str(data.get("error") or data) if isinstance(data, Mapping) else str(data)


def _parse(model: type[M], data: Any, route: str) -> M:
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise ProgressUnavailable(f"the trainer's {route} does not match {model.__name__}: {e.errors()[0]}") from None


def find(state: AdapterRunsState, name: str) -> AdapterRunState | None:
    return next((a for a in state.adapters if a.name == name), None)


# -- the adapter's status from the trainer's state of it (pure) --------------------------------------------------

MIRRORED = ("phase", "slot", "step", "numSteps", "version", "rewardMean", "lastSync", "lastCheckpoint", "exportPath")


def mirrored(run: AdapterRunState) -> dict[str, Any]:
    """The status fields the trainer's state decides; None for those it has not (or no longer: a freed slot)."""
    data = run.model_dump(by_alias=True, mode="json")
    return {k: data.get(k) for k in MIRRORED}


def run_conditions(run: AdapterRunState, job_name: str, max_staleness: int) -> list[Cond]:
    """Registered, Training, WeightsSynced, Complete and Failed from the trainer's state of the adapter."""
    where = f"slot {run.slot}" if run.slot is not None else "its slot freed"
    conds = [Cond(ConditionType.REGISTERED, ConditionStatus.TRUE, Reason.REGISTERED,
                  f"registered on LoRATrainingJob {job_name}'s trainer ({where})")]
    of = f" of {run.num_steps}" if run.num_steps is not None else ""
    no, yes = ConditionStatus.FALSE, ConditionStatus.TRUE
    training: dict[AdapterPhase, tuple[ConditionStatus, Reason, str]] = {
        AdapterPhase.PENDING: (no, Reason.WAITING_TO_LOAD,
                               "registered: the trainer loads it at its next step boundary"),
        AdapterPhase.TRAINING: (yes, Reason.ADAPTER_TRAINING, f"step {run.step}{of}"),
        AdapterPhase.RETIRING: (no, Reason.RETIRING, run.message or "retiring at the trainer's next step boundary"),
        AdapterPhase.SUCCEEDED: (no, Reason.SUCCEEDED, f"finished after {run.step} steps"),
        AdapterPhase.RETIRED: (no, Reason.RETIRED, run.message or f"deleted after {run.step} steps"),
        AdapterPhase.FAILED: (no, Reason.ADAPTER_FAILED, run.message or "the trainer failed it"),
    }
    status, reason, message = training[run.phase]
    conds.append(Cond(ConditionType.TRAINING, status, reason, message))
    if run.last_sync is not None:
        behind = run.step - run.version
        if behind > max_staleness:
            conds.append(Cond(ConditionType.WEIGHTS_SYNCED, ConditionStatus.FALSE, Reason.ENGINES_BEHIND,
                              f"the engines serve version {run.version} of this adapter while it is at step "
                              f"{run.step}: {behind} steps behind, more than spec.deployment.maxStaleness "
                              f"{max_staleness} of its job"))
        else:
            conds.append(Cond(ConditionType.WEIGHTS_SYNCED, ConditionStatus.TRUE, Reason.WEIGHTS_SYNCED,
                              f"the engines serve version {run.version} of this adapter (step {run.step})"))
    if run.phase is AdapterPhase.SUCCEEDED:
        export = f"; exported to {run.export_path}" if run.export_path else ""
        conds.append(Cond(ConditionType.COMPLETE, ConditionStatus.TRUE, Reason.SUCCEEDED,
                          f"trained {run.step} steps{export}"))
    if run.phase is AdapterPhase.FAILED:
        conds.append(Cond(ConditionType.FAILED, ConditionStatus.TRUE, Reason.ADAPTER_FAILED, message))
    return conds
