"""The version statements of the README and the docs come from one place: pyproject.toml."""

import re
import tomllib

from tests._support._markdown import DOCS, README, ROOT

PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def _floors() -> dict[str, str]:
    """Lower bound per package (core and extras), from ``name>=version`` requirements."""
    reqs = list(PYPROJECT["project"]["dependencies"])
    for extra in PYPROJECT["project"].get("optional-dependencies", {}).values():
        reqs += extra
    floors = {}
    for req in reqs:
        m = re.match(r"\s*([A-Za-z0-9_.-]+)(?:\[[^]]*\])?\s*>=\s*([0-9][0-9A-Za-z.]*)", req)
        if m:
            floors[m.group(1).lower()] = m.group(2)
    return floors


def _python_floor() -> str:
    m = re.fullmatch(r">=\s*(\d+\.\d+)", PYPROJECT["project"]["requires-python"].strip())
    assert m, f"requires-python is not a plain lower bound: {PYPROJECT['project']['requires-python']!r}"
    return m.group(1)


def _pages():
    return [README, *sorted(DOCS.rglob("*.md"))]


def test_pyproject_has_lower_bounds_and_no_upper_bound():
    reqs = PYPROJECT["project"]["dependencies"]
    assert not [r for r in reqs if "<" in r], f"upper bounds in pyproject.toml: {reqs}"
    assert {"jax", "flax", "optax"} <= set(_floors())


def test_python_version_statements_match_requires_python():
    floor, found = _python_floor(), []
    for page in _pages():
        for m in re.finditer(r"Python (?:>= ?)?(\d+\.\d+)(?: or newer|\+)?", page.read_text()):
            if "newer" in m.group(0) or ">=" in m.group(0):
                found.append((page.name, m.group(0)))
                assert m.group(1) == floor, f"{page.relative_to(ROOT)} says {m.group(0)!r}; pyproject.toml: >={floor}"
    assert found, "no page states the Python floor"


def test_package_floors_in_the_docs_match_pyproject():
    floors, found = _floors(), 0
    for page in _pages():
        text = page.read_text()
        for m in re.finditer(r"\b([A-Za-z][\w.-]*)\s*>=\s*([0-9][0-9A-Za-z.]*[0-9A-Za-z])", text):
            name = m.group(1).lower()
            if name in floors:
                found += 1
                assert m.group(2) == floors[name], \
                    f"{page.relative_to(ROOT)} says {m.group(0)!r}; pyproject.toml: {name}>={floors[name]}"
        # "tested with ... / run with ... / lower bounds ...: jax 0.10.2, flax 0.12.8": the CI floors.
        for line in re.findall(r"[^\n]*(?:tested with|run with|lower bounds)[^\n]*(?:\n[^\n]+){0,2}", text):
            for name, version in re.findall(r"\b(jax|flax|optax) (\d+\.\d+\.\d+)", line):
                found += 1
                assert version == floors[name], \
                    f"{page.relative_to(ROOT)} says it was tested with {name} {version}; pyproject.toml: {name}>={floors[name]}"
    assert found >= 3
