"""Weight sync near NVLink speed: trainer on GPU 0, engine on GPU 1, one NCCL weight-update group (issue 7);
with `--tp T --engines N` (issue 8) a tensor-parallel trainer on GPUs 0..T-1 fanning out to N engines.

A random-initialised Qwen3-4B-shaped model (no checkpoint is read): the trainer is the megatron-core policy
(`--trainer megatron`, default; `--trainer hf` = HF Qwen3 + kora's torch LoRA) with a rank-32 LoRA on
linear_qkv + linear_proj; the engine is kora's reference engine (`kora_engine.lm.server`: EngineModel + the HTTP
routes, its HF model built from the same config in the engine process) plus the fast-path receivers of
`sync/fast/plan.py`. Everything below is measured in ONE run, each number the median of --reps:

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

Tensor parallel (`--tp T`, megatron only): T trainer processes (this one is TP rank 0 on GPU 0, the others are
spawned on GPUs 1..T-1; megatron parallel_state's TP group). Every TP rank runs the same phases; only TP rank 0
talks to the engines. In (a) and (b) each rank's shards are gathered to TP rank 0 inside the push
(`plan.PipelinedSender` / `adapter_pack.AdapterPack` with the TP group), (c) folds TP rank 0's shards, (d)'s MAX runs
over the TP group, the HTTP adapter path gathers through `export.hf_adapter_tensors`.
Engines (`--engines N`): engine i on GPU T+i (fewer GPUs: wrapped onto the trainer's GPUs other than GPU 0,
with a warning — TP rank 0 and the engines share the weight-update group and NCCL refuses two ranks of one
communicator on one GPU); one weight-update group of TP rank 0 + the N engines carries every push (an ack is
then a MAX all-reduce: every engine done). `engines_scaling`: (a), (b) and the HTTP adapter path with the
first k engines, k = 1..N (a group per k), so the growth from one engine to N is measured in the same run.

    PYTHONPATH=trainer:engine:tests NCCL_NVLS_ENABLE=0 python bench/gpu_sync.py [--out FILE]     # 2 GPUs: everything
    python bench/gpu_sync.py --tp 2 --engines 2      # 4 GPUs (2 GPUs: --tp 2 --engines 1 shares GPU 1)
    python bench/gpu_sync.py --no-engine      # 1 GPU: (c), the packing halves of (a)/(b), local (d), (e)
    python bench/gpu_sync.py --cpu-smoke --trainer hf   # tiny model, gloo, CPU: the plumbing only (numbers
                                                        # meaningless; megatron-core needs CUDA)

Results: bench/results/gpu_sync_*.json (with --tp / --engines: gpu_sync_tp{T}_engines{N}_<date>.json, the
name printed as `result_file`); discussion in docs/megatron_backend.md.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import os
import signal
import statistics
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
for p in (ROOT / "trainer", ROOT / "tests", ROOT / "bench"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

from _engine_proc import EngineProc, Handler, guarded, serve_commands, start_reference_engine  # noqa: E402
from _timing import event_ms, loop_ms, run_phase, sync_dev, wall_ms  # noqa: E402

QWEN3_4B = dict(hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32,
                num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True,
                max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1_000_000.0)
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, vocab_size=32, tie_word_embeddings=True,
            max_position_embeddings=256, rms_norm_eps=1e-6, rope_theta=10000.0)
MIB = 1 << 20
# what `engines_scaling` reports per engine count
SCALING_KEYS = ("broadcast_ms", "broadcast_gbps", "merge_sync_ms", "merge_sync_vs_broadcast", "adapter_broadcast_ms",
                "adapter_push_ms", "adapter_push_vs_broadcast", "adapter_push_http_ms")


def engine_gpus(tp: int, engines: int, ngpus: int) -> tuple[list[int], str | None]:
    """(GPU of each engine, a warning or None). The trainer's TP ranks hold GPUs 0..tp-1; engine i goes on GPU
    tp+i. With fewer GPUs the engines wrap onto the trainer's GPUs in that order, skipping GPU 0: TP rank 0
    and every engine are ranks of ONE weight-update group, and NCCL refuses two ranks of a communicator on one
    GPU (so the engines also need distinct GPUs). Raises ValueError when that cannot be had."""
    if tp < 1 or engines < 0:
        raise ValueError(f"--tp {tp} / --engines {engines}: need tp >= 1, engines >= 0")
    if ngpus < tp:
        raise ValueError(f"--tp {tp} needs {tp} GPUs (one per TP rank); {ngpus} visible")
    if tp + engines <= ngpus:
        return [tp + i for i in range(engines)], None
    pool = [g for g in ((tp + k) % ngpus for k in range(ngpus)) if g != 0]
    if engines > len(pool):
        raise ValueError(f"{engines} engine(s) need {engines} distinct GPUs other than GPU 0 (TP rank 0 and the "
                         f"engines form one NCCL group: one rank per GPU); {ngpus} visible")
    gpus = pool[:engines]
    shared = sorted(set(gpus) & set(range(tp)))
    return gpus, (f"warning: {tp} trainer GPU(s) + {engines} engine(s) > {ngpus} GPUs: engine(s) on GPU(s) "
                  f"{shared} share them with a trainer TP rank; the numbers include that contention")


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


# ---- the engine process ---------------------------------------------------------------------------------

def engine_main(conn: Any, opts: dict[str, Any]) -> None:
    """GPU opts["engine_gpu"]: kora's reference engine (EngineModel + HFEngineServer on HTTP) + the fast-path
    receivers, in every weight-update group {trainer, engines 0..k-1} with k > its index."""
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    guarded(_engine, conn, opts)


def _engine(conn: Any, opts: dict[str, Any]) -> None:
    serve_commands(conn, SyncEngine(conn, opts).handlers())


class SyncEngine:
    """The engine process's side: kora's reference engine, its weight-update groups by k (TP rank 0 + engines
    0..k-1; a command's "k" picks one, default the largest) and what the trainer planned on it. One method per
    command (`handlers`); "ready" goes to the bench before the groups are joined (the trainer makes them after)."""

    def __init__(self, conn: Any, opts: dict[str, Any]):
        from kora_trainer.wire.group import init_weight_update_group

        cuda = opts["device"] == "cuda"
        if cuda:  # every thread of the engine (HTTP handlers, the sync executor) must see this GPU as its device 0
            os.environ["CUDA_VISIBLE_DEVICES"] = str(opts["engine_gpu"])
            torch.cuda.set_device(0)
        self.device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
        self.engine, self.server, url, build_s = start_reference_engine(opts["model_dir"], self.device)
        conn.send(("ready", {"url": url, "build_s": build_s}))
        rank = opts["index"] + 1
        self.groups = {k: init_weight_update_group("127.0.0.1", port, rank, k + 1, f"kora_fast{k}", opts["backend"])
                       for k, port in opts["fast_ports"]}  # in k order, as the trainer makes them
        self.top = max(self.groups)
        self.params = dict(self.engine.model.named_parameters())
        self.receivers: dict[tuple[str, int], Any] = {}  # fast_receive.PipelinedReceiver by (plan name, k)
        self.ring: Any = None  # fast_receive.AdapterRing
        self.raw_bufs: list[torch.Tensor] = []

    def handlers(self) -> dict[str, Handler]:
        return {"plan": self.plan, "merge": self.merge, "raw": self.raw, "adapter_plan": self.adapter_plan,
                "adapter": self.adapter, "allreduce": self.allreduce, "get": self.get}

    def _k(self, arg: dict[str, Any]) -> int:
        return int(arg.get("k", self.top))

    def plan(self, arg: dict[str, Any]) -> None:
        from kora_trainer.wire import fast_receive

        k = self._k(arg)
        self.receivers[(arg["name"], k)] = fast_receive.PipelinedReceiver(arg["metadata"], self.params, self.groups[k])

    def merge(self, arg: dict[str, Any]) -> None:
        from kora_trainer.wire import fast_receive

        k = self._k(arg)
        group, r = self.groups[k], self.receivers[(arg["name"], k)]
        for _ in range(arg["reps"]):
            r.receive()
            fast_receive.ack(group)
        sync_dev(self.device)

    def raw(self, arg: dict[str, Any]) -> None:
        from kora_trainer.wire import fast_receive

        group, sizes = self.groups[self._k(arg)], arg["sizes"]
        if not self.raw_bufs or self.raw_bufs[0].numel() < max(sizes):
            self.raw_bufs = [torch.empty(max(sizes), dtype=torch.uint8, device=self.device) for _ in range(2)]
        bufs = self.raw_bufs
        for _ in range(arg["reps"]):
            for i, n in enumerate(sizes):
                group.broadcast(bufs[i % 2][:n], src=0)
            fast_receive.ack(group)
        sync_dev(self.device)

    def adapter_plan(self, arg: dict[str, Any]) -> None:
        from kora_trainer.wire import fast_receive

        self.ring = fast_receive.AdapterRing(arg["metadata"], self.device, {"*": arg["scaling"]})

    def adapter(self, arg: dict[str, Any]) -> dict[str, Any]:
        from kora_engine.lm.lora_adapters import LoRAAdapter
        from kora_trainer.wire import fast_receive

        group, ring, adapters = self.groups[self._k(arg)], self.ring, self.server.adapters
        assert ring is not None
        for i in range(arg["reps"]):
            weights = ring.receive(group)
            adapter = LoRAAdapter("kora-policy", "__distributed__", ring.rank, weights, arg["config"],
                                  str(arg["version"] + i))
            adapters.upsert_built(adapter)  # served from the next request on
            fast_receive.ack(group)
        sync_dev(self.device)
        return {"loaded": adapters.loaded()}

    def allreduce(self, arg: dict[str, Any]) -> None:
        group = self.groups[self._k(arg)]
        for _ in range(arg["reps"]):  # float64, as the trainer's delta decision (adapter_pack.FlatDelta.pending)
            t = torch.zeros(1, dtype=torch.float64, device=self.device)
            group.allreduce_max(t)
        sync_dev(self.device)

    def get(self, arg: dict[str, Any]) -> dict[str, Any]:
        return {"tensors": {n: self.params[n].detach().cpu() for n in arg["names"]}}


def send_all(engines: list[EngineProc], cmd: str, **arg: Any) -> None:
    for e in engines:
        e.send(cmd, **arg)


def wait_all(engines: list[EngineProc]) -> list[dict[str, Any]]:
    return [e.wait() for e in engines]


def call_all(engines: list[EngineProc], cmd: str, **arg: Any) -> list[dict[str, Any]]:
    send_all(engines, cmd, **arg)
    return wait_all(engines)


# ---- the trainer ----------------------------------------------------------------------------------------

class Trainer:
    """The policy on GPU 0: megatron GPTModel (random init) or HF Qwen3 + kora LoRA, adapter flattened. `tp` > 1
    (megatron): this process's TP rank of it (every TP rank builds one; `self.tp` is the TP group)."""

    def __init__(self, kind: str, dims: dict[str, Any], rank: int, alpha: float, device: torch.device, seed: int = 0,
                 tp: int = 1):
        from kora_trainer.config import LoRASpec
        from kora_trainer.sync.fast.adapter_pack import flatten_parameters

        if tp > 1 and kind != "megatron":
            raise ValueError("tensor parallelism needs --trainer megatron")
        self.kind, self.device, self.tp_size = kind, device, tp
        self.tp: Any = None  # the TP group (sync.group.WeightUpdateGroup), None at TP = 1
        self.cfg = hf_config(dims)
        self.spec = LoRASpec.model_validate({"rank": rank, "alpha": alpha,
                                             "targetModules": ["linear_qkv", "linear_proj"]})
        torch.manual_seed(seed)
        if kind == "megatron":
            from kora_trainer.backends.megatron.convert import layout_from_hf_config
            from kora_trainer.backends.megatron.lora import adapter_parameters, apply_lora
            from kora_trainer.backends.megatron.model import build_gpt_model
            from kora_trainer.backends.megatron.parallel import init_parallel
            from kora_trainer.backends.megatron.sync import tp_group

            init_parallel(tp, seed)
            self.tp = tp_group()
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
        with torch.no_grad():  # a trained-looking adapter (B = 0: every fold a copy); the same on every TP rank
            g = torch.Generator(device="cpu").manual_seed(seed + 1)
            for p in self.params:
                if p.shape[1] == rank:  # B [out, r]
                    p.copy_(torch.randn(p.shape, generator=g).to(p.dtype) * 0.01)
        self.flat = flatten_parameters(self.params)
        self.scaling = alpha / rank

    def merge_entries(self, merged: bool = True) -> list[Any]:
        """The model under HF names as the fast path's entries (the product's `merge_entries`): enabled adapters
        folded in when `merged`, the base alone otherwise."""
        if self.kind == "megatron":
            from kora_trainer.backends.megatron.sync import merge_entries

            return merge_entries(self.model, self.layout, merged)
        from kora_trainer.sync.fast.policy import merge_entries as hf_merge_entries

        if merged:
            return hf_merge_entries(self.model)
        with self.adapter_disabled():  # every adapted weight then goes out as its base
            return hf_merge_entries(self.model)

    def adapter_specs(self) -> list[Any]:
        if self.kind == "megatron":
            from kora_trainer.backends.megatron.sync import adapter_specs

            return adapter_specs(self.model, self.layout)
        from kora_trainer.sync.fast.policy import adapter_specs as hf_adapter_specs

        return hf_adapter_specs(self.model)

    def lora_modules(self) -> dict[str, Any]:
        if self.kind == "megatron":
            from kora_trainer.backends.megatron.lora import lora_modules

            return lora_modules(self.model)
        from kora_trainer.lora import lora_modules as hf_lora_modules

        return hf_lora_modules(self.model)

    def adapter_disabled(self) -> contextlib.AbstractContextManager[None]:
        """The base policy from the same weights, for the `with` block (the product's `adapter_disabled`)."""
        if self.kind == "megatron":
            from kora_trainer.backends.megatron.lora import adapter_disabled

            return adapter_disabled(self.model)
        from kora_trainer.lora import adapter_disabled as hf_adapter_disabled

        return hf_adapter_disabled(self.model)

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
        """fold_reference (torch, fp32 addmm) of the tensors named, under HF names: the check of (b). Under TP a
        collective (every TP rank calls it with the same names)."""
        if self.tp is not None:
            return self._reference_hf_tp(names)
        return expected_hf(self.merge_entries(True), names)

    def _reference_hf_tp(self, names: list[str]) -> dict[str, torch.Tensor]:
        """Each rank's shard folded by fold_reference (the shards of the full fold), all-gathered, unfused."""
        from kora_trainer.backends.megatron.convert import REPL, from_megatron_shards, param_maps
        from kora_trainer.backends.megatron.lora import lora_modules
        from kora_trainer.backends.megatron.model import base_param_name
        from kora_trainer.backends.megatron.parallel import gather_tp
        from kora_trainer.kernels.fold import fold_reference

        wrapped = {f"{n}.weight": m for n, m in lora_modules(self.model).items()}
        maps = {pm.megatron: pm for pm in param_maps(self.layout)}
        out: dict[str, torch.Tensor] = {}
        for name, p in self.model.named_parameters():
            base = base_param_name(name)
            if base is None or not set(maps[base].hf) & set(names):
                continue
            pm, m, w = maps[base], wrapped.get(base), p.detach()
            if m is not None and m.enabled:
                w = fold_reference(w, m.lora_A.weight.detach(), m.lora_B.weight.detach(), m.scaling)
            shards = [w] if pm.kind == REPL else gather_tp(w.contiguous())
            for n, t in zip(pm.hf, from_megatron_shards(pm.kind, shards, self.layout), strict=True):
                out[n] = t.cpu()
        return {n: out[n] for n in names}


def expected_hf(entries: list[Any], names: list[str]) -> dict[str, torch.Tensor]:
    """What an engine holds under `names` after a push of `entries` (CPU copies): a FoldEntry as
    `kernels.fold.FoldItem.reference` writes it (torch's fp32 addmm fold, rows placed by the row map) cut into its
    HF tensors, a PlainEntry as it is."""
    from kora_trainer.kernels.fold import FoldItem
    from kora_trainer.sync.fast.plan import FoldEntry

    want = set(names)
    out: dict[str, torch.Tensor] = {}
    for e in entries:
        if isinstance(e, FoldEntry):
            if not {n for n, _ in e.outs} & want:
                continue
            item = FoldItem(e.w, torch.empty_like(e.w), e.a, e.b, e.scale, e.row_map)
            item.reference()
            start = 0
            for n, shape in e.outs:
                out[n] = item.out[start:start + shape[0]].cpu()
                start += shape[0]
        elif e.name in want:
            out[e.name] = e.src.cpu()
    return {n: out[n] for n in names}


def from_leader(obj: Any, tp_size: int) -> Any:
    """TP rank 0's `obj` on every TP rank (the default process group is the trainer's TP ranks)."""
    if tp_size == 1:
        return obj
    import torch.distributed as dist

    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


# ---- one run: set-up, then the phases ---------------------------------------------------------------------

class Aborted(RuntimeError):
    """A phase failed on a TP rank: the ranks' collectives no longer match."""


STATE: dict[str, Any] = {"res": None, "engines": []}  # TP rank 0's results so far and engines (for `watch`)


def run(args: argparse.Namespace, rank: int = 0) -> dict[str, Any]:
    """The whole bench on TP rank `rank` (every TP rank runs it; rank 0 starts and drives the engines and
    returns the results, the other ranks take part in the collectives and their numbers are dropped)."""
    from kora_trainer.wire.ports import free_port

    tp_size, n_eng = args.tp, (0 if args.no_engine else args.engines)
    leader = rank == 0
    cuda = not args.cpu_smoke
    dims = TINY if args.cpu_smoke else QWEN3_4B
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(rank)
    backend = "nccl" if cuda else "gloo"
    res = _results(args, dims, cuda, leader)
    t0 = time.perf_counter()
    engines: list[EngineProc] = STATE["engines"]
    STATE["res"] = res
    fast_ports = {k: free_port() for k in range(1, n_eng + 1)}
    if leader and n_eng:
        _start_engines(args, res, engines, dims, fast_ports, cuda, backend)
    trainer = Trainer(args.trainer, dims, args.rank, args.alpha, device, tp=tp_size)
    groups = _weight_update_groups(leader, n_eng, fast_ports, backend)
    res["setup_s"] = round(time.perf_counter() - t0, 1)
    try:
        _phases(Bench(args, res, rank, trainer, engines, groups, device))
    except Aborted as e:
        res["errors"]["aborted"] = f"phase {e} failed with tensor parallelism: the later phases did not run"
        if not leader:
            raise
    finally:
        for eng in engines:
            with contextlib.suppress(Exception):
                eng.stop()
    return res


def _results(args: argparse.Namespace, dims: dict[str, Any], cuda: bool, leader: bool) -> dict[str, Any]:
    """The run's description, the start of its results."""
    n_eng = 0 if args.no_engine else args.engines
    res: dict[str, Any] = {"bench": "gpu_sync", "trainer": args.trainer, "model": "qwen3-4b-shaped (random)"
                           if cuda else "tiny (cpu smoke)", "dims": dims, "rank": args.rank, "alpha": args.alpha,
                           "targets": ["linear_qkv", "linear_proj"], "bucket_cap_mib": args.cap_mib,
                           "reps": args.reps, "errors": {}}
    if args.tp > 1 or n_eng > 1:
        res.update(tp=args.tp, engines=n_eng)
    if leader:
        res.update(versions())
    return res


def _start_engines(args: argparse.Namespace, res: dict[str, Any], engines: list[EngineProc], dims: dict[str, Any],
                   fast_ports: dict[int, int], cuda: bool, backend: str) -> None:
    """TP rank 0: the N engine processes (engine i in the groups k > i), up and serving."""
    tp_size, n_eng = args.tp, args.engines
    model_dir = Path(args.workdir) / "model"
    write_model_dir(model_dir, dims)
    gpus = engine_gpus(tp_size, n_eng, torch.cuda.device_count())[0] if cuda else [0] * n_eng
    for i in range(n_eng):
        engines.append(EngineProc(engine_main, {
            "device": "cuda" if cuda else "cpu", "engine_gpu": gpus[i], "model_dir": str(model_dir),
            "index": i, "fast_ports": [(k, fast_ports[k]) for k in range(i + 1, n_eng + 1)], "backend": backend}))
    signal.signal(signal.SIGTERM, lambda *_: ([e.proc.terminate() for e in engines], sys.exit(143)))
    for e in engines:  # `timeout` ends them all
        e.ready(timeout=900)
    res["engine_build_s"] = round(max(e.info["build_s"] for e in engines), 1)
    if tp_size > 1 or n_eng > 1:
        res["engine_gpus"] = gpus


def _weight_update_groups(leader: bool, n_eng: int, fast_ports: dict[int, int], backend: str) -> dict[int, Any]:
    """TP rank 0's weight-update groups {TP rank 0, engines 0..k-1}, k = 1..N; without an engine (one GPU) a
    group of one (key 0), so that the packing paths run and can be timed alone. Other TP ranks: none."""
    from kora_trainer.wire.group import init_weight_update_group
    from kora_trainer.wire.ports import free_port

    groups: dict[int, Any] = {}
    if leader and n_eng:
        for k in range(1, n_eng + 1):
            groups[k] = init_weight_update_group("127.0.0.1", fast_ports[k], 0, k + 1, f"kora_fast{k}", backend)
    elif leader:
        groups[0] = init_weight_update_group("127.0.0.1", free_port(), 0, 1, "kora_fast", backend)
    return groups


@dataclass
class Bench:
    """What the phases of one run share: the options, the results so far, this TP rank's trainer, TP rank 0's
    engines and weight-update groups (by k), and what the earlier phases planned (`_plan_merge`, `_plan_adapter`)."""

    args: argparse.Namespace
    res: dict[str, Any]
    rank: int
    trainer: Trainer
    engines: list[EngineProc]
    groups: dict[int, Any]
    device: torch.device
    plan: Any = None  # fast.MergePlan of the merged model
    sizes: list[int] = field(default_factory=list)  # its bucket sizes
    merged_sender: Any = None  # one fast.PipelinedSender (ring buffers, captured folds) for every engine count
    pack: Any = None  # fast_adapter.AdapterPack
    config: dict[str, Any] = field(default_factory=dict)  # the adapter's PEFT config
    delta: Any = None  # fast_adapter.FlatDelta
    noise: Any = None  # the "optimizer step" added to the flat adapter

    def __post_init__(self) -> None:
        a = self.args
        self.tp_size, self.n_eng = a.tp, (0 if a.no_engine else a.engines)
        self.leader = self.rank == 0
        self.cuda = self.device.type == "cuda"
        self.dims = TINY if a.cpu_smoke else QWEN3_4B
        self.backend = "nccl" if self.cuda else "gloo"
        self.tp = self.trainer.tp  # the TP group (None at TP = 1)
        self.group: Any = self.groups.get(self.n_eng)  # every engine's group (TP rank 0 only)
        self.cap, self.reps = a.cap_mib * MIB, a.reps
        self.fold_kw = dict(block_m=a.block_m, block_n=a.block_n, num_warps=a.num_warps, streams=a.fold_streams)
        self.only = set(a.only.split(",")) if a.only else None

    def phase(self, name: str, fn: Any, when: bool = True) -> None:
        """Run phase `name` when `when` and --only does not leave it out; under TP a failure ends the run
        (`Aborted`)."""
        if not when or (self.only is not None and name.split("@")[0] not in self.only):
            return
        run_phase(self.res, name, fn, where="" if self.leader else f" on TP rank {self.rank}", verbose=self.leader,
                  on_error=_abort if self.tp_size > 1 else None)

    def step(self, sync: bool = True) -> None:
        """The same "optimizer step" on every TP rank (a replicated factor must stay equal across the ranks);
        `sync`: then "trainer step done" (the device synchronised)."""
        with torch.no_grad():
            self.trainer.flat.add_(self.noise)
        if sync:
            sync_dev(self.device)


def _abort(name: str, e: Exception) -> None:
    # the TP ranks no longer run the same collectives: end the run (main ends the ranks)
    raise Aborted(name) from e


def _phases(b: Bench) -> None:
    """The measurements (a)-(e), in order, on every TP rank (see `run`)."""
    n, res = b.n_eng, b.res
    _plan_merge(b)
    b.phase("raw_broadcast", lambda: raw_broadcast(b, n, res), when=n > 0)
    b.phase("merge_sync", lambda: merge_sync(b, n, res), when=n > 0)
    b.phase("pack_only", lambda: pack_only(b), when=n == 0)
    b.phase("fold", lambda: fold_bench(b))
    b.phase("base_push", lambda: base_push(b), when=n > 0)
    _plan_adapter(b)
    b.phase("adapter_push", lambda: adapter_push(b, n, res), when=n > 0)
    b.phase("adapter_pack_only", lambda: adapter_pack_only(b), when=n == 0)
    b.phase("delta_skip", lambda: delta_skip(b))
    b.phase("serving_check", lambda: serving_check(b), when=n > 0)
    b.phase("adapter_push_http", lambda: http_adapter(b, n, res), when=n > 0 and not b.args.no_http)
    if n and (b.tp_size > 1 or n > 1):
        engines_scaling(b)
    for e in b.engines:
        e.stop()
    b.phase("finetune", lambda: finetune(b), when=not b.args.no_ft)


# ---- (b) merge sync vs raw broadcast -----------------------------------------------------------------------

def _plan_merge(b: Bench) -> None:
    from kora_trainer.sync.fast import plan as fast

    b.plan = fast.MergePlan(b.trainer.merge_entries(True), b.cap)
    b.sizes = [x.nbytes for x in b.plan.buckets]
    b.res["model_bytes"] = b.plan.nbytes
    b.res["merge_buckets"] = len(b.sizes)


def merge_sender(b: Bench) -> Any:
    from kora_trainer.sync.fast import plan as fast

    if b.merged_sender is None:
        b.merged_sender = fast.PipelinedSender(b.plan, b.group, fold_kw=b.fold_kw, tp=b.tp)
    return b.merged_sender


def _fill_all(b: Bench, sender: Any) -> Any:
    """The merge fill of every bucket (grouped fold + copies into the ring buckets), no broadcast."""
    n = len(b.sizes)
    return lambda: [sender.fill(i) for i in range(n)]


def raw_broadcast(b: Bench, k: int, out: dict[str, Any]) -> None:
    """The anchor of (b): the same buckets' bytes broadcast raw to k engines (+ ack)."""
    from kora_trainer.wire import fast_receive

    if not b.leader:  # no TP collective in it: TP rank 0 alone
        return
    g, sizes = b.groups[k], b.sizes
    bufs = [torch.empty(max(sizes), dtype=torch.uint8, device=b.device) for _ in range(2)]
    for x in bufs:
        x.random_(0, 255)

    def once() -> None:
        for i, n in enumerate(sizes):
            g.broadcast(bufs[i % 2][:n], src=0)
        fast_receive.ack(g)

    send_all(b.engines[:k], "raw", sizes=sizes, reps=b.reps + 2, k=k)
    out["broadcast_ms"], out["broadcast_all_ms"] = wall_ms(once, b.reps, b.device)
    wait_all(b.engines[:k])
    out["broadcast_gbps"] = b.plan.nbytes / (out["broadcast_ms"] / 1e3) / 1e9


def merge_sync(b: Bench, k: int, out: dict[str, Any], check: bool = True) -> None:
    """(b) the pipelined Merge push to k engines (+ ack); `check`: the engine's weights vs torch's fold."""
    from kora_trainer.wire import fast_receive

    sender, leader, engines = merge_sender(b), b.leader, b.engines[:k]
    g: Any = b.groups[k] if leader else None
    if leader:
        sender.group = g
        call_all(engines, "plan", name="merged", metadata=b.plan.metadata, k=k)

    def once() -> None:
        sender.push()
        if leader:
            fast_receive.ack(g)

    if leader:
        send_all(engines, "merge", name="merged", reps=b.reps + 2, k=k)
    # the TP collectives first (every rank), then what TP rank 0 alone does with the engines
    ms, all_ms = wall_ms(once, b.reps, b.device)
    # torch's fp32 addmm fold of layer 0 q/k/v/o, up, and the final norm (a collective under TP)
    want = b.trainer.reference_hf(MERGE_CHECK) if check else {}
    # the pack alone (fold + copies into the ring buckets, no broadcast), and the broadcast alone
    pack_ms = event_ms(_fill_all(b, sender), b.reps) if b.cuda else None
    if not leader:
        return
    wait_all(engines)
    out["merge_sync_ms"], out["merge_sync_all_ms"] = ms, all_ms
    if "broadcast_ms" in out:
        out["merge_sync_vs_broadcast"] = out["merge_sync_ms"] / out["broadcast_ms"]
    if check:
        out["merge_fold_launches_per_bucket"] = [len(f.launches) for f in sender.folds][:4]
        got = b.engines[0].call("get", names=MERGE_CHECK)["tensors"]  # the merged weights on the engine
        out["merge_engine_equal_fraction"] = {n.split(".")[-2]: float((got[n] == want[n]).float().mean())
                                              for n in MERGE_CHECK}
        out["merge_engine_max_abs"] = max(float((got[n].float() - want[n].float()).abs().max())
                                          for n in MERGE_CHECK)
    if pack_ms is not None:
        out["merge_pack_only_ms"] = pack_ms


def pack_only(b: Bench) -> None:
    """No engine: the merge fill alone (grouped fold + copies into the ring buckets), no broadcast."""
    sender = merge_sender(b)
    if b.cuda:
        b.res["merge_pack_only_ms"] = event_ms(_fill_all(b, sender), b.reps)
        b.res["merge_pack_only_tbps"] = 2 * b.plan.nbytes / (b.res["merge_pack_only_ms"] / 1e3) / 1e12


# ---- (c) fold throughput vs copy (TP rank 0's shards; no collective) ------------------------------------------

FOLD_CONFIGS = [(64, 128, 4, "graph", 1), (64, 128, 4, "graph", 2), (64, 128, 4, "graph", 4),
                (64, 128, 4, "graph", 8), (64, 256, 4, "graph", 4), (128, 128, 8, "graph", 4),
                (32, 256, 4, "graph", 4), (32, 128, 4, "graph", 4), (64, 64, 4, "graph", 8),
                (64, 256, 4, "grouped", 0), (64, 128, 4, "grouped", 0)]  # (block m, block n, warps, launch, streams)


def fold_bench(b: Bench) -> None:
    from kora_trainer.kernels.fold import GroupedFold, fold

    if not b.leader:
        return
    res, reps = b.res, b.reps
    items, dst, src, nbytes = _fold_items(b)
    res["fold_tensors"] = len(items)
    res["fold_bytes"] = nbytes
    if not b.cuda:
        GroupedFold(items)()
        return
    copy = event_ms(lambda: dst.copy_(src), reps)
    res["copy_ms"] = copy
    res["copy_tbps"] = 2 * nbytes / (copy / 1e3) / 1e12
    res["copy_per_tensor_ms"] = event_ms(lambda: [i.out.copy_(i.w) for i in items], reps)
    res["fold_per_tensor_ms"] = event_ms(
        lambda: [fold(i.w, i.a, i.b, i.scale, out=i.out, row_map=i.row_map) for i in items], reps)
    sweep, best = _fold_sweep(items, copy, reps)
    # the QKV row map applied row by row instead of block by block (what the block mode saves)
    res["fold_rowwise_map_ms"] = event_ms(GroupedFold(items, map_modes=False, **b.fold_kw), reps)
    res["fold_sweep_vs_copy"] = sweep
    default = GroupedFold(items, **b.fold_kw)
    res["fold_grouped_default_ms"] = event_ms(default, reps)
    if best is not None:
        res["fold_best_config"] = best[0]
        res["fold_ms"] = best[1]
        res["fold_vs_copy"] = copy / best[1]
        res["fold_tbps"] = 2 * nbytes / (best[1] / 1e3) / 1e12
        best[2]()
    _fold_check(items, res)


def _fold_items(b: Bench) -> tuple[list[Any], torch.Tensor, torch.Tensor, int]:
    """(a FoldItem per adapted weight into one destination buffer, that buffer, a source buffer of its size,
    their bytes)."""
    from kora_trainer.kernels.fold import FoldItem
    from kora_trainer.sync.fast import plan as fast

    entries = [e for e in b.trainer.merge_entries(True)  # under TP the shards' unadapted copies are no fold
               if isinstance(e, fast.FoldEntry) and not (e.sharded and e.a is None)]
    nbytes = sum(e.nbytes for e in entries)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=b.device)
    src = torch.empty(nbytes, dtype=torch.uint8, device=b.device)
    items, off = [], 0
    for e in entries:
        items.append(FoldItem(e.w, dst[off:off + e.nbytes].view(e.dtype).view(e.w.shape), e.a, e.b, e.scale,
                              e.row_map))
        off += e.nbytes
    return items, dst, src, nbytes


