"""`kora operator`: run the kopf operator in-process (what `kopf run -m kora_operator.handlers`
does), against the current kubeconfig or the in-cluster service account."""

from __future__ import annotations

import argparse
import logging
import os
from collections.abc import Mapping
from typing import Any

from kora_operator.settings import add_flags, from_flags

DEFAULT_LIVENESS = "http://0.0.0.0:8080/healthz"


def own_identity(environ: Mapping[str, str] = os.environ) -> str | None:
    """kopf's identity for this operator: the pod's name where it runs in one (the chart sets POD_NAME; kopf itself
    reads only POD_ID), else None (kopf's own user@host). kopf's fallback asks getpass.getuser(), which raises
    KeyError in a pod whose uid has no /etc/passwd entry: the operator image runs as 65532 and has none (found on
    the real node, issue 41)."""
    return environ.get("POD_ID") or environ.get("POD_NAME") or None


def run(args: argparse.Namespace) -> int:
    # imported here so `kora validate/render` never pay for (or need) kopf and the k8s client
    import kopf  # noqa: PLC0415 - kopf and the k8s client only when the operator runs, never for `kora validate/render`

    import kora_operator.handlers  # noqa: F401, PLC0415 - kopf and the k8s client only when the operator runs, never for `kora validate/render`
    from kora_operator import metrics  # noqa: PLC0415 - kopf and the k8s client only when the operator runs, never for `kora validate/render`

    settings = from_flags(args)  # flags over environment variables over defaults
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
        identity=own_identity(),  # type: ignore[arg-type]  # kopf's Identity is a NewType of str
    )
    return 0


def register(sub: Any) -> None:
    p = sub.add_parser("operator", help="run the kora operator (kopf) against the current cluster")
    p.add_argument("-n", "--namespace", action="append", metavar="NS",
                   help="watch only this namespace (repeatable; globs like team-* work); default: all namespaces")
    p.add_argument("--liveness", default=DEFAULT_LIVENESS, metavar="URL",
                   help=f"kopf's liveness endpoint (default {DEFAULT_LIVENESS}; empty turns it off)")
    p.add_argument("--metrics-port", type=int, default=9090, help="Prometheus /metrics port (0: off)")
    p.add_argument("--metrics-address", default="0.0.0.0", help="address /metrics binds to")
    add_flags(p)  # the operator's Settings, one flag per field (settings.py)
    p.add_argument("-v", "--verbose", action="store_true", help="log every handler call")
    p.set_defaults(func=run)
