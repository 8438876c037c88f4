"""The package's shape, checked on its source: no import cycle (jaxmp/ and benchmarks/), no
import up a layer, no ``_private`` name across units, the layering table of
docs/architecture.md regenerated from the import graph, no process-global mutable counters."""

import ast
import pathlib
import textwrap

from tests._support import _import_graph as graph_lib
import pytest
from tests._support._markdown import page

GRAPH = graph_lib.import_graph()


def _write(root: pathlib.Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))


def test_the_graph_reader_sees_every_kind_of_import(tmp_path):
    """Module-level, function-level, relative, ``from pkg import module`` and import_module
    literals are all edges; a cycle through any of them is found."""
    _write(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/a.py": "from pkg import b\n",
        "pkg/b.py": "def f():\n    from . import c\n",
        "pkg/c.py": "import importlib\nimportlib.import_module('pkg.a')\n",
        "pkg/d.py": "import pkg.a\nfrom pkg.a import something\n",
        "pkg/sub/__init__.py": "from ..d import x\n",
    })
    graph = graph_lib.import_graph(("pkg",), root=tmp_path)
    assert graph["pkg.a"] == {"pkg.b"} and graph["pkg.b"] == {"pkg.c"} and graph["pkg.c"] == {"pkg.a"}
    assert graph["pkg.d"] == {"pkg.a"} and graph["pkg.sub"] == {"pkg.d"}
    assert graph_lib.cycles(graph) == [["pkg.a", "pkg.b", "pkg.c"]]


def test_no_import_cycles_in_jaxmp_and_benchmarks():
    assert len(GRAPH) > 60 and any(m.startswith("benchmarks.") for m in GRAPH)
    # Lazy imports count: the interpreter dispatches to control_flow, api builds through the interpreter.
    assert "jaxmp.engine._control_flow" in GRAPH["jaxmp.engine._interpreter"]
    assert graph_lib.cycles(GRAPH) == []


def test_every_unit_has_a_layer_and_no_import_goes_up():
    units = {graph_lib.unit(m) for m in GRAPH} - {None}
    declared = {name for _, names in graph_lib.LAYERS for name in names}
    assert units == declared, f"units without a layer: {units - declared}; layers naming no unit: {declared - units}"
    assert graph_lib.layering_violations(GRAPH) == []


def test_flax_and_parallel_are_independent_siblings_over_the_step_builder():
    edges = graph_lib.unit_edges(GRAPH)
    assert "jaxmp.parallel" not in edges["jaxmp.flax"] and "jaxmp.flax" not in edges["jaxmp.parallel"]
    assert "jaxmp._step" in edges["jaxmp.flax"] and "jaxmp._step" in edges["jaxmp.parallel"]


def test_the_layering_check_catches_an_upward_arrow_and_private_names(tmp_path, monkeypatch):
    _write(tmp_path, {
        "jaxmp/__init__.py": "",
        "jaxmp/low.py": "from jaxmp import high\n",  # up a layer
        "jaxmp/high.py": "from jaxmp.low import _helper\nfrom jaxmp import low\nlow._secret\n",
        "jaxmp/sub/__init__.py": "",
        "jaxmp/sub/_impl.py": "",
        "jaxmp/sub/ok.py": "from jaxmp.sub._impl import y\n",  # private inside its own unit: fine
        "jaxmp/other.py": "from jaxmp.sub._impl import y\n",
    })
    monkeypatch.setattr(graph_lib, "LAYERS", (("low", ("jaxmp.low", "jaxmp.sub", "jaxmp.other")),
                                              ("high", ("jaxmp.high",))))
    graph = graph_lib.import_graph(("jaxmp",), root=tmp_path)
    problems = graph_lib.layering_violations(graph, root=tmp_path)
    assert "jaxmp.low (layer 0) imports jaxmp.high (layer 1), a higher layer" in problems
    assert "jaxmp.high imports private jaxmp.low: _helper" in problems
    assert "jaxmp.high reads private jaxmp.low._secret" in problems
    assert "jaxmp.other imports private jaxmp.sub._impl: (module)" in problems
    assert not [p for p in problems if p.startswith("jaxmp.sub.ok")]


