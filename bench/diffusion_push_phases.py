#!/usr/bin/env python3
"""Where a diffusion push's time goes on one GPU: the trainer's phases of one IPC-merge (EngineMerge) and one
train-side-merge (Merge) push to the reference diffusion engine on the same GPU, each timed apart, with the
engine's own receive / apply times (its answer's message), over `--reps` pushes.

Phases: collect (the adapter's factors into layer groups and buckets) or fold (the trainer's W + s B A), flatten
(the bucket's one flat copy), serialize (the payload), post (the HTTP call: the engine's receive — unpickling and
opening the CUDA IPC handle — its apply, its synchronize, and the reply). It drives wire/diffusion_client.py's own
functions on the SD3-medium toy (`kora make-toy --diffusion --diffusion-shape sd3-medium`), made here unless
`--model` names one.

    python bench/diffusion_push_phases.py --out bench/results/diffusion_push_phases_$(date +%F).json
"""

from __future__ import annotations

import argparse
import json
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "trainer"), str(ROOT / "engine")]

import requests  # noqa: E402
import torch  # noqa: E402

from kora_trainer.lora.diffusers import SD3_TARGETS, apply_diffusion_lora  # noqa: E402
from kora_trainer.lora.model import adapter_tensors, fold_targets, lora_modules  # noqa: E402
from kora_trainer.toys.diffusion import load_diffusion_toy, make_diffusion_toy  # noqa: E402
from kora_trainer.wire import diffusion_client as engine_client  # noqa: E402
from kora_trainer.wire import flat_bucket  # noqa: E402
from kora_trainer.wire.diffusion_lora import LORA_MERGE, layer_groups, pack_pair_buckets  # noqa: E402
from kora_trainer.wire.protocol import FLAT  # noqa: E402
from kora_trainer.wire.serialize import serialize_payload  # noqa: E402

_TIMES = re.compile(r"received in ([\d.]+) ms, applied in ([\d.]+) ms")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_health(url: str, proc: subprocess.Popen[bytes], timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the engine exited with {proc.returncode}")
        try:
            if requests.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except requests.ConnectionError:
            pass
        time.sleep(0.2)  # polling the engine's /health: a bounded wait on an observable state
    raise TimeoutError(f"{url}/health not 200 within {timeout} s")


def timed(fn: Any) -> tuple[Any, float]:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    return out, (time.perf_counter() - t0) * 1e3


def push(url: str, named: list[tuple[str, torch.Tensor]], fields: dict[str, Any],
         phases: dict[str, list[float]]) -> None:
    bucket, ms = timed(lambda: flat_bucket.flatten(named))
    phases["flatten"].append(ms)
    payload, ms = timed(lambda: serialize_payload(bucket))
    phases["serialize"].append(ms)
    body = {"serialized_named_tensors": [payload], "load_format": FLAT, "target_modules": ["transformer"], **fields}
    resp, ms = timed(lambda: engine_client._post(f"{url}/update_weights_from_tensor", body))
    phases["post"].append(ms)
    got = _TIMES.search(resp.json()["message"])
    if got:
        phases["engine_receive"].append(float(got.group(1)))
        phases["engine_apply"].append(float(got.group(2)))


def one_mode(mode: str, url: str, model: torch.nn.Module, reps: int, buffer: int) -> dict[str, Any]:
    phases: dict[str, list[float]] = {k: [] for k in ("collect", "fold", "flatten", "serialize", "post",
                                                      "engine_receive", "engine_apply", "total")}
    for _ in range(reps):
        t0 = time.perf_counter()
        if mode == "EngineMerge":
            buckets, ms = timed(lambda: pack_pair_buckets(layer_groups(adapter_tensors(model))[0], buffer))
            phases["collect"].append(ms)
            for b in buckets:
                push(url, [t for g in b for t in g.named()], {"weight_update_mode": LORA_MERGE, "lora_alpha": 64.0,
                                                              "lora_rank": 32}, phases)
        else:
            folded, ms = timed(lambda: [(n, m.folded_weight()) for n, m in fold_targets(model).items()])
            phases["fold"].append(ms)
            bucket, size = [], 0
            for name, t in folded:
                if bucket and size + t.nbytes > buffer:
                    push(url, bucket, {"weight_update_mode": None}, phases)
                    bucket, size = [], 0
                bucket.append((name, t))
                size += t.nbytes
            push(url, bucket, {"weight_update_mode": None}, phases)
        phases["total"].append((time.perf_counter() - t0) * 1e3)
    return {"mode": mode, **{f"{k}_ms_p50": round(statistics.median(v), 3) for k, v in phases.items() if v},
            "per_push": {k: [round(x, 2) for x in v] for k, v in phases.items() if v}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--buffer", type=int, default=512 << 20)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    model_dir = Path(args.model) if args.model else Path(tempfile.mkdtemp(prefix="push-phases-")) / "sd3-medium"
    if args.model is None:
        make_diffusion_toy(model_dir, shape="sd3-medium", sample_size=32)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    engine = subprocess.Popen([sys.executable, "-m", "kora_engine.diffusion.server", "--toy", str(model_dir),
                               "--port", str(port), "--device", "cuda"])
    try:
        toy = load_diffusion_toy(model_dir).to("cuda")
        torch.manual_seed(0)
        apply_diffusion_lora(toy.transformer, 32, 64.0, SD3_TARGETS)
        with torch.no_grad():
            for m in lora_modules(toy.transformer).values():
                m.lora_B.weight.normal_(0, 1e-3)
        wait_health(url, engine)
        runs = [one_mode(mode, url, toy.transformer, args.reps, args.buffer) for mode in ("EngineMerge", "Merge")]
    finally:
        engine.terminate()
        engine.wait(timeout=60)
    for r in runs:
        print(json.dumps({k: v for k, v in r.items() if k != "per_push"}), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"bench": "diffusion_push_phases", "gpu": torch.cuda.get_device_name(0),
                                              "command": "python bench/diffusion_push_phases.py "
                                                         + " ".join(sys.argv[1:]), "runs": runs}, indent=1) + "\n")


if __name__ == "__main__":
    main()
