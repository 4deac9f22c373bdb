"""The operator's own settings (not the jobs'): `kora operator` flags, each with an environment
variable of the same meaning so that `kopf run -m kora_operator.handlers` can set them too."""

from __future__ import annotations

import math
import os
import shlex
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from kora_trainer.config.control import CONTROL_PORT

DEFAULT_POLL_INTERVAL = 5.0
DEFAULT_TRAINER_COMMAND = "python -m kora_trainer.train"
# Runtime Ray: trainers of different jobs may share one Ray head, so each submission gets its own
# control-plane port from this range (picked from the submission id, recorded in its metadata).
DEFAULT_RAY_CONTROL_PORTS = (CONTROL_PORT, CONTROL_PORT + 99)
DEFAULT_KEY_SECRET = "kora-operator-key"
MAX_LINGER_S = 300


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


@dataclass(frozen=True)
class Settings:
    poll_interval: float = DEFAULT_POLL_INTERVAL
    """Seconds between polls of running jobs (the trainer's /status; the Ray Jobs API for runtime Ray)."""
    http_timeout: float = 3.0
    """Timeout of one HTTP call to a trainer or a Ray Jobs API (the poll loop never waits longer)."""
    trainer_command: tuple[str, ...] = tuple(shlex.split(DEFAULT_TRAINER_COMMAND))
    """Runtime Ray: the command that starts the trainer on the Ray cluster (`--config` and `--run-dir`
    are appended), e.g. `/opt/venv/bin/python -m kora_trainer.train` when `python` is not kora's."""
    ray_control_ports: tuple[int, int] = DEFAULT_RAY_CONTROL_PORTS
    """Runtime Ray: the range the trainer's control-plane port is picked from."""
    key_file: str | None = None
    """File holding the operator key (control-plane tokens are derived from it)."""
    key_secret: str | None = None
    """NAMESPACE/NAME of the Secret holding the operator key (created when missing)."""
    kuberay_progress: bool = field(default_factory=lambda: bool(os.environ.get("KUBERNETES_SERVICE_HOST")))
    """Poll KubeRay jobs' trainers (at their head service's cluster DNS name). Default: when running in
    a pod, since outside a cluster those names do not resolve (and the lookups would leave the host)."""

    @property
    def linger_s(self) -> int:
        """What the operator asks trainers to wait, at most, for its last poll (KORA_CONTROL_LINGER_S):
        three poll intervals, at least 10 s, at most 5 minutes (a trainer whose operator is gone then
        still ends in bounded time)."""
        return min(MAX_LINGER_S, max(10, math.ceil(3 * self.poll_interval)))

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Settings:
        env = os.environ if env is None else env
        s = cls(kuberay_progress=bool(env.get("KUBERNETES_SERVICE_HOST")))
        if env.get("KORA_POLL_INTERVAL"):
            s = replace(s, poll_interval=float(env["KORA_POLL_INTERVAL"]))
        if env.get("KORA_HTTP_TIMEOUT"):
            s = replace(s, http_timeout=float(env["KORA_HTTP_TIMEOUT"]))
        if env.get("KORA_TRAINER_COMMAND"):
            s = replace(s, trainer_command=tuple(shlex.split(env["KORA_TRAINER_COMMAND"])))
        if env.get("KORA_RAY_CONTROL_PORTS"):
            s = replace(s, ray_control_ports=parse_port_range(env["KORA_RAY_CONTROL_PORTS"]))
        if env.get("KORA_OPERATOR_KEY_FILE"):
            s = replace(s, key_file=env["KORA_OPERATOR_KEY_FILE"])
        if env.get("KORA_OPERATOR_KEY_SECRET"):
            s = replace(s, key_secret=env["KORA_OPERATOR_KEY_SECRET"])
        if env.get("KORA_KUBERAY_PROGRESS"):
            s = replace(s, kuberay_progress=env["KORA_KUBERAY_PROGRESS"].lower() in ("1", "true", "yes"))
        return s
