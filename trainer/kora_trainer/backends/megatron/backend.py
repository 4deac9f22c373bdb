"""The megatron training actor: GPTModel from the HF checkpoint, LoRA wrappers, GRPO steps on the adapter.

Same contract and the same GRPO math (algorithm/grpo.py) as the torch backend, so one test batch gives the
same loss on both (tests/gpu/test_megatron_policy.py). One process per GPU; with tensor parallelism every
TP rank runs the same step on the same batch (the TP group splits the layers, not the data).

Log-probs come from the vocab-sharded logits through megatron's vocab-parallel cross entropy, so the full
[tokens, vocab] logits are never gathered on one GPU.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist

from kora_trainer.backends.batch import Padded, RolloutBatch, pad
from kora_trainer.backends.data_parallel import DataParallel, RankContext
from kora_trainer.backends.grpo_step import ShuffleState, StepMetrics, grpo_step
from kora_trainer.backends.megatron.convert import layout_from_hf_config
from kora_trainer.backends.megatron.export import hf_adapter_tensors, peft_config
from kora_trainer.backends.megatron.lora import (
    adapter_disabled,
    adapter_parameters,
    all_lora_modules,
    apply_lora,
    lora_modules,
)
from kora_trainer.backends.megatron.model import build_gpt_model, load_hf_state, read_hf_state
from kora_trainer.backends.megatron.moe import is_expert_module
from kora_trainer.backends.megatron.parallel import gather_stages, init_parallel, pp_rank_size
from kora_trainer.backends.megatron.pipeline import (
    logits_logp,
    packed,
    padded_to,
    pipeline_forward_backward,
    pipeline_logp,
    sequence_multiple,
)
from kora_trainer.backends.megatron.sync import MegatronWeightSender
from kora_trainer.backends.megatron.tp_checkpoint import TensorShards
from kora_trainer.checkpoint.lora_only import check_lora_only
from kora_trainer.config import TrainerConfig
from kora_trainer.wire.group import WeightUpdateGroup


def token_logprobs(model: torch.nn.Module, input_ids: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """[B, L] ids -> [B, L-1] log p(token t+1 | tokens <= t), reduced over the TP group's vocab shards (one stage)."""
    length = input_ids.shape[1]
    input_ids = padded_to(input_ids, sequence_multiple(model))  # sequence parallelism: a multiple of TP
    b, width = input_ids.shape
    position_ids = torch.arange(width, device=input_ids.device).unsqueeze(0).expand(b, width)
    # causal mask built inside (attn_mask_type causal); right padding never reaches a real token's context
    logp = logits_logp(model(input_ids, position_ids, None), input_ids, temperature)  # logits [B, W, V/tp]
    return logp[:, :length - 1]


def response_logprobs(model: torch.nn.Module, prompts: list[list[int]], response_ids: torch.Tensor,
                      response_mask: torch.Tensor, pad_id: int = 0, temperature: float = 1.0) -> torch.Tensor:
    """[B, R] log p of each response token given its prompt (0 where response_mask is 0; one stage)."""
    device = next(model.parameters()).device
    ids, pos = packed(prompts, response_ids, pad_id)
    lp = token_logprobs(model, ids.to(device), temperature)  # [B, W-1]
    return lp.gather(1, pos.to(device)) * response_mask.to(device)


def clip_grad_norm(params: list[torch.nn.Parameter], max_norm: float) -> float:
    """torch's clip_grad_norm_ for a TP-sharded, pipeline- and expert-split parameter set: shards' squares summed
    over the TP group, the experts' over the expert-parallel group, replicated parameters counted once, each stage's
    own parameters summed over the pipeline group."""
    from megatron.core import parallel_state  # noqa: PLC0415 - megatron-core is optional: this module imports without it

    grads = [(p.grad, bool(getattr(p, "tensor_model_parallel", False)), bool(getattr(p, "expert_parallel", False)))
             for p in params if p.grad is not None]
    if not grads and parallel_state.get_pipeline_model_parallel_world_size() == 1:
        return 0.0
    dev = grads[0][0].device if grads else params[0].device
    sharded = torch.zeros((), device=dev)
    replicated = torch.zeros((), device=dev)
    experts = torch.zeros((), device=dev)  # each expert-parallel rank's own experts
    for g, is_shard, is_expert in grads:
        sq = g.float().pow(2).sum()
        if is_expert:
            experts += sq
        elif is_shard:
            sharded += sq
        else:
            replicated += sq
    if parallel_state.get_tensor_model_parallel_world_size() > 1:
        dist.all_reduce(sharded, group=parallel_state.get_tensor_model_parallel_group())
    if parallel_state.get_expert_model_parallel_world_size() > 1:
        dist.all_reduce(experts, group=parallel_state.get_expert_model_parallel_group())
    total = sharded + replicated + experts
    if parallel_state.get_pipeline_model_parallel_world_size() > 1:
        dist.all_reduce(total, group=parallel_state.get_pipeline_model_parallel_group())
    total = torch.sqrt(total)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g, *_ in grads:
        g.mul_(coef.to(g.dtype))
    return float(total)


