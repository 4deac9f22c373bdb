"""The spec sections shared by the trainer config and the operator's LoRATrainingJob API.

One typed source: the operator's CRD schema, `kora validate`, and the trainer's
`--config job.yaml` are all built from these models. Bounds and enums live on the fields; rules
across fields live in `rules.py`, which also turns them into the CRD's CEL validations.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated, Literal

from pydantic import AfterValidator, Field, WithJsonSchema, model_validator

from kora_trainer.config.base import CamelModel
from kora_trainer.config.quantity import ByteQuantity


class SyncMode(StrEnum):
    """How the trained policy reaches the rollout engines."""

    MERGE = "Merge"
    ADAPTER = "Adapter"
    ENGINE_MERGE = "EngineMerge"


class Scope(StrEnum):
    ALL = "all"
    LANGUAGE = "language"
    VISION = "vision"


class TargetModule(StrEnum):
    """Megatron-style module names; see MEGATRON_TO_HF for what each wraps."""

    LINEAR_QKV = "linear_qkv"
    LINEAR_PROJ = "linear_proj"
    LINEAR_FC1 = "linear_fc1"
    LINEAR_FC2 = "linear_fc2"
    ROUTER = "router"
    IN_PROJ = "in_proj"
    OUT_PROJ = "out_proj"


# Megatron name -> HF projection names (the HF-PEFT export and torch backend use these).
MEGATRON_TO_HF: dict[TargetModule, tuple[str, ...]] = {
    TargetModule.LINEAR_QKV: ("q_proj", "k_proj", "v_proj"),
    TargetModule.LINEAR_PROJ: ("o_proj",),
    TargetModule.LINEAR_FC1: ("gate_proj", "up_proj"),
    TargetModule.LINEAR_FC2: ("down_proj",),
    TargetModule.ROUTER: ("gate",),
    TargetModule.IN_PROJ: ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"),
    TargetModule.OUT_PROJ: ("out_proj",),
}
# Inside a vision tower the same Megatron names wrap other HF leaves (Qwen2.5-VL / Qwen3-VL / Qwen3.5 vision
# blocks: a fused `attn.qkv`, `attn.proj`; Qwen3.5's vision MLP and patch merger keep Megatron's own fc names).
VISION_MEGATRON_TO_HF: dict[TargetModule, tuple[str, ...]] = {
    TargetModule.LINEAR_QKV: ("qkv",),
    TargetModule.LINEAR_PROJ: ("proj",),
    TargetModule.LINEAR_FC1: ("linear_fc1",),
    TargetModule.LINEAR_FC2: ("linear_fc2",),
}
# SGLang fuses the GDN input projection into one module; everything else matches HF.
MEGATRON_TO_SGLANG: dict[TargetModule, tuple[str, ...]] = {
    **MEGATRON_TO_HF,
    TargetModule.IN_PROJ: ("in_proj_qkvz",),
}


class LoRASpec(CamelModel):
    """The adapter being trained and how it is synced to the rollout engines."""

    rank: Annotated[int, Field(ge=1, le=4096)]
    """LoRA rank r (>= 1). In a multi-adapter job this is the largest rank any adapter may use."""
    alpha: Annotated[float, Field(gt=0)] = 32.0
    """LoRA alpha; the adapter's output is scaled by alpha/rank."""
    dropout: Annotated[float, Field(ge=0.0, lt=1.0)] = 0.0
    """Dropout probability applied to the adapter's input (training only)."""
    target_modules: Annotated[list[TargetModule], Field(min_length=1, max_length=7)] = Field(
        default=[TargetModule.LINEAR_QKV, TargetModule.LINEAR_PROJ],
        json_schema_extra={"x-kubernetes-list-type": "set"},
    )
    """Megatron-style modules to adapt: linear_qkv (q,k,v), linear_proj (o), linear_fc1 (gate,up),
    linear_fc2 (down), router (MoE gate; Adapter mode only), in_proj / out_proj (GDN layers)."""
    scope: Scope = Scope.ALL
    """Which region of a vision-language / omni model gets adapters: all, language, or vision.
    No effect on text-only models."""
    sync_mode: SyncMode | None = None
    """Merge (fold the adapter into the base, push the full model), Adapter (push the base once,
    then only the adapter, served as `kora-policy`), or EngineMerge (push raw lora_A/lora_B pairs;
    the engine folds them). Unset means Merge, with a warning."""

    @property
    def effective_sync_mode(self) -> SyncMode:
        return self.sync_mode or SyncMode.MERGE


