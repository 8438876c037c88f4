"""jaxmp/engine/_regions.py: region, float32_region, half_inputs and accumulate, each on its own."""

import jax.numpy as jnp
import numpy as np
import pytest

import jaxmp
from jaxmp.engine._regions import accumulate, float32_region, half_inputs, region
from tests._support._op_dtypes import op_dtypes

F32, BF16, F16 = np.dtype(np.float32), np.dtype(jnp.bfloat16), np.dtype(np.float16)
X = jnp.ones((2, 4), jnp.float32)


def _dot_dtypes(fn, *args):
    return [op.in_dtypes for op in op_dtypes(fn, *args) if op.primitive == "dot_general"]


def test_a_region_sets_its_ops_dtype_under_autocast_and_nothing_outside():
    @region("float32")
    def f32(x):
        return x @ x.T

    @region(jnp.float16)
    def f16(x):
        return x @ x.T

    assert _dot_dtypes(jaxmp.autocast(f32, "O1-bf16"), X) == [(F32, F32)]
    assert _dot_dtypes(jaxmp.autocast(f16, "O1-bf16"), X) == [(F16, F16)]
    assert _dot_dtypes(jaxmp.autocast(lambda x: x @ x.T, "O1-bf16"), X) == [(BF16, BF16)]  # the control
    # Outside autocast the function is the same function: float32 in, float32 out, same value.
    np.testing.assert_array_equal(f16(X), X @ X.T)
    assert f16.__name__ == "f16" and f16.__wrapped__ is not None


def test_half_region_runs_in_the_compute_dtype_inside_a_float32_one():
    @region("half")
    def inner(x):
        return x @ x.T

    @float32_region
    def outer(x):
        return inner(x) @ x

    dots = _dot_dtypes(jaxmp.autocast(outer, "O1-fp16"), X)
    assert dots == [(F16, F16), (F32, F32)], dots


def test_keep_region_leaves_a_float32_trace_as_it_is():
    @region("keep")
    def kept(x):
        return x @ x.T

    assert _dot_dtypes(jaxmp.autocast(kept, "O1-bf16"), X) == [(F32, F32)]


def test_the_region_is_a_named_scope_labelled_with_the_function():
    @region("float32")
    def head(x):
        return jnp.sin(x)

    scopes = [op.scope for op in op_dtypes(head, X) if op.primitive == "sin"]
    assert scopes and "jaxmp[float32]" in scopes[0] and "head" in scopes[0], scopes


@pytest.mark.parametrize("bad", [jnp.int32, "int8", "fast", None])
def test_a_region_refuses_a_non_floating_dtype(bad):
    with pytest.raises(TypeError, match="autocast_region"):
        region(bad)


def test_a_region_decorates_functions_only():
    with pytest.raises(TypeError, match="autocast_region expects a function, got int"):
        region("float32")(3)


def test_half_inputs_traces_the_kernel_with_half_inputs_under_autocast_only():
    seen = []

    @half_inputs
    def kernel(q, k, n):
        seen.append((q.dtype, k.dtype, type(n)))
        return q @ k.T

    out = jaxmp.autocast(kernel, "O1-fp16")(X, X, 3)
    assert seen[-1][:2] == (F16, F16) and seen[-1][2] is int  # non-arrays pass through
    assert out.shape == (2, 2)
    kernel(X, X, 3)
    assert seen[-1][:2] == (F32, F32)  # outside autocast: unchanged


def test_half_inputs_with_a_fixed_dtype_and_its_errors():
    seen = []

    @half_inputs(dtype=jnp.bfloat16)
    def kernel(q):
        seen.append(q.dtype)
        return q * 2

    jaxmp.autocast(kernel, "O1-fp16")(X)
    assert seen == [BF16]
    with pytest.raises(TypeError, match="half_inputs expects a function, got str"):
        half_inputs("kernel")
    with pytest.raises(TypeError, match="half_inputs: a region dtype"):
        half_inputs(lambda x: x, dtype=jnp.int8)


def test_accumulate_adds_in_the_totals_dtype_inside_and_outside_autocast():
    total = {"a": jnp.zeros(3, jnp.float32), "b": jnp.float32(1.0)}
    delta = {"a": jnp.full(3, 0.5, jnp.bfloat16), "b": jnp.float16(2.0)}
    out = accumulate(total, delta)
    assert out["a"].dtype == F32 and out["a"].tolist() == [0.5] * 3 and float(out["b"]) == 3.0
    # Under autocast the add is float32 even where every other op would go to bfloat16.
    y = jaxmp.autocast(lambda t, x: accumulate(t, (x @ x.T).sum(0)), "O1-bf16")(jnp.zeros(2), X)
    assert y.dtype == F32 and y.tolist() == [8.0, 8.0]
    adds = [op for op in op_dtypes(jaxmp.autocast(lambda t, d: accumulate(t, d), "O1-bf16"), jnp.zeros(2), X[0, :2])
            if op.primitive == "add"]
    assert adds and all(op.out_dtypes == (F32,) for op in adds), adds


def test_accumulate_broadcasts_a_delta_that_keeps_the_shape():
    out = accumulate(jnp.zeros((2, 3)), jnp.ones(3))
    assert out.shape == (2, 3) and float(out.sum()) == 6.0


def test_accumulate_refuses_what_would_be_lost_or_reshaped():
    with pytest.raises(TypeError, match="total must be an array, got the float 0.0"):
        accumulate(0.0, jnp.ones(()))
    with pytest.raises(TypeError, match=r"total at \['n'\] must be an array"):
        accumulate({"n": 1.0}, {"n": jnp.ones(())})
    with pytest.raises(ValueError, match="same tree structure"):
        accumulate({"a": jnp.zeros(2)}, {"b": jnp.zeros(2)})
    with pytest.raises(ValueError, match=r"delta has shape \(4, 3\), which would change total's shape \(3,\) to "
                                         r"\(4, 3\).*delta.sum\(0\)"):
        accumulate(jnp.zeros(3), jnp.ones((4, 3)))
    with pytest.raises(ValueError, match=r"delta has shape \(2,\), which would change total's shape \(3,\); "):
        accumulate(jnp.zeros(3), jnp.ones(2))
    with pytest.raises(TypeError, match="float32 delta cannot be added into a total of dtype int32.*fraction"):
        accumulate(jnp.zeros(3, jnp.int32), jnp.full(3, 0.7))
    with pytest.raises(TypeError, match="complex64 delta.*float32.*imaginary part"):
        accumulate(jnp.zeros(2), jnp.ones(2, jnp.complex64))
    out = accumulate(jnp.zeros(2, jnp.float32), jnp.ones(2, jnp.int32))  # an exact delta into a float total: fine
    assert out.dtype == F32 and out.tolist() == [1.0, 1.0]
