"""griffe extension: what the API pages need of a docstring written for ``help()``.

jaxmp's docstrings title their doctest section ``Example:``; griffe's Google parser reads the
singular as a free-text admonition (so ``>>>`` lines render as nested quotes) and only the
plural as code. Renaming the section here keeps the docstrings as they are.

They also point to the guides as ``docs/autocast.md#anchor`` (a path a reader of ``help()`` can
open in the repository); on the site those become links to the page (the API pages sit in
``docs/api/``, so ``../autocast.md#anchor``, which mkdocs checks and rewrites like any link).
"""

import re

import griffe

_SECTION = re.compile(r"^(\s*)Example:[ \t]*$", flags=re.M)
# docs/<page>.md[#anchor], not already inside a link or code span; a trailing period is prose.
_DOC_PATH = re.compile(r"(?<![\[(/`\w])docs/((?:[\w-]+/)*[\w-]+\.md)(#[\w-]+)?")


def _link(match: re.Match) -> str:
    page, anchor = match.group(1), match.group(2) or ""
    return f"[docs/{page}{anchor}](../{page}{anchor})"


class ExampleSections(griffe.Extension):
    def on_instance(self, *, obj, **kwargs):
        if obj.docstring is not None:
            value = _SECTION.sub(r"\1Examples:", obj.docstring.value)
            obj.docstring.value = _DOC_PATH.sub(_link, value)
