"""The SGLang builds a job may name, and what each can carry: ONE table, read by the rules (kora validate, the
CRD's CEL, the trainer's start), the trainer's sender (which route each push takes), the reference engine's
strict mode (which routes and fields exist) and docs/sglang_builds.md (the same rows, with their sources).

A build is the set of HTTP routes and request fields its server has. Sources (read 2026-12-02):
- `0.5.23`: the PyPI wheel, tabled with its lines in ../shared/SGLANG_API.md (HS = http_server.py, IO =
  io_struct.py). `/update_weight_version` is not in that table; it is in upstream main @ 18e6c61c (2026-08-06,
  HS:1412, `UpdateWeightVersionReqInput` {new_version, abort_all_requests=True}) ⚠ not checked in the wheel.
- `sglang-miles-94949da7`: sgl-project/sglang's sglang-miles branch at 94949da735cc04bf20b542d18bafff06d3f1b49f
  (2026-07-22, "#31962"; read from the fork yushengsu-thu/sglang, which carries the branch's squash-merged
  commits): it adds `POST /load_lora_adapter_from_distributed` (#27268; HS:1527, IO:2048
  `LoadLoRAAdapterFromDistributedReqInput` {lora_name, config_dict, names, dtypes, shapes, group_name,
  pinned=False, added_tokens_config, lora_id, upsert=False}; the whole adapter in one call, one broadcast per
  tensor in `names` order from src 0: model_runner.py:2376), upsert (#30913) and `AbortReq.prefix` (#30912,
  IO:1812). It has no `weight_version` on the adapter routes and no EngineMerge fold.

- `0.5.17`: the PyPI wheel sglang-0.5.17-cp312-cp312-manylinux_2_34_x86_64.whl (sha256 fb4cba47…; its
  `_version.py` has `commit_id = None`), read 2026-12-06 (docs/sglang_builds.md has the lines). Its
  `/load_lora_adapter_from_tensors` has no `@auth_level`: a NORMAL route, open unless the engine has an api key.

Multi-LoRA on a stock build (0.5.17's source; 0.5.23 the same per ../shared/SGLANG_API.md §3 and its abort): its
`AbortReq` has no `prefix` (IO:1906) and its tokenizer manager forwards an abort only for a rid it tracks
(tokenizer_manager.py:1930, `abort_request`: an unknown rid returns with one tokenizer worker), so `{"rid":
"<name>::"}` aborts nothing; a rid it tracks it aborts exactly. So the rollout manager, which mints each request's
rid, keeps the rids in flight per adapter (orchestration/inflight_rids.py) and a retire aborts each one exactly.
Its `/unload_lora_adapter` unregisters the name (new requests for it get a 400) and then WAITS until every request
holding the adapter ended (tokenizer_control_mixin.py:565 `_unload_lora_adapter_locked`, lora_registry.py:186
`wait_for_unload`), under the LoRA update lock that every load and unload takes: unaborted, a retire's unload would
hold every other adapter's publish until the retired adapter's generation ran out. No upsert
(`LoadLoRAAdapterFromTensorsReqInput`, IO:2145; a loaded name is refused, lora_registry.py:243), hence unload +
load per publish; no route carries an adapter over the weight-update group (sglang-miles only), so a
Disaggregated multi-adapter job is refused there.

What a build lacks is refused before anything starts (`build_problems`), with the fix; what it can do another
way is done that way and said so in `RoutePlan.note` (the sync line the trainer prints).
"""

from __future__ import annotations

from dataclasses import dataclass

from kora_trainer.config.sections import DeploymentMode, Engine, SGLangBuild, SyncMode
from kora_trainer.config.trainer import TrainerConfig

DEFAULT_BUILD = SGLangBuild.STOCK_0_5_23  # what engine sglang runs when rollout.sglangBuild is unset (the pin)
MILES_COMMIT = "94949da735cc04bf20b542d18bafff06d3f1b49f"

