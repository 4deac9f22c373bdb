"""Training progress, read from the trainer's control-plane API, into the job's status.

`GET <trainer>:<port>/status` with `Authorization: Bearer <the job's token>` answers the trainer's
`TrainerStatus` (kora_trainer.config.status, the model the trainer serializes it with): the `Progress`
keys (camelCase: step, totalSteps, rewardMean, lastSync, lastCheckpoint) plus how the run stands (phase,
syncedStep, ...). `fetch` does that HTTP call (through `call`, the one request helper for the control plane,
which the /adapter_runs client in adapter_runs.py uses too); `read_status`, `progress_of` and `progress_conditions`
are pure: the snapshot (and the spec) in, the parsed answer, `status.progress` and the WeightsSynced /
Checkpointed / PolicyServed conditions out.

WeightsSynced is False when the engines serve a policy more than spec.deployment.maxStaleness steps
older than the trainer's (lastSync.adapterVersion < step - maxStaleness): a stale policy shows, with
a Warning event, in `kubectl describe`. A trainer that skipped a push because no adapter tensor moved
more than sync.deltaSkipThreshold leaves the engines on an older version that is nonetheless
equivalent; it says so with the optional top-level key `syncedStep` (the last step the engines'
policy was checked against, pushed or skipped), which then counts instead of adapterVersion.
"""

from __future__ import annotations

import http.client
import json
import urllib.error
import urllib.request
from collections.abc import Mapping
from typing import Any

from pydantic import ValidationError

from kora_operator.api.job import LoRATrainingJobSpec
from kora_operator.api.status import Progress
from kora_operator.conditions import Cond
from kora_operator.reasons import ConditionStatus, ConditionType, Reason
from kora_trainer.config.status import TrainerStatus

STATUS_KEYS = tuple(f.alias or n for n, f in TrainerStatus.model_fields.items())


class ProgressUnavailable(Exception):
    """The trainer's /status could not be read; `unauthorized` when it refused the token."""

    def __init__(self, message: str, unauthorized: bool = False) -> None:
        super().__init__(message)
        self.unauthorized = unauthorized


