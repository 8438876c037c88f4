"""The block-scaled quantizer (jaxmp/fp8/_blocks.py): E8M0 scale rules at their boundaries, the
E8M0 traps, round trips against an ml_dtypes reference, jit vs op by op, stochastic rounding,
the Hadamard transform, NVFP4's two-level scales."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jaxmp import fp8
from jaxmp.fp8 import _blocks as B

E4M3, E5M2, E2M1 = (np.dtype(d) for d in (jnp.float8_e4m3fn, jnp.float8_e5m2, jnp.float4_e2m1fn))
ELEM = {d: B.element_format(d) for d in (E4M3, E5M2, E2M1)}


def _ref_exponent(amax: float, dtype, rule: str) -> int:
    """The rules of jaxmp/fp8/_blocks.py, in Python on exact float32 values (math.frexp)."""
    f = ELEM[dtype]
    a = np.float32(amax)
    if a == 0:
        return 0

    def floor_log2(v):
        return math.frexp(float(v))[1] - 1

    def ceil_log2(v):
        m, e = math.frexp(float(v))
        return e - 1 if m == 0.5 else e

    if rule == "floor":
        e = floor_log2(a) - f.emax
    elif rule == "even":
        bits = (a.view(np.int32) + np.int32(1 << (23 - f.mbits - 1))) & np.int32(0x7F800000)
        e = (int(bits) >> 23) - 127 - f.emax
    elif math.frexp(float(a))[1] - 1 < -126:  # a subnormal amax: below any scale
        e = -127
    else:  # the float32 quotient (product), rounded as if float32 had no subnormals
        exact = float(a) / f.max if rule == "ceil" else float(a) * float(np.float32(1.0 / f.max))
        shift = 64 if exact < 1e-30 else 0
        e = ceil_log2(np.float32(exact * 2.0 ** shift)) - shift
    return max(-127, min(127, e))


# The boundaries the issue names: E4M3's rules disagree at 0.9 and 449.
E4M3_TABLE = {  # amax: (floor, even, ceil, rceil)
    0.0: (0, 0, 0, 0),
    0.9: (-9, -9, -8, -8),
    448.0: (0, 0, 0, 0),
    449.0: (0, 0, 1, 1),
    480.0: (0, 0, 1, 1),
    496.0: (1, 1, 1, 1),      # mantissa 1.9375 rounds up to 2 in 3 bits: EVEN moves, FLOOR does not
    1e-40: (-127, -127, -127, -127),  # a subnormal amax: the smallest scale, not "zero"
}


@pytest.mark.parametrize("amax", sorted(E4M3_TABLE))
def test_e4m3_scale_table_at_the_boundaries(amax):
    table = _exponents(jnp.float32(amax), 0)
    got = [int(table[r]) for r in B.POW2_RULES]
    want = list(E4M3_TABLE[amax])
    if amax == 496.0:  # floor keeps 2**0 (saturating), even rounds the mantissa up first
        want = [0, 1, 1, 1]
    assert got == want
    assert got == [_ref_exponent(amax, E4M3, r) for r in B.POW2_RULES]


@pytest.mark.parametrize("dtype", [E4M3, E5M2, E2M1], ids=["e4m3", "e5m2", "e2m1"])
def test_every_rule_matches_the_reference_across_the_float32_range(dtype):
    rs = np.random.RandomState(0)
    amax = np.concatenate([np.float32(2.0) ** rs.randint(-140, 127, 300) * rs.uniform(1, 2, 300),
                           [np.float32(6.0), np.float32(57344.0), np.float32(3e38)]]).astype(np.float32)
    table = _exponents(jnp.asarray(amax), (E4M3, E5M2, E2M1).index(dtype))
    for rule in B.POW2_RULES:
        got = np.asarray(table[rule])
        want = np.array([_ref_exponent(a, dtype, rule) for a in amax])
        assert (got == want).all(), (rule, amax[got != want])


def test_e8m0_traps_zero_and_non_finite_amax():
    x = np.zeros((3, 32), np.float32)
    x[1, 0], x[2, 5] = np.inf, np.nan
    scale, out = jax.jit(lambda x: (lambda q: (jax.lax.bitcast_convert_type(q.scale, jnp.uint8), B.dequantize(q)))(
        B.quantize(x, E4M3, (1, 32), "e8m0", "floor")))(x)
    assert np.asarray(scale).ravel().tolist() == [127, 255, 255]  # amax 0 -> 2**0; inf and NaN -> the NaN scale
    out = np.asarray(out)
    assert (out[0] == 0).all() and np.isnan(out[1:]).all()  # the whole bad block, explicitly
    # the trap avoided: a plain cast of a zero scale is NaN in E8M0
    assert np.isnan(np.float32(np.float32(0.0).astype(ml_dtypes.float8_e8m0fnu)))


def test_e8m0_scales_are_never_a_round_to_nearest_cast():
    # 0.6 / 448 is nearer 2**-10 than 2**-9; a cast rounds down and 0.6 would saturate under it.
    amax = np.float32(0.6)
    cast = np.float32((amax / np.float32(448)).astype(ml_dtypes.float8_e8m0fnu))
    assert cast == 2.0 ** -10
    assert int(_exponents(jnp.float32(amax), 0)["ceil"]) == -9
    assert abs(float(QDQ(jnp.array([[0.6, 0.1]], jnp.float32), E4M3, (1, 2), "e8m0", "ceil")[0, 0]) - 0.6) < 0.6 / 16


@functools.partial(jax.jit, static_argnums=1)
def _exponents(amax, dtype_index):
    return {r: B.e8m0_exponent(amax, ELEM[(E4M3, E5M2, E2M1)[dtype_index]], r) for r in B.POW2_RULES}


def _qdq(x, dtype, block, scale_format, rule, key=None):
    return B.dequantize(B.quantize(x, dtype, block, scale_format, rule, key))


QDQ = jax.jit(_qdq, static_argnums=(1, 2, 3, 4))


def _ref_qdq(x: np.ndarray, dtype, block, rule) -> np.ndarray:
    """Quantize-dequantize with numpy and ml_dtypes' casts (an independent implementation)."""
    f = ELEM[dtype]
    a, b = block
    out = np.empty_like(x)
    for i in range(0, x.shape[0], a):
        for j in range(0, x.shape[1], b):
            blk = x[i:i + a, j:j + b]
            e = _ref_exponent(np.abs(blk).max(), dtype, rule)
            y = np.clip(blk * np.float32(2.0 ** -e), -f.max, f.max).astype(f.dtype).astype(np.float32)
            out[i:i + a, j:j + b] = y * np.float32(2.0 ** e)
    return out


