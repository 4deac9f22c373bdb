"""Per-step weight-sync time of each mode vs a raw gloo broadcast of the same bytes (CPU, one run).

For Merge, Adapter and EngineMerge (distributed: gloo group + metadata-only HTTP to a real `reference_engine`
engine process; colocated: in-memory handoff), it perturbs the adapter before every step (so delta-skip
never fires), times `WeightSender.sync`, and times, in the same run, a raw gloo broadcast of exactly the
same bucket sizes from this process to a second process (the anchor: what moving those bytes costs with
no HTTP, no fold, no apply). Prints a table and one JSON line with the ratios.

    python bench/sync_cpu.py [--model .kora/toy] [--steps 20] [--buffer 1Mi] [--hidden 0] [--out FILE]

--hidden N (> 0) benchmarks a random Qwen3 of that width instead (4 layers; e.g. 512 -> ~60 MB fp32).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from kora_trainer.backends.torch_backend import TorchBackend
from kora_trainer.config import load_config
from kora_trainer.config.quantity import parse_bytes
from kora_trainer.orchestration.engines import EngineProcess
from kora_trainer.sync.sender import WeightSender, colocated_buckets
from kora_trainer.sync.sources import adapter_source, base_source, merged_source
from kora_trainer.sync.transport import ColocatedTransport, DistributedTransport
from kora_trainer.wire.engine_client import EngineClient
from kora_trainer.wire.group import init_weight_update_group
from kora_trainer.wire.ports import free_port
from kora_trainer.wire.protocol import plan_buckets

MODES = ("Merge", "Adapter", "EngineMerge")


def _receiver(port: int, sizes: list[list[int]], reps: int) -> None:
    """Rank 1 of the anchor group: receive every planned bucket, `reps` times per plan."""
    torch.set_num_threads(1)
    group = init_weight_update_group("127.0.0.1", port, 1, 2, "anchor", "gloo", timeout_s=120)
    for plan in sizes:
        for _ in range(reps + 1):
            for n in plan:
                group.broadcast(torch.empty(n, dtype=torch.uint8))


def random_model(hidden: int, out: Path) -> Path:
    from transformers import AutoModelForCausalLM, Qwen3Config

    from kora_trainer.toys.lm import make_tokenizer

    cfg = Qwen3Config(vocab_size=16, hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=4,
                      num_attention_heads=8, num_key_value_heads=4, head_dim=hidden // 8, tie_word_embeddings=True,
                      pad_token_id=0, bos_token_id=1, eos_token_id=2, dtype="float32")
    AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(out)
    make_tokenizer().save_pretrained(out)
    return out


def bucket_sizes(b: TorchBackend, mode: str, cap: int, transport: str) -> list[int]:
    """The bytes of each bucket a steady-state step of `mode` pushes (Adapter: the adapter only)."""
    src = merged_source(b.model) if mode == "Merge" else adapter_source(b.model)
    if transport == "distributed":
        return [bk.nbytes for bk in plan_buckets(src.groups, cap)]
    sizes = {n: t.numel() * t.element_size() for g in src.groups for n, t in g}
    return [sum(sizes[n] for n in names) for names in colocated_buckets(src.groups, cap)]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=".kora/toy")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--buffer", default="1Mi")
    p.add_argument("--hidden", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default=None, help="also write the JSON result to this file")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    model = args.model
    if args.hidden:
        model = str(random_model(args.hidden, Path(tempfile.mkdtemp(prefix="kora-bench-")) / "model"))
    elif not Path(model).exists():
        from kora_trainer.toys.lm import make_toy

        make_toy(model)
    cap = parse_bytes(args.buffer)
    base = [f"model.path={model}", "data.path=unused.parquet", "lora.rank=16", "lora.alpha=32",
            "lora.targetModules=[linear_qkv, linear_proj, linear_fc1, linear_fc2]", f"sync.bufferSize={cap}",
            "rollout.engine=hf", "rollout.gpusPerEngine=0"]
    cfg0, _ = load_config(None, [*base, "lora.syncMode=Merge"])
    engine = EngineProcess.start(cfg0, Path(tempfile.mkdtemp(prefix="kora-bench-logs-")), threads=args.threads)
    rows = []
    try:
        plans = []
        for transport in ("distributed", "colocated"):
            for mode in MODES:
                cfg, _ = load_config(None, [*base, f"lora.syncMode={mode}"])
                b = TorchBackend(cfg, device="cpu", threads=args.threads)
                with torch.no_grad():
                    for prm in b.params:
                        prm.normal_(0.0, 0.05)
                client = EngineClient(engine.url)
                tr = DistributedTransport.connect([client]) if transport == "distributed" \
                    else ColocatedTransport([client])
                sender = WeightSender(b.model, cfg, tr)
                first = sender.sync(0)  # Adapter: the base goes once here; not a per-step cost
                times, nbytes = [], []
                for step in range(1, args.steps + 1):
                    with torch.no_grad():
                        b.params[0].add_(1e-3)  # the adapter moved: no delta-skip
                    r = sender.sync(step)
                    times.append(r.ms)
                    nbytes.append(r.bytes)
                sender.close()
                client.close()
                sizes = bucket_sizes(b, mode, cap, transport)
                assert sum(sizes) == nbytes[-1], (mode, transport, sum(sizes), nbytes[-1])
                plans.append(sizes)
                rows.append({"mode": mode, "transport": transport, "bytes_per_step": nbytes[-1],
                             "buckets": len(sizes),
                             "first_sync_bytes": first.bytes, "sync_ms_p50": statistics.median(times),
                             "base_bytes": sum(t.numel() * t.element_size() for g in base_source(b.model).groups
                                               for _, t in g)})
        # the anchor: the same bucket sizes over a raw 2-process gloo group, measured now, in this run
        port = free_port()
        ctx = mp.get_context("spawn")
        recv = ctx.Process(target=_receiver, args=(port, plans, args.steps))
        recv.start()
        group = init_weight_update_group("127.0.0.1", port, 0, 2, "anchor", "gloo", timeout_s=120)
        for row, plan in zip(rows, plans, strict=True):
            bufs = [torch.randint(0, 255, (n,), dtype=torch.uint8) for n in plan]
            times = []
            for rep in range(args.steps + 1):
                t0 = time.perf_counter()
                for buf in bufs:
                    group.broadcast(buf)
                if rep:  # the first round warms the connection up
                    times.append((time.perf_counter() - t0) * 1000)
            row["raw_gloo_ms_p50"] = statistics.median(times)
            row["ratio"] = row["sync_ms_p50"] / row["raw_gloo_ms_p50"]
        recv.join(timeout=60)
    finally:
        engine.stop()
    print(f"{'mode':<12}{'transport':<13}{'bytes/step':>12}{'buckets':>9}{'sync ms':>10}{'gloo ms':>10}{'ratio':>8}")
    for r in rows:
        print(f"{r['mode']:<12}{r['transport']:<13}{r['bytes_per_step']:>12}{r['buckets']:>9}"
              f"{r['sync_ms_p50']:>10.2f}{r['raw_gloo_ms_p50']:>10.2f}{r['ratio']:>8.1f}")
    # LoRA's point in one number: an adapter sync against a raw broadcast of the whole model's bytes (what a
    # full-model sync has to move at the very least), from the same run
    full = next(r["raw_gloo_ms_p50"] for r in rows if r["mode"] == "Merge" and r["transport"] == "distributed")
    adapter = next(r["sync_ms_p50"] for r in rows if r["mode"] == "Adapter" and r["transport"] == "distributed")
    result = {"bench": "sync_cpu", "model": model, "buffer": cap, "steps": args.steps, "threads": args.threads,
              "adapter_sync_vs_full_model_broadcast": adapter / full, "rows": rows,
              "command": "python " + " ".join(sys.argv), "torch": torch.__version__, "cpus": os.cpu_count()}
    print(f"adapter sync / raw broadcast of the whole model: {adapter:.2f} / {full:.2f} ms = {adapter / full:.2f}")
    print(json.dumps(result))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
