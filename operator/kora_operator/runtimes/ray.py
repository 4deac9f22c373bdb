"""Runtime Ray: the trainer as a Ray job on an existing Ray cluster (spec.runtime.address).

Nothing in Kubernetes owns a Ray job, so the operator keeps the submission's lifecycle itself:
  - one submission at a time, named `kora-<job uid>-<n>`: deterministic, so a restarted operator
    finds its submission (GET) instead of making a second one, and a lost race to POST answers
    "already exists"; status.rayJobName holds the current one;
  - a FAILED submission with restarts < backoffLimit is resubmitted as n+1 (status.restarts counts
    it; the trainer resumes from its last LoRA-only checkpoint by itself);
  - spec.suspend stops the submission; resuming submits n+1 (not a restart);
  - deleting the LoRATrainingJob stops it (handlers/jobs.py: a finalizer for runtime Ray only).
Phases: Pending while a submission waits to start (the Ray cluster already exists, so nothing is
provisioned: KubeRay's Provisioning, a RayCluster being created, has no counterpart here), then Running,
then Succeeded / Failed.

The submission carries the same trainer config as the KubeRay ConfigMap, in the environment
variable KORA_JOB_YAML, piped to `python -m kora_trainer.train --config /dev/stdin`; the
control-plane token and port also travel in the environment, and so does the NCCL environment of
the KubeRay pods (builders/ncclenv.py) less its pod-interface names. Whether the job fits the
cluster's GPUs cannot be seen from here: the trainer refuses to start when it does not.
`build_submission` and `decide` are pure: they take values and return values; `Ray` (the runtime that
handlers/reconcile.py chooses for a job) does the I/O.
"""

from __future__ import annotations

import hashlib
import re
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any
from urllib.parse import urlsplit

from kora_operator.api.job import LoRATrainingJob, RuntimeKind
from kora_operator.api.status import Phase
from kora_operator.builders.configmap import trainer_config_yaml
from kora_operator.builders.ncclenv import nccl_env
from kora_operator.conditions import Cond
from kora_operator.reasons import ConditionStatus, ConditionType, EventType, Reason
from kora_operator.runtimes.base import Advanced, Observation, Operator, Step, next_status
from kora_operator.runtimes.rayjobs import (
    FAILED,
    PENDING,
    RUNNING,
    STOPPED,
    SUCCEEDED,
    JobInfo,
    RayError,
    RayJobsClient,
    RayRejected,
    RayUnauthorized,
)
from kora_operator.settings import Settings
from kora_trainer.config.control import ControlEnv
from kora_trainer.config.ray_env import usage_stats_env
from kora_trainer.config.status import MAX_MESSAGE

PORT_KEY = "kora.dev/control-port"
JOB_KEY = "kora.dev/job"
UID_KEY = "kora.dev/uid"
RUN_DIR = ".kora/runs"  # relative to the Ray job's working directory (where the Ray head was started)
LOOPBACK = ("127.0.0.1", "localhost", "::1")


def submission_id(uid: str, n: int = 0) -> str:
    return f"kora-{uid}-{n}"


def next_submission_id(current: str) -> str:
    base, _, n = current.rpartition("-")
    return f"{base}-{int(n) + 1}" if n.isdigit() else f"{current}-1"


def control_port(sub: str, ports: tuple[int, int]) -> int:
    """The submission's control-plane port: stable for the id, spread over the range so that jobs
    sharing a Ray head rarely collide (a collision fails the trainer; its retry gets a new port)."""
    lo, hi = ports
    return lo + int(hashlib.sha256(sub.encode()).hexdigest(), 16) % (hi - lo + 1)


def ray_host(address: str) -> str:
    return urlsplit(address).hostname or "127.0.0.1"


def control_url(address: str, port: int) -> str:
    host = ray_host(address)
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def entrypoint(trainer_command: Sequence[str], sub: str) -> str:
    """`python -m kora_trainer.train --config /dev/stdin`, the config piped in from KORA_JOB_YAML."""
    return (f"printf '%s' \"$KORA_JOB_YAML\" | {shlex.join(trainer_command)} --config /dev/stdin "
            f"--run-dir {shlex.quote(f'{RUN_DIR}/{sub}')}")