def test_a_seam_exports_only_what_other_units_use(tmp_path):
    assert graph_lib.unused_seam_names() == {}
    _write(tmp_path, {
        "jaxmp/__init__.py": "",
        "jaxmp/sub/__init__.py": "",
        "jaxmp/sub/_impl.py": "x = y = 1\n",
        "jaxmp/sub/_seams.py": "from jaxmp.sub._impl import x, y\n__all__ = ['x', 'y']\n",
        "jaxmp/sub/inner.py": "from jaxmp.sub._seams import y\n",  # a use inside the unit does not count
        "jaxmp/other.py": "from jaxmp.sub._seams import x\n",
    })
    assert graph_lib.unused_seam_names(tmp_path) == {"jaxmp.sub._seams": ["y"]}


def test_the_layering_table_on_the_architecture_page_is_generated_from_the_graph():
    text = page("architecture.md").read_text()
    expected = graph_lib.page_with_table(text, graph_lib.layering_table(GRAPH))
    assert text == expected, "docs/architecture.md's layering table is stale: run `python tests/_support/_import_graph.py --write`"
    for _, names in graph_lib.LAYERS:
        for name in names:
            assert f"| `{name}` |" in text


# Module-level state that changes after import, allowed here and why. Anything else a module
# mutates (a module-level name rebound with `global`, updated in place through a mutating
# method or item assignment, or augmented) fails the test below: state that changes a result
# belongs to an object the caller holds (misuse keeps its evidence on the loss-scale object),
# never to the process.
ALLOWED_MODULE_STATE = {
    # A memo of a pure function: (class, rule) -> the generated casting subclass (the same
    # subclass each time, so NNX graph definitions stay equal).
    ("jaxmp/flax/nnx.py", "_CASTING_CLASSES"),
    # The traced programs shared by every autocast function built from one function object (so
    # jaxmp.autocast(f) rebuilt on each eager call does not retrace): keyed by the function's id,
    # each entry dropped by a weakref callback when the function goes, as jax.jit's cache is.
    ("jaxmp/engine/_build.py", "_SHARED"),
    # Warn once per model: keyed by the model object itself, held weakly.
    ("jaxmp/flax/nnx.py", "_WARNED_CALL"),
    # The Linen door's engine functions (so a module is traced once per input signature, as
    # jaxmp.autocast traces): keyed by the wrapper itself, held weakly.
    ("jaxmp/flax/linen.py", "_ENGINE_FNS"),
    # Warn once per trace that a float16 region is differentiated with no loss scale: keyed by
    # the JAX trace object, held weakly.
    ("jaxmp/engine/_unscaled.py", "_WATCHED"),
    # Log-once de-duplication of INFO messages; no result depends on it.
    ("jaxmp/parallel/_checks.py", "_LOGGED"),
    # Warn-once de-duplication, no result depends on it: a block recipe that runs emulated, once
    # per (recipe, device) (Linen re-resolves its rules on every clone, so no object lives long
    # enough to hold it); an autocast rule that matches nothing, once per (function, rule).
    ("jaxmp/fp8/_hardware.py", "_WARNED"),
    ("jaxmp/engine/_build.py", "_WARNED_SCOPES"),
    ("jaxmp/engine/_attention.py", "_LOGGED"),
    # The record of the last attention routing choice (read by tests and benchmarks).
    ("jaxmp/engine/_attention.py", "last_choice"),
    # The one owner of process-wide effects: what it patched (with the originals) and registered,
    # each once per process (docs/architecture.md#process-wide-effects).
    ("jaxmp/_effects.py", "_PATCHED"),
    ("jaxmp/_effects.py", "_REGISTERED"),
}
MUTATORS = {"add", "append", "extend", "insert", "update", "setdefault", "pop", "popitem", "clear", "discard",
            "remove", "__setitem__", "move_to_end"}


