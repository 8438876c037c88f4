"""jaxmp/diagnostics/_format.py: dtype names, number formatting, wrapping and tables, each on its own."""

import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxmp.diagnostics._format import (fmt_count, fmt_pct, is_floating, is_low_precision, render_table, short_dtype,
                                       wrap)


def test_short_dtype_shortens_the_float_family_and_keeps_other_names():
    assert [short_dtype(d) for d in (jnp.float16, jnp.bfloat16, np.float32, "float64")] == ["f16", "bf16", "f32", "f64"]
    assert short_dtype(jnp.float8_e4m3fn) == "float8_e4m3fn" and short_dtype(np.int32) == "int32"


def test_low_precision_is_floating_and_narrower_than_32_bits_keys_included_as_not_floating():
    assert all(is_low_precision(d) for d in (jnp.float16, jnp.bfloat16, jnp.float8_e5m2))
    assert not any(is_low_precision(d) for d in (jnp.float32, jnp.int8, jnp.bool_, jnp.uint16))
    key = jax.random.key(0).dtype
    assert not is_floating(key) and not is_low_precision(key)


@pytest.mark.parametrize("x, text", [
    (0, "0"), (12, "12"), (999, "999"), (1234, "1.23k"), (1234567, "1.23M"), (-1234567, "-1.23M"),
    (2.5e9, "2.5G"), (0.5, "0.5"), (3e12, "3T"),
    # Values that round up across a prefix boundary take the larger prefix, not '1e+03k'.
    (999.9, "1k"), (999_999, "1M"), (999_950.0, "1M"), (-999_999, "-1M"), (999_499, "999k"),
])
def test_fmt_count_uses_si_prefixes_with_three_significant_digits(x, text):
    assert fmt_count(x) == text


def test_fmt_count_keeps_the_unit_and_passes_non_finite_through():
    assert fmt_count(2048, "B") == "2.05kB" and fmt_count(7, "B") == "7B"
    assert fmt_count(float("inf")) == "inf" and fmt_count(None) == "None"


def test_fmt_pct_never_shows_a_tiny_share_as_zero():
    assert fmt_pct(0.25) == "25.0%" and fmt_pct(0.0) == "0.0%" and fmt_pct(1.0) == "100.0%"
    assert fmt_pct(3.1e-5) == "0.0031%" and fmt_pct(-2e-4) == "-0.02%"
    assert fmt_pct(float("nan")) == "n/a" and fmt_pct(None) == "n/a"


def test_wrap_keeps_short_lines_indents_continuations_and_never_splits_a_long_word():
    assert wrap("short\n  also short", width=20) == "short\n  also short"
    out = wrap("  key: " + "aa " * 12, width=20, hang=2).split("\n")
    assert all(len(line) <= 20 for line in out) and out[0].startswith("  key:")
    assert all(line.startswith("    ") for line in out[1:])
    path = "x/" * 30
    assert [line.strip() for line in wrap("see " + path, width=20).split("\n")] == ["see", path]


def test_render_table_holds_every_cell_verbatim_with_no_trailing_blanks():
    text = render_table("Title", ["op", "dtype"], [["dot_general", "jaxmp[float32]"], ["exp", 3]], footer="end")
    for cell in ("Title", "op", "dtype", "dot_general", "jaxmp[float32]", "exp", "3", "end"):
        assert cell in text
    assert "\x1b[" not in text and all(line == line.rstrip() for line in text.split("\n"))


def test_render_table_without_rich_is_plain_aligned_columns(monkeypatch):
    monkeypatch.setitem(sys.modules, "rich.console", None)  # importing it now raises ImportError
    text = render_table("T", ["a", "bb"], [["xxx", "y"], ["z", "w"]], footer="f")
    assert text.split("\n") == ["T", "a    bb", "---  --", "xxx  y", "z    w", "f"]
