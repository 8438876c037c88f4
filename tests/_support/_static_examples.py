"""Static checks of example code (doc pages, docstrings) that cost no compilation.

Running every example is the slow tier's job (tests/docs/test_docs.py, test_doctests.py). The
default tier still catches the usual way an example rots, a renamed or removed name: each example
must parse, and every name it takes from this repository's packages must exist there.
"""

import ast
import importlib
import warnings

#: Top-level packages of this repository whose names an example's imports are checked against.
OWN_PACKAGES = ("jaxmp", "experiments", "benchmarks")


def _own(module: str | None) -> bool:
    return bool(module) and module.split(".")[0] in OWN_PACKAGES


def _resolve(dotted: str):
    """The object at ``dotted`` (a module path, then attributes); raises if any part is missing."""
    parts = dotted.split(".")
    obj = importlib.import_module(parts[0])
    for i, name in enumerate(parts[1:], start=1):
        try:
            obj = getattr(obj, name)
        except AttributeError:
            obj = importlib.import_module(".".join(parts[:i + 1]))
    return obj


def _chain(node: ast.AST) -> list[str] | None:
    """``a.b.c`` as ``["a", "b", "c"]``; None for anything that is not a plain attribute chain."""
    names = []
    while isinstance(node, ast.Attribute):
        names.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return [node.id, *reversed(names)]


def missing_names(source: str) -> list[str]:
    """The names ``source`` takes from this repository that do not exist.

    Checks ``import jaxmp.x``, ``from jaxmp.x import y`` and every attribute chain read off a
    name bound that way (``jaxmp.flax.linen.foo``), without running the code.

    Args:
      source: Python source (a page's blocks joined, or a docstring example's statements).

    Returns:
      The dotted names that fail to resolve, sorted; a syntax error is reported as one entry.
    """
    try:
        tree = ast.parse(source)
    except SyntaxError as err:
        return [f"SyntaxError: {err}"]
    bound: dict[str, str] = {}  # local name -> dotted path in an own package
    wanted: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if _own(a.name):
                    wanted.add(a.name)
                    if a.asname:
                        bound[a.asname] = a.name
                    else:
                        bound[a.name.split(".")[0]] = a.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and _own(node.module):
            for a in node.names:
                if a.name != "*":
                    wanted.add(f"{node.module}.{a.name}")
                    bound[a.asname or a.name] = f"{node.module}.{a.name}"
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and not isinstance(getattr(node, "ctx", None), ast.Store):
            chain = _chain(node)
            if chain and chain[0] in bound:
                wanted.add(".".join([bound[chain[0]], *chain[1:]]))
    missing = []
    for dotted in sorted(wanted):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # an old place warns; tests/cross/test_api_surface.py refuses those
            try:
                _resolve(dotted)
            except (ImportError, AttributeError):
                missing.append(dotted)
    return missing
