"""jaxmp/fp8/_ops.py: fp8_dot_general, fp8_conv_general_dilated and gradient_loss_scale, op by op."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxmp import fp8
from jaxmp._formats import E4M3, E5M2
from jaxmp.fp8._ops import fp8_conv_general_dilated, fp8_dot_general, gradient_loss_scale
from jaxmp.fp8._scaling import qdq
from jaxmp.fp8._state import Fp8Scales

DN = (((1,), (0,)), ((), ()))
# numpy data: an eager jax.random draw compiles a program per shape.
A = np.random.default_rng(0).normal(size=(4, 8)).astype(np.float32)
B = np.random.default_rng(1).normal(size=(8, 3)).astype(np.float32)
DELAYED = fp8.DelayedScaling(history_length=4)


def test_current_scaling_forward_is_the_dot_of_the_fp8_rounded_operands():
    # The op and its reference in one compiled program (eagerly, each op compiles on its own).
    out, ref = jax.jit(lambda a, b: (fp8_dot_general(a, b, DN), qdq(a, E4M3) @ qdq(b, E4M3)))(A, B)
    np.testing.assert_allclose(out, ref, rtol=1e-6, atol=1e-6)
    assert not np.allclose(out, A @ B, rtol=1e-4, atol=0)  # the rounding happened


def test_preferred_element_type_and_batch_dims_are_passed_through():
    a16, b16 = jax.ShapeDtypeStruct((1, 4, 8), jnp.bfloat16), jax.ShapeDtypeStruct((1, 8, 3), jnp.bfloat16)
    dn = (((2,), (1,)), ((0,), (0,)))
    out = jax.eval_shape(lambda a, b: fp8_dot_general(a, b, dn, preferred_element_type=jnp.float32), a16, b16)
    assert out.dtype == jnp.float32 and out.shape == (1, 4, 3)
    assert jax.eval_shape(lambda a, b: fp8_dot_general(a, b, dn), a16, b16).dtype == jnp.bfloat16


def test_conv_forward_and_backward_round_operands_to_e4m3_and_the_cotangent_to_e5m2():
    rng = np.random.default_rng(2)
    x = rng.normal(size=(1, 2, 6)).astype(np.float32)  # NCW
    w = rng.normal(size=(3, 2, 2)).astype(np.float32)  # OIW
    g = rng.normal(size=(1, 3, 5)).astype(np.float32)
    conv = lambda a, b: jax.lax.conv_general_dilated(a, b, (1,), "VALID")  # noqa: E731

    @jax.jit
    def both(x, w, g):
        out, vjp = jax.vjp(lambda a, b: fp8_conv_general_dilated(a, b, (1,), "VALID"), x, w)
        ref, ref_vjp = jax.vjp(conv, qdq(x, E4M3), qdq(w, E4M3))
        return out, vjp(g), ref, ref_vjp(qdq(g, E5M2))

    out, (dx, dw), ref, (ref_dx, ref_dw) = both(x, w, g)
    for got, want in ((out, ref), (dx, ref_dx), (dw, ref_dw)):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_delayed_scaling_uses_the_given_scales_and_returns_the_amaxes_as_their_gradients():
    x, w = np.array([[300.0, 1.0]], np.float32), np.array([[1.0], [1.0]], np.float32)
    # Scale 1: 300 is rounded to E4M3 (288 or 320); scale 2 would saturate it at 448 / 2 = 224.
    f = jax.jit(lambda s: fp8_dot_general(x, w, DN, DELAYED, scales=Fp8Scales(s, 1.0, 1.0)))
    out1, out2 = f(1.0), f(2.0)
    assert float(out1[0, 0]) in (289.0, 321.0) and float(out2[0, 0]) == 225.0

    def loss(s):
        return jnp.sum(fp8_dot_general(x, w, DN, DELAYED, scales=s) * 3.0)

    grads = jax.jit(jax.grad(loss))(Fp8Scales(np.float32(1.0), np.float32(1.0), np.float32(1.0)))
    assert (float(grads.input), float(grads.kernel), float(grads.output_grad)) == (300.0, 1.0, 3.0)


def test_gradient_loss_scale_reports_the_gradient_amax_unscaled_and_is_undone_on_exit():
    x, w = np.ones((1, 2), np.float32), np.ones((2, 1), np.float32)
    s = Fp8Scales(np.float32(1.0), np.float32(1.0), np.float32(1.0))

    def scaled(s, loss_scale):
        with gradient_loss_scale(loss_scale):
            y = fp8_dot_general(x, w, DN, DELAYED, scales=s)
        return jnp.sum(y) * loss_scale

    # Jitted, each a fresh function (so traced afresh, with the context as it is then): one program
    # per gradient instead of one per eager op.
    assert float(jax.jit(jax.grad(lambda s: scaled(s, 512.0)))(s).output_grad) == 1.0
    assert float(jax.jit(jax.grad(lambda s: jnp.sum(fp8_dot_general(x, w, DN, DELAYED, scales=s)) * 512.0))(s)
                 .output_grad) == 512.0  # outside the context: the scaled amax, as observed
    with pytest.raises(RuntimeError):
        with gradient_loss_scale(4.0):
            raise RuntimeError("the context resets even on an error")
    assert float(jax.jit(jax.grad(lambda s: jnp.sum(fp8_dot_general(x, w, DN, DELAYED, scales=s))))(s)
                 .output_grad) == 1.0


@pytest.mark.parametrize("call, error, match", [
    (lambda: fp8_dot_general(A, B, DN, "e4m3"), TypeError, "recipe must be a jaxmp.fp8.CurrentScaling"),
    (lambda: fp8_dot_general(A, B, DN, DELAYED), TypeError, "delayed scaling needs scales"),
    (lambda: fp8_dot_general(A, B, DN, scales=Fp8Scales(1.0, 1.0, 1.0)), TypeError, "only used with a DelayedScaling"),
    (lambda: fp8_dot_general(A, B.astype(np.int32), DN), TypeError, "fp8_dot_general: rhs must be floating"),
    (lambda: fp8_conv_general_dilated(np.ones((1, 1, 4), np.int8), np.ones((1, 1, 2), np.float32), (1,), "VALID"),
     TypeError, "fp8_conv_general_dilated: lhs must be floating"),
    (lambda: fp8_conv_general_dilated(np.ones((1, 1, 4), np.float32), np.ones((1, 1, 2), np.float32), (1,), "VALID",
                                     recipe=DELAYED),
     TypeError, "fp8_conv_general_dilated: delayed scaling needs scales"),
])
def test_misuse_is_named_with_the_function(call, error, match):
    with pytest.raises(error, match=match):
        call()


# -- issue 59, item 17: autocast quantizes convolutions as the Flax door does ------------------

@pytest.mark.parametrize("name", ["O2-fp8-current", "O2-mxfp8", "O2-nvfp4", "O2-fp8-rowwise", "O2-fp8-block128"])
def test_autocast_runs_a_convolution_in_fp8_as_the_flax_door_does(name):
    import flax.linen as nn

    import jaxmp
    import jaxmp.flax

    rng = np.random.default_rng(3)
    x = rng.normal(size=(2, 8, 8, 3)).astype(np.float32)
    w = rng.normal(size=(1, 1, 3, 4)).astype(np.float32)  # a 1x1 convolution (a Fourier layer's mixing)
    dims = ("NHWC", "HWIO", "NHWC")

    def conv(x, w):
        return jax.lax.conv_general_dilated(x, w, (1, 1), "SAME", dimension_numbers=dims)

    def loss(policy):
        return lambda w: jnp.sum(jaxmp.autocast(conv, policy)(x, w).astype(jnp.float32) ** 2)

    run = jax.jit(lambda w: (jaxmp.autocast(conv, name)(x, w), jax.grad(loss(name))(w),
                             jaxmp.autocast(conv, "O2-bf16")(x, w), jax.grad(loss("O2-bf16"))(w)))
    out, grad, bf16_out, bf16_grad = run(w)
    assert not np.array_equal(out, bf16_out) and not np.array_equal(grad, bf16_grad)  # quantized, both ways
    # The Flax door's Conv on the same kernel: the same fp8 convolution (autocast's O2 keeps a
    # matmul's float32 output where the door's layer returns bf16: equal once rounded alike).
    layer = jaxmp.flax.mixed_precision(nn.Conv(4, (1, 1), use_bias=False), name)
    variables = layer.init(jax.random.key(0), x)
    door = layer.apply({**variables, "params": {"kernel": w}}, x)
    np.testing.assert_array_equal(np.asarray(out.astype(jnp.bfloat16), np.float32), np.asarray(door, np.float32))
    # And the precision report names the recipe that ran: per-tensor fp8 (E2M1 as E4M3).
    label = fp8._recipes.describe(fp8._recipes.conv_recipe(jaxmp.get_recipe(name).fp8))
    explained = jaxmp.precision_report(jaxmp.autocast(conv, name), x, w)
    assert label.startswith("half list, fp8 (float8_e4m3fn forward")
    assert {d.rule for d in explained.decisions if d.primitive == "conv_general_dilated"} == {label}


@pytest.mark.parametrize("name", ["O2-fp8-current", "O2-mxfp8", "O2-nvfp4"])
def test_forward_mode_runs_through_an_fp8_convolution(name):
    """Issue 59 item 13 for convolutions (docs/autocast.md: "matmuls and convolutions take every
    column too, forward mode included"): jvp, linearize, jacfwd and hessian through the fp8
    convolution autocast runs; the tangent is the quantized map that jacrev transposes."""
    import jaxmp

    rng = np.random.default_rng(5)
    x = rng.normal(size=(2, 4, 4, 3)).astype(np.float32)
    w = rng.normal(size=(1, 1, 3, 4)).astype(np.float32)
    tx, tw = rng.normal(size=x.shape).astype(np.float32), rng.normal(size=w.shape).astype(np.float32)
    dims = ("NHWC", "HWIO", "NHWC")

    def conv(x, w):
        return jax.lax.conv_general_dilated(x, w, (1, 1), "SAME", dimension_numbers=dims)

    g = jaxmp.autocast(conv, name)

    @jax.jit
    def run(x, w, tx, tw):
        y, t = jax.jvp(g, (x, w), (tx, tw))
        y_lin, lin = jax.linearize(g, x, w)
        fwd = jax.jacfwd(lambda v: g(x[:1, :2, :2], v))(w)
        rev = jax.jacrev(lambda v: g(x[:1, :2, :2], v))(w)
        hess = jax.hessian(lambda v: jnp.sum(g(x[:1, :2, :2], v).astype(jnp.float32) ** 2))(w)
        return y, t, y_lin, lin(tx, tw), fwd, rev, hess, g(x, w)

    y, t, y_lin, t_lin, fwd, rev, hess, plain = run(x, w, tx, tw)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(plain))     # the primal is the fp8 forward
    np.testing.assert_array_equal(np.asarray(t_lin), np.asarray(t))
    np.testing.assert_array_equal(np.asarray(y_lin), np.asarray(y))
    np.testing.assert_array_equal(np.asarray(fwd), np.asarray(rev))     # one linear map, both ways
    exact = np.asarray(conv(tx, w) + conv(x, tw))
    rel = np.linalg.norm(np.asarray(t, np.float32) - exact) / np.linalg.norm(exact)
    assert 1e-4 < rel < 0.1, rel                                         # quantized, and a derivative
    assert hess.shape == (1, 1, 3, 4) * 2 and np.isfinite(np.asarray(hess)).all()
    # The op itself (a custom_vjp once, which JAX's jvp refused), on the recipe autocast ran.
    recipe = fp8._recipes.conv_recipe(jaxmp.get_recipe(name).fp8)
    op = jax.jit(lambda a, b, ta, tb: jax.jvp(lambda p, q: fp8_conv_general_dilated(
        p, q, (1, 1), "SAME", dimension_numbers=dims, recipe=recipe), (a, b), (ta, tb)))
    t_op = np.asarray(op(x, w, tx, tw)[1], np.float32)     # float32 operands here, bf16 under autocast
    assert 1e-4 < np.linalg.norm(t_op - exact) / np.linalg.norm(exact) < 0.1
