"""What a status says, as trainer and operator both write it: its timestamps and its messages.

Imports nothing heavy: the operator reads it too.
"""

from __future__ import annotations

from datetime import UTC, datetime

# RFC 3339 in UTC to the second, as Kubernetes writes its own times (metav1.Time)
RFC3339 = "%Y-%m-%dT%H:%M:%SZ"
# Events are cut below 1 KiB; conditions, failure summaries and the trainer's /status message use the
# same cap so they read alike
MAX_MESSAGE = 1000


def rfc3339(when: datetime | None = None) -> str:
    """`when` (default: now) as RFC 3339 in UTC, e.g. 2026-11-30T10:00:00Z."""
    return (when or datetime.now(UTC)).astimezone(UTC).strftime(RFC3339)
