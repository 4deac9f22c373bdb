"""The SPEC's validation rules, each written once.

Every rule has one message that names the fields and the fix. Rules the API server can decide
from the object alone carry a CEL expression; the CRD generator attaches those to the spec, so
`kubectl apply` and `kora validate` reject with the same words. Rules that need the model's
config.json, or LoRAAdapter objects, are checked by `kora validate`, the operator and the trainer.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

from kora_trainer.config import sglang_builds as sb
from kora_trainer.config.layout import FIX_DATA_SEARCH, PARALLEL_MESSAGE, parallel_problems
from kora_trainer.config.sections import (
    AUTO,
    AdapterRunConfig,
    CheckpointDType,
    DeploymentMode,
    Engine,
    LrDecayStyle,
    SGLangBuild,
    SyncMode,
    TargetModule,
)
from kora_trainer.config.start_layout import EXPERT_KEYS
from kora_trainer.config.trainer import TrainerConfig

Severity = Literal["error", "warning"]


@dataclass(frozen=True)
class Problem:
    """One broken rule: which rule, where, and what to do about it."""

    rule: str
    field: str
    message: str
    severity: Severity = "error"

    def __str__(self) -> str:
        return f"{self.severity}: {self.message}"


@dataclass(frozen=True)
class SpecRule:
    """A rule over the spec alone; `cel` (when set) must hold, evaluated on the spec object.

    A rule whose message carries the job's own numbers also has `explain` (the message for a spec, in Python)
    and `cel_message` (the same words as a CEL string expression: the CRD's messageExpression, built with
    `cel_format` from the one %-template `explain` fills in). `message` is then the words without the numbers,
    which the API server falls back to if the expression cannot be evaluated."""

    id: str
    field: str
    message: str
    violated: Callable[[Any], bool]  # takes a TrainerConfig (or the operator spec, a subclass)
    cel: str | None = None
    explain: Callable[[Any], str] | None = None
    cel_message: str | None = None

    def text(self, spec: Any) -> str:
        """The message for this spec (which breaks the rule)."""
        return self.explain(spec) if self.explain is not None else self.message

    def problem(self, spec: Any) -> Problem:
        return Problem(self.id, self.field, self.text(spec))

    def cel_validation(self) -> dict[str, Any]:
        assert self.cel is not None
        out = {"rule": self.cel, "message": self.message, "fieldPath": "." + self.field}
        if self.cel_message is not None:
            out["messageExpression"] = self.cel_message
        return out


def cel_format(template: str, args: Sequence[str]) -> str:
    """CEL that renders `template` (a Python %-template of %d and %s only) with the values of the CEL
    expressions `args`: `template % values` in Python and this in the API server give the same string.
    (CEL's strings.format, Kubernetes >= 1.30 for a new rule; concatenating string(int)s instead is refused by
    the API server's cost estimate.)"""
    return f"{json.dumps(template)}.format([{', '.join(args)}])"


_ADAPTER = "(has(self.lora.syncMode) && self.lora.syncMode == 'Adapter')"
# layout.parallel_problems in CEL (every parallelism field has a default in the CRD, so each is present)
_P = "self.parallelism"
_STAGE = f"{_P}.data * {_P}.tensor * {_P}.context"
_EXPERTS = f"{_P}.expert * {_P}.expertTensor"
# layout.fix_data: the first of 1..FIX_DATA_SEARCH that fits, else expert x expertTensor
_FIX_DATA = (f"({list(range(1, FIX_DATA_SEARCH + 1))}.filter(d, (d * {_P}.tensor * {_P}.context) % ({_EXPERTS}) == 0)"
             f" + [{_EXPERTS}])[0]")


def _adapter(c: TrainerConfig) -> bool:
    return c.lora.sync_mode is SyncMode.ADAPTER


# sglang_builds.effective_build in CEL: rollout.sglangBuild, else the pin for engine sglang, else none ('')
_BUILD = (f"(has(self.rollout.sglangBuild) ? self.rollout.sglangBuild : "
          f"(self.rollout.engine == 'sglang' ? '{sb.DEFAULT_BUILD.value}' : ''))")
# the builds without an adapter route over the weight-update group (route_plan refuses their Disaggregated multi-LoRA)
_NO_GROUP_ADAPTER_BUILDS = [b.name.value for b in sb.BUILDS.values() if not b.adapter_over_group]


def _build_refused(c: TrainerConfig, mode: SyncMode | None = None) -> str | None:
    """The build's refusal of this job's combination (of sync mode `mode` only, when given)."""
    plan = sb.plan_for(c)
    if plan is None or plan.refused is None:
        return None
    return plan.refused if mode is None or c.lora.effective_sync_mode is mode else None


# A diffusion job (docs/diffusion.md): what its path runs today. The seed's own rule (--lora-ipc-weight-sync needs
# --colocate) holds for both its modes here: the weights go by same-host handles (update_weights_from_tensor).
_CONSTANT_LR = "(!has(self.algorithm.lrDecayStyle) || self.algorithm.lrDecayStyle == 'constant')"
# multiLora.maxAdapters is an int or 'auto' (config/sections.py SlotCount): on = auto or > 0
_ML_ON = "(type(self.multiLora.maxAdapters) == string || self.multiLora.maxAdapters > 0)"
_ML_OFF = "(type(self.multiLora.maxAdapters) == int && self.multiLora.maxAdapters == 0)"
_NOT_DATA = ("tensor", "pipeline", "context", "expert", "expert_tensor")  # the parallelism a diffusion job refuses
_P_ONE = " && ".join(f"{_P}.{f} == 1" for f in ("tensor", "pipeline", "context", "expert", "expertTensor"))
_DIFFUSION_RULES: tuple[tuple[str, str, str, Callable[[TrainerConfig], bool], str], ...] = (
    ("diffusion-sync-mode", "lora.syncMode",
     "lora.syncMode Adapter is not a diffusion mode (sglang-diffusion engines have no LoRA layers to serve an "
     "adapter with): use EngineMerge (IPC merge, the seed's --lora-ipc-weight-sync) or Merge (train-side merge)",
     lambda c: c.lora.sync_mode is SyncMode.ADAPTER, "!has(self.lora.syncMode) || self.lora.syncMode != 'Adapter'"),
    ("diffusion-colocate", "deployment.mode",
     "a diffusion job pushes its weights to the engine by same-host handles (update_weights_from_tensor, as the "
     "seed's CUDA IPC), so trainer and engine must share a host: set deployment.mode Colocate (the seed's --colocate)",
     lambda c: c.deployment.mode is not DeploymentMode.COLOCATE, "self.deployment.mode == 'Colocate'"),
    ("diffusion-data-parallel", "parallelism.tensor",
     "a diffusion job's ranks are data-parallel only (FSDP2 shards the transformer over parallelism.data; "
     "tensor, pipeline, context and expert parallelism are not built for it): set parallelism tensor, pipeline, "
     "context, expert and expertTensor to 1 and scale with parallelism.data",
     lambda c: any(getattr(c.parallelism, f) != 1 for f in _NOT_DATA), _P_ONE),
    ("diffusion-data-split", "algorithm.rolloutBatchSize",
     "a diffusion job splits each optimizer step's prompt groups evenly over its parallelism.data ranks: make "
     "algorithm.rolloutBatchSize (or, when set, algorithm.globalBatchSize / nSamplesPerPrompt) a multiple of "
     "parallelism.data",
     lambda c: c.algorithm.effective_global_batch_size % (c.algorithm.n_samples_per_prompt * c.parallelism.data) != 0,
     f"{_P}.data == 1 || (has(self.algorithm.globalBatchSize) ? self.algorithm.globalBatchSize : "
     f"self.algorithm.rolloutBatchSize * self.algorithm.nSamplesPerPrompt) % (self.algorithm.nSamplesPerPrompt * "
     f"{_P}.data) == 0"),
    ("diffusion-one-engine", "rollout.numEngines",
     "a diffusion job rolls out on one engine, the reference diffusion engine beside the trainer, on the CPU "
     "(rollout.gpusPerEngine 0) or on the trainer's GPU (1): set rollout.engine hf, rollout.numEngines 1, "
     "rollout.gpusPerEngine 0 or 1, rollout.dpSize 1, rollout.distributedEngines 0 and leave rollout.sglangBuild "
     "unset (launching sglang-diffusion and engines of several GPUs are not built)",
     lambda c: (c.rollout.engine != "hf" or c.rollout.num_engines != 1 or c.rollout.gpus_per_engine > 1
                or c.rollout.dp_size != 1 or c.rollout.distributed_engines != 0 or c.rollout.sglang_build is not None),
     "self.rollout.engine == 'hf' && self.rollout.numEngines == 1 && self.rollout.gpusPerEngine <= 1 && "
     "self.rollout.dpSize == 1 && self.rollout.distributedEngines == 0 && !has(self.rollout.sglangBuild)"),
    ("diffusion-gpu-ranks", "rollout.gpusPerEngine",
     "rollout.gpusPerEngine 1 runs a diffusion job on one GPU, its engine and one trainer rank sharing it; "
     "data-parallel ranks on GPUs (NCCL, a rank per GPU) are not built: set parallelism.data 1, or "
     "rollout.gpusPerEngine 0 to run the ranks on CPUs",
     lambda c: c.rollout.gpus_per_engine > 0 and c.parallelism.data > 1,
     f"self.rollout.gpusPerEngine == 0 || {_P}.data == 1"),
    ("diffusion-sync-rollouts", "deployment.async",
     "deployment.async is not built for diffusion jobs (each step's images come from the policy just pushed): set "
     "deployment.async to false",
     lambda c: c.deployment.async_, "!self.deployment.async"),
    ("diffusion-torch", "backend",
     "backend megatron trains language models; a diffusion transformer trains on the torch backend: set backend to "
     "torch or auto",
     lambda c: c.backend == "megatron", "self.backend != 'megatron'"),
    ("diffusion-dropout", "lora.dropout",
     "lora.dropout > 0 would make the trainer's re-score of a denoising step differ from the rollout's log-prob "
     "(Flow-GRPO's ratio needs the same policy twice): set lora.dropout to 0",
     lambda c: c.lora.dropout != 0.0, "self.lora.dropout == 0.0"),
    ("diffusion-custom-reward", "data.customRewardPath",
     "diffusion.reward custom needs data.customRewardPath: set it to a dotted path such as mypkg.rewards.score (a "
     "`def score(images, prompts, labels) -> tensor [B]`)",
     lambda c: c.diffusion is not None and c.diffusion.reward == "custom" and c.data.custom_reward_path is None,
     "self.diffusion.reward != 'custom' || has(self.data.customRewardPath)"),
)
def _on_diffusion(bad: Callable[[TrainerConfig], bool]) -> Callable[[Any], bool]:
    return lambda c: c.diffusion is not None and bad(c)


DIFFUSION_RULES = tuple(SpecRule(rid, fld, msg, _on_diffusion(bad), f"!has(self.diffusion) || ({cel})")
                        for rid, fld, msg, bad, cel in _DIFFUSION_RULES)


# the sglang.launch_server flags kora derives from the spec (orchestration/sglang_launcher.sglang_command)
SGLANG_OWNED_FLAGS = ("--model-path", "--host", "--port", "--tp-size", "--dp-size", "--enable-lora",
                      "--max-loras-per-batch", "--max-lora-rank", "--lora-target-modules", "--api-key",
                      "--admin-api-key", "--config", "--base-gpu-id", "--random-seed")
_OWNED_CEL = "[" + ", ".join(f"'{f}'" for f in SGLANG_OWNED_FLAGS) + "]"


def _owned_sglang_flag(arg: str) -> bool:
    return arg.split("=", 1)[0] in SGLANG_OWNED_FLAGS


SPEC_RULES: tuple[SpecRule, ...] = (
    SpecRule(
        "sglang-args-owned", "rollout.sglangArgs",
        "rollout.sglangArgs names a flag kora sets from the spec (" + ", ".join(SGLANG_OWNED_FLAGS) + "): set it "
        "through its field (model.path, rollout.gpusPerEngine, rollout.dpSize, lora, ...) and remove it from "
        "rollout.sglangArgs",
        lambda c: any(_owned_sglang_flag(a) for a in c.rollout.sglang_args),
        f"!has(self.rollout.sglangArgs) || self.rollout.sglangArgs.all(a, !(a in {_OWNED_CEL}) "
        f"&& !{_OWNED_CEL}.exists(f, a.startsWith(f + '=')))",
    ),
    SpecRule(
        "sglang-args-engine", "rollout.sglangArgs",
        "rollout.sglangArgs are sglang.launch_server flags, and rollout.engine hf starts kora's reference engine, "
        "which takes none of them: set rollout.engine to sglang, or remove rollout.sglangArgs",
        lambda c: bool(c.rollout.sglang_args) and c.rollout.engine is Engine.HF,
        "!has(self.rollout.sglangArgs) || size(self.rollout.sglangArgs) == 0 || self.rollout.engine != 'hf'",
    ),
    # SPEC rule 3
    SpecRule(
        "adapter-dp-size", "rollout.dpSize",
        "lora.syncMode Adapter requires rollout.dpSize 1 (SGLang's runtime LoRA loading does not "
        "support DP attention): set rollout.dpSize to 1, or use lora.syncMode Merge",
        lambda c: _adapter(c) and c.rollout.dp_size != 1,
        f"!{_ADAPTER} || self.rollout.dpSize == 1",
    ),
    # SPEC rule 5
    SpecRule(
        "router-needs-adapter", "lora.targetModules",
        "lora.targetModules contains router, which requires lora.syncMode Adapter (Merge and "
        "EngineMerge fold plain linear layers only, so the router adapter would be dropped at "
        "sync): remove router, or set lora.syncMode to Adapter",
        lambda c: TargetModule.ROUTER in c.lora.target_modules and not _adapter(c),
        f"!('router' in self.lora.targetModules) || {_ADAPTER}",
    ),
    # SPEC rule 7
    SpecRule(
        "adapter-colocate-distributed", "rollout.distributedEngines",
        "lora.syncMode Adapter with deployment.mode Colocate cannot feed distributed rollout "
        "engines (the adapter is pushed to colocated engines only): set rollout.distributedEngines "
        "to 0, use deployment.mode Disaggregated, or use lora.syncMode Merge",
        lambda c: _adapter(c) and c.deployment.mode is DeploymentMode.COLOCATE
        and c.rollout.distributed_engines > 0,
        f"!({_ADAPTER} && self.deployment.mode == 'Colocate' && self.rollout.distributedEngines > 0)",
    ),
    # SPEC rule 8 (the rest of it, "every trainable parameter is a LoRA parameter", is checked by
    # the trainer when it builds the model)
    SpecRule(
        "lora-only-async-save", "checkpoint.asyncSave",
        "checkpoint.loraOnly is incompatible with checkpoint.asyncSave: set asyncSave to false, "
        "or loraOnly to false for a full checkpoint",
        lambda c: c.checkpoint.lora_only and c.checkpoint.async_save,
        "!self.checkpoint.loraOnly || !self.checkpoint.asyncSave",
    ),
    SpecRule(  # the one other save (loraOnly false) is written the same way: no background writer is built
        "async-save-not-built", "checkpoint.asyncSave",
        "checkpoint.asyncSave: background checkpoint writes are not built (each checkpoint, the adapter and its "
        "optimizer state, is written before the next step starts): set asyncSave to false",
        lambda c: c.checkpoint.async_save and not c.checkpoint.lora_only,
        "!self.checkpoint.asyncSave || self.checkpoint.loraOnly",
    ),
    SpecRule(
        "lora-only-dtype", "checkpoint.dtype",
        "checkpoint.loraOnly needs a bf16 or fp32 checkpoint, not fp16/fp8: set checkpoint.dtype "
        "to bf16",
        lambda c: c.checkpoint.lora_only and c.checkpoint.dtype in (CheckpointDType.FP16, CheckpointDType.FP8),
        "!self.checkpoint.loraOnly || !(self.checkpoint.dtype in ['fp16', 'fp8'])",
    ),
    SpecRule(
        "export-needs-path", "checkpoint.path",
        "checkpoint.exportHF needs checkpoint.path: set checkpoint.path to a directory on the "
        "job's volume",
        lambda c: c.checkpoint.export_hf and c.checkpoint.path is None,
        "!self.checkpoint.exportHF || has(self.checkpoint.path)",
    ),
    SpecRule(
        "steps-or-epochs", "algorithm.numEpochs",
        "algorithm.numSteps and algorithm.numEpochs are both set: keep one of them",
        lambda c: c.algorithm.num_steps is not None and c.algorithm.num_epochs is not None,
        "!(has(self.algorithm.numSteps) && has(self.algorithm.numEpochs))",
    ),
    SpecRule(
        "global-batch-divides", "algorithm.globalBatchSize",
        "algorithm.globalBatchSize must divide rolloutBatchSize x nSamplesPerPrompt (the samples "
        "of one step): change globalBatchSize, or leave it unset for one optimizer step per rollout",
        lambda c: (c.algorithm.rollout_batch_size * c.algorithm.n_samples_per_prompt)
        % c.algorithm.effective_global_batch_size != 0,
        "!has(self.algorithm.globalBatchSize) || (self.algorithm.rolloutBatchSize * "
        "self.algorithm.nSamplesPerPrompt) % self.algorithm.globalBatchSize == 0",
    ),
    SpecRule(
        "custom-reward-path", "data.customRewardPath",
        "data.rewardType custom needs data.customRewardPath: set it to a dotted path such as "
        "mypkg.rewards.reward (a `def reward(sample) -> float`)",
        lambda c: c.data.reward_type == "custom" and c.data.custom_reward_path is None,
        "self.data.rewardType != 'custom' || has(self.data.customRewardPath)",
    ),
    SpecRule(
        "multi-lora-needs-adapter", "multiLora.maxAdapters",
        "multiLora.maxAdapters > 0 serves several adapters on one base, which requires "
        "lora.syncMode Adapter: set lora.syncMode to Adapter, or multiLora.maxAdapters to 0",
        lambda c: c.multi_lora.on and not _adapter(c),
        f"{_ML_OFF} || {_ADAPTER}",
    ),
    SpecRule(
        "multi-lora-images", "data.imageKey",
        "data.imageKey is not read by a multi-adapter job (each adapter rolls out its own data): set data.imageKey on "
        "each adapter that has images (its LoRAAdapter's spec.data.imageKey, or multiLora.adapters[].data.imageKey), "
        "or set multiLora.maxAdapters to 0",
        lambda c: c.multi_lora.on and c.data.image_key is not None,
        f"{_ML_OFF} || !has(self.data.imageKey)",
    ),
    # the learning-rate schedule (algorithm/lr_schedule.py)
    SpecRule(  # a multi-adapter job decays each adapter over its own step count (adapter_schedule_problems)
        "lr-decay-steps", "algorithm.lrDecaySteps",
        "algorithm.lrDecayStyle linear or cosine needs the step its decay ends at: set algorithm.lrDecaySteps "
        "(or algorithm.numSteps, its default), or set lrDecayStyle constant",
        lambda c: c.algorithm.lr_decay_style is not LrDecayStyle.CONSTANT and c.algorithm.num_steps is None
        and c.algorithm.lr_decay_steps is None and not c.multi_lora.on,
        f"{_CONSTANT_LR} || has(self.algorithm.numSteps) || has(self.algorithm.lrDecaySteps) || {_ML_ON}",
    ),
    SpecRule(
        "min-lr", "algorithm.minLr",
        "algorithm.minLr is above algorithm.lr, so the decay would raise the rate: set minLr at most lr",
        lambda c: c.algorithm.min_lr > c.algorithm.lr,
        "!has(self.algorithm.minLr) || self.algorithm.minLr <= self.algorithm.lr",
    ),
    SpecRule(
        "lr-warmup-steps", "algorithm.lrWarmupSteps",
        "algorithm.lrWarmupSteps must end before the decay does (lrDecaySteps, default numSteps): lower "
        "lrWarmupSteps or raise lrDecaySteps",
        lambda c: c.algorithm.lr_decay_style is not LrDecayStyle.CONSTANT
        and (c.algorithm.lr_decay_steps or c.algorithm.num_steps or c.algorithm.lr_warmup_steps + 1)
        <= c.algorithm.lr_warmup_steps,
        f"{_CONSTANT_LR} || !has(self.algorithm.lrWarmupSteps) || self.algorithm.lrWarmupSteps < "
        "(has(self.algorithm.lrDecaySteps) ? self.algorithm.lrDecaySteps : (has(self.algorithm.numSteps) ? "
        "self.algorithm.numSteps : self.algorithm.lrWarmupSteps + 1))",
    ),
    # the named SGLang build (config/sglang_builds.py's table): what it has no route for
    SpecRule(
        "build-engine-merge", "lora.syncMode",
        "lora.syncMode EngineMerge needs an engine that folds lora_A/lora_B into its base, which no SGLang build "
        "has (rollout.sglangBuild, or rollout.engine sglang): use lora.syncMode Merge, or rollout.engine hf "
        "without rollout.sglangBuild",
        lambda c: _build_refused(c, SyncMode.ENGINE_MERGE) is not None,
        f"!({_BUILD} != '' && has(self.lora.syncMode) && self.lora.syncMode == 'EngineMerge')",
        explain=lambda c: _build_refused(c) or "",
        cel_message=cel_format(sb.ENGINE_MERGE_REFUSED, [_BUILD, _BUILD]),
    ),
    SpecRule(
        "build-multi-lora", "multiLora.maxAdapters",
        "multiLora.maxAdapters > 0 with deployment.mode Disaggregated needs an adapter route over the weight-update "
        "group, which the named SGLang build lacks: set deployment.mode Colocate, rollout.sglangBuild to "
        f"{SGLangBuild.MILES_94949DA7.value}, or multiLora.maxAdapters to 0",
        lambda c: c.multi_lora.on and _build_refused(c, SyncMode.ADAPTER) is not None,
        f"!({_BUILD} in {_NO_GROUP_ADAPTER_BUILDS} && {_ADAPTER} && {_ML_ON} && "
        "self.deployment.mode == 'Disaggregated')",
        explain=lambda c: _build_refused(c) or "",
        cel_message=cel_format(sb.MULTI_LORA_REFUSED, [_BUILD]),
    ),
    # megatron-core's layout (config/layout.py): expert parallelism is carved out of one pipeline stage's ranks
    SpecRule(
        "expert-parallel-divides", "parallelism.expert",
        "parallelism.expert x expertTensor must divide data x tensor x context, the ranks of one pipeline stage "
        "(megatron-core carves expert parallelism out of them): raise parallelism.data, or lower parallelism.expert",
        lambda c: bool(parallel_problems(c.parallelism)),
        f"({_STAGE}) % ({_EXPERTS}) == 0",
        explain=lambda c: parallel_problems(c.parallelism)[0],
        cel_message=cel_format(PARALLEL_MESSAGE, [
            f"{_P}.expert", f"{_P}.expertTensor", f"{_P}.data", f"{_P}.tensor", f"{_P}.context", _STAGE, _FIX_DATA]),
    ),
    *DIFFUSION_RULES,
)


# language-model fields that do nothing in a diffusion job: one set to anything but its default is refused, with
# its diffusion counterpart named in the fix (the default itself is what the API server fills in for every job)
LANGUAGE_ONLY: tuple[tuple[str, str, str], ...] = (
    ("lora", "target_modules", "set diffusion.targetModules (diffusers names: to_q, to_k, ...)"),
    ("lora", "scope", "remove it (a diffusion transformer has one region)"),
    ("algorithm", "clip_eps", "set diffusion.clipEps (Flow-GRPO's per-step clip, default 1e-4)"),
    ("algorithm", "max_new_tokens", "set diffusion.numInferenceSteps (the denoising steps)"),
    ("algorithm", "temperature", "set diffusion.noiseLevel (the SDE's exploration)"),
    ("data", "reward_type", "set diffusion.reward (colour, or custom with data.customRewardPath)"),
    ("sync", "served_logp_gap_max", "set diffusion.servedLogpGapMax (a denoising step's log-prob is a mean over "
     "the latent's elements, far smaller than a token's)"),
)


def diffusion_unused_problems(cfg: TrainerConfig) -> list[Problem]:
    """Language-model fields a diffusion job sets to other than their defaults, which its path never reads:
    refused, not ignored (checked by `kora validate`, the operator and the trainer; not in the CRD's CEL)."""
    if cfg.diffusion is None:
        return []
    out = []
    for section, name, fix in LANGUAGE_ONLY:
        part = getattr(cfg, section)
        info = type(part).model_fields[name]
        if getattr(part, name) != info.get_default(call_default_factory=True):
            alias = info.alias or name
            out.append(Problem("diffusion-unused", f"{section}.{alias}",
                               f"{section}.{alias} does nothing in a diffusion job: {fix}"))
    return out


# SPEC rule 2: not an error. Same words in the operator's Warning event and the trainer's log.
NO_SYNC_MODE_WARNING = (
    "lora.syncMode is not set: using Merge (set lora.syncMode to Merge, Adapter or EngineMerge "
    "to choose and silence this warning)"
)

VISION_SCOPE_MESSAGE = (
    "lora.syncMode Adapter with lora.scope all is not supported on a model with a vision/audio "
    "encoder ({path}/config.json declares {keys}): SGLang serves LoRA on language layers only, so "
    "the vision adapter would train and never be served. Set lora.scope to language, or use "
    "lora.syncMode Merge to train the vision tower"
)
EXPERT_TENSOR_MESSAGE = (
    "MoE expert LoRA folding requires parallelism.expertTensor 1 (experts are folded on their "
    "owning rank; expert tensor parallelism would leave one rank alone in a collective and hang): "
    "set parallelism.expertTensor to 1 (parallelism.expert may stay > 1){why}"
)


def spec_problems(cfg: TrainerConfig) -> list[Problem]:
    """Rules decidable from the spec alone (what the CRD's CEL also enforces), plus rule 2."""
    problems = [r.problem(cfg) for r in SPEC_RULES if r.violated(cfg)]
    problems += diffusion_unused_problems(cfg)
    if cfg.lora.sync_mode is None:
        problems.append(Problem("no-sync-mode", "lora.syncMode", NO_SYNC_MODE_WARNING, "warning"))
    return problems


def _declared_encoders(hf_config: Mapping[str, Any]) -> list[str]:
    """vision_config / audio_config anywhere in config.json (omni models nest them)."""
    found: list[str] = []
    for key, value in hf_config.items():
        if key in ("vision_config", "audio_config") and value:
            found.append(key)
        elif isinstance(value, Mapping):
            found.extend(_declared_encoders(value))
    return sorted(set(found))


def is_moe(hf_config: Mapping[str, Any]) -> bool:
    if any(isinstance(hf_config.get(k), int) and hf_config[k] > 1 for k in EXPERT_KEYS):
        return True
    return any(isinstance(v, Mapping) and is_moe(v) for v in hf_config.values())


def model_problems(cfg: TrainerConfig, hf_config: Mapping[str, Any] | None) -> list[Problem]:
    """Rules that need the base model's config.json (SPEC rules 4 and 6).

    Rule 6 is also decided without config.json when parallelism.expert > 1 (only MoE models have
    expert parallelism).
    """
    problems: list[Problem] = []
    mode = cfg.lora.effective_sync_mode
    if hf_config is not None and mode is SyncMode.ADAPTER and cfg.lora.scope == "all":
        keys = _declared_encoders(hf_config)
        if keys:
            problems.append(Problem("adapter-vision-scope", "lora.scope",
                                    VISION_SCOPE_MESSAGE.format(path=cfg.model.path, keys="/".join(keys))))
    moe = cfg.parallelism.expert > 1 or (hf_config is not None and is_moe(hf_config))
    adapts_experts = {TargetModule.LINEAR_FC1, TargetModule.LINEAR_FC2} & set(cfg.lora.target_modules)
    # With LoRA the reference policy is the base with the adapter off; an off-policy (async) or KL
    # run still has a forward role with no adapter transport, whose expert delta gets folded.
    reference_role = cfg.algorithm.kl_coef > 0 or cfg.deployment.async_
    folds = mode is not SyncMode.ADAPTER or reference_role
    if moe and adapts_experts and folds and cfg.parallelism.expert_tensor != 1:
        why = "" if mode is not SyncMode.ADAPTER else (
            "; Adapter mode folds here because a reference/actor-forward role exists "
            "(algorithm.klCoef > 0 or deployment.async)")
        problems.append(Problem("moe-expert-tensor", "parallelism.expertTensor",
                                EXPERT_TENSOR_MESSAGE.format(why=why)))
    return problems


def min_groups_per_dp_split(n_samples_per_prompt: int, dp_size: int) -> int:
    """Smallest number of prompt groups whose samples split evenly across the DP ranks."""
    return dp_size // math.gcd(dp_size, n_samples_per_prompt)


@dataclass(frozen=True)
class AdapterOrigin:
    """Where an adapter's config was written, so that a rule-9 message points there. `label` names the place
    (default: the LoRAAdapter); `keys` respells the config's camelCase keys as that place spells them (the seed's
    adapter.yaml is snake_case); `save` is the checkpoint directory a seed's adapter.yaml asks for, which must be
    where kora writes the adapter (`<checkpoint.path>/adapters/<name>/`)."""

    label: str
    keys: Mapping[str, str] = field(default_factory=dict)
    save: str | None = None

    def key(self, camel: str) -> str:
        return self.keys.get(camel, camel)


def adapter_problems(
    cfg: TrainerConfig,
    *,
    name: str,
    rank: int,
    rollout_batch_size: int,
    n_samples_per_prompt: int,
    origin: AdapterOrigin | None = None,
    stream_groups: int | None = None,
    config: AdapterRunConfig | None = None,
) -> list[Problem]:
    """SPEC rule 9: may this adapter join this multi-LoRA job? `config`, when given: its schedule too."""
    problems: list[Problem] = []
    dp = cfg.parallelism.data
    at = origin or AdapterOrigin(f"LoRAAdapter {name}")
    label, key = at.label, at.key
    if rank > cfg.lora.rank:
        problems.append(Problem("adapter-rank", "rank",
            f"{label}: {key('rank')} {rank} exceeds the job's lora.rank {cfg.lora.rank} (the "
            f"largest rank a slot holds): lower the adapter's rank or raise the job's lora.rank"))
    if n_samples_per_prompt % dp and dp % n_samples_per_prompt:
        problems.append(Problem("adapter-samples-dp", "nSamplesPerPrompt",
            f"{label}: {key('nSamplesPerPrompt')} {n_samples_per_prompt} must divide, or be a "
            f"multiple of, the trainer's data-parallel size {dp}: pick e.g. {dp} or "
            f"{max(1, math.gcd(dp, n_samples_per_prompt))}"))
    groups = min_groups_per_dp_split(n_samples_per_prompt, dp)
    if rollout_batch_size % groups:
        problems.append(Problem("adapter-batch-groups", "rolloutBatchSize",
            f"{label}: {key('rolloutBatchSize')} {rollout_batch_size} must be a multiple of "
            f"{groups} (the fewest prompt groups whose samples split evenly across {dp} "
            f"data-parallel ranks): use e.g. {groups * max(1, rollout_batch_size // groups)}"))
    if stream_groups is not None and stream_groups % groups:
        problems.append(Problem("adapter-stream-groups", "streamGroups",
            f"{label}: {key('streamGroups')} {stream_groups} must be a multiple of {groups} (the fewest prompt "
            f"groups whose samples split evenly across {dp} data-parallel ranks): use e.g. "
            f"{groups * max(1, stream_groups // groups)}, or leave it unset for {groups}"))
    cap = cfg.multi_lora.max_adapter_global_batch_size or 4 * cfg.algorithm.effective_global_batch_size
    gbs = rollout_batch_size * n_samples_per_prompt
    if gbs > cap:
        problems.append(Problem("adapter-batch-cap", "rolloutBatchSize",
            f"{label}: {key('rolloutBatchSize')} x {key('nSamplesPerPrompt')} = {gbs} exceeds the "
            f"job's cap {cap} (multiLora.maxAdapterGlobalBatchSize, default 4 x "
            f"algorithm.globalBatchSize): lower the adapter's batch or raise the cap"))
    if config is not None:
        problems += adapter_schedule_problems(cfg, config, label, key)
    return problems


def adapter_schedule_problems(cfg: TrainerConfig, a: AdapterRunConfig, label: str,
                              key: Callable[[str], str] = str) -> list[Problem]:
    """An adapter's own learning-rate schedule (its fields, else the job's algorithm ones): the single-adapter
    rules min-lr and lr-warmup-steps on its numbers. Its decay ends at its lrDecaySteps, else the job's, else its
    own step count; with numEpochs that count is known once its data is read, and a warmup as long as it simply
    ends where the decay does."""
    alg = cfg.algorithm
    lr = a.lr if a.lr is not None else alg.lr
    min_lr = a.min_lr if a.min_lr is not None else alg.min_lr
    warmup = a.lr_warmup_steps if a.lr_warmup_steps is not None else alg.lr_warmup_steps
    style = a.lr_decay_style or alg.lr_decay_style
    decay = a.lr_decay_steps or alg.lr_decay_steps or a.num_steps
    problems: list[Problem] = []
    if min_lr > lr:
        problems.append(Problem("adapter-min-lr", "minLr",
            f"{label}: {key('minLr')} {min_lr:g} (default the job's algorithm.minLr) is above its {key('lr')} "
            f"{lr:g}, so its decay would raise the rate: set its {key('minLr')} at most its {key('lr')}"))
    if style is not LrDecayStyle.CONSTANT and decay is not None and warmup >= decay:
        problems.append(Problem("adapter-lr-warmup-steps", "lrWarmupSteps",
            f"{label}: {key('lrWarmupSteps')} {warmup} (default the job's algorithm.lrWarmupSteps) must end before "
            f"its decay does (step {decay}: its {key('lrDecaySteps')}, else the job's, else its "
            f"{key('numSteps')}): lower its {key('lrWarmupSteps')} or raise its {key('lrDecaySteps')}"))
    return problems


def start_adapter_problems(cfg: TrainerConfig, origins: Sequence[AdapterOrigin] = ()) -> list[Problem]:
    """multiLora.adapters, the adapters a job trains from its start: slots for all of them, unique names, and
    SPEC rule 9 for each (what registering them at start would refuse, said before anything starts). `origins`
    describe the last len(origins) entries (the trainer's --multi-lora-adapter flags, appended after the job's
    own); the others are named by their place in multiLora.adapters."""
    adapters, slots = cfg.multi_lora.adapters, cfg.multi_lora.max_adapters
    if not adapters:
        return []
    problems: list[Problem] = []
    n = len(adapters)
    if slots == 0:
        problems.append(Problem("start-adapters-need-slots", "multiLora.maxAdapters",
            f"multiLora.adapters lists {n} adapter{'s' if n > 1 else ''} and multiLora.maxAdapters is 0 "
            f"(multi-LoRA off, no slots): set multiLora.maxAdapters to {n} or more, or remove multiLora.adapters"))
    elif slots != AUTO and n > int(slots):  # auto: sized at start, refused there when too few
        problems.append(Problem("start-adapters-fit", "multiLora.maxAdapters",
            f"multiLora.adapters lists {n} adapters and multiLora.maxAdapters is {slots} (each adapter holds a slot "
            f"while it trains): raise multiLora.maxAdapters to {n}, or list fewer adapters and register the rest "
            f"once a slot frees (a LoRAAdapter, or POST /adapter_runs)"))
    first = n - len(origins)
    at = [AdapterOrigin(f"multiLora.adapters[{i}] ({a.name})") for i, a in enumerate(adapters[:first])]
    at += list(origins)
    for name in sorted({a.name for a in adapters}):
        places = [at[i].label for i, a in enumerate(adapters) if a.name == name]
        if len(places) > 1:
            problems.append(Problem("start-adapter-names", "multiLora.adapters",
                f"multiLora.adapters names {name} {len(places)} times ({', '.join(places)}): an adapter's name is "
                f"its lora_path on the engines, its request-id prefix and its checkpoint directory, so each must be "
                f"unique: rename or remove the repeats"))
    alg = cfg.algorithm
    for i, (a, origin) in enumerate(zip(adapters, at, strict=True)):
        found = adapter_problems(cfg, name=a.name, rank=a.rank, origin=origin, config=a,
                                 rollout_batch_size=a.rollout_batch_size or alg.rollout_batch_size,
                                 n_samples_per_prompt=a.n_samples_per_prompt or alg.n_samples_per_prompt,
                                 stream_groups=a.stream_groups)
        problems += [replace(p, field=f"multiLora.adapters[{i}].{p.field}") for p in found]
        if origin.save is not None:
            problems += _save_problems(cfg, i, a.name, origin)
    return problems


def _save_problems(cfg: TrainerConfig, index: int, name: str, origin: AdapterOrigin) -> list[Problem]:
    """A seed adapter.yaml's `save`: kora writes adapter `name` under <checkpoint.path>/adapters/<name>/ and
    nowhere else, so a save elsewhere is refused rather than ignored."""
    assert origin.save is not None
    save = os.path.normpath(os.path.abspath(origin.save))
    written = os.path.join(os.path.abspath(cfg.checkpoint.path), "adapters", name) if cfg.checkpoint.path else None
    if written is not None and os.path.normpath(written) == save:
        return []
    where = f"for this job {os.path.normpath(written)}/" if written is not None else "checkpoint.path is not set"
    parts = Path(save).parts
    if parts[-2:] == ("adapters", name):
        fix = f"set checkpoint.path to {Path(save).parent.parent} (the --save flag)"
    else:
        fix = f"set checkpoint.path (the --save flag) to the directory that should hold adapters/{name}/"
    key = origin.key("save")
    return [Problem("adapter-save-dir", f"multiLora.adapters[{index}].{key}",
        f"{origin.label}: {key} {save} is not where kora writes this adapter: kora writes each adapter's "
        f"checkpoints under <checkpoint.path>/adapters/<name>/ ({where}) and has no per-adapter save directory: "
        f"{fix} and remove {key} from the file")]
