"""The house metrics of docs/architecture.md#house-metrics, measured on a checkout's source with ``ast``.

    python tests/_support/_house_metrics.py                        # this tree
    python tests/_support/_house_metrics.py --root DIR             # another checkout of jaxmp
    python tests/_support/_house_metrics.py --before DIR --mypy    # the table: DIR (before) against this tree
    python tests/_support/_house_metrics.py --list                 # also the files behind each "add a ..." row

Every number is a rule over jaxmp/'s code (docstrings left out), so an older commit is measured
the same way (``git worktree add --detach /tmp/before <commit>``):

- *files touched to add a lean recipe / element format / door / layout*: the files of jaxmp/ that
  enumerate the kind, plus the new instance's own module. A file enumerates a kind when one
  display (tuple, list, set, dict), one string (an error message) or one comparison in its code
  names two or more instances of it: a new instance is one more entry there.
- *loose bits, block sites*: definitions with both a ``bits`` and a ``block`` parameter, and calls
  passing both.
- *parallel files naming a lean type*: files of jaxmp/parallel/ naming a class defined in jaxmp/lean/.
- *string tests of layouts*: comparisons (``==``, ``!=``, ``in``) with a layout's name as a string.
- *functions over 60 code lines* (blank, comment and docstring lines left out) and *functions with
  8 or more positional parameters* (``self``/``cls`` left out), nested functions counted too.
- *accidental public names*: top-level public names (defs, classes, assignments, ``from`` imports)
  of a public module with no ``__all__``.
- *import graph*: arrows between units, floors (layers), cycles and upward imports, by the
  checkout's own tests/_support/_import_graph.py.
- *mypy findings* (``--mypy``, slow): ``python -m mypy jaxmp`` in the checkout, error lines.
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import pathlib
import re
import subprocess
import sys
import tempfile
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parent.parent.parent

#: The instances of each kind and the spellings that name them in code. A layout is named by its
#: string only (``"zero"``); the others by identifiers or words of strings (error messages).
KINDS: dict[str, dict[str, set[str]]] = {
    "lean recipe": {"bf16_moments": {"bf16_moments"}, "bf16_params": {"bf16_params"},
                    "param_remainders": {"param_remainders"}, "quantized_moments": {"quantized_moments"}},
    "element format": {"E4M3": {"E4M3", "_E4M3", "float8_e4m3fn"}, "E5M2": {"E5M2", "_E5M2", "float8_e5m2"},
                       "E2M1": {"E2M1", "_E2M1", "float4_e2m1fn"}, "E8M0": {"E8M0", "_E8M0", "float8_e8m0fnu"}},
    "door": {"linen": {"linen", "Linen"}, "nnx": {"nnx", "NNX"}},
    "layout": {"replicated": {"replicated"}, "zero": {"zero"}, "fsdp": {"fsdp"}},
}
STRING_ONLY = {"layout"}
LONG = 60
MANY_POSITIONAL = 8


def _docstrings(tree: ast.AST) -> set[int]:
    """ids of the docstring nodes of a module, its classes and functions."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
                out.add(id(first.value))
    return out


def _tokens(tree: ast.AST) -> tuple[set[str], set[str]]:
    """``(identifiers, words of strings)`` of the code (docstrings left out)."""
    docs = _docstrings(tree)
    names, words = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            names.add(node.id)
        elif isinstance(node, ast.Attribute):
            names.add(node.attr)
        elif isinstance(node, ast.alias):
            names.update(node.name.split("."))
            if node.asname:
                names.add(node.asname)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.update(node.module.split("."))
        elif isinstance(node, ast.keyword) and node.arg:
            names.add(node.arg)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs:
            words.update(re.findall(r"\w+", node.value))
    return names, words


def _enumerates(tree: ast.AST, instances: dict[str, set[str]], strings_only: bool) -> bool:
    """Whether one display, string or comparison of ``tree``'s code names two or more ``instances``."""
    docs = _docstrings(tree)
    for node in ast.walk(tree):
        if isinstance(node, (ast.Tuple, ast.List, ast.Set, ast.Dict, ast.Compare)):
            names, words = _tokens(node)
            seen = words if strings_only else names | words
            if strings_only:  # a layout is named by a whole string
                seen = {n.value for n in ast.walk(node) if isinstance(n, ast.Constant) and isinstance(n.value, str)}
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs and not strings_only:
            seen = set(re.findall(r"\w+", node.value))
        else:
            continue
        if sum(1 for spellings in instances.values() if spellings & seen) >= 2:
            return True
    return False


def _code_lines(node: ast.AST, lines: list[str], docs: set[int]) -> int:
    doc_lines: set[int] = set()
    for child in ast.walk(node):
        if id(child) in docs:
            doc_lines.update(range(child.lineno, child.end_lineno + 1))  # type: ignore[attr-defined]
    return sum(1 for i in range(node.lineno, node.end_lineno + 1)  # type: ignore[attr-defined]
               if i not in doc_lines and lines[i - 1].strip() and not lines[i - 1].strip().startswith("#"))


