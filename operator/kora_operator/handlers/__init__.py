"""kopf handlers; importing this package registers them with kopf's default registry."""

from kora_operator.handlers import adapters, jobs

__all__ = ["adapters", "jobs"]
