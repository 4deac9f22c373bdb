"""The trainer's control-plane contract that both sides need: its port and the KORA_CONTROL_* environment.

The trainer serves its control-plane API (kora_trainer/control_plane.py) on CONTROL_PORT unless told
otherwise; the operator polls it there (a KubeRay head pod always uses it; runtime Ray picks one port per
submission from a range that starts here). Whoever starts a trainer (the operator's RayJob and Ray job
submissions, a test, a person) tells it how to serve through `ControlEnv`: the operator writes it with
`to_env`, the trainer reads it with `from_env`, so the variable names live here only. Imports nothing
heavy: the operator reads it too.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field

CONTROL_PORT = 8068
ENV_PREFIX = "KORA_CONTROL_"


class ControlEnv(BaseModel):
    """The KORA_CONTROL_* environment variables of a trainer; each field is the variable ENV_PREFIX + its
    name in capitals (token: KORA_CONTROL_TOKEN). Unset fields are unset variables."""

    model_config = ConfigDict(
        alias_generator=lambda name: ENV_PREFIX + name.upper(),
        populate_by_name=True,
        extra="forbid",
        frozen=True,
        use_attribute_docstrings=True,
    )

    token: str | None = None
    """The bearer token itself (runtime Ray passes it so, in the submission's environment)."""
    port: Annotated[int, Field(ge=0, le=65535)] | None = None
    """The port to serve on (0: a free one); unset: the trainer's --control-port, else CONTROL_PORT."""
    token_file: str | None = None
    """A file holding the token, read when `token` is unset (KubeRay: the job's Secret, mounted on the head)."""
    host: str | None = None
    """The address to bind; unset: 127.0.0.1 (the operator sets 0.0.0.0 where it polls from another host)."""
    linger_s: Annotated[float, Field(ge=0, allow_inf_nan=False)] = 0.0
    """Seconds the trainer may keep serving after its last step, until one authorized read of the final
    phase (0: it stops at once)."""

    @classmethod
    def env_name(cls, field: str) -> str:
        """The variable of `field`, e.g. KORA_CONTROL_TOKEN for token."""
        return str(cls.model_fields[field].alias)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, only: Iterable[str] | None = None) -> ControlEnv:
        """The variables that are set (an empty one counts as unset), just those of the fields `only` when
        given, so that a bad variable fails only the reader that needs it. A ValidationError names it."""
        env = os.environ if env is None else env
        names = (cls.env_name(f) for f in (cls.model_fields if only is None else only))
        return cls.model_validate({name: env[name] for name in names if env.get(name)})

    def to_env(self) -> dict[str, str]:
        """The variables to set, those that differ from the defaults (a trainer told nothing uses them)."""
        return {name: _text(value) for name, value in self.model_dump(by_alias=True, exclude_defaults=True).items()}


def _text(value: Any) -> str:
    # 30.0 seconds is written "30", as people and the operator have always written it
    return str(int(value)) if isinstance(value, float) and value.is_integer() else str(value)