# The routes every build here serves (SGLANG_API.md §1-5): generation, health, info, the weight-update group,
# the tensor routes, the LoRA routes a stock server has, and the control routes.
_STOCK_ROUTES = frozenset({
    "/generate", "/health", "/health_generate", "/model_info", "/get_model_info",
    "/init_weights_update_group", "/destroy_weights_update_group", "/update_weights_from_distributed",
    "/update_weights_from_tensor", "/load_lora_adapter", "/load_lora_adapter_from_tensors", "/unload_lora_adapter",
    "/update_weight_version", "/flush_cache", "/pause_generation", "/continue_generation", "/abort_request",
})
ADAPTER_OVER_GROUP = "/load_lora_adapter_from_distributed"
TENSOR_ADAPTER = "/load_lora_adapter_from_tensors"
# 0.5.17's further routes (HS = its http_server.py): memory release/resume for Colocate (HS:1462, :1474), the
# checkpoint-engine IPC push (HS:1393; needs the checkpoint-engine package beside SGLang, so kora does not send it)
# and the weight version read back (HS:761)
_STOCK_0_5_17_ROUTES = _STOCK_ROUTES | {"/release_memory_occupation", "/resume_memory_occupation",
                                        "/update_weights_from_ipc", "/weight_version", "/get_weight_version"}

# Request fields kora's reference engine reads beyond a build's structs (kora_engine/lm/request_bodies.py marks
# them "kora"): a strict engine drops them, as SGLang ignores unknown keys. Per route; `upsert` / `pinned` / `prefix`
# are the sglang-miles fields, dropped where the build lacks them.
KORA_FIELDS: dict[str, frozenset[str]] = {
    "/update_weights_from_distributed": frozenset({"weight_update_mode", "lora_alpha", "lora_rank", "merge_fp32",
                                                   "byte_ranges"}),
    "/update_weights_from_tensor": frozenset({"weight_update_mode", "lora_alpha", "lora_rank", "merge_fp32"}),
    ADAPTER_OVER_GROUP: frozenset({"byte_ranges", "load_format", "bucket_index", "num_buckets", "weight_version"}),
}


@dataclass(frozen=True)
class Build:
    """One build's routes and the behaviours the sender and the strict engine follow."""

    name: SGLangBuild
    routes: frozenset[str]
    source: str  # where its routes were read (docs/sglang_builds.md has the lines)
    adapter_over_group: bool  # /load_lora_adapter_from_distributed (upsert, whole adapter per call)
    abort_prefix: bool  # AbortReq.prefix: abort every rid starting with the given one
    pip_requirement: str  # what the trainer image installs (Dockerfile ARG SGLANG_BUILD)
    # routes 0.5.23 marks @auth_level(ADMIN_OPTIONAL) that this build serves as NORMAL (no decorator): open to
    # anyone unless the engine also has an --api-key, which then opens them (wire/engine_auth.py)
    normal_routes: frozenset[str] = frozenset()
    stock_version: str | None = None  # a PyPI release: the installed sglang must be exactly this version
    # /update_weights_from_tensor and /load_lora_adapter_from_tensors read load_format "flattened_bucket" (one
    # tensor + metadata read by attribute): read in 0.5.17 (weight_updater.py:330, tp_worker.py:241); not checked
    # in the others' source, so they get the tensors one by one
    flat_in_memory: bool = False

    def has(self, route: str) -> bool:
        return route in self.routes

    def dropped_fields(self, route: str) -> frozenset[str]:
        """Keys of `route`'s body this build does not have (a strict engine ignores them, as SGLang does)."""
        out = set(KORA_FIELDS.get(route, ()))
        if route == "/abort_request" and not self.abort_prefix:
            out.add("prefix")
        return frozenset(out)


