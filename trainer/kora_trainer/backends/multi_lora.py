"""Multi-LoRA training on the torch backend: adapter slots (lora/slots.py) on the backend's one frozen base, each
with its own AdamW, step count, gradient clipping and version.

A train call takes, per adapter, whole prompt groups of its batch (rolloutBatchSize groups of nSamplesPerPrompt
samples): its whole batch, or the next units of it as generation completes them (the recipe streams them in units
of the adapter's streamGroups, a multiple of the fewest groups whose samples split evenly over the DP ranks). Each
unit is accumulated into the slot's gradients micro-batch by micro-batch — every sample with weight 1 / the
adapter's global batch (algorithm/grpo.py `num_samples`), a constant known in advance, so the sum over the units
is the gradient of the whole batch — and the gradients stay in the slot across train calls until the batch is in;
then the slot's own optimizer steps, exactly once per batch (a batch that would overshoot is refused). Group
advantages are per group, so a unit of whole groups needs nothing from the rest of its batch. Removing an adapter
drops a partly accumulated batch with its slot. The adapters in one call never touch each other's Parameters, RNG
or optimizer, so an adapter trained beside others gets the update it would get alone (tests/e2e/test_multi_lora.py
measures it; tests/unit/test_multi_lora_stream.py: units vs the whole batch). With data parallelism each rank
takes its share of every unit and the slot's gradients are summed over the ranks before its step (config rule 9
makes the shares even).
"""
from __future__ import annotations

import time
from contextlib import AbstractContextManager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, cast

import torch

from kora_trainer.algorithm.grpo import group_advantages, grpo_loss
from kora_trainer.algorithm.lr_schedule import apply_lr
from kora_trainer.backends.batch import RolloutBatch, pad
from kora_trainer.backends.data_parallel import DataParallel
from kora_trainer.backends.grpo_step import ForwardBackward, MicroLoss, one_by_one
from kora_trainer.backends.multi_lora_api import SlotBackend
from kora_trainer.backends.torch_backend import TorchBackend, _clip_grad_norm
from kora_trainer.config.adapter_runs import AdapterSettings
from kora_trainer.config.sections import AlgorithmSpec, LrDecayStyle
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
class _Pending:
    """An adapter's step in progress: the units of its batch already accumulated into its slot's gradients, and
    their metric sums (this rank's; summed over the ranks when it steps)."""

    samples: int = 0
    loss: float = 0.0
    kl: float = 0.0
    clip_frac: float = 0.0
    gap_max: float = 0.0
    on_policy: bool = True  # every unit's rollouts came from the adapter's current version
    kl_measured: bool = False
    served: list[int] = field(default_factory=list)  # the versions the engines claimed
    rewards: list[float] = field(default_factory=list)
    response_tokens: float = 0.0
    entropy: tuple[float, float] = (0.0, 0.0)  # -sum(logp * mask), sum(mask)
    ms: float = 0.0