def build_submission(job: LoRATrainingJob, *, sub: str, token: str, port: int,
                     trainer_command: Sequence[str], linger_s: int = 0) -> dict[str, Any]:
    """The POST /api/jobs/ body for submission `sub`. `linger_s`: how long the trainer may keep its
    control plane up after the last step, until the operator has read the final numbers."""
    meta = job.metadata
    address = str(job.spec.runtime.address)
    name, namespace = str(meta["name"]), str(meta.get("namespace", "default"))
    env = {
        # kora's NCCL defaults but the pod-interface pins (this cluster's machines name their own), under
        # spec.runtime.env; the job's GPU fit is the trainer's to check here (it sees the cluster's GPUs)
        **nccl_env(job, pod=False),
        "KORA_JOB_YAML": trainer_config_yaml(job),
        # every process of the job (driver and workers: the submission metadata reaches the driver only)
        # carries its job's name in its environment, so that it can be told apart on a shared Ray head
        # (tests/raykit.py finds a job's processes so; `ps e` shows it to a person)
        "KORA_JOB_NAME": name,
        "KORA_JOB_NAMESPACE": namespace,
        **ControlEnv(
            token=token, port=port,
            # the operator reaches the trainer at the Ray head's address: loopback stays loopback
            host="127.0.0.1" if ray_host(address) in LOOPBACK else "0.0.0.0",
            linger_s=linger_s,
        ).to_env(),
        # the job's driver and workers (the cluster's own dashboard is its operator's to configure)
        **usage_stats_env(job.spec.runtime.ray_usage_stats),
    }
    return {
        "entrypoint": entrypoint(trainer_command, sub),
        "submission_id": sub,
        "runtime_env": {"env_vars": env},
        "metadata": {JOB_KEY: f"{namespace}/{name}", UID_KEY: str(meta.get("uid", "")), PORT_KEY: str(port)},
    }


_LOG_NOISE = re.compile(r"^\d{4}-\d\d-\d\d [\d:,]+\s+(INFO|DEBUG)\s|^Running entrypoint for job ")


def _fit(head: str, tail: str, limit: int = MAX_MESSAGE) -> str:
    """head + tail within `limit` bytes, cutting the tail's beginning (its end has the error)."""
    room = limit - len(head.encode())
    raw = tail.encode()
    if len(raw) > room:
        tail = "..." + raw[len(raw) - room + 3:].decode(errors="ignore")
    return head + tail


def failure_message(info: JobInfo) -> str:
    """Ray's message ("Job entrypoint command failed with exit code 1, last available logs ...:\\n<logs>")
    as `Ray job <id> failed (exit code 1): <the trainer's last lines>`, under 1 KiB."""
    msg = info.message.strip()
    summary, sep, logs = msg.partition(", last available logs")
    if not sep:
        return _fit(f"Ray job {info.submission_id} {info.status.lower()}: ", msg)
    logs = logs.partition(":\n")[2]
    lines = [ln.rstrip() for ln in logs.splitlines() if ln.strip() and not _LOG_NOISE.match(ln)]
    code = f" (exit code {info.driver_exit_code})" if info.driver_exit_code is not None else ""
    if not lines:
        return _fit(f"Ray job {info.submission_id} failed{code}: ", summary)
    return _fit(f"Ray job {info.submission_id} failed{code}; the trainer's last output:\n", "\n".join(lines[-12:]))


class Action(StrEnum):
    NONE = "none"
    SUBMIT = "submit"  # POST the current submission id (not there yet)
    STOP = "stop"  # stop the current submission (suspend)
    RETRY = "retry"  # the current one failed: submit the next id, counting a restart
    RESUME = "resume"  # the current one was stopped by a suspend: submit the next id


@dataclass(frozen=True)
class Decision:
    action: Action
    obs: Observation


def _ready(address: str) -> Cond:
    return Cond(ConditionType.CLUSTER_READY, ConditionStatus.TRUE, Reason.CLUSTER_READY,
                f"the Ray cluster at {address} answers")


