"""Sampling for the reference engine: SGLang's `sampling_params` (defaults of sglang 0.5.23,
`sglang/srt/sampling/sampling_params.py`), the logit processing they ask for, and the stop rules.

Two things an RL trainer depends on:

- **Log-probs are of the raw model.** The log-prob returned for a token is `log_softmax` of the
  model's logits at that step — before temperature, penalties, logit_bias or top-k/p/min-p
  filtering — so the trainer can compare it with its own policy log-probs computed by a plain
  forward. (SGLang can return either; kora's engine always returns the raw one.)
- **`sampling_seed` makes a sample reproducible** whatever else is in the batch: the draw for
  one token depends only on (seed, position), like SGLang's `multinomial_with_seed`. As there,
  the `n` samples of one request that share a seed are identical — give each its own seed (or
  none) for diverse samples.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import torch

TOP_K_ALL = 1 << 30
_EPS = 1e-6
LOGIT_CAP = 1e30  # processed logits are kept in [-LOGIT_CAP, LOGIT_CAP] (apply_penalties)
# constrained decoding needs grammar backends SGLang ships and the reference engine does not
_UNSUPPORTED = ("json_schema", "regex", "ebnf", "structural_tag")


@dataclass
class SamplingParams:
    max_new_tokens: int | None = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = TOP_K_ALL
    min_p: float = 0.0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    stop_regex: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    n: int = 1
    min_new_tokens: int = 0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    sampling_seed: int | None = None
    logit_bias: dict[int, float] = field(default_factory=dict)

    @classmethod
    def from_json(cls, raw: dict[str, Any] | None, vocab_size: int | None = None) -> SamplingParams:
        """Build from a dict the contract gate already accepted; raises ValueError like SGLang's `verify`
        (`vocab_size`: the logit_bias keys are checked against it, as SGLang's `verify(vocab_size)` does)."""
        raw = {k: v for k, v in (raw or {}).items() if v is not None}
        for key in _UNSUPPORTED:
            if key in raw:
                raise ValueError(f"{key} (constrained decoding) is not supported by kora's hf engine")
        p = cls()
        for key in ("max_new_tokens", "top_k", "n", "min_new_tokens", "sampling_seed"):
            if key in raw:
                setattr(p, key, int(raw[key]))
        for key in ("temperature", "top_p", "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty"):
            if key in raw:
                setattr(p, key, float(raw[key]))
        for key in ("ignore_eos", "skip_special_tokens", "no_stop_trim"):
            if key in raw:
                setattr(p, key, bool(raw[key]))
        for key in ("stop", "stop_regex"):
            if key in raw:
                setattr(p, key, [raw[key]] if isinstance(raw[key], str) else list(raw[key]))
        if "stop_token_ids" in raw:
            p.stop_token_ids = [int(t) for t in raw["stop_token_ids"]]
        if "logit_bias" in raw:
            p.logit_bias = {_token_key(k): float(v) for k, v in raw["logit_bias"].items()}
        if p.top_k == -1:
            p.top_k = TOP_K_ALL
        p.verify(vocab_size)
        return p

    def verify(self, vocab_size: int | None = None) -> None:
        """SGLang's checks and messages (sampling_params.py `verify`)."""
        if self.temperature < 0.0:
            raise ValueError(f"temperature must be non-negative, got {self.temperature}.")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}.")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}.")
        if self.top_k < 1:
            raise ValueError(f"top_k must be -1 (disable) or at least 1, got {self.top_k}.")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise ValueError(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}.")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise ValueError(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}.")
        if not 0.0 < self.repetition_penalty <= 2.0:  # 0 would divide the seen tokens' logits by zero
            raise ValueError(f"repetition_penalty must be in (0, 2] (1.0 = no penalty), got {self.repetition_penalty}.")
        if self.min_new_tokens < 0:
            raise ValueError(f"min_new_tokens must be in [0, max_new_tokens], got {self.min_new_tokens}.")
        if self.max_new_tokens is not None:
            if self.max_new_tokens < 0:
                raise ValueError(f"max_new_tokens must be at least 0, got {self.max_new_tokens}.")
            if self.min_new_tokens > self.max_new_tokens:
                raise ValueError(f"min_new_tokens must be in [0, max_new_tokens({self.max_new_tokens})], "
                                 f"got {self.min_new_tokens}.")
        if self.n < 1:
            raise ValueError(f"n must be at least 1, got {self.n}.")
        self._verify_bias_and_patterns(vocab_size)

    def _verify_bias_and_patterns(self, vocab_size: int | None) -> None:
        if vocab_size is not None:
            for token_id in self.logit_bias:
                if not 0 <= token_id < vocab_size:
                    raise ValueError(f"logit_bias must has keys in [0, {vocab_size - 1}], got {token_id}.")
        for pattern in self.stop_regex:  # here, not mid-batch where a bad one would fail every request in it
            try:
                re.compile(pattern)
            except re.error as e:
                raise ValueError(f"stop_regex {pattern!r} is not a valid regular expression: {e}.") from None

    @property
    def greedy(self) -> bool:
        return self.temperature < _EPS or self.top_k == 1


def _token_key(key: Any) -> int:
    """A logit_bias key: a token id written as a JSON object key (a string of digits)."""
    try:
        return int(key)
    except ValueError:
        raise ValueError(f"logit_bias keys must be token ids (integers as strings, e.g. \"13\"), got {key!r}.") \
            from None


