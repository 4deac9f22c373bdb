"""Prometheus metrics of the operator (prometheus-client), served on --metrics-port."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import kopf
from prometheus_client import Counter, Gauge, Histogram, start_http_server

RECONCILES = Counter("kora_reconciles_total", "Reconciles of LoRATrainingJobs, by trigger and result",
                     ["trigger", "result"])
ERRORS = Counter("kora_reconcile_errors_total", "Reconciles that raised, by exception type", ["error"])
LATENCY = Histogram("kora_reconcile_duration_seconds", "Wall time of one reconcile", ["trigger"],
                    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10))
CHILDREN_CREATED = Counter("kora_children_created_total", "Child objects created, by kind", ["kind"])
IN_FLIGHT = Gauge("kora_reconciles_in_flight", "Reconciles of LoRATrainingJobs running now (waiting on a job's lock "
                  "included)")
_in_flight = 0
_in_flight_lock = threading.Lock()


def reconciles_in_flight() -> int:
    """How many reconciles run now: the Event poster (events.py) and the status writer (statuses.py) hold back while
    any does."""
    return _in_flight


def _count(delta: int) -> None:
    global _in_flight
    with _in_flight_lock:
        _in_flight += delta
    IN_FLIGHT.inc(delta)


@contextmanager
def observe_reconcile(trigger: str) -> Iterator[None]:
    start = time.perf_counter()
    _count(1)
    try:
        yield
    except kopf.TemporaryError:
        RECONCILES.labels(trigger, "retry").inc()
        ERRORS.labels("TemporaryError").inc()
        raise
    except Exception as e:
        RECONCILES.labels(trigger, "error").inc()
        ERRORS.labels(type(e).__name__).inc()
        raise
    else:
        RECONCILES.labels(trigger, "success").inc()
    finally:
        _count(-1)
        LATENCY.labels(trigger).observe(time.perf_counter() - start)


def serve(port: int, address: str) -> None:
    """Serve /metrics in a daemon thread; port 0 turns metrics off."""
    if port:
        start_http_server(port, addr=address)
