"""Deterministic child names, so a restarted operator finds what it already created."""

from __future__ import annotations

import hashlib

MAX_NAME = 63  # child names also become label values, which are capped at 63


def child_name(job_name: str, suffix: str) -> str:
    """`<job>-<suffix>`, shortened with a stable hash when it would exceed 63 characters."""
    name = f"{job_name}-{suffix}"
    if len(name) <= MAX_NAME:
        return name
    digest = hashlib.sha256(job_name.encode()).hexdigest()[:8]
    keep = MAX_NAME - len(suffix) - len(digest) - 2
    return f"{job_name[:keep].rstrip('-')}-{digest}-{suffix}"


def config_map_name(job_name: str) -> str:
    return child_name(job_name, "trainer-config")
