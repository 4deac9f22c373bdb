"""kopf handlers: LoRAAdapter create/resume, and the watch events that show one deleted.

They call handlers/adapter_sync.py, whose level-based sync also runs after every reconcile of the adapter's job
(the last step of handlers/reconcile.py: each poll of a running multi-adapter job mirrors its trainer's state into
its adapters). No update handler: an adapter's spec is immutable (the CRD says so; the trainer cannot change a
registered one).
"""

from __future__ import annotations

from typing import Any

import kopf

from kora_operator.api.job import GROUP, VERSION
from kora_operator.handlers.adapter_sync import FINALIZER, adapter_deleting, reconcile_adapter

ADAPTERS = (GROUP, VERSION, "loraadapters")


@kopf.on.event(*ADAPTERS)
def adapter_seen(type: str | None, namespace: str | None, name: str, spec: kopf.Spec, memo: Any,
                 uid: str | None, **_: Any) -> None:
    handled = getattr(memo, "handled", None)  # kopf's diff bases (handlers/kopf_state.py)
    if type == "DELETED" and handled is not None and uid:
        handled.forget(uid)
    # every event, the first listing's included: which adapters name which job (handlers/memory.AdapterIndex)
    index = getattr(getattr(memo, "ctx", None), "adapters", None)
    if index is not None and spec.get("jobName"):
        index.seen(str(namespace), name, str(spec["jobName"]), gone=type == "DELETED")


@kopf.on.resume(*ADAPTERS)
@kopf.on.create(*ADAPTERS)
def adapter_created(namespace: str | None, name: str, memo: Any, **_: Any) -> None:
    reconcile_adapter(memo.ctx, str(namespace), name)


def _deleting_and_ours(body: kopf.Body, **_: Any) -> bool:
    return bool(body.metadata.get("deletionTimestamp")) and FINALIZER in (body.metadata.get("finalizers") or [])


# not kopf.on.delete: kopf runs delete handlers only for objects that its own finalizer holds, and puts that one
# on every object a non-optional delete handler serves. Ours (adapter_sync.FINALIZER) is on an adapter only while
# its job's trainer holds it; a watch event shows the delete (and, after an operator restart, the first listing
# shows the deletes it missed), the deletion poll loop retries until the trainer has retired it.
@kopf.on.event(*ADAPTERS, when=_deleting_and_ours)
def adapter_deleted(namespace: str | None, name: str, memo: Any, **_: Any) -> None:
    adapter_deleting(memo.ctx, str(namespace), name)
