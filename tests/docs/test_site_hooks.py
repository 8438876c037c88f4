"""The site's build hooks (docs/_hooks/): code names that break only between their parts, and
the API pages' ``docs/<page>.md#anchor`` mentions as links."""

import importlib.util
import pathlib

import pytest

HOOKS = pathlib.Path(__file__).resolve().parents[2] / "docs" / "_hooks"


def _load(name):
    spec = importlib.util.spec_from_file_location(f"_site_hook_{name}", HOOKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_inline_code_breaks_after_dots_and_underscores_and_code_blocks_stay_whole():
    hook = _load("code_breaks")
    html = ('<p><code>jaxmp.flax.mixed_precision(model, &quot;O1&quot;)</code> and <code>[B, ...]</code></p>'
            '<pre><span></span><code>x = jaxmp.loss_scaling(tx)</code></pre>')
    out = hook.on_page_content(html, None, None, None)
    assert "<code>jaxmp.<wbr>flax.<wbr>mixed_<wbr>precision(<wbr>model, &quot;O1&quot;)</code>" in out
    assert "<code>[B, ...]</code>" in out  # no break inside an ellipsis or before a space
    assert "<code>x = jaxmp.loss_scaling(tx)</code></pre>" in out  # code blocks untouched


def test_api_docstrings_link_their_guide_mentions():
    pytest.importorskip("griffe")
    ext = _load("griffe_examples")
    text = "See docs/autocast.md#what-you-can-rely-on. Also docs/guides/flax-linen.md, and `docs/x.md`."
    out = ext._DOC_PATH.sub(ext._link, text)
    assert "[docs/autocast.md#what-you-can-rely-on](../autocast.md#what-you-can-rely-on)." in out
    assert "[docs/guides/flax-linen.md](../guides/flax-linen.md)," in out
    assert "`docs/x.md`" in out  # a code span stays code
