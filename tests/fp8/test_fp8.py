"""jaxmp.fp8: scale and amax-history updates against a hand computation, the scaled fp8 dot."""


import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxmp
from jaxmp import fp8

E4M3_MAX, E5M2_MAX = 448.0, 57344.0


def hand_delayed(history_length, reduction, margin, amaxes):
    """The delayed-scaling recurrence, in plain Python floats."""
    history, scale, out = [0.0] * history_length, 1.0, []
    for a in amaxes:
        if np.isfinite(a):
            history = [a] + history[:-1]
            ref = history[0] if reduction == "most_recent" else max(history)
            if ref > 0:
                scale = E4M3_MAX / 2.0**margin / ref
        out.append((scale, list(history)))
    return out


@pytest.mark.parametrize("reduction", ["max", "most_recent"])
@pytest.mark.parametrize("margin", [0, 1])
def test_delayed_scaling_follows_the_hand_recurrence_through_zero_and_non_finite_amax(reduction, margin):
    recipe = fp8.DelayedScaling(history_length=3, reduction=reduction, margin=margin)
    amaxes = [2.0, 0.0, 8.0, float("inf"), 0.5, float("nan"), 0.0, 0.0, 0.0, 1.0]
    meta = recipe.init_meta()
    update = jax.jit(lambda m, x: fp8._scaling.update_meta(m, x, recipe))
    for (want_scale, want_history), a in zip(hand_delayed(3, reduction, margin, amaxes), amaxes):
        meta = update(meta, np.array([a / 2, -a], np.float32))
        np.testing.assert_allclose(meta.amax_history, want_history, rtol=1e-7)
        np.testing.assert_allclose(float(meta.scale), want_scale, rtol=1e-6)


def test_all_zero_history_keeps_the_old_scale_and_non_finite_amax_changes_nothing():
    recipe = fp8.DelayedScaling(history_length=2)
    meta = fp8.Fp8Meta(np.float32(7.0), np.zeros(2, np.float32))
    # Both updates in one compiled program (eagerly, each of update_meta's ops compiles on its own).
    after_zero, after_nan = jax.jit(lambda m, zero, nan: (fp8._scaling.update_meta(m, zero, recipe),
                                                          fp8._scaling.update_meta(m, nan, recipe)))(
        meta, np.zeros(4, np.float32), np.array([1.0, np.nan], np.float32))
    assert float(after_zero.scale) == 7.0
    assert float(after_nan.scale) == 7.0 and not np.any(np.asarray(after_nan.amax_history))


def test_compute_scale_and_quantize_saturate_at_the_format_maximum():
    formats = jaxmp._formats
    assert formats.fp8_max(formats.E4M3) == E4M3_MAX and formats.fp8_max(formats.E5M2) == E5M2_MAX
    one = np.float32(1.0)

    @jax.jit  # one compiled program for every call (eagerly, each op compiles on its own)
    def run(amax, big, non_finite):
        scale = fp8._scaling.compute_scale(amax, one, jaxmp._formats.E5M2, margin=2)
        q = fp8._scaling.quantize(big, one, jaxmp._formats.E4M3)
        return scale, q, [fp8._scaling.quantize(non_finite, one, d) for d in jaxmp._formats.FP8_DTYPES]

    scale, q, bads = run(np.float32(10.0), np.array([1e6, -1e6, 1.0], np.float32),
                         np.array([np.inf, np.nan, 2.0], np.float32))
    np.testing.assert_allclose(float(scale), E5M2_MAX / 4 / 10, rtol=1e-6)
    assert q.dtype == jaxmp._formats.E4M3
    np.testing.assert_array_equal(np.asarray(q).astype(np.float32), [448.0, -448.0, 1.0])
    assert [b.dtype for b in bads] == list(jaxmp._formats.FP8_DTYPES)
    for bad in bads:  # an overflow is never clipped into a finite value
        bad = np.asarray(bad).astype(np.float32)
        assert not np.any(np.isfinite(bad[:2])) and float(bad[2]) == 2.0


def test_qdq_with_current_scaling_maps_the_amax_onto_the_format_maximum():
    x = np.array([0.001, -0.0007, 0.0003], np.float32)
    y = jax.jit(lambda v: fp8._scaling.qdq(v, jaxmp._formats.E4M3))(x)  # one program, not one per op
    assert y.dtype == jnp.float32
    y = np.asarray(y)
    assert float(np.max(np.abs(y))) == pytest.approx(0.001, rel=1e-6)  # the amax is exact after scaling
    np.testing.assert_allclose(y, x, rtol=2**-3)  # E4M3 has 3 mantissa bits
    assert not np.array_equal(np.asarray(y), np.asarray(x))  # and it did round


