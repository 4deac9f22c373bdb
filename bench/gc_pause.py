"""What one full garbage collection stops a kora process for, before and after `heap.freeze`.

    python bench/gc_pause.py [--out bench/results/gc_pause_<date>.json]

A full collection holds the GIL from start to end: every thread of the process waits it out (kora_trainer/heap.py
says where that hurt: a colocated push's watcher in the engine). In this one process, what the engine's and a
trainer rank's start-up make: the toy (`make_toy`), the reference engine as its command builds it (EngineModel +
HFEngineServer) with one generation run, and a trainer rank's torch backend (`make_backend`) with one GRPO step's
log-probs. Then a full collection timed (the anchor: median of REPS), `heap.freeze`, and the same again; it prints
both and their ratio. No engine process is started: the heap is what matters, not the serving.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPS = 5


def full_collection_ms() -> float:
    samples = []
    for _ in range(REPS):
        t = time.perf_counter()
        gc.collect()
        samples.append((time.perf_counter() - t) * 1e3)
    return statistics.median(samples)


def build(workdir: Path) -> list[object]:
    """What stays alive in an engine and a trainer rank after their start-up (kept referenced, as they are)."""
    from kora_engine.lm.model import EngineModel, GenRequest
    from kora_engine.lm.sampling import SamplingParams
    from kora_engine.lm.server import HFEngineServer, parse_args
    from kora_trainer.backends.select import make_backend
    from kora_trainer.config import load_config
    from kora_trainer.toys.lm import make_toy

    model = workdir / "toy"
    make_toy(model, target=0.0, dataset="train.jsonl")
    args = parse_args(["--model-path", str(model)])
    engine = EngineModel(args.model_path, args.device, args.dtype, args.max_loras_per_batch, args.max_lora_rank)
    server = HFEngineServer(engine)
    engine.generate([GenRequest(input_ids=[1, 2, 3], params=SamplingParams(max_new_tokens=4))])
    cfg, _ = load_config(None, [f"model.path={model}", f"data.path={model / 'train.jsonl'}", "rollout.engine=hf",
                                "lora.rank=4"])
    backend = make_backend(cfg, threads=1)
    backend.logprobs([[1, 2, 3]], [[4, 5]])
    return [engine, server, backend]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", help="write the result JSON here")
    args = p.parse_args()
    from kora_trainer import heap

    with tempfile.TemporaryDirectory(prefix="kora-gc-") as tmp:
        alive = build(Path(tmp))
        before = full_collection_ms()
        tracked_before = len(gc.get_objects())
        frozen = heap.freeze("the bench")
        after = full_collection_ms()
        result = {
            "bench": "gc_pause", "command": " ".join([Path(sys.executable).name, *sys.argv]),
            "tracked_before": tracked_before, "frozen": frozen, "tracked_after": len(gc.get_objects()),
            "full_collection_ms_before": round(before, 2), "full_collection_ms_after": round(after, 4),
            "ratio_after_over_before": round(after / before, 6),
        }
        del alive
    print(json.dumps(result, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