@pytest.mark.parametrize("dtype,block", [(E4M3, (1, 32)), (E5M2, (1, 128)), (E4M3, (128, 128)), (E2M1, (1, 16)),
                                         (E4M3, "row")], ids=["mx-e4m3", "e5m2-1x128", "128x128", "mxfp4", "row"])
def test_quantize_dequantize_matches_the_ml_dtypes_reference(dtype, block):
    rs = np.random.RandomState(1)
    x = (rs.randn(130, 200) * np.exp(rs.randn(130, 1) * 3)).astype(np.float32)  # ragged edges, wide range
    blk = (1, 200) if block == "row" else block
    for rule in B.POW2_RULES:
        got = np.asarray(QDQ(jnp.asarray(x), dtype, block, "e8m0", rule))
        np.testing.assert_array_equal(got, _ref_qdq(x, dtype, blk, rule))


def test_scale_shapes_follow_the_block():
    x = jax.ShapeDtypeStruct((130, 200), jnp.float32)
    assert jax.eval_shape(lambda x: B.quantize(x, E4M3, (128, 128)), x).scale.shape == (2, 2)
    assert jax.eval_shape(lambda x: B.quantize(x, E4M3, "row"), x).scale.shape == (130, 1)
    assert jax.eval_shape(lambda x: B.quantize(x, E2M1, (1, 16), "e4m3", "exact"), x).scale.dtype == E4M3


OP_BY_OP = {"mxfp8": (E4M3, "e8m0", "rceil", False), "nvfp4-sr": (E2M1, "e4m3", "exact", True),
            "e5m2-float32": (E5M2, "float32", "exact", False)}


@pytest.mark.parametrize("name", [pytest.param(n, marks=() if n == "mxfp8" else pytest.mark.slow) for n in OP_BY_OP])
def test_jit_equals_op_by_op(name):  # op by op compiles every primitive on its own: one format in the default tier
    dtype, sf, rule, sr = OP_BY_OP[name]
    x = jnp.asarray(np.random.RandomState(2).randn(4, 32).astype(np.float32))
    key = jax.random.key(3, impl="threefry2x32") if sr else None
    with jax.disable_jit():  # every op on its own, as op-by-op dispatch runs them
        eager = _qdq(x, dtype, (1, 16), sf, rule, key)
    np.testing.assert_array_equal(np.asarray(eager), np.asarray(QDQ(x, dtype, (1, 16), sf, rule, key)))


