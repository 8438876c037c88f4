"""How the pages look: every line of a code block fits 88 characters, so nothing is cut off at
1280 px and a phone scrolls sideways only where a block must (the screenshots are the real check;
this is the proxy a test can hold)."""

import pytest
from tests._support._markdown import README, ROOT, fenced_blocks, pages

MAX = 88

#: Blocks that quote a program's printed output verbatim (tables rich draws at the terminal's
#: width): re-wrapping them would show output the program does not print. Keyed by page and the
#: block's first line.
VERBATIM_OUTPUT = {
    ("docs/diagnostics.md", "Matmuls and convolutions"):
        "diagnostics_example.py's printed report, as printed",
    ("docs/diagnostics.md", "resnet9, batch 128, O0:"):
        "python -m experiments.precision_reports's output, as printed",
}


def _too_long(path):
    name = str(path.relative_to(ROOT))
    out = []
    for info, body in fenced_blocks(path.read_text()):
        first = body.lstrip("\n").split("\n", 1)[0].strip()
        if info == "text" and (name, first) in VERBATIM_OUTPUT:
            continue
        out += [f"{name} ({info or 'plain'}): {len(line)} chars: {line[:60]}..."
                for line in body.splitlines() if len(line) > MAX]
    return out


@pytest.mark.parametrize("path", [README, *pages()], ids=lambda p: str(p.relative_to(ROOT)))
def test_code_block_lines_fit(path):
    long = _too_long(path)
    assert not long, f"code-block lines over {MAX} characters (reflow them):\n" + "\n".join(long)


def test_verbatim_exemptions_still_exist():
    # An exemption whose block is gone (or was reflowed) must be removed, not left to hide the next one.
    for (name, first), why in VERBATIM_OUTPUT.items():
        blocks = fenced_blocks((ROOT / name).read_text())
        assert any(b.lstrip("\n").split("\n", 1)[0].strip() == first for _, b in blocks), (name, first, why)
