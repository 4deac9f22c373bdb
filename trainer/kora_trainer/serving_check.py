"""The serving check: no silent non-delivery of the policy.

Each on-policy step compares the engines' log-probs of the sampled tokens with the trainer's own for the
policy version the engines claim to serve (`rollout_logp_gap_max`, backends/grpo_step.py). After a correct
sync they agree up to kernel noise; an engine that dropped the adapter, or a sync that reached no LoRA tensor,
shows as a gap of the adapter's whole effect. `ServingCheck.observe` keeps the count of consecutive steps
above sync.servedLogpGapMax and `verdict` raises `PolicyNotServed` at sync.servedBadStepsToFail, so the run stops
instead of training against a policy the engines do not run. A step without a gap (async: rollouts of an older
version) neither counts nor resets. A multi-adapter job keeps one check per adapter (`adapter` names it, in the
check and in the message), counted over that adapter's own steps.
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
    adapter: str | None = None  # a multi-adapter job's adapter this check is of (its steps, its versions)

    def observe(self, step: int, version: int, gap_max: float | None, gap_mean: float | None) -> dict[str, Any] | None:
        """The step's /status `servingCheck` (None when it measured no gap), the bad-step count moved on."""
        if gap_max is None:
            return None
        self.bad_steps = self.bad_steps + 1 if gap_max > self.threshold else 0
        check = {"logpGapMax": gap_max, "logpGapMean": gap_mean, "version": version, "step": step,
                 "threshold": self.threshold, "badSteps": self.bad_steps}
        return check if self.adapter is None else {**check, "adapter": self.adapter}

    def verdict(self, check: dict[str, Any] | None) -> None:
        """Raises PolicyNotServed once `bad_steps_to_fail` consecutive steps exceeded the threshold (`check`:
        the last step's `observe`)."""
        if check is None or self.bad_steps < self.bad_steps_to_fail:
            return
        mean = check["logpGapMean"]
        whose, its = ("", "") if self.adapter is None else (f"adapter {self.adapter}: ", "its ")
        raise PolicyNotServed(
            f"{whose}the engines do not serve {its or 'the '}trained policy: {self.bad_steps} consecutive steps "
            f"(through {its}step {check['step']}) had an engine-vs-trainer log-prob gap above {self.field} "
            f"{self.threshold:g} (last {check['logpGapMax']:.3g}, mean {'?' if mean is None else f'{mean:.3g}'}, at "
            f"{its}policy version {check['version']}); likely the engine dropped or never loaded the adapter, the "
            "sync reached no LoRA tensor (target modules the engine does not map), or the engine serves another "
            f"base: check the engine logs and the target modules; raise {self.field} only if this gap is kernel "
            "noise (bf16)")
