"""Every SPEC validation rule, through the same functions `kora validate` and the operator use."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kora_operator.api.rules import JOB_RULES
from kora_operator.validation import validate_adapter, validate_job
from kora_trainer.config import NO_SYNC_MODE_WARNING, SPEC_RULES, ParallelismSpec, TrainerConfig, adapter_problems
from kora_trainer.config.layout import fix_data, parallel_problems
from specs import DIFFUSION, MULTI_LORA_BUILD, VIOLATIONS, set_path, valid_job, violating_job


def errors(doc, hf_config=None):
    _job, problems = validate_job(doc, hf_config)
    return [p for p in problems if p.severity == "error"]


def test_valid_job_has_no_problems():
    assert errors(valid_job()) == []


def test_every_cel_rule_has_a_violation_case():
    ids = {r.id for r in (*SPEC_RULES, *JOB_RULES)}
    assert ids == set(VIOLATIONS), "add a VIOLATIONS case in tests/specs.py for each new rule"


@pytest.mark.parametrize("rule", [*SPEC_RULES, *JOB_RULES], ids=lambda r: r.id)
def test_rule_rejects_its_violation_alone(rule):
    found = errors(violating_job(rule.id))
    assert [p.rule for p in found] == [rule.id]
    # the message names the field it is about and says what to do
    assert rule.field.split(".")[-1] in found[0].message
    assert ":" in found[0].message


def diffusion_job():
    doc = valid_job()
    for path, value in DIFFUSION.items():
        doc = set_path(doc, path, value)
    return doc


@pytest.mark.parametrize("mode", ["Merge", "EngineMerge"])
def test_a_diffusion_job_in_either_of_its_modes_is_valid(mode):
    job, problems = validate_job(set_path(diffusion_job(), "lora.syncMode", mode))
    assert problems == [] and job is not None and job.spec.diffusion.clip_eps == 1e-4


def test_a_diffusion_job_on_one_gpu_is_valid_and_a_bigger_engine_is_refused_naming_the_field():
    """rollout.gpusPerEngine 1: the engine and the one trainer rank share the job's GPU; 2 is an engine of
    several GPUs (not built)."""
    doc = set_path(diffusion_job(), "rollout.gpusPerEngine", 1)
    assert errors(doc) == []
    found = errors(set_path(doc, "rollout.gpusPerEngine", 2))
    assert [p.rule for p in found] == ["diffusion-one-engine"] and "gpusPerEngine 0 or 1" in found[0].message


def test_a_diffusion_job_on_data_parallel_ranks_is_valid_when_its_prompt_groups_split_evenly():
    """parallelism.data 2: rolloutBatchSize 4 of groups of 4 splits 2 + 2; with globalBatchSize 8 (two optimizer
    steps of 2 groups) each step's 2 groups split 1 + 1; globalBatchSize 4 (1 group a step) cannot split."""
    doc = set_path(set_path(diffusion_job(), "parallelism.data", 2), "algorithm.rolloutBatchSize", 4)
    doc = set_path(doc, "algorithm.nSamplesPerPrompt", 4)
    assert errors(doc) == []
    assert errors(set_path(doc, "algorithm.globalBatchSize", 8)) == []
    assert [p.rule for p in errors(set_path(doc, "algorithm.globalBatchSize", 4))] == ["diffusion-data-split"]


@pytest.mark.parametrize("path,value,fix", [
    ("algorithm.temperature", 0.8, "diffusion.noiseLevel"),
    ("algorithm.clipEps", 0.28, "diffusion.clipEps"),
    ("lora.targetModules", ["linear_qkv"], "diffusion.targetModules"),
    ("data.rewardType", "deepscaler", "diffusion.reward"),
])
def test_a_language_model_field_set_on_a_diffusion_job_is_refused_naming_its_counterpart(path, value, fix):
    found = errors(set_path(diffusion_job(), path, value))
    assert [p.rule for p in found] == ["diffusion-unused"] and path in found[0].message and fix in found[0].message
    assert errors(set_path(valid_job(), path, value)) == []  # on a language-model job the field is fine


def test_a_diffusion_job_with_the_defaults_the_api_server_fills_in_is_valid():
    """The CRD defaults every field: a diffusion job read back from the API server carries the language-model
    fields at their defaults, which must not count as set."""
    from kora_operator.api.job import LoRATrainingJobSpec

    spec = LoRATrainingJobSpec.model_validate(diffusion_job()["spec"]).model_dump(by_alias=True, mode="json")
    assert spec["algorithm"]["temperature"] == 1.0 and spec["sync"]["servedLogpGapMax"] == 0.25
    doc = diffusion_job()
    doc["spec"] = spec
    assert errors(doc) == []