class Algorithm(StrEnum):
    GRPO = "GRPO"


class LrDecayStyle(StrEnum):
    CONSTANT = "constant"
    LINEAR = "linear"
    COSINE = "cosine"



# Upper bounds on the batch and length integers: far past any real job, and below what would make the trainer
# allocate without end or torch's generators overflow (a seed must fit in 64 bits), so a typo is refused at
# apply with the field's name rather than failing the run later. The seed's bound is JSON's exact-integer limit:
# the API server reads the schema's numbers as float64, and 2^63 - 1 came back as an overflowed int64.
MAX_ROLLOUT_BATCH = 1 << 16
MAX_GROUP = 1 << 12
MAX_STEPS = 10**9
MAX_EPOCHS = 10**6
MAX_NEW_TOKENS = 1 << 20
SEED_MAX = (1 << 53) - 1
Seed = Annotated[int, Field(ge=0, le=SEED_MAX)]


class AlgorithmSpec(CamelModel):
    """The RL algorithm and its batch shape."""

    name: Algorithm = Algorithm.GRPO
    """The policy-gradient algorithm. GRPO: group-relative advantages, clipped ratio, optional KL."""
    lr: Annotated[float, Field(gt=0, le=1.0)] = 1e-5
    """Adapter learning rate (AdamW): the rate after the warmup, where the decay starts."""
    lr_decay_style: LrDecayStyle = LrDecayStyle.CONSTANT
    """constant, linear or cosine: how the rate falls from lr to minLr over lrDecaySteps (Megatron's
    --lr-decay-style)."""
    min_lr: Annotated[float, Field(ge=0, le=1.0)] = 0.0
    """The rate a linear or cosine decay ends at (at most lr)."""
    lr_warmup_steps: Annotated[int, Field(ge=0, le=MAX_STEPS)] = 0
    """Steps over which the rate rises linearly to lr before the decay starts."""
    lr_decay_steps: Annotated[int, Field(ge=1, le=MAX_STEPS)] | None = None
    """The step at which a decay reaches minLr (it stays there after); default numSteps."""
    num_steps: Annotated[int, Field(ge=1, le=MAX_STEPS)] | None = None
    """Optimizer steps to train. Exclusive with numEpochs; neither set means one epoch."""
    num_epochs: Annotated[int, Field(ge=1, le=MAX_EPOCHS)] | None = None
    """Passes over the dataset (steps = numEpochs x dataset rows / rolloutBatchSize)."""
    rollout_batch_size: Annotated[int, Field(ge=1, le=MAX_ROLLOUT_BATCH)] = 32
    """Prompt groups generated per step."""
    n_samples_per_prompt: Annotated[int, Field(ge=1, le=MAX_GROUP)] = 8
    """Responses sampled per prompt (the GRPO group size)."""
    global_batch_size: Annotated[int, Field(ge=1, le=MAX_ROLLOUT_BATCH * MAX_GROUP)] | None = None
    """Samples per optimizer step; defaults to rolloutBatchSize x nSamplesPerPrompt."""
    max_new_tokens: Annotated[int, Field(ge=1, le=MAX_NEW_TOKENS)] = 1024
    """Longest response the engines generate."""
    temperature: Annotated[float, Field(ge=0.0)] = 1.0
    """Sampling temperature for rollouts."""
    clip_eps: Annotated[float, Field(gt=0.0, lt=1.0)] = 0.2
    """PPO-style clip range of the importance ratio."""
    kl_coef: Annotated[float, Field(ge=0.0)] = 0.0
    """Weight of the KL penalty to the frozen base (the policy with the adapter switched off)."""
    inner_epochs: Annotated[int, Field(ge=1, le=16)] = 1
    """Optimizer passes over each rollout batch."""
    seed: Seed = 1234
    """Random seed for sampling, dropout and data order."""

    @property
    def effective_global_batch_size(self) -> int:
        return self.global_batch_size or self.rollout_batch_size * self.n_samples_per_prompt


