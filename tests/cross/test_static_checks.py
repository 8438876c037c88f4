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



def test_no_line_is_longer_than_the_projects_line_length():
    """ruff's E501 at pyproject.toml's ``line-length``, as .ci/static_checks.py runs it."""
    pytest.importorskip("ruff", reason="the `test` extra installs ruff")
    import tomllib

    length = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["ruff"]["line-length"]
    assert length == 140
    trees = [t for t in ("jaxmp", "experiments", "benchmarks", "tests", ".ci") if (ROOT / t).exists()]
    done = subprocess.run([sys.executable, "-m", "ruff", "check", "--select", "E501", "--output-format", "concise",
                           "--no-cache", *trees], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert '"E501"' in (ROOT / ".ci" / "static_checks.py").read_text()  # the CI's static checks run it too

def test_the_ci_runs_the_static_checks_and_the_readme_says_how():
    ci = (ROOT / ".ci" / "run").read_text()
    assert "static_checks.py" in ci and '"$PY" -m pip install --quiet -e ".[' in ci
    readme = (ROOT / "README.md").read_text()
    assert "python .ci/static_checks.py" in readme
    baseline = (ROOT / ".ci" / "mypy-baseline.txt").read_text().split()[0]
    assert baseline.isdigit()


def _static_checks():
    import importlib.util

    spec = importlib.util.spec_from_file_location("static_checks", ROOT / ".ci" / "static_checks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_mypy_ratchet_holds_name_defined_at_zero_whatever_the_total():
    """An undefined name fails the ratchet on its own, even far under the baseline; other
    categories only count toward the total."""
    checks = _static_checks()
    undefined = 'jaxmp/x.py:3: error: Name "policy" is not defined  [name-defined]'
    other = 'jaxmp/y.py:7: error: Item "None" of "Any | None" has no attribute "x"  [union-attr]'
    ok, lines = checks.judge([undefined, other], allowed=76)
    assert not ok and undefined in lines and any("held at 0" in line for line in lines)
    assert checks.judge([other, other], allowed=76)[0]  # under the baseline, no zero category: passes
    assert not checks.judge([other] * 3, allowed=2)[0]  # over the baseline: fails
    assert checks.judge([], allowed=0)[0]
    # The code is read from the end of the line, not from the message text.
    assert checks.judge(['jaxmp/z.py:1: error: Argument 1 has type "name-defined"  [arg-type]'], allowed=1)[0]
