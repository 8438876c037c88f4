"""tests/_support/_house_metrics.py: the rules behind docs/architecture.md#house-metrics, on a
small tree, and the numbers this tree holds at zero."""

import shutil
import textwrap

from tests._support import _house_metrics as metrics


def test_the_tree_keeps_layout_facts_on_records_and_lean_types_out_of_parallel():
    found = metrics.measure()
    assert found["string tests of layouts"] == 0
    assert found["parallel files naming a lean type"] == 0
    assert found["import cycles"] == 0 and found["upward imports"] == 0
    # Element formats are enumerated in the formats room, not in the fp8 recipes' checks.
    assert "jaxmp/_formats/_elements.py" in found["files touched to add an element format files"]
    assert "jaxmp/fp8/_recipes.py" not in found["files touched to add an element format files"]


def test_the_rules_count_enumerations_layout_tests_loose_ints_and_long_functions(tmp_path):
    (tmp_path / "tests" / "_support").mkdir(parents=True)
    shutil.copy(metrics.ROOT / "tests" / "_support" / "_import_graph.py", tmp_path / "tests" / "_support")
    files = {
        "jaxmp/__init__.py": "",
        "jaxmp/a.py": '''
            """A doc naming float8_e4m3fn and float8_e5m2 (a docstring: no enumeration)."""
            def f(layout, bits, block, a, b, c, d, e, g):
                if layout == "zero":
                    return g(bits=bits, block=block)
                raise ValueError("must be float8_e4m3fn or float8_e5m2")
            ''',
        "jaxmp/b.py": "def h():\n" + "".join(f"    x{i} = {i}\n" for i in range(61)),
        "jaxmp/c.py": "X = 1\n",  # a public module without __all__: X is public by accident
    }
    for rel, text in files.items():
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    monkey_layers = (("all", ("jaxmp.a", "jaxmp.b", "jaxmp.c")),)
    graph_file = tmp_path / "tests" / "_support" / "_import_graph.py"
    text = graph_file.read_text()
    start = text.index("LAYERS: tuple")
    end = text.index("\n)\n", start) + 3
    graph_file.write_text(text[:start] + f"LAYERS = {monkey_layers!r}\n" + text[end:])
    found = metrics.measure(tmp_path)
    assert found["files touched to add an element format files"] == ["jaxmp/a.py"]
    assert found["files touched to add a layout files"] == []  # one layout named: no enumeration
    assert found["string tests of layouts"] == 1
    assert found["loose bits, block sites"] == 2  # the definition and the call
    assert found["functions with >= 8 positional parameters"] == 1
    assert found["functions over 60 code lines"] == 1
    assert found["accidental public names"] == 3  # f, h and X: no __all__ in a, b or c