def _mlp_loss(dot):
    def loss(params, x, y):
        h = jax.nn.gelu(dot(x, params["w1"]))
        return jnp.mean((dot(h, params["w2"]) - y) ** 2)
    return loss


@pytest.fixture(scope="module")
def data():
    """Params, inputs and targets, made once for this module's tests (each eager op on a new
    shape compiles a program)."""
    rng = np.random.default_rng(0)  # numpy: an eager jax.random draw compiles a program per shape
    normal = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.float32)  # noqa: E731
    params = {"w1": normal(64, 128) / 8, "w2": normal(128, 16) / 11}
    return params, normal(32, 64), normal(32, 16)


DN = (((1,), (0,)), ((), ()))


@pytest.mark.slow
def test_fp8_dot_gradients_are_within_tolerance_of_bf16_and_float32(data):
    params, x, y = data
    f32 = jax.grad(_mlp_loss(lambda a, b: a @ b))(params, x, y)
    bf16 = jax.grad(_mlp_loss(lambda a, b: (a.astype(jnp.bfloat16) @ b.astype(jnp.bfloat16)).astype(jnp.float32)))(
        params, x, y)
    g8 = jax.jit(jax.grad(_mlp_loss(lambda a, b: fp8.fp8_dot_general(a, b, DN))))(params, x, y)
    for name in params:
        rel = lambda g: float(jnp.linalg.norm(g[name] - f32[name]) / jnp.linalg.norm(f32[name]))  # noqa: E731
        assert g8[name].dtype == jnp.float32
        assert rel(bf16) < 0.01
        assert 0 < rel(g8) < 0.1  # fp8 rounds (> 0) but stays close: 3-bit / 2-bit mantissas
        assert rel(g8) < 20 * rel(bf16)


def test_backward_quantizes_the_cotangent_to_e5m2_and_is_invariant_to_a_loss_scale():
    rng = np.random.default_rng(1)  # numpy data: no eager random-draw compiles
    a, b = jnp.asarray(rng.normal(size=(8, 16)), jnp.float32), jnp.asarray(rng.normal(size=(16, 4)), jnp.float32)
    g = jnp.asarray(rng.normal(size=(8, 4)) * 1e-3, jnp.float32)
    # The forward and its backward compiled once (eagerly, every op compiles), called twice.
    vjp = jax.jit(lambda ct: jax.vjp(lambda u, v: fp8.fp8_dot_general(u, v, DN), a, b)[1](ct))
    da, db = (np.asarray(t) for t in vjp(g))
    # The rounded operands in one program; the reference products in numpy (float64: exact enough).
    qa, qb, qg = (np.asarray(t, np.float64) for t in jax.jit(lambda a, b, g: (
        fp8._scaling.qdq(a, jaxmp._formats.E4M3), fp8._scaling.qdq(b, jaxmp._formats.E4M3),
        fp8._scaling.qdq(g, jaxmp._formats.E5M2)))(a, b, g))
    np.testing.assert_allclose(da, qg @ qb.T, rtol=1e-6, atol=1e-9)
    np.testing.assert_allclose(db, qa.T @ qg, rtol=1e-6, atol=1e-9)
    assert not np.allclose(da, np.asarray(g, np.float64) @ qb.T, rtol=1e-7, atol=0)  # E5M2 rounding happened
    da_scaled, _ = vjp(np.asarray(g) * np.float32(1024.0))  # a loss scale of 2**10: current scaling cancels it
    np.testing.assert_allclose(np.asarray(da_scaled) / 1024.0, da, rtol=1e-6)


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(history_length=0), ValueError, "history_length"),
    (dict(history_length=-3), ValueError, "history_length"),
    (dict(history_length=2.5), ValueError, "history_length"),
    (dict(margin=-1), ValueError, "margin"),
    (dict(margin=float("nan")), ValueError, "margin"),
    (dict(reduction="mean"), ValueError, "reduction"),
    (dict(fwd_dtype=jnp.bfloat16), ValueError, "fwd_dtype must be an fp8 dtype"),
    (dict(bwd_dtype="float16"), ValueError, "bwd_dtype must be an fp8 dtype"),
    (dict(fwd_dtype="e4m3"), TypeError, "fwd_dtype must be an fp8 dtype"),
])
def test_bad_recipes_get_clear_errors(kwargs, error, match):
    with pytest.raises(error, match=match):
        fp8.DelayedScaling(**kwargs)


