"""handlers/memory.py: the hints that save a reconcile API calls go stale as they should."""

from __future__ import annotations

from kora_operator.handlers.memory import AdapterIndex, KnownChildren


def test_known_children_expire_after_the_recheck_time_and_can_be_forgotten():
    now = [100.0]
    known = KnownChildren(recheck_s=30.0, clock=lambda: now[0])
    assert not known.known("uid-a")
    known.remember("uid-a")
    now[0] += 29.9
    assert known.known("uid-a") and not known.known("uid-b")
    now[0] += 0.2  # past the recheck time: the next reconcile checks every child again
    assert not known.known("uid-a")
    known.remember("uid-a")
    known.forget("uid-a")  # e.g. its RayJob was deleted
    assert not known.known("uid-a")


def test_the_adapter_index_follows_adds_and_deletes_per_namespace_and_job():
    index = AdapterIndex()
    index.seen("ns", "b", "job")
    index.seen("ns", "a", "job")
    index.seen("ns", "a", "job")  # a MODIFIED event of the same adapter
    index.seen("other", "c", "job")
    assert index.of_job("ns", "job") == ["a", "b"] and index.of_job("other", "job") == ["c"]
    index.seen("ns", "b", "job", gone=True)
    index.seen("other", "c", "job", gone=True)
    assert index.of_job("ns", "job") == ["a"] and index.of_job("other", "job") == []
    assert index.of_job("ns", "nobody") == []


def test_the_rayjob_version_a_status_was_derived_from_is_known_until_forgotten():
    known = KnownChildren(recheck_s=30.0)
    assert not known.derived_from("uid-a", "7")
    known.derived("uid-a", "7")
    assert known.derived_from("uid-a", "7")  # the echo of the create: nothing new to reconcile
    assert not known.derived_from("uid-a", "8") and not known.derived_from("uid-a", None)
    assert not known.derived_from("uid-b", "7")
    known.forget("uid-a")  # its RayJob was deleted
    assert not known.derived_from("uid-a", "7")


def test_a_job_first_seen_through_its_rayjob_is_known_and_one_already_known_keeps_its_time():
    now = [100.0]
    known = KnownChildren(recheck_s=30.0, clock=lambda: now[0])
    known.remember_if_new("uid-a")  # after a restart: its RayJob exists, so its other children were made
    assert known.known("uid-a") and not known.derived_any("uid-a")
    now[0] += 20
    known.remember_if_new("uid-a")  # a later RayJob event does not put off the recheck
    now[0] += 10.1
    assert not known.known("uid-a")
    known.derived("uid-a", "7")
    assert known.derived_any("uid-a")
