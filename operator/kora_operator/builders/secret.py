"""The per-job Secret holding the bearer token of the trainer's control-plane API (port 8068).

The token is an input, not made here: the operator derives it from its key and the job's uid
(tokens.py), so the builder stays pure, a restarted operator never rotates a live job's token, and
the operator can compute it again to poll the trainer without reading the Secret back.
"""

from __future__ import annotations

import secrets
from typing import Any

from kora_operator.api.job import LoRATrainingJob
from kora_operator.builders.meta import object_meta
from kora_operator.builders.names import secret_name

TOKEN_KEY = "token"
# What `kora render` prints instead of a token unless asked to generate one (see cli.render).
TOKEN_PLACEHOLDER = "<generated-by-the-operator-at-create-time>"


def new_token() -> str:
    """256 random bits, URL-safe: fits an `Authorization: Bearer` header as is."""
    return secrets.token_urlsafe(32)


def build_secret(job: LoRATrainingJob, token: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": object_meta(job, secret_name(str(job.metadata["name"])), "control-token"),
        "type": "Opaque",
        "stringData": {TOKEN_KEY: token},
    }
