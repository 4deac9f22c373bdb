"""The few Kubernetes API calls the operator makes, over the official client (sync; kopf runs sync
handlers in its thread pool). Nothing here decides anything; handlers/reconcile.py does."""

from __future__ import annotations

import base64
import json
import os
import socket
from collections.abc import Mapping
from typing import Any, cast
from urllib.parse import quote

from kubernetes import client
from kubernetes import config as _config
from kubernetes.client.exceptions import ApiException

from kora_operator.api.job import GROUP, VERSION
from kora_operator.conditions import truncate
from kora_operator.events import EventPoster
from kora_trainer.config.status import rfc3339

JOB_PLURAL = "loratrainingjobs"
ADAPTER_PLURAL = "loraadapters"
RAY_GROUP, RAY_VERSION, RAY_PLURAL = "ray.io", "v1", "rayjobs"
# where each kind of child is created (POST), by namespace
CHILD_COLLECTIONS = {
    "ConfigMap": "/api/v1/namespaces/{ns}/configmaps",
    "Secret": "/api/v1/namespaces/{ns}/secrets",
    "NetworkPolicy": "/apis/networking.k8s.io/v1/namespaces/{ns}/networkpolicies",
    "RayJob": f"/apis/{RAY_GROUP}/{RAY_VERSION}/namespaces/{{ns}}/{RAY_PLURAL}",
}
COMPONENT = "kora-operator"

Obj = dict[str, Any]

__all__ = ["ApiException", "Kube", "now_rfc3339"]


def now_rfc3339() -> str:
    return rfc3339()


# The client's generated signatures want its V1* model classes; we hand it plain dicts (the
# builders' output), which it serialises just the same. So its objects are typed Any here.
config: Any = _config


def _load_config() -> Any:
    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config()
    cfg = client.Configuration.get_default_copy()
    # kopf runs up to max_workers handlers at once; one pooled connection each avoids
    # urllib3's "connection pool is full" churn
    cfg.connection_pool_maxsize = 64
    return cfg


