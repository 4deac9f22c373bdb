"""Weight sync near NVLink speed: trainer on GPU 0, engine on GPU 1, one NCCL weight-update group (issue 7).

A random-initialised Qwen3-4B-shaped model (no checkpoint is read): the trainer is the megatron-core policy
(`--trainer megatron`, default; `--trainer hf` = HF Qwen3 + kora's torch LoRA) with a rank-32 LoRA on
linear_qkv + linear_proj; the engine is kora's reference engine (`rollout.hf_server`: EngineModel + the HTTP
routes, its HF model built from the same config in the engine process) plus the fast-path receivers of
`sync/fast.py`. Everything below is measured in ONE run, each number the median of --reps:

(a) adapter push, end to end: trainer step done (synchronised) -> the adapter packed (one gather), broadcast,
    the engine's adapter object swapped (it serves `kora-policy` from the next request) -> engine ack;
    vs a raw broadcast (+ ack) of the same bytes. Also through the HTTP route
    /load_lora_adapter_from_distributed (`adapter_push_http_ms`: per-push export + plan + HTTP + the engine's
    copy and sha256 verification), the path `sync.sender.WeightSender` takes today.
(b) Merge-mode full sync: fold (grouped Triton launch per bucket, QKV unfused by a row map) + copies into
    ring buckets, overlapped with the broadcast of the previous bucket, the engine applying bucket i while
    i+1 arrives -> ack; vs a raw broadcast (+ ack) of the same buckets.
(c) fold throughput (every adapted weight, one grouped launch) vs ONE device-to-device copy of the same bytes,
    with a sweep of kernel configurations.
(d) delta-skip decision: one fused max|Δ| over the flat adapter + a MAX all-reduce of one number + one read.
(e) LoRA vs full fine-tuning: step time and optimizer-state / peak memory on the same model and batch.

    PYTHONPATH=trainer:tests NCCL_NVLS_ENABLE=0 python bench/gpu_sync.py [--out FILE]     # 2 GPUs: everything
    python bench/gpu_sync.py --no-engine      # 1 GPU: (c), the packing halves of (a)/(b), local (d), (e)
    python bench/gpu_sync.py --cpu-smoke      # tiny model, gloo, CPU: the plumbing only (numbers meaningless)

Results: bench/results/gpu_sync_*.json; discussion in docs/megatron_backend.md.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing as mp
import os
import signal
import statistics
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
for p in (ROOT / "trainer", ROOT / "tests"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

QWEN3_4B = dict(hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32,
                num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True,
                max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1_000_000.0)
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, vocab_size=32, tie_word_embeddings=True,
            max_position_embeddings=256, rms_norm_eps=1e-6, rope_theta=10000.0)
MIB = 1 << 20


def hf_config(dims: dict[str, Any]) -> Any:
    from transformers import Qwen3Config

    kw = dict(dims)
    theta = kw.pop("rope_theta")
    cfg = Qwen3Config(**kw, pad_token_id=0, bos_token_id=1, eos_token_id=2, dtype="bfloat16")
    with contextlib.suppress(Exception):  # transformers 5 keeps the base in rope_parameters, 4.x in rope_theta
        cfg.rope_parameters = {"rope_type": "default", "rope_theta": theta}
    cfg.rope_theta = theta
    return cfg


def write_model_dir(path: Path, dims: dict[str, Any]) -> Path:
    """config.json + tokenizer, no weights (the engine builds its random model from the config)."""
    from tinymodel import make_tokenizer

    path.mkdir(parents=True, exist_ok=True)
    hf_config(dims).save_pretrained(path)
    make_tokenizer().save_pretrained(path)
    return path


def sync_dev(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def wall_ms(fn: Any, reps: int, device: torch.device, warmup: int = 2) -> tuple[float, list[float]]:
    """Median host wall time (ms) of fn(), synchronised before and after each call."""
    for _ in range(warmup):
        fn()
        sync_dev(device)
    times = []
    for _ in range(reps):
        sync_dev(device)
        t0 = time.perf_counter()
        fn()
        sync_dev(device)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times), times


def event_ms(fn: Any, reps: int, warmup: int = 2) -> float:
    """Median CUDA-event time (ms) of fn() on the current stream."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        torch.cuda.synchronize()
        times.append(s.elapsed_time(e))
    return statistics.median(times)


# ---- the engine process ---------------------------------------------------------------------------------

def engine_main(conn: Any, opts: dict[str, Any]) -> None:
    """GPU 1: kora's reference engine (EngineModel + HFEngineServer on HTTP) + the fast-path receivers."""
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    try:
        _engine(conn, opts)
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        raise