def _fold_sweep(items: list[Any], copy: float, reps: int) -> tuple[dict[str, Any], tuple[str, float, Any] | None]:
    """(copy time / fold time per FOLD_CONFIGS entry, the fastest as (key, ms, its GroupedFold))."""
    from kora_trainer.kernels.fold import GroupedFold

    sweep: dict[str, Any] = {}
    best = None
    for bm, bn, nw, launch, streams in FOLD_CONFIGS:
        key = f"{launch}{streams if launch == 'graph' else ''}_{bm}x{bn}_w{nw}"
        try:
            gf = GroupedFold(items, block_m=bm, block_n=bn, num_warps=nw, launch=launch, streams=streams)
            ms = event_ms(gf, reps)
            sweep[key] = round(copy / ms, 3)
            if best is None or ms < best[1]:
                best = (key, ms, gf)
        except Exception as e:  # a configuration may not compile (shared memory)
            sweep[key] = f"{type(e).__name__}: {str(e)[:120]}"
    return sweep, best


def _fold_check(items: list[Any], res: dict[str, Any]) -> None:
    """The grouped fold equals torch's fp32 addmm fold (then the same row placement)."""
    from kora_trainer.kernels.fold import FoldItem

    eq, worst = [], 0.0
    for it in items[:8]:
        ref = FoldItem(it.w, torch.empty_like(it.out), it.a, it.b, it.scale, it.row_map)
        ref.reference()
        eq.append(float((ref.out == it.out).float().mean()))
        worst = max(worst, float((ref.out.float() - it.out.float()).abs().max()))
    res["fold_equal_to_fp32_addmm"] = min(eq)
    res["fold_max_abs_vs_fp32_addmm"] = worst