class RewardType(StrEnum):
    MATH = "math"
    DEEPSCALER = "deepscaler"
    CUSTOM = "custom"


class DataSpec(CamelModel):
    """The prompt dataset and how responses are scored."""

    path: Annotated[str, Field(min_length=1)]
    """Prompt dataset: a .parquet or .jsonl file (absolute path inside the job's volume)."""
    input_key: Annotated[str, Field(min_length=1)] = "prompt"
    """Column holding the prompt."""
    label_key: Annotated[str, Field(min_length=1)] = "label"
    """Column holding the reference answer the reward compares against."""
    image_key: Annotated[str, Field(min_length=1)] | None = None
    """Column holding each row's image(s), for a vision-language model: PNG/JPEG bytes, a path relative to the data
    file, a {bytes, path} struct (HF datasets' Image), or a list of these. Unset: text-only prompts."""
    reward_type: RewardType = RewardType.MATH
    """math (final-answer match), deepscaler (boxed-answer style), or custom (see customRewardPath)."""
    custom_reward_path: Annotated[str, Field(pattern=r"^[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)+$")] | None = None
    """Dotted path to `def reward(sample) -> float`, importable in the trainer image."""


class Engine(StrEnum):
    SGLANG = "sglang"
    HF = "hf"


class SGLangBuild(StrEnum):
    """The SGLang builds kora knows the routes of (config/sglang_builds.py tables them, docs/sglang_builds.md
    cites their source): stock 0.5.23 from PyPI, stock 0.5.17 (the last release on torch 2.11, the one kora has
    run on a GPU), and one pinned revision of sgl-project/sglang's sglang-miles branch (the adapter over the
    weight-update group, in-place upsert, abort by request-id prefix)."""

    STOCK_0_5_23 = "0.5.23"
    STOCK_0_5_17 = "0.5.17"
    MILES_94949DA7 = "sglang-miles-94949da7"


class RolloutSpec(CamelModel):
    """The rollout engines that generate responses with the current policy."""

    engine: Engine = Engine.SGLANG
    """sglang (production) or hf (kora's reference engine speaking SGLang's HTTP API)."""
    num_engines: Annotated[int, Field(ge=1)] = 1
    """Number of engine servers."""
    gpus_per_engine: Annotated[int, Field(ge=0)] = 1
    """GPUs per engine (tensor parallel inside SGLang); 0 runs the hf engine on CPU."""
    dp_size: Annotated[int, Field(ge=1)] = 1
    """SGLang data-parallel attention size inside each engine. Adapter mode requires 1."""
    distributed_engines: Annotated[int, Field(ge=0)] = 0
    """With deployment Colocate: engines placed off the training GPUs and fed over NCCL rather than
    in-memory. Adapter mode cannot feed them; use Merge mode for that layout."""
    engine_hang_seconds: Annotated[float, Field(ge=1.0, le=86400.0)] = 60.0
    """How long an engine may leave its GET /health unanswered before the trainer takes it as hung: it kills the
    engine and fails the attempt (EngineLost, naming the engine and what the trainer was doing), and the job's retry
    resumes from the newest checkpoint. A hung engine is one that stopped (SIGSTOP) or accepts connections and never
    answers; a busy one answers /health at once (SGLang counts any scheduler output as healthy, the reference engine
    any work in progress). Default 60: twice the rollout manager's 30 s /health limit, which SGLang's own 20 s probe
    sets. Raise it if an engine's scheduler is legitimately silent longer (a very long weight push on SGLang).
    A diffusion job's engine is watched the same way (it answers /health while it denoises or folds)."""
    sglang_build: SGLangBuild | None = None
    """The SGLang build the engines run, which decides the routes the trainer may use (docs/sglang_builds.md):
    0.5.23 (stock, the default for engine sglang), 0.5.17 (stock) or sglang-miles-94949da7. With engine hf it
    starts the reference engine in that build's strict mode (only that build's routes and fields); unset, the
    reference engine serves kora's extensions too. A sync mode the build cannot do is refused with the fix."""
    sglang_args: Annotated[list[Annotated[str, Field(min_length=1, max_length=256,
                                                     description="One flag or value, as on the command line.")]],
                           Field(max_length=64)] = Field(default_factory=list)
    """Further `sglang.launch_server` flags for every engine, appended after kora's own (e.g. ["--attention-backend",
    "triton", "--sampling-backend", "pytorch"]; a later flag wins, so `--mem-fraction-static` here overrides kora's
    Colocate default). Flags kora sets from the spec (model path, host, port, sizes, LoRA, keys, seeds) are refused;
    rollout.engine sglang only (the reference engine takes none)."""