def test_misuse_of_the_functions_gets_clear_errors():
    with pytest.raises(TypeError, match="CurrentScaling"):
        fp8.fp8_dot_general(jnp.ones((2, 2)), jnp.ones((2, 2)), DN, recipe=fp8.DelayedScaling())
    with pytest.raises(TypeError, match="lhs must be floating"):
        fp8.fp8_dot_general(jnp.ones((2, 2), jnp.int32), jnp.ones((2, 2)), DN)
    with pytest.raises(TypeError, match="DelayedScaling"):
        fp8._scaling.update_meta(fp8.DelayedScaling().init_meta(), jnp.ones(2), fp8.CurrentScaling())
    with pytest.raises(ValueError, match="history_length is 4"):
        fp8._scaling.update_meta(fp8.DelayedScaling(history_length=8).init_meta(), jnp.ones(2),
                        fp8.DelayedScaling(history_length=4))
    with pytest.raises(ValueError, match="fp8 dtype"):
        jaxmp._formats.fp8_max(jnp.float16)


def test_the_recipes_are_not_subclasses_of_each_other():
    current, delayed = fp8.CurrentScaling(), fp8.DelayedScaling(history_length=4)
    assert not isinstance(delayed, fp8.CurrentScaling) and not isinstance(current, fp8.DelayedScaling)
    assert not issubclass(fp8.DelayedScaling, fp8.CurrentScaling)
    assert isinstance(current, fp8.Fp8Recipe) and isinstance(delayed, fp8.Fp8Recipe)
    assert not isinstance("e4m3", fp8.Fp8Recipe)
    assert current != fp8.DelayedScaling() and delayed == fp8.DelayedScaling(history_length=4)
    # The shared fields keep their positions: margin, fwd_dtype, bwd_dtype, emulate.
    e5m2 = fp8.DelayedScaling(1.0, jaxmp._formats.E5M2)
    assert e5m2.margin == 1.0 and e5m2.fwd_dtype == jaxmp._formats.E5M2
    with pytest.raises(TypeError, match="CurrentScaling or jaxmp.fp8.DelayedScaling"):
        type(current).__mro__[1]()  # the shared base is no recipe by itself


def test_each_code_path_picks_the_recipe_it_was_given():
    """Current scaling is stateless, delayed scaling needs its scales: every path tells them apart."""
    import jaxmp
    from jaxmp.flax.fp8 import Fp8State, NnxFp8Op

    nnx = pytest.importorskip("flax.nnx")
    current, delayed = fp8.CurrentScaling(), fp8.DelayedScaling(history_length=4)
    x, w = np.ones((2, 2), np.float32), np.full((2, 2), 0.5, np.float32)
    scales = fp8._state.layer_scales(fp8._state.init_layer_state(delayed))
    # The ops: delayed without scales and current with scales are both refused; each runs as itself.
    with pytest.raises(TypeError, match="delayed scaling needs scales"):
        fp8.fp8_dot_general(x, w, DN, recipe=delayed)
    with pytest.raises(TypeError, match="only used with a DelayedScaling"):
        fp8.fp8_dot_general(x, w, DN, recipe=current, scales=scales)
    with pytest.raises(TypeError, match="recipe must be"):
        fp8.fp8_dot_general(x, w, DN, recipe="e4m3")
    # Jitted: one program (eagerly, each of the scaled dot's ops compiles on its own).
    assert jax.jit(lambda x, w, s: fp8.fp8_dot_general(x, w, DN, recipe=delayed, scales=s))(
        x, w, scales).tolist() == [[1.0, 1.0], [1.0, 1.0]]
    # Labels, hardware check, state builders.
    assert fp8._recipes.describe(current).endswith("current scaling)") and fp8._recipes.describe(delayed).endswith("delayed scaling)")
    cpu = jax.devices("cpu")[0]
    assert fp8.check_hardware(current, cpu) == fp8.check_hardware(delayed, cpu) == "emulated"
    with pytest.raises(TypeError, match="fp8 recipe"):
        fp8.check_hardware(jaxmp.Policy("float32", "bfloat16", "float32"), cpu)
    with pytest.raises(TypeError, match="DelayedScaling"):
        fp8._state.init_layer_state(current)
    # autocast takes current scaling only; the presets and the Flax front door take either.
    assert jaxmp.AutocastRules(fp8_matmuls=current).fp8_matmuls is current
    with pytest.raises(ValueError, match="delayed scaling"):  # refused where autocast is called
        jaxmp.autocast(lambda x: x @ x, "O1-bf16", rules=jaxmp.AutocastRules(fp8_matmuls=delayed))(jnp.ones((2, 2)))
    assert type(jaxmp.get_recipe("O2-fp8").fp8) is fp8.DelayedScaling
    assert type(jaxmp.get_recipe("O2-fp8-current").fp8) is fp8.CurrentScaling
    for recipe in (current, delayed):
        assert jaxmp.AutocastRules(fp8_matmuls=recipe).fp8_matmuls is recipe
    # An NNX fp8 op keeps state for the delayed recipe only.
    # Abstract layers (nnx.eval_shape): the state's structure is the fact, no random init compiled.
    counts = [len(nnx.state(nnx.eval_shape(lambda r=r: nnx.Linear(2, 3, rngs=nnx.Rngs(0), dot_general=NnxFp8Op(r))),
                            Fp8State))
              for r in (current, delayed)]
    assert counts[0] == 0 and counts[1] > 0