BUILDS: dict[SGLangBuild, Build] = {
    SGLangBuild.STOCK_0_5_23: Build(
        SGLangBuild.STOCK_0_5_23, _STOCK_ROUTES, "PyPI sglang 0.5.23 (../shared/SGLANG_API.md)",
        adapter_over_group=False, abort_prefix=False, pip_requirement="sglang==0.5.23", stock_version="0.5.23"),
    SGLangBuild.STOCK_0_5_17: Build(
        SGLangBuild.STOCK_0_5_17, _STOCK_0_5_17_ROUTES, "PyPI sglang 0.5.17 (docs/sglang_builds.md)",
        adapter_over_group=False, abort_prefix=False, pip_requirement="sglang==0.5.17",
        normal_routes=frozenset({TENSOR_ADAPTER}), stock_version="0.5.17", flat_in_memory=True),
    SGLangBuild.MILES_94949DA7: Build(
        SGLangBuild.MILES_94949DA7, _STOCK_ROUTES | {ADAPTER_OVER_GROUP},
        f"sgl-project/sglang sglang-miles @ {MILES_COMMIT}",
        adapter_over_group=True, abort_prefix=True,
        pip_requirement=f"sglang @ git+https://github.com/sgl-project/sglang@{MILES_COMMIT}#subdirectory=python",
        normal_routes=frozenset({TENSOR_ADAPTER, ADAPTER_OVER_GROUP})),
}


def effective_build(cfg: TrainerConfig) -> Build | None:
    """The build whose routes the trainer may use: rollout.sglangBuild, else the pin for engine sglang; None for
    engine hf without a build (kora's reference engine with its extensions)."""
    name = cfg.rollout.sglang_build
    if name is None and cfg.rollout.engine is Engine.SGLANG:
        name = DEFAULT_BUILD
    return BUILDS[name] if name is not None else None


@dataclass(frozen=True)
class RoutePlan:
    """What one combination sends, or why it cannot run on the build."""

    routes: tuple[str, ...]  # the sync routes used, in the order of one step (generate, health not listed)
    note: str  # the sync line: which route carries the policy, and any fallback taken
    refused: str | None = None  # the message (naming the fields and the fix) when the build cannot do it


_GROUP = ("/init_weights_update_group", "/update_weights_from_distributed", "/destroy_weights_update_group")
_TENSOR = ("/update_weights_from_tensor",)
_ADAPTER_TENSORS = ("/unload_lora_adapter", "/load_lora_adapter_from_tensors", "/update_weight_version")


# %-templates (of %s only): rules.py renders the same words in CEL (cel_format) for the CRD's messageExpression
ENGINE_MERGE_REFUSED = (
    "lora.syncMode EngineMerge needs an engine that folds lora_A/lora_B into its base (kora's weight_update_mode "
    "lora_merge), which sglang %s does not have (rollout.sglangBuild %s, the default for rollout.engine sglang is "
    f"{DEFAULT_BUILD.value}): use lora.syncMode Merge, or rollout.engine hf without rollout.sglangBuild")
MULTI_LORA_REFUSED = (
    "multiLora.maxAdapters > 0 with deployment.mode Disaggregated publishes each adapter over the weight-update "
    f"group ({ADAPTER_OVER_GROUP}, sglang-miles #27268), which sglang %s does not have: set deployment.mode "
    "Colocate (each adapter in memory through /load_lora_adapter_from_tensors), set rollout.sglangBuild to "
    f"{SGLangBuild.MILES_94949DA7.value}, or set multiLora.maxAdapters to 0")


def route_plan(build: Build, mode: SyncMode, deployment: DeploymentMode, multi_lora: bool) -> RoutePlan:
    """The table: one row per build x mode x deployment x multi-LoRA (docs/sglang_builds.md prints it)."""
    name = build.name.value
    colocated = deployment is DeploymentMode.COLOCATE
    base = _TENSOR if colocated else _GROUP
    if mode is SyncMode.ENGINE_MERGE:
        return RoutePlan((), "", refused=ENGINE_MERGE_REFUSED % (name, name))
    if mode is SyncMode.MERGE:
        how = "/update_weights_from_tensor (in memory)" if colocated else \
            "/update_weights_from_distributed (one broadcast per tensor, load_format null)"
        return RoutePlan(base, f"merged weights through {how} [sglang {name}]")
    if multi_lora and not colocated and not build.adapter_over_group:
        return RoutePlan((), "", refused=MULTI_LORA_REFUSED % name)
    abort = ("/abort_request", "/unload_lora_adapter") if multi_lora else ()  # retire: abort its requests, unload
    tensors = tuple(dict.fromkeys((*_ADAPTER_TENSORS, *abort)))  # the in-memory publish unloads already
    # a build without AbortReq.prefix: the rollout manager aborts each of the adapter's rids exactly
    by_rid = "; a retire aborts each of the adapter's requests by its exact rid" \
        if multi_lora and not build.abort_prefix else ""
    if colocated:
        return RoutePlan((*base, *tensors),
                         f"adapter through /unload_lora_adapter + /load_lora_adapter_from_tensors (in memory), "
                         f"version by /update_weight_version{by_rid} [sglang {name}]")
    if build.adapter_over_group:
        return RoutePlan((*base, ADAPTER_OVER_GROUP, "/update_weight_version", *abort),
                         f"adapter through {ADAPTER_OVER_GROUP} (upsert, one broadcast per tensor), version by "
                         f"/update_weight_version [sglang {name}]")
    return RoutePlan((*base, *tensors),
                     f"adapter through /load_lora_adapter_from_tensors on the trainer's node (sglang {name} has no "
                     f"{ADAPTER_OVER_GROUP}); base through /update_weights_from_distributed [sglang {name}]")


