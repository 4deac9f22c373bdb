"""The reference engine in one SGLang build's strict mode (`--sglang-build NAME`): that build's routes and
fields only, kora's extensions off, so a test against it fails where the real build would.

What the build is comes from config/sglang_builds.py (the one table). In strict mode:
- a route the build does not have is FastAPI's 404 `{"detail": "Not Found"}` (the route is not registered;
  /kora/* and the fast paths included);
- request keys the build's structs do not have are dropped before parsing, as SGLang ignores unknown keys:
  kora's EngineMerge fields (a lora_A/lora_B push then loads them as weights and fails, as it would there), kora's
  byte ranges and bucket fields (the adapter route takes the whole adapter in one call, one broadcast per tensor),
  sglang-miles' `prefix: false` on a stock build;
- `/abort_request` with `prefix: true` on a build without it (a stock one) is a 400 naming the build: the real
  build ignores the key and matches the rid exactly, which for a prefix like `<adapter>::` aborts nothing, silently;
  refused here so a test catches a sender relying on it (the exact-rid abort is served as SGLang serves it);
- responses carry the build's keys only: no `checksum` and no `weight_version` on the weight and LoRA routes, no
  `kora_engine` in /model_info; /generate reports the server's weight version (per-adapter versions are kora's);
- sglang-miles' `/load_lora_adapter_from_distributed` refuses a name already loaded unless `upsert` is true
  (IO:2048's `upsert=False` default, `validate_new_adapter`'s message).
"""

from __future__ import annotations

from typing import Any

from kora_trainer.config.sections import SGLangBuild
from kora_trainer.config.sglang_builds import BUILDS, Build

# keys kora's reference engine adds to the weight and LoRA routes' answers (server.py's module docstring lists
# them); /model_info's own `weight_version` is SGLang's and stays, its `kora_engine` goes
KORA_RESPONSE_KEYS = frozenset({"checksum", "weight_version"})
KORA_MODEL_INFO_KEYS = frozenset({"kora_engine"})
BUILD_NAMES = [b.value for b in SGLangBuild]


def build_named(name: str | None) -> Build | None:
    return BUILDS[SGLangBuild(name)] if name is not None else None


def request_body(build: Build | None, path: str, body: Any) -> Any:
    """The body as the build's struct sees it: keys it does not have dropped (SGLang ignores unknown keys)."""
    if build is None or not isinstance(body, dict):
        return body
    dropped = build.dropped_fields(path)
    return {k: v for k, v in body.items() if k not in dropped} if dropped else body


def abort_refusal(build: Build | None, body: Any) -> str | None:
    """Why the build's strict engine refuses this /abort_request body (see the module docstring), or None."""
    if build is None or build.abort_prefix or not isinstance(body, dict) or body.get("prefix") is not True:
        return None
    return (f"sglang {build.name.value} has no AbortReq.prefix (sglang-miles #30912): its /abort_request matches one "
            f"rid exactly, so {body.get('rid')!r} as a prefix would abort nothing (the real build ignores the key); "
            "abort each request by its own rid")


def response_body(build: Build | None, body: dict[str, Any], keys: frozenset[str] = KORA_RESPONSE_KEYS
                  ) -> dict[str, Any]:
    """A route's answer without kora's `keys` (the build's own response shape)."""
    if build is None:
        return body
    return {k: v for k, v in body.items() if k not in keys}