class ParallelismSpec(CamelModel):
    """How the training actor is split across GPUs (Megatron terms)."""

    data: Annotated[int, Field(ge=1)] = 1
    """Data-parallel size of the actor."""
    tensor: Annotated[int, Field(ge=1)] = 1
    """Tensor-parallel size."""
    pipeline: Annotated[int, Field(ge=1)] = 1
    """Pipeline-parallel size."""
    expert: Annotated[int, Field(ge=1)] = 1
    """Expert-parallel size (MoE models)."""
    expert_tensor: Annotated[int, Field(ge=1)] = 1
    """Expert tensor-parallel size. MoE expert folding requires 1."""
    context: Annotated[int, Field(ge=1)] = 1
    """Context-parallel size."""

    @property
    def actor_gpus(self) -> int:
        return self.data * self.tensor * self.pipeline * self.context


class DeploymentMode(StrEnum):
    COLOCATE = "Colocate"
    DISAGGREGATED = "Disaggregated"


class DeploymentSpec(CamelModel):
    """Where training and rollout run relative to each other."""

    mode: DeploymentMode = DeploymentMode.COLOCATE
    """Colocate: train and rollout share GPUs, weights move in memory (CUDA IPC). Disaggregated:
    separate GPUs, weights move over NCCL."""
    async_: bool = Field(default=False, alias="async")
    """Fully-async rollout producer with bounded staleness (rollouts may lag the policy)."""
    max_staleness: Annotated[int, Field(ge=0)] = 1
    """Async only: most policy versions a rollout may lag; the WeightsSynced condition turns False
    when the engines are further behind."""


class SyncSpec(CamelModel):
    """Weight-sync tuning."""

    buffer_size: ByteQuantity = 512 * 2**20
    """Largest bucket pushed at once (bytes or a quantity such as 512Mi); bounds peak memory."""
    delta_skip_threshold: Annotated[float, Field(ge=0.0)] = 1e-6
    """Adapter mode: skip the push when no adapter tensor moved more than this on any rank."""
    fast_path: bool = True
    """Merge and Adapter syncs to kora's hf engine over the weight-update group (Disaggregated) take the fast
    path after the first push: planned once, then one HTTP call per engine while the buckets are broadcast, no
    per-bucket calls or serialisation. Elsewhere (sglang engines, EngineMerge, the in-memory Colocate
    transport, MoE experts), or when an engine refuses the plan (the trainer prints why), the HTTP path stays.
    false: always the HTTP path."""
    served_logp_gap_max: Annotated[float, Field(gt=0.0)] = 0.25
    """The serving check: each on-policy step compares the engines' log-probs of the sampled tokens with the
    trainer's own for the policy the engines claim to serve; a step whose largest gap exceeds this is bad
    (status.progress.servingCheck, the PolicyServed condition False with a Warning event). Default 0.25: above
    every healthy gap measured in the repo (fp32 toy on CPU and GPU 4.8e-7 to 7.4e-6; a 4B model in bf16,
    engine vs trainer on the same weights, 0.031 to 0.074, bench/results/gpu_sync_colocated_*.json) by > 3x,
    and below a dropped adapter's effect (adapter vs base on that model 0.78 to 5.3, bench/results/gpu_sync_*;
    on the toy after one step 0.39 to 0.59, tests/e2e/test_policy_served.py). A small or young adapter moves
    log-probs less than that: set it lower (fp32 toy tests use 1e-4)."""
    served_bad_steps_to_fail: Annotated[int, Field(ge=1)] = 3
    """Stop the run (Failed, the message naming the gap, the threshold and the version) after this many
    consecutive bad steps of the serving check (a multi-adapter job: of one adapter, counted over its own steps,
    the message naming it); steps without a gap (async: rollouts of an older policy) neither count nor reset."""