def _load_graph(root: pathlib.Path) -> Any:
    """The checkout's own tests/_support/_import_graph.py (its LAYERS are that commit's)."""
    spec = importlib.util.spec_from_file_location(f"_import_graph_{abs(hash(str(root)))}",
                                                  root / "tests" / "_support" / "_import_graph.py")
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def measure(root: pathlib.Path = ROOT, mypy: bool = False) -> dict[str, Any]:
    """The house metrics of the checkout at ``root``.

    Args:
      root: a checkout of jaxmp (the folder holding jaxmp/ and tests/).
      mypy: also run mypy over its jaxmp/ (slow).

    Returns:
      ``{metric: number}``, and ``{metric + " files": [paths]}`` for the file counts.

    Example:
      >>> from tests._support import _house_metrics
      >>> _house_metrics.measure()["import cycles"]
      0
    """
    root = pathlib.Path(root).resolve()
    files = sorted((root / "jaxmp").rglob("*.py"))
    trees = {p.relative_to(root).as_posix(): ast.parse(p.read_text(), str(p)) for p in files}
    texts = {p.relative_to(root).as_posix(): p.read_text().splitlines() for p in files}
    lean_classes = {n.name for rel, t in trees.items() if rel.startswith("jaxmp/lean/")
                    for n in ast.walk(t) if isinstance(n, ast.ClassDef)}
    out: dict[str, Any] = {}
    enumerating: dict[str, list[str]] = {kind: [] for kind in KINDS}
    loose = layout_tests = long_fns = many_pos = accidental = 0
    parallel_lean: list[str] = []
    layout_names = set(KINDS["layout"])
    for rel, tree in trees.items():
        for kind, instances in KINDS.items():
            if _enumerates(tree, instances, kind in STRING_ONLY):
                enumerating[kind].append(rel)
        names, _ = _tokens(tree)
        if rel.startswith("jaxmp/parallel/") and names & lean_classes:
            parallel_lean.append(rel)
        docs = _docstrings(tree)
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                params = [a.arg for a in node.args.posonlyargs + node.args.args]
                if {"bits", "block"} <= set(params + [a.arg for a in node.args.kwonlyargs]):
                    loose += 1
                if len([p for p in params if p not in ("self", "cls")]) >= MANY_POSITIONAL:
                    many_pos += 1
                if _code_lines(node, texts[rel], docs) > LONG:
                    long_fns += 1
            elif isinstance(node, ast.Call):
                passed = {a.id for a in node.args if isinstance(a, ast.Name)} | {k.arg for k in node.keywords if k.arg}
                if {"bits", "block"} <= passed:
                    loose += 1
            elif isinstance(node, ast.Compare):
                sides = [node.left, *node.comparators]
                consts = [c for s in sides for c in ([s] if isinstance(s, ast.Constant) else
                                                     getattr(s, "elts", []) if isinstance(s, (ast.Tuple, ast.Set, ast.List)) else [])]
                if any(isinstance(c, ast.Constant) and c.value in layout_names for c in consts):
                    layout_tests += 1
        parts = rel.removesuffix(".py").split("/")
        public = not any(p.startswith("_") and p != "__init__" for p in parts)
        if public and not any(isinstance(n, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in n.targets)
                              for n in tree.body):
            for n in tree.body:
                if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    bound = [n.name]
                elif isinstance(n, ast.Assign):
                    bound = [t.id for t in n.targets if isinstance(t, ast.Name)]
                elif isinstance(n, ast.ImportFrom) and n.module != "__future__":
                    bound = [a.asname or a.name for a in n.names]
                else:
                    bound = []
                accidental += sum(1 for b in bound if not b.startswith("_"))
    for kind, found in enumerating.items():
        name = f"files touched to add {'an' if kind[0] in 'aeiou' else 'a'} {kind}"
        out[name] = len(found) + 1
        out[f"{name} files"] = found
    out["loose bits, block sites"] = loose
    out["parallel files naming a lean type"] = len(parallel_lean)
    out["parallel files naming a lean type files"] = parallel_lean
    out["string tests of layouts"] = layout_tests
    out[f"functions over {LONG} code lines"] = long_fns
    out[f"functions with >= {MANY_POSITIONAL} positional parameters"] = many_pos
    out["accidental public names"] = accidental
    graph_lib = _load_graph(root)
    graph = graph_lib.import_graph(("jaxmp", "benchmarks"), root)
    edges = graph_lib.unit_edges(graph)
    out["import graph: units"] = len(edges)
    out["import graph: arrows between units"] = sum(len(v) for v in edges.values())
    out["import graph: floors"] = len(graph_lib.LAYERS)
    out["import cycles"] = len(graph_lib.cycles(graph))
    out["upward imports"] = sum(1 for p in graph_lib.layering_violations(graph, root) if "a higher layer" in p)
    if mypy:
        with tempfile.TemporaryDirectory() as cache:
            done = subprocess.run([sys.executable, "-m", "mypy", "--cache-dir", cache, "jaxmp"], cwd=root,
                                  capture_output=True, text=True)
        out["mypy findings"] = sum(1 for line in done.stdout.splitlines() if re.match(r"\S+\.py:\d+: error:", line))
    return out


def table(before: dict[str, Any], after: dict[str, Any]) -> str:
    """A markdown table of the numbers of two `measure` results."""
    rows = ["| metric | before | after |", "|---|---|---|"]
    rows += [f"| {k} | {before.get(k, '-')} | {after[k]} |" for k in after if not k.endswith(" files")]
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--root", type=pathlib.Path, default=ROOT, help="the checkout to measure (default: this one)")
    parser.add_argument("--before", type=pathlib.Path, help="another checkout: print the before/after table")
    parser.add_argument("--mypy", action="store_true", help="also count mypy's findings (slow)")
    parser.add_argument("--list", action="store_true", help="also list the files behind the file counts")
    args = parser.parse_args(argv)
    after = measure(args.root, args.mypy)
    if args.before is not None:
        before = measure(args.before, args.mypy)
        print(table(before, after))
    else:
        for k, v in after.items():
            if not k.endswith(" files"):
                print(f"{k}: {v}")
    if args.list:
        for k, v in after.items():
            if k.endswith(" files"):
                print(f"{k.removesuffix(' files')}: {', '.join(v) or '(none)'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
