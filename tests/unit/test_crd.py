"""The CRDs are generated from the pydantic models; the committed YAML must match them."""

from __future__ import annotations

from pathlib import Path

import yaml
from pydantic import Field

from kora_operator.api.crd import OUTPUT_DIRS, generated_files, loraadapter_crd, loratrainingjob_crd, main
from kora_operator.api.job import IMMUTABLE_SECTIONS, LoRATrainingJob, LoRATrainingJobSpec, immutable_sections
from kora_operator.builders.rayjob import mutable_spec
from specs import valid_job

ROOT = Path(__file__).resolve().parents[2]


def test_committed_crds_match_the_models():
    for name, text in generated_files().items():
        for out_dir in OUTPUT_DIRS:
            path = ROOT / out_dir / name
            assert path.exists(), f"{path} missing: run `make manifests`"
            assert path.read_text() == text, f"{path} is stale: run `make manifests` and commit it"
    assert main(["--root", str(ROOT), "--check"]) == 0


def test_check_mode_reports_drift(tmp_path: Path, capsys):
    for out_dir in OUTPUT_DIRS:
        (tmp_path / out_dir).mkdir(parents=True)
    name, text = next(iter(generated_files().items()))
    (tmp_path / OUTPUT_DIRS[0] / name).write_text(text.replace("LoRA rank", "LoRA rnak"))
    assert main(["--root", str(tmp_path), "--check"]) == 1
    assert "make manifests" in capsys.readouterr().err


def _walk(schema, path="spec"):
    yield path, schema
    for key, prop in schema.get("properties", {}).items():
        yield from _walk(prop, f"{path}.{key}")
    if "items" in schema:
        yield from _walk(schema["items"], f"{path}[]")


def _version():
    return loratrainingjob_crd()["spec"]["versions"][0]


def test_every_field_is_documented_and_structural():
    root = _version()["schema"]["openAPIV3Schema"]
    for top in ("spec", "status"):
        for path, node in _walk(root["properties"][top], top):
            assert node.get("description"), f"{path} has no description"
            assert "$ref" not in node and "title" not in node
            assert "type" in node or node.get("x-kubernetes-int-or-string"), f"{path} has no type"
            if "properties" in node:
                assert "additionalProperties" not in node, path


def test_defaults_enums_bounds_and_rules_are_in_the_schema():
    spec = _version()["schema"]["openAPIV3Schema"]["properties"]["spec"]
    lora = spec["properties"]["lora"]["properties"]
    assert lora["syncMode"]["enum"] == ["Merge", "Adapter", "EngineMerge"]
    assert "default" not in lora["syncMode"]  # unset must stay visible to warn (SPEC rule 2)
    assert lora["rank"]["minimum"] == 1
    assert lora["alpha"]["default"] == 32.0 and lora["alpha"]["exclusiveMinimum"] is True
    assert lora["targetModules"]["default"] == ["linear_qkv", "linear_proj"]
    assert spec["properties"]["rollout"]["default"] == {}
    rules = [v["message"] for v in spec["x-kubernetes-validations"]]
    assert any("rollout.dpSize 1" in m for m in rules)
    assert any("router" in m for m in rules)
    assert spec["properties"]["lora"]["x-kubernetes-validations"][0]["rule"] == "self == oldSelf"
    assert "x-kubernetes-validations" not in spec["properties"]["suspend"]


def test_immutable_sections_are_every_spec_field_but_the_mutable_ones():
    assert set(IMMUTABLE_SECTIONS) == {
        "model", "lora", "algorithm", "data", "rollout", "parallelism", "deployment", "sync", "multiLora", "tracking",
        "diffusion", "backend", "runtime", "image", "resources", "queueName"}
    # the lifecycle fields are the ones the operator passes on to the RayJob, and they stay mutable
    job = LoRATrainingJob.model_validate(valid_job("immut"))
    lifecycle = set(mutable_spec(job))
    assert lifecycle == {"suspend", "backoffLimit", "ttlSecondsAfterFinished"}
    assert not lifecycle & set(IMMUTABLE_SECTIONS) and "checkpoint" not in IMMUTABLE_SECTIONS
    spec = _version()["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]
    for name, prop in spec.items():
        rules = [v["rule"] for v in prop.get("x-kubernetes-validations", [])]
        assert ("self == oldSelf" in rules) == (name in IMMUTABLE_SECTIONS), name


def test_a_new_spec_section_is_immutable_unless_said_otherwise():
    class Grown(LoRATrainingJobSpec):
        new_section: dict[str, str] = Field(default_factory=dict)
        """A section added later."""

    assert immutable_sections(Grown) == (*immutable_sections(LoRATrainingJobSpec), "newSection")


def test_printer_columns_and_names():
    crd = loratrainingjob_crd()
    assert crd["spec"]["names"]["shortNames"] == ["ltj"]
    version = _version()
    assert version["subresources"] == {"status": {}}
    visible = [c["name"] for c in version["additionalPrinterColumns"] if not c.get("priority")]
    assert visible == ["Mode", "Phase", "Step", "Reward", "Age"]
    (eta,) = [c for c in version["additionalPrinterColumns"] if c["name"] == "ETA"]
    assert eta["jsonPath"] == ".status.progress.eta" and eta["priority"] == 1  # -o wide only


def test_adapter_printer_columns_and_its_spec_is_immutable():
    crd = loraadapter_crd()
    assert crd["spec"]["names"]["shortNames"] == ["lad"]
    (version,) = crd["spec"]["versions"]
    assert version["subresources"] == {"status": {}}
    columns = {c["name"]: (c["jsonPath"], c.get("priority", 0)) for c in version["additionalPrinterColumns"]}
    assert [n for n, (_, priority) in columns.items() if not priority] == [
        "Job", "Phase", "Step", "Reward", "Version", "Age"]
    assert columns["Version"][0] == ".status.version" and columns["Total"] == (".status.numSteps", 1)
    spec = version["schema"]["openAPIV3Schema"]["properties"]["spec"]
    (rule,) = [r for r in spec["x-kubernetes-validations"] if r["rule"] == "self == oldSelf"]
    assert "delete the LoRAAdapter and create it again" in rule["message"]


def test_crd_yaml_is_plain_yaml():
    for text in generated_files().values():
        doc = yaml.safe_load(text)
        assert doc["kind"] == "CustomResourceDefinition"
