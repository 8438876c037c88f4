"""jaxmp/diagnostics/_matmul.py: the GEMM view of dot_general and convolutions, counted by hand."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxmp.diagnostics._matmul import Gemm, conv_gemm, dot_gemm, tc_shape_problems


def test_a_plain_matmul_is_one_gemm_with_m_n_k_from_the_shapes():
    g = dot_gemm((32, 30), (30, 8), (((1,), (0,)), ((), ())))
    assert g == Gemm(1, 32, 8, 30, 2 * 32 * 8 * 30, (("M", 32), ("N", 8), ("K", 30)))


def _abstract(shape):
    """A float32 placeholder: eval_shape needs only the shape (an eager jnp.zeros compiles a program)."""
    return jax.ShapeDtypeStruct(shape, jnp.float32)


def test_batch_free_and_contracting_dims_multiply_out_in_any_position():
    # lhs [k1=3, b=4, m1=5, k2=2, m2=6], rhs [b=4, n=7, k2=2, k1=3]
    dn = (((0, 3), (3, 2)), ((1,), (0,)))
    g = dot_gemm((3, 4, 5, 2, 6), (4, 7, 2, 3), dn)
    assert (g.batch, g.m, g.n, g.k) == (4, 30, 7, 6) and g.flops == 2 * 4 * 30 * 7 * 6
    # The count agrees with the dot JAX runs: one multiply-add per output element and contraction step.
    out = jax.eval_shape(lambda a, b: jax.lax.dot_general(a, b, dn), _abstract((3, 4, 5, 2, 6)), _abstract((4, 7, 2, 3)))
    assert g.flops == 2 * int(np.prod(out.shape)) * g.k


def test_a_vector_dot_has_unit_m_and_n():
    g = dot_gemm((16,), (16,), (((0,), (0,)), ((), ())))
    assert (g.batch, g.m, g.n, g.k, g.flops) == (1, 1, 1, 16, 32)


def test_conv_gemm_counts_output_positions_channels_and_kernel_taps():
    lhs, rhs = (2, 10, 10, 4), (3, 3, 4, 16)
    dn = jax.lax.conv_dimension_numbers(lhs, rhs, ("NHWC", "HWIO", "NHWC"))
    out = jax.eval_shape(lambda a, b: jax.lax.conv_general_dilated(a, b, (2, 2), "VALID", dimension_numbers=dn),
                         _abstract(lhs), _abstract(rhs)).shape
    assert out == (2, 4, 4, 16)
    g = conv_gemm(lhs, rhs, out, dn)
    assert (g.batch, g.m, g.n, g.k) == (1, 2 * 4 * 4, 16, 4 * 9)
    assert g.flops == 2 * int(np.prod(out)) * 4 * 9 and g.tc_dims == (("C_in", 4), ("C_out", 16))


def test_grouped_conv_counts_channels_per_group():
    lhs, rhs = (1, 8, 8, 8), (3, 3, 2, 8)  # 4 groups of 2 input channels
    dn = jax.lax.conv_dimension_numbers(lhs, rhs, ("NHWC", "HWIO", "NHWC"))
    out = jax.eval_shape(lambda a, b: jax.lax.conv_general_dilated(a, b, (1, 1), "SAME", dimension_numbers=dn,
                                                                   feature_group_count=4),
                         _abstract(lhs), _abstract(rhs)).shape
    g = conv_gemm(lhs, rhs, out, dn, feature_group_count=4)
    assert g.k == 2 * 9 and g.n == 8 and g.tc_dims == (("C_in", 2), ("C_out", 2))
    assert g.flops == 2 * int(np.prod(out)) * 2 * 9


@pytest.mark.parametrize("multiple, problems", [(8, ("N=12", "K=30")), (4, ("K=30",)), (2, ()), (1, ())])
def test_tc_shape_problems_names_each_size_off_the_multiple(multiple, problems):
    g = dot_gemm((64, 30), (30, 12), (((1,), (0,)), ((), ())))
    assert tc_shape_problems(g, multiple) == problems