def test_cpu_reports_emulation():
    available, why = fp8._hardware.native_fp8(jax.devices("cpu")[0])
    assert not available and "emulated" in why


def _jaxpr_dtypes(closed):
    """Every dtype produced anywhere in a closed jaxpr, sub-jaxprs included."""
    from jaxmp import _jaxpr

    return {str(a.dtype) for e in _jaxpr.walk(closed) for a in e.out_avals if hasattr(a, "dtype")}


@pytest.mark.slow  # ~4 s of training
def test_autocast_with_fp8_matmuls_runs_half_list_dots_in_fp8_and_trains_close_to_bf16(data):
    import jaxmp

    params, x, y = data
    loss = _mlp_loss(lambda a, b: a @ b)
    rules = jaxmp.AutocastRules(fp8_matmuls=fp8.CurrentScaling())
    f8 = jaxmp.autocast(loss, "O1-bf16", rules=rules)
    bf = jaxmp.autocast(loss, "O1-bf16")
    fwd = _jaxpr_dtypes(jax.make_jaxpr(f8)(params, x, y))
    bwd = _jaxpr_dtypes(jax.make_jaxpr(jax.grad(f8))(params, x, y))
    assert "float8_e4m3fn" in fwd and "float8_e5m2" in bwd
    assert "float8_e4m3fn" not in _jaxpr_dtypes(jax.make_jaxpr(bf)(params, x, y))
    g8, gb = jax.jit(jax.grad(f8))(params, x, y), jax.jit(jax.grad(bf))(params, x, y)
    f32 = jax.grad(loss)(params, x, y)
    for name in params:
        assert g8[name].dtype == jnp.float32
        rel = float(jnp.linalg.norm(g8[name] - f32[name]) / jnp.linalg.norm(f32[name]))
        rel_bf = float(jnp.linalg.norm(gb[name] - f32[name]) / jnp.linalg.norm(f32[name]))
        assert 0 < rel < 0.1 and rel > rel_bf  # coarser than bf16, still close


def test_autocast_fp8_composes_with_dynamic_loss_scaling_and_skips_overflow(data):
    import optax

    import jaxmp

    params, x, y = data
    loss = jaxmp.autocast(_mlp_loss(lambda a, b: a @ b), "O1-bf16",
                          rules=jaxmp.AutocastRules(fp8_matmuls=fp8.CurrentScaling()))
    tx = jaxmp.loss_scaling(optax.sgd(0.1), loss_scale="dynamic")
    state = tx.init(params)

    @jax.jit
    def step(p, s, xb):
        _, g = jaxmp.value_and_grad(loss, s)(p, xb, y)
        u, s = tx.update(g, s, p)
        return jaxmp.apply_updates(p, u, s), s

    first, s1 = step(params, state, x)
    assert jaxmp.scaling_stats(s1)["last_step_finite"] and not jax.tree_util.tree_all(
        jax.tree_util.tree_map(lambda a, b: np.array_equal(np.asarray(a), np.asarray(b)), first, params))
    x_bad = np.array(x)
    x_bad[0, 0] = np.inf
    bad, s2 = step(first, s1, x_bad)
    assert not jaxmp.scaling_stats(s2)["last_step_finite"]
    jax.tree_util.tree_map(np.testing.assert_array_equal, bad, first)  # the overflowed step changed nothing


def test_autocast_refuses_delayed_scaling_and_non_recipes():
    import jaxmp

    # The rules object takes delayed scaling (the Flax door keeps its state); autocast refuses it when called.
    rules = jaxmp.AutocastRules(fp8_matmuls=fp8.DelayedScaling())
    with pytest.raises(ValueError, match="delayed scaling"):
        jaxmp.autocast(lambda x: x @ x, "O1-bf16", rules=rules)(jnp.ones((2, 2)))
    with pytest.raises(TypeError, match="fp8_matmuls"):
        jaxmp.AutocastRules(fp8_matmuls="e4m3")


def test_precision_report_names_the_fp8_matmuls_and_their_formats():
    import jaxmp

    f = jaxmp.autocast(lambda w, x: jnp.sum(jnp.tanh(x @ w) @ w), "O1-bf16",
                       rules=jaxmp.AutocastRules(fp8_matmuls=fp8.CurrentScaling()))
    text = jaxmp.precision_report(f, np.ones((4, 4), np.float32), np.ones((2, 4), np.float32)).to_json()
    assert text.count("fp8 (float8_e4m3fn forward, float8_e5m2 backward, current scaling)") >= 2
