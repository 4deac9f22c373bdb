"""The serving check: no silent non-delivery of the policy.

Each on-policy step compares the engines' log-probs of the sampled tokens with the trainer's own for the
policy version the engines claim to serve (`rollout_logp_gap_max`, backends/grpo_step.py). After a correct
sync they agree up to kernel noise; an engine that dropped the adapter, or a sync that reached no LoRA tensor,
shows as a gap of the adapter's whole effect. `ServingCheck.observe` keeps the count of consecutive steps
above sync.servedLogpGapMax and `verdict` raises `PolicyNotServed` at sync.servedBadStepsToFail, so the run stops
instead of training against a policy the engines do not run. A step without a gap (async: rollouts of an older
version) neither counts nor resets.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


class PolicyNotServed(RuntimeError):
    """The engines do not serve the policy the trainer holds, for `bad_steps` steps in a row."""


@dataclass
class ServingCheck:
    threshold: float
    bad_steps_to_fail: int
    bad_steps: int = 0
    field: str = "sync.servedLogpGapMax"  # where the threshold is set (a diffusion job's: diffusion.servedLogpGapMax)

    def observe(self, step: int, version: int, gap_max: float | None, gap_mean: float | None) -> dict[str, Any] | None:
        """The step's /status `servingCheck` (None when it measured no gap), the bad-step count moved on."""
        if gap_max is None:
            return None
        self.bad_steps = self.bad_steps + 1 if gap_max > self.threshold else 0
        return {"logpGapMax": gap_max, "logpGapMean": gap_mean, "version": version, "step": step,
                "threshold": self.threshold, "badSteps": self.bad_steps}

    def verdict(self, check: dict[str, Any] | None) -> None:
        """Raises PolicyNotServed once `bad_steps_to_fail` consecutive steps exceeded the threshold (`check`:
        the last step's `observe`)."""
        if check is None or self.bad_steps < self.bad_steps_to_fail:
            return
        mean = check["logpGapMean"]
        raise PolicyNotServed(
            f"the engines do not serve the trained policy: {self.bad_steps} consecutive steps (through step "
            f"{check['step']}) had an engine-vs-trainer log-prob gap above {self.field} {self.threshold:g} "
            f"(last {check['logpGapMax']:.3g}, mean {'?' if mean is None else f'{mean:.3g}'}, at policy version "
            f"{check['version']}); likely the engine dropped or never loaded the adapter, the sync reached no LoRA "
            "tensor (target modules the engine does not map), or the engine serves another base: check the engine "
            f"logs and the target modules; raise {self.field} only if this gap is kernel noise (bf16)")
