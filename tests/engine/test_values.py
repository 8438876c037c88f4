"""jaxmp/engine/_values.py: the dtype helpers the interpreter and the control-flow handlers share."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxmp.engine._values import Val, dtype_of, is_complex, is_float, lost_in, np_dtype, saturate, widest

F16, BF16, F32 = np.dtype("float16"), np.dtype(jnp.bfloat16), np.dtype("float32")


def test_is_float_is_real_floating_only_and_never_raises():
    assert all(is_float(d) for d in (F16, BF16, F32, jnp.float8_e4m3fn, "float64"))
    assert not any(is_float(d) for d in (np.int32, np.bool_, np.complex64, jax.random.key(0).dtype, None, [1]))
    assert is_complex(np.complex64) and not is_complex(F32) and not is_complex(None) and not is_complex({})


def test_dtype_of_reads_arrays_tracers_scalars_and_keys():
    assert dtype_of(jnp.ones(2, BF16)) == BF16 and dtype_of(3) == np.asarray(3).dtype and dtype_of(2.0) == np.float64
    assert jax.jit(lambda x: jnp.zeros(()) if dtype_of(x) == F16 else jnp.ones(()))(jnp.ones(1, F16)) == 0
    key = jax.random.key(0)
    assert dtype_of(key) == key.dtype and np_dtype(key.dtype) == key.dtype and np_dtype("bfloat16") == BF16


@pytest.mark.parametrize("make", [np.asarray, jnp.asarray])
def test_saturate_clips_finite_values_and_keeps_inf_and_nan(make):
    x = make(np.array([1e6, -1e6, 1.5, np.inf, -np.inf, np.nan], np.float32))
    out = np.asarray(saturate(x, F16), np.float32)
    assert out.dtype == np.float32 and saturate(x, F16).dtype == F16
    np.testing.assert_array_equal(out[:3], [65504.0, -65504.0, 1.5])
    assert out[3] == np.inf and out[4] == -np.inf and np.isnan(out[5])


def test_lost_in_flags_constants_beyond_the_range_or_below_the_smallest_normal():
    assert lost_in(1e5, F16) and lost_in(-1e5, F16) and lost_in(1e-8, F16) and lost_in(1e-8, BF16) is False
    assert not lost_in(1.0, F16) and not lost_in(0.0, F16) and not lost_in(float("inf"), F16)
    assert not lost_in(np.array([1.0, -3e38], np.float32), BF16) and lost_in(np.array([np.finfo(np.float32).min]), BF16)
    assert lost_in(np.array([1.0, np.finfo(np.float32).min], np.float32), F16)
    assert lost_in(jnp.float32(1e-8), F16) and not lost_in(np.float16(1e-5), F16)  # not wider than the target
    assert not lost_in(np.full(65, 1e5, np.float32), F16)  # a large array is data, not a constant
    assert jax.jit(lambda x: jnp.float32(lost_in(x, F16)))(jnp.float32(1e5)) == 0  # a tracer has no value


def test_widest_and_val_defaults():
    assert widest([F16, F32]) == F32 and widest([BF16, BF16]) == BF16 and widest([F16, BF16]) == F32
    assert Val(1.0) == (1.0, False, False, False)
