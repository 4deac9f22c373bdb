"""Every condition type, condition status, condition reason and Event reason the operator writes, in one place.

Reasons are CamelCase (metav1.Condition requires it); Event reasons reuse them, so what
`kubectl describe` lists under Events matches the Reason column of the conditions above it.
"""

from __future__ import annotations

from enum import StrEnum


class ConditionType(StrEnum):
    VALIDATED = "Validated"
    CLUSTER_READY = "ClusterReady"
    TRAINING = "Training"
    WEIGHTS_SYNCED = "WeightsSynced"
    POLICY_SERVED = "PolicyServed"
    CHECKPOINTED = "Checkpointed"
    COMPLETE = "Complete"
    FAILED = "Failed"
    REGISTERED = "Registered"  # a LoRAAdapter's: its job's trainer holds it


class ConditionStatus(StrEnum):
    """A metav1.Condition's status (api/status.py's Condition.status spells the same three for the schema)."""

    TRUE = "True"
    FALSE = "False"
    UNKNOWN = "Unknown"


class EventType(StrEnum):
    NORMAL = "Normal"
    WARNING = "Warning"


class Reason(StrEnum):
    # validation
    VALIDATED = "Validated"
    VALIDATION_FAILED = "ValidationFailed"
    SYNC_MODE_DEFAULTED = "SyncModeDefaulted"
    # children: a reconcile that makes one says Created<Kind>, one that makes several CreatedChildren (naming each)
    CREATED_CHILDREN = "CreatedChildren"
    CREATED_CONFIG_MAP = "CreatedConfigMap"
    CREATED_SECRET = "CreatedSecret"
    CREATED_RAY_JOB = "CreatedRayJob"
    CREATED_NETWORK_POLICY = "CreatedNetworkPolicy"
    UPDATED_RAY_JOB = "UpdatedRayJob"
    FAILED_TO_CREATE_CONFIG_MAP = "FailedToCreateConfigMap"
    FAILED_TO_CREATE_SECRET = "FailedToCreateSecret"
    FAILED_TO_CREATE_RAY_JOB = "FailedToCreateRayJob"
    FAILED_TO_CREATE_NETWORK_POLICY = "FailedToCreateNetworkPolicy"
    FAILED_TO_UPDATE_RAY_JOB = "FailedToUpdateRayJob"
    # the Ray cluster and the trainer, as KubeRay reports them
    RAY_JOB_PENDING = "RayJobPending"
    CLUSTER_PROVISIONING = "ClusterProvisioning"
    CLUSTER_READY = "ClusterReady"
    CLUSTER_SHUT_DOWN = "ClusterShutDown"
    RETRYING = "Retrying"
    RESUMING = "Resuming"
    SUSPENDED = "Suspended"
    TRAINER_PENDING = "TrainerPending"
    TRAINER_RUNNING = "TrainerRunning"
    SUCCEEDED = "Succeeded"
    # failures: KubeRay's RayJob reasons (rayjob_types.go JobFailedReason) mapped onto ours
    TRAINER_FAILED = "TrainerFailed"
    TRAINER_STOPPED = "TrainerStopped"
    SUBMISSION_FAILED = "SubmissionFailed"
    DEADLINE_EXCEEDED = "DeadlineExceeded"
    RAY_JOB_REJECTED = "RayJobRejected"
    CLUSTER_STUCK = "ClusterStuck"
    RAY_JOB_FAILED = "RayJobFailed"
    # runtime Ray: the submission to an existing Ray cluster
    SUBMITTED_RAY_JOB = "SubmittedRayJob"
    FAILED_TO_SUBMIT_RAY_JOB = "FailedToSubmitRayJob"
    STOPPED_RAY_JOB = "StoppedRayJob"
    RAY_UNREACHABLE = "RayUnreachable"
    RAY_UNAUTHORIZED = "RayUnauthorized"
    # progress, from the trainer's control-plane API
    WEIGHTS_SYNCED = "WeightsSynced"
    ENGINES_BEHIND = "EnginesBehind"
    POLICY_SERVED = "PolicyServed"
    POLICY_NOT_SERVED = "PolicyNotServed"  # engine vs trainer log-probs apart by more than sync.servedLogpGapMax
    CHECKPOINTED = "Checkpointed"
    NO_CHECKPOINT_YET = "NoCheckpointYet"
    CHECKPOINTS_DISABLED = "CheckpointsDisabled"
    PROGRESS_UNAVAILABLE = "ProgressUnavailable"
    # LoRAAdapters: their registration on the job's trainer (POST/DELETE /adapter_runs) and their state there
    JOB_NOT_FOUND = "JobNotFound"
    JOB_NOT_RUNNING = "JobNotRunning"
    JOB_ENDED = "JobEnded"
    TRAINER_UNREACHABLE = "TrainerUnreachable"
    NO_FREE_SLOT = "NoFreeSlot"
    REGISTERED = "Registered"
    WAITING_TO_LOAD = "WaitingToLoad"
    ADAPTER_TRAINING = "AdapterTraining"
    RETIRING = "Retiring"
    RETIRED = "Retired"
    ADAPTER_FAILED = "AdapterFailed"
    DEREGISTERED = "Deregistered"
    DEREGISTRATION_ABANDONED = "DeregistrationAbandoned"


# child kind -> the Event reasons of its creation (handlers/children.py creates every child alike)
CREATED: dict[str, Reason] = {
    "ConfigMap": Reason.CREATED_CONFIG_MAP,
    "Secret": Reason.CREATED_SECRET,
    "RayJob": Reason.CREATED_RAY_JOB,
    "NetworkPolicy": Reason.CREATED_NETWORK_POLICY,
}
FAILED_TO_CREATE: dict[str, Reason] = {
    "ConfigMap": Reason.FAILED_TO_CREATE_CONFIG_MAP,
    "Secret": Reason.FAILED_TO_CREATE_SECRET,
    "RayJob": Reason.FAILED_TO_CREATE_RAY_JOB,
    "NetworkPolicy": Reason.FAILED_TO_CREATE_NETWORK_POLICY,
}

# RayJob .status.reason -> our reason (anything else is RAY_JOB_FAILED)
KUBERAY_FAILURE_REASONS: dict[str, Reason] = {
    "AppFailed": Reason.TRAINER_FAILED,
    "SubmissionFailed": Reason.SUBMISSION_FAILED,
    "DeadlineExceeded": Reason.DEADLINE_EXCEEDED,
    "ValidationFailed": Reason.RAY_JOB_REJECTED,
    "JobDeploymentStatusTransitionGracePeriodExceeded": Reason.CLUSTER_STUCK,
}
