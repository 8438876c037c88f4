"""8-bit and 4-bit optimizer moments (jaxmp.lean.quantized_moments): the maps, one Adam step against an
independent NumPy re-derivation, the failure modes (an affine int8 ``nu``; the bf16 stall), and the
compositions: loss scaling with fp16 dynamic scaling, float32 masters, remainders, MultiSteps,
inject_hyperparams, chain with clipping, the Flax TrainState and check_health.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxmp
from jaxmp import _formats, _jaxpr, lean
from tests._support._arrays import leaf_bytes

# optax.adam's bias correction (Python float ** int32 count) is not strict-promotion clean.
pytestmark = pytest.mark.standard_promotion(reason="optax.adam: bias correction is a Python float ** int32 count")

BF16 = jnp.bfloat16



# ----------------------------------------------------------------------------------- the maps (NumPy, own)


def _np_dynamic_map(signed, exp_bits, total_bits):
    """bitsandbytes' create_dynamic_map re-derived: per decade 10**(e - exp_bits + 1), 2**e fractions
    (2**(e+1) unsigned) at the midpoints of linspace(0.1, 1); plus 0 and 1."""
    vals = [0.0, 1.0]
    for e in range(exp_bits):
        k = 2 ** (e + total_bits - 1 - exp_bits + (0 if signed else 1))
        edges = np.linspace(0.1, 1, k + 1, dtype=np.float32)
        mids = (edges[:-1] + edges[1:]) / np.float32(2)
        vals += list(np.float32(10.0 ** (e - exp_bits + 1)) * mids)
        if signed:
            vals += list(-np.float32(10.0 ** (e - exp_bits + 1)) * mids)
    return np.sort(np.asarray(vals, np.float32))


def test_code_maps_are_bitsandbytes_and_torchao_maps():
    # Bit for bit against the peers' own tables: tests/lean/test_lean_reference.py. Here the
    # re-derivation: the 8-bit maps are torch.linspace's points, within 6e-8 of NumPy's.
    for bits, signed, want in [(8, True, _np_dynamic_map(True, 7, 8)), (8, False, _np_dynamic_map(False, 7, 8)),
                               (4, True, _np_dynamic_map(True, 3, 4)),
                               (4, False, np.arange(1, 17, dtype=np.float32) / 16)]:
        got = _formats.code_map(bits, signed)
        assert got.shape == (2 ** bits,) and len(np.unique(got)) == 2 ** bits and (np.diff(got) > 0).all()
        np.testing.assert_allclose(got, want, rtol=0, atol=6e-8 if bits == 8 else 0)
    assert _formats.code_map(4, False).min() == 1 / 16   # no zero: a second moment never rounds to 0
    assert _formats.code_map(8, False).min() == 0 and _formats.code_map(8, True).max() == 1


def test_quantize_round_trip_packing_and_partial_block():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(7, 37)).astype(np.float32)      # 259 elements: a partial last block of 3
    for bits, block in ((8, 256), (4, 128), (4, 5)):
        grid = _formats.Grid(bits, block)
        codes, absmax = jax.jit(functools.partial(grid.quantize, signed=True))(x)
        n = -(-x.size // block)
        assert codes.dtype == jnp.uint8 and absmax.shape == (n,)
        assert codes.size == (x.size if bits == 8 else -(-x.size // 2))   # 4 bits: two codes a byte
        padded = np.pad(x.reshape(-1), (0, n * block - x.size)).reshape(n, block)
        np.testing.assert_array_equal(absmax, np.abs(padded).max(1))
        back = np.asarray(grid.dequantize(codes, absmax, True, x.shape))
        gap = np.diff(_formats.code_map(bits, True)).max()
        err = np.abs(back - x).reshape(-1)
        bound = np.repeat(np.asarray(absmax), block)[:x.size] * gap / 2
        assert (err <= bound * (1 + 1e-5)).all()   # -absmax is 1 - 0.993 (8 bits) from -0.993: half the top gap


@pytest.mark.parametrize("bits,block", [(8, 256), (8, 64), (4, 128)])
def test_rows_of_blocks_are_the_flattened_blocks_kept_in_the_leafs_shape(bits, block):
    # A last axis of whole blocks: the same blocks as the flattened leaf's (bitsandbytes' C order),
    # the codes bit for bit (stochastic ones too: their uniforms follow the C order), the absmax
    # the flat one reshaped to shape[:-1] + (blocks a row,), so a split of any axis keeps it whole.
    rng = np.random.default_rng(1)
    x = (rng.normal(size=(6, 4 * block)) * np.exp(rng.normal(size=(6, 1)) * 4)).astype(np.float32)
    grid = _formats.Grid(bits, block)
    assert grid.axis(x.shape) == 1
    assert grid.absmax_shape(x.shape) == (6, 4)
    key = jax.random.key(3)
    for k in (None, key):
        codes, absmax = grid.quantize(jnp.asarray(x), True, k)
        flat_codes, flat_absmax = grid.quantize(jnp.asarray(x.reshape(-1)), True, k)
        assert absmax.shape == (6, 4) and codes.shape == grid.codes_shape(x.shape)
        np.testing.assert_array_equal(np.asarray(absmax).reshape(-1), flat_absmax)
        np.testing.assert_array_equal(np.asarray(codes).reshape(-1), flat_codes)
        np.testing.assert_array_equal(grid.dequantize(codes, absmax, True, x.shape),
                                      np.asarray(grid.dequantize(flat_codes, flat_absmax, True,
                                                                 (x.size,))).reshape(x.shape))
    if bits == 8:
        want_codes, want_absmax = _np_quantize(x, _formats.code_map(8, True), block)
        np.testing.assert_array_equal(np.asarray(absmax).reshape(-1), want_absmax)
    # Slabs of the trailing axes that are a whole number of blocks; else flattened and padded.
    assert grid.absmax_shape((3, 4, block // 2)) == (3, 2)          # slabs of 2 rows
    assert grid.absmax_shape((6, block + 2)) == (-(-6 * (block + 2) // block),)
    stacked = (rng.normal(size=(3, 4, block // 2))).astype(np.float32)
    codes, absmax = grid.quantize(jnp.asarray(stacked), True)
    flat_codes, flat_absmax = grid.quantize(jnp.asarray(stacked.reshape(-1)), True)
    np.testing.assert_array_equal(np.asarray(codes).reshape(-1), flat_codes)
    np.testing.assert_array_equal(np.asarray(absmax).reshape(-1), flat_absmax)


# ----------------------------------------------------------------------------------- one Adam step, NumPy


def _np_quantize(x, qmap, block):
    """Blockwise absmax, then the argmin over the map of |x / absmax - entry| (nearest)."""
    flat = x.reshape(-1).astype(np.float32)
    n = -(-flat.size // block)
    blocks = np.pad(flat, (0, n * block - flat.size)).reshape(n, block)
    absmax = np.abs(blocks).max(1)
    normed = blocks / np.where(absmax > 0, absmax, np.float32(1))[:, None]
    codes = np.abs(normed[..., None] - qmap).argmin(-1).astype(np.uint8)
    return codes.reshape(-1)[:flat.size].reshape(x.shape), absmax


def _np_dequantize(codes, absmax, qmap, block):
    flat = qmap[codes.reshape(-1)]
    n = absmax.size
    blocks = np.pad(flat, (0, n * block - flat.size)).reshape(n, block) * absmax[:, None]
    return blocks.reshape(-1)[:codes.size].reshape(codes.shape)


def test_one_blockwise_8bit_adam_step_equals_a_numpy_rederivation():
    b1, b2, eps, lr = 0.9, 0.999, 1e-8, 1e-3
    tx = lean.quantized_moments(optax.adam(lr, b1=b1, b2=b2, eps=eps), bits=8)
    rng = np.random.default_rng(1)
    shape = (50, 100)                                     # 5000: 19 blocks and a partial one of 136
    params = {"w": np.zeros(shape, np.float32)}
    g1 = (rng.normal(size=shape) * np.exp(rng.normal(size=shape))).astype(np.float32)
    g2 = (rng.normal(size=shape) * np.exp(rng.normal(size=shape))).astype(np.float32)
    update = jax.jit(tx.update)
    _, s1 = update({"w": g1}, tx.init(params))
    u2, s2 = update({"w": g2}, s1)
    signed, unsigned = _np_dynamic_map(True, 7, 8), _np_dynamic_map(False, 7, 8)
    get = lambda s, f: (np.asarray(getattr(s.inner_state[0], f)["w"]), np.asarray(getattr(s.absmax[0], f)["w"]))  # noqa: E731
    mu = _np_dequantize(*get(s1, "mu"), signed, 256)
    nu = _np_dequantize(*get(s1, "nu"), unsigned, 256)
    # optax's order of operations in float32; 1 - b is a Python float there, rounded once to float32.
    mu = np.float32(1 - b1) * g2 + np.float32(b1) * mu
    nu = np.float32(1 - b2) * (g2 * g2) + np.float32(b2) * nu
    # XLA:CPU contracts a * x + b * y into an FMA where NumPy rounds twice: the absmax agree to 1 ulp
    # and a code may differ only where the value sits within that ulp of a midpoint between two entries.
    for field, want, qmap in (("mu", mu, signed), ("nu", nu, unsigned)):
        codes, absmax = get(s2, field)
        want_codes, want_absmax = _np_quantize(want, qmap, 256)
        np.testing.assert_allclose(absmax, want_absmax, rtol=2.4e-7, atol=0)
        normed = want.reshape(-1) / np.repeat(want_absmax, 256)[:want.size]
        mids = (qmap[:-1] + qmap[1:]) / 2
        near_tie = np.abs(normed[:, None] - mids).min(1) < 1e-6
        differ = codes.reshape(-1) != want_codes.reshape(-1)
        assert not (differ & ~near_tie).any(), (field, np.nonzero(differ & ~near_tie))
        assert differ.sum() <= 2, differ.sum()
    # The update the inner Adam returned: from the dequantized float32 moments, bias-corrected.
    want_u = -lr * (mu / (1 - b1 ** 2)) / (np.sqrt(nu / (1 - b2 ** 2)) + eps)
    np.testing.assert_allclose(np.asarray(u2["w"]), want_u, rtol=1e-5, atol=1e-9)
    assert int(s2.inner_state[0].count) == 2 and int(s2.count) == 2


# ----------------------------------------------------------------------------------- failure modes


def _affine_int8(x, block=256):
    """An affine int8 map with a zero point per block (min/max): what the dynamic map replaces."""
    blocks = x.reshape(-1, block)
    lo, hi = blocks.min(1, keepdims=True), blocks.max(1, keepdims=True)
    scale = jnp.where(hi > lo, (hi - lo) / 255, 1.0)
    zero = jnp.round(-lo / scale)
    q = jnp.clip(jnp.round(blocks / scale) + zero, 0, 255)
    return ((q - zero) * scale).reshape(x.shape)


def _dynamic(signed):
    def fq(x):
        grid = _formats.Grid(8, 256)
        return grid.dequantize(*grid.quantize(x, signed), signed, x.shape)
    return fq


def test_affine_int8_nu_diverges_where_the_dynamic_map_tracks_float32():
    """Adam on 0.5 * sum(a * x**2) with curvatures a spanning 2 decades in every block, lr 1e-2, 300
    steps. An affine int8 ``nu`` rounds the small coordinates' second moment to exactly 0, Adam divides
    by eps, and the loss blows up; with the unsigned dynamic map (and the signed one for mu) the loss
    falls by six orders of magnitude or more, as float32's does (measured: 4426 -> 1.5e-4 float32,
    1.2e-3 8-bit)."""
    n = 4096
    a = jnp.asarray(np.tile(10.0 ** np.linspace(-1, 1, 256), n // 256), jnp.float32)
    x0 = jnp.ones(n, jnp.float32)
    ident = lambda x: x  # noqa: E731

    def run(fq_mu, fq_nu):
        def body(carry, t):
            x, mu, nu = carry
            g = a * x
            mu = fq_mu(0.1 * g + 0.9 * mu)
            nu = fq_nu(0.001 * g * g + 0.999 * nu)
            step = (mu / (1 - 0.9 ** t)) / (jnp.sqrt(nu / (1 - 0.999 ** t)) + 1e-8)
            x = x - 1e-2 * step
            return (x, mu, nu), 0.5 * jnp.sum(a * x * x)
        _, losses = jax.lax.scan(body, (x0, jnp.zeros(n), jnp.zeros(n)), jnp.arange(1, 301, dtype=jnp.float32))
        return losses

    f32, dyn, affine = jax.jit(lambda: (run(ident, ident), run(_dynamic(True), _dynamic(False)),
                                        run(_dynamic(True), _affine_int8)))()
    f32, dyn, affine = map(np.asarray, (f32, dyn, affine))
    first = 0.5 * float(jnp.sum(a))
    assert f32[-1] < 1e-6 * first and dyn[-1] < 1e-6 * first, (f32[-1], dyn[-1])   # both converge
    assert not np.isfinite(affine).all() or affine.max() > 1e6 * first, affine.max()


NU_STEPS = 5000


@pytest.mark.slow
def test_nu_tracks_float32_where_round_to_nearest_bf16_stalls():
    """The bf16 stall test's setting (tests/lean/test_lean.py): Adam, b2 = 0.999, g**2 = 1, 5000 steps,
    float32 nu = 1 - 0.999**5000 = 0.99329. bf16 round-to-nearest sticks at 0.25; blockwise codes are
    relative to the block's absmax, so a block of equal values is stored exactly at 8 and 4 bits,
    nearest or stochastic."""
    adam = optax.adam(1e-3, b1=0.9, b2=0.999)
    params, grads = {"w": jnp.zeros(4096)}, {"w": jnp.ones(4096)}
    txs = [adam] + [lean.quantized_moments(adam, bits=b, rounding=r, key=0 if r == "stochastic" else None)
                    for b in (8, 4) for r in ("nearest", "stochastic")]

    @jax.jit
    def run(states):
        return [jax.lax.fori_loop(0, NU_STEPS, lambda i, s, tx=tx: tx.update(grads, s, params)[1], s)
                for tx, s in zip(txs, states)]

    out = run([tx.init(params) for tx in txs])
    ref = np.asarray(out[0][0].nu["w"])
    assert abs(ref[0] - (1 - 0.999 ** NU_STEPS)) < 1e-4 and ref[0] > 0.993
    for (bits, _), s in zip([(8, 0), (8, 1), (4, 0), (4, 1)], out[1:]):
        nu = s.grid.dequantize(s.inner_state[0].nu["w"], s.absmax[0].nu["w"], False, (4096,))
        np.testing.assert_array_equal(np.asarray(nu), ref)


# ----------------------------------------------------------------------------------- the state


@pytest.mark.slow
def test_state_layout_small_leaves_scalars_and_classification():
    tx = lean.quantized_moments(optax.inject_hyperparams(optax.adamw)(learning_rate=1e-3), bits=4)
    params = {"w": jnp.zeros((64, 96)), "odd": jnp.zeros((65, 65)), "b": jnp.zeros(96), "nu": jnp.zeros((64, 64))}
    state = tx.init(params)
    adam = state.inner_state.inner_state[0]
    assert adam.mu["w"].dtype == jnp.uint8 and adam.mu["w"].shape == (64, 48)     # two codes a byte
    assert adam.mu["odd"].shape == (-(-65 * 65 // 2),)                              # odd last axis: flat
    assert adam.mu["b"].dtype == jnp.float32 and state.absmax.inner_state[0].mu["b"] is None  # < 4096: float32
    assert state.absmax.inner_state[0].nu["w"].shape == (64 * 96 // 128,)
    assert adam.count.dtype == jnp.int32 and state.inner_state.hyperparams["learning_rate"].dtype == jnp.float32
    # A param named "nu" (a dict key) is a signed mu leaf: only NamedTuple fields classify.
    from jaxmp.lean._quantized import _non_negative
    paths = dict(jax.tree_util.tree_leaves_with_path(adam))
    kinds = {jax.tree_util.keystr(p): _non_negative(p) for p in paths}
    assert kinds[".mu['nu']"] is False and kinds[".nu['w']"] is True
    # A mu leaf goes negative: the signed map keeps the sign.
    grads = {k: -jnp.ones_like(v) for k, v in params.items()}
    upd, new = jax.jit(tx.update)(grads, state, params)
    mu = _formats.Grid(4, 128).dequantize(new.inner_state.inner_state[0].mu["w"], new.absmax.inner_state[0].mu["w"],
                                            True, (64, 96))
    assert (np.asarray(mu) < 0).all() and (np.asarray(upd["w"]) > 0).all()
    assert jax.tree_util.tree_structure(new) == jax.tree_util.tree_structure(state)


@pytest.mark.parametrize("make,exc,pattern", [
    (lambda: lean.quantized_moments(optax.adam(0.1), bits=6), ValueError, r"bits must be 8 or 4"),
    (lambda: lean.quantized_moments(optax.adam(0.1), block=1), ValueError, r"block must be an int >= 2"),
    (lambda: lean.quantized_moments(optax.adam(0.1), min_size=-1), ValueError, r"min_size must be"),
    (lambda: lean.quantized_moments(optax.adam(0.1), rounding="up"), ValueError, r"'nearest' or 'stochastic'"),
    (lambda: lean.quantized_moments(optax.adam(0.1), rounding="stochastic"), TypeError, r"needs key="),
    (lambda: lean.quantized_moments(optax.adam(0.1)).update({"w": jnp.ones(2)}, optax.adam(0.1).init(
        {"w": jnp.ones(2)})), TypeError, r"QuantizedMomentsState"),
    (lambda: lean.quantized_moments(optax.adam(0.1)).update(
        {"w": jnp.ones((64, 128))}, lean.quantized_moments(optax.adam(0.1)).init({"w": jnp.ones((128, 64))})),
     ValueError, r"state leaf at .*mu\['w'\].*made for other params"),
    (lambda: lean.quantized_moments(optax.adam(0.1), bits=4).update(
        {"w": jnp.ones((64, 128))}, lean.quantized_moments(optax.adam(0.1)).init({"w": jnp.ones((64, 128))})),
     ValueError, r"state was made with bits=8, block=256, this transformation has bits=4, block=128"),
    (lambda: lean.quantized_moments(optax.adam(0.1), slice_size=0), ValueError, r"slice_size must be an int >= 1"),
])
def test_bad_inputs(make, exc, pattern):
    with pytest.raises(exc, match=pattern):
        make()


# ----------------------------------------------------------------------------------- compositions


def _problem(dtype=BF16, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(64, 128)).astype(np.float32)
    y = (x @ rng.normal(size=(128, 4)) / 10).astype(np.float32)
    params = {"w": jnp.asarray(rng.normal(size=(128, 64)) / 10, dtype), "v": jnp.asarray(rng.normal(size=(64, 4)) / 8,
                                                                                        dtype)}
    return x, y, params


def _loss(p, x, y):
    h = jnp.tanh(x @ p["w"].astype(jnp.float32))
    return jnp.mean((h @ p["v"].astype(jnp.float32) - y) ** 2)


def _step(tx, x, y):
    @jax.jit
    def step(params, state, poison):
        loss, grads = jaxmp.value_and_grad(_loss, state)(params, x, y)
        grads = jax.tree_util.tree_map(lambda g: jnp.where(poison, jnp.inf, g).astype(g.dtype), grads)
        updates, state = tx.update(grads, state, params)
        return jaxmp.apply_updates(params, updates, state), state, loss
    return step


def test_inside_loss_scaling_fp16_dynamic_a_skipped_step_leaves_every_leaf_bitwise():
    x, y, params = _problem(jnp.float16)
    tx = jaxmp.loss_scaling(lean.quantized_moments(optax.adamw(1e-2), bits=8), jaxmp.DynamicLossScale(2.0**10),
                            master_weights=True)
    state = tx.init(params)
    step = _step(tx, x, y)
    losses = []
    for _ in range(3):
        params, state, loss = step(params, state, jnp.array(False))
        losses.append(float(loss))
    q = jaxmp._tree.find_states(state, lean.QuantizedMomentsState)[0]
    assert q.inner_state[0].mu["w"].dtype == jnp.uint8 and int(q.count) == 3
    skipped_p, skipped_s, _ = step(params, state, jnp.array(True))
    assert leaf_bytes(skipped_p) == leaf_bytes(params)
    q2 = jaxmp._tree.find_states(skipped_s, lean.QuantizedMomentsState)[0]
    assert leaf_bytes(q2) == leaf_bytes(q)          # codes, absmax, the small float32 leaves, counts, key
    assert float(jaxmp.get_loss_scale(skipped_s).loss_scale) == 2.0**9 and int(jaxmp.scaling_stats(skipped_s)["total_skips"]) == 1
    params, state, loss = step(params, state, jnp.array(False))
    assert float(loss) < losses[0]


@pytest.mark.slow
def test_remainders_8bit_is_bitwise_float32_masters_with_8bit_moments():
    """param_remainders(quantized) vs master_weights(quantized), fed the same gradients (open loop, as
    tests/lean/test_lean.py's remainder test): the same inner computation on the same float32 masters,
    so the same masters, codes and scales at each of 30 steps."""
    x, y, params = _problem()
    ref = jaxmp.loss_scaling(lean.quantized_moments(optax.adamw(1e-2)), "none", master_weights=True)
    rem = jaxmp.loss_scaling(lean.preset("remainders-8bit", optax.adamw(1e-2)), "none")

    @jax.jit
    def step(p_ref, s_ref, p_rem, s_rem):
        grads = jax.grad(_loss)(p_ref, x, y)
        u, s_ref = ref.update(grads, s_ref, p_ref)
        v, s_rem = rem.update(grads, s_rem, p_rem)
        return jaxmp.apply_updates(p_ref, u, s_ref), s_ref, jaxmp.apply_updates(p_rem, v, s_rem), s_rem

    carry = (params, ref.init(params), params, rem.init(params))
    for _ in range(30):
        carry = step(*carry)
        p_ref, s_ref, p_rem, s_rem = carry
        assert leaf_bytes(lean.remainder_master(p_rem, s_rem)) == leaf_bytes(jaxmp.master_params(s_ref))
    q_ref, q_rem = (jaxmp._tree.find_states(s, lean.QuantizedMomentsState)[0] for s in (s_ref, s_rem))
    assert leaf_bytes(q_ref) == leaf_bytes(q_rem) and q_ref.inner_state[0].mu["w"].dtype == jnp.uint8
    assert float(_loss(p_rem, x, y)) < float(_loss(params, x, y)) / 2


@pytest.mark.parametrize("name", ["bf16-sr-8bit", pytest.param("remainders-4bit", marks=pytest.mark.slow)])
def test_presets_with_multisteps_move_every_second_step_and_learn(name):
    x, y, params = _problem()
    tx = jaxmp.loss_scaling(lean.preset(name, optax.adamw(1e-2), key=1, accumulate_steps=2), "none")
    step, state = _step(tx, x, y), tx.init(params)
    first = float(_loss(params, x, y))
    for i in range(1, 9):
        new, state, _ = step(params, state, jnp.array(False))
        assert (leaf_bytes(new) != leaf_bytes(params)) == (i % 2 == 0), i
        params = new
    skipped_p, skipped_s, _ = step(params, state, jnp.array(True))
    assert leaf_bytes(skipped_p) == leaf_bytes(params) and leaf_bytes(skipped_s.inner_state) == leaf_bytes(state.inner_state)
    assert float(_loss(params, x, y)) < first


def test_multisteps_goes_outside_the_quantized_moments_so_the_accumulator_stays_float32():
    # docs/lean-recipes.md#gradient-accumulation: MultiSteps(quantized_moments(adamw)) keeps the
    # gradient accumulator float32 (only Adam's moments become codes), as the presets'
    # accumulate_steps does; the other order classes the accumulator as one more signed state leaf
    # and stores the sum of the mini-batch gradients in 8 bits, requantized on every mini-step.
    params = {"w": jax.ShapeDtypeStruct((64, 128), BF16)}
    dtypes = lambda tx: {jax.tree_util.keystr(p): x.dtype for p, x in  # noqa: E731
                         jax.tree_util.tree_leaves_with_path(jax.eval_shape(tx.init, params))}
    outside = dtypes(optax.MultiSteps(lean.quantized_moments(optax.adamw(1e-3)), 2).gradient_transformation())
    inside = dtypes(lean.quantized_moments(optax.MultiSteps(optax.adamw(1e-3), 2).gradient_transformation()))
    preset = dtypes(lean.preset("remainders-8bit", optax.adamw(1e-3), accumulate_steps=2))
    acc = lambda d: [v for k, v in d.items() if "acc_grads" in k and "absmax" not in k]  # noqa: E731
    moments = lambda d: [v for k, v in d.items() if k.endswith(("mu['w']", "nu['w']")) and "absmax" not in k]  # noqa: E731
    assert acc(outside) == acc(preset) == [np.dtype(np.float32)] and acc(inside) == [np.dtype(np.uint8)]
    assert moments(outside) == moments(inside) == moments(preset) == [np.dtype(np.uint8)] * 2


def test_inject_hyperparams_and_chain_with_clipping_inside():
    """The hyperparameters stay float32 scalars a schedule can set; clipping runs before the quantized
    Adam; after one step the dequantized moments are float32 Adam's to within half a map gap per block."""
    inner = optax.chain(optax.clip_by_global_norm(1.0), optax.inject_hyperparams(optax.adam)(learning_rate=1e-2))
    tx = lean.quantized_moments(inner, bits=8)
    params = {"w": jnp.zeros((64, 128))}
    grads = {"w": jnp.asarray(np.random.default_rng(2).normal(size=(64, 128)), jnp.float32)}   # norm ~90: clipped
    state = tx.init(params)
    upd, new = jax.jit(tx.update)(grads, state, params)
    ref_upd, ref = jax.jit(inner.update)(grads, inner.init(params), params)
    adam, scales = new.inner_state[1].inner_state[0], new.absmax[1].inner_state[0]
    gap = np.diff(_formats.code_map(8, True)).max()
    for field, signed in (("mu", True), ("nu", False)):
        deq = _formats.Grid(8, 256).dequantize(getattr(adam, field)["w"], getattr(scales, field)["w"], signed,
                                                 (64, 128))
        want = np.asarray(getattr(ref[1].inner_state[0], field)["w"])
        bound = np.repeat(np.asarray(getattr(scales, field)["w"]), 256).reshape(64, 128) * gap / 2
        assert (np.abs(np.asarray(deq) - want) <= bound * 1.0001).all(), field
    np.testing.assert_array_equal(np.asarray(upd["w"]), np.asarray(ref_upd["w"]))   # step 1 reads g, not codes
    assert float(jnp.abs(upd["w"]).max()) == pytest.approx(1e-2, rel=1e-3)
    # A new learning rate in the state is read by the next update.
    hyper = dict(new.inner_state[1].hyperparams, learning_rate=jnp.float32(0.0))
    state2 = new._replace(inner_state=(new.inner_state[0], new.inner_state[1]._replace(hyperparams=hyper)))
    upd2, _ = jax.jit(tx.update)(grads, state2, params)
    assert float(jnp.abs(upd2["w"]).max()) == 0.0


@pytest.mark.slow
def test_flax_train_state_and_check_health():
    import flax.linen as nn

    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(4)(nn.tanh(nn.Dense(128)(x)))

    x, y, _ = _problem()
    model = jaxmp.flax.mixed_precision(MLP(), "O2-bf16")
    variables = model.init(jax.random.key(0), x)
    tx = jaxmp.loss_scaling(lean.preset("bf16-sr-8bit", optax.adamw(1e-2), key=0), "none")
    state = jaxmp.flax.TrainState.create(model, variables, tx)

    def loss_fn(logits, batch):
        return jnp.mean((logits.astype(jnp.float32) - batch[1]) ** 2)

    step = jax.jit(jaxmp.flax.make_train_step(loss_fn=loss_fn))
    losses = []
    for _ in range(5):
        state, metrics = step(state, (x, y))
        losses.append(float(metrics["loss"]))
    assert losses[-1] < losses[0]
    q = jaxmp._tree.find_states(state.opt_state, lean.QuantizedMomentsState)[0]
    # Dense_1 is the 128 x 128 kernel (Flax numbers the modules as they are built: Dense(4) first).
    assert q.inner_state[0].mu["Dense_1"]["kernel"].dtype == jnp.uint8
    assert q.inner_state[0].mu["Dense_0"]["kernel"].dtype == jnp.float32     # 512 elements: float32
    bad_x = x.copy()
    bad_x[0, 0] = np.inf
    for _ in range(3):
        new, metrics = step(state, (bad_x, y))
        assert not bool(metrics["last_step_finite"]) and leaf_bytes(new.opt_state.inner_state) == leaf_bytes(state.opt_state.inner_state)
        assert leaf_bytes(new.params) == leaf_bytes(state.params)
        state = new
    # A block that overflowed is named by its path in the state (check_health's tree=).
    planted = jax.tree_util.tree_map(lambda a: a, q)
    planted.absmax[0].nu["Dense_1"]["kernel"] = planted.absmax[0].nu["Dense_1"]["kernel"].at[3].set(jnp.inf)
    with pytest.raises(jaxmp.TrainingDivergedError, match=r"3 consecutive.*absmax.*nu.*Dense_1.*kernel"):
        jaxmp.check_health(state.opt_state, max_consecutive_skips=2, tree=planted)


@pytest.mark.slow
def test_fidelity_8bit_and_4bit_against_float32_masters():
    """The tanh MLP of tests/lean/test_lean.py's fidelity test (3 seeds, 1500 AdamW steps, cosine
    decay), every leaf quantized (min_size=0): the 8-bit recipes end within the float32-master seed
    spread; prints the table of docs/lean-recipes.md#8-bit-and-4-bit-moments."""
    from tests.lean.test_lean import FIDELITY_STEPS, _train_seeds

    sched = optax.cosine_decay_schedule(1e-2, FIDELITY_STEPS)
    ref, _ = _train_seeds(lambda s: lean.preset("fp32-masters", optax.adamw(sched)))
    rows = {"fp32-masters (reference)": ref}
    for outer, wrap in (("remainders", lambda t, s: lean.param_remainders(t)), ("SR params", lean.bf16_params)):
        for bits in (8, 4):
            for r in ("nearest", "stochastic"):
                rows[f"{outer} + {bits}-bit, {r}"], _ = _train_seeds(lambda s, b=bits, r=r, wrap=wrap: wrap(
                    lean.quantized_moments(optax.adamw(sched), s if r == "stochastic" else None, bits=b, rounding=r,
                                           min_size=0), s))
    for name, v in rows.items():
        print(f"| {name} | {' | '.join(f'{x:.5f}' for x in v)} | {v.mean():.5f} |")
    tolerance = max(ref.max() - ref.min(), 0.01 * ref.mean())
    for name, v in rows.items():
        if "8-bit" in name:
            assert abs(v.mean() - ref.mean()) <= tolerance, (name, v, ref)


@pytest.mark.slow  # orbax's first save and restore: seconds
@pytest.mark.standard_promotion(reason="optax's Adam bias correction mixes a float with its int32 count")
def test_an_orbax_checkpoint_of_8bit_state_resumes_bitwise(tmp_path):
    # Codes (uint8), block absmax (float32), the key and the counts round-trip through orbax, and
    # the resumed run is bitwise the uninterrupted one (a poisoned step in each half).
    ocp = pytest.importorskip("orbax.checkpoint")
    x, y, params = _problem()
    tx = jaxmp.loss_scaling(lean.preset("bf16-sr-8bit", optax.adamw(1e-2), key=5), "none")
    step = _step(tx, x, y)
    poisons = [False, True, False, False, True, False]

    def run(p, s, flags):
        for flag in flags:
            p, s, _ = step(p, s, jnp.array(flag))
        return p, s

    p_all, s_all = run(params, tx.init(params), poisons)
    p_half, s_half = run(params, tx.init(params), poisons[:3])
    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(tmp_path / "ckpt", {"params": p_half, "opt_state": s_half})
        ckpt.wait_until_finished()
        target = jax.tree_util.tree_map(ocp.utils.to_shape_dtype_struct, {"params": p_half, "opt_state": s_half})
        restored = ckpt.restore(tmp_path / "ckpt", target)
    q = jaxmp._tree.find_states(restored["opt_state"], lean.QuantizedMomentsState)[0]
    assert q.inner_state[0].mu["w"].dtype == jnp.uint8     # the codes came back as codes
    assert leaf_bytes(restored) == leaf_bytes({"params": p_half, "opt_state": s_half})
    p_res, s_res = run(restored["params"], restored["opt_state"], poisons[3:])
    assert leaf_bytes(p_res) == leaf_bytes(p_all) and leaf_bytes(s_res) == leaf_bytes(s_all)
    assert int(jaxmp.scaling_stats(s_all)["total_skips"]) == 2


@pytest.mark.parametrize("bits,signed", [(8, True), (8, False), (4, True), (4, False)])
def test_the_one_pass_code_search_is_bitwise_searchsorted(bits, signed):
    # The quantizer finds codes by a bucket lookup on the value's bits plus two compares (one
    # fused pass); it must count exactly as jnp.searchsorted does, at and around every entry and
    # midpoint, at +-0, +-1 and subnormals, for both sides (nearest and stochastic rounding).
    rng = np.random.default_rng(0)
    qmap = _formats.code_map(bits, signed)
    mids = (qmap[:-1] + qmap[1:]) / np.float32(2)
    edges = np.concatenate([mids, qmap, [0.0, -0.0, 1.0, -1.0, 1e-30, -1e-30, 1e-45, -1e-45]]).astype(np.float32)
    x = np.concatenate([rng.uniform(-1.0 if signed else 0.0, 1.0, 4096), edges,
                        np.nextafter(edges, np.float32(2)), np.nextafter(edges, np.float32(-2))]).astype(np.float32)
    x = np.clip(x, -1.0 if signed else 0.0, 1.0).astype(np.float32)
    for side, table in (("left", mids), ("right", qmap)):
        got = jax.jit(lambda v, t=table, s=side: _formats._code_maps._count(v, t, s))(x)
        want = jnp.searchsorted(jnp.asarray(table), jnp.asarray(x), side=side)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def _update_bytes(tx, dtype):
    """Bytes accessed and temporaries (XLA's deterministic figures) of one jitted update + apply,
    per parameter, on two 1024x1024 weights and a bias."""
    rng = np.random.default_rng(0)
    params = {k: jnp.asarray(rng.normal(size=s) / 30, dtype) for k, s in
              {"w1": (1024, 1024), "w2": (1024, 1024), "b": (1024,)}.items()}
    grads = jax.tree_util.tree_map(lambda a: (a * 0.01).astype(dtype), params)
    state = tx.init(params)

    def update(p, s, g):
        u, s = tx.update(g, s, p)
        plain = not jaxmp._tree.find_states(s, jaxmp.LossScalingState)
        return (optax.apply_updates(p, u) if plain else jaxmp.apply_updates(p, u, s)), s
    compiled = jax.jit(update, donate_argnums=(0, 1)).lower(params, state, grads).compile()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    n = sum(x.size for x in jax.tree_util.tree_leaves(params))
    state_bytes = sum(x.nbytes for x in jax.tree_util.tree_leaves((params, state)))
    return state_bytes / n, cost["bytes accessed"] / n, compiled.memory_analysis().temp_size_in_bytes / n


@pytest.mark.slow  # six compiles of a 2 M-parameter update
@pytest.mark.standard_promotion(reason="optax's Adam bias correction mixes a float with its int32 count")
def test_update_bytes_per_parameter_against_float32_adamw():
    # The table of docs/lean-recipes.md#what-the-update-costs (printed with -s).
    rows = {"float32 AdamW (optax alone)": _update_bytes(optax.adamw(1e-3), jnp.float32),
            "O2-bf16 masters": _update_bytes(jaxmp.loss_scaling(optax.adamw(1e-3), "none", master_weights=True),
                                             BF16)}
    for name in ("bf16-sr", "remainders-8bit", "bf16-sr-8bit", "bf16-sr-4bit"):
        rows[name] = _update_bytes(jaxmp.loss_scaling(lean.preset(name, optax.adamw(1e-3), key=0), "none"), BF16)
    base = rows["float32 AdamW (optax alone)"][1]
    for name, (state, accessed, temp) in rows.items():
        print(f"| {name} | {state:.2f} | {accessed:.0f} | {accessed / base:.1f}x | {temp:.0f} |")
    assert rows["bf16-sr-8bit"][0] < 4.1 and rows["remainders-8bit"][0] < 6.1
    # One pass for the code search: well under searchsorted's (336 and 310 B/param before).
    assert rows["bf16-sr-8bit"][1] < 4.5 * base and rows["remainders-8bit"][1] < 4 * base


# ----------------------------------------------------------------------------------- a slice at a time


def _has_loop(fn, *args) -> bool:
    return any(_jaxpr.primitive_kind(e) in ("scan", "while") for e in _jaxpr.equations(jax.make_jaxpr(fn)(*args)))


def _sliced_pair(make, params, steps=2, seed=0):
    """``make(slice_size)``'s updates and states after ``steps`` updates, for small slices and whole leaves."""
    rng = np.random.default_rng(seed)
    grads = [jax.tree_util.tree_map(lambda x: jnp.asarray(rng.normal(size=x.shape), x.dtype), params)
             for _ in range(steps)]
    out = []
    for slice_size in (256, None):
        tx = make(slice_size)
        s, fn = tx.init(params), jax.jit(tx.update)
        for g in grads:
            u, s = fn(g, s, params)
        out.append((u, s, _has_loop(tx.update, grads[0], tx.init(params), params)))
    return out


SLICE_PARAMS = {"rows": (24, 256), "flat": (40, 100), "vec": (3000,), "cube": (6, 4, 128), "small": (8,)}


@pytest.mark.standard_promotion(reason="optax's Adam bias correction mixes a float with its int32 count")
@pytest.mark.parametrize("bits,rounding", [(8, "nearest"), (4, "nearest"), (8, "stochastic")])
def test_the_update_a_slice_at_a_time_is_the_whole_leaf_update(bits, rounding):
    # Rows of blocks, flattened blocks (100 is no whole number of 256), a 1-D and a 3-D leaf, a
    # small one (whole, beside the slices), AdamW with a mask on the params' rank: the same codes
    # (the stochastic ones draw each slice's own bits), the absmax and updates to float32's
    # rounding (XLA contracts multiply-adds differently in the two programs; so does plain optax
    # when another leaf's shape changes).
    rng = np.random.default_rng(2)
    params = {k: jnp.asarray(rng.normal(size=s), jnp.float32) for k, s in SLICE_PARAMS.items()}
    inner = optax.adamw(1e-2, mask=lambda t: jax.tree_util.tree_map(lambda x: x.ndim > 1, t))
    (u, s, looped), (u0, s0, looped0) = _sliced_pair(
        lambda ss: lean.quantized_moments(inner, 1 if rounding == "stochastic" else None, bits=bits, rounding=rounding,
                                          min_size=0, slice_size=ss), params)
    assert looped and not looped0
    codes = lambda st: [x for x in jax.tree_util.tree_leaves(st.inner_state) if x.dtype == jnp.uint8]  # noqa: E731
    same = [np.mean(np.asarray(a) == np.asarray(b)) for a, b in zip(codes(s), codes(s0))]
    assert min(same) >= 0.999, same
    for a, b in zip(jax.tree_util.tree_leaves(s.absmax), jax.tree_util.tree_leaves(s0.absmax)):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=0)
    for k in params:
        np.testing.assert_allclose(u[k], u0[k], rtol=1e-5, atol=1e-9)


