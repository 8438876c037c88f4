"""How the pages look: every line of a code block fits 88 characters, so nothing is cut off at
1280 px and a phone scrolls sideways only where a block must (the screenshots are the real check;
this is the proxy a test can hold). The docstring examples under jaxmp/ are held to the same
88 characters: the API pages render them as code blocks too.

"A code block" is what a renderer draws as one, not what a regex takes for one: each page is
rendered the two ways readers meet it, by Python-Markdown with the site's extensions from
mkdocs.yml (admonitions, superfences at any indent, snippets pulled in from other files) and by
a CommonMark parser as GitHub shows the file, and every line of every ``<pre>`` block either
renderer produces is measured: fenced blocks at any indent, indented blocks, blocks inside lists
and admonitions, console and pycon blocks alike. Tables and prose are not code blocks (the
browser wraps them) and are not measured.
"""

import ast
import doctest
import html
import re

import pytest
from tests._support._markdown import README, ROOT, pages
from markdown_it import MarkdownIt

MAX = 88

#: Blocks that quote a program's printed output verbatim and may pass 88 characters (re-wrapping
#: them would show output the program does not print), keyed by page and the block's first line.
#: None today: the diagnostics reports print 88 columns (docs/diagnostics.md's two blocks).
VERBATIM_OUTPUT: dict[tuple[str, str], str] = {}


def commonmark_blocks(text: str) -> list[str]:
    """The code blocks GitHub draws for ``text`` (CommonMark: fenced at any indent, indented)."""
    return [t.content for t in MarkdownIt("commonmark").parse(text) if t.type in ("fence", "code_block")]


def _site_extensions():
    """The markdown_extensions of mkdocs.yml as Python-Markdown's (names, configs)."""
    yaml = pytest.importorskip("yaml", reason="reading mkdocs.yml needs the docs extra")
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    names, configs = [], {}
    for ext in config["markdown_extensions"]:
        name, options = next(iter(ext.items())) if isinstance(ext, dict) else (ext, {})
        names.append(name)
        configs[name] = dict(options or {})
    # Unhighlighted output keeps each code line one text line; snippets resolve from the root.
    configs.setdefault("pymdownx.highlight", {})["use_pygments"] = False
    if "pymdownx.snippets" in configs:
        configs["pymdownx.snippets"]["base_path"] = [str(ROOT)]
    return names, configs


def site_blocks(text: str) -> list[str]:
    """The code blocks the mkdocs site draws for ``text`` (snippets included)."""
    markdown = pytest.importorskip("markdown", reason="rendering the site needs the docs extra")
    pytest.importorskip("pymdownx", reason="rendering the site needs the docs extra")
    names, configs = _site_extensions()
    out = markdown.Markdown(extensions=names, extension_configs=configs).convert(text)
    return [html.unescape(m.group(1))
            for m in re.finditer(r"<pre[^>]*>\s*<code[^>]*>(.*?)</code>\s*</pre>", out, flags=re.S)]


def _first_line(block: str) -> str:
    return block.lstrip("\n").split("\n", 1)[0].strip()


def too_long(name: str, blocks: list[str], where: str) -> list[str]:
    """``name (where): N chars: ...`` for each line over MAX in ``blocks`` outside the exemptions."""
    return [f"{name} ({where}): {len(line)} chars: {line[:60]}..."
            for block in blocks if (name, _first_line(block)) not in VERBATIM_OUTPUT
            for line in block.splitlines() if len(line) > MAX]


PATHS = [README, *pages()]


@pytest.mark.parametrize("path", PATHS, ids=lambda p: str(p.relative_to(ROOT)))
def test_code_block_lines_fit_on_github(path):
    name = str(path.relative_to(ROOT))
    long = too_long(name, commonmark_blocks(path.read_text()), "as GitHub shows it")
    assert not long, f"code-block lines over {MAX} characters (reflow them):\n" + "\n".join(long)


@pytest.mark.parametrize("path", PATHS, ids=lambda p: str(p.relative_to(ROOT)))
def test_code_block_lines_fit_on_the_site(path):
    name = str(path.relative_to(ROOT))
    long = too_long(name, site_blocks(path.read_text()), "as the site draws it")
    assert not long, f"code-block lines over {MAX} characters (reflow them):\n" + "\n".join(long)


