"""Weight sync near NVLink speed: trainer on GPU 0, engine on GPU 1, one NCCL weight-update group (issue 7);
with `--tp T --engines N` (issue 8) a tensor-parallel trainer on GPUs 0..T-1 fanning out to N engines.

A random-initialised Qwen3-4B-shaped model (no checkpoint is read): the trainer is the megatron-core policy
(`--trainer megatron`, default; `--trainer hf` = HF Qwen3 + kora's torch LoRA) with a rank-32 LoRA on
linear_qkv + linear_proj; the engine is kora's reference engine (`reference_engine.server`: EngineModel + the HTTP
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

Tensor parallel (`--tp T`, megatron only): T trainer processes (this one is TP rank 0 on GPU 0, the others are
spawned on GPUs 1..T-1; megatron parallel_state's TP group). Every TP rank runs the same phases; only TP rank 0
talks to the engines. In (a) and (b) each rank's shards are gathered to TP rank 0 inside the push
(`fast.PipelinedSender` / `fast_adapter.AdapterPack` with the TP group), (c) folds TP rank 0's shards, (d)'s MAX runs
over the TP group, the HTTP adapter path gathers through `export.hf_adapter_tensors`.
Engines (`--engines N`): engine i on GPU T+i (fewer GPUs: wrapped onto the trainer's GPUs other than GPU 0,
with a warning — TP rank 0 and the engines share the weight-update group and NCCL refuses two ranks of one
communicator on one GPU); one weight-update group of TP rank 0 + the N engines carries every push (an ack is
then a MAX all-reduce: every engine done). `engines_scaling`: (a), (b) and the HTTP adapter path with the
first k engines, k = 1..N (a group per k), so the growth from one engine to N is measured in the same run.

    PYTHONPATH=trainer:tests NCCL_NVLS_ENABLE=0 python bench/gpu_sync.py [--out FILE]     # 2 GPUs: everything
    python bench/gpu_sync.py --tp 2 --engines 2      # 4 GPUs (2 GPUs: --tp 2 --engines 1 shares GPU 1)
    python bench/gpu_sync.py --no-engine      # 1 GPU: (c), the packing halves of (a)/(b), local (d), (e)
    python bench/gpu_sync.py --cpu-smoke      # tiny model, gloo, CPU: the plumbing only (numbers meaningless)

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
import traceback
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
for p in (ROOT / "trainer", ROOT / "tests", ROOT / "bench"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

from _engine_proc import EngineProc, Handler, guarded, serve_commands, start_reference_engine  # noqa: E402
from _timing import event_ms, sync_dev, wall_ms  # noqa: E402

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
        from kora_trainer.reference_engine.lora_adapters import LoRAAdapter
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
        for _ in range(arg["reps"]):
            t = torch.zeros(1, device=self.device)
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
        from kora_trainer.sync.fast_adapter import flatten_parameters

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
        from kora_trainer.sync.sources import merge_entries as hf_merge_entries

        if merged:
            return hf_merge_entries(self.model)
        with self.adapter_disabled():  # every adapted weight then goes out as its base
            return hf_merge_entries(self.model)

    def adapter_specs(self) -> list[Any]:
        if self.kind == "megatron":
            from kora_trainer.backends.megatron.sync import adapter_specs

            return adapter_specs(self.model, self.layout)
        from kora_trainer.sync.sources import adapter_specs as hf_adapter_specs

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
    from kora_trainer.sync.fast import FoldEntry

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


def run(args: argparse.Namespace, rank: int = 0) -> dict[str, Any]:  # noqa: C901 (split by phase: STATUS.md)
    """The whole bench on TP rank `rank` (every TP rank runs it; rank 0 starts and drives the engines and
    returns the results, the other ranks take part in the collectives and their numbers are dropped)."""
    from kora_trainer.wire.group import free_port, init_weight_update_group

    tp_size, n_eng = args.tp, (0 if args.no_engine else args.engines)
    leader = rank == 0
    cuda = not args.cpu_smoke
    dims = TINY if args.cpu_smoke else QWEN3_4B
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(rank)
    backend = "nccl" if cuda else "gloo"
    res: dict[str, Any] = {"bench": "gpu_sync", "trainer": args.trainer, "model": "qwen3-4b-shaped (random)"
                           if cuda else "tiny (cpu smoke)", "dims": dims, "rank": args.rank, "alpha": args.alpha,
                           "targets": ["linear_qkv", "linear_proj"], "bucket_cap_mib": args.cap_mib,
                           "reps": args.reps, "errors": {}}
    if tp_size > 1 or n_eng > 1:
        res.update(tp=tp_size, engines=n_eng)
    if leader:
        res.update(versions())
    tmp = Path(args.workdir)
    model_dir = tmp / "model"
    t0 = time.perf_counter()
    engines: list[EngineProc] = STATE["engines"]
    STATE["res"] = res
    fast_ports = {k: free_port() for k in range(1, n_eng + 1)}
    if leader and n_eng:
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
    trainer = Trainer(args.trainer, dims, args.rank, args.alpha, device, tp=tp_size)
    # the weight-update groups {TP rank 0, engines 0..k-1}, k = 1..N; without an engine (one GPU) a group of one,
    # so that the packing paths run and can be timed alone
    groups: dict[int, Any] = {}
    if leader and n_eng:
        for k in range(1, n_eng + 1):
            groups[k] = init_weight_update_group("127.0.0.1", fast_ports[k], 0, k + 1, f"kora_fast{k}", backend)
    elif leader:
        groups[0] = init_weight_update_group("127.0.0.1", free_port(), 0, 1, "kora_fast", backend)
    res["setup_s"] = round(time.perf_counter() - t0, 1)
    only = set(args.only.split(",")) if args.only else None

    def phase(name: str, fn: Any) -> None:
        if only is not None and name.split("@")[0] not in only:
            return
        t = time.perf_counter()
        try:
            fn()
        except Exception as e:
            res["errors"][name] = traceback.format_exc()[-3000:]
            print(f"[{name}] FAILED{'' if leader else f' on TP rank {rank}'}\n{res['errors'][name]}", flush=True)
            if tp_size > 1:  # the TP ranks no longer run the same collectives: end the run (main ends the ranks)
                raise Aborted(name) from e
        res.setdefault("phase_s", {})[name] = round(time.perf_counter() - t, 1)
        if leader:
            print(f"[{name}] {res['phase_s'][name]} s", flush=True)

    try:
        _phases(args, res, phase, rank, trainer, engines, groups, device)
    except Aborted as e:
        res["errors"]["aborted"] = f"phase {e} failed with tensor parallelism: the later phases did not run"
        if not leader:
            raise
    finally:
        for eng in engines:
            with contextlib.suppress(Exception):
                eng.stop()
    return res


class Aborted(RuntimeError):
    """A phase failed on a TP rank: the ranks' collectives no longer match."""


