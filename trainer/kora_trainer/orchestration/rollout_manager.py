"""The rollout manager: prompts in, scored samples out, through the engines' `/generate`.

Each step takes `rolloutBatchSize` prompts, asks for `nSamplesPerPrompt` samples of each, spreads the
prompts over the engines, and scores every response with the configured reward. In Adapter mode every
request carries `lora_path=kora-policy`, so generation runs through the adapter being trained.

Every sample is its own request: the prompt repeated, a prompt's samples adjacent (the GRPO group
layout). SGLang's `n` is not used, because the `n` samples of one request share its `sampling_seed` and
would be the same draw.

Reproducible per step, when the run claims exact resume (`sglang_launcher.reproducible_rollouts`:
checkpoint.path set, deployment.async false): each request then carries its own `sampling_seed`, a pure
function of (algorithm.seed, step, prompt index in the step's batch, sample index). Both engines make a
seeded draw depend only on (seed, position) and the logits (SGLang with --enable-deterministic-inference,
which the launcher adds for such runs), so step t's rollouts depend only on the policy the engines serve
and on which prompts step t takes. Otherwise no seed is sent: the requests sample independently (a seeded
draw costs the reference engine ~30% more generation time on the toy, SGLang its batch-invariant kernels).
The prompts come from one seeded iterator; `position` counts the batches it has yielded, and `skip_to`
fast-forwards a fresh manager to a checkpoint's position on resume.
"""

from __future__ import annotations

import hashlib
import time
from typing import Any, cast

from kora_trainer.algorithm.rewards import Sample, reward_fn
from kora_trainer.backends.batch import RolloutBatch
from kora_trainer.config import SyncMode, TrainerConfig
from kora_trainer.orchestration.data import batches, load_rows
from kora_trainer.orchestration.sglang_launcher import reproducible_rollouts
from kora_trainer.sync.sender import POLICY_ADAPTER
from kora_trainer.wire.engine_client import EngineClient, EngineError, GenerateOutput

ADAPTER_SWAP_RETRIES = 5
SEED_MASK = 0x7FFF_FFFF  # 31 bits: SGLang keeps request seeds in an int32 tensor


def sampling_seed(seed: int, step: int, prompt: int, sample: int) -> int:
    """The seed of sample `sample` of prompt `prompt` (its index in the step's batch) at `step`."""
    digest = hashlib.blake2b(f"kora/{seed}/{step}/{prompt}/{sample}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & SEED_MASK


class Rollout:
    def __init__(self, cfg: TrainerConfig, engine_urls: list[str], timeout_s: float = 600.0):
        from transformers import AutoTokenizer

        self.cfg = cfg
        self.tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)
        self.rows = load_rows(cfg.data.path, cfg.data.input_key, cfg.data.label_key)
        self._batches = batches(self.rows, cfg.algorithm.rollout_batch_size, cfg.algorithm.seed)
        self.position = 0  # batches taken from self._batches (one per generated step)
        self.reward = reward_fn(cfg.data)
        self.clients = [EngineClient(u, timeout=timeout_s) for u in engine_urls]
        self.lora_path = POLICY_ADAPTER if cfg.lora.effective_sync_mode is SyncMode.ADAPTER else None
        self.seeded = reproducible_rollouts(cfg)  # per-sample sampling_seed (see the module docstring)
        self.timeout_s = timeout_s

    def skip_to(self, position: int) -> int:
        """Fast-forward the prompt iterator to `position` batches taken (a checkpoint's data position)."""
        if position < self.position:
            raise ValueError(f"cannot rewind the prompt iterator from batch {self.position} to {position}")
        while self.position < position:
            next(self._batches)
            self.position += 1
        return self.position

    def generate(self, step: int) -> tuple[RolloutBatch, dict[str, Any]]:
        t0 = time.monotonic()
        alg = self.cfg.algorithm
        rows = next(self._batches)
        self.position += 1
        prompts = [self.tokenizer(r.prompt)["input_ids"] for r in rows]  # [N] token ids (bos added)
        g = alg.n_samples_per_prompt
        base = {"max_new_tokens": alg.max_new_tokens, "temperature": alg.temperature}
        shards = [list(range(i, len(rows), len(self.clients))) for i in range(len(self.clients))]
        futs = []
        for c, idx in zip(self.clients, shards, strict=True):
            if not idx:
                continue
            # one request per sample, a prompt's g samples adjacent (each with its own seed when seeded)
            ids = [prompts[i] for i in idx for _ in range(g)]
            params = [{**base, "sampling_seed": sampling_seed(alg.seed, step, i, j)} if self.seeded else base
                      for i in idx for j in range(g)]
            futs.append(c.submit(self._generate, c, ids, params))
        outs: list[GenerateOutput | None] = [None] * (len(rows) * g)
        for idx, fut in zip([s for s in shards if s], futs, strict=True):
            result = fut.result(timeout=self.timeout_s)  # [len(idx) * g] in request order
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
            # decode of one sequence is a str (transformers types it str | list[str])
            response = out.text if out.text is not None else cast(str, self.tokenizer.decode(
                out.output_ids, skip_special_tokens=True))
            batch.rewards.append(float(self.reward(Sample(row.prompt, response, row.label, row.index))))
        stats = {"gen_ms": round(gen_s * 1000, 1), "rollout_ms": round((time.monotonic() - t0) * 1000, 1),
                 "weight_versions": sorted({v or "" for v in batch.weight_versions}),
                 "data_position": self.position}  # batches taken up to and including this step's
        return batch, stats

    def _generate(self, client: EngineClient, prompts: list[list[int]],
                  params: list[dict[str, Any]]) -> list[GenerateOutput]:
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
