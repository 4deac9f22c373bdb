"""handlers/kopf_state.py: kopf's diff base in memory, read back from the status after a restart."""

from __future__ import annotations

import kopf

from kora_operator.handlers.kopf_state import HandledSpecs


def body(generation: int, observed: int | None = None, uid: str = "uid-a") -> kopf.Body:
    raw = {"apiVersion": "kora.dev/v1alpha1", "kind": "LoRATrainingJob",
           "metadata": {"name": "j", "namespace": "ns", "uid": uid, "generation": generation, "labels": {"a": "b"}},
           "spec": {"suspend": generation > 1}}
    if observed is not None:
        raw["status"] = {"phase": "Pending", "observedGeneration": observed}
    return kopf.Body(raw)


def test_a_job_never_reconciled_is_new_and_stays_new_until_handled():
    handled = HandledSpecs()
    assert handled.fetch(body=body(1)) is None  # kopf: a create
    # the status a failed create wrote does not turn its retry into a resume
    assert handled.fetch(body=body(1, observed=1)) is None
    handled.store(body=body(1, observed=1), patch=kopf.Patch(), essence=handled.build(body=body(1, observed=1)))
    assert handled.fetch(body=body(1, observed=1)) == handled.build(body=body(1, observed=1))


def test_after_a_restart_the_status_says_what_was_handled():
    current = body(2, observed=2)
    assert HandledSpecs().fetch(body=current) == HandledSpecs().build(body=current)  # kopf: a resume
    stale = body(2, observed=1)
    base = HandledSpecs().fetch(body=stale)
    assert base is not None and base["spec"] != stale["spec"]  # kopf: an update of the spec
    assert base["metadata"] == HandledSpecs().build(body=stale)["metadata"]


def test_a_deleted_object_is_forgotten():
    handled = HandledSpecs()
    handled.fetch(body=body(1))
    assert len(handled) == 1
    handled.forget("uid-a")
    assert len(handled) == 0


def test_the_essence_is_kopfs_own_built_from_less():
    # kopf's build copies the whole body (managedFields, status) and drops what it does not keep; ours copies only
    # what it keeps: the same essence, with or without the extra fields a handler names
    raw = {"apiVersion": "kora.dev/v1alpha1", "kind": "LoRATrainingJob",
           "metadata": {"name": "j", "namespace": "ns", "uid": "u", "generation": 3, "resourceVersion": "7",
                        "labels": {"a": "b"}, "managedFields": [{"manager": "kubectl", "fieldsV1": {"f:spec": {}}}],
                        "annotations": {"note": "x", "kubectl.kubernetes.io/last-applied-configuration": "{}",
                                        "kora.dev/kopf-managed": "yes", "kora.dev/job_created": "{}"}},
           "spec": {"suspend": True, "lora": {"rank": 8}}, "status": {"phase": "Pending", "observedGeneration": 3}}
    for extra in (None, [("spec",)], ["spec.lora"], [("status", "phase")], [("metadata", "generation")], []):
        ours = HandledSpecs().build(body=kopf.Body(raw), extra_fields=extra)
        assert ours == kopf.DiffBaseStorage.build(HandledSpecs(), body=kopf.Body(raw), extra_fields=extra), extra
    mine = HandledSpecs().build(body=kopf.Body(raw))
    mine["spec"]["lora"]["rank"] = 16
    assert raw["spec"]["lora"]["rank"] == 8  # a copy