def base_push(b: Bench) -> None:
    """The base on the engines (Adapter mode's first sync), so that engine + adapter = the trainer's policy."""
    from kora_trainer.sync.fast import plan as fast
    from kora_trainer.wire import fast_receive

    base_plan = fast.MergePlan(b.trainer.merge_entries(False), b.cap)
    sender = fast.PipelinedSender(base_plan, b.group, fold_kw=b.fold_kw, tp=b.tp)
    if b.leader:
        call_all(b.engines, "plan", name="base", metadata=base_plan.metadata)
        send_all(b.engines, "merge", name="base", reps=1)
    sender.push()
    if b.leader:
        fast_receive.ack(b.group)
    sync_dev(b.device)
    if b.leader:
        wait_all(b.engines)


# ---- (a) adapter push vs raw broadcast; (d) delta-skip ---------------------------------------------------------

def _plan_adapter(b: Bench) -> None:
    from kora_trainer.sync.fast import adapter_pack as fast_adapter

    t = b.trainer
    b.pack = fast_adapter.AdapterPack(t.params, t.adapter_specs(), b.cap, tp=b.tp)
    b.res["adapter_bytes"] = b.pack.out.numel() * b.pack.out.element_size()
    b.res["adapter_params"] = t.flat.numel()  # under TP: this rank's (sharded factors split, A / B whole)
    b.config = t.peft_config()
    b.delta = fast_adapter.FlatDelta(t.flat)
    b.noise = torch.randn(t.flat.shape, device=b.device, dtype=t.flat.dtype,
                          generator=torch.Generator(device=b.device).manual_seed(7)) * 1e-3