@dataclass
class _Adapter:
    settings: AdapterSettings
    slot: Slot
    optimizer: torch.optim.Optimizer
    step: int = 0
    pending: _Pending | None = None  # its batch's units in so far (None: at a step boundary)
    # its learning-rate schedule (the job's AlgorithmSpec with its own rate, style and step count): set once its
    # step count is known (schedule_adapter), or from its checkpoint
    schedule: AlgorithmSpec | None = None


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
        # numSteps known: its schedule now; numEpochs: once its data is read (schedule_adapter). A checkpoint's
        # schedule replaces either (load_state)
        schedule = None if settings.num_steps is None else settings.schedule(self.backend.cfg.algorithm,
                                                                              settings.num_steps)
        self.adapters[settings.name] = _Adapter(settings, slot, opt, schedule=schedule)

    def remove(self, name: str) -> None:
        """Its slot cleared: factors, optimizer state, its partly accumulated batch and any gradient it held are
        dropped."""
        self.adapters.pop(name).optimizer.state.clear()
        self.slots.remove(name)

    def names(self) -> list[str]:
        return list(self.adapters)

    def drop_pending(self, name: str) -> None:
        """Forget adapter `name`'s partly accumulated batch (its generation was aborted): gradients and sums."""
        a = self.adapters[name]
        a.pending = None
        a.optimizer.zero_grad(set_to_none=True)

    def pending(self, name: str) -> int:
        """Samples of adapter `name`'s current batch already in its slot's gradients (0 at a step boundary)."""
        p = self.adapters[name].pending
        return p.samples if p is not None else 0

    def schedule_adapter(self, name: str, num_steps: int) -> dict[str, Any]:
        """Its schedule over its own `num_steps` (known once its data is read), unless its checkpoint brought the
        one it started with: a resumed adapter goes on along the same curve. Returns the schedule's fields."""
        a = self.adapters[name]
        if a.schedule is None:
            a.schedule = a.settings.schedule(self.backend.cfg.algorithm, num_steps)
        return schedule_fields(a.schedule)

    def step(self, name: str) -> int:
        return self.adapters[name].step

    def settings(self, name: str) -> AdapterSettings:
        return self.adapters[name].settings

    def active(self, name: str) -> AbstractContextManager[Slot]:
        """The model runs adapter `name` inside the block (what a push of it reads)."""
        return self.slots.active(name)

    # ---- training --------------------------------------------------------------------------------------

    def train(self, batches: dict[str, RolloutBatch]) -> list[AdapterStepMetrics]:
        """Accumulate each adapter's samples (whole prompt groups: its whole batch, or the next units of it) into
        its slot; an adapter steps exactly when its batch (rolloutBatchSize groups) is in. Returns one entry per
        adapter that stepped. A batch is cut into the adapter's units (streamGroups groups) and each unit runs on
        its own, so the result depends on the order of the units, not on how they were grouped into calls."""
        out = []
        for name, batch in batches.items():
            a = self.adapters[name]
            s = a.settings
            done = self.pending(name)
            if len(batch) % batch.group_size or done + len(batch) > s.global_batch_size:
                raise ValueError(f"adapter {name}: {len(batch)} samples after {done} do not fit its batch of "
                                 f"rolloutBatchSize x nSamplesPerPrompt = {s.global_batch_size} in whole groups")
            for lo in range(0, len(batch), s.unit_samples):
                self._accumulate(a, batch.rows(lo, lo + s.unit_samples))
                if self.pending(name) == s.global_batch_size:
                    out.append(self._step(a))
        return out

    def _accumulate(self, a: _Adapter, batch: RolloutBatch) -> None:
        """Whole prompt groups of adapter `a`'s batch into its slot's gradients, each sample weighted 1 / its
        global batch (the scaling it gets training its whole batch at once)."""
        t0 = time.monotonic()
        b, s = self.backend, a.settings
        alg = b.cfg.algorithm
        if a.pending is None:
            a.pending = _Pending()
            a.optimizer.zero_grad(set_to_none=True)
        acc = a.pending
        p = pad(batch.prompt_ids, batch.response_ids, batch.rollout_logprobs, b.pad_id, batch.images)
        mask = p.response_mask.to(b.device)  # [B, R]
        adv = group_advantages(torch.tensor(batch.rewards), batch.group_size).to(b.device)  # [B]: per group
        temperature = alg.temperature if alg.temperature > 0 else 1.0
        served = [int(v) for v in batch.weight_versions if v is not None and v.isdigit()]
        on_policy = bool(served) and len(served) == len(batch) and all(v == a.step for v in served)
        with self.slots.active(s.name) as slot:
            with torch.no_grad():
                old = p.rollout_logp.to(b.device) if temperature == 1.0 else b._token_logp(p, temperature)
                ref = None
                if alg.kl_coef > 0:
                    with self._adapter_off():
                        ref = b._token_logp(p, temperature)
            dp = self._data_parallel(slot)
            b.model.train()  # LoRA dropout on (from the slot's own RNG stream)
            b.model.train()  # LoRA dropout on (from the slot's own RNG stream)
            mbs = list(dp.share(torch.arange(len(batch))).split(b.micro_batch_size))
            self._forward_backward()(p, mbs, temperature, self._loss_of(s, old, adv, mask, ref, acc, on_policy))
            b.model.eval()
        acc.samples += len(batch)
        acc.on_policy = acc.on_policy and on_policy
        acc.kl_measured = ref is not None
        acc.served += served
        acc.rewards += batch.rewards
        acc.response_tokens += float(p.response_mask.sum())
        acc.entropy = (acc.entropy[0] - float((old * mask).sum()), acc.entropy[1] + float(mask.sum()))
        acc.ms += (time.monotonic() - t0) * 1000

    def _step(self, a: _Adapter) -> AdapterStepMetrics:
        """Its batch is in: the slot's gradients summed over the ranks, clipped, and its own AdamW steps."""
        t0 = time.monotonic()
        b, s, acc = self.backend, a.settings, a.pending
        assert acc is not None and acc.samples == s.global_batch_size
        with self.slots.active(s.name) as slot:
            dp = self._data_parallel(slot)
            dp.allreduce_grads(slot.params)
            grad_norm = self._clip(slot.params, b.max_grad_norm)
            _set_lr(a)
            a.optimizer.step()
            a.optimizer.zero_grad(set_to_none=True)
        a.step += 1
        a.pending = None
        # with pipeline stages only the last computes losses: summed over the stages too
        loss, kl, clip_frac = b.stages.sum(dp.sum([acc.loss, acc.kl, acc.clip_frac]))
        gap_max = b.stages.max(dp.max(acc.gap_max))
        rewards = torch.tensor(acc.rewards)
        return AdapterStepMetrics(
            name=s.name, step=a.step, reward_mean=float(rewards.mean()), samples=acc.samples,
            loss=loss, clip_frac=clip_frac, kl=kl, grad_norm=grad_norm,
            response_len=acc.response_tokens / acc.samples,
            rollout_logp_gap_max=gap_max if acc.on_policy else None,
            rollout_version_lag=a.step - 1 - min(acc.served) if acc.served else 0,
            train_ms=round(acc.ms + (time.monotonic() - t0) * 1000, 1),
            reward_std=float(rewards.std()) if len(rewards) > 1 else 0.0, reward_min=float(rewards.min()),
            reward_max=float(rewards.max()), kl_measured=acc.kl_measured,
            entropy=acc.entropy[0] / max(acc.entropy[1], 1.0),
            lr=float(a.optimizer.param_groups[0]["lr"]))

    def _loss_of(self, s: AdapterSettings, old: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor,
                 ref: torch.Tensor | None, acc: _Pending, on_policy: bool) -> MicroLoss:
        """The loss of a micro-batch (its sample indices, its [b, R] log-probs), every sample weighted 1 / the
        adapter's global batch; its statistics (and, on-policy, its trainer-vs-engine gap) added to `acc`."""
        alg, device = self.backend.cfg.algorithm, self.backend.device

        def loss_of(mb: torch.Tensor, logp: torch.Tensor) -> torch.Tensor:
            mbd = mb.to(device)
            out = grpo_loss(logp, old[mbd], adv[mbd], mask[mbd], alg.clip_eps,
                            None if ref is None else ref[mbd], alg.kl_coef, num_samples=s.global_batch_size)
            acc.loss += out.pg_loss
            acc.kl += out.kl
            acc.clip_frac += out.clip_frac * len(mb) / s.global_batch_size
            if on_policy:
                acc.gap_max = max(acc.gap_max, float(((logp.detach() - old[mbd]).abs() * mask[mbd]).max()))
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
                "optimizer": a.optimizer.state_dict(), "step": a.step, "rng": a.slot.rng.clone(),
                "schedule": None if a.schedule is None else schedule_fields(a.schedule)}

    def load_state(self, name: str, state: dict[str, Any]) -> None:
        a = self.adapters[name]
        with torch.no_grad():
            for n, t in self.adapter_named(name):
                t.copy_(state["tensors"][n])
        a.optimizer.load_state_dict(state["optimizer"])
        a.step, a.slot.rng = int(state["step"]), state["rng"]
        self._restore_schedule(a, state)

    def _restore_schedule(self, a: _Adapter, state: dict[str, Any]) -> None:
        """The schedule its checkpoint carries (a resumed adapter goes on along the curve it started on)."""
        if state.get("schedule") is not None:  # a checkpoint from before schedules: set by schedule_adapter
            saved = state["schedule"]
            a.schedule = self.backend.cfg.algorithm.model_copy(
                update={**saved, "lr_decay_style": LrDecayStyle(saved["lr_decay_style"])})


def _set_lr(a: _Adapter) -> None:
    """Its own step count picks its rate (a pure function of the step: resume-exact)."""
    if a.schedule is None:
        raise RuntimeError(f"adapter {a.settings.name} has no schedule: schedule_adapter comes before its training")
    apply_lr(a.optimizer, a.schedule, a.step)


_SCHEDULE_FIELDS = ("lr", "lr_decay_style", "min_lr", "lr_warmup_steps", "lr_decay_steps", "num_steps")


def schedule_fields(alg: AlgorithmSpec) -> dict[str, Any]:
    """What of an AlgorithmSpec lr_schedule.py reads: the schedule an adapter's checkpoint carries."""
    return {f: str(v) if f == "lr_decay_style" else v for f, v in alg.model_dump(include=set(_SCHEDULE_FIELDS)).items()}
