"""`kora operator`: run the kopf operator in-process (what `kopf run -m kora_operator.handlers`
does), against the current kubeconfig or the in-cluster service account."""

from __future__ import annotations

import argparse
import logging
import shlex
from dataclasses import replace
from typing import Any

from kora_operator.settings import (
    DEFAULT_KEY_SECRET,
    DEFAULT_POLL_INTERVAL,
    DEFAULT_RAY_CONTROL_PORTS,
    DEFAULT_TRAINER_COMMAND,
    Settings,
    parse_port_range,
)

DEFAULT_LIVENESS = "http://0.0.0.0:8080/healthz"


def run(args: argparse.Namespace) -> int:
    # imported here so `kora validate/render` never pay for (or need) kopf and the k8s client
    import kopf

    import kora_operator.handlers  # noqa: F401  (registers the handlers)
    from kora_operator import metrics

    settings = _settings(args)
    kopf.configure(verbose=args.verbose, log_format=kopf.LogFormat.PLAIN)
    logging.getLogger("kubernetes").setLevel(logging.WARNING)
    metrics.serve(args.metrics_port, args.metrics_address)
    namespaces = args.namespace or []
    kopf.run(
        clusterwide=not namespaces,
        namespaces=namespaces,
        standalone=True,  # one replica (the chart's Deployment uses Recreate): no peering objects
        liveness_endpoint=args.liveness or None,
        memo=kopf.Memo(settings=settings),
    )
    return 0


def _settings(args: argparse.Namespace) -> Settings:
    """Flags over environment variables over defaults."""
    s = Settings.from_env()
    if args.poll_interval is not None:
        s = replace(s, poll_interval=args.poll_interval)
    if args.trainer_command is not None:
        s = replace(s, trainer_command=tuple(shlex.split(args.trainer_command)))
    if args.ray_control_ports is not None:
        s = replace(s, ray_control_ports=parse_port_range(args.ray_control_ports))
    if args.key_file is not None:
        s = replace(s, key_file=args.key_file)
    if args.key_secret is not None:
        s = replace(s, key_secret=args.key_secret)
    return s


def register(sub: Any) -> None:
    lo, hi = DEFAULT_RAY_CONTROL_PORTS
    p = sub.add_parser("operator", help="run the kora operator (kopf) against the current cluster")
    p.add_argument("-n", "--namespace", action="append", metavar="NS",
                   help="watch only this namespace (repeatable; globs like team-* work); default: all namespaces")
    p.add_argument("--liveness", default=DEFAULT_LIVENESS, metavar="URL",
                   help=f"kopf's liveness endpoint (default {DEFAULT_LIVENESS}; empty turns it off)")
    p.add_argument("--metrics-port", type=int, default=9090, help="Prometheus /metrics port (0: off)")
    p.add_argument("--metrics-address", default="0.0.0.0", help="address /metrics binds to")
    p.add_argument("--poll-interval", type=float, metavar="SECONDS",
                   help=f"how often running jobs are polled: the trainer's progress, and the Ray Jobs API for "
                        f"runtime Ray (default $KORA_POLL_INTERVAL or {DEFAULT_POLL_INTERVAL:g})")
    p.add_argument("--trainer-command", metavar="CMD",
                   help="runtime Ray: the command that starts the trainer on the Ray cluster, --config and "
                        f"--run-dir appended (default $KORA_TRAINER_COMMAND or '{DEFAULT_TRAINER_COMMAND}')")
    p.add_argument("--ray-control-ports", metavar="LOW-HIGH",
                   help="runtime Ray: ports the trainers' control planes may use on the Ray head, one per "
                        f"submission (default $KORA_RAY_CONTROL_PORTS or {lo}-{hi})")
    p.add_argument("--key-file", metavar="PATH",
                   help="file with the operator key that control-plane tokens are derived from (made if missing; "
                        "default $KORA_OPERATOR_KEY_FILE)")
    p.add_argument("--key-secret", metavar="NAMESPACE/NAME",
                   help="Secret with the operator key (made if missing; default $KORA_OPERATOR_KEY_SECRET; in a pod: "
                        f"{DEFAULT_KEY_SECRET} in the pod's namespace; elsewhere the file "
                        "~/.local/state/kora/operator-key)")
    p.add_argument("-v", "--verbose", action="store_true", help="log every handler call")
    p.set_defaults(func=run)
