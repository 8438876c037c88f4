"""jaxmp/_formats/_elements.py: the element table (every row held to its dtype), the fp8 formats, their ranges and the
dtype checks; the margin check (jaxmp/fp8/_recipes.py); lean's code-map table."""

import jax.numpy as jnp
import numpy as np
import pytest

from jaxmp import fp8
from jaxmp._formats import E4M3, E5M2, FP8_DTYPES, fp8_dtype, fp8_max
from jaxmp.fp8._recipes import check_margin


def test_the_formats_and_their_largest_values():
    assert FP8_DTYPES == (E4M3, E5M2) and E4M3 == jnp.float8_e4m3fn and E5M2 == jnp.float8_e5m2
    assert fp8_max(E4M3) == 448.0 and fp8_max("float8_e5m2") == 57344.0
    # The values are those of the formats themselves: one more step overflows / rounds back.
    assert float(jnp.float32(448.0).astype(E4M3)) == 448.0
    assert np.isnan(float(jnp.float32(480.0).astype(E4M3)))  # e4m3fn has no inf: past its range is NaN


def test_fp8_dtype_accepts_both_spellings_and_refuses_other_dtypes_naming_the_argument():
    assert fp8_dtype("float8_e4m3fn", "fwd_dtype") == E4M3 and fp8_dtype(jnp.float8_e5m2, "bwd_dtype") == E5M2
    with pytest.raises(ValueError, match="bwd_dtype must be an fp8 dtype .*got bfloat16"):
        fp8_dtype(jnp.bfloat16, "bwd_dtype")
    with pytest.raises(ValueError, match="got float8_e4m3fnuz"):
        fp8_dtype(jnp.float8_e4m3fnuz, "fwd_dtype")  # a third fp8 format the recipes do not use
    with pytest.raises(TypeError, match="fwd_dtype must be an fp8 dtype .*got 'fp8'"):
        fp8_dtype("fp8", "fwd_dtype")
    with pytest.raises(ValueError, match="dtype must be an fp8 dtype"):
        fp8_max(jnp.float16)


@pytest.mark.parametrize("good,value", [(0, 0.0), (2, 2.0), (0.5, 0.5), (np.float64(1.0), 1.0),
                                        (np.float32(1.0), 1.0), (np.int64(3), 3.0)])
def test_check_margin_accepts_finite_non_negative_numbers(good, value):
    out = check_margin(good)
    assert out == value and type(out) is float


@pytest.mark.parametrize("bad", [-1, -0.5, float("inf"), float("nan"), True, "1", None, [1]])
def test_check_margin_refuses_the_rest(bad):
    with pytest.raises(ValueError, match="margin must be a finite number >= 0"):
        check_margin(bad)


def test_the_element_table_holds_every_format_to_its_dtype_and_the_messages_read_it():
    from jaxmp import _formats

    assert [f.name for f in _formats.FORMATS] == ["E4M3", "E5M2", "E2M1", "E8M0"]
    for f in _formats.FORMATS:
        info = jnp.finfo(f.dtype)
        assert (f.max, f.emax, f.mbits) == (float(info.max), int(np.log2(float(info.max))), int(info.nmant)), f.name
        assert f.emin == int(info.minexp), f.name
    assert _formats.FP8_DTYPES == (_formats.E4M3, _formats.E5M2)
    assert tuple(_formats.ELEMENTS) == (_formats.E4M3, _formats.E5M2, _formats.E2M1)
    assert _formats.with_role(_formats.BLOCK_SCALE) == (_formats.E4M3, _formats.E8M0)
    # The quantizers read the table: NVFP4's per-tensor level is E4M3's max times E2M1's.
    assert _formats._block_scaled.NVFP4_GLOBAL == 448.0 * 6.0
    with pytest.raises(ValueError, match="float8_e4m3fn, float8_e5m2 or float4_e2m1fn, got float8_e8m0fnu"):
        _formats.element_format(_formats.E8M0)
    with pytest.raises(ValueError, match=r"fwd_dtype of a block-scaled recipe must be float8_e4m3fn, float8_e5m2 or "
                                         r"float4_e2m1fn, got bfloat16"):
        fp8.CurrentScaling(block=(1, 32), fwd_dtype=jnp.bfloat16)


def test_lean_code_maps_are_one_table_keyed_by_bits_and_sign():
    from jaxmp import _formats

    assert set(_formats.CODE_MAPS) == {(8, True), (8, False), (4, True), (4, False)} and _formats.CODE_BITS == (8, 4)
    for (bits, signed), table in _formats.CODE_MAPS.items():
        assert table.dtype == np.float32 and table.size == 2 ** bits and not table.flags.writeable
        assert np.all(np.diff(table) > 0) and table[-1] == 1 and (table[0] == -table[-2] if signed else table[0] >= 0)
        assert _formats.code_map(bits, signed) is table
