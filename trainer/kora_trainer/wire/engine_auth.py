"""Who may call which engine route: SGLang 0.5.23's rules (`sglang/srt/utils/auth.py` `decide_request_auth`),
shared by the trainer's client (`engine_client`, which key to send) and the reference engine (which to demand).

- Always open: `/health*`, `/ready*`, `/metrics*` (matched by prefix, as SGLang does, so probes need no
  secret), and any OPTIONS request.
- ADMIN routes (SGLang's `@auth_level(ADMIN_OPTIONAL)`: every weight, LoRA, flush, pause and abort route
  (`/abort_request` is ADMIN_OPTIONAL in http_server.py); here also
  kora's own `/load_lora_adapter_from_distributed` and `/kora/*`): the admin key when one is set, else the
  api key when one is set, else open. With both set, only the admin key opens them.
- NORMAL routes (`/generate`, `/model_info`, and any route not listed): the api key when one is set, else
  open. The admin key does not open them when an api key is set.
- The key travels as `Authorization: Bearer <key>` (scheme case-insensitive) or `x-api-key: <key>`;
  a refused request gets 401 `{"error": "Unauthorized"}`. Keys are compared in constant time.

A job's engines get a per-job admin key (`new_admin_key`) that only the trainer holds. It reaches an
engine process through the environment, not argv (`ps` shows every user a process's argv, while
/proc/PID/environ is readable only by its owner): the reference engine reads ADMIN_API_KEY_ENV /
API_KEY_ENV; SGLang reads no key from the environment, so the launcher hands it a private `--config`
YAML file instead (orchestration/sglang_launcher.py).
"""

from __future__ import annotations

import hmac
import secrets
from collections.abc import Mapping
from enum import StrEnum

ADMIN_API_KEY_ENV = "KORA_ENGINE_ADMIN_API_KEY"
API_KEY_ENV = "KORA_ENGINE_API_KEY"
KEY_ENVS = (ADMIN_API_KEY_ENV, API_KEY_ENV)
UNAUTHORIZED = {"error": "Unauthorized"}

OPEN_PREFIXES = ("/health", "/ready", "/metrics")
ADMIN_ROUTES = frozenset({
    "/init_weights_update_group", "/destroy_weights_update_group", "/update_weights_from_distributed",
    "/update_weights_from_tensor", "/update_weight_version", "/load_lora_adapter", "/load_lora_adapter_from_tensors",
    "/load_lora_adapter_from_distributed", "/unload_lora_adapter", "/flush_cache", "/pause_generation",
    "/continue_generation", "/abort_request",
})  # the routes of SGLANG_API.md §3-5 the trainer calls (SGLang marks more, e.g. /update_weights_from_disk)
KORA_PREFIX = "/kora/"  # kora's fast-sync and state routes: admin


class Level(StrEnum):
    OPEN = "open"
    NORMAL = "normal"
    ADMIN = "admin"


def new_admin_key() -> str:
    """A fresh per-job engine admin key: 256 random bits, URL-safe (fits a Bearer header and a YAML scalar)."""
    return secrets.token_urlsafe(32)


def route_level(path: str, normal: frozenset[str] = frozenset()) -> Level:
    """`normal`: routes a build serves without `@auth_level` although 0.5.23 marks them admin (Build.normal_routes:
    0.5.17's /load_lora_adapter_from_tensors), which a strict engine of that build emulates."""
    if path.startswith(OPEN_PREFIXES):
        return Level.OPEN
    if path in normal:
        return Level.NORMAL
    if path in ADMIN_ROUTES or path.startswith(KORA_PREFIX):
        return Level.ADMIN
    return Level.NORMAL


def key_for(path: str, api_key: str | None, admin_api_key: str | None) -> str | None:
    """The key a caller holding these keys sends on `path` (the one `required_key` asks for)."""
    return required_key(route_level(path), api_key, admin_api_key)


def required_key(level: Level, api_key: str | None, admin_api_key: str | None) -> str | None:
    """The one key that opens a route of `level` on a server with these keys; None: the route is open."""
    if level is Level.ADMIN:
        return admin_api_key or api_key or None
    if level is Level.NORMAL:
        return api_key or None
    return None


def _same(given: str, expected: str) -> bool:
    # bytes, not str: hmac.compare_digest raises TypeError on non-ASCII str (a header may carry any byte)
    return hmac.compare_digest(given.encode("utf-8", "surrogateescape"), expected.encode("utf-8", "surrogateescape"))


def presented_key_matches(headers: Mapping[str, str], expected: str) -> bool:
    """`Authorization: Bearer <expected>` or `x-api-key: <expected>`."""
    scheme, _, token = headers.get("Authorization", "").partition(" ")
    if scheme.lower() == "bearer" and token and _same(token, expected):
        return True
    x_api_key = headers.get("x-api-key")
    return bool(x_api_key) and _same(str(x_api_key), expected)


def allowed(method: str, path: str, headers: Mapping[str, str], api_key: str | None,
            admin_api_key: str | None, normal: frozenset[str] = frozenset()) -> bool:
    """SGLang's decision for one request (`normal`: see route_level)."""
    if method == "OPTIONS":
        return True
    expected = required_key(route_level(path, normal), api_key, admin_api_key)
    return expected is None or presented_key_matches(headers, expected)
