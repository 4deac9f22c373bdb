"""metav1.Condition helpers over plain dicts (the JSON the status subresource holds).

lastTransitionTime moves only when a condition's status flips, as in apimachinery's
meta.SetStatusCondition: a new reason or message alone is an update, not a transition.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kora_operator.reasons import ConditionStatus, ConditionType, EventType, Reason
from kora_trainer.config.status import MAX_MESSAGE

Conditions = list[dict[str, Any]]


def truncate(message: str, limit: int = MAX_MESSAGE) -> str:
    if len(message.encode()) <= limit:
        return message
    cut = message.encode()[: limit - 3].decode(errors="ignore")
    return cut + "..."


@dataclass(frozen=True)
class Cond:
    """A condition to set: the parts the operator decides (the times come from set_condition)."""

    type: ConditionType
    status: ConditionStatus
    reason: Reason
    message: str = ""


def get_condition(conditions: Sequence[Mapping[str, Any]], type_: str) -> Mapping[str, Any] | None:
    return next((c for c in conditions if c.get("type") == type_), None)


def set_condition(conditions: Sequence[Mapping[str, Any]], cond: Cond, generation: int | None, now: str) -> Conditions:
    """A new list with `cond` set; the others untouched and in place (new types go last)."""
    new: dict[str, Any] = {
        "type": str(cond.type),
        "status": str(cond.status),
        "observedGeneration": generation,
        "lastTransitionTime": now,
        "reason": str(cond.reason),
        "message": truncate(cond.message),
    }
    if generation is None:
        del new["observedGeneration"]
    out: Conditions = []
    found = False
    for c in conditions:
        if c.get("type") == cond.type:
            found = True
            if c.get("status") == cond.status and c.get("lastTransitionTime"):
                new["lastTransitionTime"] = c["lastTransitionTime"]
            out.append(new)
        else:
            out.append(dict(c))
    if not found:
        out.append(new)
    return out


def set_conditions(
    conditions: Sequence[Mapping[str, Any]], conds: Sequence[Cond], generation: int | None, now: str
) -> Conditions:
    out: Conditions = [dict(c) for c in conditions]
    for cond in conds:
        out = set_condition(out, cond, generation, now)
    return out


# A condition turning True (False for Validated, WeightsSynced, PolicyServed) in these types is bad news: a
# Warning event. A stale policy on the engines is one.
_BAD_WHEN_TRUE = {ConditionType.FAILED}
_BAD_WHEN_FALSE = {ConditionType.VALIDATED, ConditionType.WEIGHTS_SYNCED, ConditionType.POLICY_SERVED}
# and these reasons are bad news whatever the condition (a Ray cluster the operator cannot use, an adapter
# its job has no room for)
_BAD_REASONS = {Reason.RAY_UNREACHABLE, Reason.RAY_UNAUTHORIZED, Reason.SUBMISSION_FAILED, Reason.NO_FREE_SLOT}


@dataclass(frozen=True)
class Transition:
    """One Event to post: a condition whose status or reason changed."""

    type: EventType
    reason: str
    message: str


def transitions(old: Sequence[Mapping[str, Any]], new: Sequence[Mapping[str, Any]]) -> list[Transition]:
    out: list[Transition] = []
    for c in new:
        before = get_condition(old, str(c["type"]))
        if before is not None and (before.get("status"), before.get("reason")) == (c["status"], c["reason"]):
            continue
        bad = (c["type"] in _BAD_WHEN_TRUE and c["status"] == ConditionStatus.TRUE) or (
            c["type"] in _BAD_WHEN_FALSE and c["status"] == ConditionStatus.FALSE) or c["reason"] in _BAD_REASONS
        message = c.get("message") or f"{c['type']} is {c['status']}"
        out.append(Transition(EventType.WARNING if bad else EventType.NORMAL, str(c["reason"]), truncate(message)))
    # one Event per piece of news: two conditions changing for the same reason with the same
    # message (Training=False and Failed=True on a crash) post once, as a Warning if either is bad
    out.sort(key=lambda t: t.type != EventType.WARNING)
    seen: set[tuple[str, str]] = set()
    unique = []
    for t in out:
        if (t.reason, t.message) not in seen:
            seen.add((t.reason, t.message))
            unique.append(t)
    return unique
