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
from tests._support._markdown import DOCS, ROOT

import jaxmp

DIRECTIVE = re.compile(r"^::: ([\w.]+)", flags=re.M)


def public_names() -> list[str]:
    """``jaxmp.__all__`` when the package declares it, else the names of ``dir(jaxmp)`` without underscores."""
    names = getattr(jaxmp, "__all__", None)
    if names is None:  # implementation modules (jaxmp._precision._policy, jaxmp._scaling._transform ...) are not API names
        names = [n for n in dir(jaxmp) if not n.startswith("_")
                 and (not isinstance(getattr(jaxmp, n), types.ModuleType) or n in ("flax", "parallel", "diagnostics"))]
    return sorted(names)


def _is_module(path: str) -> bool:
    try:
        return importlib.util.find_spec(path) is not None
    except (ImportError, ValueError):
        return False


def _resolve(path: str):
    """The object ``::: path`` renders. As mkdocstrings (griffe) does, a module of that name wins over
    an attribute: ``jaxmp.diagnostics.precision_report`` is the module, not the re-exported function."""
    parts = path.split(".")
    obj = importlib.import_module(parts[0])
    for i, part in enumerate(parts[1:], start=1):
        prefix = ".".join(parts[: i + 1])
        obj = importlib.import_module(prefix) if isinstance(obj, types.ModuleType) and _is_module(prefix) \
            else getattr(obj, part)
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


def all_modules() -> list[types.ModuleType]:
    """jaxmp and every jaxmp module that declares ``__all__`` (subpackages and their modules, no private ones)."""
    import pkgutil

    found = [jaxmp]
    for info in pkgutil.walk_packages(jaxmp.__path__, "jaxmp."):
        if any(part.startswith("_") for part in info.name.split(".")):
            continue
        module = importlib.import_module(info.name)
        if hasattr(module, "__all__"):
            found.append(module)
    return found


def exported() -> dict[int, tuple[object, list[str]]]:
    """Every object named in any ``__all__`` (modules aside), keyed by identity, with its public names."""
    out: dict[int, tuple[object, list[str]]] = {}
    for module in all_modules():
        for name in module.__all__:
            obj = getattr(module, name)
            if isinstance(obj, types.ModuleType):
                continue
            out.setdefault(id(obj), (obj, []))[1].append(f"{module.__name__}.{name}")
    return out


def test_every_name_in_every_all_is_documented_exactly_once():
    """Each object in any ``__all__`` has exactly one ``::: path`` entry, under one of its public names."""
    paths = [m for f in sorted((DOCS / "api").glob("*.md")) for m in DIRECTIVE.findall(f.read_text())]
    ambiguous = [p for p in paths if isinstance(_resolve(p), types.ModuleType)
                 and not isinstance(getattr(_resolve(p.rsplit(".", 1)[0]), p.rsplit(".", 1)[1]), types.ModuleType)]
    assert not ambiguous, f"these entries render a whole module, not the re-exported object of that name: {ambiguous}"
    by_object: dict[int, list[str]] = {}
    for p in paths:
        by_object.setdefault(id(_resolve(p)), []).append(p)
    problems = []
    for key, (obj, names) in sorted(exported().items(), key=lambda kv: kv[1][1][0]):
        entries = by_object.get(key, [])
        if len(entries) != 1:
            problems.append(f"{names[0]}: {len(entries)} entries {entries}")
        elif entries[0] not in names and entries[0] != f"{getattr(obj, '__module__', '')}.{getattr(obj, '__qualname__', '')}":
            # A public name, or the defining location (needed where a module shadows the function of its name).
            problems.append(f"{names[0]}: documented only as {entries[0]}, which is no name in any __all__ ({names})")
        else:
            top = [n for n in names if n.count(".") == 1]  # its jaxmp.* name, the one users meet first
            if top and entries[0].rsplit(".", 1)[1] != top[0].rsplit(".", 1)[1]:
                problems.append(f"{top[0]}: documented only under another name, {entries[0]}")
    assert not problems, "API reference entries, each should be 1:\n" + "\n".join(problems)


