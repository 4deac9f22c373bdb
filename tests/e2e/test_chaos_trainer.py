"""The trainer under faults, CI-sized (bench/chaos_trainer.py runs >= 20 trainer kills): one toy job with a checkpoint
every step and deployment.async false, ended in turn by the checkpoint writer SIGKILLing itself inside a write (then
the whole trainer SIGKILLed), one at a random moment of its steps, its engine dying mid-generate and mid-sync, its
engine hanging without dying mid-generate (SIGSTOP) and mid-sync (a wedged event loop inside the HTTP-path push),
and checkpoint.path's tmpfs filling up; then a last attempt runs to the end. A hang is noticed within
rollout.engineHangSeconds (chaoskit.HANG_S) plus a few seconds, not the calls' own 600 s / 300 s timeouts. Every
attempt resumes from exactly the checkpoint the disk says it must (never a torn one), every step any attempt ran has
the uninterrupted run's loss and reward, and the final adapter is the uninterrupted run's bit for bit
(tests/chaoskit.py checks it all)."""

from __future__ import annotations

import pytest

from chaoskit import HANG_S, NOTICE_SLACK_S, Chaos, steps_for

PLAN = ["write", "steps", "engine-generate", "engine-sync", "engine-hang-generate", "engine-hang-sync", "disk"]


@pytest.mark.slow
def test_kills_engine_deaths_and_hangs_and_a_full_disk_lose_nothing(toy_dir, tmp_path):
    result = Chaos(toy_dir, tmp_path, steps=steps_for(PLAN), seed=18).run(PLAN)
    figures = result.figures()
    print(figures)
    assert result.problems() == [], "\n".join(result.problems())
    assert figures["trainer_kills"] == 2 and figures["kills_during_checkpoint_write"] >= 1, figures
    assert figures["engine_kills_mid_generate"] == 1 and figures["engine_kills_mid_sync"] == 1
    assert figures["engine_notice_s_max"] < 30, figures  # seconds, not the group's 120 s timeout
    assert figures["disk_full_attempts"] == (1 if result.tmpfs else 0)
    assert figures["torn_loaded"] == 0 and figures["final_adapter_equal"]
    assert figures["killed_before_loading"] == 0  # no startup kill in this plan
    assert figures["resumes_from_verified_checkpoint"] == figures["attempts"] - figures["fresh_starts"]
    assert figures["engine_hangs_mid_generate"] == 1 and figures["engine_hangs_mid_sync"] == 1
    assert figures["engine_hang_notice_s_max"] < HANG_S + NOTICE_SLACK_S, figures
    engine = [a for a in result.attempts if a.fault.startswith("engine")]
    assert all("EngineLost" in a.message and "engine 0 (pid" in a.message for a in engine), [a.message for a in engine]
    hangs = {a.fault_at.rsplit(":", 1)[1]: a.message for a in engine if "hang" in a.fault}
    assert "stopped (SIGSTOP)" in hangs["stop"] and "generate" in hangs["stop"], hangs  # what it was doing
    assert "the first push of the policy" in hangs["wedge"] and "sleeping" in hangs["wedge"], hangs
    assert all("raise rollout.engineHangSeconds" in m for m in hangs.values()), hangs  # the fix if only slow
    disk = [a for a in result.attempts if a.fault == "disk"]
    assert all("no checkpoint" not in a.message and "ckpt" in a.message and "needs" in a.message for a in disk)
