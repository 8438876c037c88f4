"""jaxmp/_dtypes.py: dtype names, checks, leaf predicates, casts and float32_backward."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxmp import _dtypes as dtypes
from jaxmp._dtypes import (accumulation_dtype, cast_floating, cast_to_full, cast_to_half, dtype_names, float32_backward,
                          float_dtype, half_dtype, is_floating_array, is_inexact_array, parse_dtype)

BF16, F16, F32 = np.dtype(jnp.bfloat16), np.dtype(np.float16), np.dtype(np.float32)


def test_parse_dtype_reads_jmps_names_case_and_space_insensitively():
    assert parse_dtype(" BF16 ") == BF16 and parse_dtype("fp16") == F16 and parse_dtype("full") == F32
    assert parse_dtype("half") == half_dtype() == F16  # float16 off TPU (the tests run on CPU)
    assert parse_dtype("f64") == np.float64
    assert "half" in dtype_names() and dtype_names() == sorted(dtype_names())
    for name in dtype_names():
        assert jnp.issubdtype(parse_dtype(name), jnp.floating), name
    with pytest.raises(ValueError, match=r"Unknown dtype name 'f8'.*'bf16'"):
        parse_dtype("f8")
    with pytest.raises(TypeError, match="dtype name must be a string, got _ScalarMeta"):
        parse_dtype(jnp.float32)


def test_float_dtype_takes_any_floating_spelling_and_names_the_value_when_refusing():
    assert float_dtype("bfloat16") == BF16 and float_dtype(jnp.float16) == F16 and float_dtype(np.dtype("f4")) == F32
    assert float_dtype("Half") == F16 and float_dtype(jnp.float8_e4m3fn) == np.dtype(jnp.float8_e4m3fn)
    assert dtypes.canonical_float_dtype is float_dtype
    with pytest.raises(TypeError, match="compute_dtype must be a floating dtype.*got None"):
        float_dtype(None, "compute_dtype")  # np.dtype(None) would be float64
    with pytest.raises(TypeError, match=r"got 'fast' \(names: \["):
        float_dtype("fast")
    with pytest.raises(TypeError, match="got int32"):
        float_dtype(jnp.int32)
    with pytest.raises(TypeError, match="got complex64"):
        float_dtype(jnp.complex64)
    with pytest.raises(TypeError, match="got bool"):
        float_dtype(bool)


@pytest.mark.parametrize("dtype,acc", [(jnp.float16, F32), (jnp.bfloat16, F32), (jnp.float8_e5m2, F32),
                                       (jnp.float32, F32), (np.float64, np.dtype(np.float64))])
def test_accumulation_dtype_is_at_least_float32(dtype, acc):
    assert accumulation_dtype(dtype) == acc


def test_leaf_predicates_tell_floating_from_complex_keys_float0_and_python_numbers():
    assert is_floating_array(jnp.ones(1, jnp.bfloat16)) and is_floating_array(np.float32(1.0))
    assert is_inexact_array(jnp.ones(1, jnp.complex64)) and not is_floating_array(jnp.ones(1, jnp.complex64))
    for leaf in (jnp.ones(1, jnp.int32), jnp.array([True]), jax.random.key(0), np.zeros((), jax.dtypes.float0),
                 1.0, None, "x"):
        assert not is_floating_array(leaf) and not is_inexact_array(leaf), leaf
    # Tracers count (jit, grad): the predicates run inside traced code.
    assert jax.jit(lambda x: jnp.float32(is_floating_array(x)))(jnp.ones(2)) == 1.0


def test_cast_floating_casts_only_floating_arrays_and_keeps_the_structure():
    key = jax.random.key(0)
    tree = {"f": jnp.ones(2), "b": jnp.ones(2, jnp.bfloat16), "i": jnp.ones(2, jnp.int32), "k": key,
            "c": jnp.ones(1, jnp.complex64), "py": 1.5, "none": None}
    out = cast_floating(tree, "f16")
    assert out["f"].dtype == F16 and out["b"].dtype == F16
    assert out["i"].dtype == jnp.int32 and out["k"] is key and out["c"].dtype == jnp.complex64
    assert out["py"] == 1.5 and out["none"] is None
    same = jnp.ones(2, jnp.float16)
    assert cast_floating({"x": same}, jnp.float16)["x"] is same  # no cast op for a leaf already there
    assert cast_to_full(out)["f"].dtype == F32 and cast_to_half(tree)["f"].dtype == half_dtype()
    with pytest.raises(TypeError, match="must be a floating dtype"):
        cast_floating(tree, jnp.int8)


def _logits(q, k):
    return jnp.einsum("qd,kd->qk", q, k, preferred_element_type=jnp.float32)


def test_float32_backward_keeps_the_forward_and_takes_float32_gradients_in_the_inputs_dtypes():
    q = jnp.linspace(-1, 1, 8, dtype=jnp.float32).reshape(2, 4).astype(jnp.bfloat16)
    k = jnp.linspace(1, 2, 12, dtype=jnp.float32).reshape(3, 4).astype(jnp.bfloat16)
    f = float32_backward(_logits)
    out = f(q, k)
    assert out.dtype == F32 and np.array_equal(out, _logits(q, k))
    gq, gk = jax.jit(jax.grad(lambda q, k: jnp.sum(f(q, k) ** 2), argnums=(0, 1)))(q, k)
    assert gq.dtype == BF16 and gk.dtype == BF16
    rq, rk = jax.jit(jax.grad(lambda q, k: jnp.sum(_logits(q, k) ** 2), argnums=(0, 1)))(q.astype(F32), k.astype(F32))
    np.testing.assert_allclose(np.asarray(gq, F32), np.asarray(rq.astype(jnp.bfloat16), F32))
    np.testing.assert_allclose(np.asarray(gk, F32), np.asarray(rk.astype(jnp.bfloat16), F32))


def test_float32_backward_gives_non_floating_arguments_no_gradient():
    def masked(x, mask):
        return jnp.where(mask, x, 0).astype(jnp.float32)

    x, mask = jnp.ones(3, jnp.float16), jnp.array([True, False, True])
    g = jax.grad(lambda x: jnp.sum(float32_backward(masked)(x, mask)))(x)
    assert g.dtype == F16 and g.tolist() == [1.0, 0.0, 1.0]