def _engine(conn: Any, opts: dict[str, Any]) -> None:
    import transformers
    from aiohttp import web

    from kora_trainer.rollout.engine_model import EngineModel
    from kora_trainer.rollout.hf_server import HFEngineServer
    from kora_trainer.rollout.lora_adapters import LoRAAdapter
    from kora_trainer.sync import fast
    from kora_trainer.sync.group import free_port, init_weight_update_group

    cuda = opts["device"] == "cuda"
    if cuda:  # every thread of the engine (HTTP handlers, the sync executor) must see this GPU as its device 0
        os.environ["CUDA_VISIBLE_DEVICES"] = str(opts["engine_gpu"])
        torch.cuda.set_device(0)
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    cfg = transformers.AutoConfig.from_pretrained(opts["model_dir"])
    t0 = time.perf_counter()
    with torch.device(device):  # random init on the GPU; no checkpoint is read
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model.eval()
    build_s = time.perf_counter() - t0
    transformers.AutoModelForCausalLM.from_pretrained = lambda *a, **k: model  # EngineModel takes this one
    engine = EngineModel(opts["model_dir"], "cuda" if cuda else "cpu", "bfloat16")
    server = HFEngineServer(engine)
    port = free_port()
    loop = asyncio.new_event_loop()

    def serve() -> None:
        asyncio.set_event_loop(loop)
        runner = web.AppRunner(server.app(), access_log=None)
        loop.run_until_complete(runner.setup())
        loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", port).start())
        loop.run_forever()

    threading.Thread(target=serve, daemon=True).start()
    conn.send(("ready", {"url": f"http://127.0.0.1:{port}", "build_s": build_s}))
    group = init_weight_update_group("127.0.0.1", opts["fast_port"], 1, 2, "kora_fast", opts["backend"])
    params = dict(engine.model.named_parameters())
    receivers: dict[str, fast.PipelinedReceiver] = {}
    ring: fast.AdapterRing | None = None
    raw_bufs: list[torch.Tensor] = []
    while True:
        cmd, arg = conn.recv()
        info: dict[str, Any] = {}
        if cmd == "stop":
            conn.send(("done", {}))
            break
        if cmd == "plan":
            receivers[arg["name"]] = fast.PipelinedReceiver(arg["metadata"], params, group)
        elif cmd == "merge":
            r = receivers[arg["name"]]
            for _ in range(arg["reps"]):
                r.receive()
                fast.ack(group)
            sync_dev(device)
        elif cmd == "raw":
            if not raw_bufs or raw_bufs[0].numel() < max(arg["sizes"]):
                raw_bufs = [torch.empty(max(arg["sizes"]), dtype=torch.uint8, device=device) for _ in range(2)]
            for _ in range(arg["reps"]):
                for i, n in enumerate(arg["sizes"]):
                    group.broadcast(raw_bufs[i % 2][:n], src=0)
                fast.ack(group)
            sync_dev(device)
        elif cmd == "adapter_plan":
            ring = fast.AdapterRing(arg["metadata"], device, {"*": arg["scaling"]})
        elif cmd == "adapter":
            assert ring is not None
            for i in range(arg["reps"]):
                weights = ring.receive(group)
                adapter = LoRAAdapter("kora-policy", "__distributed__", ring.rank, weights, arg["config"],
                                      str(arg["version"] + i))
                server.adapters._register(adapter, upsert=True)  # served from the next request on
                fast.ack(group)
            sync_dev(device)
            info["loaded"] = server.adapters.loaded()
        elif cmd == "allreduce":
            for _ in range(arg["reps"]):
                t = torch.zeros(1, device=device)
                group.allreduce_max(t)
            sync_dev(device)
        elif cmd == "get":
            info["tensors"] = {n: params[n].detach().cpu() for n in arg["names"]}
        conn.send(("done", info))


class Engine:
    def __init__(self, opts: dict[str, Any]):
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=engine_main, args=(child, opts), daemon=True)
        self.proc.start()
        self.info = self.wait("ready", timeout=900)

    def wait(self, what: str = "done", timeout: float = 600) -> dict[str, Any]:
        if not self.conn.poll(timeout):
            raise TimeoutError(f"engine did not answer {what} within {timeout}s")
        kind, info = self.conn.recv()
        if kind == "error":
            raise RuntimeError(f"engine failed:\n{info}")
        assert kind == what, (kind, what)
        return info

    def send(self, cmd: str, **arg: Any) -> None:
        self.conn.send((cmd, arg))

    def call(self, cmd: str, **arg: Any) -> dict[str, Any]:
        self.send(cmd, **arg)
        return self.wait()

    def stop(self) -> None:
        try:
            self.call("stop")
        finally:
            self.proc.join(timeout=30)
            if self.proc.is_alive():
                self.proc.terminate()


