"""Where kopf keeps its own bookkeeping for our objects: nowhere on the objects while all goes well.

kopf's defaults write two things onto every object it handles, each one more write of the whole object (the
CRD's schema and CEL rules run again, every watcher gets one more event) and one more wait for that write to
come back through the watch before kopf handles the object's next event:

- its diff base, the last handled spec, labels and annotations, from which it tells create from update from
  resume and computes `on.update`'s diff. `HandledSpecs` keeps it in memory instead. After a restart, when the
  memory is empty, the status stands in for it: every reconcile writes `status.observedGeneration`, so an
  object whose status has observed its current generation was handled as it is (kopf resumes it), one whose
  status observed an older generation has an unhandled spec change (kopf calls its update handlers), and one
  without any was never handled (kopf calls its create handlers).
- a marker annotation (`<prefix>/kopf-managed`) that it adds with the first progress record. A handler that
  succeeds at once leaves no progress record (kopf adds it and purges it in the same patch), so without the
  marker the patch is empty and kopf sends none. A handler that fails still gets its record in an annotation:
  kopf's retry counts and delays live there, and its own patch wakes the retry.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Iterable
from typing import Any, cast

import kopf

# the spec a status of an older generation stands for: it differs from every real spec, so kopf sees a spec
# change and calls the update handlers (they reconcile the object as it is; none reads the old spec)
UNHANDLED_SPEC = "kora.dev/unhandled-generation"


class HandledSpecs(kopf.DiffBaseStorage):
    """kopf's diff base per object uid, in memory; read from the status the first time an object is seen."""

    def __init__(self) -> None:
        super().__init__()
        self._essences: dict[str, kopf.BodyEssence | None] = {}
        self._lock = threading.Lock()

    def build(self, *, body: kopf.Body, extra_fields: Iterable[Any] | None = None) -> kopf.BodyEssence:
        """kopf's essence, built from only the parts of the body that go into it. kopf's own `build` deep-copies
        the whole body, managedFields and status included, and then drops them: on every watch event of every
        job (most of kopf's CPU per event in a burst). The essence is the same: the spec and other top-level
        stanzas, labels and annotations, and the extra fields handlers name (`on.update(field=...)`)."""
        fields = list(extra_fields or ())
        roots = {f.split(".", 1)[0] if isinstance(f, str) else f[0] for f in fields}
        slim = {k: v for k, v in body.items() if k not in ("metadata", "status") or k in roots}
        if "metadata" not in roots:
            meta = body.get("metadata") or {}
            slim["metadata"] = {k: meta[k] for k in ("labels", "annotations") if k in meta}
        return super().build(body=kopf.Body(cast(kopf.RawBody, slim)), extra_fields=fields)

    def fetch(self, *, body: kopf.Body) -> kopf.BodyEssence | None:
        uid = str(body.metadata.uid)
        with self._lock:
            if uid in self._essences:
                return self._essences[uid]
        # kept, None included: a create that failed after writing the status is still a create when retried
        base = self._from_status(body)
        with self._lock:
            return self._essences.setdefault(uid, base)

    def store(self, *, body: kopf.Body, patch: kopf.Patch, essence: kopf.BodyEssence) -> None:
        with self._lock:
            self._essences[str(body.metadata.uid)] = copy.deepcopy(essence)

    def forget(self, uid: str) -> None:
        """The object is gone (its DELETED event)."""
        with self._lock:
            self._essences.pop(uid, None)

    def __len__(self) -> int:
        with self._lock:
            return len(self._essences)

    def _from_status(self, body: kopf.Body) -> kopf.BodyEssence | None:
        observed = (body.get("status") or {}).get("observedGeneration")
        if observed is None:
            return None
        essence = cast(dict[str, Any], self.build(body=body))
        if observed != body.metadata.get("generation"):
            essence["spec"] = {UNHANDLED_SPEC: observed}
        return cast(kopf.BodyEssence, essence)


class UnmarkedProgress(kopf.AnnotationsProgressStorage):
    """kopf's progress records in annotations, without the marker annotation that only names the prefix (kopf
    reads it to leave other operators' annotations out of an object's essence; `clear` already leaves ours
    out, by prefix)."""

    def _store_marker(self, prefix: str, patch: kopf.Patch, body: kopf.Body) -> None:
        return None
