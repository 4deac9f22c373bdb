"""The generated CRDs against a real kube-apiserver: install, explain, print, CEL, immutability."""

from __future__ import annotations

import json
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from kora_operator.api.rules import JOB_RULES
from kora_operator.validation import validate_job
from kora_trainer.config import SPEC_RULES
from localcluster import wait_for
from specs import set_path, valid_job, violating_job

ROOT = Path(__file__).resolve().parents[2]
CRDS = ROOT / "manifests/crds"
SAMPLES = sorted((ROOT / "manifests/samples").glob("*.yaml"))
RULES = {r.id: r for r in (*SPEC_RULES, *JOB_RULES)}


@pytest.fixture(scope="module")
def crds(cluster):
    cluster.kubectl("apply", "--server-side", "-f", str(CRDS))
    # right after creation a CRD has no conditions yet and `kubectl wait` errors out (".status.conditions accessor
    # error"): retry it, as operatorkit.install_crds does
    names = [f"crd/{n}" for n in ("loratrainingjobs.kora.dev", "loraadapters.kora.dev")]
    wait_for(lambda: cluster.kubectl("wait", "--for=condition=Established", *names, "--timeout=30s",
                                     check=False).returncode == 0, timeout=60, what="our CRDs established")
    # discovery can lag Established by a moment; wait until kubectl can resolve the kinds
    wait_for(lambda: cluster.kubectl("explain", "ltj", check=False).returncode == 0,
             timeout=30, interval=0.5, what="ltj in discovery")
    return cluster


def apply(cluster, doc, namespace, *extra):
    return cluster.kubectl("apply", "-n", namespace, *extra, "-f", "-", input=yaml.safe_dump(doc), check=False)


def test_crds_are_established_and_explained(crds):
    out = " ".join(crds.kubectl("explain", "loratrainingjob.spec.lora").stdout.split())  # explain re-wraps
    assert "syncMode" in out and "Unset means Merge, with a warning" in out
    assert "LoRA rank r (>= 1)" in out
    out = " ".join(crds.kubectl("explain", "lad.spec.rank").stdout.split())
    assert "at most the job's lora.rank" in out


@pytest.mark.parametrize("sample", SAMPLES, ids=lambda p: p.name)
def test_samples_pass_server_dry_run(crds, namespace, sample):
    res = crds.kubectl("apply", "-n", namespace, "--dry-run=server", "-f", str(sample), check=False)
    assert res.returncode == 0, res.stderr
    assert "(server dry run)" in res.stdout


def test_defaults_are_applied_when_sections_are_omitted(crds, namespace):
    doc = valid_job("defaults")
    del doc["spec"]["lora"]["syncMode"]
    assert apply(crds, doc, namespace).returncode == 0
    spec = json.loads(crds.kubectl("get", "ltj", "defaults", "-n", namespace, "-o", "json").stdout)["spec"]
    assert spec["rollout"]["dpSize"] == 1 and spec["sync"]["bufferSize"] == 536870912
    assert spec["lora"]["targetModules"] == ["linear_qkv", "linear_proj"]
    assert spec["checkpoint"]["loraOnly"] is True and spec["algorithm"]["name"] == "GRPO"
    # no default for syncMode: the operator must still see that none was chosen (SPEC rule 2)
    assert "syncMode" not in spec["lora"]