# ---- the trainer ----------------------------------------------------------------------------------------

class Trainer:
    """The policy on GPU 0: megatron GPTModel (random init) or HF Qwen3 + kora LoRA, adapter flattened."""

    def __init__(self, kind: str, dims: dict[str, Any], rank: int, alpha: float, device: torch.device, seed: int = 0):
        from kora_trainer.config import LoRASpec
        from kora_trainer.sync.fast import flatten_parameters

        self.kind, self.device = kind, device
        self.cfg = hf_config(dims)
        self.spec = LoRASpec.model_validate({"rank": rank, "alpha": alpha,
                                             "targetModules": ["linear_qkv", "linear_proj"]})
        torch.manual_seed(seed)
        if kind == "megatron":
            from kora_trainer.backends.megatron.convert import layout_from_hf_config
            from kora_trainer.backends.megatron.lora import adapter_parameters, apply_lora
            from kora_trainer.backends.megatron.model import build_gpt_model
            from kora_trainer.backends.megatron.parallel import init_parallel

            init_parallel(1, seed)
            self.layout = layout_from_hf_config(self.cfg)
            self.model = build_gpt_model(self.cfg, torch.bfloat16, init=True)
            apply_lora(self.model, self.spec, seed=seed)
            self.params = adapter_parameters(self.model)
        else:
            from transformers import AutoModelForCausalLM

            from kora_trainer.lora import adapter_parameters, apply_lora

            with torch.device(device):
                self.model = AutoModelForCausalLM.from_config(self.cfg, dtype=torch.bfloat16)
            apply_lora(self.model, self.spec)
            self.params = adapter_parameters(self.model)
        self.model.eval()
        with torch.no_grad():  # a trained-looking adapter (B = 0 would make every fold a copy)
            g = torch.Generator(device="cpu").manual_seed(seed + 1)
            for p in self.params:
                if p.shape[1] == rank:  # B [out, r]
                    p.copy_(torch.randn(p.shape, generator=g).to(p.dtype) * 0.01)
        self.flat = flatten_parameters(self.params)
        self.scaling = alpha / rank

    def merge_entries(self, merged: bool = True) -> list[Any]:
        from kora_trainer.sync.fast import FoldEntry, PlainEntry

        if self.kind == "megatron":
            from kora_trainer.backends.megatron.sync import merge_entries

            return merge_entries(self.model, self.layout, merged)
        from kora_trainer.lora import hf_name, lora_modules

        wrapped = {f"{n}.base_layer.weight": m for n, m in lora_modules(self.model).items()}
        out: list[Any] = []
        for name, p in self.model.named_parameters():
            if ".lora_A." in name or ".lora_B." in name:
                continue
            m = wrapped.get(name)
            if merged and m is not None and m.enabled:
                out.append(FoldEntry([(hf_name(name), tuple(p.shape))], p.detach(), m.lora_A.weight.detach(),
                                     m.lora_B.weight.detach(), m.scaling))
            else:
                out.append(PlainEntry(hf_name(name), p.detach()))
        return out

    def adapter_specs(self) -> list[Any]:
        from kora_trainer.sync.fast import GatherSpec

        if self.kind == "megatron":
            from kora_trainer.backends.megatron.sync import adapter_specs

            return adapter_specs(self.model, self.layout)
        from kora_trainer.lora import adapter_pairs

        return [GatherSpec(n, t) for pair in adapter_pairs(self.model) for n, t in pair]

    def peft_config(self) -> dict[str, Any]:
        if self.kind == "megatron":
            from kora_trainer.backends.megatron.export import peft_config

            return peft_config(self.model, self.spec, "random-qwen3")
        from kora_trainer.lora import peft_config_dict

        return peft_config_dict(self.model, self.spec, "random-qwen3")

    def hf_adapter(self) -> dict[str, torch.Tensor]:
        """The adapter under HF-PEFT names the way the HTTP path exports it (per push)."""
        if self.kind == "megatron":
            from kora_trainer.backends.megatron.export import hf_adapter_tensors

            return hf_adapter_tensors(self.model, self.layout)
        from kora_trainer.lora import adapter_tensors

        return dict(adapter_tensors(self.model))

    def logprobs(self, ids: torch.Tensor) -> torch.Tensor:
        """[B, L-1] log p(token t+1 | <= t)."""
        if self.kind == "megatron":
            from kora_trainer.backends.megatron.backend import token_logprobs

            return token_logprobs(self.model, ids)
        logits = self.model(input_ids=ids).logits[:, :-1].float()
        return torch.log_softmax(logits, -1).gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)

    def reference_hf(self, names: list[str]) -> dict[str, torch.Tensor]:
        """fold_reference (torch, fp32 addmm) of the tensors named, under HF names: the check of (b)."""
        from kora_trainer.kernels.fold import fold_reference

        out: dict[str, torch.Tensor] = {}
        for e in self.merge_entries(True):
            outs = [n for n, _ in e.outs] if hasattr(e, "outs") else [e.name]
            if not set(outs) & set(names):
                continue
            if hasattr(e, "outs"):
                w = fold_reference(e.w, e.a, e.b, e.scale) if e.a is not None else e.w
                rows = torch.empty_like(w)
                if e.row_map is not None:
                    rows[e.row_map.long()] = w
                else:
                    rows = w
                start = 0
                for n, shape in e.outs:
                    out[n] = rows[start:start + shape[0]].cpu()
                    start += shape[0]
            else:
                out[e.name] = e.src.cpu()
        return {n: out[n] for n in names}


