"""The `/adapter_runs` routes (config/adapter_runs.py documents them) over an AdapterRegistry: what the control
plane calls for any request under /adapter_runs, after it has checked the bearer token."""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from kora_trainer.adapter_runs.registry import AdapterRegistry, RegistryError, validation_message
from kora_trainer.config.adapter_runs import AdapterRunRequest
from kora_trainer.wire.strict_json import BodyError, loads_body

PREFIX = "/adapter_runs"
SHAPE = '{"name": ..., "config": {...}}'


class AdapterRunsAPI:
    prefix = PREFIX

    def __init__(self, registry: AdapterRegistry):
        self.registry = registry

    def handle(self, method: str, path: str, body: bytes) -> tuple[int, Any]:
        """(HTTP status, JSON-ready answer). Bad requests are 4xx with the field and the fix, never 5xx."""
        rest = path.split("?")[0][len(PREFIX):].strip("/")
        try:
            if method == "POST" and not rest:
                return 201, self._dump(self.registry.register(*self._request(body)))
            if method == "GET" and not rest:
                return 200, self._dump(self.registry.listing())
            if method == "GET" and rest == "state":
                return 200, self._dump(self.registry.state())
            if method == "GET" and "/" not in rest:
                return 200, self._dump(self.registry.get(rest))
            if method == "DELETE" and rest and rest != "state" and "/" not in rest:
                code, state = self.registry.deregister(rest)
                return code, self._dump(state)
        except RegistryError as e:
            return e.status, {"error": e.message}
        routes = "POST/GET /adapter_runs, GET /adapter_runs/state, GET/DELETE /adapter_runs/{name}"
        return (405 if not rest or rest == "state" else 404), {"error": f"no route {method} {path}: {routes}"}

    @staticmethod
    def _request(body: bytes) -> tuple[str, Any]:
        try:
            raw = loads_body(body or b"null")
        except BodyError as e:
            raise RegistryError(400, f"the body is not JSON: {e}; the body is {SHAPE}") from None
        try:
            req = AdapterRunRequest.model_validate(raw)
        except ValidationError as e:
            raise RegistryError(400, f"bad adapter run: {validation_message(e)}") from e
        return req.name, req.config

    @staticmethod
    def _dump(model: Any) -> Any:
        return model.model_dump(by_alias=True, mode="json")