def _module_state(path: pathlib.Path) -> set[str]:
    """Module-level names the module changes after binding them: ``global`` rebinding, augmented
    assignment, item assignment or a mutating method call (``_SEEN.add(x)``), anywhere in it."""
    tree = ast.parse(path.read_text())
    names = set()
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
        names.update(t.id for t in targets if isinstance(t, ast.Name))
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Global):
            found.update(node.names)
        elif isinstance(node, ast.AugAssign) and isinstance(node.target, ast.Name) and node in tree.body:
            found.add(node.target.id)
        elif isinstance(node, (ast.Assign, ast.AugAssign)):
            for target in (node.targets if isinstance(node, ast.Assign) else [node.target]):
                if isinstance(target, ast.Subscript) and isinstance(target.value, ast.Name) and target.value.id in names:
                    found.add(target.value.id)
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in MUTATORS
              and isinstance(node.func.value, ast.Name) and node.func.value.id in names):
            found.add(node.func.value.id)
    return found - {"__all__"}


def test_no_process_global_mutable_state_beyond_the_documented_caches():
    root = graph_lib.ROOT
    found = {(p.relative_to(root).as_posix(), name) for p in sorted((root / "jaxmp").rglob("*.py"))
             for name in _module_state(p)}
    assert found - ALLOWED_MODULE_STATE == set(), "module-level mutable state: keep it on an object the caller holds"
    # misuse in particular: its evidence lives on the loss-scale object, nothing per process.
    assert not [n for f, n in found if f == "jaxmp/_misuse.py"]


@pytest.mark.parametrize("source,names", [
    ("_SEEN = set()\ndef f(x):\n    _SEEN.add(x)\n", {"_SEEN"}),
    ("COUNT = 0\nCOUNT += 1\n", {"COUNT"}),
    ("_N = 0\ndef bump():\n    global _N\n    _N += 1\n", {"_N"}),
    ("_C = {}\ndef f(k):\n    _C[k] = 1\n", {"_C"}),
    ("TABLE = {'a': 1}\nNAMES = ('a', 'b')\n__all__ = ['x']\ndef f(d):\n    d.update(TABLE)\n", set()),
])
def test_the_module_state_scan_finds_counters_and_containers(tmp_path, source, names):
    path = tmp_path / "m.py"
    path.write_text(source)
    assert _module_state(path) == names


def _private_reaches(package: pathlib.Path) -> list[str]:
    """``module: name`` for every ``_private`` name one module of ``package`` imports from, or reads
    off, a sibling module (``from pkg.sib import _x``, ``sib._x``); private *modules* whose public
    names are imported (``_checks.log_once``) are fine: the name is the contract."""
    siblings = {p.stem for p in package.glob("*.py")}
    dotted = "jaxmp." + package.name
    found = []
    for path in sorted(package.glob("*.py")):
        tree = ast.parse(path.read_text())
        aliases = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module:
                mod = node.module.rsplit(".", 1)
                if node.module.startswith(dotted + ".") and mod[-1] in siblings and mod[-1] != path.stem:
                    found += [f"{path.stem}: {mod[-1]}.{a.name}" for a in node.names
                              if a.name.startswith("_") and not a.name.startswith("__")]
                if node.module == dotted:
                    aliases.update({a.asname or a.name: a.name for a in node.names if a.name in siblings})
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases
                    and aliases[node.value.id] != path.stem and node.attr.startswith("_")
                    and not node.attr.startswith("__")):
                found.append(f"{path.stem}: {aliases[node.value.id]}.{node.attr}")
    return sorted(set(found))


def test_no_module_of_jaxmp_parallel_reaches_into_a_siblings_private_names(tmp_path):
    assert _private_reaches(graph_lib.ROOT / "jaxmp" / "parallel") == []
    _write(tmp_path, {"parallel/a.py": "_x = 1\nHELPER = 2\n",
                      "parallel/b.py": "from jaxmp.parallel.a import _x, HELPER\nfrom jaxmp.parallel import a\na._x\n",
                      "parallel/_c.py": "def ok(): pass\n",
                      "parallel/d.py": "from jaxmp.parallel._c import ok\n"})
    assert _private_reaches(tmp_path / "parallel") == ["b: a._x"]