def test_a_diffusion_section_without_its_kind_is_refused():
    found = errors(set_path(valid_job(), "diffusion.noiseLevel", 0.5))
    assert any("diffusion.kind" in p.message for p in found), found


def test_rule2_no_mode_means_merge_with_warning():
    doc = valid_job()
    del doc["spec"]["lora"]["syncMode"]
    job, problems = validate_job(doc)
    assert job is not None and job.spec.lora.effective_sync_mode == "Merge"
    assert [(p.severity, p.message) for p in problems] == [("warning", NO_SYNC_MODE_WARNING)]


def test_rule3_adapter_with_dp1_is_fine():
    assert errors(set_path(set_path(valid_job(), "lora.syncMode", "Adapter"), "rollout.dpSize", 1)) == []


VL_CONFIG = {"model_type": "qwen2_5_vl", "vision_config": {"depth": 32}}
OMNI_CONFIG = {"model_type": "qwen2_5_omni", "thinker_config": {"audio_config": {"d_model": 8}}}


@pytest.mark.parametrize("hf_config", [VL_CONFIG, OMNI_CONFIG], ids=["vision", "omni-nested-audio"])
def test_rule4_adapter_scope_all_on_multimodal_model(hf_config):
    doc = set_path(valid_job(), "lora.syncMode", "Adapter")
    found = errors(doc, hf_config)
    assert [p.rule for p in found] == ["adapter-vision-scope"]
    assert "lora.scope" in found[0].message and "language" in found[0].message
    # the two fixes the message offers both work
    assert errors(set_path(doc, "lora.scope", "language"), hf_config) == []
    assert errors(set_path(doc, "lora.syncMode", "Merge"), hf_config) == []


def test_rule4_reads_config_json_from_model_path(tmp_path: Path):
    (tmp_path / "config.json").write_text(json.dumps(VL_CONFIG))
    doc = set_path(set_path(valid_job(), "lora.syncMode", "Adapter"), "model.path", str(tmp_path))
    assert [p.rule for p in errors(doc)] == ["adapter-vision-scope"]
    assert str(tmp_path) in errors(doc)[0].message


def test_rule4_text_model_is_fine():
    doc = set_path(valid_job(), "lora.syncMode", "Adapter")
    assert errors(doc, {"model_type": "qwen3"}) == []


MOE = {"model_type": "qwen3_moe", "num_experts": 128}


def _moe_job(mode: str, **extra):
    doc = set_path(valid_job(), "lora.syncMode", mode)
    doc = set_path(doc, "lora.targetModules", ["linear_qkv", "linear_fc1", "linear_fc2"])
    doc = set_path(doc, "parallelism.expertTensor", 2)
    doc = set_path(doc, "parallelism.data", 2)  # expertTensor 2 must divide the ranks (expert-parallel-divides)
    for k, v in extra.items():
        doc = set_path(doc, k, v)
    return doc


def test_rule6_moe_merge_needs_expert_tensor_1():
    found = errors(_moe_job("Merge"), MOE)
    assert [p.rule for p in found] == ["moe-expert-tensor"]
    assert "parallelism.expertTensor" in found[0].message
    assert errors(set_path(_moe_job("Merge"), "parallelism.expertTensor", 1), MOE) == []


def test_rule6_adapter_mode_only_with_a_reference_role():
    assert errors(_moe_job("Adapter"), MOE) == []  # fully on-policy: nothing is folded
    found = errors(_moe_job("Adapter", **{"algorithm.klCoef": 0.01}), MOE)
    assert [p.rule for p in found] == ["moe-expert-tensor"]
    assert [p.rule for p in errors(_moe_job("Adapter", **{"deployment.async": True}), MOE)] == [
        "moe-expert-tensor"]


def test_rule6_dense_model_unaffected_and_expert_parallel_implies_moe():
    assert errors(_moe_job("Merge"), {"model_type": "qwen3"}) == []
    doc = set_path(_moe_job("Merge"), "parallelism.expert", 4)  # no config.json readable
    doc = set_path(doc, "parallelism.data", 8)  # expert 4 x expertTensor 2 must divide the 8 ranks
    assert [p.rule for p in errors(doc)] == ["moe-expert-tensor"]


