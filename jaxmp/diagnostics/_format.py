"""Rendering helpers shared by the diagnostics reports: tables and human-readable numbers.

rich is used when installed (imported lazily, so ``import jaxmp`` stays light); otherwise a
plain fixed-width table is produced. Both paths return a string, so callers can log it.
"""

from __future__ import annotations

import io
import math
import re
import textwrap
from typing import Sequence

import numpy as np

from jaxmp import _jaxpr

_SHORT_DTYPE = {
    "float16": "f16",
    "bfloat16": "bf16",
    "float32": "f32",
    "float64": "f64",
}


def short_dtype(dtype) -> str:
    """``float16`` -> ``f16``; fp8 and integer dtypes keep numpy's name."""
    name = np.dtype(dtype).name
    return _SHORT_DTYPE.get(name, name)


def is_low_precision(dtype) -> bool:
    """Floating dtypes narrower than 32 bits: float16, bfloat16 and the float8 family."""
    # bfloat16 / float8 are ml_dtypes extension types, not numpy "f" kinds, so ask jnp; PRNG
    # key dtypes have no numpy form at all, so they are tested before any np.dtype call.
    return is_floating(dtype) and np.dtype(dtype).itemsize < 4


def is_floating(dtype) -> bool:
    import jax
    import jax.numpy as jnp

    if jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
        return False
    return bool(jnp.issubdtype(dtype, jnp.floating))


def fmt_count(x: float, unit: str = "") -> str:
    """1234567 -> '1.23M' (SI prefixes, 3 significant digits)."""
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return str(x)
    # Rounded to 3 significant digits before the prefix is chosen: 999999 is '1M', not '1e+03k'.
    rounded = float(f"{x:.3g}")
    for factor, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(rounded) >= factor:
            return f"{x / factor:.3g}{prefix}{unit}"
    return f"{x:.3g}{unit}" if isinstance(x, float) else f"{x}{unit}"


def fmt_pct(x: float) -> str:
    """0.25 -> '25.0%'; tiny non-zero shares keep two significant digits ('0.0031%'), never '0.0%'."""
    if x is None or not math.isfinite(x):
        return "n/a"
    if 0 < abs(x) < 1e-3:
        return f"{100.0 * x:.2g}%"
    return f"{100.0 * x:.1f}%"


#: jaxmp's own scopes that say nothing about where the user's op is: the wrapper autocast puts
#: around the whole function and the per-op rule labels of explain mode (reports have a rule
#: column). Region markers (``jaxmp[float32]:head``) stay: they carry the user's label.
_OWN_SCOPE = re.compile(r"jaxmp\.rule=|jaxmp\[keep\]:autocast\(")


def user_path(stack) -> str:
    """A name stack as the user reads it: JAX's rendering without jaxmp's own wrapper scopes.

    Args:
      stack: a name stack as `jaxmp._jaxpr.StackItem`s.

    Returns:
      E.g. ``"transpose(jvp(CNN))/head"`` where JAX prints
      ``"transpose(jvp(jaxmp[keep]:autocast(O1)))/CNN/head/jaxmp.rule=half list"``.
    """
    return _jaxpr.render(tuple(i for i in stack if not (i.kind == "scope" and _OWN_SCOPE.match(i.name))))


#: The width reports wrap their prose to: a docs page shows 88 columns without scrolling.
WIDTH = 88


def wrap(text: str, width: int = WIDTH, hang: int = 4) -> str:
    """Wraps each line of ``text`` over ``width`` characters at spaces (words are never split).

    Continuation lines keep the line's indent plus ``hang`` spaces, so a wrapped field reads as
    one item. Paths and code longer than ``width`` stay whole on their own line.

    Args:
      text: the text, possibly several lines.
      width: the column limit.
      hang: extra indent of continuation lines.

    Returns:
      The wrapped text.
    """
    out = []
    for line in text.split("\n"):
        if len(line) <= width:
            out.append(line)
            continue
        indent = line[:len(line) - len(line.lstrip())]
        out.append(textwrap.fill(line.strip(), width, initial_indent=indent, subsequent_indent=indent + " " * hang,
                                 break_long_words=False, break_on_hyphens=False))
    return "\n".join(out)