@pytest.mark.standard_promotion(reason="optax's Adam bias correction mixes a float with its int32 count")
@pytest.mark.parametrize("wrap", ["bf16_params", "param_remainders"])
def test_lean_wrappers_hand_their_bfloat16_grads_and_params_to_the_slices_unwidened(wrap):
    params = {k: jnp.asarray(np.random.default_rng(3).normal(size=s), BF16) for k, s in SLICE_PARAMS.items()}

    def make(ss):
        q = lean.quantized_moments(optax.adamw(1e-2), bits=8, min_size=0, slice_size=ss)
        return lean.bf16_params(q, key=4) if wrap == "bf16_params" else lean.param_remainders(q)

    (u, s, looped), (u0, s0, _) = _sliced_pair(make, params, steps=1)
    assert looped
    for k in params:
        np.testing.assert_allclose(u[k], u0[k], rtol=1e-5, atol=1e-9)
    for a, b in zip(jax.tree_util.tree_leaves(s), jax.tree_util.tree_leaves(s0)):
        if a.dtype != jnp.int16:   # codes, absmax, counts (the remainders: the masters below)
            assert np.mean(np.asarray(a) == np.asarray(b)) >= 0.999
    if wrap == "param_remainders":   # the float32 masters the remainders complete, to their rounding
        masters = [lean.remainder_master(jaxmp.apply_updates(params, upd), st) for upd, st in ((u, s), (u0, s0))]
        for k in params:
            np.testing.assert_allclose(masters[0][k], masters[1][k], rtol=1e-6, atol=1e-8)   # the ulp of a 1e-2 step


