"""The operator's own settings (not the jobs'): one pydantic-settings class, read from environment
variables (so that `kopf run -m kora_operator.handlers` can set them) and, for `kora operator`, from flags
generated from the same fields (`add_flags` / `from_flags`). Each field's docstring is its --help text, its
validation alias its environment variable, its default the default of both: flags over environment
variables over defaults.

`Settings(...)` is a plain value (tests build one so); only `from_env` reads an environment.
"""

from __future__ import annotations

import argparse
import math
import os
import shlex
from collections.abc import Mapping
from typing import Annotated, Any

from pydantic import BeforeValidator, Field, ValidationError
from pydantic_settings import BaseSettings, EnvSettingsSource, NoDecode, PydanticBaseSettingsSource, SettingsConfigDict

from kora_operator.builders.networkpolicy import KUBERAY_OPERATOR_LABELS, Peers
from kora_trainer.config.control import CONTROL_PORT

DEFAULT_POLL_INTERVAL = 5.0
# a child a user deletes is re-made within this long (a RayJob at once): few checks in a burst, quick repair
DEFAULT_CHILDREN_RECHECK = 30.0
DEFAULT_TRAINER_COMMAND = "python -m kora_trainer.train"
# Runtime Ray: trainers of different jobs may share one Ray head, so each submission gets its own
# control-plane port from this range (picked from the submission id, recorded in its metadata).
DEFAULT_RAY_CONTROL_PORTS = (CONTROL_PORT, CONTROL_PORT + 99)
DEFAULT_KEY_SECRET = "kora-operator-key"
MAX_LINGER_S = 300
IN_A_POD = "KUBERNETES_SERVICE_HOST"  # set in every pod's environment


def parse_port_range(text: str) -> tuple[int, int]:
    """`8068` or `8068-8167` -> (low, high)."""
    low, sep, high = text.strip().partition("-")
    try:
        lo, hi = int(low), int(high) if sep else int(low)
    except ValueError:
        raise ValueError(f"port range {text!r}: write PORT or LOW-HIGH, e.g. 8068-8167") from None
    if not 0 < lo <= hi < 65536:
        raise ValueError(f"port range {text!r}: need 0 < LOW <= HIGH < 65536")
    return lo, hi


def parse_labels(text: str) -> dict[str, str]:
    """`k=v,k2=v2` -> {k: v, k2: v2} (an empty text: no labels)."""
    out: dict[str, str] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"labels {text!r}: write KEY=VALUE[,KEY=VALUE...], e.g. app.kubernetes.io/name=kora")
        out[key.strip()] = value.strip()
    return out


def _labels(value: Any) -> Any:
    return parse_labels(value) if isinstance(value, str) else value


def _command(value: Any) -> Any:
    return tuple(shlex.split(value)) if isinstance(value, str) else value


def _port_range(value: Any) -> Any:
    return parse_port_range(value) if isinstance(value, str) else value


def _yes(value: Any) -> Any:
    # as the operator has always read it: 1, true or yes (any case) is on, anything else off
    return value.strip().lower() in ("1", "true", "yes") if isinstance(value, str) else value


# text (an environment variable, a flag) is parsed here, never as JSON (NoDecode)
Command = Annotated[tuple[str, ...], NoDecode, BeforeValidator(_command)]
PortRange = Annotated[tuple[int, int], NoDecode, BeforeValidator(_port_range)]
YesNo = Annotated[bool, BeforeValidator(_yes)]
Labels = Annotated[dict[str, str], NoDecode, BeforeValidator(_labels)]


