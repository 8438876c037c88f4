"""SIGKILL a run while it writes a checkpoint and start it again in the same workdir: every
checkpoint it leaves (params, fp32 masters, optimizer moments, loss scale and counters,
BatchNorm statistics, step) is bitwise equal to the same step of an uninterrupted run. This is
the kill part of the fault drill with one kill (the full drill does 10 kills of a 300-step run;
one kill needs only a run with checkpoints on both sides of it: 60 steps, 6 checkpoints)."""

import pytest

from experiments import drills

STEPS = 60


@pytest.mark.slow
def test_sigkill_mid_save_and_resume_is_bit_identical(tmp_path):
    row = drills.kill_drill(str(tmp_path), kills=1, seed=0, steps=STEPS)
    assert row["ok"], row
    assert "1 mid-save" in row["check"] and "resumed at steps [" in row["result"]
    assert "6/6 checkpoints bitwise equal" in row["result"], row
    resumed = int(row["result"].split("[")[1].split("]")[0])
    assert 0 < resumed < STEPS


def test_kill_drill_refuses_a_run_length_without_checkpoints_on_both_sides_of_a_kill(tmp_path):
    with pytest.raises(ValueError, match="multiple of 10"):
        drills.kill_drill(str(tmp_path), kills=1, seed=0, steps=35)