@pytest.mark.parametrize("inner", [
    lambda: optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-2)),   # a norm over every leaf
    lambda: optax.adafactor(1e-2),                                            # factored moments
])
@pytest.mark.standard_promotion(reason="optax's transforms mix a float with their int32 counts")
def test_an_update_that_is_not_per_element_is_run_on_whole_leaves(inner):
    params = {"w": jnp.ones((64, 128)), "v": jnp.ones(4096)}
    tx = lean.quantized_moments(inner(), min_size=0, slice_size=256)
    assert not _has_loop(tx.update, params, tx.init(params), params)
    u, _ = jax.jit(tx.update)(params, tx.init(params), params)
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree_util.tree_leaves(u))


@pytest.mark.standard_promotion(reason="optax's Adam bias correction mixes a float with its int32 count")
def test_a_slice_at_a_time_cuts_the_updates_temporaries():
    # XLA's own (deterministic) figure for the jitted update of a 2048x2048 bfloat16 weight:
    # the whole-leaf program holds both moments in float32, old and new (16 bytes a parameter);
    # a slice at a time keeps one slice's, plus the float32 updates the optax interface returns
    # and the copies of the skip (10.3).
    p = {"w": jax.ShapeDtypeStruct((2048, 2048), BF16)}
    temp = {}
    for ss in (1 << 16, None):
        tx = jaxmp.loss_scaling(lean.bf16_params(lean.quantized_moments(optax.adamw(1e-3), slice_size=ss), key=0),
                                "none")
        compiled = jax.jit(tx.update_and_apply, donate_argnums=(1, 2)).lower(p, jax.eval_shape(tx.init, p), p).compile()
        temp[ss] = compiled.memory_analysis().temp_size_in_bytes / 2048**2
    assert temp[None] > 15 and temp[1 << 16] < 11, temp
