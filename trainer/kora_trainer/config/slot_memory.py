"""`multiLora.maxAdapters: auto` (miles' `--multi-lora-n-adapters auto`): how many adapter slots the free memory at
the job's rank holds. Pure arithmetic on config.json and measured byte counts; orchestration/slot_sizing.py
measures at start, config/placement.py prints the per-slot part in `kora plan` / `--dry-run`.

One slot's bytes:
- trainer: every LoRA factor element at lora.rank (A [r, in] + B [out, r] of each target module of each layer,
  from config.json) x 16 bytes: the fp32 factor, its gradient and AdamW's exp_avg and exp_avg_sq; divided by
  tensor x pipeline (the factors are split like their modules; every data-parallel rank holds every slot), an MoE
  model's experts by expert x pipeline instead (megatron never splits an expert by tensor parallelism) and its
  routers by pipeline (whole on every TP rank).
- engine: SGLang's LoRA memory pool (python/sglang/srt/lora/mem_pool.py, `get_lora_A_shape` / `get_lora_B_shape`)
  holds, per layer and target module, A [max_loras_per_batch, max_lora_rank x stacked, in / tp] and
  B [max_loras_per_batch, out / tp, max_lora_rank] in the model's dtype: per buffer slot the same factor elements
  at max_lora_rank (q/k/v and gate/up stacked as their separate A's), divided by the engine's TP size, and it
  allocates maxAdapters + 1 buffer slots (base-only requests count as one: sglang_launcher.max_loras_per_batch).
  The reference engine on CPU holds them in fp32.
Slots take at most SLOT_SHARE of the free memory left once the base weights are in (the rest: activations, the KV
cache, allocator slack). Where trainer and engine share a memory (CPU: the host's available memory, MemAvailable;
Colocate: the GPU) one budget pays for both; else each side's count is its own and the job takes the smaller.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kora_trainer.config.layout import colocated
from kora_trainer.config.load import ConfigError
from kora_trainer.config.sections import MAX_SLOTS, TargetModule
from kora_trainer.config.start_layout import config_experts
from kora_trainer.config.trainer import TrainerConfig

SLOT_SHARE = 0.25  # of the free memory after the base weights: a choice, not a measurement (see the docstring)
TRAINER_BYTES_PER_ELEMENT = 16  # fp32 factor + gradient + AdamW exp_avg + exp_avg_sq
_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


def slot_elements(hf: Mapping[str, Any], cfg: TrainerConfig) -> int:
    """LoRA factor elements of one slot at lora.rank: r x (in + out) of every targeted projection of every layer."""
    return sum(_target_elements(hf, cfg).values())


def _target_elements(hf: Mapping[str, Any], cfg: TrainerConfig) -> dict[TargetModule, int]:
    """One slot's factor elements per target module (every layer; an MoE model's MLP linears: every expert's)."""
    text = hf.get("text_config") or hf
    hidden, layers = int(text["hidden_size"]), int(text["num_hidden_layers"])
    heads = int(text["num_attention_heads"])
    head_dim = int(text.get("head_dim") or hidden // heads)
    kv = int(text.get("num_key_value_heads") or heads)
    experts = config_experts(text) or 0
    inter = int(text.get("moe_intermediate_size") or text["intermediate_size"]) if experts else int(
        text["intermediate_size"])
    shapes: dict[TargetModule, list[tuple[int, int]]] = {  # (in, out) of each HF projection it wraps
        TargetModule.LINEAR_QKV: [(hidden, heads * head_dim), (hidden, kv * head_dim), (hidden, kv * head_dim)],
        TargetModule.LINEAR_PROJ: [(heads * head_dim, hidden)],
        TargetModule.LINEAR_FC1: [(hidden, inter)] * 2 * max(experts, 1),
        TargetModule.LINEAR_FC2: [(inter, hidden)] * max(experts, 1),
        TargetModule.ROUTER: [(hidden, experts)],
    }
    unknown = [t.value for t in cfg.lora.target_modules if t not in shapes]
    if unknown:
        raise ConfigError([f"multiLora.maxAdapters auto cannot size a slot of lora.targetModules {unknown} (their "
                           "shapes are not read from config.json here): set multiLora.maxAdapters to a number"])
    return {t: cfg.lora.rank * layers * sum(i + o for i, o in shapes[t]) for t in cfg.lora.target_modules}


def _rank_elements(hf: Mapping[str, Any], cfg: TrainerConfig) -> float:
    """One slot's elements on one trainer rank: the attention's (and a dense MLP's) split over tensor x pipeline; an
    MoE model's experts over expert x pipeline (never split by tensor parallelism: expertTensor 1) and its routers'
    over the pipeline only (whole on every TP rank)."""
    p = cfg.parallelism
    moe = bool(config_experts(hf.get("text_config") or hf))
    total = 0.0
    for t, n in _target_elements(hf, cfg).items():
        if t is TargetModule.ROUTER:
            total += n / p.pipeline
        elif moe and t in (TargetModule.LINEAR_FC1, TargetModule.LINEAR_FC2):
            total += n / (p.expert * p.pipeline)
        else:
            total += n / (p.tensor * p.pipeline)
    return total


@dataclass(frozen=True)
class SlotBytes:
    trainer: int  # one slot on one trainer rank
    engine: int  # one buffer slot on one engine GPU (or the CPU engine)


def slot_bytes(hf: Mapping[str, Any], cfg: TrainerConfig) -> SlotBytes:
    elements = slot_elements(hf, cfg)
    text = hf.get("text_config") or hf
    on_cpu = cfg.rollout.gpus_per_engine == 0
    engine_dtype = 4 if on_cpu else _DTYPE_BYTES.get(str(text.get("torch_dtype") or hf.get("torch_dtype")), 2)
    return SlotBytes(math.ceil(_rank_elements(hf, cfg) * TRAINER_BYTES_PER_ELEMENT),
                     math.ceil(elements * engine_dtype / max(cfg.rollout.gpus_per_engine, 1)))


@dataclass(frozen=True)
class Pool:
    """One memory the slots draw on, measured at the job's rank before the models load."""

    name: str
    free: int  # bytes free when measured
    base: int  # what the base weights will take there
    per_slot: int  # what each slot adds there
    fixed: int = 0  # what sizing adds whatever the count (the engine's base-only buffer slot)

    def slots(self) -> int:
        return max(0, int((SLOT_SHARE * max(self.free - self.base, 0) - self.fixed) // max(self.per_slot, 1)))

    def line(self) -> str:
        budget = SLOT_SHARE * max(self.free - self.base, 0)
        fixed = f" - {_mib(self.fixed)} (the engine's base-only buffer)" if self.fixed else ""
        return (f"{self.name}: {SLOT_SHARE:g} x ({_mib(self.free)} free - {_mib(self.base)} base weights) = "
                f"{_mib(budget)}{fixed}, / {_mib(self.per_slot)} per slot = {self.slots()} slot(s)")


def pools(cfg: TrainerConfig, each: SlotBytes, base_bytes: int, trainer_free: int, engine_free: int, world: int,
          trainer_gpu: bool) -> list[Pool]:
    """The memories at the job's rank: one shared pool (CPU: the host; Colocate: the GPU), else one per side."""
    p, engines, gpe = cfg.parallelism, cfg.rollout.num_engines, max(cfg.rollout.gpus_per_engine, 1)
    trainer_base, engine_base = base_bytes // (p.tensor * p.pipeline), base_bytes // gpe
    engine_cpu = cfg.rollout.gpus_per_engine == 0
    if not trainer_gpu and engine_cpu:  # every rank and every engine on the one host's memory (a local CPU job)
        return [Pool(f"host MemAvailable ({world} trainer rank(s) + {engines} CPU engine(s))", trainer_free,
                     world * trainer_base + engines * engine_base, world * each.trainer + engines * each.engine,
                     engines * each.engine)]
    if trainer_gpu and colocated(cfg):
        return [Pool("GPU of rank 0 (trainer + colocated engine)", trainer_free, trainer_base + engine_base,
                     each.trainer + each.engine, each.engine)]
    return [Pool("trainer rank 0 " + ("GPU" if trainer_gpu else "host MemAvailable"), trainer_free, trainer_base,
                 each.trainer),
            Pool("engine 0 " + ("host MemAvailable" if engine_cpu else "GPU"), engine_free, engine_base, each.engine,
                 each.engine)]


def sized(found: list[Pool]) -> tuple[int, list[str]]:
    """The slot count (the smallest pool's, at most MAX_SLOTS) and the arithmetic, one line a pool; refused at 0."""
    n = min(min(p.slots() for p in found), MAX_SLOTS)
    lines = [p.line() for p in found] + [f"multiLora.maxAdapters auto = {n} slot(s)"
                                         + (f" (at most {MAX_SLOTS})" if n == MAX_SLOTS else "")]
    if n < 1:
        raise ConfigError([f"multiLora.maxAdapters auto: the free memory holds no adapter slot ({'; '.join(lines)}):"
                           " lower lora.rank or lora.targetModules, free memory, or set multiLora.maxAdapters"])
    return n, lines


def plan_lines(cfg: TrainerConfig, hf: Mapping[str, Any] | None) -> list[str]:
    """`kora plan` / `--dry-run`: what one slot costs and how auto is sized (the free memory is measured at start)."""
    if cfg.multi_lora.max_adapters != "auto":
        return []
    if not hf:
        return [f"multiLora.maxAdapters auto: sized at start from the free memory (model.path {cfg.model.path}'s "
                "config.json is not readable here, so the per-slot bytes are not shown)"]
    try:
        each = slot_bytes(hf, cfg)
    except ConfigError as e:
        return [f"multiLora.maxAdapters auto: {e.problems[0]}"]
    return [f"multiLora.maxAdapters auto: one slot = {slot_elements(hf, cfg):,} LoRA elements at rank "
            f"{cfg.lora.rank}: {_mib(each.trainer)} per trainer rank (x{TRAINER_BYTES_PER_ELEMENT} B: fp32 factor, "
            f"grad, Adam m and v; / tensor x pipeline), {_mib(each.engine)} per engine (SGLang's LoRA pool, "
            f"maxAdapters + 1 buffer slots); sized at start as {SLOT_SHARE:g} x (free - base weights) / per-slot "
            "bytes, measured at rank 0 and engine 0"]


def _mib(n: float) -> str:
    return f"{n / 2**20:,.1f} MiB"
