"""miles' multi-LoRA flags: slots, batch cap, coalesce wait, and `--multi-lora-adapter NAME PATH` reading the
seed's adapter.yaml into multiLora.adapters, with every refusal naming the flag, the file, the key and the fix."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from kora_trainer.config import ConfigError, load_config
from kora_trainer.config.flags import as_overrides, origins, parse_seed_flags

BASE = {"model": {"path": "/m"}, "lora": {"rank": 32, "syncMode": "Adapter"}, "data": {"path": "/d.jsonl"},
        "algorithm": {"rolloutBatchSize": 8, "nSamplesPerPrompt": 4},
        "rollout": {"sglangBuild": "sglang-miles-94949da7"}}  # miles' recipes run on its SGLang build
GSM8K = {"rank": 16, "alpha": 16, "rollout_batch_size": 32, "n_samples_per_prompt": 4,
         "data": "/root/datasets/gsm8k/train.parquet", "input_key": "messages", "label_key": "label",
         "rm_type": "math", "num_step": 400}


def load(argv, base=BASE):
    values = parse_seed_flags(argv)
    cfg, _ = load_config(None, as_overrides(values), base=base, origins=origins(values))
    return cfg


def adapter_yaml(tmp_path: Path, name: str, body: object) -> str:
    path = tmp_path / f"{name}.yaml"
    path.write_text(body if isinstance(body, str) else yaml.safe_dump(body))
    return str(path)


def refusal(argv, base=BASE) -> str:
    with pytest.raises(ConfigError) as err:
        load(argv, base)
    return "\n".join(err.value.problems)


def test_each_multi_lora_flag_sets_its_field():
    cfg = load(["--multi-lora-n-adapters", "3", "--multi-lora-max-adapter-global-batch-size", "256",
                "--multi-lora-max-coalesce-wait-s", "1.5"])
    ml = cfg.multi_lora
    assert (ml.max_adapters, ml.max_adapter_global_batch_size, ml.max_coalesce_wait_seconds) == (3, 256, 1.5)
    assert ml.adapters == []  # service mode: idles until adapters are registered


def test_two_adapter_flags_give_two_adapters_with_the_seed_keys_mapped(tmp_path):
    dapo = {"rank": 8, "data": "dapo.parquet", "rm_type": "deepscaler", "num_epoch": 2, "lr": 1e-4, "seed": 7,
            "rollout_batch_size": 16, "n_samples_per_prompt": 8}
    cfg = load(["--multi-lora-n-adapters", "2", "--multi-lora-adapter", "gsm8k", adapter_yaml(tmp_path, "g", GSM8K),
                "--multi-lora-adapter", "dapo-math", adapter_yaml(tmp_path, "d", dapo)])
    gsm8k, dapo_math = cfg.multi_lora.adapters
    assert (gsm8k.name, gsm8k.rank, gsm8k.alpha, gsm8k.rollout_batch_size, gsm8k.n_samples_per_prompt) == (
        "gsm8k", 16, 16, 32, 4)
    assert (gsm8k.num_steps, gsm8k.num_epochs) == (400, None)
    assert gsm8k.data.model_dump(by_alias=True) == {"path": "/root/datasets/gsm8k/train.parquet",
                                                    "inputKey": "messages", "labelKey": "label",
                                                    "rewardType": "math", "customRewardPath": None, "imageKey": None}
    assert (dapo_math.name, dapo_math.num_epochs, dapo_math.lr, dapo_math.seed) == ("dapo-math", 2, 1e-4, 7)
    assert dapo_math.data.reward_type == "deepscaler" and dapo_math.alpha is None  # the job's lora.alpha
    # a relative data path is taken from the adapter.yaml's directory
    assert dapo_math.data.path == str(tmp_path / "dapo.parquet")


def test_custom_rm_path_maps_onto_the_custom_reward(tmp_path):
    body = {"rank": 4, "data": "/d.parquet", "rm_type": "custom", "custom_rm_path": "mypkg.rewards.reward"}
    cfg = load(["--multi-lora-n-adapters", "1", "--multi-lora-adapter", "a", adapter_yaml(tmp_path, "a", body)])
    assert cfg.multi_lora.adapters[0].data.custom_reward_path == "mypkg.rewards.reward"


def test_flag_adapters_are_appended_to_the_job_files(tmp_path):
    base = {**BASE, "multiLora": {"maxAdapters": 2, "adapters": [{"name": "first", "rank": 4,
                                                                  "data": {"path": "/d.parquet"}}]}}
    cfg = load(["--multi-lora-adapter", "gsm8k", adapter_yaml(tmp_path, "g", GSM8K)], base)
    assert [a.name for a in cfg.multi_lora.adapters] == ["first", "gsm8k"]


def test_a_save_where_kora_writes_the_adapter_is_accepted(tmp_path):
    body = {**GSM8K, "save": str(tmp_path / "ckpt" / "adapters" / "gsm8k") + "/"}
    cfg = load(["--multi-lora-n-adapters", "1", "--save", str(tmp_path / "ckpt"),
                "--multi-lora-adapter", "gsm8k", adapter_yaml(tmp_path, "g", body)])
    assert cfg.checkpoint.path == str(tmp_path / "ckpt")


def test_a_save_elsewhere_is_refused_with_where_kora_writes(tmp_path):
    file = adapter_yaml(tmp_path, "g", {**GSM8K, "save": "/runs/x/adapters/gsm8k"})
    text = refusal(["--multi-lora-n-adapters", "1", "--save", "/ckpt", "--multi-lora-adapter", "gsm8k", file])
    assert text == (f"--multi-lora-adapter gsm8k {file}: save /runs/x/adapters/gsm8k is not where kora writes this "
                    "adapter: kora writes each adapter's checkpoints under <checkpoint.path>/adapters/<name>/ (for "
                    "this job /ckpt/adapters/gsm8k/) and has no per-adapter save directory: set checkpoint.path to "
                    "/runs/x (the --save flag) and remove save from the file")
    # without checkpoint.path nothing is written, so any save is refused; a relative one is read from the file's dir
    file = adapter_yaml(tmp_path, "g", {**GSM8K, "save": "out"})
    text = refusal(["--multi-lora-n-adapters", "1", "--multi-lora-adapter", "gsm8k", file])
    assert f"save {tmp_path / 'out'} is not where kora writes this adapter" in text
    assert "(checkpoint.path is not set)" in text
    assert "set checkpoint.path (the --save flag) to the directory that should hold adapters/gsm8k/" in text


def test_rule9_names_the_flag_the_file_and_the_files_keys(tmp_path):
    file = adapter_yaml(tmp_path, "g", {**GSM8K, "rank": 64, "n_samples_per_prompt": 3})
    text = refusal(["--multi-lora-n-adapters", "1", "--multi-lora-adapter", "gsm8k", file],
                   {**BASE, "parallelism": {"data": 2}})
    assert (f"--multi-lora-adapter gsm8k {file}: rank 64 exceeds the job's lora.rank 32 (the largest rank a slot "
            "holds): lower the adapter's rank or raise the job's lora.rank") in text
    assert f"--multi-lora-adapter gsm8k {file}: n_samples_per_prompt 3 must divide, or be a multiple of" in text
    file = adapter_yaml(tmp_path, "g", {**GSM8K, "rollout_batch_size": 1000})
    text = refusal(["--multi-lora-n-adapters", "1", "--multi-lora-adapter", "gsm8k", file])
    assert "rollout_batch_size x n_samples_per_prompt = 4000 exceeds the job's cap 128" in text


def test_slots_and_names_are_checked_across_flags(tmp_path):
    one, two = adapter_yaml(tmp_path, "one", GSM8K), adapter_yaml(tmp_path, "two", GSM8K)
    text = refusal(["--multi-lora-adapter", "gsm8k", one, "--multi-lora-adapter", "gsm8k", two])
    assert "multiLora.adapters lists 2 adapters and multiLora.maxAdapters is 0" in text
    assert "multiLora.adapters names gsm8k 2 times (--multi-lora-adapter gsm8k " + one in text
    assert "--multi-lora-adapter gsm8k " + two + "): an adapter's name is its lora_path" in text
    text = refusal(["--multi-lora-n-adapters", "1", "--multi-lora-adapter", "a", one, "--multi-lora-adapter", "b", two])
    assert "multiLora.adapters lists 2 adapters and multiLora.maxAdapters is 1" in text


@pytest.mark.parametrize(("body", "words"), [
    (None, "cannot read {file} (No such file or directory): PATH must be the adapter's adapter.yaml"),
    ("rank: [16\n", "{file} is not valid YAML"),
    ("", "{file} holds nothing; it must be a mapping of keys"),
    ("- rank: 16\n", "{file} holds a list; it must be a mapping of keys"),
    ({**GSM8K, "rolout_batch_size": 3}, "unknown key rolout_batch_size in {file}: remove or respell it (the keys: "
                                        "rank, alpha, rollout_batch_size,"),
    ({"rank": 8}, "data: required key is missing: set it"),
    ({"data": "/d.parquet"}, "rank: required key is missing: set it"),
    ({**GSM8K, "rank": 0}, "rank: Input should be greater than or equal to 1"),
    ({**GSM8K, "input_key": ""}, "input_key: String should have at least 1 character"),
    ({**GSM8K, "rm_type": "exact"}, "rm_type: Input should be 'math', 'deepscaler' or 'custom'"),
    ({**GSM8K, "rm_type": "custom"}, "rm_type custom needs custom_rm_path: set it to a dotted path"),
    ({**GSM8K, "num_epoch": 2}, "num_step and num_epoch are both set: keep one of them"),
    ({**GSM8K, "save": 3}, "save in {file} must be a directory path, not 3"),
], ids=["missing", "bad-yaml", "empty", "a-list", "unknown-key", "no-data", "no-rank", "rank-0", "empty-key",
        "bad-rm-type", "custom-without-path", "steps-and-epochs", "save-not-a-path"])
def test_every_refusal_names_the_flag_file_and_key(tmp_path, body, words):
    file = str(tmp_path / "missing.yaml") if body is None else adapter_yaml(tmp_path, "a", body)
    with pytest.raises(ConfigError) as err:
        parse_seed_flags(["--multi-lora-adapter", "a", file])
    [line] = err.value.problems
    assert line.startswith(f"--multi-lora-adapter a {file}: ")
    assert words.format(file=file) in line


def test_a_bad_name_is_refused_with_the_rule(tmp_path):
    with pytest.raises(ConfigError, match=r"NAME GSM_8k must be a DNS label \(lower-case letters"):
        parse_seed_flags(["--multi-lora-adapter", "GSM_8k", adapter_yaml(tmp_path, "g", GSM8K)])


def test_all_bad_adapter_flags_are_reported_at_once(tmp_path):
    with pytest.raises(ConfigError) as err:
        parse_seed_flags(["--multi-lora-adapter", "a", str(tmp_path / "a.yaml"),
                          "--multi-lora-adapter", "b", str(tmp_path / "b.yaml")])
    assert [p.split(":")[0] for p in err.value.problems] == [f"--multi-lora-adapter a {tmp_path}/a.yaml",
                                                             f"--multi-lora-adapter b {tmp_path}/b.yaml"]


def test_the_trainer_exits_2_with_the_message(tmp_path, capsys):
    from kora_trainer.train import main

    file = adapter_yaml(tmp_path, "g", {**GSM8K, "rank": 64})
    rc = main(["--hf-checkpoint", "/m", "--prompt-data", "/d.jsonl", "--lora-rank", "32", "--lora-adapter-mode",
               "--multi-lora-n-adapters", "1", "--multi-lora-adapter", "gsm8k", file, "--dry-run"])
    assert rc == 2
    assert f"--multi-lora-adapter gsm8k {file}: rank 64 exceeds the job's lora.rank 32" in capsys.readouterr().err


def test_append_override_needs_a_list():
    with pytest.raises(ConfigError, match=r"\+= appends a list to a list"):
        load_config(None, ["multiLora.adapters+={name: a}"], base=BASE)


def test_an_adapter_takes_an_image_key():
    """data.imageKey on an adapter: its rollouts carry its rows' images (a text model's job refuses it at
    registration: test_adapter_runs_api.py)."""
    from kora_trainer.config.sections import AdapterRunConfig

    config = AdapterRunConfig.model_validate({"rank": 8, "data": {"path": "d.parquet", "imageKey": "image"}})
    assert config.data.image_key == "image"