def _multi_job(dp: int = 2) -> TrainerConfig:
    doc = valid_job(**{"multiLora": {"maxAdapters": 4}}, rollout=MULTI_LORA_BUILD)
    doc = set_path(doc, "lora.syncMode", "Adapter")
    doc = set_path(doc, "lora.rank", 32)
    doc = set_path(doc, "parallelism.data", dp)
    doc = set_path(doc, "algorithm.rolloutBatchSize", 8)
    doc = set_path(doc, "algorithm.nSamplesPerPrompt", 4)
    job, problems = validate_job(doc)
    assert job is not None and not [p for p in problems if p.severity == "error"]
    return job


def adapter_doc(**spec):
    base = {"jobName": "job", "rank": 16, "data": {"path": "/d.parquet"}}
    base.update(spec)
    return {"apiVersion": "kora.dev/v1alpha1", "kind": "LoRAAdapter", "metadata": {"name": "a"}, "spec": base}


def test_rule9_adapter_fits():
    _, problems = validate_adapter(adapter_doc(), _multi_job())
    assert problems == []


@pytest.mark.parametrize(("spec", "rule"), [
    ({"rank": 64}, "adapter-rank"),
    ({"nSamplesPerPrompt": 3}, "adapter-samples-dp"),
    ({"nSamplesPerPrompt": 6, "rolloutBatchSize": 4}, "adapter-samples-dp"),
    ({"rolloutBatchSize": 1000}, "adapter-batch-cap"),
])
def test_rule9_adapter_violations(spec, rule):
    _, problems = validate_adapter(adapter_doc(**spec), _multi_job(dp=4))
    assert rule in [p.rule for p in problems]


def test_rule9_groups_must_split_evenly_across_dp():
    job = _multi_job(dp=8)
    # 2 samples/prompt on 8 DP ranks: 4 groups fill one split, so 6 groups cannot be split
    found = adapter_problems(job.spec, name="a", rank=8, rollout_batch_size=6, n_samples_per_prompt=2)
    assert [p.rule for p in found] == ["adapter-batch-groups"]
    assert "multiple of 4" in found[0].message
    assert adapter_problems(job.spec, name="a", rank=8, rollout_batch_size=8, n_samples_per_prompt=2) == []


def test_stream_groups_must_be_whole_dp_splits():
    """streamGroups: units of whole DP splits (8 ranks, 2 samples a group: 4 groups a split), at start and on a
    LoRAAdapter, naming the field and a fix."""
    job = _multi_job(dp=8)
    found = adapter_problems(job.spec, name="a", rank=8, rollout_batch_size=8, n_samples_per_prompt=2, stream_groups=6)
    assert [(p.rule, p.field) for p in found] == [("adapter-stream-groups", "streamGroups")]
    assert "multiple of 4" in found[0].message and "use e.g. 4" in found[0].message
    assert adapter_problems(job.spec, name="a", rank=8, rollout_batch_size=8, n_samples_per_prompt=2,
                            stream_groups=4) == []
    _, problems = validate_adapter(adapter_doc(nSamplesPerPrompt=2, rolloutBatchSize=8, streamGroups=3),
                                   _multi_job(dp=8))
    assert "adapter-stream-groups" in [p.rule for p in problems]
    found = errors(_start_job([start_adapter("a", streamGroups=2), start_adapter("b", nSamplesPerPrompt=1,
                                                                                   streamGroups=1)]))
    assert [(p.rule, p.field) for p in found] == [("adapter-stream-groups", "multiLora.adapters[1].streamGroups")]


def test_adapter_on_a_single_adapter_job_is_rejected():
    job, _ = validate_job(valid_job())
    _, problems = validate_adapter(adapter_doc(), job)
    assert "adapter-needs-multi-lora" in [p.rule for p in problems]


def _start_job(adapters, max_adapters=2, **extra):
    """A multi-LoRA job (dp 2, rank 32, 8 groups x 4) that lists `adapters` in multiLora.adapters."""
    doc = valid_job(multiLora={"maxAdapters": max_adapters, "adapters": adapters}, rollout=MULTI_LORA_BUILD)
    for k, v in {"lora.syncMode": "Adapter", "lora.rank": 32, "parallelism.data": 2,
                 "algorithm.rolloutBatchSize": 8, "algorithm.nSamplesPerPrompt": 4, **extra}.items():
        doc = set_path(doc, k, v)
    return doc


def start_adapter(name, **spec):
    return {"name": name, "rank": 16, "data": {"path": "/d.parquet"}, **spec}


def test_adapters_at_start_that_fit_pass():
    assert errors(_start_job([start_adapter("a"), start_adapter("b", rolloutBatchSize=4)])) == []


