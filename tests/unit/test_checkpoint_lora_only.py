"""LoRA-only checkpoints: atomic, verified, pruned, and a resumed run reproduces the uninterrupted one."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from kora_trainer.checkpoint import lora_only as ck


class TinyLoRA(torch.nn.Module):
    """A frozen base weight plus a trainable A/B pair, with dropout so RNG state matters."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.base = torch.nn.Parameter(torch.randn(8, 8, generator=g), requires_grad=False)
        self.lora_A = torch.nn.Parameter(torch.randn(2, 8, generator=g) * 0.1)
        self.lora_B = torch.nn.Parameter(torch.zeros(8, 2))
        self.drop = torch.nn.Dropout(0.3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.base.T + self.drop(x) @ self.lora_A.T @ self.lora_B.T


def make():
    torch.manual_seed(42)
    random.seed(42)
    model = TinyLoRA()
    opt = torch.optim.AdamW([model.lora_A, model.lora_B], lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    return model, opt, sched


def step(model, opt, sched) -> float:
    x = torch.randn(16, 8)
    noise = random.random()  # python RNG is part of the state too
    loss = ((model(x) - x * noise) ** 2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    sched.step()
    return loss.item()


def adapter(model):
    return {"lora_A": model.lora_A.detach().clone(), "lora_B": model.lora_B.detach().clone()}


def save(root, n, model, opt, sched, **kw):
    return ck.save(root, n, adapter=adapter(model), optimizer=opt.state_dict(), scheduler=sched.state_dict(),
                   meta={"data_position": n * 16}, **kw)


@pytest.mark.parametrize("dtype", [None, torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float32])
def test_resume_reproduces_the_uninterrupted_run(tmp_path: Path, dtype):
    """Whatever checkpoint.dtype the adapter file is written in (the fp32 adapter rounded to bf16, fp16 or fp8),
    the resumed run goes on exactly."""
    from safetensors import safe_open

    model, opt, sched = make()
    straight = [step(model, opt, sched) for _ in range(6)]
    final = adapter(model)

    model, opt, sched = make()
    first = [step(model, opt, sched) for _ in range(3)]
    held = adapter(model)
    path = save(tmp_path, 3, model, opt, sched, dtype=dtype)
    with safe_open(str(path / ck.ADAPTER), "pt") as f:  # the file a user reads is in checkpoint.dtype
        assert {f.get_tensor(k).dtype for k in f.keys()} == {dtype or torch.float32}  # noqa: SIM118
        if dtype not in (None, torch.float32):  # it rounded what the run held
            assert not torch.equal(f.get_tensor("lora_A").float(), held["lora_A"])
    for _ in range(2):  # the run goes on past the checkpoint, then dies: this work is lost
        step(model, opt, sched)

    model, opt, sched = make()  # a new process: fresh model from the base, then the checkpoint
    c = ck.load_latest(tmp_path)
    assert c is not None and c.step == 3 and c.meta["data_position"] == 48
    with torch.no_grad():
        model.lora_A.copy_(c.adapter["lora_A"])
        model.lora_B.copy_(c.adapter["lora_B"])
    opt.load_state_dict(c.optimizer)
    sched.load_state_dict(c.scheduler)
    ck.restore_rng(c.rng)
    resumed = first + [step(model, opt, sched) for _ in range(3)]
    assert resumed == straight  # exact, same seed on CPU
    assert all(torch.equal(adapter(model)[k], final[k]) for k in final)


def test_an_adapter_the_file_dtype_holds_exactly_keeps_no_second_copy(tmp_path: Path):
    """A bf16 adapter written as bf16 or fp32 loses nothing: the checkpoint holds it once, and loads as it was."""
    a = {"lora_A": (torch.randn(4, 8) * 0.1).to(torch.bfloat16), "lora_B": torch.randn(8, 4).to(torch.bfloat16)}
    for n, dtype in enumerate((torch.bfloat16, torch.float32), start=1):
        path = ck.save(tmp_path, n, adapter=a, optimizer={}, scheduler=None, dtype=dtype)
        state = torch.load(path / ck.TRAINER_STATE, weights_only=False)
        assert state[ck.EXACT] == {}
        loaded = ck.load_latest(tmp_path)
        assert loaded is not None and all(torch.equal(loaded.adapter[k].to(torch.bfloat16), a[k]) for k in a)
    rounded = ck.save(tmp_path, 3, adapter={k: v.float() + 1e-4 for k, v in a.items()}, optimizer={},
                      scheduler=None, dtype=torch.bfloat16)
    assert set(torch.load(rounded / ck.TRAINER_STATE, weights_only=False)[ck.EXACT]) == {"lora_A", "lora_B"}


def test_corrupted_checkpoint_is_refused_and_the_previous_good_one_used(tmp_path: Path):
    model, opt, sched = make()
    step(model, opt, sched)
    save(tmp_path, 1, model, opt, sched)
    step(model, opt, sched)
    newest = save(tmp_path, 2, model, opt, sched)
    blob = bytearray((newest / ck.ADAPTER).read_bytes())
    blob[-1] ^= 0xFF
    (newest / ck.ADAPTER).write_bytes(bytes(blob))
    c = ck.load_latest(tmp_path)
    assert c is not None and c.step == 1
    assert "adapter.safetensors fails its checksum" in c.skipped[0]


def test_half_written_checkpoint_is_never_loaded(tmp_path: Path):
    model, opt, sched = make()
    save(tmp_path, 1, model, opt, sched)
    torn = tmp_path / "step_00000002"  # a rename that happened without its manifest
    torn.mkdir()
    (torn / ck.ADAPTER).write_bytes(b"garbage")
    (tmp_path / ck.LATEST).write_text("step_00000002\n")
    c = ck.load_latest(tmp_path)
    assert c is not None and c.step == 1 and "half-written" in c.skipped[0]


def test_nothing_verifies_is_an_error_not_a_silent_fresh_start(tmp_path: Path):
    model, opt, sched = make()
    only = save(tmp_path, 1, model, opt, sched)
    (only / ck.TRAINER_STATE).write_bytes(b"x")
    with pytest.raises(ck.CheckpointError, match="no checkpoint under"):
        ck.load_latest(tmp_path)


def test_keep_prunes_old_checkpoints_and_stale_temp_dirs(tmp_path: Path):
    model, opt, sched = make()
    (tmp_path / ".step_00000009.tmp-dead").mkdir(parents=True)
    for n in range(1, 5):
        save(tmp_path, n, model, opt, sched, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_00000003", "step_00000004"]
    assert (tmp_path / "latest").read_text().strip() == "step_00000004"


def test_no_checkpoint_yet(tmp_path: Path):
    assert ck.load_latest(tmp_path / "none") is None


def test_lora_only_refuses_other_trainable_parameters():
    ck.check_lora_only(["model.layers.0.self_attn.q_proj.lora_A.weight", "x.lora_B.weight"])
    with pytest.raises(ck.CheckpointError, match=r"model\.norm\.weight"):
        ck.check_lora_only(["model.layers.0.self_attn.q_proj.lora_A.weight", "model.norm.weight"])


KILLED_WRITER = """
import sys, torch
from kora_trainer.checkpoint import lora_only as ck
for n in (1, 2):
    ck.save(sys.argv[1], n, adapter={"lora_A": torch.full((2, 2), float(n))}, optimizer={}, scheduler=None)
"""


@pytest.mark.parametrize("phase,left", [("files", ".step_00000002.tmp-"), ("renamed", "step_00000002")])
def test_a_writer_killed_inside_its_write_leaves_the_previous_checkpoint_newest(tmp_path: Path, phase, left):
    import os
    import signal
    import subprocess
    import sys

    from kora_trainer.checkpoint.faults import KILL_AT_ENV

    env = {**os.environ, KILL_AT_ENV: f"{phase}:2"}
    proc = subprocess.run([sys.executable, "-c", KILLED_WRITER, str(tmp_path)], env=env, capture_output=True)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()[-2000:]
    names = sorted(p.name for p in tmp_path.iterdir())
    assert any(n.startswith(left) for n in names) and (tmp_path / ck.LATEST).read_text() == "step_00000001\n", names
    c = ck.load_latest(tmp_path)
    assert c is not None and c.step == 1 and torch.equal(c.adapter["lora_A"], torch.full((2, 2), 1.0))
    model, opt, sched = make()
    save(tmp_path, 2, model, opt, sched)  # the resumed run writes step 2 again: the torn leftovers go
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_00000001", "step_00000002"]


def test_a_malformed_kill_at_fails_the_write_naming_the_variable(tmp_path: Path, monkeypatch):
    from kora_trainer.checkpoint.faults import KILL_AT_ENV

    monkeypatch.setenv(KILL_AT_ENV, "midway:1")
    model, opt, sched = make()
    with pytest.raises(ValueError, match=KILL_AT_ENV):
        save(tmp_path, 1, model, opt, sched)
    assert ck.load_latest(tmp_path) is None
