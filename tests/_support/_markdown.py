"""Executing the ```python blocks of the README and of every page under docs/.

The mechanism: a page's ```python blocks run in order, in one namespace, as the reader would
paste them into one interpreter session. A block whose first line starts with ``SKIP_MARKER``
(a comment the rendered page shows, followed by the reason) is not run: it is kept for blocks
that need a GPU, a cluster or a file the reader has and the tests do not.
"""

import contextlib
import io
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
SKIP_MARKER = "# not run by the tests:"


def section(heading: str, path: pathlib.Path = README) -> str:
    """The text under the level-2 heading ``## {heading}``, up to the next level-2 heading."""
    text = path.read_text()
    match = re.search(rf"^## {re.escape(heading)}\n(.*?)(?=^## |\Z)", text, flags=re.S | re.M)
    if match is None:
        raise AssertionError(f"{path.name} has no section '## {heading}'")
    return match.group(1)


def page(name: str) -> pathlib.Path:
    """The docs page ``docs/{name}`` (e.g. ``"guides/flax-linen.md"``); fails if it does not exist."""
    path = DOCS / name
    if not path.is_file():
        raise AssertionError(f"docs/{name} does not exist")
    return path


def pages() -> list[pathlib.Path]:
    """Every Markdown page of the documentation site, sorted."""
    return sorted(p for p in DOCS.rglob("*.md") if not any(part.startswith("_") for part in p.relative_to(DOCS).parts))


def python_blocks(text: str) -> list[str]:
    """The bodies of the ```python fenced blocks in ``text``, in order (skipped ones included)."""
    return re.findall(r"^```python\n(.*?)^```", text, flags=re.S | re.M)


def fenced_blocks(text: str) -> list[tuple[str, str]]:
    """``(info, body)`` of every fenced code block in ``text`` (any language), in order."""
    return [(m.group(2).strip(), m.group(3))
            for m in re.finditer(r"^(`{3,})([^\n`]*)\n(.*?)^\1[ \t]*$", text, flags=re.S | re.M)]


def is_skipped(block: str) -> bool:
    """Whether a block carries the visible not-run marker on its first line (with a reason)."""
    first = block.lstrip("\n").split("\n", 1)[0]
    return first.startswith(SKIP_MARKER)


def runnable_blocks(path: pathlib.Path) -> list[str]:
    """The ```python blocks of a page that the tests execute."""
    return [b for b in python_blocks(path.read_text()) if not is_skipped(b)]


def run_blocks(blocks: list[str], label: str, namespace: dict | None = None, quiet: bool = True) -> dict:
    """Executes ``blocks`` in order in one namespace and returns it.

    A failing block raises AssertionError naming ``label``, the block's index and its text.
    """
    namespace = {"__name__": "docs_page"} if namespace is None else namespace
    for i, block in enumerate(blocks):
        out = io.StringIO()
        try:
            with contextlib.redirect_stdout(out) if quiet else contextlib.nullcontext():
                exec(compile(block, f"{label} block {i}", "exec"), namespace)
        except Exception as e:
            raise AssertionError(f"{label} block {i} failed: {type(e).__name__}: {e}\n{block}") from e
        namespace.setdefault("__outputs__", []).append(out.getvalue())
    return namespace


def run_page(path: pathlib.Path, quiet: bool = True) -> dict:
    """Runs every runnable ```python block of a docs page in one namespace and returns it."""
    return run_blocks(runnable_blocks(path), str(path.relative_to(ROOT)), quiet=quiet)