def fold_path(path: str, width: int) -> str:
    """``path`` broken into lines of at most ``width`` at ``/`` (never inside a name).

    A table cell holding the result wraps at its line breaks, not mid-token; a single name
    longer than ``width`` stays whole on its line.

    Args:
      path: a module or parameter path, e.g. ``"ResNet/Block_0/Conv_1"``.
      width: the longest line wanted.

    Returns:
      The path with ``"\\n"`` after some of its ``/``.
    """
    parts = [p + "/" for p in path.split("/")]
    parts[-1] = parts[-1][:-1]
    lines = [""]
    for part in parts:
        if lines[-1] and len(lines[-1]) + len(part) > width:
            lines.append("")
        lines[-1] += part
    return "\n".join(lines)


def clip_left(text: str, width: int) -> str:
    """``text`` if it fits ``width`` characters, else ``"..."`` and its last characters.

    The end of a module path names the op's own module, so that is the part kept.

    Args:
      text: e.g. ``"jvp(Model)/Encoder_0/Attention_0/query"``.
      width: the longest result wanted (at least 4).

    Returns:
      E.g. ``".../Attention_0/query"``.
    """
    return text if len(text) <= width else "..." + text[len(text) - width + 3:]


def render_table(title: str, headers: Sequence[str], rows: Sequence[Sequence[str]],
                 footer: str | None = None, width: int = 160, compact: bool = False) -> str:
    """Returns a table as text: rich's box table if rich is installed, else plain columns.

    Args:
      title: the caption above the table.
      headers: column names.
      rows: cells, already formatted as strings.
      footer: optional line below the table.
      width: console width rich wraps to.
      compact: rich draws only the rule under the header, with two blanks between columns (as
        the plain table): a table of eight columns keeps room for its cells at 88 characters.

    Returns:
      The rendered table (no ANSI colour codes, so it is safe for log files).
    """
    rows = [[str(c) for c in r] for r in rows]
    try:
        from rich import box
        from rich.console import Console
        from rich.markup import escape
        from rich.table import Table
    except ImportError:
        return _plain_table(title, headers, rows, footer, width)
    # not compact: rich's own defaults (a heavy head, edges, one blank either side of a cell)
    table = Table(title=title, show_lines=False, title_justify="left",
                  box=box.SIMPLE_HEAD if compact else box.HEAVY_HEAD, show_edge=not compact,
                  pad_edge=not compact, padding=(0, 1, 0, 0) if compact else (0, 1))
    for h in headers:
        # fold: a cell longer than its column breaks (callers pre-break paths at "/", `fold_path`)
        table.add_column(h, overflow="fold")
    for r in rows:
        table.add_row(*[escape(c) for c in r])  # cells such as "jaxmp[float32]" are text, not markup
    buf = io.StringIO()
    # No colour and no terminal detection: the string must look the same in a log file.
    console = Console(file=buf, width=width, color_system=None, force_terminal=False, legacy_windows=False)
    console.print(table)
    if footer:
        console.print(wrap(footer, width), highlight=False, markup=False, soft_wrap=True)
    # rich pads the title to the table's width: trailing blanks are noise in a log or a page.
    return "\n".join(line.rstrip() for line in buf.getvalue().rstrip("\n").split("\n"))


def _plain_table(title, headers, rows, footer, width) -> str:
    widths = [len(h) for h in headers]
    for r in rows:
        for i, c in enumerate(r):
            widths[i] = max(widths[i], *map(len, c.split("\n")))
    line = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()
    out = [title, line(headers), line(["-" * w for w in widths])]
    for r in rows:  # a cell with line breaks (a folded path) takes several lines
        cells = [c.split("\n") for c in r]
        for k in range(max(len(c) for c in cells)):
            out.append(line([c[k] if k < len(c) else "" for c in cells]))
    if footer:
        out.append(wrap(footer, width))
    return "\n".join(out)