class CheckpointDType(StrEnum):
    BF16 = "bf16"
    FP32 = "fp32"
    FP16 = "fp16"
    FP8 = "fp8"


class CheckpointSpec(CamelModel):
    """Resumable checkpoints and the exported adapter."""

    path: str | None = None
    """Directory for checkpoints and the exported adapter (inside the job's volume). Unset: none."""
    interval: Annotated[int, Field(ge=1)] = 50
    """Save every this many steps (and at the end)."""
    keep: Annotated[int, Field(ge=1)] = 2
    """How many recent checkpoints to keep."""
    lora_only: bool = True
    """Save only the adapter, optimizer, scheduler, RNG and step; the base is reloaded from
    model.path on resume. Fails if any trainable parameter is not a LoRA parameter."""
    async_save: bool = False
    """Write checkpoints in the background: not built, so true is refused (with loraOnly by SPEC rule 8)."""
    dtype: CheckpointDType = CheckpointDType.BF16
    """Precision of the checkpoint's adapter file (loraOnly needs bf16 or fp32). Where it rounds the trained
    values, the exact ones are kept beside the optimizer state, so a resume goes on exactly."""
    export_hf: bool = Field(default=False, alias="exportHF")
    """Also write lora_adapter/ (HF-PEFT) at the end. It is its own save beside the resumable
    checkpoint, never mixed into it."""


class TensorBoardSpec(CamelModel):
    """TensorBoard event files of the step metrics (docs/metrics.md lists the tags)."""

    enabled: bool = True
    """Write event files (torch.utils.tensorboard's SummaryWriter)."""
    log_dir: str | None = None
    """Where the event files go: unset, `<run dir>/tensorboard`; else this directory (absolute inside the
    job's volume, so they outlive the pods: point `tensorboard --logdir` at it)."""


class WandbMode(StrEnum):
    OFFLINE = "offline"
    ONLINE = "online"


class WandbSpec(CamelModel):
    """Weights & Biases: the same step metrics as TensorBoard, under the same names."""

    enabled: bool = False
    """Log to W&B (the `wandb` package: the trainer image has it; locally `pip install kora[wandb]`)."""
    mode: WandbMode = WandbMode.OFFLINE
    """offline (default): the run is written under `dir` and never leaves the pod (`wandb sync DIR` uploads
    it later); online: streamed to the W&B server your cluster reaches (WANDB_API_KEY, WANDB_BASE_URL)."""
    project: Annotated[str, Field(min_length=1)] = "kora"
    """W&B project."""
    entity: str | None = None
    """W&B entity (team or user); unset: the API key's default."""
    name: str | None = None
    """Run name; unset: the run directory's name."""
    dir: str | None = None
    """Where the run's files go: unset, the run directory (W&B makes `wandb/` in it); else this directory."""


class TrackingSpec(CamelModel):
    """Experiment tracking: TensorBoard and W&B, both fed per step from the trainer's step recorder."""

    tensorboard: TensorBoardSpec = Field(default_factory=TensorBoardSpec)
    """TensorBoard event files (default on)."""
    wandb: WandbSpec = Field(default_factory=WandbSpec)
    """Weights & Biases (default off; offline unless mode is online)."""
    kl_to_base: bool = False
    """Measure the KL to the base (actor/kl_loss) every step even when algorithm.klCoef is 0: one more no-grad
    forward per step with the adapter switched off (with klCoef > 0 the loss computes it anyway). The loss is
    unchanged."""


ADAPTER_NAME = r"^[a-z0-9]([-a-z0-9.]{0,61}[a-z0-9])?$"  # a DNS label (dots allowed): the LoRAAdapter's name
POLICY_ADAPTER = "kora-policy"  # SPEC's fixed name of the one adapter a single-adapter Adapter-mode job serves


