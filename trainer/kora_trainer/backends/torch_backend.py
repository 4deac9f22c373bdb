"""The torch training actor: an HF model loaded with `from_pretrained`, LoRA injected, GRPO steps.

Used for CPU and small-GPU runs (the megatron backend is the GPU path for large models). It owns the
policy; the weight sender (sync/) reads the policy through the lora/ views (folded_state, base_state,
adapter_pairs), so this module knows nothing about engines.

Old log-probs: at temperature 1 the ratio's denominator is the engine's own log-probs of the tokens it
sampled (no extra forward; after a correct sync they equal ours, which `rollout_logp_gap` tracks every
step). Engines report raw log-probs (before temperature, SGLang's default), so at T != 1 they are not the
sampling distribution: there the actor recomputes them at T before the first update.

Randomness: the global torch RNG (LoRA dropout) and a private generator for the minibatch shuffle.
`checkpoint/training.py` saves and restores both (`generator_states`), with the adapter, AdamW state and
`version`, so a resumed run continues the uninterrupted one's random streams.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from kora_trainer.backends.batch import Padded, RolloutBatch, pad
from kora_trainer.backends.logprobs import sequence_logp, shared_prefix_logp
from kora_trainer.config import TrainerConfig
from kora_trainer.lora import adapter_disabled, adapter_parameters, apply_lora
from kora_trainer.rollout.grpo import group_advantages, grpo_loss


class TorchBackend:
    def __init__(self, cfg: TrainerConfig, device: str | None = None, threads: int | None = None,
                 micro_batch_size: int = 256, max_grad_norm: float = 1.0, shared_prefix: bool = True):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        if threads:
            torch.set_num_threads(threads)
        torch.manual_seed(cfg.algorithm.seed)
        self.cfg = cfg
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.model = AutoModelForCausalLM.from_pretrained(cfg.model.path, dtype="auto").to(self.device)
        self.tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        self.wrapped = apply_lora(self.model, cfg.lora)
        self.model.eval()
        self.params = adapter_parameters(self.model)
        # only adapter parameters reach the optimizer: the base is frozen and holds no Adam state
        self.optimizer = torch.optim.AdamW(self.params, lr=cfg.algorithm.lr, weight_decay=0.0)
        self.micro_batch_size = micro_batch_size
        self.max_grad_norm = max_grad_norm
        self.shared_prefix = shared_prefix  # forward a GRPO group's prompt once (backends/logprobs.py)
        self.version = 0  # GRPO steps applied: the policy version the sender pushes
        self._shuffle = torch.Generator().manual_seed(cfg.algorithm.seed)

    # ---- checkpoint hooks (checkpoint/training.py) ------------------------------------------------

    def generator_states(self) -> dict[str, torch.Tensor]:
        """The backend's own generators (the global RNGs are captured separately)."""
        return {"shuffle": self._shuffle.get_state()}

    def load_generator_states(self, states: dict[str, torch.Tensor]) -> None:
        if "shuffle" in states:
            self._shuffle.set_state(states["shuffle"])

    # ---- log-probs ----------------------------------------------------------------------------

    def _token_logp(self, p: Padded, temperature: float = 1.0) -> torch.Tensor:
        """[B, R] log p of each response token under the current policy (0 on padding)."""
        shared = self.shared_prefix and len({tuple(x) for x in p.prompts}) < len(p.prompts)
        fn = shared_prefix_logp if shared else sequence_logp
        return fn(self.model, p, self.pad_id, temperature)

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

    # ---- one GRPO step --------------------------------------------------------------------------

    def train_step(self, batch: RolloutBatch) -> dict[str, Any]:
        t0 = time.monotonic()
        alg = self.cfg.algorithm
        p = pad(batch.prompt_ids, batch.response_ids, batch.rollout_logprobs, self.pad_id)
        mask = p.response_mask.to(self.device)  # [B, R]
        adv = group_advantages(torch.tensor(batch.rewards), batch.group_size).to(self.device)  # [B]
        temperature = alg.temperature if alg.temperature > 0 else 1.0
        with torch.no_grad():
            # [B, R]
            old = p.rollout_logp.to(self.device) if temperature == 1.0 else self._token_logp(p, temperature)
            ref = None
            if alg.kl_coef > 0:
                with adapter_disabled(self.model):
                    ref = self._token_logp(p, temperature)  # [B, R] the base policy: the KL reference
        # the engines tag what they served; with async rollouts that is an older version than ours
        served = [int(v) for v in batch.weight_versions if v is not None and v.isdigit()]
        lag = self.version - min(served) if served else 0
        on_policy = all(v == str(self.version) for v in batch.weight_versions)
        n = len(batch)
        gbs = min(alg.effective_global_batch_size, n)
        sums: dict[str, float] = {"loss": 0.0, "clip_frac": 0.0, "kl": 0.0, "ratio": 0.0, "grad_norm": 0.0}
        gap_max, gap_sum, gap_n = 0.0, 0.0, 0.0
        updates = 0
        self.model.train()  # LoRA dropout on
        for _ in range(alg.inner_epochs):
            # shuffle whole groups, so a minibatch holds complete groups (and their shared prompts)
            g = batch.group_size
            order = (torch.randperm(n // g, generator=self._shuffle).unsqueeze(1) * g + torch.arange(g)).reshape(-1)
            for start in range(0, n, gbs):
                idx = order[start:start + gbs]
                num_tokens = float(p.response_mask[idx].sum())
                self.optimizer.zero_grad(set_to_none=True)
                for mb in idx.split(self.micro_batch_size):
                    logp = self._token_logp(p.select(mb), temperature)  # [b, R]
                    out = grpo_loss(logp, old[mb], adv[mb.to(self.device)], mask[mb], alg.clip_eps,
                                    None if ref is None else ref[mb], alg.kl_coef, num_tokens=num_tokens)
                    out.loss.backward()
                    w = float(mask[mb].sum()) / max(num_tokens, 1.0)
                    sums["loss"] += out.pg_loss * w
                    sums["clip_frac"] += out.clip_frac * w
                    sums["kl"] += out.kl * w
                    sums["ratio"] += out.ratio_mean * w
                    if updates == 0 and on_policy:  # before any update: trainer vs engine, the same policy
                        gap = ((logp.detach() - old[mb]).abs() * mask[mb])
                        gap_max = max(gap_max, float(gap.max()))
                        gap_sum += float(gap.sum())
                        gap_n += float(mask[mb].sum())
                sums["grad_norm"] += float(torch.nn.utils.clip_grad_norm_(self.params, self.max_grad_norm))
                self.optimizer.step()
                updates += 1
        self.model.eval()
        self.version += 1
        rewards = torch.tensor(batch.rewards)
        return {
            "version": self.version, "reward_mean": float(rewards.mean()), "samples": n, "updates": updates,
            **{k: v / updates for k, v in sums.items()},
            "response_len": float(p.response_mask.sum() / n),
            # None when the rollouts came from an older policy version (async): then no gap is expected
            "rollout_logp_gap_max": gap_max if on_policy else None,
            "rollout_logp_gap_mean": gap_sum / max(gap_n, 1.0) if on_policy else None,
            "rollout_version_lag": lag,
            "train_ms": round((time.monotonic() - t0) * 1000, 1),
        }
