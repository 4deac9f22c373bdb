"""A directory written whole or not at all: fill a temp dir beside it, then swap it into place.

The previous directory stays whole until the new one is complete (it is renamed aside, the new one renamed in,
the old one removed); a failure while filling removes the temp dir and leaves the previous one as it was. Used by
the exports (the HF-PEFT one, the diffusers one) and the multi-adapter slots; checkpoints proper go through
lora_only.save, which also moves a `latest` pointer.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def swapped_in(parent: Path, name: str) -> Iterator[Path]:
    """Yield a fresh temp dir under `parent`; when the body returns, it becomes `parent/name`."""
    parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}.tmp-", dir=parent))
    try:
        tmp.chmod(0o755)  # mkdtemp's 0700 would hide it from a server reading the volume as another user
        yield tmp
        final, old = parent / name, parent / f".{name}.old"
        if final.exists():
            shutil.rmtree(old, ignore_errors=True)
            os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
