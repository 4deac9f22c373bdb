"""The operator's settings: one class, read from environment variables and from `kora operator` flags."""

from __future__ import annotations

import argparse

import pytest

from kora_cli.main import build_parser
from kora_operator.operator_main import own_identity
from kora_operator.settings import Settings, add_flags, env_name, from_flags


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kora operator")
    add_flags(p)
    return p


def test_every_setting_keeps_its_flag_and_its_variable():
    flags = {a.option_strings[0] for a in parser()._actions if a.dest in Settings.model_fields}
    assert flags == {"--poll-interval", "--http-timeout", "--children-recheck", "--trainer-command",
                     "--ray-control-ports", "--key-file", "--key-secret", "--kuberay-progress", "--network-policy",
                     "--operator-namespace", "--operator-pod-labels", "--kuberay-operator-namespace",
                     "--kuberay-operator-pod-labels"}
    assert {env_name(n) for n in Settings.model_fields} == {
        "KORA_POLL_INTERVAL", "KORA_HTTP_TIMEOUT", "KORA_CHILDREN_RECHECK", "KORA_TRAINER_COMMAND",
        "KORA_RAY_CONTROL_PORTS", "KORA_OPERATOR_KEY_FILE", "KORA_OPERATOR_KEY_SECRET", "KORA_KUBERAY_PROGRESS",
        "KORA_NETWORK_POLICY", "POD_NAMESPACE", "KORA_OPERATOR_POD_LABELS", "KORA_KUBERAY_OPERATOR_NAMESPACE",
        "KORA_KUBERAY_OPERATOR_POD_LABELS"}
    text = " ".join(parser().format_help().split())
    assert "(default $KORA_POLL_INTERVAL or 5)" in text and "$KORA_RAY_CONTROL_PORTS or 8068-8167" in text
    assert "$KORA_NETWORK_POLICY or True" in text and "--no-network-policy" in text
    assert "app.kubernetes.io/name=kuberay-operator" in text


def test_flags_over_environment_variables_over_defaults():
    args = parser().parse_args(["--poll-interval", "2", "--key-secret=ns/key", "--trainer-command", "/opt/py -m t"])
    env = {"KORA_POLL_INTERVAL": "7", "KORA_HTTP_TIMEOUT": "9", "KORA_RAY_CONTROL_PORTS": "9000-9009",
           "KORA_OPERATOR_KEY_FILE": ""}  # empty: unset
    s = from_flags(args, env)
    assert (s.poll_interval, s.http_timeout, s.key_secret, s.key_file) == (2.0, 9.0, "ns/key", None)
    assert s.trainer_command == ("/opt/py", "-m", "t") and s.ray_control_ports == (9000, 9009)
    assert from_flags(parser().parse_args([]), {}) == Settings(kuberay_progress=False)
    assert from_flags(parser().parse_args(["--no-kuberay-progress"]), {"KUBERNETES_SERVICE_HOST": "10.0.0.1"}) == \
        Settings(kuberay_progress=False)
    assert not Settings.from_env({"KORA_KUBERAY_PROGRESS": "on"}).kuberay_progress  # 1, true or yes only


def test_a_settings_value_reads_no_environment(monkeypatch):
    monkeypatch.setenv("KORA_POLL_INTERVAL", "7")
    assert Settings(kuberay_progress=False).poll_interval == 5.0
    assert Settings.from_env(kuberay_progress=False).poll_interval == 7.0


@pytest.mark.parametrize(("flag", "why"), [("--ray-control-ports=9-1", "port range"),
                                           ("--poll-interval=soon", "valid number")])
def test_a_bad_flag_is_a_usage_error(flag, why, capsys):
    with pytest.raises(SystemExit) as e:
        parser().parse_args([flag])
    assert e.value.code == 2 and why in capsys.readouterr().err


def test_kora_operator_takes_the_settings_flags_beside_its_own():
    args = build_parser().parse_args(["operator", "-n", "team-a", "--liveness", "", "--metrics-port", "0",
                                      "--poll-interval=10", "--ray-control-ports", "8068", "-v"])
    assert (args.namespace, args.liveness, args.metrics_port, args.verbose) == (["team-a"], "", 0, True)
    s = from_flags(args, {})
    assert s.poll_interval == 10.0 and s.ray_control_ports == (8068, 8068) and s.linger_s == 30


def test_the_operator_names_itself_by_its_pod_not_by_a_passwd_lookup():
    """kopf's default identity calls getpass.getuser(), a KeyError in the operator image (uid 65532, no passwd
    entry): the real node's crash loop (issue 41). The chart's POD_NAME (or kopf's POD_ID) names it instead."""
    assert own_identity({"POD_NAME": "kora-6cc5-x"}) == "kora-6cc5-x"
    assert own_identity({"POD_ID": "a", "POD_NAME": "b"}) == "a"
    assert own_identity({}) is None  # outside a pod: kopf's user@host