@pytest.mark.parametrize("dtype,value", [(E2M1, 1.3), (E4M3, 1.0 + 0.3 / 8)], ids=["e2m1", "e4m3"])
def test_stochastic_rounding_is_unbiased(dtype, value):
    n = 40_000
    x = jnp.full((1, n), value, jnp.float32)
    # per-element scale 1 (block of one, float32 scale = amax / max would rescale): round the grid directly
    y = jax.jit(B.round_stochastic, static_argnums=1)(x, ELEM[dtype], jax.random.key(0, impl="threefry2x32"))
    y = np.asarray(y.astype(dtype).astype(jnp.float32), np.float64)
    err = y - value
    assert len(set(y.ravel().tolist())) == 2  # only the two neighbours
    assert abs(err.mean()) < 3 * err.std() / math.sqrt(n)
    nearest = float(np.float32(value).astype(dtype).astype(np.float32)) - value
    assert abs(nearest) > 10 * err.std() / math.sqrt(n)  # round-to-nearest would fail the same check


def test_hadamard_is_orthogonal_and_random():
    rs = np.random.RandomState(4)
    x, y = rs.randn(3, 40).astype(np.float32), rs.randn(5, 40).astype(np.float32)  # 40: padded to 48

    @jax.jit
    def run(x, y):
        s = B.hadamard_signs(jax.random.key(0))
        return B.hadamard(jax.random.key(0)), B.hadamard(jax.random.key(1)), B.apply_hadamard(x, s), \
            B.apply_hadamard(y, s)

    h, h1, hx, hy = (np.asarray(a) for a in run(x, y))
    assert (h @ h.T == np.eye(16)).all()
    assert set(np.abs(h).ravel().tolist()) == {0.25}
    assert not (h == h1).all()
    got = hx @ hy.T
    np.testing.assert_allclose(got, x @ y.T, rtol=1e-5, atol=1e-5)


def test_nvfp4_activations_near_1e_3_are_not_all_zero():
    x = np.random.RandomState(5).uniform(-2e-3, 2e-3, (8, 64)).astype(np.float32)
    g, out = jax.jit(lambda x: (lambda q: (q.global_scale, B.dequantize(q)))(B.quantize(x, E2M1, (1, 16), "e4m3",
                                                                                       "exact")))(x)
    assert float(g) == float(np.float32(np.abs(x).max()) / np.float32(448 * 6))
    out = np.asarray(out)
    assert (out != 0).mean() > 0.5
    assert np.abs(out - np.asarray(x)).max() <= 0.25 * 2e-3
    # without the per-tensor level (JAX's default global scale of 1) the E4M3 block scales flush to zero
    assert (np.abs(x).reshape(8, 4, 16).max(-1) / 6).astype(E4M3).astype(np.float32).max() == 0


def test_recipe_fields_are_validated():
    with pytest.raises(ValueError, match="only with block"):
        fp8.CurrentScaling(scale_format="e8m0")
    with pytest.raises(ValueError, match="does not go with"):
        fp8.CurrentScaling(block=(1, 32), scale_format="e8m0", scale_rule="exact")
    with pytest.raises(ValueError, match="block must be"):
        fp8.CurrentScaling(block=(0, 32))
    with pytest.raises(ValueError, match="float4_e2m1fn"):
        fp8.CurrentScaling(block=(1, 32), fwd_dtype=jnp.bfloat16)
    with pytest.raises(ValueError, match="high_precision_legs"):
        fp8.CurrentScaling(block=(1, 32), high_precision_legs=("fwd",))
    with pytest.raises(ValueError, match="2-D"):
        B.quantize(jnp.ones((2, 2, 2)), E4M3)


def test_a_nan_in_a_ragged_block_gives_the_nan_scale_under_jit():
    # 64 elements in a 1x128 block (zero-padded): XLA's CPU max drops a NaN beside the padding,
    # so the quantizer must find it on its own, or the NaN row decodes to zeros and a
    # skip-on-overflow check never sees it.
    x = np.ones((32, 64), np.float32)
    x[5] = np.nan
    x[9, 3] = np.inf
    for fmt, rule, dtype in (("e8m0", "ceil", jnp.float8_e4m3fn), ("float32", "exact", jnp.float8_e4m3fn),
                             ("e4m3", "exact", jnp.float4_e2m1fn)):
        qx = jax.jit(lambda a: fp8._blocks.quantize(a, dtype, (1, 128), fmt, rule))(x)
        got = np.asarray(fp8._blocks.dequantize(qx))
        assert np.isnan(got[5]).all() and np.isnan(got[9]).all(), fmt
        assert np.isfinite(np.delete(got, [5, 9], axis=0)).all(), fmt
    r = fp8.CurrentScaling(block=(1, 128), rhs_block=(128, 128), bwd_dtype=jnp.float8_e4m3fn, scale_format="e8m0",
                           scale_rule="ceil")
    out = np.asarray(jax.jit(lambda a, w: fp8.fp8_dot_general(a, w, (((1,), (0,)), ((), ())), r))(
        x, np.full((64, 8), 0.5, np.float32)))
    assert np.isnan(out[[5, 9]]).all() and np.isfinite(np.delete(out, [5, 9], axis=0)).all()