def kora_validate(doc, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(doc))
    exe = Path(sys.executable).with_name("kora")
    return subprocess.run([str(exe), "validate", str(path)], capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("rule_id", sorted(RULES))
def test_cel_rule_rejects_with_the_same_message_as_kora_validate(crds, namespace, tmp_path, rule_id):
    doc = violating_job(rule_id, name=f"bad-{rule_id}")
    # the words kora validate uses for this spec (with its numbers, for a rule that has a messageExpression)
    (message,) = [p.message for p in validate_job(doc)[1] if p.rule == rule_id]
    res = apply(crds, doc, namespace)
    assert res.returncode != 0, f"the API server accepted a job breaking {rule_id}"
    assert message in res.stderr, res.stderr
    local = kora_validate(doc, tmp_path)
    assert local.returncode == 1
    assert f"error: {message}" in local.stderr


def _grid(n: int) -> list[dict]:
    """n jobs spread over the shapes the fit rules and the expert rule look at (deterministic)."""
    rnd = random.Random(15)
    docs = []
    for i in range(n):
        doc = valid_job(f"grid-{i}", resources={"workers": rnd.choice([0, 1, 2, 3]),
                                                "gpusPerWorker": rnd.choice([0, 2, 4, 8, 8, 16])},
                        parallelism={"data": rnd.choice([1, 2, 4, 8]), "tensor": rnd.choice([1, 2, 4]),
                                     "pipeline": rnd.choice([1, 1, 2]), "context": rnd.choice([1, 1, 2]),
                                     "expert": rnd.choice([1, 2, 4, 8]), "expertTensor": rnd.choice([1, 1, 2])},
                        rollout={"engine": rnd.choice(["sglang", "hf"]), "numEngines": rnd.choice([1, 2, 4]),
                                 "gpusPerEngine": rnd.choice([0, 1, 2, 4]),
                                 "distributedEngines": rnd.choice([0, 0, 1])},
                        deployment={"mode": rnd.choice(["Colocate", "Disaggregated"])})
        if rnd.random() < 0.1:
            doc["spec"]["runtime"] = {"kind": "Ray", "address": "http://ray-head:8265"}
        docs.append(doc)
    return docs


def _refusals(stderr: str) -> dict[str, str]:
    """`kubectl create` of many documents: job name -> the API server's refusal of it (one line each:
    `Error from server (Invalid): ... LoRATrainingJob.kora.dev "NAME" is invalid: CAUSES`)."""
    return {m[1]: m[2] for m in re.finditer(r'LoRATrainingJob\.kora\.dev "([^"]+)" is invalid: (.*)', stderr)}


def test_cel_and_kora_validate_agree_on_every_shape(crds, namespace):
    """The fit and expert rules are layout.py's arithmetic in Python and a CEL copy of it in the CRD: over a
    spread of shapes the API server refuses exactly the jobs kora validate refuses, with the same words."""
    docs = _grid(160)
    res = crds.kubectl("create", "-n", namespace, "--dry-run=server", "-f", "-", check=False,
                       input=yaml.safe_dump_all(docs))
    refused = _refusals(res.stderr)
    kinds = set()
    for doc in docs:
        name = doc["metadata"]["name"]
        messages = [p.message for p in validate_job(doc)[1] if p.severity == "error"]
        kinds.update(p.rule for p in validate_job(doc)[1] if p.severity == "error")
        if not messages:
            assert name not in refused, f"{name} {doc['spec']}: the API server refused: {refused.get(name)}"
            assert f"loratrainingjob.kora.dev/{name} created (server dry run)" in res.stdout
            continue
        assert name in refused, f"{name} {doc['spec']}: the API server accepted what kora validate refuses: {messages}"
        for m in messages:
            assert m in refused[name], f"{name}: {m!r} not in {refused[name]!r}"
        assert refused[name].count("Invalid value") == len(messages), refused[name]
    # the spread reached every rule it is about, and some jobs fit
    assert {"kuberay-gpus", "kuberay-gpus-per-node", "kuberay-cpu-engines", "expert-parallel-divides"} <= kinds
    assert "created (server dry run)" in res.stdout


def test_immutable_sections_and_mutable_lifecycle(crds, namespace):
    doc = valid_job("immut")
    assert apply(crds, doc, namespace).returncode == 0
    res = apply(crds, set_path(doc, "lora.rank", 16), namespace)
    assert res.returncode != 0
    assert "spec.lora is immutable" in res.stderr and "re-create" in res.stderr
    res = apply(crds, set_path(doc, "model.path", "/other"), namespace)
    assert "spec.model is immutable" in res.stderr
    # lifecycle fields may change on a created job
    assert apply(crds, set_path(doc, "suspend", True), namespace).returncode == 0
    assert apply(crds, set_path(set_path(doc, "suspend", True), "backoffLimit", 3), namespace).returncode == 0


def test_printer_columns_show_status(crds, namespace):
    assert apply(crds, valid_job("cols"), namespace).returncode == 0
    status = {"status": {"phase": "Running", "syncMode": "Adapter",
                         "progress": {"step": 7, "totalSteps": 20, "rewardMean": 0.625, "secondsPerStep": 2.0,
                                      "estimatedRemainingSeconds": 26, "eta": "26s"}}}
    crds.kubectl("patch", "ltj", "cols", "-n", namespace, "--subresource=status", "--type=merge",
                 "-p", json.dumps(status))
    out = crds.kubectl("get", "ltj", "-n", namespace).stdout.splitlines()
    assert out[0].split() == ["NAME", "MODE", "PHASE", "STEP", "REWARD", "AGE"]
    row = next(line.split() for line in out if line.startswith("cols "))
    assert row[:5] == ["cols", "Adapter", "Running", "7", "0.625"]
    wide = crds.kubectl("get", "ltj", "cols", "-n", namespace, "-o", "wide").stdout
    assert "TOTAL" in wide and "20" in wide
    lines = wide.splitlines()
    header, row = lines[0].split(), next(line.split() for line in lines if line.startswith("cols "))
    assert header[-1] == "ETA" and row[-1] == "26s"  # the ETA column, -o wide only (priority 1)


def test_status_is_not_writable_through_the_main_resource(crds, namespace):
    assert apply(crds, valid_job("st"), namespace).returncode == 0
    crds.kubectl("patch", "ltj", "st", "-n", namespace, "--type=merge", "-p", '{"status": {"phase": "Succeeded"}}')
    got = json.loads(crds.kubectl("get", "ltj", "st", "-n", namespace, "-o", "json").stdout)
    assert "phase" not in got.get("status", {})


def test_unknown_fields_are_rejected(crds, namespace):
    doc = set_path(valid_job("typo"), "lora.syncmode", "Adapter")
    res = apply(crds, doc, namespace)
    assert res.returncode != 0 and "syncmode" in res.stderr


MULTI = {"lora.syncMode": "Adapter", "rollout.sglangBuild": "sglang-miles-94949da7"}


@pytest.mark.parametrize(("value", "ok"), [(0, True), (4, True), ("auto", True), (257, False), ("many", False),
                                           (-1, False)])
def test_max_adapters_takes_a_count_or_auto(crds, namespace, value, ok):
    """multiLora.maxAdapters is int-or-string (issue 44 item 5): an integer manifest stays valid, `auto` is taken
    (and turns multi-LoRA on for the rules that read it: a Merge job with auto is refused as one with 2), anything
    else is refused with the field's message; kora validate agrees."""
    doc = valid_job(f"slots-{str(value).replace('-', 'm')}")
    for path, v in ({**MULTI, "multiLora.maxAdapters": value} if value else {}).items():
        doc = set_path(doc, path, v)
    res = crds.kubectl("create", "-n", namespace, "--dry-run=server", "-f", "-", check=False,
                       input=yaml.safe_dump(doc))
    assert (res.returncode == 0) is ok, res.stderr
    assert bool(validate_job(doc)[1]) is not ok and (ok or "maxAdapters must be 0 to 256" in res.stderr)
    if value == "auto":  # auto counts as on: the multi-lora-needs-adapter rule sees it
        doc = set_path(doc, "lora.syncMode", "Merge")
        res = crds.kubectl("create", "-n", namespace, "--dry-run=server", "-f", "-", check=False,
                           input=yaml.safe_dump(doc))
        assert res.returncode != 0 and "requires lora.syncMode Adapter" in " ".join(res.stderr.split())