def adapter_push(b: Bench, k: int, out: dict[str, Any], first: bool = True) -> None:
    """(a) trainer step done -> the adapter packed, broadcast to k engines, swapped there -> ack; vs the raw
    broadcast of the same bytes."""
    from kora_trainer.wire import fast_receive

    g: Any = b.groups.get(k)
    pack, leader, device, engines = b.pack, b.leader, b.device, b.engines[:k]
    if leader:
        call_all(engines, "adapter_plan", metadata=pack.metadata, scaling=b.trainer.scaling, k=k)
    abytes = pack.pack()  # a TP collective
    if leader:
        _adapter_raw(b, k, out, abytes)
        send_all(engines, "adapter", reps=b.reps + 2, version=1, config=b.config, k=k)

    def push(_: int) -> None:
        pack.push(g)
        if leader:
            fast_receive.ack(g)
        sync_dev(device)

    times = loop_ms(b.reps + 2, push, before=lambda _: b.step())[2:]  # the optimizer step, then "step done"
    infos = wait_all(engines) if leader else []
    out["adapter_push_ms"] = statistics.median(times)
    out["adapter_push_all_ms"] = times
    if leader:
        out["adapter_push_vs_broadcast"] = out["adapter_push_ms"] / out["adapter_broadcast_ms"]
    if first:
        out["adapter_engine_loaded"] = infos[0].get("loaded") if infos else None
    if b.cuda:
        out["adapter_pack_only_ms"] = event_ms(pack.pack, b.reps)