def decide(info: JobInfo | None, *, sub: str, address: str, suspend: bool, phase: str | None,
           restarts: int, backoff_limit: int) -> Decision:
    """What to do about submission `sub` (its Ray status `info`, None before it was submitted),
    and what the job's status should say."""
    ready = _ready(address)
    status = info.status if info is not None else None
    if status == SUCCEEDED:
        msg = f"the trainer finished successfully (Ray job {sub})"
        return Decision(Action.NONE, Observation(Phase.SUCCEEDED, [
            ready, Cond(ConditionType.TRAINING, ConditionStatus.FALSE, Reason.SUCCEEDED, msg),
            Cond(ConditionType.COMPLETE, ConditionStatus.TRUE, Reason.SUCCEEDED, msg)],
            terminal_time=info.end_time if info else None))
    if suspend:
        action = Action.STOP if info is not None and not info.terminal else Action.NONE
        return Decision(action, Observation(Phase.SUSPENDED, [
            Cond(ConditionType.TRAINING, ConditionStatus.FALSE, Reason.SUSPENDED,
                 f"spec.suspend is true: Ray job {sub} is stopped; set it to false to resubmit (the trainer resumes "
                 "from its last checkpoint)")]))
    was_suspended = phase == Phase.SUSPENDED
    if info is None:
        return Decision(Action.SUBMIT, Observation(Phase.PENDING, [
            ready, Cond(ConditionType.TRAINING, ConditionStatus.FALSE, Reason.TRAINER_PENDING,
                        f"submitted the trainer as Ray job {sub}; waiting for it to start")]))
    if was_suspended:
        if info.terminal:
            return Decision(Action.RESUME, Observation(Phase.PENDING, [
                ready, Cond(ConditionType.TRAINING, ConditionStatus.FALSE, Reason.RESUMING,
                            "resuming: resubmitting the trainer, which continues from its last checkpoint")]))
        return Decision(Action.STOP, Observation(Phase.SUSPENDED, [
            Cond(ConditionType.TRAINING, ConditionStatus.FALSE, Reason.RESUMING,
                 f"resuming once Ray job {sub} has stopped")]))
    if status == FAILED:
        message = failure_message(info)
        if restarts < backoff_limit:
            return Decision(Action.RETRY, Observation(Phase.PENDING, [
                ready, Cond(ConditionType.TRAINING, ConditionStatus.FALSE, Reason.RETRYING,
                            _fit(f"restart {restarts + 1} of {backoff_limit} (spec.backoffLimit): ", message))]))
        return Decision(Action.NONE, _failed(ready, Reason.TRAINER_FAILED, message, info.end_time))
    if status == STOPPED:
        return Decision(Action.NONE, _failed(ready, Reason.TRAINER_STOPPED, f"Ray job {sub} was stopped outside "
                                             "kora (`ray job stop` or the Ray dashboard)", info.end_time))
    if status == RUNNING:
        return Decision(Action.NONE, Observation(Phase.RUNNING, [
            ready, Cond(ConditionType.TRAINING, ConditionStatus.TRUE, Reason.TRAINER_RUNNING,
                        f"the trainer runs as Ray job {sub} on {address}")]))
    if status != PENDING:
        unknown = f"Ray job {sub} is in state {status!r}, which this operator does not know"
        return Decision(Action.NONE, Observation(Phase.PENDING, [
            ready, Cond(ConditionType.TRAINING, ConditionStatus.FALSE, Reason.TRAINER_PENDING, unknown)]))
    return Decision(Action.NONE, Observation(Phase.PENDING, [
        ready, Cond(ConditionType.TRAINING, ConditionStatus.FALSE, Reason.TRAINER_PENDING,
                    f"Ray job {sub} waits for the Ray cluster to start it")]))


def _failed(ready: Cond, reason: Reason, message: str, end: str | None) -> Observation:
    return Observation(Phase.FAILED, [ready, Cond(ConditionType.TRAINING, ConditionStatus.FALSE, reason, message),
                                      Cond(ConditionType.FAILED, ConditionStatus.TRUE, reason, message)],
                       terminal_time=end)


def unreachable(phase: str | None, reason: Reason, message: str) -> Observation:
    """The Ray Jobs API cannot be used right now: say so, and keep the phase (the trainer may be fine)."""
    keep = Phase(phase) if phase in set(Phase) else Phase.PENDING
    return Observation(keep, [Cond(ConditionType.CLUSTER_READY, ConditionStatus.FALSE, reason, message)])


def recorded_port(info: JobInfo | None, sub: str, ports: tuple[int, int]) -> int:
    """The control-plane port the submission was given (its metadata), else what it would be given."""
    raw: Mapping[str, str] = info.metadata if info is not None else {}
    port = raw.get(PORT_KEY, "")
    return int(port) if port.isdigit() else control_port(sub, ports)


# -- the runtime: the I/O around `decide` ----------------------------------------------------------------------


class Ray:
    kind = RuntimeKind.RAY
    stops_on_delete = True  # nothing in Kubernetes owns a Ray job: a deleted job waits until it has stopped

    def advance(self, step: Step) -> Advanced:
        """The children made (the ConfigMap with the rendered config, the Secrets; a poll leaves them alone), then
        the Ray job's submission moved along (`decide` says how), and the next status."""
        if not step.poll and not step.children.known():
            step.children.create(step.create_first)
            step.children.remember()
        return _Submission.of(step).advance()

    def trainer_url(self, ops: Operator, body: Mapping[str, Any]) -> str | None:
        sub = (body.get("status") or {}).get("rayJobName")
        address = ((body.get("spec") or {}).get("runtime") or {}).get("address")
        if not sub or not address:
            return None
        try:
            info = ops.ray_client(str(address)).get(str(sub))
        except RayError:
            info = None  # the port the submission would have been given; the trainer is likely unreachable too
        return control_url(str(address), recorded_port(info, str(sub), ops.settings.ray_control_ports))

    def polls(self, phase: str | None, settings: Settings) -> bool:
        return True  # until it ends: only polling sees its Ray job change

    def stop(self, ops: Operator, body: Mapping[str, Any]) -> tuple[str | None, JobInfo | None]:
        """Stop the deleted job's Ray job: (submission id, its state after the stop request); (None, None) when
        nothing was submitted."""
        sub = (body.get("status") or {}).get("rayJobName")
        address = ((body.get("spec") or {}).get("runtime") or {}).get("address")
        if not sub or not address:
            return None, None
        client = ops.ray_client(str(address))
        info = client.get(str(sub))
        if info is not None and not info.terminal:
            client.stop(str(sub))
            info = client.get(str(sub))
        return str(sub), info


