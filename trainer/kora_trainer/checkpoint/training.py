"""The train loop's checkpoints: what a LoRA-only checkpoint of a running job holds, how a job resumes from
one, and the HF-PEFT export written beside them. The files themselves are `lora_only.py`'s (atomic,
verified, pruned) and `peft_export.py`'s; this module decides what goes in and puts it back.

A checkpoint of step K is written after step K's update and its sync, and holds
- the adapter as the backend holds it (`backend.adapter_named()`: HF-PEFT names for the torch backend,
  megatron names and fused layout for the megatron one), its file in checkpoint.dtype; where that rounds the
  trained values, the exact ones too (precision.py), so a resumed run goes on from what the uninterrupted one held;
- the AdamW state, and the scheduler's (None: the trainer runs a constant learning rate);
- RNG: the trainer process's torch / python / numpy (/ cuda) states and the backend's own generators
  (the torch backend's minibatch shuffle);
- meta: step (= the policy version), `data_position` (prompt batches the rollout manager had taken for
  steps 1..K), the parameter names in the optimizer state's order, sync mode, base model.
The base is not saved: it is reloaded from model.path.

Resume with `deployment.async: false`: the trainer restores all of the above, the rollout manager
fast-forwards its seeded prompt iterator to `data_position`, the engines get policy K as the run's first
sync, and step K+1 generates from policy K with per-sample seeds derived from the step number — what the
uninterrupted run did — so steps K+1, K+2, ... reproduce its rewards, losses and adapter exactly (CPU,
one thread; on GPU as far as the kernels are deterministic; delta-skip threshold 0, or a skipped push
leaves the uninterrupted run's engines on a policy that differs from the trainer's by up to the threshold).

With `deployment.async: true` the uninterrupted run generated step K+1's rollouts with policy K-1 while
step K trained (one version of staleness). That in-flight generation is not part of the checkpoint: on
resume, step K+1's rollouts are regenerated from policy K (same prompts, same seeds, a policy one version
fresher). Training continues correctly but is not bit-identical to the uninterrupted run.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from kora_trainer.checkpoint import lora_only
from kora_trainer.checkpoint.lora_only import CheckpointError, select_state
from kora_trainer.checkpoint.peft_export import export_peft
from kora_trainer.config import MEGATRON_TO_HF, TrainerConfig

EXPORT_FORMAT = "kora-lora-export/1"
WHOLE_FACTORS = "whole"  # meta tp_layout: TP shards joined into one-rank layout (backends/megatron/tp_checkpoint.py)


@dataclass
class Resumed:
    step: int
    path: str
    data_position: int
    skipped: list[str] = field(default_factory=list)  # newer checkpoints refused, with the reason

    def as_dict(self) -> dict[str, Any]:
        return {"step": self.step, "path": self.path, "data_position": self.data_position, "skipped": self.skipped}


def save_training_state(root: Path, backend: Any, *, data_position: int, keep: int,
                        meta: Mapping[str, Any] | None = None, dtype: torch.dtype | None = None) -> Path | None:
    """Checkpoint `backend.version` under `root` (atomic; `latest` moves; pruned to `keep`).

    Every trainer rank calls it: under tensor parallelism the shards are gathered first (a collective,
    `backend.checkpoint_shards`); the writing rank (`backend.checkpoint_writer`: rank 0) returns the path, the
    others None."""
    shards = backend.checkpoint_shards
    if shards is None and not backend.checkpoint_writer:
        return None  # a data-parallel replica: nothing to gather, the writer holds the same state
    adapter = backend.adapter_named()  # the optimizer's parameter order
    optimizer = backend.optimizer.state_dict()
    rng = {**lora_only.capture_rng(), "generators": backend.generator_states()}
    if shards is not None:
        adapter, optimizer, rng = shards.gather(adapter, optimizer, rng)
    if not backend.checkpoint_writer:
        return None
    return lora_only.save(
        Path(root), backend.version, adapter=dict(adapter), optimizer=optimizer, scheduler=None, rng=rng, keep=keep,
        dtype=dtype, meta={"data_position": data_position, "param_names": [n for n, _ in adapter],
              "tensor_parallel": shards.size if shards is not None else 1, "tp_layout": WHOLE_FACTORS,
              "pipeline_parallel": shards.stages if shards is not None else 1,
              "expert_parallel": shards.experts if shards is not None else 1, **(meta or {})})


def restore_training_state(root: Path, backend: Any) -> Resumed | None:
    """Load the newest checkpoint under `root` that verifies into `backend`; None when there is none.

    A torn or corrupted newer checkpoint is skipped (listed in `Resumed.skipped`); a checkpoint that does
    not fit this model (other target modules or rank) is an error, not a silent fresh start."""
    ckpt = lora_only.load_latest(Path(root))
    if ckpt is None:
        return None
    live = dict(backend.adapter_named())
    names = ckpt.meta.get("param_names", list(ckpt.adapter))
    adapter, optimizer, rng = ckpt.adapter, ckpt.optimizer, ckpt.rng
    shards = backend.checkpoint_shards
    tp, ours = int(ckpt.meta.get("tensor_parallel", 1)), shards.size if shards is not None else 1
    whole = tp == 1 or ckpt.meta.get("tp_layout") == WHOLE_FACTORS  # else written as TP shards side by side (older)
    if not whole and tp != ours:
        raise CheckpointError(f"{ckpt.path} holds a policy trained at parallelism.tensor {tp} in the older "
                              f"side-by-side layout and this job runs {ours}: set parallelism.tensor to {tp} to "
                              "resume it, or point checkpoint.path at a new directory to start afresh")
    # every pipeline stage's and expert-parallel rank's names (a checkpoint written at another split lists them in
    # another order: the state is taken by name)
    everyone = shards.all_names(list(live)) if shards is not None else list(live)
    if set(everyone) != set(names) or len(everyone) != len(names) or set(adapter) != set(everyone):
        gone, new = sorted(set(adapter) - set(everyone)), sorted(set(everyone) - set(adapter))
        raise CheckpointError(f"{ckpt.path} does not fit this model's adapter (lora.targetModules / lora.scope "
                              f"changed?): only in the checkpoint {gone[:3]}, only in the model {new[:3]}")
    if shards is not None:  # this TP rank's shards of this rank's own parameters (tp_checkpoint.py)
        adapter, optimizer = shards.local(adapter, names, optimizer, list(live), whole)
        rng = shards.own_rng(rng)
    elif list(live) != list(names):
        optimizer = select_state(optimizer, names, list(live))
    names = list(live)
    bad = [n for n in names if adapter[n].shape != live[n].shape]
    if bad:
        raise CheckpointError(f"{ckpt.path}: {bad[0]} is {tuple(adapter[bad[0]].shape)} in the checkpoint but "
                              f"{tuple(live[bad[0]].shape)} in the model (lora.rank changed?)")
    with torch.no_grad():
        for n in names:
            live[n].copy_(adapter[n])  # live views share the parameters' storage
    backend.optimizer.load_state_dict(optimizer)
    lora_only.restore_rng(rng)
    backend.load_generator_states(rng.get("generators", {}))
    backend.version = ckpt.step
    return Resumed(ckpt.step, str(ckpt.path), int(ckpt.meta.get("data_position", ckpt.step)), list(ckpt.skipped))


def export_adapter(root: Path, backend: Any, cfg: TrainerConfig, meta: Mapping[str, Any] | None = None
                   ) -> Path | None:
    """`root/lora_adapter/`: HF-PEFT names, base_model_name_or_path = the base's absolute directory, and a
    kora meta file (base, step, sync mode, the Megatron -> HF module map of the targets). Every trainer rank
    calls it (the export gathers tensor-parallel shards); the writing rank returns the path, the others None."""
    if backend.checkpoint_shards is None and not backend.checkpoint_writer:
        return None  # a data-parallel replica: the writer exports the same adapter
    base = str(Path(cfg.model.path).resolve())
    tensors, config, modules = backend.peft_export()  # under tensor parallelism a collective of every rank
    if not backend.checkpoint_writer:
        return None
    lora = cfg.lora
    info = {
        "format": EXPORT_FORMAT, "base_model": base, "step": backend.version,
        "sync_mode": str(lora.effective_sync_mode), "rank": lora.rank, "alpha": lora.alpha, "scope": str(lora.scope),
        "module_map": {str(t): list(MEGATRON_TO_HF[t]) for t in lora.target_modules},
        "modules": modules, **(meta or {}),
    }
    return export_peft(Path(root), tensors, config, info)