class AdapterRunConfig(CamelModel):
    """One adapter of a multi-adapter job: its shape, optimizer, data and length. Unset fields take the job's
    (lora.alpha, algorithm.lr / rolloutBatchSize / nSamplesPerPrompt / seed); the rank must be set.
    The body of `POST /adapter_runs` and the spec of a LoRAAdapter (which adds jobName)."""

    model_config = CamelModel.model_config | {
        "json_schema_extra": {"x-kubernetes-validations": [
            {"rule": "!(has(self.numSteps) && has(self.numEpochs))",
             "message": "numSteps and numEpochs are both set: keep one of them", "fieldPath": ".numEpochs"},
            {"rule": "self.data.rewardType != 'custom' || has(self.data.customRewardPath)",
             "message": "data.rewardType custom needs data.customRewardPath: set it to a dotted path "
                        "such as mypkg.rewards.reward", "fieldPath": ".data.customRewardPath"},
        ]}
    }

    rank: Annotated[int, Field(ge=1, le=4096)]
    """LoRA rank; at most the job's lora.rank (the largest a slot holds)."""
    alpha: Annotated[float, Field(gt=0)] | None = None
    """LoRA alpha (scaling alpha/rank); default the job's lora.alpha."""
    lr: Annotated[float, Field(gt=0, le=1.0)] | None = None
    """Learning rate of this adapter's own optimizer; default the job's algorithm.lr."""
    rollout_batch_size: Annotated[int, Field(ge=1, le=MAX_ROLLOUT_BATCH)] | None = None
    """Prompt groups per optimizer step of this adapter; default the job's."""
    n_samples_per_prompt: Annotated[int, Field(ge=1, le=MAX_GROUP)] | None = None
    """Group size; default the job's. Must divide, or be a multiple of, the trainer's DP size."""
    data: DataSpec
    """This adapter's prompts and reward."""
    num_steps: Annotated[int, Field(ge=1, le=MAX_STEPS)] | None = None
    """Stop after this many of its own optimizer steps."""
    num_epochs: Annotated[int, Field(ge=1, le=MAX_EPOCHS)] | None = None
    """Or after this many passes over its data (default 1): numEpochs x rows // rolloutBatchSize steps."""
    seed: Seed | None = None
    """Seed of its LoRA init, data order and sampling; default the job's algorithm.seed."""
    stream_groups: Annotated[int, Field(ge=1, le=MAX_ROLLOUT_BATCH)] | None = None
    """Prompt groups per unit of streaming into training: its completed groups enter training in units of this
    many, gradients accumulate across units, and its optimizer steps when its rolloutBatchSize groups are in.
    A multiple of the fewest groups whose samples split evenly over the trainer's DP ranks, which is the
    default; rolloutBatchSize (or more) trains the whole batch in one call."""
    # its own learning-rate schedule (algorithm/lr_schedule.py), counted in its own optimizer steps
    lr_decay_style: LrDecayStyle | None = None
    """constant, linear or cosine; default the job's algorithm.lrDecayStyle."""
    min_lr: Annotated[float, Field(ge=0, le=1.0)] | None = None
    """The rate its decay ends at (at most its lr); default the job's algorithm.minLr."""
    lr_warmup_steps: Annotated[int, Field(ge=0, le=MAX_STEPS)] | None = None
    """Its steps of linear warmup; default the job's algorithm.lrWarmupSteps."""
    lr_decay_steps: Annotated[int, Field(ge=1, le=MAX_STEPS)] | None = None
    """Its step at which the decay reaches minLr; default the job's algorithm.lrDecaySteps, else its own step
    count (numSteps, or numEpochs x rows // rolloutBatchSize)."""

    @model_validator(mode="after")
    def _one_length(self) -> AdapterRunConfig:
        if self.num_steps is not None and self.num_epochs is not None:
            raise ValueError("numSteps and numEpochs are both set: keep one of them")
        if self.data.reward_type == RewardType.CUSTOM and self.data.custom_reward_path is None:
            raise ValueError("data.rewardType custom needs data.customRewardPath: set it to a dotted path such as "
                             "mypkg.rewards.reward")
        return self


class NamedAdapterRun(AdapterRunConfig):
    """An adapter registered when the job starts (multiLora.adapters): its name and its config."""

    name: Annotated[str, Field(pattern=ADAPTER_NAME)]
    """The adapter's name: its lora_path on the engines, its request-id prefix, its checkpoint directory."""

    def config(self) -> AdapterRunConfig:
        return AdapterRunConfig.model_validate(self.model_dump(exclude={"name"}))


