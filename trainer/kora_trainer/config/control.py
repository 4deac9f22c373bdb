"""The trainer's control-plane contract that both sides need: its port.

The trainer serves its control-plane API (kora_trainer/control_plane.py) on this port unless told
otherwise; the operator polls it there (a KubeRay head pod always uses it; runtime Ray picks one per
submission from a range that starts here). Imports nothing heavy: the operator reads it too.
"""

from __future__ import annotations

CONTROL_PORT = 8068
