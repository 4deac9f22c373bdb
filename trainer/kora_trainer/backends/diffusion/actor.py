"""The diffusion job's policy as one trainer rank holds it: the transformer with its LoRA adapter (FSDP2-sharded
over the data-parallel ranks when there are several: backends/diffusion/fsdp.py), its AdamW, one step's update on this
rank's rows, and the LoRA-only checkpoint (adapter and optimizer state whole, so a checkpoint resumes at any rank
count) and the diffusers export. The train command's one process holds one of these; at parallelism.data N each
of N Ray actors holds one (orchestration/diffusion_ranks.py).

Every method that gathers (`adapter`, `save`) is a collective: at N ranks every rank calls it, and rank 0 writes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from kora_trainer.algorithm.flow_grpo import Trajectory
from kora_trainer.algorithm.lr_schedule import apply_lr
from kora_trainer.backends.diffusion.fsdp import (
    full_adapter,
    full_optimizer_state,
    load_full_adapter,
    load_optimizer_state,
    shard_transformer,
)
from kora_trainer.backends.diffusion.train_loop import FlowGRPOSettings, update
from kora_trainer.checkpoint import lora_only
from kora_trainer.checkpoint.diffusers_export import export_diffusers_lora, lora_config
from kora_trainer.checkpoint.precision import torch_dtype
from kora_trainer.lora.diffusers import apply_diffusion_lora
from kora_trainer.lora.model import adapter_parameters, adapter_tensors
from kora_trainer.toys.diffusion import is_diffusion_toy, load_diffusion_toy
from kora_trainer.wire.diffusion_client import FoldedSync, LoraMergeSync

if TYPE_CHECKING:
    from kora_trainer.algorithm.flow_grpo import Trajectory
    from kora_trainer.backends.diffusion.train_loop import FlowGRPOSettings
    from kora_trainer.config import TrainerConfig
    from kora_trainer.toys.diffusion import DiffusionToy
    from kora_trainer.wire.diffusion_client import Pushed


class DiffusionJobError(ValueError):
    """The job cannot run on this model or data: the message names the field and the fix."""


def settings_of(cfg: TrainerConfig) -> FlowGRPOSettings:
    """The job's fields as the Flow-GRPO loop's knobs (the one place they meet)."""
    d, a = cfg.diffusion, cfg.algorithm
    assert d is not None
    samples = a.rollout_batch_size * a.n_samples_per_prompt
    return FlowGRPOSettings(
        prompts_per_step=a.rollout_batch_size, samples_per_prompt=a.n_samples_per_prompt,
        num_inference_steps=d.num_inference_steps, noise_level=d.noise_level, guidance_scale=d.guidance_scale,
        timestep_fraction=d.timestep_fraction,
        lr=a.lr, clip_eps=d.clip_eps,
        kl_coef=a.kl_coef, measure_kl=cfg.tracking.kl_to_base, adv_clip=d.adv_clip,
        minibatches=samples // a.effective_global_batch_size,
        lora_rank=cfg.lora.rank, lora_alpha=cfg.lora.alpha, lora_init=str(d.lora_init), seed=a.seed)


def device_of(cfg: TrainerConfig) -> torch.device:
    """Where the job's transformer runs, in the trainer and the engine alike: rollout.gpusPerEngine 1 puts both on
    the GPU (deployment Colocate: the same one; a push is CUDA IPC handles), 0 on the CPU."""
    if cfg.rollout.gpus_per_engine == 0:
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise DiffusionJobError(f"rollout.gpusPerEngine {cfg.rollout.gpus_per_engine} puts the diffusion engine and "
                                "its trainer on the GPU, and this host has no CUDA device: run the job where one is "
                                "(resources.gpusPerWorker 1), or set rollout.gpusPerEngine 0 to run on the CPU")
    return torch.device("cuda")


def load_model(cfg: TrainerConfig) -> DiffusionToy:
    """model.path as the diffusion path can load it today (a `kora make-toy --diffusion` checkpoint), checked
    against diffusion.scheduler and diffusion.resolution."""
    d = cfg.diffusion
    assert d is not None
    if not is_diffusion_toy(cfg.model.path):
        raise DiffusionJobError(
            f"model.path {cfg.model.path} is not a diffusion checkpoint kora can load: the diffusion path loads "
            "`kora make-toy --diffusion` checkpoints (a transformer, its scheduler and a prompt-embedding table; "
            "a text encoder and a VAE are not built yet): point model.path at one, or pass --make-toy")
    toy = load_diffusion_toy(cfg.model.path)
    have = type(toy.scheduler).__name__.removesuffix("Scheduler")
    if have != d.scheduler.value:
        raise DiffusionJobError(f"diffusion.scheduler {d.scheduler.value}: {cfg.model.path}/scheduler is a {have}: "
                                f"set diffusion.scheduler to {have}")
    if d.guidance_scale > 1 and toy.negative is None:
        raise DiffusionJobError(f"diffusion.guidanceScale {d.guidance_scale}: {cfg.model.path}/"
                                "prompt_embeds.safetensors has no unconditional embedding (negative_*; the toy "
                                "was made before guidance was built): remake it with `kora make-toy --diffusion`, "
                                "or set diffusion.guidanceScale 1")
    side = toy.latent_shape[1]
    if d.resolution is not None and d.resolution != side:
        raise DiffusionJobError(f"diffusion.resolution {d.resolution}: the model makes {side}x{side} images (its "
                                f"transformer's sample_size; it has no VAE): set diffusion.resolution to {side} or "
                                "leave it unset")
    return toy


def adapted(cfg: TrainerConfig, toy: DiffusionToy) -> DiffusionToy:
    """The toy with the job's adapter on its transformer, initialised from algorithm.seed alone (every rank, and a
    copy made for pushing, gets the same factors)."""
    assert cfg.diffusion is not None
    s = settings_of(cfg)
    toy.transformer.eval()  # no dropout: the re-score must see the rollout's policy
    torch.manual_seed(s.seed)  # the adapter's A init draws from the global stream
    apply_diffusion_lora(toy.transformer, cfg.lora.rank, cfg.lora.alpha,
                         [t.value for t in cfg.diffusion.target_modules], s.lora_init)
    return toy


@dataclass(frozen=True)
class Batch:
    """What a rank trains on in one step: its rows of the step's rollouts, a prompt's samples adjacent."""

    ids: torch.Tensor  # [b] prompt ids
    traj: Trajectory  # latents [b, T+1, C, H, W], log_probs [b, T]
    adv: torch.Tensor  # [b] the whole batch's group advantages, at these rows

    def rows(self, rows: torch.Tensor) -> Batch:
        t = self.traj
        return Batch(self.ids[rows], Trajectory(latents=t.latents[rows], log_probs=t.log_probs[rows],
                                                timesteps=t.timesteps, sigmas=t.sigmas, noise_level=t.noise_level),
                     self.adv[rows])


class DiffusionPolicy:
    """One rank's policy and optimizer. `mesh`: the data-parallel ranks' device mesh (None: one rank, unsharded)."""

    def __init__(self, cfg: TrainerConfig, toy: DiffusionToy, mesh: Any = None, rank: int = 0):
        self.cfg, self.toy, self.rank = cfg, adapted(cfg, toy), rank
        self.settings = settings_of(cfg)
        if mesh is not None:
            shard_transformer(toy.transformer, mesh)  # before the optimizer: sharding replaces the parameters
        self.opt = torch.optim.AdamW(adapter_parameters(toy.transformer), lr=self.settings.lr, weight_decay=0.0)

    def train(self, step: int, batch: Batch) -> list[dict[str, float]]:
        """algorithm.innerEpochs passes of train_loop.update over this rank's rows at step's learning rate; each
        pass's stats (this rank's means over its rows)."""
        apply_lr(self.opt, self.cfg.algorithm, step - 1)  # `step` counts from 1
        return [update(self.toy, self.settings, batch.traj, batch.ids, batch.adv, self.opt)
                for _ in range(self.cfg.algorithm.inner_epochs)]

    def adapter(self) -> dict[str, torch.Tensor]:
        """The adapter's factors whole (PEFT names): a collective."""
        return full_adapter(self.toy.transformer)

    # ---- checkpoints: LoRA-only, as the language-model path's (checkpoint/lora_only.py) -------------------------

    def save(self, root: str, step: int) -> Path | None:
        """A collective (the adapter and the optimizer state are gathered whole); rank 0 writes and returns the
        step's directory, the others None."""
        lora_only.check_lora_only(n for n, p in self.toy.transformer.named_parameters() if p.requires_grad)
        adapter, optimizer = self.adapter(), full_optimizer_state(self.toy.transformer, self.opt)
        if self.rank != 0:
            return None
        meta = {"kind": "diffusion", "data_position": step, "sync_mode": str(self.cfg.lora.effective_sync_mode),
                "base_model": str(Path(self.cfg.model.path).resolve()), "seed": self.settings.seed}
        return lora_only.save(Path(root), step, adapter=adapter, optimizer=optimizer, scheduler=None,
                              rng=lora_only.capture_rng(), meta=meta, keep=self.cfg.checkpoint.keep,
                              dtype=torch_dtype(self.cfg.checkpoint.dtype))

    def resume(self, root: str) -> dict[str, Any] | None:
        """The newest good checkpoint under root restored (adapter, optimizer, RNG) on this rank, whatever rank
        count wrote it; None when there is none. Every rank reads it."""
        ck = lora_only.load_latest(Path(root))
        if ck is None:
            return None
        if ck.meta.get("kind") != "diffusion":
            raise DiffusionJobError(f"checkpoint.path {root}: {ck.path} is a language-model checkpoint, not this "
                                    "diffusion job's: point checkpoint.path at a new directory")
        if dict(adapter_tensors(self.toy.transformer)).keys() != ck.adapter.keys():
            raise DiffusionJobError(f"checkpoint.path {root}: {ck.path} adapts other modules than "
                                    "diffusion.targetModules: set them as that run had, or point checkpoint.path at a "
                                    "new directory")
        load_full_adapter(self.toy.transformer, dict(ck.adapter))
        if all(isinstance(i, int) for g in ck.optimizer["param_groups"] for i in g["params"]):  # torch's own form
            self.opt.load_state_dict(ck.optimizer)
        else:
            load_optimizer_state(self.toy.transformer, self.opt, dict(ck.optimizer))
        lora_only.restore_rng(ck.rng)
        return {"step": ck.step, "path": str(ck.path), "skipped": ck.skipped}


