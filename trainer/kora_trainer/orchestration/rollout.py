"""The rollout manager: prompts in, scored samples out, through the engines' `/generate`.

Each step takes `rolloutBatchSize` prompts, asks for `nSamplesPerPrompt` samples of each (SGLang's `n`:
the samples of a prompt come back adjacent, which is the group layout GRPO wants), spreads the prompts
over the engines, and scores every response with the configured reward. In Adapter mode every request
carries `lora_path=kora-policy`, so generation runs through the adapter being trained.
"""

from __future__ import annotations

import time
from typing import Any

from kora_trainer.backends.batch import RolloutBatch
from kora_trainer.config import SyncMode, TrainerConfig
from kora_trainer.orchestration.data import batches, load_rows
from kora_trainer.rollout.client import EngineClient, EngineError, GenerateOutput
from kora_trainer.rollout.rewards import Sample, reward_fn
from kora_trainer.sync.sender import POLICY_ADAPTER

ADAPTER_SWAP_RETRIES = 5


class Rollout:
    def __init__(self, cfg: TrainerConfig, engine_urls: list[str], timeout_s: float = 600.0):
        from transformers import AutoTokenizer

        self.cfg = cfg
        self.tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)
        self.rows = load_rows(cfg.data.path, cfg.data.input_key, cfg.data.label_key)
        self._batches = batches(self.rows, cfg.algorithm.rollout_batch_size, cfg.algorithm.seed)
        self.reward = reward_fn(cfg.data)
        self.clients = [EngineClient(u, timeout=timeout_s) for u in engine_urls]
        self.lora_path = POLICY_ADAPTER if cfg.lora.effective_sync_mode is SyncMode.ADAPTER else None
        self.timeout_s = timeout_s

    def generate(self, step: int) -> tuple[RolloutBatch, dict[str, Any]]:
        t0 = time.monotonic()
        alg = self.cfg.algorithm
        rows = next(self._batches)
        prompts = [self.tokenizer(r.prompt)["input_ids"] for r in rows]  # [N] token ids (bos added)
        # no sampling_seed: SGLang gives the n samples of a request that share a seed identical draws
        params = {"max_new_tokens": alg.max_new_tokens, "temperature": alg.temperature, "n": alg.n_samples_per_prompt}
        shards = [list(range(i, len(rows), len(self.clients))) for i in range(len(self.clients))]
        futs = [c.submit(self._generate, c, [prompts[i] for i in idx], params)
                for c, idx in zip(self.clients, shards, strict=True) if idx]
        outs: list[GenerateOutput | None] = [None] * (len(rows) * alg.n_samples_per_prompt)
        g = alg.n_samples_per_prompt
        for idx, fut in zip([s for s in shards if s], futs, strict=True):
            result = fut.result(timeout=self.timeout_s)  # [len(idx) * n], samples of a prompt adjacent
            for j, i in enumerate(idx):
                outs[i * g:(i + 1) * g] = result[j * g:(j + 1) * g]
        gen_s = time.monotonic() - t0
        batch = RolloutBatch([], [], [], [], g)
        for k, out in enumerate(outs):
            assert out is not None
            row = rows[k // g]
            batch.prompt_ids.append(prompts[k // g])
            batch.response_ids.append(out.output_ids)
            batch.rollout_logprobs.append(out.output_logprobs)
            batch.weight_versions.append(out.weight_version)
            response = out.text if out.text is not None else self.tokenizer.decode(out.output_ids,
                                                                                  skip_special_tokens=True)
            batch.rewards.append(float(self.reward(Sample(row.prompt, response, row.label, row.index))))
        stats = {"gen_ms": round(gen_s * 1000, 1), "rollout_ms": round((time.monotonic() - t0) * 1000, 1),
                 "weight_versions": sorted({v or "" for v in batch.weight_versions})}
        return batch, stats

    def _generate(self, client: EngineClient, prompts: list[list[int]], params: dict[str, Any]) -> list[GenerateOutput]:
        """One engine's share. A colocated Adapter-mode sync replaces `kora-policy` by unload + load (SGLang
        has no replace); a request that lands in between is refused, so retry a few times (bounded)."""
        for attempt in range(ADAPTER_SWAP_RETRIES + 1):
            try:
                return client.generate(prompts, params, lora_path=self.lora_path)
            except EngineError as e:
                swapping = self.lora_path is not None and self.lora_path in e.message and e.status == 400
                if not swapping or attempt == ADAPTER_SWAP_RETRIES:
                    raise
                time.sleep(0.05 * (attempt + 1))
        raise AssertionError("unreachable")

    def close(self) -> None:
        for c in self.clients:
            c.close()
