"""The experiments' model trained through jaxmp.autocast (engine="autocast"): it reaches O0's
accuracy on the main job's dataset, as the Flax path does. CI size: O1-fp16 only, one seed, 250 steps
(the recorded 3-seed run in experiments/recorded/cpu_autocast covers O1, O2-bf16 and O2-fp16)."""

import json
import os
import subprocess
import sys

import pytest


pytestmark = pytest.mark.slow  # end-to-end: run by .ci/run and `pytest -m slow`
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_autocast_engine_trains_to_o0_accuracy(tmp_path):
    cmd = [sys.executable, "-m", "experiments.compare", "--config=experiments/configs/cpu.py",
           f"--workdir={tmp_path}", "--policies=O0,O1-fp16", "--seeds=1", "--config.num_epochs=2",
           "--config.progress_bar=false", "--config.engine=autocast", "--noscale_demo"]
    out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = {r["policy"]: r for r in json.loads((tmp_path / "results.json").read_text())["rows"]}
    o0 = rows["O0"]["val_accuracy"]
    assert o0 >= 0.85, rows
    for p in ("O1-fp16",):
        assert abs(rows[p]["val_accuracy"] - o0) <= 0.015, (p, rows[p]["val_accuracy"], o0)
    assert rows["O1-fp16"]["loss_scaling"] == "dynamic" and rows["O1-fp16"]["skipped_steps"] == 0