def _adapter_raw(b: Bench, k: int, out: dict[str, Any], abytes: torch.Tensor) -> None:
    """The anchor of (a): random bytes of the adapter's size, broadcast raw in its buckets (+ ack)."""
    from kora_trainer.wire import fast_receive

    g, bounds = b.groups[k], b.pack.bounds
    araw = torch.empty_like(abytes).random_(0, 255)

    def raw_once() -> None:
        for start, end in bounds:
            g.broadcast(araw[start:end], src=0)
        fast_receive.ack(g)

    send_all(b.engines[:k], "raw", sizes=[e - s for s, e in bounds], reps=b.reps + 2, k=k)
    out["adapter_broadcast_ms"], _ = wall_ms(raw_once, b.reps, b.device)
    wait_all(b.engines[:k])


def adapter_pack_only(b: Bench) -> None:
    if b.cuda:
        b.res["adapter_pack_only_ms"] = event_ms(b.pack.pack, b.reps)


def _should_push_ms(b: Bench, over: Any) -> tuple[list[float], tuple[bool, float]]:
    """Host times (ms) of reps + 2 delta-skip decisions with the MAX over `over` (None: local), the last one."""
    delta, flat, device = b.delta, b.trainer.flat, b.device
    times = []
    for _ in range(b.reps + 2):
        sync_dev(device)
        t = time.perf_counter()
        decision = delta.should_push(flat, 1e-6, over)
        times.append((time.perf_counter() - t) * 1e3)
    return times, decision


