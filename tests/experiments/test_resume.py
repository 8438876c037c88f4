"""SIGKILL a run while it writes a checkpoint and start it again in the same workdir: every
checkpoint it leaves (params, fp32 masters, optimizer moments, loss scale and counters,
BatchNorm statistics, step) is bitwise equal to the same step of an uninterrupted run. This is
the kill part of the fault drill with one kill (the full drill does 10)."""

import pytest

from experiments import drills


@pytest.mark.slow
def test_sigkill_mid_save_and_resume_is_bit_identical(tmp_path):
    row = drills.kill_drill(str(tmp_path), kills=1, seed=0)
    assert row["ok"], row
    assert "1 mid-save" in row["check"] and "resumed at steps [" in row["result"]
    resumed = int(row["result"].split("[")[1].split("]")[0])
    assert 0 < resumed < 300
