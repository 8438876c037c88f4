"""The main job's console output explains every line, its two progress counters agree, and a rerun
in the same workdir reports its own time next to the time the runs took (no training: the runs
are stubbed, so this is fast)."""

import json
import re

import pytest

from experiments import compare, train

pytest.importorskip("ml_collections")


def _fake_run(config, workdir, policy, seed, desc, report, isolated, *, reused, calls):
    calls.append(desc)
    return {"policy": policy, "seed": seed, "val_accuracy": 0.9, "steps": 10, "steps_per_s": 1.0,
            "examples_per_s": 1.0, "wall_time_s": 1.0, "skipped_steps": 0, "final_loss_scale": 1.0,
            "reused": reused}


def _run(monkeypatch, tmp_path, capsys, reused):
    from experiments.configs import cpu

    calls = []
    monkeypatch.setattr(compare, "_train", lambda *a, **k: _fake_run(*a, **k, reused=reused, calls=calls))
    monkeypatch.setattr(compare, "_write_outputs", lambda *a, **k: {"paths": {"table": "results.md"}})
    monkeypatch.setattr(train, "summary_line", lambda r: f"{r['policy']} seed {r['seed']}: summary")
    (tmp_path / "results.json").write_text(json.dumps({"meta": {"total_time_s": 41.25}}))
    config = cpu.get_config()
    config.progress_bar = False
    compare._compare_locked(config, str(tmp_path), ["O0", "O1"], 2, False, False, False, "cpu", True)
    return calls, capsys.readouterr().out


def test_the_per_run_counter_counts_the_runs_the_comparison_counter_counts(monkeypatch, tmp_path, capsys):
    calls, out = _run(monkeypatch, tmp_path, capsys, reused=False)
    assert [re.match(r"\[(\d+)/(\d+)\]", c).groups() for c in calls] == [(str(i), "5") for i in range(1, 6)]
    assert calls[-1] == "[5/5] loss-scale demo"


def test_the_loss_scale_demo_line_is_explained_before_it(monkeypatch, tmp_path, capsys):
    _, out = _run(monkeypatch, tmp_path, capsys, reused=False)
    lines = out.splitlines()
    i = next(k for k, line in enumerate(lines) if line.startswith("loss-scale demo: "))
    assert lines[i - 1].startswith("loss-scale demo (not in the table): O2-fp16 for 300 steps")
    assert "2**24" in lines[i - 1] and "every 50 finite steps" in lines[i - 1] and "loss_scale.png" in lines[i - 1]


def test_a_rerun_reports_its_own_time_and_the_time_the_runs_took(monkeypatch, tmp_path, capsys):
    _, first = _run(monkeypatch, tmp_path, capsys, reused=False)
    assert re.search(r"^Total \d+\.\d s\. Wrote results\.md", first, flags=re.M), first
    _, again = _run(monkeypatch, tmp_path, capsys, reused=True)
    assert re.search(r"^Total 41\.2 s when the runs were trained; this command read all 5 back in \d+\.\d s\.",
                     again, flags=re.M), again
    assert compare.total_line(41.25, 3.0, 2, 5) == "\nTotal 3.0 s (2 of 5 runs read back from an earlier command)."