def call(base_url: str, path: str, token: str, timeout: float, method: str = "GET",
         body: Any = None) -> tuple[int, Any]:
    """One request to the trainer's control plane with the job's token: (HTTP status, the JSON answer), 4xx
    answers included (the /adapter_runs routes say what is wrong in them). Raises ProgressUnavailable, with a
    message naming the address, when the trainer cannot be reached, refuses the token, or answers 5xx or no
    JSON."""
    url = base_url.rstrip("/") + path
    headers = {"Authorization": f"Bearer {token}", "Accept": "application/json"}
    data = None
    if body is not None:
        data = json.dumps(body).encode()
        headers["Content-Type"] = "application/json"
    req = urllib.request.Request(url, data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return int(resp.status), json.loads(resp.read())
    except urllib.error.HTTPError as e:
        if e.code in (401, 403):
            raise ProgressUnavailable(
                f"the trainer at {url} refused the job's control-plane token ({e.code}): the trainer was started "
                "with another token (an older operator key?)", unauthorized=True) from None
        if e.code >= 500:
            raise ProgressUnavailable(f"the trainer at {url} answered {e.code}") from None
        try:
            return e.code, json.loads(e.read())
        except (OSError, ValueError, http.client.HTTPException):
            raise ProgressUnavailable(f"the trainer at {url} answered {e.code}") from None
    except (urllib.error.URLError, OSError, ValueError, http.client.HTTPException) as e:  # HTTPException: an
        # answer cut short (the trainer exiting while it wrote)
        raise ProgressUnavailable(f"cannot read {url}: {getattr(e, 'reason', e)}") from None


def fetch(base_url: str, token: str, timeout: float) -> dict[str, Any]:
    """One GET /status; raises ProgressUnavailable with a message naming the address."""
    code, data = call(base_url, "/status", token, timeout)
    url = base_url.rstrip("/") + "/status"
    if code != 200:
        raise ProgressUnavailable(f"the trainer at {url} answered {code}")
    if not isinstance(data, dict):
        raise ProgressUnavailable(f"{url} answered {type(data).__name__}, not an object")
    return data


def read_status(snapshot: Mapping[str, Any]) -> TrainerStatus:
    """A /status answer checked against the trainer's model (and so, for its progress, the CRD schema): the
    keys the model has (a newer trainer may send more), a None value as unset."""
    picked = {k: snapshot[k] for k in STATUS_KEYS if snapshot.get(k) is not None}
    try:
        return TrainerStatus.model_validate(picked)
    except ValidationError as e:
        raise ProgressUnavailable(f"the trainer's /status does not match the Progress model: {e.errors()[0]}") from None


def status_progress(status: TrainerStatus) -> dict[str, Any]:
    """status.progress from a parsed /status answer: the Progress fields only, None values dropped."""
    return status.model_dump(by_alias=True, mode="json", exclude_none=True, include=set(Progress.model_fields))


def progress_of(snapshot: Mapping[str, Any]) -> dict[str, Any]:
    """status.progress from a /status answer (read_status, then status_progress)."""
    return status_progress(read_status(snapshot))


def policy_served(check: Mapping[str, Any] | None, spec: LoRATrainingJobSpec) -> Cond | None:
    """PolicyServed from status.progress.servingCheck: False (a Warning event) when the last on-policy step's
    engine-vs-trainer log-prob gap exceeds the threshold (the trainer's, else spec.sync.servedLogpGapMax);
    None before any step measured one."""
    if not check or check.get("logpGapMax") is None:
        return None
    gap, threshold = float(check["logpGapMax"]), float(check.get("threshold") or spec.sync.served_logp_gap_max)
    where = f"policy version {check.get('version', '?')} (trainer step {check.get('step', '?')})"
    if check.get("adapter"):  # a multi-adapter job: the adapter's own version and step
        where = f"adapter {check['adapter']}'s version {check.get('version', '?')} (its step {check.get('step', '?')})"
    if gap > threshold:
        bad = check.get("badSteps")
        return Cond(ConditionType.POLICY_SERVED, ConditionStatus.FALSE, Reason.POLICY_NOT_SERVED,
                    f"the engines' log-probs of the sampled tokens are {gap:.3g} from the trainer's for {where}, "
                    f"above sync.servedLogpGapMax {threshold:g}" + (f" ({bad} step(s) in a row; the run stops at "
                    f"sync.servedBadStepsToFail {spec.sync.served_bad_steps_to_fail})" if bad else "")
                    + ": the engines do not serve the trained policy (adapter dropped or not loaded?)")
    return Cond(ConditionType.POLICY_SERVED, ConditionStatus.TRUE, Reason.POLICY_SERVED,
                f"the engines serve the trained policy: log-prob gap {gap:.2g} <= {threshold:g} at {where}")


def progress_conditions(progress: Mapping[str, Any], spec: LoRATrainingJobSpec,
                        synced_step: int | None = None) -> list[Cond]:
    """WeightsSynced and Checkpointed from status.progress (and the snapshot's `syncedStep`, if any)."""
    conds: list[Cond] = []
    step = int(progress.get("step") or 0)
    sync = progress.get("lastSync")
    if sync and sync.get("adapterVersion") is not None:
        version = int(sync["adapterVersion"])
        checked = max(version, synced_step) if isinstance(synced_step, int) else version
        behind = step - checked
        allowed = spec.deployment.max_staleness
        if behind > allowed:
            conds.append(Cond(ConditionType.WEIGHTS_SYNCED, ConditionStatus.FALSE, Reason.ENGINES_BEHIND,
                              f"the engines serve policy version {version} while the trainer is at step {step}: "
                              f"{behind} steps behind, more than spec.deployment.maxStaleness {allowed}"))
        else:
            how = ""
            if sync.get("bytes") is not None and sync.get("milliseconds") is not None:
                how = f"; last push {sync['bytes']} B in {float(sync['milliseconds']):.0f} ms"
            same = (f", unchanged within sync.deltaSkipThreshold up to step {checked}"
                    if checked > version else "")
            conds.append(Cond(ConditionType.WEIGHTS_SYNCED, ConditionStatus.TRUE, Reason.WEIGHTS_SYNCED,
                              f"the engines serve policy version {version}{same} (trainer step {step}, "
                              f"{sync.get('mode') or spec.lora.effective_sync_mode} mode){how}"))
    served = policy_served(progress.get("servingCheck"), spec)
    if served is not None:
        conds.append(served)
    ckpt = progress.get("lastCheckpoint")
    if ckpt and ckpt.get("path"):
        conds.append(Cond(ConditionType.CHECKPOINTED, ConditionStatus.TRUE, Reason.CHECKPOINTED,
                          f"step {ckpt.get('step', '?')} saved in {ckpt['path']}"))
    elif spec.checkpoint.path:
        conds.append(Cond(ConditionType.CHECKPOINTED, ConditionStatus.FALSE, Reason.NO_CHECKPOINT_YET,
                          f"no checkpoint yet: one every {spec.checkpoint.interval} steps, in {spec.checkpoint.path}"))
    else:
        conds.append(Cond(ConditionType.CHECKPOINTED, ConditionStatus.FALSE, Reason.CHECKPOINTS_DISABLED,
                          "spec.checkpoint.path is unset: nothing is saved, and a retry starts over"))
    return conds
