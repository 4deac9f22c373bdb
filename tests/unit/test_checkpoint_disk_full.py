"""A checkpoint the disk has no room for: the write fails with an error naming what happened (ENOSPC / EFBIG,
the path, the bytes), nothing half-written stays behind, and the previous checkpoint is still the newest good one
(`latest` names it, load_latest loads it). Two real limits: a small tmpfs (the kernel's ENOSPC; needs root to
mount) and RLIMIT_FSIZE in a child process (EFBIG in the middle of a file; no privilege needed)."""

from __future__ import annotations

import json
import resource
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import torch

from kora_trainer.checkpoint import lora_only as ck
from tmpfskit import mounted_tmpfs

ADAPTER_NUMEL = 64 * 1024  # 256 KiB of fp32 per factor: a checkpoint of ~1.5 MiB with its optimizer moments


def state(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    adapter = {f"m.lora_{x}.weight": torch.randn(ADAPTER_NUMEL, generator=g) for x in "AB"}
    moments = {i: {"exp_avg": torch.randn(ADAPTER_NUMEL, generator=g), "exp_avg_sq": torch.rand(ADAPTER_NUMEL,
                                                                                                 generator=g)}
               for i in range(2)}
    return {"adapter": adapter, "optimizer": {"state": moments, "param_groups": [{"lr": 1e-3, "params": [0, 1]}]},
            "scheduler": None, "meta": {"data_position": step}}


def assert_previous_is_newest(root: Path, step: int) -> None:
    assert (root / "latest").read_text().strip() == ck.step_dir_name(step)
    assert sorted(p.name for p in root.iterdir() if p.name.startswith(".")) == []  # no temp dir, no pointer temp
    got = ck.load_latest(root)
    assert got is not None and got.step == step and got.skipped == []
    assert torch.equal(got.adapter["m.lora_A.weight"], state(step)["adapter"]["m.lora_A.weight"])


def test_a_full_tmpfs_refuses_the_checkpoint_and_keeps_the_previous_one(tmp_path):
    with mounted_tmpfs(tmp_path / "vol", "4M") as root:
        ck.save(root, 1, **state(1), keep=2)
        ck.save(root, 2, **state(2), keep=2)
        needed = sum(p.stat().st_size for p in (root / "step_00000002").iterdir())
        free = ck._free_bytes(root)
        assert free < needed, (free, needed)  # the third checkpoint cannot fit beside the two kept
        try:
            ck.save(root, 3, **state(3), keep=2)
        except ck.CheckpointWriteError as e:
            err = e
        else:
            raise AssertionError("a checkpoint larger than the free space was written")
        msg = str(err)
        assert err.errno == 28 and "ENOSPC" in msg and str(root) in msg and f"needs {needed}" in msg, msg
        assert f"{free} bytes free" in msg and f"still {root / 'step_00000002'}" in msg, msg
        assert "checkpoint.keep" in msg  # and the fix
        assert_previous_is_newest(root, 2)
        assert sorted(p.name for p in root.glob("step_*")) == ["step_00000001", "step_00000002"]


CHILD = textwrap.dedent("""
    import json, sys
    from pathlib import Path
    sys.path[:0] = {paths!r}
    from kora_trainer.checkpoint import lora_only as ck
    from test_checkpoint_disk_full import state
    root = Path({root!r})
    try:
        ck.save(root, 2, **state(2), keep=2)
    except ck.CheckpointWriteError as e:
        print(json.dumps({{"errno": e.errno, "message": str(e), "filename": e.filename}}))
""")


def test_a_file_size_limit_mid_write_keeps_the_previous_one(tmp_path):
    """RLIMIT_FSIZE below one file's size: os.write fails with EFBIG inside the adapter file, after part of
    the checkpoint is on disk (SIGXFSZ ignored, as a process that wants the error does)."""
    root = tmp_path / "ckpt"
    ck.save(root, 1, **state(1), keep=2)
    limit = 300 * 1024  # under the 512 KiB adapter file, above meta and manifest

    def limited() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    paths = [str(Path(__file__).parent), *sys.path]
    done = subprocess.run([sys.executable, "-c", CHILD.format(paths=paths, root=str(root))], capture_output=True,
                          text=True, timeout=120, preexec_fn=limited)
    assert done.returncode == 0 and done.stdout.strip(), done.stderr[-3000:]
    err = json.loads(done.stdout.strip().splitlines()[-1])
    assert err["errno"] == 27 and err["filename"].endswith("adapter.safetensors"), err
    msg = err["message"]
    assert "EFBIG" in msg and "writing " + str(root / ".step_00000002.tmp-") in msg, msg
    assert f"still {root / 'step_00000001'}" in msg, msg
    assert_previous_is_newest(root, 1)
    assert sorted(p.name for p in root.glob("step_*")) == ["step_00000001"]