def test_public_names_fallback_matches_all():
    names = public_names()
    assert "loss_scaling" in names and "get_policy" in names
    assert not any(n.startswith("_") for n in names)


@pytest.mark.skipif(shutil.which("mkdocs") is None and importlib.util.find_spec("mkdocs") is None,
                    reason="mkdocs is not installed (pip install -e '.[docs]')")
@pytest.mark.slow
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
    # Each entry renders the object it names: a '::: pkg.name' whose target griffe resolves to a module of
    # that name (jaxmp.precision_report -> jaxmp.diagnostics.precision_report) renders the whole module again.
    kinds = {path: kind for kind, path in re.findall(r'<div class="doc doc-object doc-(\w+)">\s*<h[2-6] id="(jaxmp\.[\w.]+)"', html)}
    for path, obj in documented().items():
        assert path in kinds, f"'::: {path}' rendered no object heading"
        assert (kinds[path] == "module") == isinstance(obj, types.ModuleType), \
            f"'::: {path}' rendered a {kinds[path]}, but the name is a {type(obj).__name__}"
    assert (site / "recorded" / "cpu").is_dir()  # the recorded plots are published with the site
    # Cross-references render as links: no Sphinx role reaches a page as raw text.
    raw = {f"{page.relative_to(site)}: {m}" for page in site.rglob("*.html")
           for m in SPHINX_ROLE.findall(re.sub(r"<[^>]+>", "", page.read_text()))}
    assert not raw, f"raw Sphinx roles in the built site (use [`name`][jaxmp.path] or `name`): {sorted(raw)[:20]}"
    # Parameter types are the signatures' annotations: no parameter reads plain "Any" but forwarded ``**kwargs``.
    typed_any = [f"{page.relative_to(site)}: {name}" for page in (site / "api").rglob("*.html")
                 for name, kind in PARAM_ROW.findall(page.read_text())
                 if re.sub(r"<[^>]+>", "", kind).strip() == "Any" and not name.startswith("**")]
    assert not typed_any, f"parameters typed Any in the API reference (annotate the signature): {typed_any[:20]}"
    links = len(re.findall(r'<a class="autorefs autorefs-internal"', html))
    assert links > 100, f"only {links} cross-reference links in the API reference"


#: A row of a rendered parameter table: the parameter's name and its type cell.
PARAM_ROW = re.compile(r'<tr class="doc-section-item">\s*<td>\s*<code>(.*?)</code>\s*</td>\s*<td>(.*?)</td>', re.S)

#: A Sphinx role as it shows when mkdocstrings leaves it alone (the backquotes become <code>).
SPHINX_ROLE = re.compile(r":(?:class|func|meth|mod|attr|exc|data|obj):(?:`[^`]*`|[\w.~]+)")


def _docstrings(path: pathlib.Path):
    """(line, text) of every docstring griffe renders: module/class/function docstrings and the string
    after an assignment (an attribute docstring)."""
    import ast

    for node in ast.walk(ast.parse(path.read_text())):
        body = getattr(node, "body", None)
        if not isinstance(body, list):
            continue
        for i, stmt in enumerate(body):
            if (isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant) and isinstance(stmt.value.value, str)
                    and (i == 0 or isinstance(body[i - 1], (ast.Assign, ast.AnnAssign)))):
                yield stmt.lineno, stmt.value.value


def test_docstrings_use_markdown_cross_references():
    # The API reference is Markdown (mkdocstrings): a Sphinx role would show as raw ':class:`x`' text.
    found = [f"{path.relative_to(ROOT)}:{line}: {m}" for path in sorted((ROOT / "jaxmp").rglob("*.py"))
             for line, text in _docstrings(path) for m in SPHINX_ROLE.findall(text)]
    assert not found, "Sphinx roles in docstrings; write [`name`][jaxmp.path] (or `name` for a target the API " \
                      "reference does not render):\n" + "\n".join(found[:30])