class Settings(BaseSettings):
    """How the operator polls, submits and derives tokens; the same for every job it serves."""

    model_config = SettingsConfigDict(
        case_sensitive=True, env_ignore_empty=True, populate_by_name=True, frozen=True, extra="forbid",
        use_attribute_docstrings=True,
    )

    poll_interval: float = Field(DEFAULT_POLL_INTERVAL, validation_alias="KORA_POLL_INTERVAL",
                                 json_schema_extra={"metavar": "SECONDS"})
    """How often running jobs are polled: the trainer's progress, and the Ray Jobs API for runtime Ray."""
    http_timeout: float = Field(3.0, validation_alias="KORA_HTTP_TIMEOUT", json_schema_extra={"metavar": "SECONDS"})
    """Timeout of one HTTP call to a trainer or a Ray Jobs API (the poll loop never waits longer)."""
    children_recheck: float = Field(DEFAULT_CHILDREN_RECHECK, validation_alias="KORA_CHILDREN_RECHECK",
                                    json_schema_extra={"metavar": "SECONDS"})
    """How long a job's children, once all seen, are taken to exist: a reconcile within that time reads only the
    RayJob (a deleted RayJob is re-made at once, from its watch event; a ConfigMap, Secret or NetworkPolicy
    a user deleted, at the first reconcile after that time). 0: check every child on every reconcile."""
    trainer_command: Command = Field(tuple(shlex.split(DEFAULT_TRAINER_COMMAND)),
                                     validation_alias="KORA_TRAINER_COMMAND", json_schema_extra={"metavar": "CMD"})
    """Runtime Ray: the command that starts the trainer on the Ray cluster, --config and --run-dir appended
    (e.g. `/opt/venv/bin/python -m kora_trainer.train` when `python` is not kora's)."""
    ray_control_ports: PortRange = Field(DEFAULT_RAY_CONTROL_PORTS, validation_alias="KORA_RAY_CONTROL_PORTS",
                                         json_schema_extra={"metavar": "LOW-HIGH"})
    """Runtime Ray: ports the trainers' control planes may use on the Ray head, one per submission."""
    key_file: str | None = Field(None, validation_alias="KORA_OPERATOR_KEY_FILE", json_schema_extra={"metavar": "PATH"})
    """File with the operator key that control-plane tokens are derived from (made if missing)."""
    key_secret: str | None = Field(
        None, validation_alias="KORA_OPERATOR_KEY_SECRET", json_schema_extra={"metavar": "NAMESPACE/NAME"},
        description=f"Secret with the operator key (made if missing). Unset: in a pod, {DEFAULT_KEY_SECRET} in the "
                    "pod's namespace; elsewhere the file ~/.local/state/kora/operator-key.")
    kuberay_progress: YesNo = Field(default_factory=lambda: bool(os.environ.get(IN_A_POD)),
                                    validation_alias="KORA_KUBERAY_PROGRESS")
    """Poll KubeRay jobs' trainers (at their head service's cluster DNS name). Default: when running in a
    pod, since outside a cluster those names do not resolve (and the lookups would leave the host)."""

    network_policy: YesNo = Field(True, validation_alias="KORA_NETWORK_POLICY")
    """Give each KubeRay job a NetworkPolicy (builders/networkpolicy.py): only its own pods reach its pods, the
    operator's pods its control-plane port, KubeRay's operator its dashboard port; nothing else reaches them."""
    operator_namespace: str | None = Field(None, validation_alias="POD_NAMESPACE",
                                           json_schema_extra={"metavar": "NAMESPACE"})
    """The namespace of the operator's own pod (the chart sets it from the downward API): with
    --operator-pod-labels, whom a job's NetworkPolicy lets reach the control-plane port. Unset (not in a pod):
    only the job's own pods reach it."""
    operator_pod_labels: Labels = Field(default_factory=dict, validation_alias="KORA_OPERATOR_POD_LABELS",
                                        json_schema_extra={"metavar": "K=V,..."})
    """The labels of the operator's own pods (the chart: its selector labels)."""
    kuberay_operator_namespace: str | None = Field(None, validation_alias="KORA_KUBERAY_OPERATOR_NAMESPACE",
                                                   json_schema_extra={"metavar": "NAMESPACE"})
    """The namespace of KubeRay's operator, which a job's NetworkPolicy lets reach the Ray dashboard port (its
    RayJob controller reads the Ray job there). Unset: any namespace."""
    kuberay_operator_pod_labels: Labels = Field(
        default_factory=lambda: dict(KUBERAY_OPERATOR_LABELS), validation_alias="KORA_KUBERAY_OPERATOR_POD_LABELS",
        json_schema_extra={"metavar": "K=V,..."},
        description="The labels of KubeRay's operator pods (default: those of KubeRay's Helm chart, "
                    + ",".join(f"{k}={v}" for k, v in KUBERAY_OPERATOR_LABELS.items()) + ").")

    def network_peers(self) -> Peers | None:
        """Who outside a job may reach its pods; None: the operator makes no NetworkPolicy."""
        if not self.network_policy:
            return None
        return Peers(self.operator_namespace, dict(self.operator_pod_labels), self.kuberay_operator_namespace,
                     dict(self.kuberay_operator_pod_labels))

    @property
    def linger_s(self) -> int:
        """What the operator asks trainers to wait, at most, for its last poll (KORA_CONTROL_LINGER_S):
        three poll intervals, at least 10 s, at most 5 minutes (a trainer whose operator is gone then
        still ends in bounded time)."""
        return min(MAX_LINGER_S, max(10, math.ceil(3 * self.poll_interval)))

    @classmethod
    def settings_customise_sources(
        cls, settings_cls: type[BaseSettings], init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource, dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        return (init_settings,)  # the keyword arguments only: from_env adds an environment

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **flags: Any) -> Settings:
        """`flags` (by field name) over the environment `env` (default: this process's) over the defaults."""
        env = os.environ if env is None else env
        values = {**_Environment(cls, env)(), **{env_name(name): value for name, value in flags.items()}}
        values.setdefault(env_name("kuberay_progress"), bool(env.get(IN_A_POD)))
        return cls(**values)