def delta_skip(b: Bench) -> None:
    """(d) one fused max|Δ| over the flat adapter + a MAX all-reduce of one number + one read."""
    res, tp = b.res, b.tp
    b.delta.mark_pushed(b.trainer.flat)
    b.step(sync=False)
    local, decision = _should_push_ms(b, None)
    res["delta_skip_local_ms"] = statistics.median(local[2:])
    # the MAX over the trainer's ranks: the TP group; at TP = 1 the weight-update group stands in for it
    over = tp if tp is not None else (b.group if b.n_eng else None)
    if over is not None:
        if tp is None:
            send_all(b.engines, "allreduce", reps=b.reps + 2)
        coll, decision = _should_push_ms(b, over)
        if tp is None:
            wait_all(b.engines)
        res["delta_skip_ms"] = statistics.median(coll[2:])  # with the MAX all-reduce over 2 GPUs
        if tp is not None or b.n_eng > 1:
            res["delta_skip_group"] = f"TP group ({b.tp_size} GPUs)" if tp is not None else \
                f"weight-update group ({b.n_eng + 1} GPUs)"
    push, value = decision
    res["delta_skip_decision"] = {"push": push, "max_delta": value}
    # the old per-tensor tracker (sync/delta.py) on the same adapter, for comparison
    from kora_trainer.sync.delta import DeltaTracker

    named = [(str(i), p.detach()) for i, p in enumerate(b.trainer.params)]
    tracker = DeltaTracker()
    tracker.mark_pushed(named)
    res["delta_skip_per_tensor_ms"], _ = wall_ms(lambda: tracker.local_max_delta(named), b.reps, b.device)