def test_adapters_at_start_pass_rule9_naming_their_entry():
    found = errors(_start_job([start_adapter("a"), start_adapter("b", rank=64, nSamplesPerPrompt=3)]))
    assert [(p.rule, p.field) for p in found] == [("adapter-rank", "multiLora.adapters[1].rank"),
                                                  ("adapter-samples-dp", "multiLora.adapters[1].nSamplesPerPrompt")]
    assert found[0].message.startswith("multiLora.adapters[1] (b): rank 64 exceeds the job's lora.rank 32")
    assert "lower the adapter's rank or raise the job's lora.rank" in found[0].message


def test_adapters_at_start_need_a_slot_each():
    found = errors(_start_job([start_adapter("a"), start_adapter("b"), start_adapter("c")]))
    assert [p.rule for p in found] == ["start-adapters-fit"]
    assert found[0].message.startswith("multiLora.adapters lists 3 adapters and multiLora.maxAdapters is 2")
    assert "raise multiLora.maxAdapters to 3" in found[0].message
    assert errors(_start_job([start_adapter("a"), start_adapter("b"), start_adapter("c")], 3)) == []


def test_adapters_at_start_need_multi_lora_on():
    found = errors(_start_job([start_adapter("a")], 0))
    assert [p.rule for p in found] == ["start-adapters-need-slots"]
    assert found[0].message == ("multiLora.adapters lists 1 adapter and multiLora.maxAdapters is 0 (multi-LoRA off, "
                                "no slots): set multiLora.maxAdapters to 1 or more, or remove multiLora.adapters")


def test_adapters_at_start_have_unique_names():
    found = errors(_start_job([start_adapter("a"), start_adapter("a", rank=8)]))
    assert [(p.rule, p.field) for p in found] == [("start-adapter-names", "multiLora.adapters")]
    assert found[0].message.startswith("multiLora.adapters names a 2 times (multiLora.adapters[0] (a), "
                                       "multiLora.adapters[1] (a)):")
    assert "rename or remove the repeats" in found[0].message


def test_kora_trainer_checks_adapters_at_start_too():
    from kora_trainer.config import ConfigError, load_config
    from kora_trainer.config.load import spec_of

    spec = spec_of(_start_job([start_adapter("a", rank=64)]))
    with pytest.raises(ConfigError, match=r"multiLora\.adapters\[0\] \(a\): rank 64 exceeds"):
        load_config(None, base=spec)


def test_adapter_named_like_one_the_job_trains_from_the_start_is_rejected():
    doc = valid_job(multiLora={"maxAdapters": 2, "adapters": [{"name": "a", "rank": 8, "data": {"path": "/d.jsonl"}}]},
                    rollout=MULTI_LORA_BUILD)
    doc = set_path(set_path(doc, "lora.syncMode", "Adapter"), "lora.rank", 32)
    job, _ = validate_job(doc)
    _, problems = validate_adapter(adapter_doc(), job)
    (taken,) = [p for p in problems if p.rule == "adapter-name-taken"]
    assert taken.field == "metadata.name" and "multiLora.adapters" in taken.message


def test_schema_errors_name_the_field():
    doc = set_path(valid_job(), "lora.rank", 0)
    doc = set_path(doc, "lora.syncmode", "Adapter")  # misspelt
    _, problems = validate_job(doc)
    text = "\n".join(p.message for p in problems)
    assert "spec.lora.rank: Input should be greater than or equal to 1" in text
    assert "spec.lora.syncmode: unknown field" in text


# -- the fit of a KubeRay job (api/rules.py over config/layout.py) -----------------------------------------------


def only(doc):
    found = errors(doc)
    assert len(found) == 1, found
    return found[0]


def test_too_few_gpus_names_the_numbers_and_the_fix():
    p = only(set_path(valid_job(), "parallelism.data", 16))  # Colocate, 1 engine, on 1 worker x 8 GPUs
    assert p.rule == "kuberay-gpus" and p.field == "resources.workers"
    assert p.message.startswith("the job needs 16 GPUs (16 trainer ranks = parallelism data x tensor x pipeline x "
                                "context, 1 engines x 1 GPUs; max(ranks, gpusPerEngine): Colocate, the engines share "
                                "the ranks' GPUs) and the cluster has 8 (1 node): raise resources.workers or "
                                "resources.gpusPerWorker")
    # Disaggregated adds the engines to the ranks: 4 + 4 x 2 = 12 > 2 workers x 4
    doc = valid_job(resources={"workers": 2, "gpusPerWorker": 4}, parallelism={"data": 4},
                    rollout={"numEngines": 4, "gpusPerEngine": 2}, deployment={"mode": "Disaggregated"})
    p = only(doc)
    assert "needs 12 GPUs (4 trainer ranks" in p.message and "4 engines x 2 GPUs; ranks + engines" in p.message
    assert "the cluster has 8 (2 nodes)" in p.message
    assert errors(set_path(doc, "resources.workers", 3)) == []  # the fix it names works


