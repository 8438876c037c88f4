"""jaxmp/_formats/_elements.py: the two fp8 formats, their ranges, and the dtype and margin checks."""

import jax.numpy as jnp
import numpy as np
import pytest

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