# -- one jaxpr reader ------------------------------------------------------------------------
# jaxmp/_jaxpr.py is the only module that imports jax.extend.core or reads an equation's name
# stack, source info or bind parameters, or a jaxpr's equation list (`.eqns`); the engine's seam
# (jaxmp/engine/_internals.py) is the only other module that touches jax._src (trace state,
# config states). Everyone else, the engine's own modules and the tests included, goes through
# them: a JAX release that changes how jaxprs look is then two files to read.
READER = "jaxmp/_jaxpr.py"
SEAM = "jaxmp/engine/_internals.py"
READER_ONLY_ATTRIBUTES = {"eqns", "name_stack", "source_info", "get_bind_params", "jaxprs_in_params"}
SCANNED = ("jaxmp", "tests", "benchmarks", "experiments")


def _dotted(node) -> str:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
    return ".".join(reversed(parts))


def jaxpr_internals_used(source: str) -> set[str]:
    """What a module's source reaches of JAX's jaxpr internals: ``"jax.extend.core"``,
    ``"jax._src"`` (imported or reached as an attribute chain), ``".eqns"``, ``".name_stack"``,
    ``".source_info"``, ``".get_bind_params"``, ``".jaxprs_in_params"``."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level:
            names = [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Attribute):
            if node.attr in READER_ONLY_ATTRIBUTES:
                found.add(f".{node.attr}")
            names = [_dotted(node)]
        for name in names:
            for prefix in ("jax.extend.core", "jax._src"):
                if name == prefix or name.startswith(prefix + "."):
                    found.add(prefix)
    return found


def _python_files():
    for folder in SCANNED:
        for path in sorted((graph_lib.ROOT / folder).rglob("*.py")):
            yield path.relative_to(graph_lib.ROOT).as_posix(), path


#: Tests that call JAX's own private code as a peer reference (its result compared with jaxmp's),
#: reading no jaxpr: ``jax.nn.scaled_dot_general``'s MXFP8 quantizer has no public name.
PEER_REFERENCES = {"tests/formats/test_block_scaled.py": {"jax._src"}}


def test_jaxprs_are_read_through_the_one_reader_only():
    readers = {rel: used for rel, path in _python_files() if (used := jaxpr_internals_used(path.read_text()))
               and PEER_REFERENCES.get(rel) != used}
    assert set(readers) <= {READER, SEAM}, {k: v for k, v in readers.items() if k not in (READER, SEAM)}
    assert readers.get(SEAM, set()) == {"jax._src"}, readers.get(SEAM)  # trace state and config only
    assert "jax.extend.core" in readers[READER] and ".name_stack" in readers[READER]


@pytest.mark.parametrize("source, expected", [
    ("from jax.extend import core\n", {"jax.extend.core"}),
    ("from jax.extend.core import Literal\n", {"jax.extend.core"}),
    ("import jax\nx = jax.extend.core.ClosedJaxpr\n", {"jax.extend.core"}),
    ("import jax._src.lax as lax_pkg\n", {"jax._src"}),
    ("from jax._src import source_info_util\n", {"jax._src"}),
    ("def f(j):\n    return [e for e in j.eqns]\n", {".eqns"}),
    ("def f(e):\n    return str(e.source_info.name_stack).split('/')\n", {".source_info", ".name_stack"}),
    ("def f(e):\n    return e.primitive.get_bind_params(e.params)\n", {".get_bind_params"}),
    ("import jax\nfrom jaxmp import _jaxpr\ndef f(j):\n    return _jaxpr.equations(j)\n", set()),
])
def test_the_reader_check_sees_every_way_in(source, expected):
    assert jaxpr_internals_used(source) == expected