def test_a_tensor_group_or_an_engine_must_fit_on_one_worker():
    p = only(valid_job(resources={"workers": 4, "gpusPerWorker": 2}, parallelism={"tensor": 4}))
    assert p.rule == "kuberay-gpus-per-node" and p.field == "resources.gpusPerWorker"
    assert p.message == ("parallelism.tensor 4 and rollout.gpusPerEngine 1 must each fit on one node, the largest has "
                         "2 GPUs: raise resources.gpusPerWorker to 4, or lower them")
    p = only(valid_job(resources={"workers": 4, "gpusPerWorker": 2}, rollout={"gpusPerEngine": 4}))
    assert "rollout.gpusPerEngine 4" in p.message and "raise resources.gpusPerWorker to 4" in p.message


def test_expert_parallelism_must_divide_a_pipeline_stage():
    # the MoE recipe as it once was: tensor 2 x expert 4 with data 1
    p = only(valid_job(parallelism={"data": 1, "tensor": 2, "expert": 4}))
    assert p.rule == "expert-parallel-divides"
    assert p.message.startswith("parallelism.expert 4 x expertTensor 1 must divide the ranks of one pipeline "
                                "stage, data 1 x tensor 2 x context 1 = 2")
    assert p.message.endswith("raise parallelism.data to a multiple of 2, or lower parallelism.expert")
    assert errors(valid_job(parallelism={"data": 2, "tensor": 2, "expert": 4})) == []
    # a trainer rule: runtime Ray too
    ray = valid_job(parallelism={"tensor": 2, "expert": 4}, runtime={"kind": "Ray", "address": "http://r:8265"})
    assert only(ray).rule == "expert-parallel-divides"


def test_a_cpu_cluster_runs_the_reference_engine_only():
    cpu = valid_job(resources={"workers": 0, "gpusPerWorker": 0}, rollout={"engine": "hf", "gpusPerEngine": 0},
                    deployment={"mode": "Disaggregated"})
    assert errors(cpu) == []  # the toy / demo shape on KubeRay (hack/e2e_kind.py)
    for rollout in ({"engine": "sglang", "gpusPerEngine": 0}, {"engine": "hf", "gpusPerEngine": 1}):
        p = only(set_path(cpu, "rollout", rollout))
        assert p.rule == "kuberay-cpu-engines" and "rollout.engine hf and rollout.gpusPerEngine 0" in p.message


def test_runtime_ray_leaves_the_fit_to_the_trainer():
    doc = valid_job(parallelism={"data": 64}, resources={"workers": 1, "gpusPerWorker": 1},
                    runtime={"kind": "Ray", "address": "http://ray-head:8265"})
    assert errors(doc) == []


def test_zero_workers_fit_the_head():
    assert errors(valid_job(resources={"workers": 0, "gpusPerWorker": 8}, parallelism={"data": 8})) == []
    p = only(valid_job(resources={"workers": 0, "gpusPerWorker": 8}, parallelism={"data": 16}))
    assert "the cluster has 8 (1 node)" in p.message


@pytest.mark.parametrize(("sizes", "data"), [
    ({"tensor": 2, "expert": 4}, 2),
    ({"tensor": 3, "expert": 4}, 4),
    ({"tensor": 2, "context": 2, "expert": 8, "expertTensor": 2}, 4),
    ({"expert": 384}, 384),  # past layout.FIX_DATA_SEARCH: expert x expertTensor itself, still a fix
    ({"tensor": 3, "expert": 768}, 256),  # 768 / gcd(768, 3): found at the end of the search
    ({"tensor": 2, "expert": 1024}, 1024),  # the smallest, 512, is past the search: 1024 itself then
])
def test_the_expert_fix_names_a_data_size_that_works(sizes, data):
    p = ParallelismSpec.model_validate(sizes)
    assert fix_data(p) == data
    fixed = ParallelismSpec.model_validate({**sizes, "data": data})
    assert parallel_problems(fixed) == []