# ---- every engine serves the pushed adapter: its log-probs (HTTP /generate, lora_path) vs the trainer's ---------

SERVING_PROMPTS = [[1, 4, 5, 13, 6, 7, 14], [1, 12, 13, 3, 14]]
GREEDY4 = {"max_new_tokens": 4, "temperature": 0.0, "ignore_eos": True}


def serving_check(b: Bench) -> None:
    from kora_trainer.wire import fast_receive

    b.step(sync=False)
    if b.leader:
        send_all(b.engines, "adapter", reps=1, version=100, config=b.config)
    b.pack.push(b.group)
    if b.leader:
        fast_receive.ack(b.group)
    sync_dev(b.device)
    prompts = SERVING_PROMPTS
    seen = _served(b, prompts) if b.leader else None
    seen = from_leader(seen, b.tp_size)  # every TP rank scores the same continuations (a TP forward)
    worst, base_gap = 0.0, 0.0
    for per_engine in seen:
        for prompt, (out_ids, out_lp, base_lp, _) in zip(prompts, per_engine, strict=True):
            ids = torch.tensor([prompt + out_ids], device=b.device)
            with torch.no_grad():
                lp = b.trainer.logprobs(ids)[0, len(prompt) - 1:].float().cpu()
            worst = max(worst, max(abs(x - float(y)) for x, y in zip(out_lp, lp, strict=True)))
            base_gap = max(base_gap, max(abs(x - y) for x, y in zip(out_lp, base_lp, strict=True)))
    b.res["serving_logprob_max_abs_vs_trainer"] = worst  # bf16 both sides: megatron vs HF kernels
    b.res["serving_adapter_vs_base_logprob_gap"] = base_gap
    b.res["serving_weight_version"] = seen[0][0][3]


def _served(b: Bench, prompts: list[list[int]]) -> list[Any]:
    """Per engine, per prompt: (greedy ids, their log-probs with the adapter, the base's, the weight version)."""
    from kora_trainer.wire.engine_client import EngineClient

    wait_all(b.engines)
    seen = []
    for e in b.engines:
        with EngineClient(e.info["url"], timeout=300) as c:
            outs = c.generate(prompts, GREEDY4, lora_path="kora-policy")
            base = c.generate(prompts, GREEDY4)
        seen.append([(list(o.output_ids), list(o.output_logprobs), list(x.output_logprobs), o.weight_version)
                     for o, x in zip(outs, base, strict=True)])
    return seen


# ---- (a') the adapter through the HTTP route (what WeightSender does today), fanned out to k engines ------------

