"""The README's Python examples run as written, in order, in one namespace."""

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def python_blocks(path):
    return re.findall(r"```python\n(.*?)```", path.read_text(), flags=re.S)


def test_readme_examples_run():
    blocks = python_blocks(ROOT / "README.md")
    assert len(blocks) >= 3
    namespace = {"__name__": "readme"}
    for i, block in enumerate(blocks):
        try:
            exec(compile(block, f"README.md block {i}", "exec"), namespace)
        except Exception as e:  # pragma: no cover - the message points at the failing block
            pytest.fail(f"README block {i} failed: {type(e).__name__}: {e}\n{block}")
