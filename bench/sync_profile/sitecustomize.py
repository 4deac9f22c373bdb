"""A cProfile of every weight push, in whichever process makes it (the trainer's Ray actors too): put this folder
first on PYTHONPATH and set KORA_SYNC_PROFILE to a directory. Each process that imports
`kora_trainer.sync.sender` then profiles every `sync` of the sender classes defined there (the HTTP path's, and
the fast path's `http` under it) and writes the running total to DIR/sync-<pid>.prof after each push. Any
checkout of kora works (a bench can profile an old commit's tree the same way); `python bench/sync_profile/report.py
DIR` prints the totals. Without KORA_SYNC_PROFILE this file does nothing.

Not product code: a bench's instrument. It patches at import (a meta-path hook) so a process that never syncs pays
nothing, and the pushes' own timing (SyncReport.ms) includes the profiler's overhead: compare profiled runs with
profiled runs.
"""

from __future__ import annotations

import os
import sys

_DIR = os.environ.get("KORA_SYNC_PROFILE")
_TARGET = "kora_trainer.sync.sender"


def _patch(module: object) -> None:
    import cProfile
    import functools

    prof = cProfile.Profile()
    out = os.path.join(_DIR or ".", f"sync-{os.getpid()}.prof")
    for cls in list(vars(module).values()):
        if not isinstance(cls, type) or cls.__module__ != _TARGET or "sync" not in vars(cls):
            continue
        original = vars(cls)["sync"]

        @functools.wraps(original)
        def sync(self, *args, _original=original, **kw):  # type: ignore[no-untyped-def]
            if getattr(prof, "_kora_active", False):  # a nested push (fast path over http): one profile
                return _original(self, *args, **kw)
            prof._kora_active = True  # type: ignore[attr-defined]
            prof.enable()
            try:
                return _original(self, *args, **kw)
            finally:
                prof.disable()
                prof._kora_active = False  # type: ignore[attr-defined]
                prof.dump_stats(out)

        cls.sync = sync  # type: ignore[attr-defined]


if _DIR:
    import importlib.abc
    import importlib.util

    class _Hook(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):  # type: ignore[no-untyped-def]
            if name != _TARGET:
                return None
            sys.meta_path.remove(self)
            spec = importlib.util.find_spec(name)
            if spec is None or spec.loader is None:
                return spec
            run = spec.loader.exec_module

            def exec_module(module):  # type: ignore[no-untyped-def]
                run(module)
                _patch(module)

            spec.loader.exec_module = exec_module  # type: ignore[method-assign]
            return spec

    os.makedirs(_DIR, exist_ok=True)
    sys.meta_path.insert(0, _Hook())