def http_adapter(b: Bench, k: int, out: dict[str, Any]) -> None:
    from kora_trainer.sync.transport import DistributedTransport
    from kora_trainer.wire.engine_client import EngineClient

    with contextlib.ExitStack() as stack:
        transport = None
        if b.leader:
            clients = [stack.enter_context(EngineClient(e.info["url"], timeout=300)) for e in b.engines[:k]]
            transport = DistributedTransport.connect(clients, b.backend)
        times = loop_ms(max(3, b.reps // 2) + 1, lambda i: _http_push(b, transport, i), before=lambda _: b.step())
        if transport is not None:
            transport.close()
    out["adapter_push_http_ms"] = statistics.median(times[1:])
    out["adapter_push_http_all_ms"] = times[1:]


def _http_push(b: Bench, transport: Any, version: int) -> None:
    """One push: the adapter exported under HF-PEFT names (a TP collective), then (TP rank 0) per bucket the
    metadata over HTTP to every engine + one broadcast (`DistributedTransport.send`)."""
    from kora_trainer.wire.protocol import FLAT, plan_buckets

    tensors = b.trainer.hf_adapter()  # a TP collective (the shards' all-gather)
    if transport is None:
        return
    pairs: dict[str, list[Any]] = {}
    for n, tt in tensors.items():
        pairs.setdefault(n.split(".lora_")[0], []).append((n, tt))
    buckets = plan_buckets(list(pairs.values()), b.cap)
    for bi, bucket in enumerate(buckets):
        def call(c: Any, meta: Any, bi: int = bi) -> Any:
            return c.load_lora_adapter_from_distributed("kora-http", b.config, meta, bucket_index=bi,
                                                        num_buckets=len(buckets), load_format=FLAT,
                                                        weight_version=str(version))

        answers = transport.send(bucket, tensors, call)
    assert all(a["success"] for a in answers), answers


# ---- how the pushes grow with the number of engines: the same measurements with the first k engines ------------

def engines_scaling(b: Bench) -> None:
    n, res = b.n_eng, b.res
    scaling: dict[str, dict[str, Any]] = {}
    for k in range(1, n):
        out: dict[str, Any] = {}
        b.phase(f"raw_broadcast@{k}", lambda k=k, out=out: raw_broadcast(b, k, out))
        b.phase(f"merge_sync@{k}", lambda k=k, out=out: merge_sync(b, k, out, check=False))
        b.phase(f"adapter_push@{k}", lambda k=k, out=out: adapter_push(b, k, out, first=False))
        b.phase(f"adapter_push_http@{k}", lambda k=k, out=out: http_adapter(b, k, out), when=not b.args.no_http)
        scaling[str(k)] = {key: out[key] for key in SCALING_KEYS if key in out}
    scaling[str(n)] = {key: res[key] for key in SCALING_KEYS if key in res}
    res["engines_scaling"] = scaling
    if n > 1:
        first, last = scaling["1"], scaling[str(n)]
        timed = ("broadcast_ms", "merge_sync_ms", "adapter_push_ms", "adapter_push_http_ms")
        res["engines_scaling_growth"] = {key: last[key] / first[key] for key in timed
                                         if key in first and key in last}
        res["engines_scaling_note"] = ("k engines: one weight-update group of TP rank 0 + k engines per k; the ack "
                                       "is the engine's 4-byte broadcast at k = 1, a MAX all-reduce (every "
                                       "engine done) for k > 1")


# ---- (e) LoRA vs full fine-tuning (every TP rank runs the steps) -------------------------------------------------

def finetune(b: Bench) -> None:
    res, trainer = b.res, b.trainer
    g = torch.Generator(device="cpu").manual_seed(3)
    bsz, length = (b.args.ft_batch, b.args.ft_len) if b.cuda else (2, 16)
    ids = torch.randint(0, b.dims["vocab_size"], (bsz, length), generator=g).to(b.device)
    adv = torch.randn(bsz, length - 1, generator=g).to(b.device)
    res["ft_batch"] = [bsz, length]
    _ft_measure(b, ids, adv, list(trainer.params), "lora")
    # full fine-tuning: every base weight trains, the adapter is switched off and frozen
    for m in trainer.lora_modules().values():
        m.enabled = False
    for p in trainer.params:
        p.requires_grad_(False)
    base = [p for n, p in trainer.model.named_parameters() if ".lora_" not in n]
    for p in base:
        p.requires_grad_(True)
    trainer.model.train()
    _ft_measure(b, ids, adv, base, "full")
    res["full_vs_lora_step_time"] = res["full_step_ms"] / res["lora_step_ms"]
    res["full_vs_lora_optimizer_state"] = res["full_optimizer_state_bytes"] / res["lora_optimizer_state_bytes"]
    res["ft_note"] = ("torch.optim.AdamW on the parameters in their own dtype (bf16: exp_avg, exp_avg_sq in "
                      "bf16); loss = -(token log-prob x random advantage).mean(); grad clip 1.0")
    if b.tp_size > 1:
        res["ft_note"] += f"; tensor parallel {b.tp_size}: TP rank 0's numbers (its shards), local grad clip"


def _ft_measure(b: Bench, ids: torch.Tensor, adv: torch.Tensor, params: list[torch.nn.Parameter],
                label: str) -> None:
    """Step time, optimizer state and (GPU) peak memory of AdamW on `params` under res[f"{label}_..."]."""
    res, device, cuda = b.res, b.device, b.cuda
    opt = torch.optim.AdamW(params, lr=1e-5, weight_decay=0.0)

    def step() -> None:
        lp = b.trainer.logprobs(ids)
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
    ms, _ = wall_ms(step, max(3, b.reps // 3), device, warmup=1)
    state = sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values()
                if isinstance(t, torch.Tensor))
    res[f"{label}_step_ms"] = ms
    res[f"{label}_trainable_params"] = sum(p.numel() for p in params)
    res[f"{label}_optimizer_state_bytes"] = state
    if cuda:
        res[f"{label}_peak_allocated_bytes"] = torch.cuda.max_memory_allocated(device)
        res[f"{label}_resident_before_step_bytes"] = before


MERGE_CHECK = ["model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight",
               "model.layers.0.self_attn.v_proj.weight", "model.layers.0.self_attn.o_proj.weight",
               "model.layers.0.mlp.up_proj.weight", "model.norm.weight"]


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


def follower_main(rank: int, args: argparse.Namespace) -> None:
    """TP rank `rank` > 0 (GPU `rank`): the same phases as rank 0, its numbers dropped."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank))
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    run(args, rank)


def start_followers(args: argparse.Namespace) -> list[Any]:
    """TP ranks 1..T-1 in their own processes (torchrun's environment for megatron's process group)."""
    from kora_trainer.wire.ports import free_port

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE=str(args.tp), RANK="0",
                      LOCAL_RANK="0")
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=follower_main, args=(r, args), daemon=True) for r in range(1, args.tp)]
    for p in procs:
        p.start()
    return procs


def watch(followers: list[Any], out: str | None) -> None:
    """A TP rank that died leaves rank 0 waiting in a collective: save what was measured, end everything."""
    while True:
        time.sleep(2)
        codes = [p.exitcode for p in followers]
        if all(c == 0 for c in codes):
            return
        if any(c not in (None, 0) for c in codes):
            res = STATE["res"] or {"errors": {}}
            res["errors"]["followers"] = f"a TP rank failed (exit codes of ranks 1..: {codes}); run ended"
            text = json.dumps(res, indent=2, default=str)
            if out:
                Path(out).write_text(text)
            print(text, flush=True)
            for e in STATE["engines"]:
                e.proc.terminate()
            for p in followers:
                if p.is_alive():
                    p.terminate()
            os._exit(3)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trainer", choices=["megatron", "hf"], default="megatron")
    ap.add_argument("--tp", type=int, default=1, help="tensor parallel size of the trainer (GPUs 0..T-1)")
    ap.add_argument("--engines", type=int, default=1, help="engines on GPUs T..T+N-1, one weight-update group")
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
    # refuse an impossible layout before anything starts
    if args.tp > 1 and (args.trainer != "megatron" or args.cpu_smoke):
        ap.error("--tp > 1 needs --trainer megatron on GPUs (not --cpu-smoke)")
    if args.engines < 1 and not args.no_engine:
        ap.error("--engines must be >= 1 (or --no-engine)")
    if not args.cpu_smoke:
        n_eng = 0 if args.no_engine else args.engines
        try:
            _, warning = engine_gpus(args.tp, n_eng, torch.cuda.device_count())
        except ValueError as e:
            ap.error(str(e))
        if warning:
            print(warning, flush=True)
    followers = start_followers(args) if args.tp > 1 else []
    if followers:
        threading.Thread(target=watch, args=(followers, args.out), daemon=True).start()
    try:
        res = run(args)
    finally:
        for p in followers:  # they end with rank 0 (an aborted run: they may sit in a collective)
            p.join(timeout=10 if STATE["res"] is None or STATE["res"]["errors"].get("aborted") else 300)
            if p.is_alive():
                p.terminate()
    res["command"] = "python bench/gpu_sync.py " + " ".join(sys.argv[1:])
    res["date"] = time.strftime("%Y-%m-%d")
    if args.tp > 1 or args.engines > 1:
        res["result_file"] = f"bench/results/gpu_sync_tp{args.tp}_engines{args.engines}_{res['date']}.json"
    if any(p.exitcode not in (0, None) for p in followers):
        res["errors"]["followers"] = f"TP rank exit codes {[p.exitcode for p in followers]}"
    text = json.dumps(res, indent=2, default=str)
    if args.out:
        Path(args.out).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
