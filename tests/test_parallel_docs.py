"""The README's data-parallel section: its Python examples run on the 8 simulated devices, and its scaling table is
what benchmarks/scaling_model.py prints."""

import contextlib
import io
import pathlib
import re
import runpy

import pytest
from _markdown import python_blocks, section

ROOT = pathlib.Path(__file__).resolve().parents[1]
SECTION = "Data-parallel and multi-host training"


def test_parallel_doc_examples_run():
    blocks = python_blocks(section(SECTION))
    assert len(blocks) >= 3
    namespace = {"__name__": "parallel_doc"}
    for i, block in enumerate(blocks):
        try:
            with contextlib.redirect_stdout(io.StringIO()):
                exec(compile(block, f"README parallel block {i}", "exec"), namespace)
        except Exception as e:  # pragma: no cover - the message points at the failing block
            pytest.fail(f"README parallel block {i} failed: {type(e).__name__}: {e}\n{block}")


def test_scaling_table_in_docs_is_the_script_output():
    text = section(SECTION)
    command = "python benchmarks/scaling_model.py"
    assert f"`{command}` prints:" in text
    documented = re.search(r"`python benchmarks/scaling_model.py` prints:\n\n```text\n(.*?)```", text, flags=re.S).group(1)
    module = runpy.run_path(str(ROOT / "benchmarks" / "scaling_model.py"), run_name="scaling_model")
    with contextlib.redirect_stdout(io.StringIO()):
        printed = module["main"]([])
    assert documented.strip() == printed.strip()
    # The model's arithmetic on one row by hand: ResNet-50, 8 devices, fp32, no overlap.
    comm = 2 * 7 / 8 * 25.6e6 * 4 / 12.5e9 + 2 * 7 * 5e-6
    assert abs(module["efficiency"](0.268, comm, 0.0) - 0.268 / (0.268 + comm)) < 1e-12
    assert "94.9%" in printed and "not a measurement" in printed
