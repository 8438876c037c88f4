"""Reading the README's sections and their ```python blocks, for tests that execute the docs."""

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = ROOT / "README.md"


def section(heading: str, path: pathlib.Path = README) -> str:
    """The text under the level-2 heading ``## {heading}``, up to the next level-2 heading."""
    text = path.read_text()
    match = re.search(rf"^## {re.escape(heading)}\n(.*?)(?=^## |\Z)", text, flags=re.S | re.M)
    if match is None:
        raise AssertionError(f"{path.name} has no section '## {heading}'")
    return match.group(1)


def python_blocks(text: str) -> list[str]:
    """The bodies of the ```python fenced blocks in ``text``, in order."""
    return re.findall(r"```python\n(.*?)```", text, flags=re.S)
