"""Every ``tests/...py`` path that the docs, the README, the code or CI name is a file that exists.

The tests live in folders that mirror the package (``tests/engine/test_rules.py``); a page or a
docstring that still names a file at an old place (the flat ``test_autocast_rules`` of old) sends the
reader nowhere, and ``.ci/run`` would fail on it late. Recorded results and the changelog keep the
paths of their time and are not read.
"""

import re

from tests._support._markdown import README, ROOT

MENTION = re.compile(r"(?<![\w.-])(tests/(?:\w+/)*\w+\.py)")


def _sources():
    roots = ["jaxmp", "tests", "benchmarks", "experiments", "docs", ".ci"]
    files = [README, ROOT / "pyproject.toml", ROOT / "mkdocs.yml"]
    files += [p for r in roots for p in (ROOT / r).rglob("*")
              if p.is_file() and (p.suffix in (".py", ".md", ".sh", ".yml", ".toml") or p.parent.name == ".ci")
              and "results" not in p.relative_to(ROOT).parts and "__pycache__" not in p.parts]
    return [f for f in files if f.is_file()]


def stale_mentions(text: str) -> list[str]:
    """The ``tests/...py`` paths named in ``text`` that are not files of this checkout."""
    return sorted({m for m in MENTION.findall(text) if not (ROOT / m).is_file()})


def test_every_named_test_file_exists():
    stale = {str(f.relative_to(ROOT)): s for f in _sources() if (s := stale_mentions(f.read_text(errors="replace")))}
    assert not stale, f"these name test files that do not exist (moved? see tests/*/): {stale}"


def test_the_check_sees_old_flat_paths_and_accepts_the_mirrored_ones():
    # The old paths are spelled in two pieces so that a script rewriting mentions leaves them alone.
    old_rules, old_graph = "tests/test_autocast_rules" + ".py", "tests/_import_graph" + ".py"
    assert stale_mentions(f"checked by `{old_rules}`") == [old_rules]
    assert stale_mentions(f"python {old_graph} --write") == [old_graph]
    assert stale_mentions("`tests/engine/test_rules.py`, python tests/_support/_import_graph.py --write") == []
    assert stale_mentions("mytests/test_x.py, a.tests/test_y.py") == []  # not a path from the root
