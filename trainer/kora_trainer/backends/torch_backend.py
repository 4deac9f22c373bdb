"""The torch training actor: an HF model loaded with `from_pretrained`, LoRA injected, GRPO steps.

Used for CPU and small-GPU runs (the megatron backend is the GPU path for large models). It owns the
policy; the weight sender (sync/) reads the policy through the lora/ views (folded_state, base_state,
adapter_pairs), so this module knows nothing about engines.

The GRPO step itself (old log-probs, minibatches of whole groups, the rollout log-prob gap) is
`grpo_step.py`'s, shared with the megatron backend.

Randomness: the global torch RNG (LoRA dropout) and its own generator for the minibatch shuffle.
`checkpoint/training.py` saves and restores both (`generator_states`), with the adapter, AdamW state and
`version`, so a resumed run continues the uninterrupted one's random streams.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from kora_trainer.backends.batch import Padded, RolloutBatch, pad
from kora_trainer.backends.data_parallel import DataParallel, RankContext
from kora_trainer.backends.grpo_step import ShuffleState, StepMetrics, grpo_step
from kora_trainer.backends.logprobs import prefix_shareable, sequence_logp, shared_prefix_logp
from kora_trainer.checkpoint.lora_only import check_lora_only
from kora_trainer.config import SyncMode, TrainerConfig
from kora_trainer.config.engine_lora_limits import engine_lora_limits, gdn_gate_mask_needed
from kora_trainer.lora import (
    adapter_disabled,
    adapter_parameters,
    adapter_tensors,
    apply_lora,
    lora_modules,
    peft_config_dict,
)
from kora_trainer.lora.gdn import pin_gate_rows
from kora_trainer.sync.sender import WeightSender
from kora_trainer.wire.vision import ImageInputs, load_policy_model


def _clip_grad_norm(params: list[torch.nn.Parameter], max_norm: float) -> float:
    return float(torch.nn.utils.clip_grad_norm_(params, max_norm))


class TorchBackend(ShuffleState):
    def __init__(self, cfg: TrainerConfig, device: str | None = None, threads: int | None = None,
                 micro_batch_size: int = 256, max_grad_norm: float = 1.0, shared_prefix: bool = True,
                 rank: RankContext | None = None):
        from transformers import AutoTokenizer  # noqa: PLC0415 - transformers is heavy: loaded on use

        if threads:
            torch.set_num_threads(threads)
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        # the trainer's group: every rank a data-parallel replica (the torch backend splits the data only)
        self.group = rank.join("nccl" if self.device.type == "cuda" else "gloo") if rank else None
        self.dp = DataParallel(rank.rank, rank.world, self.group) if rank else DataParallel()
        self.stages = DataParallel()  # no pipeline stages on the torch backend
        torch.manual_seed(cfg.algorithm.seed)  # the same LoRA init on every rank
        self.cfg = cfg
        # a VL checkpoint with its vision tower, the class the engine serves (wire/vision.py)
        self.model = load_policy_model(cfg.model.path, dtype="auto").to(self.device)
        self.tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        self.wrapped = apply_lora(self.model, cfg.lora)
        # GDN b/a gate adapters the engine build cannot serve are pinned to zero (lora/gdn.py): trained = served
        served_as = SyncMode.ADAPTER if cfg.multi_lora.on else cfg.lora.effective_sync_mode
        self.gate_pinned = pin_gate_rows(self.model) \
            if gdn_gate_mask_needed(served_as, engine_lora_limits().gdn_gate_adapters) else []
        self.model.eval()
        if self.dp.rank:  # LoRA dropout: each rank its own draws (rank 0 keeps the one-rank stream)
            torch.manual_seed(cfg.algorithm.seed + self.dp.rank)
        self.params = adapter_parameters(self.model)
        # only adapter parameters reach the optimizer: the base is frozen and holds no Adam state
        self.optimizer: torch.optim.Optimizer = torch.optim.AdamW(self.params, lr=cfg.algorithm.lr, weight_decay=0.0)
        self.micro_batch_size = micro_batch_size
        self.max_grad_norm = max_grad_norm
        # forward a GRPO group's prompt once (backends/logprobs.py), where the model's cache allows it
        self.shared_prefix = shared_prefix and prefix_shareable(self.model)
        self.version = 0  # GRPO steps applied: the policy version the sender pushes
        self.checkpoint_writer = self.dp.rank == 0  # data-parallel replicas hold the same state
        self.checkpoint_shards = None  # no tensor parallelism: a rank's state is the whole state
        self.shuffle = torch.Generator().manual_seed(cfg.algorithm.seed)

    # ---- checkpoint hooks (checkpoint/training.py) ------------------------------------------------

    def adapter_named(self) -> list[tuple[str, torch.Tensor]]:
        """The adapter under HF-PEFT names, live storage, in the optimizer's parameter order."""
        return adapter_tensors(self.model)

    def check_lora_only(self) -> None:
        check_lora_only(n for n, p in self.model.named_parameters() if p.requires_grad)

    def peft_export(self) -> tuple[dict[str, torch.Tensor], dict[str, Any], list[str]]:
        """(tensors, adapter_config.json, adapted module names) of the HF-PEFT export."""
        base = str(Path(self.cfg.model.path).resolve())
        return (dict(adapter_tensors(self.model)), peft_config_dict(self.model, self.cfg.lora, base),
                list(lora_modules(self.model)))

    def make_sender(self, transport: Any) -> Any:
        return WeightSender(self.model, self.cfg, transport, trainer_group=self.group)  # delta-skip: MAX over ranks

    # ---- log-probs ----------------------------------------------------------------------------

    def _token_logp(self, p: Padded, temperature: float = 1.0) -> torch.Tensor:
        """[B, R] log p of each response token under the current policy (0 on padding)."""
        shared = self.shared_prefix and len({tuple(x) for x in p.prompts}) < len(p.prompts)
        fn = shared_prefix_logp if shared else sequence_logp
        return fn(self.model, p, self.pad_id, temperature)

    @torch.no_grad()
    def logprobs(self, prompts: list[list[int]], responses: list[list[int]], adapter: bool = True,
                 images: list[ImageInputs | None] | None = None) -> list[list[float]]:
        """Raw (T=1) log-probs of each response token, as an engine reports them (`images`: a VL batch's)."""
        p = pad(prompts, responses, pad_id=self.pad_id, images=images)
        if adapter:
            lp = self._token_logp(p)
        else:
            with adapter_disabled(self.model):
                lp = self._token_logp(p)
        return [lp[i, :len(r)].tolist() for i, r in enumerate(responses)]

    # ---- one GRPO step --------------------------------------------------------------------------

    def train_step(self, batch: RolloutBatch) -> StepMetrics:
        return grpo_step(self, batch, self._token_logp, lambda: adapter_disabled(self.model), _clip_grad_norm)
