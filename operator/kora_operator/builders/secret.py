"""The per-job Secrets: the bearer token of the trainer's control-plane API (port 8068), and the engines'
admin key.

The token is an input, not made here: the operator derives it from its key and the job's uid
(tokens.py), so the builder stays pure, a restarted operator never rotates a live job's token, and
the operator can compute it again to poll the trainer without reading the Secret back.
"""

from __future__ import annotations

import secrets
from typing import Any

from kora_operator.api.job import LoRATrainingJob
from kora_operator.builders.meta import object_meta
from kora_operator.builders.names import engine_key_secret_name, secret_name

TOKEN_KEY = "token"
# What `kora render` prints instead of a token unless asked to generate one (see cli.render).
TOKEN_PLACEHOLDER = "<generated-by-the-operator-at-create-time>"


def new_token() -> str:
    """256 random bits, URL-safe: fits an `Authorization: Bearer` header as is."""
    return secrets.token_urlsafe(32)


def _opaque(job: LoRATrainingJob, name: str, component: str, data: dict[str, str]) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Secret", "metadata": object_meta(job, name, component), "type": "Opaque",
            "stringData": data}


def build_secret(job: LoRATrainingJob, token: str) -> dict[str, Any]:
    return _opaque(job, secret_name(str(job.metadata["name"])), "control-token", {TOKEN_KEY: token})


# The engines' admin key (SPEC "Security"): the trainer's ranks send it on every weight and LoRA route, each
# engine demands it (`--admin-api-key`). Unlike the token it is random, not derived: the operator never needs
# it, so it makes one when it creates the Secret and never again (create answers 409 once the Secret exists,
# and the key in it stays). The RayJob's pods read it by secretKeyRef into ENGINE_ADMIN_KEY_ENV.
ENGINE_KEY_KEY = "key"
# = kora_trainer.wire.engine_auth.ADMIN_API_KEY_ENV, which the trainer and the reference engine read; the
# operator may import only kora_trainer.config, so the name is repeated here (tests/unit/test_builders.py
# checks that the two agree)
ENGINE_ADMIN_KEY_ENV = "KORA_ENGINE_ADMIN_API_KEY"
ENGINE_KEY_PLACEHOLDER = "<random-made-by-the-operator-at-create-time>"


def build_engine_key_secret(job: LoRATrainingJob, key: str) -> dict[str, Any]:
    """The per-job Secret of the engines' admin key; `key` is made by the caller (`new_token`), so this stays pure."""
    return _opaque(job, engine_key_secret_name(str(job.metadata["name"])), "engine-admin-key", {ENGINE_KEY_KEY: key})