MAX_SLOTS = 256
AUTO = "auto"


def _slot_count(value: int | str) -> int | str:
    if isinstance(value, int) and not 0 <= value <= MAX_SLOTS:
        raise ValueError(f"must be 0 to {MAX_SLOTS}, or {AUTO}")
    return value


# An int-or-string in the CRD (existing integer manifests stay valid); the CEL rule bounds both forms.
SlotCount = Annotated[
    int | Literal["auto"],
    AfterValidator(_slot_count),
    WithJsonSchema({"x-kubernetes-int-or-string": True, "anyOf": [{"type": "integer"}, {"type": "string"}],
                    "x-kubernetes-validations": [{
                        "rule": f"type(self) == string ? self == '{AUTO}' : (self >= 0 && self <= {MAX_SLOTS})",
                        "message": f"maxAdapters must be 0 to {MAX_SLOTS} slots, or {AUTO} (sized from the free "
                                   "memory at start)"}]}),
]


class MultiLoRASpec(CamelModel):
    """Multi-adapter service: many adapters, one base; LoRAAdapter objects register them."""

    adapters: list[NamedAdapterRun] = Field(default_factory=list)
    """Adapters trained from the start (each to its numSteps; the job succeeds when all are done). None: a
    service that idles until adapters are registered (LoRAAdapter objects, POST /adapter_runs) and runs until
    the job is deleted."""

    max_adapters: SlotCount = 0
    """Adapter slots; 0 turns multi-LoRA off, > 0 makes the job a multi-adapter service. `auto` (miles'
    `--multi-lora-n-adapters auto`): as many as the trainer's and the engines' free memory hold at the job's rank,
    sized when the job starts (config/slot_memory.py; the trainer prints the arithmetic, `kora plan` the per-slot
    bytes)."""
    max_adapter_global_batch_size: Annotated[int, Field(ge=1)] | None = None
    """Largest samples-per-step an adapter may ask for; default 4 x algorithm.globalBatchSize."""
    max_coalesce_wait_seconds: Annotated[float, Field(gt=0)] = 5.0
    """How long a non-empty train batch waits for more adapters' groups before it trains anyway."""

    @property
    def on(self) -> bool:
        """A multi-adapter job: maxAdapters > 0 or auto."""
        return self.max_adapters == AUTO or int(self.max_adapters) > 0

    @property
    def slots(self) -> int:
        """The slot count (auto is sized at start, before anything reads this: orchestration/slot_sizing.py)."""
        if isinstance(self.max_adapters, str):
            raise ValueError("multiLora.maxAdapters auto is sized when the job starts; nothing reads it before")
        return self.max_adapters


class ModelSpec(CamelModel):
    """The base model."""

    path: Annotated[str, Field(min_length=1)]
    """HF checkpoint directory (config.json, safetensors, tokenizer), inside the job's volume."""


class DiffusionKind(StrEnum):
    """What the diffusion transformer makes."""

    IMAGE = "image"


class DiffusionScheduler(StrEnum):
    """The sampler the rollouts step with (Flow-GRPO's SDE is built on the flow-matching Euler step)."""

    FLOW_MATCH_EULER = "FlowMatchEulerDiscrete"


class DiffusionReward(StrEnum):
    COLOUR = "colour"
    CUSTOM = "custom"


class DiffusionTarget(StrEnum):
    """diffusers module names (PEFT's `target_modules` spelling; each matches every block's module of that name)."""

    TO_Q = "to_q"
    TO_K = "to_k"
    TO_V = "to_v"
    TO_OUT = "to_out.0"
    ADD_Q_PROJ = "add_q_proj"
    ADD_K_PROJ = "add_k_proj"
    ADD_V_PROJ = "add_v_proj"
    TO_ADD_OUT = "to_add_out"


class LoRAInit(StrEnum):
    GAUSSIAN = "gaussian"
    DEFAULT = "default"


class DiffusionModule(StrEnum):
    """The pipeline component a sync updates on the engine (sglang-diffusion's `target_modules`)."""

    TRANSFORMER = "transformer"


