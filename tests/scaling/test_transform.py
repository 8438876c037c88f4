"""The optax loss-scaling transform: skip semantics, unscale-before-clip, master weights, composition, pmap."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxmp
from tests._support._arrays import leaf_bytes


# Inputs come from numpy: an eager jax.random draw or jnp op compiles a program of its own (XLA:CPU
# compiles are most of these tests' time), and no test here depends on the particular draw.
def _params(dtype=jnp.float32, seed=0):
    rng = np.random.default_rng(seed)
    w, scale = rng.normal(size=(4, 3)).astype(np.float32), rng.normal(size=3).astype(np.float32)
    return {"dense": {"w": jnp.asarray(w.astype(dtype)), "b": jnp.asarray(np.zeros(3, dtype))},
            "scale": jnp.asarray(scale.astype(dtype))}


def _loss(params, x, y):
    h = x @ params["dense"]["w"].astype(jnp.float32) + params["dense"]["b"].astype(jnp.float32)
    return jnp.mean((h * params["scale"].astype(jnp.float32) - y) ** 2)


def _batch(seed=1, n=8):
    rng = np.random.default_rng(100 + seed)
    return rng.normal(size=(n, 4)).astype(np.float32), rng.normal(size=(n, 3)).astype(np.float32)


def _poison(x, index, value=np.nan):
    """A copy of the numpy batch ``x`` with ``value`` at ``index`` (no eager ``.at[].set`` program)."""
    x = np.array(x)
    x[index] = value
    return x



def _make_step(tx):
    @jax.jit
    def step(params, state, x, y):
        loss, grads = jaxmp.value_and_grad(_loss, state)(params, x, y)
        updates, state = tx.update(grads, state, params)
        return jaxmp.apply_updates(params, updates, state), state, loss
    return step


INNERS = {
    "adamw+clip": lambda: optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-2, weight_decay=1e-2)),
    "sgd-momentum": lambda: optax.sgd(1e-2, momentum=0.9),
    "multisteps": lambda: optax.MultiSteps(optax.adam(1e-2), every_k_schedule=2),
    "inject": lambda: optax.inject_hyperparams(optax.adam)(learning_rate=optax.linear_schedule(1e-2, 0.0, 100)),
}


@pytest.mark.standard_promotion(reason="optax.adam: bias correction is a Python float ** int32 count")
@pytest.mark.parametrize("skip_with", ["cond", "select"])
@pytest.mark.parametrize("inner", sorted(INNERS)[:2] + [pytest.param(i, marks=pytest.mark.slow) for i in sorted(INNERS)[2:]])
def test_skipped_step_leaves_params_and_every_inner_leaf_bitwise_equal(inner, skip_with):
    tx = jaxmp.loss_scaling(INNERS[inner](), jaxmp.DynamicLossScale(2.0**10), skip_with=skip_with)
    step = _make_step(tx)
    params, (x, y) = _params(), _batch()
    params["dense"]["b"] = jnp.array([-0.0, 0.0, -0.0])  # negative zeros must survive a skip too
    state = tx.init(params)
    for _ in range(3):
        params, state, _ = step(params, state, x, y)
    params["dense"]["b"] = jnp.array([-0.0, 0.0, -0.0])
    before_p, before_inner = leaf_bytes(params), leaf_bytes(state.inner_state)
    bad_x = _poison(x, (0, 0))
    params2, state2, _ = step(params, state, bad_x, y)
    plain, _ = jax.jit(lambda p, s: optax.apply_updates(p, tx.update(
        jaxmp.value_and_grad(_loss, s)(p, bad_x, y)[1], s, p)[0]))(params, state), None
    assert leaf_bytes(plain) == before_p  # optax.apply_updates too: -0.0 updates keep -0.0 params
    assert leaf_bytes(params2) == before_p
    assert leaf_bytes(state2.inner_state) == before_inner
    assert not bool(state2.last_step_finite)
    assert int(state2.total_skips) == 1 and int(state2.consecutive_skips) == 1
    assert float(state2.loss_scale.loss_scale) == 2.0**9
    # A finite step afterwards applies again and resets the consecutive count.
    params3, state3, _ = step(params2, state2, x, y)
    assert leaf_bytes(params3) != before_p and int(state3.consecutive_skips) == 0 and int(state3.total_skips) == 1


def test_unscale_happens_before_clipping():
    # With a scale of 2**12 the raw scaled gradient norm is huge; if clipping saw it, the update
    # would be the clipped direction of the *scaled* grads. It must equal the bare chain's update
    # on the true gradients.
    inner = optax.chain(optax.clip_by_global_norm(0.5), optax.sgd(1.0))
    tx = jaxmp.loss_scaling(inner, jaxmp.StaticLossScale(2.0**12))
    params, (x, y) = _params(), _batch()
    state = tx.init(params)

    @jax.jit  # one program for the whole comparison (eagerly, each op compiles on its own)
    def ours_and_want(params, state):
        _, scaled_grads = jaxmp.value_and_grad(_loss, state)(params, x, y)
        true_grads = jax.grad(_loss)(params, x, y)
        ours, _ = tx.update(scaled_grads, state, params)
        want, _ = inner.update(true_grads, inner.init(params), params)
        return true_grads, ours, want

    true_grads, ours, want = jax.device_get(ours_and_want(params, state))

    def norm(tree):  # optax.tree.norm, in numpy
        return np.sqrt(sum(np.sum(np.square(np.asarray(a, np.float64))) for a in jax.tree_util.tree_leaves(tree)))

    true_norm = norm(true_grads)
    assert 0.5 < true_norm < 0.5 * 2.0**12  # clipping is active on true grads but not a no-op either way
    for a, b in zip(jax.tree_util.tree_leaves(ours), jax.tree_util.tree_leaves(want)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6)
    assert norm(ours) == pytest.approx(0.5, rel=1e-5)


@pytest.mark.standard_promotion(reason="optax.adam: bias correction is a Python float ** int32 count")
def test_finite_steps_match_bare_optax_exactly_with_power_of_two_scale():
    inner = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-2))
    tx = jaxmp.loss_scaling(inner, jaxmp.DynamicLossScale(2.0**8, period=2))
    params_a = params_b = _params()
    sa, sb = tx.init(params_a), inner.init(params_b)
    step = _make_step(tx)

    @jax.jit
    def bare_step(params, state, x, y):
        u, state = inner.update(jax.grad(_loss)(params, x, y), state, params)
        return optax.apply_updates(params, u), state

    for i in range(6):
        x, y = _batch(seed=i)
        params_a, sa, _ = step(params_a, sa, x, y)
        params_b, sb = bare_step(params_b, sb, x, y)
    # Power-of-two scaling is exact in binary floating point; only XLA's fusion choices differ.
    for a, b in zip(jax.tree_util.tree_leaves(params_a), jax.tree_util.tree_leaves(params_b)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)
    assert float(sa.loss_scale.loss_scale) == 2.0**11


@pytest.mark.standard_promotion(reason="optax.adam: bias correction is a Python float ** int32 count")
def test_never_applies_non_finite_however_many_in_a_row_and_check_health_says_so():
    tx = jaxmp.loss_scaling(optax.adam(1e-2), jaxmp.DynamicLossScale(2.0**15))
    step = _make_step(tx)
    params, (x, y) = _params(), _batch()
    state = tx.init(params)
    start = leaf_bytes(params)
    bad = _poison(x, (slice(None), 0), np.inf)
    for _ in range(60):
        params, state, _ = step(params, state, bad, y)
    assert leaf_bytes(params) == start
    assert int(state.consecutive_skips) == 60 and float(state.loss_scale.loss_scale) == 1.0  # at the floor
    jaxmp.check_health(state, max_consecutive_skips=60)  # at the limit: fine
    with pytest.raises(jaxmp.TrainingDivergedError, match=r"61|60 consecutive steps.*floor"):
        jaxmp.check_health(state, max_consecutive_skips=59)
    with pytest.raises(FloatingPointError):
        jaxmp.check_health((optax.EmptyState(), state), max_consecutive_skips=10)


def test_scaling_stats_and_helpers_inside_jit():
    tx = jaxmp.loss_scaling(optax.sgd(0.1), jaxmp.DynamicLossScale(4.0))
    params, (x, y) = _params(), _batch()
    state = tx.init(params)
    stats = jax.jit(jaxmp.scaling_stats)(state)
    assert {k: float(v) for k, v in stats.items()} == {"loss_scale": 4.0, "last_step_finite": 1.0,
                                                       "consecutive_skips": 0.0, "total_skips": 0.0}
    _, state, _ = _make_step(tx)(params, state, _poison(x, (0, 0)), y)
    assert int(jaxmp.scaling_stats(state)["total_skips"]) == 1 and not bool(jaxmp.scaling_stats(state)["last_step_finite"])
    assert float(jaxmp.get_loss_scale(state).loss_scale) == 2.0


@pytest.mark.standard_promotion(reason="optax.MultiSteps: float32 gradients / int32 count")
def test_multisteps_accumulates_true_gradients_and_drops_non_finite_micro_batches():
    k = 3
    inner = optax.MultiSteps(optax.sgd(0.1), every_k_schedule=k)
    tx = jaxmp.loss_scaling(inner, jaxmp.StaticLossScale(2.0**6))
    step = _make_step(tx)
    params = _params()
    state = tx.init(params)
    batches = [_batch(seed=i) for i in range(k)]
    p, s = params, state
    p, s, _ = step(p, s, *batches[0])
    p, s, _ = step(p, s, _poison(batches[1][0], (0, 0)), batches[1][1])  # dropped micro-batch
    assert leaf_bytes(p) == leaf_bytes(params)
    for b in batches[1:]:
        p, s, _ = step(p, s, *b)
    grad = jax.jit(jax.grad(_loss))  # one program; the mean and the SGD step in numpy
    mean_grad = jax.tree_util.tree_map(lambda *g: sum(g) / k, *[jax.device_get(grad(params, *b)) for b in batches])
    want = jax.tree_util.tree_map(lambda w, g: np.asarray(w) - np.float32(0.1) * g, params, mean_grad)
    for a, b in zip(jax.tree_util.tree_leaves(p), jax.tree_util.tree_leaves(want)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7)


def test_inject_hyperparams_schedule_counts_applied_steps_only():
    sched = optax.linear_schedule(1.0, 0.0, 10)
    tx = jaxmp.loss_scaling(optax.inject_hyperparams(optax.sgd)(learning_rate=sched), jaxmp.DynamicLossScale(8.0))
    step = _make_step(tx)
    params, (x, y) = _params(), _batch()
    state = tx.init(params)
    for bad in (False, True, True, False, True):
        xx = _poison(x, (0, 0)) if bad else x
        params, state, _ = step(params, state, xx, y)
    inner = state.inner_state
    assert int(inner.count) == 2  # two applied steps
    assert float(inner.hyperparams["learning_rate"]) == pytest.approx(float(sched(1)))


@pytest.mark.parametrize("half", [jnp.float16, jnp.bfloat16])
def test_master_weights_keep_half_params_bit_exact_and_accumulate_small_updates(half):
    tx = jaxmp.loss_scaling(optax.sgd(1.0), "none", master_weights=True)
    params = {"w": jnp.ones((16,), half)}
    state = tx.init(params)
    assert jaxmp.master_params(state)["w"].dtype == jnp.float32
    tiny = float(jnp.finfo(half).eps) / 8  # far below the half resolution at 1.0

    @jax.jit
    def step(params, state, g):
        updates, state = tx.update({"w": g}, state, params)
        return jaxmp.apply_updates(params, updates, state), state

    g = jnp.full((16,), tiny, half)
    params1, state1 = step(params, state, g)
    assert leaf_bytes(params1["w"]) == leaf_bytes(params["w"])  # the half copy cannot move by eps/8 ...
    assert float(jaxmp.master_params(state1)["w"][0]) == pytest.approx(1.0 - tiny)  # ... the master does
    for _ in range(15):
        params1, state1 = step(params1, state1, g)
    master = jaxmp.master_params(state1)["w"]
    assert float(master[0]) == pytest.approx(1.0 - 16 * tiny, rel=1e-6)
    assert float(params1["w"][0]) < 1.0  # 16 accumulated updates moved the half param
    assert leaf_bytes(params1["w"]) == leaf_bytes(master.astype(half))


@pytest.mark.standard_promotion(reason="optax.adam: bias correction is a Python float ** int32 count")
def test_master_weights_random_walk_stays_bit_exact_and_moments_are_fp32():
    tx = jaxmp.loss_scaling(optax.adam(3e-3), jaxmp.DynamicLossScale(2.0**4), master_weights=True)
    params = _params(jnp.float16)
    state = tx.init(params)
    step = _make_step(tx)
    for i in range(25):
        x, y = _batch(seed=i)
        if i % 7 == 3:
            x = _poison(x, (0, 0), np.inf)
        params, state, _ = step(params, state, x, y)
        master = jaxmp.master_params(state)
        assert leaf_bytes(params) == leaf_bytes(jax.tree_util.tree_map(lambda m: m.astype(jnp.float16), master))
    adam_state = state.inner_state.inner_state[0]  # inside the master_weights state
    assert all(leaf.dtype == jnp.float32 for leaf in jax.tree_util.tree_leaves(adam_state.mu))
    assert all(leaf.dtype == jnp.float16 for leaf in jax.tree_util.tree_leaves(params))
    assert int(state.total_skips) == 4  # i = 3, 10, 17, 24


def test_inner_state_dtype_is_the_users_choice_with_half_params():
    # Without master weights, half params and a bf16 first moment by request.
    tx = jaxmp.loss_scaling(optax.adam(1e-3, mu_dtype=jnp.bfloat16), "none")
    state = tx.init(_params(jnp.float16))
    assert all(m.dtype == jnp.bfloat16 for m in jax.tree_util.tree_leaves(state.inner_state[0].mu))


def test_value_and_grad_has_aux_argnums_and_true_loss():
    ls = jaxmp.StaticLossScale(16.0)
    params, (x, y) = _params(), _batch()

    def f(p, xx, yy):
        loss = _loss(p, xx, yy)
        return loss, {"twice": 2 * loss}

    @jax.jit  # ours and the references in one program (eagerly, each op compiles on its own)
    def ours_and_want(params, x, y):
        return (jaxmp.value_and_grad(f, ls, argnums=(0, 1), has_aux=True)(params, x, y), _loss(params, x, y),
                jax.grad(_loss, argnums=(0, 1))(params, x, y))

    ((loss, aux), (gp, gx)), want_loss, (want_gp, want_gx) = ours_and_want(params, x, y)
    assert float(loss) == float(want_loss) and float(aux["twice"]) == 2 * float(want_loss)
    np.testing.assert_allclose(np.asarray(gx), 16.0 * np.asarray(want_gx), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(gp["scale"]), 16.0 * np.asarray(want_gp["scale"]), rtol=1e-6)


def test_gradients_of_fp32_master_through_a_cast_are_fp32():
    policy = jaxmp.get_policy("O1-fp16")
    params, (x, y) = _params(), _batch()

    def loss_fn(p):
        p16 = policy.cast_to_compute(p)
        h = policy.cast_to_compute(x) @ p16["dense"]["w"] + p16["dense"]["b"]
        return jnp.mean((policy.cast_to_output(h * p16["scale"]) - y) ** 2)

    tx = jaxmp.loss_scaling(optax.adam(1e-3), "dynamic")
    state = tx.init(params)
    # Dtypes only: traced, not compiled.
    loss, grads = jax.eval_shape(jaxmp.value_and_grad(loss_fn, state), params)
    assert loss.dtype == jnp.float32
    assert all(g.dtype == jnp.float32 for g in jax.tree_util.tree_leaves(grads))
    assert all(m.dtype == jnp.float32 for m in jax.tree_util.tree_leaves(state.inner_state[0].mu))


def _pmap_setup(reduce_grads):
    n = jax.local_device_count()
    assert n == 8, "conftest sets 8 simulated CPU devices"
    tx = jaxmp.loss_scaling(optax.adam(1e-2), jaxmp.DynamicLossScale(2.0**10, period=3), axis_name="batch")

    def step(params, state, x, y):
        loss, grads = jaxmp.value_and_grad(_loss, state)(params, x, y)
        if reduce_grads:
            grads = jax.lax.pmean(grads, "batch")
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    params = _params()
    rep = lambda t: jax.tree_util.tree_map(lambda a: np.broadcast_to(np.asarray(a), (n,) + np.shape(a)), t)  # noqa: E731
    x, y = _batch(n=8 * 4)
    return jax.pmap(step, axis_name="batch"), rep(params), rep(tx.init(params)), x.reshape(8, 4, 4), y.reshape(8, 4, 3)


@pytest.mark.standard_promotion(reason="optax.adam: bias correction is a Python float ** int32 count")
def test_pmap_nan_in_one_replica_makes_every_replica_skip_and_replicas_stay_identical():
    pstep, p, s, x, y = _pmap_setup(reduce_grads=True)
    for i in range(5):
        before = leaf_bytes(p)
        p, s = pstep(p, s, _poison(x, (5, 0, 0)) if i == 2 else x, y)
        if i == 2:
            assert not np.any(np.asarray(s.last_step_finite)) and leaf_bytes(p) == before
    assert np.all(np.asarray(s.total_skips) == 1)
    for leaf in jax.tree_util.tree_leaves((p, s)):
        arr = np.asarray(leaf)
        for r in range(1, 8):
            assert arr[r].tobytes() == arr[0].tobytes()


@pytest.mark.standard_promotion(reason="optax.adam: bias correction is a Python float ** int32 count")
def test_axis_name_alone_makes_replicas_agree_on_the_verdict():
    # Without a gradient all-reduce only replica 5 sees the NaN; axis_name must still make all skip.
    pstep, p, s, x, y = _pmap_setup(reduce_grads=False)
    p1, s1 = pstep(p, s, _poison(x, (5, 0, 0)), y)
    assert not np.any(np.asarray(s1.last_step_finite))
    assert np.all(np.asarray(s1.total_skips) == 1)
    assert np.all(np.asarray(s1.loss_scale.loss_scale) == 2.0**9)
    assert leaf_bytes(p1) == leaf_bytes(p) and leaf_bytes(s1.inner_state) == leaf_bytes(s.inner_state)


def test_unbound_axis_name_is_a_clear_error():
    tx = jaxmp.loss_scaling(optax.sgd(0.1), axis_name="batch")
    params = _params()
    state = tx.init(params)
    with pytest.raises(ValueError, match="axis_name='batch' is not bound"):
        tx.update(jax.tree_util.tree_map(jnp.ones_like, params), state, params)


@pytest.mark.standard_promotion(reason="optax.adam: bias correction is a Python float ** int32 count")
@pytest.mark.parametrize("skip_with", ["cond", "select"])
def test_finite_gradients_with_non_finite_updates_are_skipped(skip_with):
    # Pure fp16 Adam (O3): epsilon 1e-8 flushes to zero, so a zero gradient gives 0/0 = NaN.
    tx = jaxmp.loss_scaling(optax.adam(1e-3), "none", skip_with=skip_with)
    params = {"w": jnp.ones(4, jnp.float16)}
    state = tx.init(params)
    grads = {"w": jnp.array([0.0, 1.0, 0.0, 2.0], jnp.float16)}
    updates, state2 = jax.jit(tx.update)(grads, state, params)
    new = optax.apply_updates(params, updates)
    assert bool(jnp.all(jnp.isfinite(new["w"]))) and leaf_bytes(new) == leaf_bytes(params)
    assert leaf_bytes(state2.inner_state) == leaf_bytes(state.inner_state)
    assert int(state2.total_skips) == 1 and not bool(state2.last_step_finite)
    # Opting out of the check lets the NaN through: the check is what prevents it.
    raw = jaxmp.loss_scaling(optax.adam(1e-3), "none", skip_with=skip_with, check_updates=False)
    u, _ = jax.jit(raw.update)(grads, raw.init(params), params)
    assert not bool(jnp.all(jnp.isfinite(u["w"])))


def test_master_value_beyond_the_half_range_is_skipped():
    tx = jaxmp.loss_scaling(optax.sgd(1.0), "none", master_weights=True)
    params = {"w": jnp.array([60000.0, 1.0], jnp.float16)}
    state = tx.init(params)
    # the update and the apply in one jitted program (eagerly, each op compiles on its own)
    new, state = jax.jit(lambda g, s: (lambda u, s: (jaxmp.apply_updates(params, u, s), s))(*tx.update(g, s, params)))(
        {"w": jnp.array([-10000.0, 0.5], jnp.float16)}, state)  # 70000 > 65504
    assert not bool(state.last_step_finite)
    assert leaf_bytes(new) == leaf_bytes(params)
    assert float(jaxmp.master_params(state)["w"][0]) == 60000.0


@pytest.mark.standard_promotion(reason="optax.adam: bias correction is a Python float ** int32 count")
def test_master_weights_with_fp32_grads_for_bf16_params_follow_the_params_dtype():
    tx = jaxmp.loss_scaling(optax.adam(1e-2), "none", master_weights=True)
    params = {"w": jnp.asarray(np.linspace(-1, 1, 64).astype(jnp.bfloat16))}
    state, update = tx.init(params), jax.jit(tx.update)
    for i in range(30):
        g = {"w": np.sin(np.arange(64.0) + i).astype(np.float32)}  # float32 gradients
        updates, state = update(g, state, params)
        assert updates["w"].dtype == jnp.bfloat16
        via_optax = optax.apply_updates(params, updates)  # within one bf16 ulp of the master's cast
        params = jaxmp.apply_updates(params, updates, state)  # exactly the master's cast
        assert leaf_bytes(params) == leaf_bytes({"w": jaxmp.master_params(state)["w"].astype(jnp.bfloat16)})
        np.testing.assert_allclose(np.asarray(via_optax["w"], np.float32), np.asarray(params["w"], np.float32),
                                   rtol=2**-6)


def test_int_leaves_and_float0_gradients_pass_through_and_donation_works():
    tx = jaxmp.loss_scaling(
        optax.multi_transform({"f": optax.sgd(0.1), "i": optax.set_to_zero()}, {"w": "f", "n": "i"}),
        "static:8", master_weights=True)
    params = {"w": jnp.ones(3, jnp.float16), "n": jnp.int32(7)}
    state = tx.init(params)

    @jax.jit
    def step(params, state):
        loss, grads = jaxmp.value_and_grad(lambda p: jnp.sum(p["w"].astype(jnp.float32) * p["n"].astype(jnp.float32)), state,
                                           allow_int=True)(params)
        updates, state = tx.update(grads, state, params)
        return jaxmp.apply_updates(params, updates, state), state

    donating = jax.jit(step, donate_argnums=(0, 1))
    params, state = donating(params, state)  # the master copy shares no buffer with params
    assert int(params["n"]) == 7 and params["w"].dtype == jnp.float16
    np.testing.assert_allclose(np.asarray(params["w"], np.float32), 1 - 0.1 * 7, rtol=1e-3)


def test_make_loss_scale_accepts_numpy_and_jax_scalars():
    for v in (np.float32(1024), np.int64(8), jnp.float32(8.0)):
        assert float(jaxmp.make_loss_scale(v).loss_scale) == float(v)


@pytest.mark.standard_promotion(reason="optax.adam: bias correction is a Python float ** int32 count")
@pytest.mark.parametrize("skip_with", ["cond", "select"])
def test_an_inner_chain_that_changes_its_state_dtype_is_named_with_the_fix(skip_with):
    # inject_hyperparams' float32 betas promote a bfloat16 param's moments to float32 on the
    # first update; a skipped step must return the old state, so the types must not change.
    params = {"a": jnp.ones(3), "b": jnp.ones((2, 2), jnp.bfloat16)}
    grads = jax.tree_util.tree_map(jnp.ones_like, params)
    inner = optax.inject_hyperparams(optax.adam)(learning_rate=1e-2)
    tx = jaxmp.loss_scaling(inner, "static:1", skip_with=skip_with)
    # Jitted: the check is made while tracing, and one program is cheaper than the eager ops.
    with pytest.raises(ValueError, match=r"mu\['b'\] is bfloat16\[2, 2\] after init and float32\[2, 2\].*master_weights=True"):
        jax.jit(tx.update)(grads, tx.init(params), params)
    tx = jaxmp.loss_scaling(inner, "static:1", skip_with=skip_with, master_weights=True)
    updates, state = jax.jit(tx.update)(grads, tx.init(params), params)
    assert bool(state.last_step_finite) and updates["b"].dtype == jnp.bfloat16


def test_master_weights_step_complex_params_as_optax_does():
    # complex64 params beside bfloat16 ones: the master keeps them complex64 (no real master dtype
    # holds them) and both the updates and apply_updates move them; they used to stay frozen.
    params = {"half": jnp.ones(2, jnp.bfloat16), "c": jnp.array([1 + 1j, 2 - 1j], jnp.complex64)}
    grads = {"half": jnp.ones(2, jnp.bfloat16), "c": jnp.array([1 + 0j, 0 + 1j], jnp.complex64)}
    inner = optax.sgd(0.1)
    # Each path jitted whole: one program each instead of many eager ones.
    want = jax.jit(lambda: optax.apply_updates(params, inner.update(grads, inner.init(params), params)[0])["c"])()
    tx = jaxmp.loss_scaling(inner, "none", master_weights=True)
    state = tx.init(params)
    assert jaxmp.master_params(state)["c"].dtype == jnp.complex64
    updates, new_state = jax.jit(tx.update)(grads, state, params)
    np.testing.assert_allclose(np.asarray(params["c"]) + np.asarray(updates["c"]), np.asarray(want), rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(jax.jit(jaxmp.apply_updates)(params, updates, new_state)["c"]),
                                  np.asarray(want))
    fused, fused_state = jax.jit(functools.partial(jaxmp._scaling._transform.update_and_apply, tx))(grads, state, params)
    np.testing.assert_array_equal(np.asarray(fused["c"]), np.asarray(want))
    np.testing.assert_array_equal(np.asarray(jaxmp.master_params(fused_state)["c"]), np.asarray(want))


@pytest.mark.standard_promotion(reason="optax.adam: bias correction is a Python float ** int32 count")
def test_pure_fp16_adam_skips_a_step_that_overflows_its_state():
    # nu = 0.001 * 300**2 overflows float16 while the update (mu / sqrt(inf)) stays finite: applied,
    # the inf would stay in nu and freeze that param for good. The step is skipped instead.
    params = {"w": jnp.array([1.0, 1.0], jnp.float16)}
    tx = jaxmp.loss_scaling(optax.adam(1e-2), "static:1")
    state = tx.init(params)
    fused = jax.jit(functools.partial(jaxmp._scaling._transform.update_and_apply, tx))  # one program for both calls
    new, state = fused({"w": jnp.array([300.0, 1.0], jnp.float16)}, state, params)
    assert not bool(state.last_step_finite) and int(state.skip_reason) == jaxmp._scaling._transform.NON_FINITE_UPDATES
    assert leaf_bytes(new) == leaf_bytes(params)
    assert bool(jaxmp.all_finite(state.inner_state))
    updates, state2 = jax.jit(tx.update)({"w": jnp.array([300.0, 1.0], jnp.float16)}, tx.init(params), params)
    assert not bool(state2.last_step_finite) and bool(jaxmp.all_finite(state2.inner_state))
    new, state = fused({"w": jnp.array([1.0, 1.0], jnp.float16)}, state, params)
    assert bool(state.last_step_finite) and np.all(np.asarray(new["w"]) < 1)


@pytest.mark.parametrize("master", [False, True])
def test_a_param_holding_minus_inf_is_applied_by_update_and_skipped_by_the_fused_step(master):
    # docs/reliability.md: the unfused path checks the updates (a -inf param's update is 0:
    # applied); the fused path checks the new params without reading the old ones a second time,
    # so a param that already holds inf makes it skip. Masks belong outside the params.
    params = {"w": jnp.array([1.0, 2.0], jnp.bfloat16), "mask": jnp.array([0.0, -jnp.inf], jnp.bfloat16)}
    grads = {"w": jnp.array([1.0, 1.0], jnp.bfloat16), "mask": jnp.zeros(2, jnp.bfloat16)}
    tx = jaxmp.loss_scaling(optax.sgd(0.5), "none", master_weights=master)
    state = tx.init(params)
    updates, unfused_state = tx.update(grads, state, params)
    unfused = jaxmp.apply_updates(params, updates, unfused_state)
    assert bool(unfused_state.last_step_finite)
    np.testing.assert_array_equal(np.asarray(unfused["w"], np.float32), [0.5, 1.5])
    fused, fused_state = jaxmp._scaling._transform.update_and_apply(tx, grads, state, params)
    if master:
        # bfloat16 params with float32 masters: no check after the update (the gradient bound
        # stands in for it), so both paths apply the step and the mask stays -inf.
        assert bool(fused_state.last_step_finite)
        assert leaf_bytes(fused) == leaf_bytes(unfused)
        return
    assert not bool(fused_state.last_step_finite) and int(fused_state.skip_reason) == jaxmp._scaling._transform.NON_FINITE_UPDATES
    assert leaf_bytes(fused) == leaf_bytes(params)


def test_each_init_hands_out_fresh_buffers_that_survive_another_states_donation():
    tx = jaxmp.loss_scaling(optax.sgd(0.1), "dynamic")
    params = {"w": jnp.ones(3)}
    s1, s2 = tx.init(params), tx.init(params)
    step = jax.jit(lambda p, s: jaxmp._scaling._transform.update_and_apply(
        tx, jaxmp.value_and_grad(lambda q: jnp.sum(q["w"] ** 2), s)(p)[1], s, p), donate_argnums=(0, 1))
    step({"w": jnp.ones(3)}, s1)
    new, s2 = step({"w": jnp.ones(3)}, s2)  # a deleted (donated) buffer in s2 would raise here
    assert float(s2.loss_scale.loss_scale) == 2.0**15 and bool(s2.last_step_finite)
    assert float(tx.init(params).loss_scale.loss_scale) == 2.0**15


@pytest.mark.standard_promotion(reason="optax.noisy_sgd: its noise schedule is a Python float ** int32 count")
@pytest.mark.parametrize("skip_with", ["cond", "select"])
def test_an_inner_state_holding_a_prng_key_steps_and_skips(skip_with):
    # optax.noisy_sgd keeps a typed key in its state; the state-type check used to crash on it.
    params = {"w": jnp.ones(3)}
    inner = optax.noisy_sgd(1e-2, key=jax.random.key(0))
    # Jitted: one program for both updates instead of the eager ops (noise draws included).
    want = jax.jit(inner.update)({"w": jnp.ones(3)}, inner.init(params), params)[0]["w"]
    tx = jaxmp.loss_scaling(inner, "none", skip_with=skip_with)
    state = tx.init(params)
    update = jax.jit(tx.update)
    updates, applied = update({"w": jnp.ones(3)}, state, params)
    np.testing.assert_allclose(np.asarray(updates["w"]), np.asarray(want), rtol=1e-6)  # same noise draw
    _, skipped = update({"w": jnp.array([1.0, jnp.inf, 1.0])}, state, params)
    assert not bool(skipped.last_step_finite)
    keys = [x for x in jax.tree_util.tree_leaves(skipped.inner_state) if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)]
    old = [x for x in jax.tree_util.tree_leaves(state.inner_state) if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)]
    assert keys and all(np.array_equal(jax.random.key_data(a), jax.random.key_data(b)) for a, b in zip(keys, old))


@pytest.mark.parametrize("master_dtype", [jnp.float16, "bf16", jnp.bfloat16])
def test_a_half_master_copy_is_refused(master_dtype):
    """Issue 37 item 5: a half master never moves under small updates (sgd(1e-4) on weights near 1:
    every update is below half an ulp), so the master copy would protect nothing."""
    with pytest.raises(ValueError, match=r"master_dtype=(float16|bfloat16): a master copy in half precision drops "
                                         r"every update .*master_dtype=jnp.float32"):
        jaxmp.loss_scaling(optax.sgd(1e-4), master_weights=True, master_dtype=master_dtype)
    with pytest.raises(ValueError, match=r"master copy in half precision"):
        jaxmp._scaling._transform.master_weights(optax.sgd(1e-4), master_dtype=master_dtype)


@pytest.mark.parametrize("master_weights", [None, False])
@pytest.mark.parametrize("master_dtype", ["bf16", jnp.float32])
def test_a_master_dtype_without_master_weights_is_refused(master_dtype, master_weights):
    """Issue 48, defect 8: accepted and ignored before (no master copy kept, whatever the params'
    dtype); the default (None) is float32 with master weights and nothing without them."""
    with pytest.raises(ValueError, match=r"master_dtype=(bfloat16|float32) is given without master_weights=True.*"
                                         r"would do nothing.*pass master_weights=True.*or drop master_dtype"):
        jaxmp.loss_scaling(optax.sgd(1e-4), master_weights=master_weights, master_dtype=master_dtype)
    params = {"w": jnp.ones(2, jnp.bfloat16)}
    kept = jaxmp.loss_scaling(optax.sgd(1e-4), "none", master_weights=True).init(params)
    assert jaxmp.master_params(kept)["w"].dtype == jnp.float32
    assert jaxmp.loss_scaling(optax.sgd(1e-4), "none", master_weights=False).init(params).master_params is None


def test_a_float32_master_moves_where_a_half_one_would_not():
    # what the refusal above prevents: the bf16 master's params never move, the float32 master's do
    params = {"w": jnp.ones(4, jnp.bfloat16)}
    tx = jaxmp.loss_scaling(optax.sgd(1e-4), "none", master_weights=True)
    state = tx.init(params)

    @jax.jit
    def step(params, state):
        updates, state = tx.update({"w": jnp.ones(4, jnp.bfloat16)}, state, params)
        return jaxmp.apply_updates(params, updates, state), state

    for _ in range(100):
        params, state = step(params, state)
    np.testing.assert_allclose(jaxmp.master_params(state)["w"], 1.0 - 100 * 1e-4, rtol=1e-5)
    assert float(params["w"][0]) < 1.0


@pytest.mark.standard_promotion(reason="optax.adam: bias correction is a Python float ** int32 count")
@pytest.mark.parametrize("master", [False, True])
@pytest.mark.parametrize("skip_with", ["cond", "select"])
def test_float0_gradients_and_prng_key_params_pass_through_a_full_update(master, skip_with):
    # Issue 37, item 10: optax.adam multiplies every leaf ("Called power with a float0 array",
    # "multiply does not accept ... key<fry>"); int and key params now pass through untouched.
    tx = jaxmp.loss_scaling(optax.adam(0.1), "dynamic", master_weights=master, skip_with=skip_with)
    params = {"w": jnp.ones(3), "n": jnp.int32(2), "key": jax.random.key(7)}
    state = tx.init(params)

    @jax.jit
    def step(params, state, x):
        def loss(p):
            return jnp.sum((p["w"] * x) ** 2) * p["n"].astype(jnp.float32)

        _, grads = jaxmp.value_and_grad(loss, state, allow_int=True)(params)
        assert grads["n"].dtype == jax.dtypes.float0 and grads["key"].dtype == jax.dtypes.float0
        updates, state = tx.update(grads, state, params)
        return jaxmp.apply_updates(params, updates, state), state

    new, state = step(params, state, jnp.ones(3))
    assert bool(state.last_step_finite)
    assert int(new["n"]) == 2 and new["n"].dtype == jnp.int32
    np.testing.assert_array_equal(jax.random.key_data(new["key"]), jax.random.key_data(params["key"]))
    np.testing.assert_allclose(np.asarray(new["w"]), 0.9, rtol=1e-4)  # Adam's first step: lr * sign
    # float32 like the first call's input (a weakly typed full() would compile the step again)
    skipped, state = step(new, state, jnp.full(3, jnp.inf, jnp.float32))  # a skipped step keeps everything
    assert not bool(state.last_step_finite)
    np.testing.assert_array_equal(np.asarray(skipped["w"]), np.asarray(new["w"]))
    assert int(skipped["n"]) == 2


def test_a_list_of_axis_names_is_taken_as_the_tuple_jax_accepts():
    # Issue 37, item 12: axis_name=["b"] failed inside lax.pmin (a list is not hashable).
    devices = jax.local_devices()[:2]
    params = {"w": jnp.ones(3)}
    tx = jaxmp.loss_scaling(optax.sgd(0.1), "static:1", axis_name=["b"])
    update = jax.pmap(lambda g, s, p: tx.update(g, s, p), axis_name="b", devices=devices)
    grads = jnp.stack([jnp.ones(3), jnp.full(3, jnp.inf)])  # one row per replica
    updates, state = update({"w": grads}, *jaxmp.parallel.replicate((tx.init(params), params), devices))
    # the replica with inf gradients makes both skip: the verdict was reduced over the axis
    assert not np.asarray(state.last_step_finite).any()
    np.testing.assert_array_equal(np.asarray(updates["w"]), np.zeros((2, 3)))


def test_the_fused_step_is_an_explicit_entry_of_a_typed_transform():
    # Issue 38, item 2: no hidden keyword on update and no attribute set on the update function.
    import inspect

    from jaxmp._scaling._transform import FusedTransformation

    tx = jaxmp.loss_scaling(optax.sgd(0.5), "static:4")
    assert isinstance(tx, FusedTransformation) and isinstance(tx, optax.GradientTransformationExtraArgs)
    assert len(tx) == 2 and list(inspect.signature(tx.update).parameters) == ["grads", "state", "params", "extra_args"]
    assert not vars(tx.update)  # nothing rides on the function
    params = {"w": jnp.ones(2)}
    new, state = tx.update_and_apply({"w": jnp.full(2, 4.0)}, tx.init(params), params)
    np.testing.assert_array_equal(new["w"], [0.5, 0.5])
    # Rebuilt from init and update (what _replace does), the fused entry is gone, not stale.
    assert type(tx._replace(update=tx.update)) is optax.GradientTransformationExtraArgs
    assert jaxmp._scaling._transform.update_and_apply(tx._replace(update=tx.update), {"w": jnp.full(2, 4.0)},
                                            tx.init(params), params)[0]["w"].tolist() == [0.5, 0.5]


@pytest.mark.slow  # 10-20 s each: 8 steps of each wrapped transform, eager
@pytest.mark.standard_promotion(reason="optax.MultiSteps: float32 gradients / int32 count")
@pytest.mark.parametrize("wrap", ["multisteps", "chain", "inject"])
def test_update_and_apply_falls_back_for_a_wrapped_loss_scaling_and_trains_the_same(wrap):
    # optax's wrappers rebuild a plain (init, update): update_and_apply must take the unfused path
    # and give exactly what tx.update + jaxmp.apply_updates give, skipped steps included.
    from jaxmp._scaling._transform import FusedTransformation

    inner = jaxmp.loss_scaling(optax.adam(1e-2), "dynamic")
    tx = {"multisteps": lambda: optax.MultiSteps(inner, every_k_schedule=2),
          "chain": lambda: optax.chain(inner, optax.identity()),
          "inject": lambda: optax.inject_hyperparams(
              lambda learning_rate: jaxmp.loss_scaling(optax.adam(learning_rate), "dynamic"))(learning_rate=1e-2),
          }[wrap]()
    assert not isinstance(tx, FusedTransformation)
    params = _params()
    fused_p, fused_s = params, tx.init(params)
    plain_p, plain_s = params, tx.init(params)
    x, y = _batch()
    losses = []
    for t in range(8):
        loss, grads = jaxmp.value_and_grad(_loss, fused_s)(fused_p, x, y)
        if t == 7:  # an overflow: a skipped step (the last: optax's MultiSteps keeps an inf accumulator)
            grads = jax.tree_util.tree_map(lambda g: g.at[0].set(jnp.inf), grads)
        losses.append(float(loss))
        fused_p, fused_s = jaxmp._scaling._transform.update_and_apply(tx, grads, fused_s, fused_p)
        updates, plain_s = tx.update(grads, plain_s, plain_p)
        plain_p = jaxmp.apply_updates(plain_p, updates, plain_s)
        assert leaf_bytes(fused_p) == leaf_bytes(plain_p) and leaf_bytes(fused_s) == leaf_bytes(plain_s)
        assert all(bool(jnp.all(jnp.isfinite(v))) for v in jax.tree_util.tree_leaves(fused_p))
    assert losses[-1] < losses[0]  # it trains
    assert int(jaxmp.scaling_stats(fused_s)["total_skips"]) == 1
