"""Multi-LoRA training on the torch backend: adapter slots (lora/slots.py) on the backend's one frozen base, each
with its own AdamW, step count, gradient clipping and version.

A train call takes whole adapter batches (rolloutBatchSize prompt groups of nSamplesPerPrompt each, from one
adapter): each is accumulated into its slot's gradients micro-batch by micro-batch — every sample with weight
1 / the adapter's global batch (algorithm/grpo.py `num_samples`), a constant known in advance — and the slot's
optimizer steps when its batch is full. The adapters in one call never touch each other's Parameters, RNG or
optimizer, so an adapter trained beside others gets the update it would get alone (tests/e2e/test_multi_lora.py
measures it). With data parallelism each rank takes its share of every adapter batch and the slot's gradients
are summed over the ranks before its step (config rule 9 makes the shares even).
"""

from __future__ import annotations

import time
from contextlib import AbstractContextManager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, cast

import torch

from kora_trainer.algorithm.grpo import group_advantages, grpo_loss
from kora_trainer.backends.batch import RolloutBatch, pad
from kora_trainer.backends.data_parallel import DataParallel
from kora_trainer.backends.grpo_step import ForwardBackward, MicroLoss, one_by_one
from kora_trainer.backends.multi_lora_api import SlotBackend
from kora_trainer.backends.torch_backend import TorchBackend, _clip_grad_norm
from kora_trainer.config.adapter_runs import AdapterSettings
from kora_trainer.lora.model import adapter_disabled, adapter_tensors, peft_config_dict
from kora_trainer.lora.slots import AdapterSlots, Slot
from kora_trainer.sync.slot_sender import SlotSender


@dataclass(frozen=True)
class AdapterStepMetrics:
    """One optimizer step of one adapter."""

    name: str
    step: int  # its optimizer steps after this one (= its version)
    reward_mean: float
    samples: int
    loss: float
    clip_frac: float
    kl: float
    grad_norm: float
    response_len: float
    rollout_logp_gap_max: float | None  # engine vs trainer on the sampled tokens (None: rollouts of an older version)
    rollout_version_lag: int
    train_ms: float
    # for the trackers, as in grpo_step.StepMetrics (entropy: the same Monte-Carlo estimate from the sampled tokens)
    reward_std: float = 0.0
    reward_min: float = 0.0
    reward_max: float = 0.0
    kl_measured: bool = False
    entropy: float = 0.0
    lr: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class _Adapter:
    settings: AdapterSettings
    slot: Slot
    optimizer: torch.optim.Optimizer
    step: int = 0