STATE: dict[str, Any] = {"res": None, "engines": []}  # TP rank 0's results so far and engines (for `watch`)


def _phases(args: argparse.Namespace, res: dict[str, Any], phase: Any, rank: int, trainer: Trainer,  # noqa: C901 (split by phase: STATUS.md)
            engines: list[EngineProc], groups: dict[int, Any], device: torch.device) -> None:
    """The measurements (a)-(e), in order, on every TP rank (see `run`)."""
    from kora_trainer.kernels.fold import FoldItem, GroupedFold, fold
    from kora_trainer.sync import fast, fast_adapter
    from kora_trainer.wire import fast_receive
    from kora_trainer.wire.group import free_port, init_weight_update_group

    tp_size, n_eng = args.tp, (0 if args.no_engine else args.engines)
    leader = rank == 0
    cuda = device.type == "cuda"
    dims = TINY if args.cpu_smoke else QWEN3_4B
    backend = "nccl" if cuda else "gloo"
    tp = trainer.tp  # the TP group (None at TP = 1)
    group = groups.get(n_eng)  # every engine's group (TP rank 0 only)
    cap = args.cap_mib * MIB
    reps = args.reps

    # (b) merge sync vs raw broadcast --------------------------------------------------------------------
    plan = fast.MergePlan(trainer.merge_entries(True), cap)
    sizes = [b.nbytes for b in plan.buckets]
    res["model_bytes"] = plan.nbytes
    res["merge_buckets"] = len(sizes)
    fold_kw = dict(block_m=args.block_m, block_n=args.block_n, num_warps=args.num_warps, streams=args.fold_streams)
    made: dict[str, Any] = {}

    def merge_sender() -> Any:  # one sender (ring buffers, captured folds) for every engine count
        if "merged" not in made:
            made["merged"] = fast.PipelinedSender(plan, group, fold_kw=fold_kw, tp=tp)
        return made["merged"]

    def raw(k: int, out: dict[str, Any]) -> None:
        if not leader:  # no TP collective in it: TP rank 0 alone
            return
        g = groups[k]
        bufs = [torch.empty(max(sizes), dtype=torch.uint8, device=device) for _ in range(2)]
        for b in bufs:
            b.random_(0, 255)

        def once() -> None:
            for i, n in enumerate(sizes):
                g.broadcast(bufs[i % 2][:n], src=0)
            fast_receive.ack(g)

        send_all(engines[:k], "raw", sizes=sizes, reps=reps + 2, k=k)
        out["broadcast_ms"], out["broadcast_all_ms"] = wall_ms(once, reps, device)
        wait_all(engines[:k])
        out["broadcast_gbps"] = plan.nbytes / (out["broadcast_ms"] / 1e3) / 1e9

    def merge(k: int, out: dict[str, Any], check: bool = True) -> None:
        sender = merge_sender()
        if leader:
            sender.group = groups[k]
            call_all(engines[:k], "plan", name="merged", metadata=plan.metadata, k=k)

        def once() -> None:
            sender.push()
            if leader:
                fast_receive.ack(groups[k])

        if leader:
            send_all(engines[:k], "merge", name="merged", reps=reps + 2, k=k)
        # the TP collectives first (every rank), then what TP rank 0 alone does with the engines
        ms, all_ms = wall_ms(once, reps, device)
        # torch's fp32 addmm fold of layer 0 q/k/v/o, up, and the final norm (a collective under TP)
        want = trainer.reference_hf(MERGE_CHECK) if check else {}
        # the pack alone (fold + copies into the ring buckets, no broadcast), and the broadcast alone
        pack_ms = event_ms(lambda: [sender.fill(i) for i in range(len(sizes))], reps) if cuda else None
        if not leader:
            return
        wait_all(engines[:k])
        out["merge_sync_ms"], out["merge_sync_all_ms"] = ms, all_ms
        if "broadcast_ms" in out:
            out["merge_sync_vs_broadcast"] = out["merge_sync_ms"] / out["broadcast_ms"]
        if check:
            out["merge_fold_launches_per_bucket"] = [len(f.launches) for f in sender.folds][:4]
            got = engines[0].call("get", names=MERGE_CHECK)["tensors"]  # the merged weights on the engine
            out["merge_engine_equal_fraction"] = {n.split(".")[-2]: float((got[n] == want[n]).float().mean())
                                                  for n in MERGE_CHECK}
            out["merge_engine_max_abs"] = max(float((got[n].float() - want[n].float()).abs().max())
                                              for n in MERGE_CHECK)
        if pack_ms is not None:
            out["merge_pack_only_ms"] = pack_ms

    def pack_only() -> None:  # the merge fill (grouped fold + copies into the ring buckets), no broadcast
        sender = merge_sender()
        if cuda:
            res["merge_pack_only_ms"] = event_ms(lambda: [sender.fill(i) for i in range(len(sizes))], reps)
            res["merge_pack_only_tbps"] = 2 * plan.nbytes / (res["merge_pack_only_ms"] / 1e3) / 1e12

    if n_eng:
        phase("raw_broadcast", lambda: raw(n_eng, res))
        phase("merge_sync", lambda: merge(n_eng, res))
    else:
        phase("pack_only", pack_only)

    # (c) fold throughput vs copy (TP rank 0's shards; no collective) -------------------------------------------
    def fold_bench() -> None:
        if not leader:
            return
        entries = [e for e in trainer.merge_entries(True)  # under TP the shards' unadapted copies are no fold
                   if isinstance(e, fast.FoldEntry) and not (e.sharded and e.a is None)]
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

    # the base on the engines (Adapter mode's first sync), so that engine + adapter = the trainer's policy
    def base_push() -> None:
        base_plan = fast.MergePlan(trainer.merge_entries(False), cap)
        sender = fast.PipelinedSender(base_plan, group, fold_kw=fold_kw, tp=tp)
        if leader:
            call_all(engines, "plan", name="base", metadata=base_plan.metadata)
            send_all(engines, "merge", name="base", reps=1)
        sender.push()
        if leader:
            fast_receive.ack(group)
        sync_dev(device)
        if leader:
            wait_all(engines)

    if n_eng:
        phase("base_push", base_push)

    # (a) adapter push vs raw broadcast; (d) delta-skip -----------------------------------------------------
    pack = fast_adapter.AdapterPack(trainer.params, trainer.adapter_specs(), cap, tp=tp)
    res["adapter_bytes"] = pack.out.numel() * pack.out.element_size()
    res["adapter_params"] = trainer.flat.numel()  # under TP: this rank's (sharded factors split, A / B whole)
    config = trainer.peft_config()
    delta = fast_adapter.FlatDelta(trainer.flat)
    # the same "optimizer step" on every TP rank (a replicated factor must stay equal across the ranks)
    noise = torch.randn(trainer.flat.shape, device=device, dtype=trainer.flat.dtype,
                        generator=torch.Generator(device=device).manual_seed(7)) * 1e-3

    def adapter(k: int, out: dict[str, Any], first: bool = True) -> None:
        g = groups.get(k)
        if leader:
            call_all(engines[:k], "adapter_plan", metadata=pack.metadata, scaling=trainer.scaling, k=k)
        abytes = pack.pack()  # a TP collective
        if leader:
            araw = torch.empty_like(abytes).random_(0, 255)

            def raw_once() -> None:
                for start, end in pack.bounds:
                    g.broadcast(araw[start:end], src=0)
                fast_receive.ack(g)

            send_all(engines[:k], "raw", sizes=[e - s for s, e in pack.bounds], reps=reps + 2, k=k)
            out["adapter_broadcast_ms"], _ = wall_ms(raw_once, reps, device)
            wait_all(engines[:k])
            send_all(engines[:k], "adapter", reps=reps + 2, version=1, config=config, k=k)
        times = []
        for i in range(reps + 2):
            with torch.no_grad():
                trainer.flat.add_(noise)  # the optimizer step
            sync_dev(device)  # "trainer step done"
            t = time.perf_counter()
            pack.push(g)
            if leader:
                fast_receive.ack(g)
            sync_dev(device)
            if i >= 2:
                times.append((time.perf_counter() - t) * 1e3)
        infos = wait_all(engines[:k]) if leader else []
        out["adapter_push_ms"] = statistics.median(times)
        out["adapter_push_all_ms"] = times
        if leader:
            out["adapter_push_vs_broadcast"] = out["adapter_push_ms"] / out["adapter_broadcast_ms"]
        if first:
            out["adapter_engine_loaded"] = infos[0].get("loaded") if infos else None
        if cuda:
            out["adapter_pack_only_ms"] = event_ms(pack.pack, reps)

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
        # the MAX over the trainer's ranks: the TP group; at TP = 1 the weight-update group stands in for it
        over = tp if tp is not None else (group if n_eng else None)
        if over is not None:
            if tp is None:
                send_all(engines, "allreduce", reps=reps + 2)
            coll = []
            for _ in range(reps + 2):
                sync_dev(device)
                t = time.perf_counter()
                push, value = delta.should_push(trainer.flat, 1e-6, over)
                coll.append((time.perf_counter() - t) * 1e3)
            if tp is None:
                wait_all(engines)
            res["delta_skip_ms"] = statistics.median(coll[2:])  # with the MAX all-reduce over 2 GPUs
            if tp is not None or n_eng > 1:
                res["delta_skip_group"] = f"TP group ({tp_size} GPUs)" if tp is not None else \
                    f"weight-update group ({n_eng + 1} GPUs)"
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

    if n_eng:
        phase("adapter_push", lambda: adapter(n_eng, res))
    else:
        phase("adapter_pack_only", adapter_pack_only)
    phase("delta_skip", delta_skip)

    # every engine serves the pushed adapter: its log-probs (HTTP /generate, lora_path) vs the trainer's policy
    def serving_check() -> None:
        from kora_trainer.wire.engine_client import EngineClient

        with torch.no_grad():
            trainer.flat.add_(noise)
        if leader:
            send_all(engines, "adapter", reps=1, version=100, config=config)
        pack.push(group)
        if leader:
            fast_receive.ack(group)
        sync_dev(device)
        prompts = [[1, 4, 5, 13, 6, 7, 14], [1, 12, 13, 3, 14]]
        seen = None
        if leader:
            wait_all(engines)
            seen = []
            for e in engines:
                with EngineClient(e.info["url"], timeout=300) as c:
                    outs = c.generate(prompts, {"max_new_tokens": 4, "temperature": 0.0, "ignore_eos": True},
                                      lora_path="kora-policy")
                    base = c.generate(prompts, {"max_new_tokens": 4, "temperature": 0.0, "ignore_eos": True})
                seen.append([(list(o.output_ids), list(o.output_logprobs), list(b.output_logprobs), o.weight_version)
                             for o, b in zip(outs, base, strict=True)])
        seen = from_leader(seen, tp_size)  # every TP rank scores the same continuations (a TP forward)
        worst, base_gap = 0.0, 0.0
        for per_engine in seen:
            for prompt, (out_ids, out_lp, base_lp, _) in zip(prompts, per_engine, strict=True):
                ids = torch.tensor([prompt + out_ids], device=device)
                with torch.no_grad():
                    lp = trainer.logprobs(ids)[0, len(prompt) - 1:].float().cpu()
                worst = max(worst, max(abs(x - float(y)) for x, y in zip(out_lp, lp, strict=True)))
                base_gap = max(base_gap, max(abs(x - y) for x, y in zip(out_lp, base_lp, strict=True)))
        res["serving_logprob_max_abs_vs_trainer"] = worst  # bf16 both sides: megatron vs HF kernels
        res["serving_adapter_vs_base_logprob_gap"] = base_gap
        res["serving_weight_version"] = seen[0][0][3]

    if n_eng:
        phase("serving_check", serving_check)

    # (a') the adapter through the HTTP route (what WeightSender does today), fanned out to k engines ----------
    def http_adapter(k: int, out: dict[str, Any]) -> None:
        from kora_trainer.wire.engine_client import EngineClient
        from kora_trainer.wire.protocol import FLAT, plan_buckets
        from kora_trainer.wire.protocol import pack as pack_bucket

        with contextlib.ExitStack() as stack:
            clients: list[Any] = []
            hgroup = None
            if leader:
                clients = [stack.enter_context(EngineClient(e.info["url"], timeout=300)) for e in engines[:k]]
                port = free_port()
                futs = [c.submit(c.init_weights_update_group, "127.0.0.1", port, 1 + i, 1 + k, "weight_update_group",
                                 backend) for i, c in enumerate(clients)]
                hgroup = init_weight_update_group("127.0.0.1", port, 0, 1 + k, "weight_update_group", backend)
                for f in futs:
                    f.result(timeout=120)
            times = []
            for i in range(max(3, reps // 2) + 1):
                with torch.no_grad():
                    trainer.flat.add_(noise)
                sync_dev(device)
                t = time.perf_counter()
                tensors = trainer.hf_adapter()  # a TP collective (the shards' all-gather)
                if leader:
                    assert hgroup is not None
                    pairs: dict[str, list] = {}
                    for n, tt in tensors.items():
                        pairs.setdefault(n.split(".lora_")[0], []).append((n, tt))
                    buckets = plan_buckets(list(pairs.values()), cap)
                    for bi, bucket in enumerate(buckets):
                        fs = [c.submit(c.load_lora_adapter_from_distributed, "kora-http", config, bucket.metadata(),
                                       bucket_index=bi, num_buckets=len(buckets), load_format=FLAT,
                                       weight_version=str(i)) for c in clients]
                        hgroup.broadcast(pack_bucket(bucket, tensors, device), src=0)
                        answers = [f.result(timeout=300) for f in fs]
                    assert all(a["success"] for a in answers), answers
                if i >= 1:
                    times.append((time.perf_counter() - t) * 1e3)
            for c in clients:
                c.destroy_weights_update_group("weight_update_group")
        out["adapter_push_http_ms"] = statistics.median(times)
        out["adapter_push_http_all_ms"] = times

    if n_eng and not args.no_http:
        phase("adapter_push_http", lambda: http_adapter(n_eng, res))

    # how the pushes grow with the number of engines: the same measurements with the first k engines ----------
    if n_eng and (tp_size > 1 or n_eng > 1):
        scaling: dict[str, dict[str, Any]] = {}
        for k in range(1, n_eng):
            out: dict[str, Any] = {}
            phase(f"raw_broadcast@{k}", lambda k=k, out=out: raw(k, out))
            phase(f"merge_sync@{k}", lambda k=k, out=out: merge(k, out, check=False))
            phase(f"adapter_push@{k}", lambda k=k, out=out: adapter(k, out, first=False))
            if not args.no_http:
                phase(f"adapter_push_http@{k}", lambda k=k, out=out: http_adapter(k, out))
            scaling[str(k)] = {key: out[key] for key in SCALING_KEYS if key in out}
        scaling[str(n_eng)] = {key: res[key] for key in SCALING_KEYS if key in res}
        res["engines_scaling"] = scaling
        if n_eng > 1:
            first, last = scaling["1"], scaling[str(n_eng)]
            timed = ("broadcast_ms", "merge_sync_ms", "adapter_push_ms", "adapter_push_http_ms")
            res["engines_scaling_growth"] = {key: last[key] / first[key] for key in timed
                                             if key in first and key in last}
            res["engines_scaling_note"] = ("k engines: one weight-update group of TP rank 0 + k engines per k; the ack "
                                           "is the engine's 4-byte broadcast at k = 1, a MAX all-reduce (every "
                                           "engine done) for k > 1")
    for e in engines:
        e.stop()

    # (e) LoRA vs full fine-tuning (every TP rank runs the steps) ------------------------------------------------
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
        for m in trainer.lora_modules().values():
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
        if tp_size > 1:
            res["ft_note"] += f"; tensor parallel {tp_size}: TP rank 0's numbers (its shards), local grad clip"

    if not args.no_ft:
        phase("finetune", finetune)


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
    from kora_trainer.wire.group import free_port

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
