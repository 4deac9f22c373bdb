"""Control-plane tokens: derived, never stored by the operator, never read back from Secrets.

Each job's bearer token is HMAC-SHA256(operator key, job uid). The operator can compute it again at
any time (after a restart, for every poll) from one secret of its own, so its account needs no right
to read the per-job Secrets (the trainer's pod mounts those; runtime Ray gets the token in the
submission's environment). A token names its job: the HMAC of one uid says nothing about another's.

The operator key comes from, in order: $KORA_OPERATOR_KEY; the file --key-file (made, mode 0600,
when missing); the Secret --key-secret NAMESPACE/NAME (made when missing; the chart lets the
operator read that one Secret by name and no other); in a pod without either, the Secret
`kora-operator-key` in the pod's namespace; outside a cluster, the file
$XDG_STATE_HOME/kora/operator-key (~/.local/state/kora/operator-key). Rotating the key changes every
job's token: running trainers keep the old one, so their progress goes unread until they restart.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import logging
import os
import secrets
import tempfile
from pathlib import Path
from typing import Protocol

from kora_operator.settings import DEFAULT_KEY_SECRET, Settings

log = logging.getLogger("kora.tokens")

KEY_ENV = "KORA_OPERATOR_KEY"
SECRET_KEY = "key"  # the data key inside the operator-key Secret
SA_NAMESPACE_FILE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")
MIN_KEY_LEN = 16


def derive_token(key: bytes, uid: str) -> str:
    """The job's control-plane token: 256 bits, URL-safe (fits an `Authorization: Bearer` header)."""
    mac = hmac.new(key, f"kora.dev/control-token/v1/{uid}".encode(), hashlib.sha256).digest()
    return base64.urlsafe_b64encode(mac).rstrip(b"=").decode()


def new_key() -> str:
    return secrets.token_urlsafe(32)


class Tokens:
    """The operator key, and the tokens derived from it."""

    def __init__(self, key: str, source: str) -> None:
        key = key.strip()
        if len(key) < MIN_KEY_LEN:
            raise ValueError(f"the operator key from {source} is shorter than {MIN_KEY_LEN} characters")
        self._key = key.encode()
        self.source = source

    def for_job(self, uid: str) -> str:
        return derive_token(self._key, uid)


class SecretStore(Protocol):
    def read_secret(self, ns: str, name: str, key: str) -> str | None: ...
    def create_secret(self, ns: str, name: str, data: dict[str, str]) -> bool: ...


def _file_key(path: Path) -> str:
    """Read the key file; make it first (atomically, 0600) if it does not exist."""
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".operator-key-")
        try:
            with os.fdopen(fd, "w") as fh:
                fh.write(new_key() + "\n")
            try:
                os.link(tmp, path)  # fails if another operator made it meanwhile: then read theirs
                log.info("made a new operator key in %s", path)
            except FileExistsError:
                pass
        finally:
            os.unlink(tmp)
    return path.read_text()


def _secret_key(store: SecretStore, ns: str, name: str) -> str:
    value = store.read_secret(ns, name, SECRET_KEY)
    if value is None:
        if store.create_secret(ns, name, {SECRET_KEY: new_key()}):
            log.info("made the operator key Secret %s/%s", ns, name)
        value = store.read_secret(ns, name, SECRET_KEY)  # ours, or the one a racing operator made
    if value is None:
        raise RuntimeError(f"the operator key Secret {ns}/{name} has no data key {SECRET_KEY!r}")
    return value


def state_dir() -> Path:
    return Path(os.environ.get("XDG_STATE_HOME") or Path.home() / ".local/state") / "kora"


def load_tokens(settings: Settings, store: SecretStore, env: dict[str, str] | None = None) -> Tokens:
    env = dict(os.environ) if env is None else env
    if env.get(KEY_ENV):
        return Tokens(env[KEY_ENV], f"${KEY_ENV}")
    if settings.key_file:
        return Tokens(_file_key(Path(settings.key_file)), settings.key_file)
    secret = settings.key_secret
    if secret is None and SA_NAMESPACE_FILE.exists():
        secret = f"{SA_NAMESPACE_FILE.read_text().strip()}/{DEFAULT_KEY_SECRET}"
    if secret is not None:
        ns, sep, name = secret.partition("/")
        if not sep or not ns or not name:
            raise ValueError(f"--key-secret {secret!r}: write NAMESPACE/NAME")
        return Tokens(_secret_key(store, ns, name), f"Secret {ns}/{name}")
    path = state_dir() / "operator-key"
    return Tokens(_file_key(path), str(path))