def make_sync(cfg: TrainerConfig, url: str) -> Callable[[torch.nn.Module], Pushed]:
    """lora.syncMode's push to the engine at `url` of an unsharded transformer: EngineMerge the A/B pairs
    (LoraMergeSync), Merge the adapted weights folded (FoldedSync); sync.bufferSize caps a bucket."""
    assert cfg.diffusion is not None
    buffer, module = int(cfg.sync.buffer_size), cfg.diffusion.engine_module.value
    if cfg.lora.effective_sync_mode == "EngineMerge":
        return LoraMergeSync(url, cfg.lora.rank, cfg.lora.alpha, buffer, module)
    return FoldedSync(url, buffer, module)


def export(cfg: TrainerConfig, root: str, step: int, transformer: torch.nn.Module) -> Path:
    """`<root>/lora_adapter/`: an unsharded transformer's adapter as diffusers' own LoRA file
    (checkpoint/diffusers_export.py)."""
    assert cfg.diffusion is not None
    s = settings_of(cfg)
    config = lora_config(cfg.lora.rank, cfg.lora.alpha, [t.value for t in cfg.diffusion.target_modules], s.lora_init)
    meta = {"step": step, "base_model": str(Path(cfg.model.path).resolve()), "seed": s.seed}
    return export_diffusers_lora(Path(root), transformer, config, meta)
