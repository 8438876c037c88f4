"""The API reference covers every public name of jaxmp, and the site builds with warnings as errors."""

import importlib
import pathlib
import re
import shutil
import subprocess
import sys
import time
import types

import pytest
from _markdown import DOCS, ROOT

import jaxmp

DIRECTIVE = re.compile(r"^::: ([\w.]+)", flags=re.M)


def public_names() -> list[str]:
    """``jaxmp.__all__`` when the package declares it, else the names of ``dir(jaxmp)`` without underscores."""
    names = getattr(jaxmp, "__all__", None)
    if names is None:  # implementation modules (jaxmp.policy, jaxmp.transform ...) are not API names
        names = [n for n in dir(jaxmp) if not n.startswith("_")
                 and (not isinstance(getattr(jaxmp, n), types.ModuleType) or n in ("flax", "parallel", "diagnostics"))]
    return sorted(names)


def _resolve(path: str):
    parts = path.split(".")
    obj = importlib.import_module(parts[0])
    for i, part in enumerate(parts[1:], start=1):
        # An attribute first: jaxmp.diagnostics.gradient_stats is the function, not its module.
        obj = getattr(obj, part) if hasattr(obj, part) else importlib.import_module(".".join(parts[: i + 1]))
    return obj


def documented() -> dict[str, object]:
    """Every ``::: path`` directive of docs/api/*.md, resolved to the object it renders."""
    paths = [m for f in sorted((DOCS / "api").glob("*.md")) for m in DIRECTIVE.findall(f.read_text())]
    assert paths, "docs/api has no mkdocstrings directives"
    return {p: _resolve(p) for p in paths}


def _covered(name: str, docs: dict[str, object]) -> bool:
    obj = getattr(jaxmp, name)
    if isinstance(obj, types.ModuleType):  # a subpackage: covered when its members are documented
        return any(p == obj.__name__ or p.startswith(obj.__name__ + ".") for p in docs)
    if f"jaxmp.{name}" in docs:
        return True
    try:
        return any(d is obj for d in docs.values())
    except Exception:
        return False


def test_api_reference_covers_every_public_name():
    docs = documented()
    missing = [n for n in public_names() if not _covered(n, docs)]
    assert not missing, f"names of jaxmp's public API with no '::: ...' entry under docs/api/: {missing}"


def test_public_names_fallback_matches_all():
    names = public_names()
    assert "loss_scaling" in names and "get_policy" in names
    assert not any(n.startswith("_") for n in names)


@pytest.mark.skipif(shutil.which("mkdocs") is None and importlib.util.find_spec("mkdocs") is None,
                    reason="mkdocs is not installed (pip install -e '.[docs]')")
def test_docs_build_strict(tmp_path):
    pytest.importorskip("mkdocstrings")
    site = tmp_path / "site"
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
                          cwd=ROOT, capture_output=True, text=True, env={**__import__("os").environ, "NO_MKDOCS_2_WARNING": "1"})
    elapsed = time.perf_counter() - start
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert elapsed < 120, f"docs build took {elapsed:.0f} s"
    html = "".join(p.read_text() for p in (site / "api").rglob("*.html"))
    for path in documented():
        assert f'id="{path}"' in html, f"{path} was not rendered in the API reference"
    assert (site / "recorded" / "cpu").is_dir()  # the recorded plots are published with the site