class MultiLoRATrainer:
    """The torch backend's slot trainer (backends/multi_lora_api.MultiLoRA). The megatron one
    (backends/megatron/multi_lora.py) runs this same step and swaps what differs through the hooks below: the
    slots, the forward/backward of the micro-batches, the gradient clip, the adapter switched off, the slot's
    data-parallel view, and the gathered views that leave the trainer."""

    def __init__(self, backend: TorchBackend):
        self.backend: SlotBackend = backend
        self.slots = AdapterSlots(backend.model)
        self.adapters: dict[str, _Adapter] = {}

    # ---- the hooks a backend swaps ----------------------------------------------------------------------

    def _forward_backward(self) -> ForwardBackward:
        return one_by_one(self.backend._token_logp)

    def _clip(self, params: list[torch.nn.Parameter], max_norm: float) -> float:
        return _clip_grad_norm(params, max_norm)

    def _adapter_off(self) -> AbstractContextManager[None]:
        return adapter_disabled(self.backend.model)

    def _optimizer(self, params: list[torch.nn.Parameter], lr: float) -> torch.optim.Optimizer:
        """A slot's own optimizer (its state replicated on the data-parallel ranks)."""
        return torch.optim.AdamW(params, lr=lr, weight_decay=0.0)

    def _data_parallel(self, slot: Slot) -> DataParallel:
        """The group the slot's gradients are summed over."""
        return self.backend.dp

    def make_sender(self, transport: Any) -> SlotSender:
        """The push of the base once and of each adapter by name (sync/slot_sender.py)."""
        b = cast(TorchBackend, self.backend)
        return SlotSender(b.model, b.cfg, transport, trainer_group=b.group)

    # ---- slots ----------------------------------------------------------------------------------------

    def add(self, settings: AdapterSettings) -> None:
        slot = self.slots.add(settings.name, settings.rank, settings.alpha, settings.seed)
        opt = self._optimizer(slot.params, settings.lr)
        self.adapters[settings.name] = _Adapter(settings, slot, opt)

    def remove(self, name: str) -> None:
        """Its slot cleared: factors, optimizer state and any gradient it held are dropped."""
        self.adapters.pop(name).optimizer.state.clear()
        self.slots.remove(name)

    def names(self) -> list[str]:
        return list(self.adapters)

    def step(self, name: str) -> int:
        return self.adapters[name].step

    def settings(self, name: str) -> AdapterSettings:
        return self.adapters[name].settings

    def active(self, name: str) -> AbstractContextManager[Slot]:
        """The model runs adapter `name` inside the block (what a push of it reads)."""
        return self.slots.active(name)

    # ---- training --------------------------------------------------------------------------------------

    def train(self, batches: dict[str, RolloutBatch]) -> list[AdapterStepMetrics]:
        """One optimizer step for each adapter whose whole batch is given."""
        return [self._train_one(self.adapters[name], batch) for name, batch in batches.items()]

    def _train_one(self, a: _Adapter, batch: RolloutBatch) -> AdapterStepMetrics:
        t0 = time.monotonic()
        b, s = self.backend, a.settings
        alg = b.cfg.algorithm
        if len(batch) != s.global_batch_size:
            raise ValueError(f"adapter {s.name}: a train batch of {len(batch)} samples, not its "
                             f"rolloutBatchSize x nSamplesPerPrompt = {s.global_batch_size}")
        p = pad(batch.prompt_ids, batch.response_ids, batch.rollout_logprobs, b.pad_id, batch.images)
        mask = p.response_mask.to(b.device)  # [B, R]
        adv = group_advantages(torch.tensor(batch.rewards), batch.group_size).to(b.device)  # [B]
        temperature = alg.temperature if alg.temperature > 0 else 1.0
        served = [int(v) for v in batch.weight_versions if v is not None and v.isdigit()]
        on_policy = bool(served) and len(served) == len(batch) and all(v == a.step for v in served)
        sums = {"loss": 0.0, "clip_frac": 0.0, "kl": 0.0, "gap": 0.0}
        with self.slots.active(s.name) as slot:
            with torch.no_grad():
                old = p.rollout_logp.to(b.device) if temperature == 1.0 else b._token_logp(p, temperature)
                ref = None
                if alg.kl_coef > 0:
                    with self._adapter_off():
                        ref = b._token_logp(p, temperature)
            dp = self._data_parallel(slot)
            b.model.train()  # LoRA dropout on (from the slot's own RNG stream)
            a.optimizer.zero_grad(set_to_none=True)

            mbs = list(dp.share(torch.arange(len(batch))).split(b.micro_batch_size))
            self._forward_backward()(p, mbs, temperature, self._loss_of(s, old, adv, mask, ref, sums, on_policy))
            b.model.eval()
            dp.allreduce_grads(slot.params)
            grad_norm = self._clip(slot.params, b.max_grad_norm)
            a.optimizer.step()
            a.optimizer.zero_grad(set_to_none=True)
        a.step += 1
        # with pipeline stages only the last computes losses: summed over the stages too
        loss, kl, clip_frac = b.stages.sum(dp.sum([sums["loss"], sums["kl"], sums["clip_frac"]]))
        rewards = torch.tensor(batch.rewards)
        return AdapterStepMetrics(
            name=s.name, step=a.step, reward_mean=float(torch.tensor(batch.rewards).mean()), samples=len(batch),
            loss=loss, clip_frac=clip_frac, kl=kl, grad_norm=grad_norm,
            response_len=float(p.response_mask.sum() / len(batch)),
            rollout_logp_gap_max=b.stages.max(dp.max(sums["gap"])) if on_policy else None,
            rollout_version_lag=a.step - 1 - min(served) if served else 0,
            train_ms=round((time.monotonic() - t0) * 1000, 1),
            reward_std=float(rewards.std()) if len(rewards) > 1 else 0.0, reward_min=float(rewards.min()),
            reward_max=float(rewards.max()), kl_measured=ref is not None,
            entropy=float(-(old * mask).sum() / mask.sum().clamp(min=1.0)),
            lr=float(a.optimizer.param_groups[0]["lr"]))

    def _loss_of(self, s: AdapterSettings, old: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor,
                 ref: torch.Tensor | None, sums: dict[str, float], on_policy: bool) -> MicroLoss:
        """The loss of a micro-batch (its sample indices, its [b, R] log-probs), every sample weighted 1 / the
        adapter's global batch; its statistics (and, on-policy, its trainer-vs-engine gap) added to `sums`."""
        alg, device = self.backend.cfg.algorithm, self.backend.device

        def loss_of(mb: torch.Tensor, logp: torch.Tensor) -> torch.Tensor:
            mbd = mb.to(device)
            out = grpo_loss(logp, old[mbd], adv[mbd], mask[mbd], alg.clip_eps,
                            None if ref is None else ref[mbd], alg.kl_coef, num_samples=s.global_batch_size)
            sums["loss"] += out.pg_loss
            sums["kl"] += out.kl
            sums["clip_frac"] += out.clip_frac * len(mb) / s.global_batch_size
            if on_policy:
                sums["gap"] = max(sums["gap"], float(((logp.detach() - old[mbd]).abs() * mask[mbd]).max()))
            return out.loss
        return loss_of

    # ---- what leaves the trainer: the adapter's tensors and its PEFT config --------------------------------

    def adapter_named(self, name: str) -> list[tuple[str, torch.Tensor]]:
        """Its factors under HF-PEFT names (live storage), the optimizer's order."""
        with self.slots.active(name):
            return adapter_tensors(self.backend.model)

    def peft_config(self, name: str) -> dict[str, Any]:
        s = self.adapters[name].settings
        spec = self.backend.cfg.lora.model_copy(update={"rank": s.rank, "alpha": s.alpha})
        with self.slots.active(name):
            return peft_config_dict(self.backend.model, spec, str(Path(self.backend.cfg.model.path).resolve()))

    @torch.no_grad()
    def logprobs(self, name: str, prompts: list[list[int]], responses: list[list[int]]) -> list[list[float]]:
        """Raw (T=1) log-probs of each response token under adapter `name`, as an engine reports them."""
        with self.slots.active(name):
            return self.backend.logprobs(prompts, responses)

    # ---- checkpoints: the slot's factors, AdamW state, step and RNG ----------------------------------------

    def state(self, name: str) -> dict[str, Any]:
        a = self.adapters[name]
        return {"tensors": {n: t.detach().cpu().clone() for n, t in self.adapter_named(name)},
                "optimizer": a.optimizer.state_dict(), "step": a.step, "rng": a.slot.rng.clone()}

    def load_state(self, name: str, state: dict[str, Any]) -> None:
        a = self.adapters[name]
        with torch.no_grad():
            for n, t in self.adapter_named(name):
                t.copy_(state["tensors"][n])
        a.optimizer.load_state_dict(state["optimizer"])
        a.step, a.slot.rng = int(state["step"]), state["rng"]
