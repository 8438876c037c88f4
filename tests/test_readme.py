"""The README's core examples run as written, in order, in one namespace."""

import pytest
from _markdown import python_blocks, section


def test_readme_usage_examples_run():
    blocks = python_blocks(section("Usage"))
    assert len(blocks) >= 3
    namespace = {"__name__": "readme"}
    for i, block in enumerate(blocks):
        try:
            exec(compile(block, f"README Usage block {i}", "exec"), namespace)
        except Exception as e:  # pragma: no cover - the message points at the failing block
            pytest.fail(f"README Usage block {i} failed: {type(e).__name__}: {e}\n{block}")


def test_readme_diagnostics_example_runs(tmp_path, monkeypatch, capsys):
    blocks = python_blocks(section("Diagnostics"))
    assert len(blocks) == 1
    monkeypatch.chdir(tmp_path)
    code = blocks[0].replace("/tmp/gradient_stats.png", str(tmp_path / "g.png"))
    exec(compile(code, "README Diagnostics block", "exec"), {"__name__": "readme_diagnostics"})
    out = capsys.readouterr().out
    assert "precision:" in out and "100.0% low precision" in out and "suggested static scale 2^" in out
    assert (tmp_path / "g.png").stat().st_size > 10_000