class Kube:
    def __init__(self, api_client: Any = None) -> None:
        self.api: Any = api_client or client.ApiClient(_load_config())
        self.core: Any = client.CoreV1Api(self.api)
        self.custom: Any = client.CustomObjectsApi(self.api)
        self.networking: Any = client.NetworkingV1Api(self.api)
        self.instance = os.environ.get("POD_NAME") or socket.gethostname()
        # None: event() posts each Event itself, before it returns (the CLI's one-shot reconcile, tests)
        self.poster: EventPoster | None = None

    # -- reads: None when absent
    def get_job(self, ns: str, name: str) -> Obj | None:
        return self._absent_is_none(lambda: self.custom.get_namespaced_custom_object(
            GROUP, VERSION, ns, JOB_PLURAL, name))

    def get_adapter(self, ns: str, name: str) -> Obj | None:
        return self._absent_is_none(lambda: self.custom.get_namespaced_custom_object(
            GROUP, VERSION, ns, ADAPTER_PLURAL, name))

    def list_adapters(self, ns: str) -> list[Obj]:
        got = self.custom.list_namespaced_custom_object(GROUP, VERSION, ns, ADAPTER_PLURAL)
        return list(got.get("items") or [])

    def get_ray_job(self, ns: str, name: str) -> Obj | None:
        return self._absent_is_none(lambda: self.custom.get_namespaced_custom_object(
            RAY_GROUP, RAY_VERSION, ns, RAY_PLURAL, name))

    def get_child(self, obj: Mapping[str, Any]) -> Obj | None:
        ns, name = obj["metadata"]["namespace"], obj["metadata"]["name"]
        kind = obj["kind"]
        if kind == "ConfigMap":
            return self._absent_is_none(lambda: self.api.sanitize_for_serialization(
                self.core.read_namespaced_config_map(name, ns)))
        if kind == "RayJob":
            return self.get_ray_job(ns, name)
        if kind == "NetworkPolicy":
            return self._absent_is_none(lambda: self.api.sanitize_for_serialization(
                self.networking.read_namespaced_network_policy(name, ns)))
        raise ValueError(f"unknown child kind {kind}")

    def read_secret(self, ns: str, name: str, key: str) -> str | None:
        """One value of one Secret (the operator key's; RBAC grants `get` on that name only)."""
        got = self._absent_is_none(lambda: self.api.sanitize_for_serialization(
            self.core.read_namespaced_secret(name, ns)))
        if got is None:
            return None
        raw = (got.get("data") or {}).get(key)
        return base64.b64decode(raw).decode() if raw is not None else None

    def create_secret(self, ns: str, name: str, data: Mapping[str, str]) -> bool:
        """Create an Opaque Secret; False if it exists already."""
        body = {"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
                "metadata": {"name": name, "namespace": ns, "labels": {"app.kubernetes.io/part-of": "kora"}},
                "stringData": dict(data)}
        try:
            self.core.create_namespaced_secret(ns, body)
        except ApiException as e:
            if e.status == 409:
                return False
            raise
        return True

    @staticmethod
    def _absent_is_none(call: Any) -> Obj | None:
        try:
            return cast(Obj, call())
        except ApiException as e:
            if e.status == 404:
                return None
            raise

    # -- writes
    def create_child(self, obj: Mapping[str, Any]) -> Obj | None:
        """Create `obj`; None if it exists already (someone, maybe our former self, made it). The RayJob as
        made; {} for the other kinds, whose answer is dropped unread: only whether they were made matters (the
        Secrets' values are never held longer than needed)."""
        ns, kind = obj["metadata"]["namespace"], obj["kind"]
        collection = CHILD_COLLECTIONS.get(kind)
        if collection is None:
            raise ValueError(f"unknown child kind {kind}")
        try:
            made = self._send("POST", collection.format(ns=quote(ns, safe="")), obj)
        except ApiException as e:
            if e.status == 409:
                return None
            raise
        return cast(Obj, json.loads(made)) if kind == "RayJob" else {}

    def patch_ray_job(self, ns: str, name: str, patch: Mapping[str, Any]) -> None:
        self.custom.patch_namespaced_custom_object(RAY_GROUP, RAY_VERSION, ns, RAY_PLURAL, name, patch)

    def patch_job_status(self, ns: str, name: str, status: Mapping[str, Any]) -> None:
        """A merge patch of the /status subresource (the main resource ignores status)."""
        self._send("PATCH", f"/apis/{GROUP}/{VERSION}/namespaces/{quote(ns, safe='')}/{JOB_PLURAL}/"
                   f"{quote(name, safe='')}/status", {"status": status}, "application/merge-patch+json")

    def patch_adapter(self, ns: str, name: str, patch: Mapping[str, Any]) -> Obj:
        """A merge patch of a LoRAAdapter (its metadata: ownerReferences, finalizers). Give
        metadata.resourceVersion in it to make it fail (409) if the object changed since it was read."""
        return cast(Obj, self.custom.patch_namespaced_custom_object(GROUP, VERSION, ns, ADAPTER_PLURAL, name, patch))

    def patch_adapter_status(self, ns: str, name: str, status: Mapping[str, Any]) -> None:
        self.custom.patch_namespaced_custom_object_status(GROUP, VERSION, ns, ADAPTER_PLURAL, name,
                                                          {"status": status})

    def event(self, job: Mapping[str, Any], type_: str, reason: str, message: str) -> None:
        """A core/v1 Event on the job or adapter `job` (what `kubectl describe` lists), stamped now; posted by
        `poster` when there is one (events.py: behind the reconciles, in order), else here."""
        meta = job["metadata"]
        now = now_rfc3339()
        body = {
            "metadata": {"generateName": f"{meta['name']}.", "namespace": meta["namespace"]},
            "involvedObject": {
                "apiVersion": job.get("apiVersion", f"{GROUP}/{VERSION}"), "kind": job.get("kind", "LoRATrainingJob"),
                "name": meta["name"], "namespace": meta["namespace"], "uid": meta.get("uid"),
                "resourceVersion": meta.get("resourceVersion"),
            },
            "type": type_, "reason": reason, "message": truncate(message),
            "source": {"component": COMPONENT},
            "reportingComponent": COMPONENT, "reportingInstance": self.instance,
            "firstTimestamp": now, "lastTimestamp": now, "count": 1,
        }
        if self.poster is not None:
            self.poster.put(meta["namespace"], body)
        else:
            self.post_event(meta["namespace"], body)

    def post_event(self, ns: str, body: Mapping[str, Any]) -> None:
        self._send("POST", f"/api/v1/namespaces/{quote(ns, safe='')}/events", body)

    def _send(self, method: str, path: str, body: Any, content_type: str = "application/json") -> bytes:
        """One write as the client's generated methods make it (the same connection pool, headers and credentials,
        a refreshed token included), without their per-call work: a pydantic check of every argument and a
        recursive copy of the body, which were a good part of the operator's CPU per job in a burst
        (bench/operator_scale.py). Returns the answer's bytes; an error answer raises ApiException, as they do."""
        headers = {**self.api.default_headers, "Content-Type": content_type, "Accept": "application/json"}
        if self.api.cookie:
            headers["Cookie"] = self.api.cookie
        self.api.update_params_for_auth(headers, [], ["BearerToken"], path, method, body)
        answer = self.api.call_api(method, self.api.configuration.host + path, headers, body)
        try:
            data: bytes = answer.read()
        finally:
            answer.response.release_conn()
        if not 200 <= answer.status <= 299:
            raise ApiException.from_response(http_resp=answer, body=data.decode(errors="replace"), data=None)
        return data