def plan_for(cfg: TrainerConfig) -> RoutePlan | None:
    """This job's row (None: kora's reference engine with its extensions, which carries every combination)."""
    build = effective_build(cfg)
    if build is None:
        return None
    mode = cfg.lora.effective_sync_mode
    return route_plan(build, mode, cfg.deployment.mode, cfg.multi_lora.on)


def engines_need_api_key(cfg: TrainerConfig) -> bool:
    """True when a route this job's sync uses is NORMAL on its build (`Build.normal_routes`: no `@auth_level`
    there), which an engine with only an admin key serves to anyone: such engines get the job's key as their
    api key too (SGLang then asks it on NORMAL routes, /generate included), so nothing the trainer sends is open."""
    build, plan = effective_build(cfg), plan_for(cfg)
    return build is not None and plan is not None and bool(set(plan.routes) & build.normal_routes)


def same_node_problem(build: Build, plan: RoutePlan, trainer_host: str, engine_hosts: list[str]) -> str | None:
    """The stock build's Disaggregated Adapter hand-over is in memory: refused at trainer start when an engine runs
    on another node than trainer rank 0 (its node address is not theirs)."""
    if "/load_lora_adapter_from_tensors" not in plan.routes or "/update_weights_from_distributed" not in plan.routes:
        return None
    away = sorted({h for h in engine_hosts if h != trainer_host})
    if not away:
        return None
    return (f"deployment.mode Disaggregated with lora.syncMode Adapter on sglang {build.name.value} hands the adapter "
            f"over in memory (/load_lora_adapter_from_tensors), so every engine must run on trainer rank 0's node "
            f"({trainer_host}); engines run on {', '.join(away)}: set rollout.sglangBuild to "
            f"{SGLangBuild.MILES_94949DA7.value} (adapter over the weight-update group), use deployment.mode "
            f"Colocate, or lora.syncMode Merge")


def table_rows() -> list[tuple[str, str, str, str, str]]:
    """The table, one row per build x mode x deployment x multi-LoRA (multi-LoRA is Adapter mode only):
    (build, mode, deployment, multi-LoRA, the routes used and the sync line, or `refused: <message>`)."""
    rows = []
    for build in BUILDS.values():
        for mode in SyncMode:
            for deployment in DeploymentMode:
                for multi in (False, True) if mode is SyncMode.ADAPTER else (False,):
                    p = route_plan(build, mode, deployment, multi)
                    routes = ", ".join(f"`{r}`" for r in p.routes)
                    what = f"refused: {p.refused}" if p.refused else f"{routes} ({p.note})"
                    rows.append((build.name.value, mode.value, deployment.value, "yes" if multi else "no", what))
    return rows


def table_markdown() -> str:
    """docs/sglang_builds.md's table (a test keeps the two the same)."""
    lines = ["| build | syncMode | deployment | multi-LoRA | routes (the sync line), or the refusal |",
             "| --- | --- | --- | --- | --- |"]
    lines += [f"| {' | '.join(r)} |" for r in table_rows()]
    return "\n".join(lines)
