"""ruff's F rules over the repository, in the README's test command: an undefined name (the NNX
door's O0 ``NameError``) or a shadowing import fails here before any test reaches the line."""

import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_ruff_finds_no_undefined_name_unused_import_or_redefinition():
    pytest.importorskip("ruff", reason="the `test` extra installs ruff")
    trees = [t for t in ("jaxmp", "experiments", "benchmarks", "tests", ".ci") if (ROOT / t).exists()]
    done = subprocess.run([sys.executable, "-m", "ruff", "check", "--select", "F", "--output-format", "concise",
                           "--no-cache", *trees], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_ci_runs_the_static_checks_and_the_readme_says_how():
    ci = (ROOT / ".ci" / "run").read_text()
    assert "static_checks.py" in ci and '"$PY" -m pip install --quiet -e ".[' in ci
    readme = (ROOT / "README.md").read_text()
    assert "python .ci/static_checks.py" in readme
    baseline = (ROOT / ".ci" / "mypy-baseline.txt").read_text().split()[0]
    assert baseline.isdigit()
