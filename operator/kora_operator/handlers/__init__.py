"""kopf handlers; importing this package registers them with kopf's default registry."""

from kora_operator.handlers import jobs

__all__ = ["jobs"]
