"""One recipe per file behind one small interface (base.Recipe; torchtune's habit), picked once per job here.

- grpo.py: one LoRA adapter on a language model, GRPO on Ray (the default);
- multi_lora.py: many adapters on one frozen base (multiLora.maxAdapters > 0), each with its own data and steps;
- flow_grpo.py: Flow-GRPO on a diffusion transformer's adapter (a `diffusion` section).

They share base.py: the run's one Clock, the one EngineWatch, the Ray start and stop of the language-model jobs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kora_trainer.recipes.base import Clock, Recipe, RecipeRefused

if TYPE_CHECKING:
    from kora_trainer.config import TrainerConfig

__all__ = ["Clock", "Recipe", "RecipeRefused", "recipe_for"]


def recipe_for(cfg: TrainerConfig, clock: Clock, threads: int = 1) -> Recipe:
    """The job's recipe: the only place that asks which kind of job it is. Each module is imported when chosen
    (flow_grpo imports torch and the diffusion stack; a dry run or a refused config needs neither)."""
    if cfg.diffusion is not None:
        from kora_trainer.recipes.flow_grpo import FlowGRPO  # noqa: PLC0415 - deliberate: each recipe loads its own stack when chosen

        return FlowGRPO(cfg, clock, threads)
    if cfg.multi_lora.on:
        from kora_trainer.recipes.multi_lora import MultiLoRA  # noqa: PLC0415 - deliberate: each recipe loads its own stack when chosen

        return MultiLoRA(cfg, clock, threads)
    from kora_trainer.recipes.grpo import GRPO  # noqa: PLC0415 - deliberate: each recipe loads its own stack when chosen

    return GRPO(cfg, clock, threads)
