"""How much of adapter B's generation throughput adapter A's trainer costs, in one reference engine process
(`python -m kora_engine.lm` on a tiny Qwen3, CPU): A publishing a new version over a gloo group
(`/load_lora_adapter_from_distributed`) or A retired and its slot reloaded (abort by rid prefix, unload, load from
tensors), once per --every seconds, a trainer's cadence.

    python bench/multi_lora_isolation.py [--windows 4] [--every 0.1] [--out FILE]

The anchor is B's wall time for the same requests with A quiet, in the same run: quiet and busy windows alternate
(--windows pairs, summed), so load from other processes falls on both alike. Ratio = quiet / busy: 1.0 means A
costs B nothing; on a 2-core machine the test process's serialization and the engine's adapter builds share the
CPU with B, so expect ~0.85-1.0 there. That A never *blocks* B is a test (tests/unit/test_engine_multi_lora.py).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
for p in (ROOT / "trainer", ROOT / "tests", ROOT / "hack"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

from engine_helpers import (  # noqa: E402  (tests/engine_helpers.py, after the path above)
    PROMPTS,
    make_peft_adapter,
    peft_config_dict,
    publish_adapter,
    retire_and_reload,
    serialize_adapter,
    served_engine,
    trainer_group,
)
from tinymodel import make_tiny_model  # noqa: E402

SHORT = {"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True}
B_REQUESTS = 16


def b_round(client, n: int = B_REQUESTS, workers: int = 2) -> float:
    """Wall seconds for n short B requests from `workers` closed-loop senders."""
    start = time.monotonic()
    with ThreadPoolExecutor(workers) as pool:
        outs = list(pool.map(lambda i: client.generate([PROMPTS[i % 3]], SHORT, lora_path="steady")[0], range(n)))
    assert all(o.finish_reason["type"] == "length" for o in outs)
    return time.monotonic() - start


def _paced(action: Callable[[int], None], first: int, stop: threading.Event, every_s: float) -> int:
    """`action(first)`, `action(first + 1)`, ... one per `every_s` until `stop`; how many ran."""
    n = 0
    while not stop.is_set():
        action(first + n)
        n += 1
        stop.wait(every_s)  # pacing, not a wait for a result
    return n


def quiet_vs_busy(client, action: Callable[[int], None], windows: int, every_s: float) -> dict:
    """B's seconds quiet and while `action(i)` runs once per `every_s`, `windows` alternating pairs summed."""
    quiet = busy = 0.0
    actions = 0
    for _ in range(windows):
        quiet += b_round(client)
        stop = threading.Event()
        with ThreadPoolExecutor(1) as pool:
            fut = pool.submit(_paced, action, actions, stop, every_s)
            busy += b_round(client)
            stop.set()
            actions += fut.result(timeout=60)
    return {"b_quiet_s": round(quiet, 3), "b_busy_s": round(busy, 3), "ratio": round(quiet / busy, 3),
            "a_actions": actions}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--windows", type=int, default=4)
    ap.add_argument("--every", type=float, default=0.1, help="seconds between two of A's actions")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model_dir = make_tiny_model(root / "tiny")
        (_, a1), (_, a2), (dir_b, _) = (make_peft_adapter(model_dir, root / f"s{s}", seed=s) for s in (31, 32, 33))
        (root / "logs").mkdir()
        with served_engine(model_dir, root / "logs") as (_, client), trainer_group(client) as group:
            client.load_lora_adapter("steady", str(dir_b))
            publish_adapter(client, group, "hot", a1, "h0")
            client.load_lora_adapter_from_tensors("cold", peft_config_dict(a1), serialize_adapter(a1))
            b_round(client, 4)  # warm
            result = {
                "publish": quiet_vs_busy(
                    client, lambda i: publish_adapter(client, group, "hot", (a2, a1)[i % 2], f"h{i + 1}"),
                    args.windows, args.every),
                "retire": quiet_vs_busy(client, lambda i: retire_and_reload(client, "cold", (a2, a1)[i % 2]),
                                        args.windows, args.every),
            }
    result["config"] = {"windows": args.windows, "every_s": args.every, "b_requests": B_REQUESTS}
    for what in ("publish", "retire"):
        r = result[what]
        print(f"B during A's {what}: {r['b_quiet_s']:.2f} s quiet, {r['b_busy_s']:.2f} s busy "
              f"({r['a_actions']} actions): ratio {r['ratio']:.3f}")
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
