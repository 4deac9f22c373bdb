"""Control-plane tokens: derived from the operator key and the job's uid, the key found in one place."""

from __future__ import annotations

import os
import threading

import pytest

from kora_operator.settings import Settings
from kora_operator.tokens import Tokens, derive_token, load_tokens


class FakeSecrets:
    """The two Secret calls tokens.py makes, over a dict (the API server's part is tested in the
    integration tests)."""

    def __init__(self):
        self.data: dict[tuple[str, str], dict[str, str]] = {}
        self.created = 0

    def read_secret(self, ns, name, key):
        return self.data.get((ns, name), {}).get(key)

    def create_secret(self, ns, name, data):
        if (ns, name) in self.data:
            return False
        self.data[(ns, name)] = dict(data)
        self.created += 1
        return True


def test_tokens_are_per_job_stable_and_keyed():
    a, b = Tokens("k" * 32, "test"), Tokens("q" * 32, "test")
    assert a.for_job("uid-1") == a.for_job("uid-1") == derive_token(b"k" * 32, "uid-1")
    assert a.for_job("uid-1") != a.for_job("uid-2") and a.for_job("uid-1") != b.for_job("uid-1")
    assert len(a.for_job("u")) == 43 and "=" not in a.for_job("u")  # 256 bits, URL-safe, no padding


def test_a_short_key_is_refused():
    with pytest.raises(ValueError, match="shorter"):
        Tokens("short", "test")


def test_the_env_key_comes_first(tmp_path):
    t = load_tokens(Settings(key_file=str(tmp_path / "k")), FakeSecrets(), env={"KORA_OPERATOR_KEY": "e" * 20})
    assert t.source == "$KORA_OPERATOR_KEY" and not (tmp_path / "k").exists()


def test_a_key_file_is_made_once_private_and_then_reused(tmp_path):
    path = tmp_path / "state" / "operator-key"
    first = load_tokens(Settings(key_file=str(path)), FakeSecrets(), env={})
    assert path.exists() and (os.stat(path).st_mode & 0o777) == 0o600
    again = load_tokens(Settings(key_file=str(path)), FakeSecrets(), env={})
    assert first.for_job("u") == again.for_job("u")
    assert [p.name for p in path.parent.iterdir()] == ["operator-key"]  # no temp files left


def test_racing_operators_agree_on_one_key_file(tmp_path):
    path = tmp_path / "operator-key"
    got: list[str] = []
    threads = [threading.Thread(target=lambda: got.append(
        load_tokens(Settings(key_file=str(path)), FakeSecrets(), env={}).for_job("u"))) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(got)) == 1


def test_the_key_secret_is_made_when_missing_and_read_after(tmp_path):
    store = FakeSecrets()
    first = load_tokens(Settings(key_secret="kora-system/kora-key"), store, env={})
    assert store.created == 1 and first.source == "Secret kora-system/kora-key"
    again = load_tokens(Settings(key_secret="kora-system/kora-key"), store, env={})
    assert store.created == 1 and again.for_job("u") == first.for_job("u")
    with pytest.raises(ValueError, match="NAMESPACE/NAME"):
        load_tokens(Settings(key_secret="just-a-name"), store, env={})


def test_outside_a_cluster_the_default_is_a_file_in_the_state_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path))
    t = load_tokens(Settings(), FakeSecrets(), env={})
    assert t.source == str(tmp_path / "kora" / "operator-key")
