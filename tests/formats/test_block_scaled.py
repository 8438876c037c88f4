"""The block-scaled quantizer (jaxmp/_formats/_block_scaled.py): E8M0 scale rules at their boundaries, the
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

import jaxmp
from jaxmp import fp8
from jaxmp._formats import _block_scaled as B

E4M3, E5M2, E2M1 = (np.dtype(d) for d in (jnp.float8_e4m3fn, jnp.float8_e5m2, jnp.float4_e2m1fn))
ELEM = {d: B.element_format(d) for d in (E4M3, E5M2, E2M1)}


def _ref_exponent(amax: float, dtype, rule: str) -> int:
    """The rules of jaxmp/_formats/_block_scaled.py in numpy (IEEE float32 with subnormals), written after
    the peers: torchao's FLOOR / EVEN / CEIL read amax's exponent field, RCEIL rounds the float32
    quotient amax / max up as JAX's cast_to_e8m0_with_rounding_up (and the hardware's cvt.rp)."""
    f = ELEM[dtype]
    a = np.float32(amax)
    if a == 0:
        return 0
    bits = int(a.view(np.int32))
    field, mant = (bits >> 23) & 0xFF, bits & 0x7FFFFF
    if rule == "even":
        field = ((bits + (1 << (23 - f.mbits - 1))) >> 23) & 0xFF
    if rule in ("floor", "even", "ceil"):
        e = field - 127 + (rule == "ceil" and mant > 0) - f.emax
    else:
        with np.errstate(under="ignore"):
            q = int((a / np.float32(f.max)).view(np.int32))
        qf, qm = q >> 23, q & 0x7FFFFF
        e = qf - 127 + (qm > 0 and qf != 0xFE and not (qf == 0 and qm <= 0x400000))
    return max(-127, min(127, e))


# The boundaries the issue names: E4M3's rules disagree at 0.9, 448 and 449.
E4M3_TABLE = {  # amax: (floor, even, ceil, rceil)
    0.0: (0, 0, 0, 0),
    0.9: (-9, -9, -8, -8),
    448.0: (0, 0, 1, 0),      # torchao's CEIL rounds amax's exponent up (448 = 1.75 * 2**8): 2**1
    449.0: (0, 0, 1, 1),
    480.0: (0, 0, 1, 1),
    496.0: (0, 1, 1, 1),      # mantissa 1.9375 rounds up to 2 in 3 bits: EVEN moves, FLOOR does not
    1e-40: (-127, -127, -127, -127),  # a subnormal amax: the smallest scale, not "zero"
}


@pytest.mark.parametrize("amax", sorted(E4M3_TABLE))
def test_e4m3_scale_table_at_the_boundaries(amax):
    table = _exponents(jnp.float32(amax), 0)
    got = [int(table[r]) for r in B.POW2_RULES]
    assert got == list(E4M3_TABLE[amax])
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
    assert int(_exponents(jnp.float32(amax), 0)["rceil"]) == -9
    assert abs(float(QDQ(jnp.array([[0.6, 0.1]], jnp.float32), E4M3, (1, 2), "e8m0", "rceil")[0, 0]) - 0.6) < 0.6 / 16


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
    for fmt, rule, dtype in (("e8m0", "rceil", jnp.float8_e4m3fn), ("float32", "exact", jnp.float8_e4m3fn),
                             ("e4m3", "exact", jnp.float4_e2m1fn)):
        qx = jax.jit(lambda a: jaxmp._formats._block_scaled.quantize(a, dtype, (1, 128), fmt, rule))(x)
        got = np.asarray(jaxmp._formats._block_scaled.dequantize(qx))
        assert np.isnan(got[5]).all() and np.isnan(got[9]).all(), fmt
        assert np.isfinite(np.delete(got, [5, 9], axis=0)).all(), fmt
    r = fp8.CurrentScaling(block=(1, 128), rhs_block=(128, 128), bwd_dtype=jnp.float8_e4m3fn, scale_format="e8m0",
                           scale_rule="rceil")
    out = np.asarray(jax.jit(lambda a, w: fp8.fp8_dot_general(a, w, (((1,), (0,)), ((), ())), r))(
        x, np.full((64, 8), 0.5, np.float32)))
    assert np.isnan(out[[5, 9]]).all() and np.isfinite(np.delete(out, [5, 9], axis=0)).all()


def test_rceil_is_jaxs_rule_and_ceil_is_torchaos_ceil():
    # Issue 59 item 2: "ceil" was the round-up of amax / max (torchao's RCEIL) under a CEIL label.
    # Now "rceil" is that rule, the one jax.nn.scaled_dot_general's MXFP8 quantizer uses (its own
    # code, run here on CPU), and "ceil" is torchao's CEIL: amax's exponent rounded up.
    from jax._src.cudnn import scaled_matmul_stablehlo as sm
    rs = np.random.RandomState(7)
    x = (rs.randn(64, 256) * np.exp(rs.randn(64, 1) * 4)).astype(np.float32)
    theirs_q, theirs_s = jax.jit(lambda v: sm.quantize(v, jax.nn.get_scaled_dot_general_config("mxfp8")))(x[None])
    theirs_s = np.asarray(jax.lax.bitcast_convert_type(theirs_s, jnp.uint8))[0]
    got = {r: jax.jit(lambda v, r=r: B.quantize(v, E4M3, (1, 32), "e8m0", r))(x) for r in ("ceil", "rceil")}
    np.testing.assert_array_equal(np.asarray(jax.lax.bitcast_convert_type(got["rceil"].scale, jnp.uint8)), theirs_s)
    np.testing.assert_array_equal(np.asarray(got["rceil"].q.astype(jnp.float32)),
                                  np.asarray(theirs_q[0].astype(jnp.float32)))
    ceil = np.asarray(jax.lax.bitcast_convert_type(got["ceil"].scale, jnp.uint8)).astype(int)
    amax = np.abs(x).reshape(64, 8, 32).max(-1)
    fields, mant = (amax.view(np.int32) >> 23) & 0xFF, amax.view(np.int32) & 0x7FFFFF
    np.testing.assert_array_equal(ceil, fields + (mant > 0) - 8)  # torchao's CEIL, from amax's bits
    assert (ceil != theirs_s).mean() > 0.5  # two different rules: most blocks disagree
    # The native MXFP8 path is taken for JAX's rule only.
    from jaxmp.fp8 import _hardware
    mx = {r: fp8.CurrentScaling(block=(1, 32), bwd_dtype=jnp.float8_e4m3fn, scale_format="e8m0", scale_rule=r)
          for r in ("ceil", "rceil")}
    reasons = {r: _hardware.native_block(mx[r], jax.devices("cpu")[0])[1] for r in mx}
    assert all("emulated" in v for v in reasons.values())


def test_subnormals_are_quantized_from_their_bits():
    # Issue 59 item 3: XLA:CPU flushes subnormals in float arithmetic; a block of 1e-40 got scale
    # 2**0 and decoded to zeros, and 3.66e-41 beside an amax of 8.339e-36 coded 0 (torchao: 2**-9).
    tiny = np.full((1, 32), 1e-40, np.float32)
    for rule in B.POW2_RULES:
        qx = jax.jit(lambda v, r=rule: B.quantize(v, E4M3, (1, 32), "e8m0", r))(tiny)
        assert int(np.asarray(jax.lax.bitcast_convert_type(qx.scale, jnp.uint8))[0, 0]) == 0, rule  # 2**-127
        want = (np.float32(1e-40) * np.float32(2.0 ** 127)).astype(E4M3).astype(np.float32) * np.float32(2.0 ** -127)
        out = np.asarray(QDQ(tiny, E4M3, (1, 32), "e8m0", rule))
        assert want > 0 and (out.view(np.int32) == np.float32(want).view(np.int32)).all(), rule
    x = np.zeros((1, 32), np.float32)
    x[0, :2] = 8.339e-36, 3.66e-41
    qx = jax.jit(lambda v: B.quantize(v, E4M3, (1, 32), "e8m0", "floor"))(x)
    assert float(qx.q[0, 1].astype(jnp.float32)) == 2.0 ** -9
    assert float(np.asarray(QDQ(x, E4M3, (1, 32), "e8m0", "floor"))[0, 1]) == np.float32(2.0 ** -134)
    # RCEIL's quotient near 2**-127 is rounded as IEEE float32 with subnormals (numpy) rounds it.
    for dtype in (E4M3, E5M2, E2M1):
        mid = np.float32(ELEM[dtype].max * 2.0 ** -127).view(np.int32)
        amax = np.arange(mid - 300, mid + 300, dtype=np.int32).view(np.float32)
        got = np.asarray(_exponents(jnp.asarray(amax), (E4M3, E5M2, E2M1).index(dtype))["rceil"])
        want = np.array([_ref_exponent(a, dtype, "rceil") for a in amax])
        np.testing.assert_array_equal(got, want)
        assert set(want.tolist()) == {-127, -126}
    # float32 and NVFP4 scales stay normal floats; the subnormal elements still code nonzero.
    for fmt, dt in (("float32", E4M3), ("e4m3", E2M1)):
        out = np.asarray(QDQ(tiny, dt, (1, 16), fmt, "exact"))
        assert (out > 0).all() and np.abs(out / 1e-40 - 1).max() < 0.5, fmt
