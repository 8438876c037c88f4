"""mkdocs hook: inline code may break after its dots, underscores, parentheses and commas only.

docs/stylesheets/extra.css keeps inline code from breaking anywhere (Material's default breaks
mid-identifier at a phone's width); this hook gives it the places where a break reads well, as
``<wbr>`` after ``.``, ``_``, ``(``, ``,`` and ``/``. Code blocks (``<pre>``) are left alone.
"""

import re

_PRE = re.compile(r"(<pre\b.*?</pre>)", flags=re.S)
_INLINE = re.compile(r"(<code\b[^>]*>)(.*?)(</code>)", flags=re.S)
_TEXT = re.compile(r"([^<]+)|(<[^>]*>)")
_AFTER = re.compile(r"([._(,/])(?=[^\s)\].,])")


def _breaks(code: str) -> str:
    # Only in text, never inside a tag or an entity (entities hold no . _ ( , /).
    return "".join(_AFTER.sub(r"\1<wbr>", t) if t else tag for t, tag in _TEXT.findall(code))


def on_page_content(html, page, config, files):
    parts = _PRE.split(html)
    for i in range(0, len(parts), 2):  # the even parts lie outside <pre> blocks
        parts[i] = _INLINE.sub(lambda m: m.group(1) + _breaks(m.group(2)) + m.group(3), parts[i])
    return "".join(parts)