@dataclass
class _Submission:
    """One reconcile's look at the job's current submission, and what it did about it."""

    step: Step
    address: str
    client: RayJobsClient
    sub: str
    restarts: int
    info: JobInfo | None = None
    submitted: bool = False

    @classmethod
    def of(cls, step: Step) -> _Submission:
        address = str(step.job.spec.runtime.address)
        sub = str(step.status.get("rayJobName") or submission_id(str(step.meta["uid"])))
        return cls(step, address, step.ops.ray_client(address), sub, int(step.status.get("restarts") or 0))

    def advance(self) -> Advanced:
        status = self.step.status
        try:
            obs = self._act()
        except RayRejected as e:
            obs = Observation(Phase.PENDING, [Cond(ConditionType.TRAINING, ConditionStatus.FALSE,
                                                   Reason.SUBMISSION_FAILED, str(e))])
        except RayError as e:
            reason = Reason.RAY_UNAUTHORIZED if isinstance(e, RayUnauthorized) else Reason.RAY_UNREACHABLE
            obs = unreachable(status.get("phase"), reason, str(e))
        seen = {"dashboardURL": self.address}
        if self.info is not None and self.info.start_time and not status.get("startTime"):
            seen["startTime"] = self.info.start_time
        # rayJobName names a submission that exists (the delete handler stops it), or the one being made
        known = self.info is not None or self.submitted or status.get("rayJobName") == self.sub
        new = next_status(status, obs, seen, ray_name=self.sub if known else None,
                          generation=self.step.meta.get("generation"), now=self.step.now, restarts=self.restarts)
        port = recorded_port(self.info, self.sub, self.step.ops.settings.ray_control_ports)
        return Advanced(new, control_url(self.address, port))

    def _act(self) -> Observation:
        step, job = self.step, self.step.job
        self.info = self.client.get(self.sub)
        decision = decide(self.info, sub=self.sub, address=self.address, suspend=job.spec.suspend,
                          phase=step.status.get("phase"), restarts=self.restarts,
                          backoff_limit=job.spec.backoff_limit)
        if decision.action is Action.SUBMIT:
            if step.status.get("rayJobName") != self.sub:  # named before it exists: a delete then knows what to stop
                step.ops.write_status_now(step.body, {"rayJobName": self.sub})
            self._submit()
        elif decision.action is Action.STOP:
            if self.client.stop(self.sub):
                step.ops.kube.event(step.body, EventType.NORMAL, Reason.STOPPED_RAY_JOB,
                                    f"stopped Ray job {self.sub} (spec.suspend is true)")
        elif decision.action in (Action.RETRY, Action.RESUME):
            self._resubmit(retry=decision.action is Action.RETRY)
        return decision.obs

    def _resubmit(self, retry: bool) -> None:
        step = self.step
        failed, self.sub = self.sub, next_submission_id(self.sub)
        if retry:
            self.restarts += 1
            step.ops.kube.event(step.body, EventType.WARNING, Reason.TRAINER_FAILED,
                                f"restart {self.restarts} of {step.job.spec.backoff_limit}: resubmitting as "
                                f"{self.sub}; {failure_message(self.info) if self.info else failed}")
        # the new id is written before it is submitted: an operator that dies in between finds
        # the id in the status, sees no such Ray job and submits it, never a second one
        step.ops.write_status_now(step.body, {"rayJobName": self.sub, "restarts": self.restarts})
        self.info = None
        self._submit()

    def _submit(self) -> None:
        step, settings = self.step, self.step.ops.settings
        port = control_port(self.sub, settings.ray_control_ports)
        request = build_submission(step.job, sub=self.sub, token=step.ops.tokens.for_job(str(step.meta["uid"])),
                                   port=port, trainer_command=settings.trainer_command, linger_s=settings.linger_s)
        try:
            made = self.client.submit(request)
        except RayRejected as e:
            step.ops.kube.event(step.body, EventType.WARNING, Reason.FAILED_TO_SUBMIT_RAY_JOB, str(e))
            raise
        if made:
            step.ops.kube.event(step.body, EventType.NORMAL, Reason.SUBMITTED_RAY_JOB,
                                f"submitted the trainer as Ray job {self.sub} to {self.client.address} (control "
                                f"plane on port {port})")
        self.submitted = True
