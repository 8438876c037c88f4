"""The block-scaled dot_general (jaxmp/fp8/_block_ops.py) and its presets: the forward against
an independent reference, each backward leg's formats read from the jaxpr, unquantized legs,
autocast under the block presets, and (JAX >= 0.12) JAX's own scaled_dot_general."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxmp
from jaxmp import _jaxpr, fp8
from tests.formats.test_block_scaled import E2M1, E4M3, E5M2, _ref_qdq

DN = (((1,), (0,)), ((), ()))
LOW = {E4M3, E5M2, E2M1}
RS = np.random.RandomState(0)
X = RS.randn(32, 64).astype(np.float32)
W = (RS.randn(64, 48) * 0.1).astype(np.float32)


def _mx(**kw):
    return fp8.CurrentScaling(block=(1, 32), bwd_dtype=jnp.float8_e4m3fn, scale_format="e8m0", scale_rule="rceil",
                              **kw)


def test_forward_equals_the_dot_of_reference_quantized_operands():
    got = jax.jit(lambda x, w: fp8.fp8_dot_general(x, w, DN, _mx(), precision=jax.lax.Precision.HIGHEST))(X, W)
    ref = _ref_qdq(X, E4M3, (1, 32), "rceil") @ _ref_qdq(np.ascontiguousarray(W.T), E4M3, (1, 32), "rceil").T
    np.testing.assert_allclose(np.asarray(got), ref, rtol=1e-6, atol=1e-5)
    assert np.abs(np.asarray(got) - X @ W).max() > 1e-3  # it did quantize


def _leg_formats(recipe, dtype=jnp.bfloat16):
    """``{leg: (low-precision dtypes its operands pass through, dtypes its dot_generals consume)}``."""
    def loss(x, w):
        return jnp.sum(fp8.fp8_dot_general(x, w, DN, recipe).astype(jnp.float32))

    closed = jax.make_jaxpr(jax.grad(loss, (0, 1)))(X.astype(dtype), W.astype(dtype))
    out = {}
    for leg in ("dgrad", "wgrad"):
        eqns = [e for e in _jaxpr.walk(closed) if leg in e.scopes]
        casts = {np.dtype(a.dtype) for e in eqns if e.primitive == "convert_element_type" for a in e.out_avals}
        dots = {np.dtype(a.dtype) for e in eqns if e.primitive == "dot_general" for a in e.in_avals}
        out[leg] = (casts & LOW, dots)
    return out


@pytest.mark.parametrize("preset,grad", [("O2-mxfp8", E4M3), ("O2-fp8-block128", E4M3), ("O2-fp8-rowwise", E4M3),
                                         ("O2-nvfp4", E2M1)], ids=lambda v: str(v))
def test_each_presets_backward_legs_read_from_the_jaxpr(preset, grad):
    recipe = jaxmp.get_recipe(preset).fp8
    legs = _leg_formats(recipe)
    casts = {np.dtype(recipe.fwd_dtype), grad} | ({E4M3} if recipe.scale_format == "e4m3" else set())  # NVFP4's scales
    for leg in ("dgrad", "wgrad"):
        assert legs[leg] == (casts, {np.dtype(jnp.bfloat16)}), (leg, legs[leg])


def test_a_format_per_leg_and_unquantized_legs():
    hybrid = _leg_formats(fp8.CurrentScaling(block=(1, 32), scale_format="e8m0", scale_rule="floor"))  # E5M2 grads
    assert hybrid["dgrad"][0] == {E4M3, E5M2} and hybrid["wgrad"][0] == {E4M3, E5M2}
    kept = _leg_formats(_mx(high_precision_legs=("wgrad",)))
    assert kept["dgrad"][0] == {E4M3}
    assert kept["wgrad"][0] == set()  # torchao's rowwise_with_gw_hp: the weight gradient in bf16


def test_unquantized_legs_are_the_exact_gradients():
    r = _mx(high_precision_legs=("dgrad", "wgrad"))
    g = RS.randn(32, 48).astype(np.float32)

    @jax.jit
    def both(x, w, g):
        mine = jax.vjp(lambda a, b: fp8.fp8_dot_general(a, b, DN, r), x, w)[1](g)
        exact = jax.vjp(lambda a, b: jax.lax.dot_general(a, b, DN), x, w)[1](g)
        return mine, exact

    mine, exact = both(X, W, g)
    for m, e in zip(mine, exact):
        np.testing.assert_array_equal(np.asarray(m), np.asarray(e))


@pytest.mark.slow  # four compiles of a forward and backward pass
@pytest.mark.parametrize("preset,tol", [("O2-mxfp8", 0.08), ("O2-fp8-block128", 0.08), ("O2-fp8-rowwise", 0.08),
                                        ("O2-nvfp4", 0.35)])
def test_autocast_runs_the_block_presets_with_gradients_near_bf16(preset, tol):
    def loss(x, w):
        return jnp.sum(jnp.tanh(x @ w))

    @jax.jit
    def grads(x, w):
        return jax.grad(jaxmp.autocast(loss, preset), (0, 1))(x, w), jax.grad(loss, (0, 1))(x, w)

    (gx, gw), (ex, ew) = grads(X, W)
    for got, want in ((gx, ex), (gw, ew)):
        got, want = np.asarray(got, np.float32), np.asarray(want)
        rel = np.linalg.norm(got - want) / np.linalg.norm(want)
        assert 1e-4 < rel < tol, rel  # quantized (not exact), and close


def test_the_precision_report_names_the_block_format():
    f = jaxmp.autocast(lambda x, w: jnp.sum(jnp.tanh(x @ w)), "O2-mxfp8")
    text = jaxmp.precision_report(f, X, W).to_json()
    assert text.count("block-scaled (float8_e4m3fn forward, float8_e4m3fn backward, 1x32 blocks, e8m0 scales, "
                      "rceil rule)") >= 1


@pytest.mark.skipif(tuple(int(p) for p in jax.__version__.split(".")[:2]) < (0, 12),
                    reason="jax.nn.scaled_dot_general lowers on CPU from JAX 0.12")
def test_emulated_mxfp8_forward_equals_jax_scaled_dot_general():
    # JAX's MXFP8 scale is the round-up of float32 amax / 448 (its cast_to_e8m0_with_rounding_up):
    # the "rceil" rule (torchao's RCEIL, Transformer Engine's float_to_e8m0), bit for bit.
    x, w = jnp.asarray(X, jnp.bfloat16), jnp.asarray(np.ascontiguousarray(W.T), jnp.bfloat16)  # [m, k], [n, k]
    dn = (((1,), (1,)), ((), ()))
    configs = [jax.nn.get_scaled_dot_general_config("mxfp8")] * 3
    theirs = jax.jit(functools.partial(jax.nn.scaled_dot_general, dimension_numbers=dn, configs=configs,
                                       preferred_element_type=jnp.float32))(x, w)
    for rule in ("rceil",):
        r = fp8.CurrentScaling(block=(1, 32), bwd_dtype=jnp.float8_e4m3fn, scale_format="e8m0", scale_rule=rule)
        mine = jax.jit(lambda a, b: fp8.fp8_dot_general(a, b, dn, r, preferred_element_type=jnp.float32))(x, w)
        np.testing.assert_array_equal(np.asarray(mine), np.asarray(theirs))


def test_a_scope_rule_keeps_attention_in_bf16_under_a_block_preset():
    def f(x, w):
        with jax.named_scope("attention"):
            s = x @ w.T
        return jnp.sum(s @ w)

    g = jaxmp.autocast(f, "O2-mxfp8", rules=jaxmp.AutocastRules(scope_rules=(("attention", "half"),)))
    closed = jax.make_jaxpr(jax.grad(g, 1))(X, np.ascontiguousarray(W.T))
    quantized = [e for e in _jaxpr.walk(closed) if e.primitive == "convert_element_type"
                 and np.dtype(e.out_avals[0].dtype) in LOW]
    assert quantized and not any("attention" in s for e in quantized for s in e.scopes)
    assert {leg for e in quantized for leg in ("dgrad", "wgrad") if leg in e.scopes} == {"dgrad", "wgrad"}


@pytest.mark.slow  # one compile of four forward and backward passes
def test_hadamard_and_stochastic_rounding_change_only_the_backward_and_stay_close():
    base = dict(block=(1, 16), bwd_dtype=jnp.float8_e4m3fn, scale_format="e8m0", scale_rule="rceil")
    recipes = [fp8.CurrentScaling(**base), fp8.CurrentScaling(**base, hadamard=True),
               fp8.CurrentScaling(**base, stochastic_rounding=True)]
    g = RS.randn(32, 48).astype(np.float32)

    @jax.jit
    def run(x, w, g):
        outs = [jax.vjp(lambda a, b, r=r: fp8.fp8_dot_general(a, b, DN, r), x, w) for r in recipes]
        return [o[0] for o in outs], [o[1](g) for o in outs], jax.vjp(lambda a, b: jax.lax.dot_general(a, b, DN),
                                                                       x, w)[1](g)

    fwd, grads, exact = run(X, W, g)
    for f in fwd[1:]:
        np.testing.assert_array_equal(np.asarray(f), np.asarray(fwd[0]))  # the forward is the same
    (dx0, dw0), (dx_h, dw_h), (dx_sr, dw_sr) = [[np.asarray(t) for t in gr] for gr in grads]
    np.testing.assert_array_equal(dx_h, dx0)  # the transform is on the wgrad leg only
    assert not np.array_equal(dw_h, dw0) and not np.array_equal(dx_sr, dx0)
    for got, want in ((dw0, exact[1]), (dw_h, exact[1]), (dx_sr, exact[0]), (dw_sr, exact[1])):
        want = np.asarray(want)
        assert np.linalg.norm(got - want) / np.linalg.norm(want) < 0.08


@pytest.mark.skipif(tuple(int(p) for p in jax.__version__.split(".")[:2]) < (0, 12),
                    reason="jax.nn.scaled_dot_general lowers on CPU from JAX 0.12")
@pytest.mark.standard_promotion(reason="JAX's own nvfp4 quantize divides the bf16 operand by the float32 global scale")
def test_emulated_mxfp4_and_nvfp4_forwards_equal_jax_scaled_dot_general():
    import dataclasses

    x, w = jnp.asarray(X, jnp.bfloat16), jnp.asarray(np.ascontiguousarray(W.T), jnp.bfloat16)
    dn = (((1,), (1,)), ((), ()))

    def theirs(configs):
        return np.asarray(jax.jit(functools.partial(jax.nn.scaled_dot_general, dimension_numbers=dn, configs=configs,
                                                    preferred_element_type=jnp.float32))(x, w))

    def mine(r):
        return np.asarray(jax.jit(lambda a, b: fp8.fp8_dot_general(a, b, dn, r, preferred_element_type=jnp.float32))(
            x, w))

    mx4 = fp8.CurrentScaling(block=(1, 32), fwd_dtype=jnp.float4_e2m1fn, bwd_dtype=jnp.float4_e2m1fn,
                             scale_format="e8m0", scale_rule="rceil")
    np.testing.assert_array_equal(mine(mx4), theirs([jax.nn.get_scaled_dot_general_config("mxfp4")] * 3))
    # NVFP4 with the per-tensor scales jaxmp computes (JAX's default is 1.0), 1x16 blocks on both operands
    nv = jax.nn.get_scaled_dot_general_config("nvfp4")
    g = [jnp.float32(np.float32(np.abs(np.asarray(t, np.float32)).max()) / np.float32(448 * 6)) for t in (x, w)]
    configs = [dataclasses.replace(nv, global_scale=g[0]), dataclasses.replace(nv, global_scale=g[1]), nv]
    mine_nv = mine(dataclasses.replace(jaxmp.get_recipe("O2-nvfp4").fp8, rhs_block=None))
    np.testing.assert_array_equal(mine_nv, theirs(configs))


@pytest.mark.parametrize("preset", ["O2-nvfp4", "O2-mxfp8"])
def test_fp8_operands_under_a_block_preset_are_finite(preset):
    # Issue 59 item 6: float8_e4m3fn operands under O2-nvfp4 gave an all-NaN product: NVFP4's
    # q * s (up to 6 * 448) was dequantized into E4M3, which has no such values.
    rs = np.random.RandomState(11)
    x = rs.randn(4, 64).astype(jnp.float8_e4m3fn)
    w = (rs.randn(64, 32) * 0.1).astype(jnp.float8_e4m3fn)
    out = np.asarray(jaxmp.autocast(lambda a, b: a @ b, preset)(x, w), np.float32)
    ref = x.astype(np.float32) @ w.astype(np.float32)
    assert np.isfinite(out).all()
    assert np.abs(out - ref).max() < 0.3 * np.abs(ref).max()


@pytest.mark.parametrize("preset", ["O2-nvfp4", "O2-mxfp8", "O2-fp8-current", "O2-fp8-block128"])
def test_an_empty_matmul_returns_the_empty_result(preset):
    # Issue 59 item 7: (0, 64) @ (64, 32) raised "zero-size array to reduction operation max".
    f = jaxmp.autocast(lambda a, b: jnp.sum((a @ b).astype(jnp.float32)), preset)
    x, w = np.zeros((0, 64), np.float32), np.ones((64, 32), np.float32)
    out = jaxmp.autocast(lambda a, b: a @ b, preset)(x, w)
    assert out.shape == (0, 32)
    gx, gw = jax.grad(f, argnums=(0, 1))(x, w)
    assert gx.shape == (0, 64) and (np.asarray(gw) == 0).all()


# -- issue 59, item 13: forward mode through the quantized matmuls ------------------------------

@pytest.mark.parametrize("preset", ["O2-fp8-current", "O2-mxfp8", "O2-fp8-rowwise", "O2-fp8-block128", "O2-nvfp4"])
def test_forward_mode_runs_through_every_fp8_and_block_preset(preset):
    x, w = X[:16], W  # 16 tokens: NVFP4's wgrad leg takes its Hadamard transform
    tx, tw = RS.randn(*x.shape).astype(np.float32), RS.randn(*w.shape).astype(np.float32)

    def f(x, w):
        return x @ w

    g = jaxmp.autocast(f, preset)

    @jax.jit
    def run(x, w, tx, tw):
        y, t = jax.jvp(g, (x, w), (tx, tw))
        y_lin, lin = jax.linearize(g, x, w)
        jac = jax.jacfwd(lambda v: g(x[:2], v))(w[:, :3])
        hess = jax.hessian(lambda v: jnp.sum(g(x[:2], v) ** 2))(w[:, :3])
        return y, t, y_lin, lin(tx, tw), jac, hess, g(x, w)

    y, t, y_lin, t_lin, jac, hess, plain = run(x, w, tx, tw)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(plain))  # the primal is the quantized forward
    np.testing.assert_array_equal(np.asarray(y_lin), np.asarray(y))
    np.testing.assert_array_equal(np.asarray(t_lin), np.asarray(t))
    exact = tx @ w + x @ tw
    rel = np.linalg.norm(np.asarray(t, np.float32) - exact) / np.linalg.norm(exact)
    assert 1e-4 < rel < (0.35 if preset == "O2-nvfp4" else 0.08), rel  # quantized, and the derivative's
    assert jac.shape == (2, 3, 64, 3) and hess.shape == (64, 3, 64, 3) and np.isfinite(np.asarray(hess)).all()


@pytest.mark.parametrize("preset", ["O2-fp8-current", "O2-mxfp8", "O2-fp8-rowwise"])
def test_forward_mode_is_the_linear_map_reverse_mode_transposes(preset):
    # A one-hot cotangent or tangent quantizes exactly (1 is in every format), so jacfwd and
    # jacrev see the same linear map: each leg's dot on the operand copy that leg quantizes.
    r = jaxmp.get_recipe(preset).fp8
    x, w = X[:4], W[:, :8]
    fns = (lambda v: fp8.fp8_dot_general(v, w, DN, r), lambda v: fp8.fp8_dot_general(x, v, DN, r))
    for fn, arg in zip(fns, (x, w)):
        fwd, rev = jax.jit(lambda v, fn=fn: (jax.jacfwd(fn)(v), jax.jacrev(fn)(v)))(arg)
        np.testing.assert_array_equal(np.asarray(fwd), np.asarray(rev))
    # Per tensor, that map is the quantized forward's derivative, quantization passed straight through.
    if r.block is None:
        tx, tw = RS.randn(*x.shape).astype(np.float32), RS.randn(*w.shape).astype(np.float32)
        t = jax.jvp(lambda a, b: fp8.fp8_dot_general(a, b, DN, r), (x, w), (tx, tw))[1]
        qx, qw = (np.asarray(fp8._scaling.qdq(v, E4M3)) for v in (x, w))
        want = tx @ qw + qx @ tw  # the same products, summed in another order: float32 rounding apart
        np.testing.assert_allclose(np.asarray(t), want, rtol=1e-5, atol=1e-6 * float(np.abs(want).max()))


def test_jvp_through_a_block_matmul_under_vmap_and_checkpoint():
    r = jaxmp.get_recipe("O2-nvfp4").fp8

    def f(x, w):
        return jnp.sum(jax.checkpoint(lambda a, b: fp8.fp8_dot_general(a, b, DN, r))(x, w) ** 2)

    batched = jax.jit(jax.vmap(lambda x, t: jax.jvp(lambda v: f(v, W), (x,), (t,))[1]))
    xs = np.stack([X[:16], X[16:]])
    out = batched(xs, xs)
    assert out.shape == (2,) and np.isfinite(np.asarray(out)).all()
    grads = jax.jit(jax.vmap(jax.grad(f), (0, None)))(xs, W)
    assert grads.shape == (2, 16, 64) and np.isfinite(np.asarray(grads)).all()