# flow_grpo's SD3 list (scripts/train_sd3.py:419 @ ac4c86e8): attention of both streams
SD3_DEFAULT_TARGETS = [DiffusionTarget.TO_Q, DiffusionTarget.TO_K, DiffusionTarget.TO_V, DiffusionTarget.TO_OUT,
                       DiffusionTarget.ADD_Q_PROJ, DiffusionTarget.ADD_K_PROJ, DiffusionTarget.ADD_V_PROJ,
                       DiffusionTarget.TO_ADD_OUT]


class DiffusionSpec(CamelModel):
    """A diffusion-model job: Flow-GRPO on a diffusion transformer's LoRA adapter (docs/diffusion.md). Present, the
    job trains an image model: algorithm.rolloutBatchSize prompts of algorithm.nSamplesPerPrompt images per step,
    the denoising steps playing the part of tokens; data.path is the prompts file (data.inputKey the prompt,
    data.labelKey what the reward compares with)."""

    kind: DiffusionKind
    """What the model makes: image (video is not built)."""
    scheduler: DiffusionScheduler = DiffusionScheduler.FLOW_MATCH_EULER
    """The sampler; must be the checkpoint's own (its scheduler/scheduler_config.json)."""
    num_inference_steps: Annotated[int, Field(ge=1, le=100)] = 10
    """Denoising steps per image (T); each is one Gaussian policy step of the SDE sampler."""
    noise_level: Annotated[float, Field(gt=0.0, le=2.0)] = 0.7
    """The SDE's noise level a: s_t = a sqrt(t / (1 - t)). Higher explores more."""
    guidance_scale: Annotated[float, Field(ge=1.0, le=30.0)] = 1.0
    """Classifier-free guidance scale; 1 is no guidance. Above 1 every denoising step of the rollouts and of the
    trainer's re-score uses the guided velocity v_uncond + g (v_cond - v_uncond), v_uncond from the model's
    unconditional (empty negative prompt) embedding: two transformer passes a step."""
    resolution: Annotated[int, Field(ge=8, le=4096)] | None = None
    """Image side in pixels; unset: the model's own sample size (the only one the toy serves)."""
    reward: DiffusionReward = DiffusionReward.COLOUR
    """colour: minus the RMS distance of the image's mean colour to the prompt's target (data.labelKey); custom:
    data.customRewardPath names `def reward(images, prompts, labels) -> tensor [B]`."""
    clip_eps: Annotated[float, Field(gt=0.0, lt=1.0)] = 1e-4
    """Flow-GRPO's ratio clip (per denoising step; tiny, as the paper's)."""
    timestep_fraction: Annotated[float, Field(gt=0.0, le=1.0)] = 1.0
    """The share of each image's denoising steps the update trains on: the first max(1, int(numInferenceSteps x
    timestepFraction)) steps (flow_grpo's train.timestep_fraction); the rollouts still take every step. Below 1 a
    step's training costs that share of the re-score's passes."""
    adv_clip: Annotated[float, Field(gt=0.0)] = 5.0
    """Group-relative advantages are clipped to +-advClip."""
    target_modules: Annotated[list[DiffusionTarget], Field(min_length=1, max_length=8)] = Field(
        default_factory=lambda: list(SD3_DEFAULT_TARGETS), json_schema_extra={"x-kubernetes-list-type": "set"})
    """diffusers modules to adapt (PEFT names); the default is both attention streams of every block."""
    lora_init: LoRAInit = LoRAInit.GAUSSIAN
    """lora_A's init: gaussian (N(0, 1/r), flow_grpo's) or default (PEFT's kaiming-uniform). lora_B starts at 0."""
    engine_module: DiffusionModule = DiffusionModule.TRANSFORMER
    """The pipeline component each sync updates on the engines."""
    served_logp_gap_max: Annotated[float, Field(gt=0.0)] = 1e-3
    """The serving check's threshold: the largest |trainer re-score - engine log-prob| of a denoising step (a mean
    over the latent's elements) taken for the engine serving the trained policy. Measured: under 1e-5 when it
    does (fp32, CPU); an engine a sync missed shows the adapter's whole effect, which grows as it trains."""
