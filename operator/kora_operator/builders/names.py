"""Deterministic child names, so a restarted operator finds what it already created."""

from __future__ import annotations

import hashlib
import re

MAX_NAME = 63  # child names also become label values, which are capped at 63
# KubeRay names the RayCluster `<rayjob>-<5 random chars>` and caps RayJob names at 53 - 6 = 47
# (ray-operator utils.MaxRayJobNameLength, v1.5.0); its validation also wants a DNS-1035 label.
MAX_RAYJOB_NAME = 47


def child_name(job_name: str, suffix: str, max_len: int = MAX_NAME) -> str:
    """`<job>-<suffix>`, shortened with a stable hash when it would exceed `max_len` characters."""
    name = f"{job_name}-{suffix}"
    if len(name) <= max_len:
        return name
    digest = hashlib.sha256(job_name.encode()).hexdigest()[:8]
    keep = max_len - len(suffix) - len(digest) - 2
    return f"{job_name[:keep].rstrip('-.')}-{digest}-{suffix}"


def config_map_name(job_name: str) -> str:
    return child_name(job_name, "trainer-config")


def secret_name(job_name: str) -> str:
    return child_name(job_name, "control-token")


def engine_key_secret_name(job_name: str) -> str:
    return child_name(job_name, "engine-admin-key")


def network_policy_name(job_name: str) -> str:
    return child_name(job_name, "network-policy")


def ray_job_name(job_name: str) -> str:
    """A DNS-1035 label of at most 47 characters, as KubeRay's RayJob validation demands.

    A LoRATrainingJob name is a DNS-1123 subdomain: it may contain dots and start with a digit,
    which a DNS-1035 label may not; such names get a stable hash so two jobs never collide.
    """
    label = re.sub(r"[^a-z0-9-]", "-", job_name)
    if label != job_name or not label[:1].isalpha():
        digest = hashlib.sha256(job_name.encode()).hexdigest()[:8]
        label = f"j{digest}-{label}".rstrip("-")
    return child_name(label, "ray", MAX_RAYJOB_NAME)
