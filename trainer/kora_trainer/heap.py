"""Python's cyclic garbage collector kept off the hot paths of kora's long-lived processes.

A collection of the oldest generation walks every object the process tracks and holds the GIL from start to
end, so every thread of the process stops for it: the colocated watcher between a push's request and its
answer, a generation between two tokens. A process that has imported torch and transformers tracks hundreds of
thousands of objects, so that pause is long enough to show as a slow push (docs/megatron_backend.md, session 24;
`bench/gc_pause.py` measures it).

`freeze` collects once and then moves every object alive into the permanent generation, which no collection
walks again: the model, the imported modules, the plan. What the process makes later is still collected as
before. The price: a cycle of objects alive at the freeze that becomes garbage later is never freed (reference
counting still frees everything that is not a cycle); at exit they are handed back, so the exit's collection
frees them (Triton's bindings report leaks otherwise). SGLang (`freeze_gc`) and vLLM (`freeze_gc_heap`) freeze
their servers' heaps after start-up in the same way.
"""

from __future__ import annotations

import atexit
import gc
import logging

log = logging.getLogger("kora.heap")


def freeze(what: str) -> int:
    """After `what`'s start-up: collect, then freeze what is alive. Returns the number of frozen objects."""
    gc.collect()
    gc.freeze()
    atexit.unregister(gc.unfreeze)  # once: the exit's own collection may free them (nanobind checks its leaks)
    atexit.register(gc.unfreeze)
    frozen = gc.get_freeze_count()
    log.info("%s: %d objects moved out of the garbage collector's full collections", what, frozen)
    return frozen
