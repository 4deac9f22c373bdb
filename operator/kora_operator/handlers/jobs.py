"""kopf handlers: LoRATrainingJob create/resume/update/delete, and changes of the RayJobs we own.

Every handler calls the same level-based reconcile (handlers/reconcile.py); none sleeps.
"""

from __future__ import annotations

import logging
from typing import Any

import kopf

from kora_operator.api.job import GROUP, VERSION
from kora_operator.builders.meta import JOB_LABEL, MANAGED_BY
from kora_operator.handlers.reconcile import forget, reconcile
from kora_operator.kube import Kube

JOBS = (GROUP, VERSION, "loratrainingjobs")
log = logging.getLogger("kora.handlers")


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    # kopf's bookkeeping goes to annotations: the status belongs to the API (and to us), and
    # status.kopf would be pruned by the structural schema anyway
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=GROUP, key="last-handled-configuration")
    # we post our own Events, one per transition; kopf's log-lines-as-events would double them
    settings.posting.enabled = False
    settings.execution.max_workers = 16
    # no watching of Namespaces and CRDs: the account needs no cluster-wide read rights, at the
    # price that CRDs (ours, KubeRay's) installed after the operator started need a restart
    settings.scanning.disabled = True
    memo.kube = Kube()


@kopf.on.resume(*JOBS)
@kopf.on.create(*JOBS)
def job_created(namespace: str | None, name: str, memo: Any, reason: str, **_: Any) -> None:
    reconcile(memo.kube, str(namespace), name, trigger=reason)


@kopf.on.update(*JOBS, field="spec")
def job_updated(namespace: str | None, name: str, memo: Any, **_: Any) -> None:
    reconcile(memo.kube, str(namespace), name, trigger="update")


# optional: no finalizer. Children carry ownerReferences, so the garbage collector removes them
# even when the operator is down; a finalizer would only make deletes hang on us.
@kopf.on.delete(*JOBS, optional=True)
def job_deleted(namespace: str | None, name: str, **_: Any) -> None:
    forget(str(namespace), name)
    log.info("%s/%s deleted; the garbage collector removes its children", namespace, name)


@kopf.on.event("ray.io", "v1", "rayjobs", labels={"app.kubernetes.io/managed-by": MANAGED_BY})
def ray_job_changed(body: kopf.Body, namespace: str | None, memo: Any, **_: Any) -> None:
    owners = [o for o in body.metadata.get("ownerReferences", []) if o.get("kind") == "LoRATrainingJob"]
    job = owners[0]["name"] if owners else body.metadata.labels.get(JOB_LABEL)
    if job:
        reconcile(memo.kube, str(namespace), str(job), trigger="rayjob")