def checkpoint_dtype(hf_config: object) -> torch.dtype:
    """The dtype the checkpoint declares (`dtype` on transformers 5, `torch_dtype` before), bf16 if none:
    what `from_pretrained(dtype="auto")` gives the torch backend, so both train in the same precision."""
    declared = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    if isinstance(declared, str):
        declared = getattr(torch, declared, None)
    return declared if isinstance(declared, torch.dtype) and declared.is_floating_point else torch.bfloat16


class MegatronBackend(ShuffleState):
    def __init__(self, cfg: TrainerConfig, dtype: torch.dtype | None = None, micro_batch_size: int = 256,
                 max_grad_norm: float = 1.0, rank: RankContext | None = None):
        from megatron.core import parallel_state  # noqa: PLC0415 - megatron-core is optional: this module imports without it
        from transformers import AutoConfig  # noqa: PLC0415 - transformers is heavy: loaded on use

        if rank is not None:  # one Ray actor per rank: the default group megatron's layers talk through
            os.environ.update(rank.torch_env())
        init_parallel(cfg.parallelism.tensor, cfg.algorithm.seed, pipeline=cfg.parallelism.pipeline,
                      expert=cfg.parallelism.expert)
        world = torch.distributed.get_world_size()
        stage, stages = pp_rank_size()
        self.stages = DataParallel(stage, stages, WeightUpdateGroup.wrap(
            parallel_state.get_pipeline_model_parallel_group()) if stages > 1 else None)
        # the delta-skip decision spans every rank (MAX over the world); None: one rank
        self.group = WeightUpdateGroup.wrap(torch.distributed.group.WORLD) if world > 1 else None  # type: ignore[arg-type]
        torch.manual_seed(cfg.algorithm.seed)  # the same LoRA init on every rank (apply_lora takes the seed too)
        self.cfg = cfg
        self.hf_config = AutoConfig.from_pretrained(cfg.model.path)
        self.layout = layout_from_hf_config(self.hf_config)
        self.model = build_gpt_model(self.hf_config, dtype or checkpoint_dtype(self.hf_config))
        self.device = next(self.model.parameters()).device
        self.wrapped = apply_lora(self.model, cfg.lora, seed=cfg.algorithm.seed)
        load_hf_state(self.model, read_hf_state(cfg.model.path), self.layout)
        self.model.eval()
        self.pad_id = getattr(self.hf_config, "pad_token_id", None) or 0
        self.params = adapter_parameters(self.model)
        self.dp = self._data_parallel(world)
        self.optimizer: torch.optim.Optimizer = torch.optim.AdamW(self.params, lr=cfg.algorithm.lr, weight_decay=0.0)
        self.micro_batch_size = micro_batch_size
        self.max_grad_norm = max_grad_norm
        self.version = 0
        self.shuffle = torch.Generator().manual_seed(cfg.algorithm.seed)
        # checkpoints and the export: the TP shards gathered (a collective), written once by global rank 0
        self.checkpoint_writer = torch.distributed.get_rank() == 0
        self.checkpoint_shards = TensorShards.of(self.params)

    def _data_parallel(self, world: int) -> DataParallel:
        """The DP group the adapter's gradients are summed over. Under expert or sequence parallelism the experts'
        factors are marked (`expert_parallel`: clip_grad_norm sums them over the EP group) and summed over the
        expert-data-parallel group instead (with sequence parallelism it holds the TP peers, whose tokens differ);
        the factors the LoRA wrappers mark `sequence_parallel` are summed over the TP group as well."""
        from megatron.core import parallel_state  # noqa: PLC0415 - megatron-core is optional: this module imports without it

        group = WeightUpdateGroup.wrap(parallel_state.get_data_parallel_group()) if world > 1 else None
        dp = DataParallel(parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size(), group)
        sequence = [p for p in self.params if getattr(p, "sequence_parallel", False)]
        if sequence:
            dp.sequence_group = WeightUpdateGroup.wrap(parallel_state.get_tensor_model_parallel_group())
            dp.sequence_params = frozenset(id(p) for p in sequence)
        if parallel_state.get_expert_model_parallel_world_size() == 1 and not self.model.config.sequence_parallel:
            return dp
        experts = [w.weight for name, m in lora_modules(self.model).items() if is_expert_module(name)
                   for w in (m.lora_A, m.lora_B)]
        if not experts:  # a dense model (or no expert LoRA) under sequence parallelism: nothing for that group
            return dp
        for p in experts:
            p.expert_parallel = True  # type: ignore[attr-defined]
        edp = parallel_state.get_expert_data_parallel_group()
        dp.expert_group = WeightUpdateGroup.wrap(edp) if edp.size() > 1 else None
        dp.expert_params = frozenset(id(p) for p in experts)
        return dp

    # ---- checkpoint, export and sync hooks (the same as TorchBackend's; backends/select.PolicyBackend) ----

    def adapter_named(self) -> list[tuple[str, torch.Tensor]]:
        """The adapter under megatron names (this TP rank's shards), live storage, in the optimizer's order.
        Checkpoints keep megatron's own layout (one fused A per linear_qkv): what resuming loads back."""
        return [(f"{name}.lora_{w}.weight", getattr(m, f"lora_{w}").weight.detach())
                for name, m in lora_modules(self.model).items() for w in "AB"]

    def check_lora_only(self) -> None:
        check_lora_only(n for n, p in self.model.named_parameters() if p.requires_grad)

    def peft_export(self) -> tuple[dict[str, torch.Tensor], dict[str, Any], list[str]]:
        """(tensors, adapter_config.json, adapted module names) of the HF-PEFT export (a TP and pipeline
        collective)."""
        base = str(Path(self.cfg.model.path).resolve())
        tensors, modules = hf_adapter_tensors(self.model, self.layout), all_lora_modules(self.model)
        if self.stages.size > 1:  # each stage's own layers: gathered, in stage order (experts: already whole)
            parts = cast(list[dict[str, torch.Tensor]], gather_stages({n: t.cpu() for n, t in tensors.items()}))
            tensors = {n: t for part in parts for n, t in part.items()}
        return tensors, peft_config(self.model, self.cfg.lora, base, modules), modules

    def make_sender(self, transport: Any) -> Any:
        return MegatronWeightSender(self.model, self.layout, self.cfg, transport, trainer_group=self.group)

    def _token_logp(self, p: Padded, temperature: float = 1.0) -> torch.Tensor:
        """[B, R] log p of each response token (aligned with `p.response_ids`, 0 on padding); with pipeline stages
        (no grad: the step's own forwards go through `pipeline_forward_backward`) the same on every stage."""
        if self.stages.size > 1:
            return pipeline_logp(self.model, p, self.pad_id, temperature, self.micro_batch_size)
        return response_logprobs(self.model, p.prompts, p.response_ids, p.response_mask, self.pad_id, temperature)

    @torch.no_grad()
    def logprobs(self, prompts: list[list[int]], responses: list[list[int]], adapter: bool = True) -> list[list[float]]:
        """Raw (T=1) log-probs of each response token, as an engine reports them."""
        p = pad(prompts, responses, pad_id=self.pad_id)
        if adapter:
            lp = self._token_logp(p)
        else:
            with adapter_disabled(self.model):
                lp = self._token_logp(p)
        return [lp[i, :len(r)].tolist() for i, r in enumerate(responses)]

    def train_step(self, batch: RolloutBatch) -> StepMetrics:
        """One GRPO step: `backends/grpo_step.py`, the torch backend's loop, with megatron's log-probs and the
        TP-aware grad-norm clip."""
        staged = pipeline_forward_backward(self.model, self.pad_id) if self.stages.size > 1 else None
        return grpo_step(self, batch, self._token_logp, lambda: adapter_disabled(self.model), clip_grad_norm, staged)