class _Environment(EnvSettingsSource):
    """pydantic-settings' environment source over a given mapping instead of os.environ."""

    def __init__(self, settings_cls: type[BaseSettings], env: Mapping[str, str]) -> None:
        self._given = env  # read by _load_env_vars, which the base __init__ calls
        super().__init__(settings_cls)

    def _load_env_vars(self) -> Mapping[str, str | None]:
        return {k: v for k, v in self._given.items() if not (self.env_ignore_empty and v == "")}


def env_name(field: str) -> str:
    """The environment variable of a Settings field."""
    return str(Settings.model_fields[field].validation_alias)


def _flag_value(field: str) -> Any:
    """argparse `type` for a field's flag: the text validated as the environment variable would be."""

    def parse(text: str) -> Any:
        try:
            return getattr(Settings.model_validate({env_name(field): text}), field)
        except ValidationError as e:
            raise argparse.ArgumentTypeError(e.errors()[0]["msg"]) from None

    parse.__name__ = field  # argparse names it in its "invalid ... value" message
    return parse


def _shown(value: Any) -> str:
    if isinstance(value, dict):
        return ",".join(f"{k}={v}" for k, v in value.items())
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, tuple) and all(isinstance(v, int) for v in value):
        return "-".join(map(str, value))
    return f"'{shlex.join(value)}'" if isinstance(value, tuple) else str(value)


def add_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per Settings field (--poll-interval for poll_interval); unset flags leave the field to the
    environment and the defaults (from_flags)."""
    for name, field in Settings.model_fields.items():
        default = "" if field.default is None or field.default_factory else f" or {_shown(field.default)}"
        text = " ".join((field.description or "").split()).rstrip(".")
        help_ = f"{text} (default ${env_name(name)}{default})"
        flag = "--" + name.replace("_", "-")
        if field.annotation is bool:
            parser.add_argument(flag, dest=name, action=argparse.BooleanOptionalAction, default=None, help=help_)
            continue
        extra = field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}
        parser.add_argument(flag, dest=name, type=_flag_value(name), metavar=str(extra.get("metavar", "VALUE")),
                            default=None, help=help_)


def from_flags(args: argparse.Namespace, env: Mapping[str, str] | None = None) -> Settings:
    """Flags over environment variables over defaults."""
    given = {name: getattr(args, name) for name in Settings.model_fields if getattr(args, name, None) is not None}
    return Settings.from_env(env, **given)