@pytest.mark.parametrize("render", [commonmark_blocks, site_blocks], ids=["github", "site"])
def test_every_kind_of_code_block_is_measured(render):
    # The blocks the first version of this test (fenced at column 0 only) missed.
    wide = "x" * (MAX + 1)
    samples = {
        "indented": f"Text.\n\n    {wide}\n",
        "fenced in a list": f"1. Step:\n\n    ```console\n    $ {wide}\n    ```\n",
        "pycon": f"```pycon\n>>> {wide}\n```\n",
        "tilde fence": f"~~~\n{wide}\n~~~\n",
    }
    if render is site_blocks:
        samples["in an admonition"] = f'!!! note\n\n    ```python\n    {wide}\n    ```\n'
    for kind, text in samples.items():
        assert too_long("sample.md", render(text), kind), kind
    # Prose and table rows are wrapped by the browser: not code, not measured.
    assert not too_long("sample.md", render(f"{wide} prose\n\n| a | b |\n|---|---|\n| {wide} | 1 |\n"), "prose")


def test_verbatim_exemptions_still_exist():
    # An exemption whose block is gone (or was reflowed) must be removed, not left to hide the next one.
    for (name, first), why in VERBATIM_OUTPUT.items():
        blocks = commonmark_blocks((ROOT / name).read_text())
        assert any(_first_line(b) == first and any(len(x) > MAX for x in b.splitlines()) for b in blocks), (
            name, first, why)


# Docstring examples: the API pages (mkdocstrings, Google style) render each ``Example:`` section
# as a code block with the section's indentation removed, so a line is measured from its prompt.
_PROMPT = re.compile(r"^(>>>|\.\.\.)( |$)")
_DOCUMENTED = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)


def docstring_example_lines(source: str) -> list[tuple[int, str]]:
    """``(line number, line)`` of each ``>>>``/``...`` line, and each line of expected output, of
    the module's, the classes' and the functions' docstrings in ``source``, the example's
    indentation stripped (other strings
    and comments are not docstrings and are not read)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, _DOCUMENTED) and node.body and isinstance(node.body[0], ast.Expr)):
            continue
        doc = node.body[0].value
        if isinstance(doc, ast.Constant) and isinstance(doc.value, str):
            for offset, line in enumerate(doc.value.splitlines()):
                if _PROMPT.match(line.lstrip()):
                    found.append((doc.lineno + offset, line.lstrip()))
            # The expected output is shown in the same code block (doctest's own parse of it).
            for ex in doctest.DocTestParser().get_examples(doc.value):
                first = doc.lineno + ex.lineno + len(ex.source.splitlines())
                found += [(first + k, line) for k, line in enumerate(ex.want.splitlines())]
    return sorted(found)


def too_long_examples(name: str, source: str) -> list[str]:
    """``name:LINE: N chars: ...`` for each docstring example line over MAX in ``source``."""
    return [f"{name}:{lineno}: {len(line)} chars: {line[:60]}..."
            for lineno, line in docstring_example_lines(source) if len(line) > MAX]


MODULES = sorted((ROOT / "jaxmp").rglob("*.py"))


def test_docstring_example_lines_fit_on_the_api_pages():
    assert len(MODULES) > 50  # the walk sees the package
    long = [msg for path in MODULES
            for msg in too_long_examples(str(path.relative_to(ROOT)), path.read_text())]
    assert not long, (f"docstring example lines over {MAX} characters (split the call over "
                      "'... ' lines, put a trailing comment on its own line):\n" + "\n".join(long))


def test_every_docstring_example_line_is_measured():
    wide = "x" * MAX
    source = f'''"""Module.

    >>> {wide}
    """


def f():
    """Function.

    Example:
      >>> g(1,
      ...   {wide})
    """
    note = f"... {wide} not a docstring"  # >>> {wide} a comment


class C:
    """Class.

        >>> {wide}
    """

    async def m(self):
        """Method: prose with ... {wide} inside is not an example.

        Example:
          >>> {wide}
        """
'''
    long = too_long_examples("sample.py", source)
    # Module, function (its continuation line), class and method: each named by line and length.
    assert [m.split(": ")[0:2] for m in long] == [
        ["sample.py:3", f"{MAX + 4} chars"], ["sample.py:12", f"{MAX + 7} chars"],
        ["sample.py:20", f"{MAX + 4} chars"], ["sample.py:27", f"{MAX + 4} chars"]], long
    # Expected output is in the same code block: measured too.
    out = too_long_examples("sample.py", f'def f():\n    """\n    >>> f()\n    {wide}y\n    """\n')
    assert [m.split(": ")[0:2] for m in out] == [["sample.py:4", f"{MAX + 1} chars"]], out
    # The indentation is not counted: a line of exactly MAX from its prompt passes.
    assert not too_long_examples("sample.py", f'def f():\n    """\n    >>> {"x" * (MAX - 4)}\n    """\n')