def _seeded_generator(seed: int, position: int) -> torch.Generator:
    """A generator whose state depends only on (seed, position) — SGLang's hashing constants."""
    g = torch.Generator()
    g.manual_seed(((seed * 19349663) ^ (position * 73856093)) & 0x7FFF_FFFF_FFFF_FFFF)
    return g


def apply_penalties(logits: torch.Tensor, params: SamplingParams, output_ids: list[int],
                    generated: int, stop_ids: set[int]) -> torch.Tensor:
    """logits [V] (float32) -> processed logits [V] for one row: bias, penalties, min_new_tokens mask."""
    if params.logit_bias:
        for tok, bias in params.logit_bias.items():
            if 0 <= tok < logits.numel():
                logits[tok] += bias
    if output_ids and (params.frequency_penalty or params.presence_penalty or params.repetition_penalty != 1.0):
        ids = torch.tensor(output_ids, dtype=torch.long)
        counts = torch.bincount(ids, minlength=logits.numel())[: logits.numel()].to(logits.dtype)  # [V]
        seen = counts > 0
        if params.repetition_penalty != 1.0:
            rp = params.repetition_penalty
            logits = torch.where(seen, torch.where(logits > 0, logits / rp, logits * rp), logits)
        logits = logits - params.frequency_penalty * counts - params.presence_penalty * seen.to(logits.dtype)
    if generated < params.min_new_tokens:
        for tok in stop_ids:
            if 0 <= tok < logits.numel():
                logits[tok] = float("-inf")
    # a huge bias (any finite JSON number is one) must not overflow to inf, whose softmax is NaN: at +-LOGIT_CAP a
    # token is already certain / impossible, and divided by a temperature >= _EPS it stays finite in float32
    return logits.clamp(-LOGIT_CAP, LOGIT_CAP)


def needs_processing(params: SamplingParams, generated: int) -> bool:
    """Whether apply_penalties would change this row's logits at this step."""
    return bool(params.logit_bias or params.frequency_penalty or params.presence_penalty
                or params.repetition_penalty != 1.0 or generated < params.min_new_tokens)


def _filtered_probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """logits [b, V] (rows sharing p's filters) -> sampling distribution [b, V]."""
    probs = torch.softmax(logits / p.temperature, dim=-1)  # [b, V]
    if p.top_k < probs.shape[-1]:
        kth = torch.topk(probs, p.top_k, dim=-1).values[:, -1:]  # [b, 1]
        probs = torch.where(probs < kth, torch.zeros_like(probs), probs)
    if p.top_p < 1.0:
        sorted_p, order = torch.sort(probs, dim=-1, descending=True)
        drop = (torch.cumsum(sorted_p, dim=-1) - sorted_p) > p.top_p  # keep the smallest prefix reaching top_p
        probs = torch.zeros_like(probs).scatter(-1, order, torch.where(drop, torch.zeros_like(sorted_p), sorted_p))
    if p.min_p > 0.0:
        probs = torch.where(probs < p.min_p * probs.max(dim=-1, keepdim=True).values, torch.zeros_like(probs), probs)
    return probs / probs.sum(dim=-1, keepdim=True)


def sample_rows(logits: torch.Tensor, params: list[SamplingParams], positions: list[int]) -> list[int]:
    """One token per row of processed logits [b, V]; rows with the same filters are sampled together.

    A row with a sampling_seed draws from a generator seeded by (seed, position) alone, so its token
    does not depend on the other rows.
    """
    out = [0] * len(params)
    groups: dict[tuple[Any, ...], list[int]] = {}
    for i, p in enumerate(params):
        key = ("greedy",) if p.greedy else (p.temperature, p.top_k, p.top_p, p.min_p)
        groups.setdefault(key, []).append(i)
    for key, rows in groups.items():
        sub = logits[rows]  # [g, V]
        if key == ("greedy",):
            toks = torch.argmax(sub, dim=-1).tolist()
        else:
            probs = _filtered_probs(sub, params[rows[0]])
            toks = torch.multinomial(probs, 1).squeeze(-1).tolist()
            for j, i in enumerate(rows):
                seed = params[i].sampling_seed
                if seed is not None:
                    toks[j] = int(torch.multinomial(probs[j], 1, generator=_seeded_generator(seed, positions[i])))
        for i, tok in zip(rows, toks, strict=True):
            out[i] = int(tok)
    return out


@dataclass
class StopCheck:
    """What ended a sequence, in SGLang's `finish_reason` shape."""

    finish_reason: dict[str, Any] | None
    trim_to: int | None = None  # cut the text at this character (a matched stop string)


def check_stop(params: SamplingParams, output_ids: list[int], text: str, eos_ids: set[int],
               context_left: int) -> StopCheck:
    """SGLang's `check_finished` order: min_new_tokens, length, stop token, stop string, stop regex."""
    n = len(output_ids)
    if n < params.min_new_tokens:
        return StopCheck(None)
    last = output_ids[-1]
    if params.max_new_tokens is not None and n >= params.max_new_tokens:
        return StopCheck({"type": "length", "length": params.max_new_tokens})
    if context_left <= 0:
        return StopCheck({"type": "length", "length": n})
    if last in params.stop_token_ids or (not params.ignore_eos and last in eos_ids):
        return StopCheck({"type": "stop", "matched": last})
    for s in params.stop:
        idx = text.find(s)
        if s and idx >= 0:
            return StopCheck({"type": "stop", "matched": s}, None if params.no_stop_trim else idx)
    for pattern in params.stop_regex:
        m = re.search(pattern, text)
        if m:
            return StopCheck({"type": "stop", "matched": pattern}, None if params.no_stop_trim else m.start())
    return StopCheck(None)
