"""The lean-recipe fidelity script (experiments/lean_fidelity.py) in dry-run mode, and its pieces."""

import json

import pytest

from experiments import lean_fidelity


def test_docstring_text_is_offline_deterministic_and_sizeable():
    a = lean_fidelity.docstring_text(limit_bytes=200_000)
    assert a == lean_fidelity.docstring_text(limit_bytes=200_000) and len(a) == 200_000


def test_verdicts_use_the_seed_spread_or_one_percent():
    rows = [{"job": "j", "recipe": "fp32-masters", "values": [1.0, 1.001, 1.002], "mean": 1.001},
            {"job": "j", "recipe": "bf16-sr", "values": [1.01] * 3, "mean": 1.01},
            {"job": "j", "recipe": "plain-bf16", "values": [1.02] * 3, "mean": 1.02}]
    v = lean_fidelity.verdicts(rows)["j"]
    assert v["tolerance"] == pytest.approx(0.01001)   # 1% of the mean beats the 0.002 spread
    assert v["recipes"]["bf16-sr"]["within"] and not v["recipes"]["plain-bf16"]["within"]


def test_bad_arguments():
    with pytest.raises(SystemExit, match="unknown job"):
        lean_fidelity.main(["--jobs", "imagenet", "--out", "-"])
    with pytest.raises(SystemExit, match="fp32-masters recipe is the reference"):
        lean_fidelity.main(["--recipes", "bf16-sr", "--out", "-"])


@pytest.mark.slow
def test_dry_run_writes_every_job_and_recipe(tmp_path):
    out = tmp_path / "fidelity.json"
    lean_fidelity.main(["--dry-run", "--recipes", "fp32-masters,bf16-sr", "--out", str(out)])
    result = json.loads(out.read_text())
    assert {(r["job"], r["recipe"]) for r in result["rows"]} == {
        (j, r) for j in lean_fidelity.JOBS for r in ("fp32-masters", "bf16-sr")}
    assert all(len(r["values"]) == 3 for r in result["rows"])
    assert result["env"]["git_commit"]["sha"] and result["env"]["versions"]["jax"]
    assert "tail_update_over_ulp_median" in result["rows"][0]
