"""griffe extension: read a Google-style ``Example:`` section as ``Examples:``.

jaxmp's docstrings title their doctest section ``Example:``; griffe's Google parser reads the
singular as a free-text admonition (so ``>>>`` lines render as nested quotes) and only the
plural as code. Renaming the section here keeps the docstrings as they are.
"""

import re

import griffe

_SECTION = re.compile(r"^(\s*)Example:[ \t]*$", flags=re.M)


class ExampleSections(griffe.Extension):
    def on_instance(self, *, obj, **kwargs):
        if obj.docstring is not None:
            obj.docstring.value = _SECTION.sub(r"\1Examples:", obj.docstring.value)