def run(args: argparse.Namespace) -> dict[str, Any]:
    from kora_trainer.kernels.fold import FoldItem, GroupedFold, fold
    from kora_trainer.sync import fast
    from kora_trainer.sync.group import free_port, init_weight_update_group

    cuda = not args.cpu_smoke
    dims = TINY if args.cpu_smoke else QWEN3_4B
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(0)
    backend = "nccl" if cuda else "gloo"
    res: dict[str, Any] = {"bench": "gpu_sync", "trainer": args.trainer, "model": "qwen3-4b-shaped (random)"
                           if cuda else "tiny (cpu smoke)", "dims": dims, "rank": args.rank, "alpha": args.alpha,
                           "targets": ["linear_qkv", "linear_proj"], "bucket_cap_mib": args.cap_mib,
                           "reps": args.reps, "errors": {}}
    res.update(versions())
    tmp = Path(args.workdir)
    model_dir = write_model_dir(tmp / "model", dims)
    fast_port = free_port()
    t0 = time.perf_counter()
    engine = None
    if not args.no_engine:
        engine = Engine({"device": "cuda" if cuda else "cpu", "engine_gpu": 1, "model_dir": str(model_dir),
                         "fast_port": fast_port, "backend": backend})
        signal.signal(signal.SIGTERM, lambda *_: (engine.proc.terminate(), sys.exit(143)))  # `timeout` ends both
        res["engine_build_s"] = round(engine.info["build_s"], 1)
    trainer = Trainer(args.trainer, dims, args.rank, args.alpha, device)
    # without an engine (one GPU): a group of one, so that the packing paths run and can be timed alone
    group = init_weight_update_group("127.0.0.1", fast_port, 0, 1 if engine is None else 2, "kora_fast", backend)
    res["setup_s"] = round(time.perf_counter() - t0, 1)
    cap = args.cap_mib * MIB
    reps = args.reps

    only = set(args.only.split(",")) if args.only else None

    def phase(name: str, fn: Any) -> None:
        if only is not None and name not in only:
            return
        t = time.perf_counter()
        try:
            fn()
        except Exception:
            res["errors"][name] = traceback.format_exc()[-3000:]
            print(f"[{name}] FAILED\n{res['errors'][name]}", flush=True)
        res.setdefault("phase_s", {})[name] = round(time.perf_counter() - t, 1)
        print(f"[{name}] {res['phase_s'][name]} s", flush=True)

    # (b) merge sync vs raw broadcast --------------------------------------------------------------------
    plan = fast.MergePlan(trainer.merge_entries(True), cap)
    sizes = [b.nbytes for b in plan.buckets]
    res["model_bytes"] = plan.nbytes
    res["merge_buckets"] = len(sizes)

    def raw() -> None:
        bufs = [torch.empty(max(sizes), dtype=torch.uint8, device=device) for _ in range(2)]
        for b in bufs:
            b.random_(0, 255)

        def once() -> None:
            for i, n in enumerate(sizes):
                group.broadcast(bufs[i % 2][:n], src=0)
            fast.ack(group)

        engine.send("raw", sizes=sizes, reps=reps + 2)
        res["broadcast_ms"], res["broadcast_all_ms"] = wall_ms(once, reps, device)
        engine.wait()
        res["broadcast_gbps"] = plan.nbytes / (res["broadcast_ms"] / 1e3) / 1e9

    def merge() -> None:
        sender = fast.PipelinedSender(plan, group, fold_kw=fold_kw)
        engine.call("plan", name="merged", metadata=plan.metadata)

        def once() -> None:
            sender.push()
            fast.ack(group)

        engine.send("merge", name="merged", reps=reps + 2)
        res["merge_sync_ms"], res["merge_sync_all_ms"] = wall_ms(once, reps, device)
        engine.wait()
        res["merge_sync_vs_broadcast"] = res["merge_sync_ms"] / res["broadcast_ms"]
        res["merge_fold_launches_per_bucket"] = [len(f.launches) for f in sender.folds][:4]
        # the merged weights on the engine vs torch's fp32 addmm fold (layer 0 q/k/v/o, and the embedding)
        names = ["model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight",
                 "model.layers.0.self_attn.v_proj.weight", "model.layers.0.self_attn.o_proj.weight",
                 "model.layers.0.mlp.up_proj.weight", "model.norm.weight"]
        got = engine.call("get", names=names)["tensors"]
        want = trainer.reference_hf(names)
        res["merge_engine_equal_fraction"] = {n.split(".")[-2]:
                                              float((got[n] == want[n]).float().mean()) for n in names}
        res["merge_engine_max_abs"] = max(float((got[n].float() - want[n].float()).abs().max()) for n in names)
        # the pack alone (fold + copies into the ring buckets, no broadcast), and the broadcast alone
        if cuda:
            res["merge_pack_only_ms"] = event_ms(lambda: [sender.fill(i) for i in range(len(sizes))], reps)

    fold_kw = dict(block_m=args.block_m, block_n=args.block_n, num_warps=args.num_warps, streams=args.fold_streams)
    def pack_only() -> None:  # the merge fill (grouped fold + copies into the ring buckets), no broadcast
        sender = fast.PipelinedSender(plan, group, fold_kw=fold_kw)
        if cuda:
            res["merge_pack_only_ms"] = event_ms(lambda: [sender.fill(i) for i in range(len(sizes))], reps)
            res["merge_pack_only_tbps"] = 2 * plan.nbytes / (res["merge_pack_only_ms"] / 1e3) / 1e12

    if engine is not None:
        phase("raw_broadcast", raw)
        phase("merge_sync", merge)
    else:
        phase("pack_only", pack_only)

    # (c) fold throughput vs copy --------------------------------------------------------------------------
    def fold_bench() -> None:
        entries = [e for e in trainer.merge_entries(True) if isinstance(e, fast.FoldEntry)]
        nbytes = sum(e.nbytes for e in entries)
        dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
        src = torch.empty(nbytes, dtype=torch.uint8, device=device)
        items, off = [], 0
        for e in entries:
            items.append(FoldItem(e.w, dst[off:off + e.nbytes].view(e.dtype).view(e.w.shape), e.a, e.b, e.scale,
                                  e.row_map))
            off += e.nbytes
        res["fold_tensors"] = len(items)
        res["fold_bytes"] = nbytes
        if not cuda:
            GroupedFold(items)()
            return
        copy = event_ms(lambda: dst.copy_(src), reps)
        res["copy_ms"] = copy
        res["copy_tbps"] = 2 * nbytes / (copy / 1e3) / 1e12
        res["copy_per_tensor_ms"] = event_ms(lambda: [i.out.copy_(i.w) for i in items], reps)
        res["fold_per_tensor_ms"] = event_ms(
            lambda: [fold(i.w, i.a, i.b, i.scale, out=i.out, row_map=i.row_map) for i in items], reps)
        sweep = {}
        configs = [(64, 128, 4, "graph", 1), (64, 128, 4, "graph", 2), (64, 128, 4, "graph", 4),
                   (64, 128, 4, "graph", 8), (64, 256, 4, "graph", 4), (128, 128, 8, "graph", 4),
                   (32, 256, 4, "graph", 4), (32, 128, 4, "graph", 4), (64, 64, 4, "graph", 8),
                   (64, 256, 4, "grouped", 0), (64, 128, 4, "grouped", 0)]
        best = None
        for bm, bn, nw, launch, streams in configs:
            key = f"{launch}{streams if launch == 'graph' else ''}_{bm}x{bn}_w{nw}"
            try:
                gf = GroupedFold(items, block_m=bm, block_n=bn, num_warps=nw, launch=launch, streams=streams)
                ms = event_ms(gf, reps)
                sweep[key] = round(copy / ms, 3)
                if best is None or ms < best[1]:
                    best = (key, ms, gf)
            except Exception as e:  # a configuration may not compile (shared memory)
                sweep[key] = f"{type(e).__name__}: {str(e)[:120]}"
        # the QKV row map applied row by row instead of block by block (what the block mode saves)
        res["fold_rowwise_map_ms"] = event_ms(GroupedFold(items, map_modes=False, **fold_kw), reps)
        res["fold_sweep_vs_copy"] = sweep
        default = GroupedFold(items, **fold_kw)
        res["fold_grouped_default_ms"] = event_ms(default, reps)
        if best is not None:
            res["fold_best_config"] = best[0]
            res["fold_ms"] = best[1]
            res["fold_vs_copy"] = copy / best[1]
            res["fold_tbps"] = 2 * nbytes / (best[1] / 1e3) / 1e12
            best[2]()
        # the grouped fold equals torch's fp32 addmm fold (then the same row placement)
        eq, worst = [], 0.0
        for it in items[:8]:
            ref = FoldItem(it.w, torch.empty_like(it.out), it.a, it.b, it.scale, it.row_map)
            ref.reference()
            eq.append(float((ref.out == it.out).float().mean()))
            worst = max(worst, float((ref.out.float() - it.out.float()).abs().max()))
        res["fold_equal_to_fp32_addmm"] = min(eq)
        res["fold_max_abs_vs_fp32_addmm"] = worst

    phase("fold", fold_bench)

    # the base on the engine (Adapter mode's first sync), so that engine + adapter = the trainer's policy
    def base_push() -> None:
        base_plan = fast.MergePlan(trainer.merge_entries(False), cap)
        sender = fast.PipelinedSender(base_plan, group, fold_kw=fold_kw)
        engine.call("plan", name="base", metadata=base_plan.metadata)
        engine.send("merge", name="base", reps=1)
        sender.push()
        fast.ack(group)
        sync_dev(device)
        engine.wait()

    if engine is not None:
        phase("base_push", base_push)

    # (a) adapter push vs raw broadcast; (d) delta-skip -----------------------------------------------------
    pack = fast.AdapterPack(trainer.params, trainer.adapter_specs(), cap)
    res["adapter_bytes"] = pack.out.numel() * pack.out.element_size()
    res["adapter_params"] = trainer.flat.numel()
    config = trainer.peft_config()
    delta = fast.FlatDelta(trainer.flat)
    noise = torch.randn(trainer.flat.shape, device=device, dtype=trainer.flat.dtype) * 1e-3

    def adapter() -> None:
        engine.call("adapter_plan", metadata=pack.metadata, scaling=trainer.scaling)
        abytes = pack.pack()
        araw = torch.empty_like(abytes).random_(0, 255)

        def raw_once() -> None:
            for start, end in pack.bounds:
                group.broadcast(araw[start:end], src=0)
            fast.ack(group)

        engine.send("raw", sizes=[e - s for s, e in pack.bounds], reps=reps + 2)
        res["adapter_broadcast_ms"], _ = wall_ms(raw_once, reps, device)
        engine.wait()
        times = []
        engine.send("adapter", reps=reps + 2, version=1, config=config)
        for i in range(reps + 2):
            with torch.no_grad():
                trainer.flat.add_(noise)  # the optimizer step
            sync_dev(device)  # "trainer step done"
            t = time.perf_counter()
            pack.push(group)
            fast.ack(group)
            sync_dev(device)
            if i >= 2:
                times.append((time.perf_counter() - t) * 1e3)
        info = engine.wait()
        res["adapter_push_ms"] = statistics.median(times)
        res["adapter_push_all_ms"] = times
        res["adapter_push_vs_broadcast"] = res["adapter_push_ms"] / res["adapter_broadcast_ms"]
        res["adapter_engine_loaded"] = info.get("loaded")
        if cuda:
            res["adapter_pack_only_ms"] = event_ms(pack.pack, reps)

    def delta_skip() -> None:
        delta.mark_pushed(trainer.flat)
        with torch.no_grad():
            trainer.flat.add_(noise)
        local = []
        for _ in range(reps + 2):
            sync_dev(device)
            t = time.perf_counter()
            push, value = delta.should_push(trainer.flat, 1e-6, None)
            local.append((time.perf_counter() - t) * 1e3)
        res["delta_skip_local_ms"] = statistics.median(local[2:])
        if engine is not None:
            engine.send("allreduce", reps=reps + 2)
            coll = []
            for _ in range(reps + 2):
                sync_dev(device)
                t = time.perf_counter()
                push, value = delta.should_push(trainer.flat, 1e-6, group)
                coll.append((time.perf_counter() - t) * 1e3)
            engine.wait()
            res["delta_skip_ms"] = statistics.median(coll[2:])  # with the MAX all-reduce over 2 GPUs
        res["delta_skip_decision"] = {"push": push, "max_delta": value}
        # the old per-tensor tracker (sync/delta.py) on the same adapter, for comparison
        from kora_trainer.sync.delta import DeltaTracker

        named = [(str(i), p.detach()) for i, p in enumerate(trainer.params)]
        tracker = DeltaTracker()
        tracker.mark_pushed(named)
        res["delta_skip_per_tensor_ms"], _ = wall_ms(lambda: tracker.local_max_delta(named), reps, device)

    def adapter_pack_only() -> None:
        if cuda:
            res["adapter_pack_only_ms"] = event_ms(pack.pack, reps)

    if engine is not None:
        phase("adapter_push", adapter)
    else:
        phase("adapter_pack_only", adapter_pack_only)
    phase("delta_skip", delta_skip)

    # the engine serves the pushed adapter: its log-probs (HTTP /generate, lora_path) vs the trainer's policy
    def serving_check() -> None:
        from kora_trainer.rollout.client import EngineClient

        with torch.no_grad():
            trainer.flat.add_(noise)
        engine.send("adapter", reps=1, version=100, config=config)
        pack.push(group)
        fast.ack(group)
        sync_dev(device)
        engine.wait()
        prompts = [[1, 4, 5, 13, 6, 7, 14], [1, 12, 13, 3, 14]]
        with EngineClient(engine.info["url"], timeout=300) as c:
            outs = c.generate(prompts, {"max_new_tokens": 4, "temperature": 0.0, "ignore_eos": True},
                              lora_path="kora-policy")
            base = c.generate(prompts, {"max_new_tokens": 4, "temperature": 0.0, "ignore_eos": True})
        worst, base_gap = 0.0, 0.0
        for prompt, out, b in zip(prompts, outs, base, strict=True):
            ids = torch.tensor([prompt + list(out.output_ids)], device=device)
            with torch.no_grad():
                lp = trainer.logprobs(ids)[0, len(prompt) - 1:].float().cpu()
            worst = max(worst, max(abs(x - float(y)) for x, y in zip(out.output_logprobs, lp, strict=True)))
            base_gap = max(base_gap, max(abs(x - y) for x, y in zip(out.output_logprobs, b.output_logprobs,
                                                                     strict=True)))
        res["serving_logprob_max_abs_vs_trainer"] = worst  # bf16 both sides: megatron vs HF kernels
        res["serving_adapter_vs_base_logprob_gap"] = base_gap
        res["serving_weight_version"] = outs[0].weight_version

    if engine is not None:
        phase("serving_check", serving_check)

    # (a') the adapter through the HTTP route (what WeightSender does today), same engine --------------------
    def http_adapter() -> None:
        from kora_trainer.rollout.client import EngineClient
        from kora_trainer.sync.protocol import FLAT, plan_buckets
        from kora_trainer.sync.protocol import pack as pack_bucket

        with EngineClient(engine.info["url"], timeout=300) as c:
            port = free_port()
            fut = c.submit(c.init_weights_update_group, "127.0.0.1", port, 1, 2, "weight_update_group", backend)
            hgroup = init_weight_update_group("127.0.0.1", port, 0, 2, "weight_update_group", backend)
            fut.result(timeout=120)
            times = []
            for i in range(max(3, reps // 2) + 1):
                with torch.no_grad():
                    trainer.flat.add_(noise)
                sync_dev(device)
                t = time.perf_counter()
                tensors = trainer.hf_adapter()
                pairs: dict[str, list] = {}
                for n, tt in tensors.items():
                    pairs.setdefault(n.split(".lora_")[0], []).append((n, tt))
                buckets = plan_buckets(list(pairs.values()), cap)
                for bi, bucket in enumerate(buckets):
                    f = c.submit(c.load_lora_adapter_from_distributed, "kora-http", config, bucket.metadata(),
                                 bucket_index=bi, num_buckets=len(buckets), load_format=FLAT,
                                 weight_version=str(i))
                    hgroup.broadcast(pack_bucket(bucket, tensors, device), src=0)
                    out = f.result(timeout=300)
                assert out["success"], out
                if i >= 1:
                    times.append((time.perf_counter() - t) * 1e3)
            c.destroy_weights_update_group("weight_update_group")
        res["adapter_push_http_ms"] = statistics.median(times)
        res["adapter_push_http_all_ms"] = times

    if engine is not None and not args.no_http:
        phase("adapter_push_http", http_adapter)
    if engine is not None:
        engine.stop()

    # (e) LoRA vs full fine-tuning -----------------------------------------------------------------------------
    def finetune() -> None:
        g = torch.Generator(device="cpu").manual_seed(3)
        b, length = (args.ft_batch, args.ft_len) if cuda else (2, 16)
        ids = torch.randint(0, dims["vocab_size"], (b, length), generator=g).to(device)
        adv = torch.randn(b, length - 1, generator=g).to(device)

        def measure(params: list[torch.nn.Parameter], label: str) -> None:
            opt = torch.optim.AdamW(params, lr=1e-5, weight_decay=0.0)

            def step() -> None:
                lp = trainer.logprobs(ids)
                loss = -(lp * adv).mean()
                loss.backward()
                torch.nn.utils.clip_grad_norm_(params, 1.0)
                opt.step()
                opt.zero_grad(set_to_none=True)

            step()  # the optimizer state exists from here on
            sync_dev(device)
            if cuda:
                torch.cuda.reset_peak_memory_stats(device)
                before = torch.cuda.memory_allocated(device)
            ms, _ = wall_ms(step, max(3, reps // 3), device, warmup=1)
            state = sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values()
                        if isinstance(t, torch.Tensor))
            res[f"{label}_step_ms"] = ms
            res[f"{label}_trainable_params"] = sum(p.numel() for p in params)
            res[f"{label}_optimizer_state_bytes"] = state
            if cuda:
                res[f"{label}_peak_allocated_bytes"] = torch.cuda.max_memory_allocated(device)
                res[f"{label}_resident_before_step_bytes"] = before

        res["ft_batch"] = [b, length]
        measure(list(trainer.params), "lora")
        # full fine-tuning: every base weight trains, the adapter is switched off and frozen
        if trainer.kind == "megatron":
            from kora_trainer.backends.megatron.lora import lora_modules
        else:
            from kora_trainer.lora import lora_modules
        for m in lora_modules(trainer.model).values():
            m.enabled = False
        for p in trainer.params:
            p.requires_grad_(False)
        base = [p for n, p in trainer.model.named_parameters() if ".lora_" not in n]
        for p in base:
            p.requires_grad_(True)
        trainer.model.train()
        measure(base, "full")
        res["full_vs_lora_step_time"] = res["full_step_ms"] / res["lora_step_ms"]
        res["full_vs_lora_optimizer_state"] = res["full_optimizer_state_bytes"] / res["lora_optimizer_state_bytes"]
        res["ft_note"] = ("torch.optim.AdamW on the parameters in their own dtype (bf16: exp_avg, exp_avg_sq in "
                          "bf16); loss = -(token log-prob x random advantage).mean(); grad clip 1.0")

    if not args.no_ft:
        phase("finetune", finetune)
    return res


def versions() -> dict[str, Any]:
    out: dict[str, Any] = {"torch": torch.__version__, "python": sys.version.split()[0]}
    for mod in ("triton", "transformers", "megatron.core", "megatron.core.package_info"):
        try:
            m = __import__(mod, fromlist=["x"])
            out[mod.replace(".", "_")] = getattr(m, "__version__", "?")
        except Exception as e:
            out[mod.replace(".", "_")] = f"unavailable ({type(e).__name__})"
    if torch.cuda.is_available():
        out["device"] = torch.cuda.get_device_name(0)
        out["gpus"] = torch.cuda.device_count()
        out["cuda"] = torch.version.cuda
        try:
            v = torch.cuda.nccl.version()
            out["nccl"] = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
            import subprocess

            out["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                           capture_output=True, text=True, timeout=30).stdout.split()[0]
            topo = subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True, timeout=30).stdout
            out["link"] = " ".join(topo.splitlines()[1].split()[:3]) if topo else None
        except Exception:
            out["driver"] = None
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trainer", choices=["megatron", "hf"], default="megatron")
    ap.add_argument("--rank", type=int, default=32)
    ap.add_argument("--alpha", type=float, default=64.0)
    ap.add_argument("--cap-mib", type=int, default=512, help="sync.bufferSize in MiB")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--block-m", type=int, default=64)
    ap.add_argument("--block-n", type=int, default=128)
    ap.add_argument("--num-warps", type=int, default=4)
    ap.add_argument("--fold-streams", type=int, default=4, help="parallel branches of the captured fold graph")
    ap.add_argument("--ft-batch", type=int, default=8)
    ap.add_argument("--ft-len", type=int, default=512)
    ap.add_argument("--no-ft", action="store_true")
    ap.add_argument("--no-http", action="store_true")
    ap.add_argument("--no-engine", action="store_true", help="one GPU: fold, packing, delta-skip, fine-tuning only")
    ap.add_argument("--only", default=None, help="comma-separated phases to run (default: all)")
    ap.add_argument("--cpu-smoke", action="store_true")
    ap.add_argument("--workdir", default="/tmp/kora-gpu-sync")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    res = run(args)
    res["command"] = "python bench/gpu_sync.py " + " ".join(sys.argv[1:])
    res["date"] = time.strftime("%Y-%m-%d")
    text = json.dumps(res, indent=2, default=str)
    if args.out:
        Path(args.out).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
