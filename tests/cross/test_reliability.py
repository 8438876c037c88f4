"""Reliability: no loss scale can die, skips say why, misuse warns or raises, trees must match,
BatchNorm statistics stay in sync across replicas, gradient accumulation in both orders."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxmp
import jaxmp.parallel
from tests._support._arrays import leaf_bytes

TINY = float(np.finfo(np.float32).tiny)



@jax.jit
def _run_flags(ls, flags):
    def body(ls, finite):
        ls = ls.adjust(finite)
        return ls, ls.loss_scale

    return jax.lax.scan(body, ls, flags)


# ---------------------------------------------------------------------------------------------
# No loss scale can die.

@pytest.mark.parametrize("spec", ["dynamic", "torch", "custom"])
def test_every_dynamic_scale_survives_300_overflows_and_recovers(spec):
    ls = (jaxmp.DynamicLossScale(2.0**10, period=7, factor=4.0, min_loss_scale=2.0**-100) if spec == "custom"
          else jaxmp.make_loss_scale(spec))
    flags = jnp.concatenate([jnp.zeros(300, bool), jnp.ones(3 * ls.period, bool)])
    ls, scales = _run_flags(ls, flags)
    scales = np.asarray(scales)
    floor = ls.min_loss_scale
    assert floor >= TINY
    # Never zero, subnormal, inf or NaN; stops at the floor.
    assert np.all(np.isfinite(scales)) and np.all(scales >= TINY) and scales[299] == np.float32(floor)
    # Grows again once gradients are finite: three growth periods after the burst.
    assert scales[-1] == np.float32(floor) * np.float32(ls.factor) ** 3


def test_torch_parity_keeps_torch_sequence_above_the_floor_and_stops_there():
    # 143 overflows from 2**16: torch reaches 2**-127 (subnormal) and then 0; ours stops at 2**-126.
    ls, scales = _run_flags(jaxmp.make_loss_scale("torch"), jnp.zeros(150, bool))
    scales = np.asarray(scales)
    torch_seq = [2.0 ** (16 - k) for k in range(1, 151)]
    above = [i for i, t in enumerate(torch_seq) if t >= TINY]
    assert [float(scales[i]) for i in above] == [torch_seq[i] for i in above]
    assert float(scales[-1]) == TINY > 0


@pytest.mark.parametrize("make,pattern", [
    (lambda: jaxmp.StaticLossScale(1e39), "which is inf in float32"),
    (lambda: jaxmp.StaticLossScale(1e-50), "which is 0.0 in float32"),
    (lambda: jaxmp.make_loss_scale(1e39), "loss_scale must be a positive finite number"),
    (lambda: jaxmp.make_loss_scale("static:1e-45"), "normal number"),
    (lambda: jaxmp.DynamicLossScale(1e-50, min_loss_scale=TINY), "loss_scale must be"),
    (lambda: jaxmp.DynamicLossScale(min_loss_scale=1e-46), "min_loss_scale"),
    (lambda: jaxmp.DynamicLossScale(min_loss_scale=0.0), "min_loss_scale"),
])
def test_scales_are_validated_after_the_float32_cast(make, pattern):
    with pytest.raises(ValueError, match=pattern):
        make()


def test_a_damaged_scale_falls_back_to_the_floor():
    for bad in (0.0, float("nan")):
        ls = jax.tree_util.tree_map(lambda _: jnp.float32(bad), jaxmp.DynamicLossScale(8.0, min_loss_scale=0.5))
        ls = jax.tree_util.tree_map(lambda x: x, ls)
        ls = jaxmp.DynamicLossScale(ls.loss_scale, jnp.int32(0), min_loss_scale=0.5)
        assert float(ls.adjust(jnp.array(True)).loss_scale) == 0.5


# ---------------------------------------------------------------------------------------------
# Attribution: why a step was skipped.

@pytest.mark.standard_promotion(reason="optax.adam: bias correction is a Python float ** int32 count")
def test_pure_fp16_adam_is_blamed_on_updates_not_gradients():
    tx = jaxmp.loss_scaling(optax.adam(1e-3), "none")
    params = {"w": jnp.ones(4, jnp.float16)}
    state = tx.init(params)
    grads = {"w": jnp.array([0.0, 1.0, 0.0, 2.0], jnp.float16)}  # finite; Adam's 0/0 gives NaN
    update = jax.jit(tx.update)
    for _ in range(3):
        _, state = update(grads, state, params)
    assert int(state.skip_reason) == jaxmp._scaling._transform.NON_FINITE_UPDATES
    with pytest.raises(jaxmp.TrainingDivergedError, match="finite gradients but non-finite updates") as e:
        jaxmp.check_health(state, max_consecutive_skips=2)
    assert "non-finite gradients" not in str(e.value).split("for ")[1].split("(")[0]
    assert "master_weights=True" in str(e.value)


def test_non_finite_gradients_name_the_first_offending_leaf_when_asked():
    tx = jaxmp.loss_scaling(optax.sgd(0.1), "static:4")
    params = {"a": jnp.ones(2), "b": {"c": jnp.ones(3)}}
    state = tx.init(params)
    grads = {"a": jnp.ones(2), "b": {"c": jnp.array([1.0, jnp.inf, 0.0])}}
    for _ in range(3):
        _, state = tx.update(grads, state, params)
    assert int(state.skip_reason) == jaxmp._scaling._transform.NON_FINITE_GRADIENTS
    with pytest.raises(jaxmp.TrainingDivergedError, match=r"non-finite gradients.*first non-finite leaf is \['b'\]\['c'\]"):
        jaxmp.check_health(state, 2, tree=grads)


def test_a_nan_loss_is_recorded_as_the_loss():
    tx = jaxmp.loss_scaling(optax.sgd(0.1), "static:4")
    params = {"w": jnp.ones(2)}
    state = tx.init(params)
    for _ in range(2):
        _, state = tx.update({"w": jnp.full(2, jnp.nan)}, state, params, value=jnp.float32(jnp.nan))
    assert int(state.skip_reason) == jaxmp._scaling._transform.NON_FINITE_LOSS
    with pytest.raises(jaxmp.TrainingDivergedError, match="the loss itself was inf/NaN"):
        jaxmp.check_health(state, 1)
    _, state = tx.update({"w": jnp.ones(2)}, state, params, value=jnp.float32(1.0))
    assert int(state.skip_reason) == 0 and bool(state.last_step_finite)


# ---------------------------------------------------------------------------------------------
# Traps warn or raise.

def _quadratic(p):
    return jnp.sum((p["w"] - 3.0) ** 2)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_unscaled_gradients_to_a_dynamic_scale_warn(jit):
    tx = jaxmp.loss_scaling(optax.sgd(0.1), "dynamic")
    params = {"w": jnp.ones(2)}

    def plain(params, state):
        grads = jax.grad(_quadratic)(params)
        return tx.update(grads, state, params)

    # No process-wide state: another loss scaled before (here, just now) does not hide it.
    jaxmp.value_and_grad(_quadratic, tx.init(params))(params)
    with pytest.warns(jaxmp.MixedPrecisionWarning, match="never multiplied a loss: were they computed with jax.grad"):
        (jax.jit(plain) if jit else plain)(params, tx.init(params))


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_scaled_gradients_do_not_warn_either_way_they_are_scaled(jit):
    tx = jaxmp.loss_scaling(optax.sgd(0.1), "dynamic")
    params = {"w": jnp.ones(2)}

    def ours(params, state):
        _, grads = jaxmp.value_and_grad(_quadratic, state)(params)
        return tx.update(grads, state, params)

    def by_hand(params, state):
        scale = jaxmp.get_loss_scale(state)
        grads = jax.grad(lambda p: scale.scale(_quadratic(p)))(params)
        return tx.update(grads, state, params)

    with warnings.catch_warnings():
        warnings.simplefilter("error", jaxmp.MixedPrecisionWarning)
        for step in (by_hand, ours):
            updates, _ = (jax.jit(step) if jit else step)(params, tx.init(params))
            np.testing.assert_allclose(np.asarray(updates["w"]), 0.1 * 2 * (3.0 - 1.0), rtol=1e-6)


def test_the_scaled_mark_is_not_carried_into_the_next_state():
    # The mark belongs to the loss-scale object that scaled a loss, not to later states.
    tx = jaxmp.loss_scaling(optax.sgd(0.1), "dynamic")
    params = {"w": jnp.ones(2)}
    state = tx.init(params)
    _, grads = jaxmp.value_and_grad(_quadratic, state)(params)
    _, state = tx.update(grads, state, params)
    with pytest.warns(jaxmp.MixedPrecisionWarning, match="never multiplied a loss"):
        tx.update(jax.grad(_quadratic)(params), state, params)


@pytest.mark.standard_promotion(reason="optax.MultiSteps: float32 gradients / int32 count")
def test_the_scaled_mark_crosses_jit_arguments_and_multisteps_cond():
    tx = jaxmp.loss_scaling(optax.sgd(0.1), "dynamic")
    params = {"w": jnp.ones(2)}
    state = tx.init(params)
    _, grads = jax.jit(jaxmp.value_and_grad(_quadratic, state))(params)  # scales with (marks) this state
    with warnings.catch_warnings():
        warnings.simplefilter("error", jaxmp.MixedPrecisionWarning)
        _, new_state = jax.jit(tx.update)(grads, state, params)  # the update in another jitted function
        assert jax.tree_util.tree_structure(new_state) == jax.tree_util.tree_structure(state)  # no retrace key
        _accumulation_run("around")


@pytest.mark.slow  # default-tier time: the slow tier runs it
def test_the_scaled_mark_reaches_an_nnx_optimizer_state_kept_in_variables():
    from flax import nnx

    import jaxmp.flax

    model = jaxmp.flax.mixed_precision(nnx.Linear(4, 3, rngs=nnx.Rngs(0)), "O1-fp16")
    x = jnp.ones((2, 4))
    loss = lambda m: jnp.mean(m(x).astype(jnp.float32) ** 2)  # noqa: E731
    optimizer = nnx.Optimizer(model, jaxmp.loss_scaling(optax.sgd(0.1), "dynamic"), wrt=nnx.Param)
    with pytest.warns(jaxmp.MixedPrecisionWarning, match="never multiplied a loss"):
        optimizer.update(model, nnx.grad(loss)(model))
    optimizer = nnx.Optimizer(model, jaxmp.loss_scaling(optax.sgd(0.1), "dynamic"), wrt=nnx.Param)
    with warnings.catch_warnings():
        warnings.simplefilter("error", jaxmp.MixedPrecisionWarning)
        # A loss scaled by hand under plain nnx.grad: neither warning (the fp16 region's is decided
        # when the gradient is traced, after scale.scale ran).
        scale = jaxmp.get_loss_scale(jaxmp.flax.nnx.optimizer_state(optimizer))  # a pure copy, linked
        optimizer.update(model, nnx.grad(lambda m: scale.scale(loss(m)))(model))
        jaxmp.flax.nnx.train_step(model, optimizer, (x, jnp.zeros(2, jnp.int32)))


def test_a_float16_loss_warns_and_names_the_float32_cast():
    state = jaxmp.loss_scaling(optax.sgd(0.1)).init({"w": jnp.ones(2)})
    with pytest.warns(jaxmp.MixedPrecisionWarning, match=r"loss is float16.*cast the logits or the loss to float32"):
        jaxmp.value_and_grad(lambda p: jnp.sum(p["w"].astype(jnp.float16)), state)({"w": jnp.ones(2)})
    with warnings.catch_warnings():
        warnings.simplefilter("error", jaxmp.MixedPrecisionWarning)
        jaxmp.value_and_grad(lambda p: jnp.sum(p["w"]), state)({"w": jnp.ones(2)})  # float32: silent
        jaxmp.value_and_grad(lambda p: jnp.sum(p["w"].astype(jnp.float16)), jaxmp.NoOpLossScale())({"w": jnp.ones(2)})


def test_a_chain_that_touches_gradients_before_loss_scaling_warns():
    params = {"w": jnp.ones(2)}
    tx = optax.chain(optax.clip_by_global_norm(1.0), jaxmp.loss_scaling(optax.sgd(0.1)))
    with pytest.warns(jaxmp.MixedPrecisionWarning, match="1 transform.*before jaxmp.loss_scaling.*outermost"):
        jaxmp.value_and_grad(_quadratic, tx.init(params))(params)
    good = jaxmp.loss_scaling(optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(0.1)))
    with warnings.catch_warnings():
        warnings.simplefilter("error", jaxmp.MixedPrecisionWarning)
        jaxmp.value_and_grad(_quadratic, good.init(params))(params)


def test_fp16_params_without_master_weights_warn():
    with pytest.warns(jaxmp.MixedPrecisionWarning, match="without a float32 master copy"):
        jaxmp.loss_scaling(optax.sgd(0.1), "dynamic").init({"w": jnp.ones(2, jnp.float16)})
    with warnings.catch_warnings():
        warnings.simplefilter("error", jaxmp.MixedPrecisionWarning)
        jaxmp.loss_scaling(optax.sgd(0.1), "dynamic", master_weights=True).init({"w": jnp.ones(2, jnp.float16)})
        jaxmp.loss_scaling(optax.sgd(0.1), "none").init({"w": jnp.ones(2, jnp.float16)})  # O3: pure half on purpose


def test_nested_loss_scaling_is_rejected():
    tx = jaxmp.loss_scaling(jaxmp.loss_scaling(optax.sgd(0.1)))
    with pytest.raises(ValueError, match="loss_scaling wraps another loss_scaling"):
        tx.init({"w": jnp.ones(2)})


def test_complex_leaves_are_unscaled_and_checked():
    tx = jaxmp.loss_scaling(optax.sgd(0.1), "static:65536")
    params = {"z": jnp.array([1 + 2j, -1j], jnp.complex64), "w": jnp.ones(2)}
    state = tx.init(params)
    loss_fn = lambda p: jnp.sum(jnp.abs(p["z"]) ** 2) + jnp.sum(p["w"] ** 2)  # noqa: E731
    _, grads = jaxmp.value_and_grad(loss_fn, state)(params)
    updates, state = tx.update(grads, state, params)
    true = jax.grad(loss_fn)(params)
    np.testing.assert_allclose(np.asarray(updates["z"]), -0.1 * np.asarray(true["z"]), rtol=1e-6)
    bad = {**grads, "z": grads["z"].at[0].set(complex(0, np.inf))}
    updates, state = tx.update(bad, state, params)
    assert not bool(state.last_step_finite) and int(state.skip_reason) == 2
    assert leaf_bytes(optax.apply_updates(params, updates)) == leaf_bytes(params)


def test_integer_gradient_leaves_never_reach_the_optimizer():
    tx = jaxmp.loss_scaling(optax.sgd(0.1), "none")
    params = {"w": jnp.ones(2), "n": jnp.int32(3)}
    with pytest.raises(TypeError, match=r"gradient leaf at \['n'\] has dtype int32.*allow_int=True"):
        tx.update({"w": jnp.ones(2), "n": jnp.int32(1)}, tx.init(params), params)


def test_a_nan_learning_rate_on_float32_updates_is_rejected():
    params = {"w": jnp.ones(2)}
    tx = jaxmp.loss_scaling(optax.sgd(float("nan")), "none")
    with pytest.raises(ValueError, match="non-finite constant.*learning rate"):
        jax.jit(tx.update)(params, tx.init(params), params)
    with pytest.raises(ValueError, match="initial state holds inf/NaN.*learning_rate"):
        jaxmp.loss_scaling(optax.inject_hyperparams(optax.sgd)(learning_rate=float("nan")), "none").init(params)


def test_an_inf_learning_rate_is_still_rejected():
    params = {"w": jnp.ones(2)}
    with pytest.raises(ValueError, match="non-finite constant"):
        jaxmp.loss_scaling(optax.sgd(float("inf")), "none").update(params, jaxmp.loss_scaling(
            optax.sgd(float("inf")), "none").init(params), params)
    with pytest.raises(ValueError, match="initial state holds inf/NaN.*learning_rate"):
        jaxmp.loss_scaling(optax.inject_hyperparams(optax.sgd)(learning_rate=float("inf")), "none").init(params)


@pytest.mark.parametrize("clip", [optax.clip_by_global_norm, optax.clip_by_block_rms, optax.clip])
def test_an_infinite_clipping_threshold_trains_as_optax(clip):
    # inf means "no clipping": it is multiplied in the branch a select never takes, or divided
    # under a max, and never reaches the updates.
    params, grads = {"w": jnp.ones(3)}, {"w": jnp.array([0.1, -0.2, 0.3])}
    inner = optax.chain(clip(float("inf")), optax.sgd(0.1))
    want = inner.update(grads, inner.init(params), params)[0]["w"]
    tx = jaxmp.loss_scaling(inner, "none")
    np.testing.assert_array_equal(np.asarray(tx.update(grads, tx.init(params), params)[0]["w"]), np.asarray(want))


@pytest.mark.parametrize("inner", [
    lambda: optax.chain(optax.sgd(1e-2), optax.contrib.reduce_on_plateau()),
    lambda: optax.lbfgs(),
    lambda: optax.chain(optax.sgd(1.0), optax.scale_by_backtracking_linesearch(max_backtracking_steps=5)),
], ids=["reduce_on_plateau", "lbfgs", "backtracking_linesearch"])
def test_a_state_that_starts_at_inf_outside_the_hyperparameters_is_accepted(inner):
    params = {"w": jnp.ones(3)}
    state = jaxmp.loss_scaling(inner(), "none").init(params)
    assert any(np.isinf(np.asarray(x)).any() for x in jax.tree_util.tree_leaves(state.inner_state))


# ---------------------------------------------------------------------------------------------
# Mismatched trees.

def test_params_of_the_wrong_shape_are_rejected_with_master_weights():
    tx = jaxmp.loss_scaling(optax.sgd(0.1), "none", master_weights=True)
    state = tx.init({"w": jnp.ones((2, 3), jnp.float16)})
    with pytest.raises(ValueError, match=r"leaf at \['w'\] has shape \(2, 3\) but the params leaf has \(3,\)"):
        tx.update({"w": jnp.ones((2, 3), jnp.float16)}, state, {"w": jnp.ones(3, jnp.float16)})


@pytest.mark.standard_promotion(reason="optax.adam: bias correction is a Python float ** int32 count")
def test_a_state_made_for_other_params_or_another_optimizer_is_named():
    params = {"w": jnp.ones(3)}
    tx = jaxmp.loss_scaling(optax.adam(1e-2), "none")
    with pytest.raises(ValueError, match=r"inner_state\[0\]\.mu\['w'\] has shape \(4,\).*gives \(3,\)"):
        tx.update(params, tx.init({"w": jnp.ones(4)}), params)
    with pytest.raises(ValueError, match="does not belong to this optimizer"):
        tx.update(params, jaxmp.loss_scaling(optax.sgd(1e-2), "none").init(params), params)
    # A state that broadcasts against the params (no error inside optax) is named too.
    with pytest.raises(ValueError, match=r"inner_state\[0\]\.mu\['w'\] has shape \(1,\).*gives \(3,\)"):
        tx.update(params, tx.init({"w": jnp.ones(1)}), params)


def test_a_transform_chained_after_master_weights_is_refused_not_dropped():
    params, grads = {"w": jnp.ones(2, jnp.bfloat16)}, {"w": jnp.ones(2, jnp.bfloat16)}
    tx = optax.chain(jaxmp.loss_scaling(optax.sgd(0.25), "none", master_weights=True), optax.scale(0.0))
    state = tx.init(params)
    updates, new_state = tx.update(grads, state, params)
    with pytest.raises(ValueError, match="after the one keeping float32 master weights"):
        jaxmp.apply_updates(params, updates, new_state)
    with pytest.raises(ValueError, match="after the one keeping float32 master weights"):
        jaxmp._scaling._transform.update_and_apply(tx, grads, state, params)
    # Nothing after it: fine.
    tx = optax.chain(jaxmp.loss_scaling(optax.sgd(0.25), "none", master_weights=True))
    state = tx.init(params)
    new, _ = jaxmp._scaling._transform.update_and_apply(tx, grads, state, params)
    np.testing.assert_array_equal(np.asarray(new["w"], np.float32), [0.75, 0.75])


def test_apply_updates_does_not_broadcast():
    with pytest.raises(ValueError, match=r"updates leaf at \['w'\] has shape \(3,\)"):
        jaxmp.apply_updates({"w": jnp.ones((2, 3))}, {"w": jnp.ones(3)})


# ---------------------------------------------------------------------------------------------
# Synchronised BatchNorm statistics.

def _bn_loss(params, model_state, batch):
    x = batch["x"] @ params["w"]
    mean = jnp.mean(x, axis=0)
    new_state = {"mean": 0.9 * model_state["mean"] + 0.1 * mean}
    y = (x - mean) * params["s"]
    return jnp.mean((y - batch["y"]) ** 2), new_state


def _bn_problem(n_steps, batch):
    rng = np.random.default_rng(0)
    params = {"w": jnp.asarray(rng.normal(size=(3, 4)), jnp.float32), "s": jnp.ones(4)}
    xs = rng.normal(size=(n_steps, batch, 3)).astype(np.float32) * np.arange(1, batch + 1)[None, :, None]
    ys = rng.normal(size=(n_steps, batch, 4)).astype(np.float32)
    return params, {"mean": jnp.zeros(4)}, xs, ys


def test_pmap_step_keeps_batch_stats_bitwise_equal_across_replicas():
    n = 4
    devices = jax.local_devices()[:n]
    tx = jaxmp.loss_scaling(optax.sgd(0.05), "dynamic", axis_name="batch")
    step = jaxmp.parallel.make_pmap_train_step(_bn_loss, tx, "batch", devices=devices, model_state=True)
    params, ms, xs, ys = _bn_problem(4, 16)
    p, m, s = (jaxmp.parallel.replicate(t, devices) for t in (params, ms, tx.init(params)))
    for t in range(4):
        x = xs[t].copy()
        if t == 2:
            x[0, 0] = np.nan  # one replica overflows: every replica skips, statistics included
        before = leaf_bytes(m)
        p, m, s, metrics = step(p, m, s, jaxmp.parallel.shard_batch({"x": x, "y": ys[t]}, n))
        if t == 2:
            assert not np.any(np.asarray(metrics["last_step_finite"])) and leaf_bytes(m) == before
    stats = np.asarray(m["mean"])
    assert all(stats[i].tobytes() == stats[0].tobytes() for i in range(n))
    assert np.any(stats[0] != 0)
    jaxmp.parallel.check_replicated((p, m, s), num_replicas=n)


def test_pmap_step_returns_a_model_state_equal_on_every_replica_exactly():
    # A sum of six equal float32 values divided by six is not always the value: a model state the
    # loss passes through unchanged (frozen statistics) would drift a few ulps per step.
    n = 6
    devices = jax.local_devices()[:n]
    frozen = np.random.default_rng(0).normal(size=1000).astype(np.float32)
    assert np.any((frozen * np.float32(n)) / np.float32(n) != frozen)  # the drift the guard prevents

    def loss_fn(params, model_state, batch):
        loss, new = _bn_loss(params, {"mean": model_state["mean"]}, batch)
        return loss, {"mean": new["mean"], "frozen": model_state["frozen"]}

    tx = jaxmp.loss_scaling(optax.sgd(0.05), "dynamic", axis_name="batch")
    step = jaxmp.parallel.make_pmap_train_step(loss_fn, tx, "batch", devices=devices, model_state=True)
    params, ms, xs, ys = _bn_problem(3, 24)
    ms = {**ms, "frozen": frozen}
    p, m, s = (jaxmp.parallel.replicate(t, devices) for t in (params, ms, tx.init(params)))
    for t in range(3):
        p, m, s, _ = step(p, m, s, jaxmp.parallel.shard_batch({"x": xs[t], "y": ys[t]}, n))
    assert np.asarray(m["frozen"]).tobytes() == np.tile(frozen, (n, 1)).tobytes()
    assert np.any(np.asarray(m["mean"])[0] != 0)  # the statistics that do differ are still averaged
    jaxmp.parallel.check_replicated((p, m, s), num_replicas=n)


def _linen_bn_problem():
    import flax.linen as nn

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = nn.BatchNorm(use_running_average=False, momentum=0.5)(nn.Dense(8)(x))
            return nn.Dense(1)(nn.Dropout(0.3, deterministic=False)(x))[:, 0]

    net = Net()
    x = np.random.default_rng(3).normal(size=(32, 4)).astype(np.float32)
    variables = net.init({"params": jax.random.key(0), "dropout": jax.random.key(1)}, x)

    def loss_fn(params, batch_stats, batch, rng):
        out, new = net.apply({"params": params, "batch_stats": batch_stats}, batch["x"], rngs={"dropout": rng},
                             mutable=["batch_stats"])
        return jnp.mean((out - batch["y"]) ** 2), new["batch_stats"]

    return loss_fn, variables["params"], variables["batch_stats"], x


@pytest.mark.slow  # ~3 s: a pmap BatchNorm + dropout step compiled twice
def test_pmap_step_keeps_flax_batchnorm_statistics_bitwise_equal_with_dropout():
    # A Flax BatchNorm (mean and var), a different dropout mask and batch shard per replica.
    n = 4
    devices = jax.local_devices()[:n]
    loss_fn, params, batch_stats, x = _linen_bn_problem()
    tx = jaxmp.loss_scaling(optax.sgd(0.05), "dynamic", axis_name="batch")
    step = jaxmp.parallel.make_pmap_train_step(loss_fn, tx, "batch", devices=devices, model_state=True)
    p, m, s = (jaxmp.parallel.replicate(t, devices) for t in (params, batch_stats, tx.init(params)))
    for t in range(3):
        batch = jaxmp.parallel.shard_batch({"x": x * (t + 1), "y": x.sum(-1)}, n)
        p, m, s, _ = step(p, m, s, batch, jax.random.key(t))
    for leaf in jax.tree_util.tree_leaves(m):
        leaf = np.asarray(leaf)
        assert all(leaf[i].tobytes() == leaf[0].tobytes() for i in range(n))
    jaxmp.parallel.check_replicated((p, m, s), num_replicas=n)


def test_pmap_step_refuses_batch_stats_carried_in_aux():
    n = 2
    devices = jax.local_devices()[:n]
    loss_fn, params, batch_stats, x = _linen_bn_problem()
    tx = jaxmp.loss_scaling(optax.sgd(0.05), "dynamic", axis_name="batch")

    def aux_loss(params, batch, rng):  # the statistics smuggled out per replica: they would drift apart
        loss, new = loss_fn(params, batch_stats, batch, rng)
        return loss, {"batch_stats": new}

    step = jaxmp.parallel.make_pmap_train_step(aux_loss, tx, "batch", devices=devices, has_aux=True)
    p, s = (jaxmp.parallel.replicate(t, devices) for t in (params, tx.init(params)))
    with pytest.raises(ValueError, match=r"'batch_stats' in its aux.*drift apart.*model_state=True"):
        step(p, s, jaxmp.parallel.shard_batch({"x": x, "y": x.sum(-1)}, n), jax.random.key(0))


def test_sharded_step_carries_model_state_and_keeps_it_on_skipped_steps():
    mesh = jaxmp.parallel.make_data_mesh(jax.devices()[:4])
    tx = jaxmp.loss_scaling(optax.sgd(0.05), "dynamic")
    step = jaxmp.parallel.make_sharded_train_step(_bn_loss, tx, mesh, model_state=True)
    params, ms, xs, ys = _bn_problem(3, 16)
    p, m, s = jaxmp.parallel.replicate_on_mesh((params, ms, tx.init(params)), mesh)
    p, m, s, metrics = step(p, m, s, jaxmp.parallel.make_global_batch({"x": xs[0], "y": ys[0]}, mesh))
    assert bool(metrics["last_step_finite"]) and np.any(np.asarray(m["mean"]) != 0)
    x = xs[1].copy()
    x[3, 1] = np.inf
    before = leaf_bytes(m)
    p, m, s, metrics = step(p, m, s, jaxmp.parallel.make_global_batch({"x": x, "y": ys[1]}, mesh))
    assert not bool(metrics["last_step_finite"]) and leaf_bytes(m) == before


def test_a_non_finite_loss_with_finite_gradients_is_applied_the_gradients_decide():
    from jaxmp._step import make_step

    params = {"w": jnp.ones(3)}
    tx = jaxmp.loss_scaling(optax.sgd(0.1))
    loss_fn = lambda p, ms, batch, rng: (jnp.sum(p["w"]) + jax.lax.stop_gradient(batch), (ms, None))  # noqa: E731
    step = jax.jit(make_step(loss_fn, tx))
    out = step(params, {}, tx.init(params), jnp.float32(jnp.nan))
    assert np.isnan(float(out.loss)) and bool(out.finite) and int(out.opt_state.skip_reason) == 0
    np.testing.assert_allclose(out.params["w"], 0.9)
    # A non-finite loss that reaches the gradients skips, and says so.
    loss_fn = lambda p, ms, batch, rng: (jnp.sum(p["w"] * batch), (ms, None))  # noqa: E731
    out = jax.jit(make_step(loss_fn, tx))(params, {}, tx.init(params), jnp.float32(jnp.nan))
    assert not bool(out.finite) and int(out.opt_state.skip_reason) == 1
    np.testing.assert_array_equal(out.params["w"], params["w"])


# ---------------------------------------------------------------------------------------------
# Gradient accumulation: optax.MultiSteps inside and around loss_scaling.

def _accumulation_run(order, k=2, steps=6):
    rng = np.random.default_rng(1)
    xs = rng.normal(size=(steps, 8, 3)).astype(np.float32)
    params = {"w": jnp.zeros(3)}
    loss_fn = lambda p, x: jnp.mean((x @ p["w"] - 1.0) ** 2)  # noqa: E731
    if order == "inside":
        tx = jaxmp.loss_scaling(optax.MultiSteps(optax.sgd(0.1), k), jaxmp.DynamicLossScale(2.0**10, period=1))
    else:
        tx = optax.MultiSteps(jaxmp.loss_scaling(optax.sgd(0.1), jaxmp.DynamicLossScale(2.0**10, period=1)), k)
    state = tx.init(params)

    @jax.jit
    def step(params, state, x):
        _, grads = jaxmp.value_and_grad(loss_fn, state)(params, x)
        updates, state = tx.update(grads, state, params)
        return jaxmp.apply_updates(params, updates, state), state

    for t in range(steps):
        params, state = step(params, state, xs[t])
    # The reference: plain SGD on the mean gradient of each group of k batches.
    ref = {"w": jnp.zeros(3)}
    for t in range(0, steps, k):
        g = sum(jax.grad(loss_fn)(ref, xs[t + i])["w"] for i in range(k)) / k
        ref = {"w": ref["w"] - 0.1 * g}
    return params, ref, state


@pytest.mark.standard_promotion(reason="optax.MultiSteps: float32 gradients / int32 count")
@pytest.mark.parametrize("order", ["inside", "around"])
def test_multisteps_in_both_orders_matches_large_batch_sgd(order):
    params, ref, state = _accumulation_run(order)
    np.testing.assert_allclose(np.asarray(params["w"]), np.asarray(ref["w"]), rtol=1e-5)
    stats = jaxmp.scaling_stats(state)
    # Inside: the scale adjusts on every micro-batch (6 finite steps); around: only on the k-th (3).
    assert float(stats["loss_scale"]) == 2.0 ** (10 + (6 if order == "inside" else 3))


@pytest.mark.standard_promotion(reason="optax.adam: bias correction is a Python float ** int32 count")
def test_cond_and_select_agree_on_every_decision_and_leave_skipped_steps_unchanged():
    rng = np.random.default_rng(2)
    params = {"w": jnp.asarray(rng.normal(size=(4, 4)), jnp.float16)}
    grads = [{"w": jnp.asarray(rng.normal(size=(4, 4)), jnp.float16)} for _ in range(6)]
    grads[2] = {"w": grads[2]["w"].at[1, 1].set(jnp.inf)}
    results = {}
    for mode in ("cond", "select"):
        tx = jaxmp.loss_scaling(optax.adam(1e-2), "static:1", master_weights=True, skip_with=mode)
        p, s = params, tx.init(params)
        update = jax.jit(tx.update)
        flags, bits = [], []
        for g in grads:
            before = leaf_bytes((p, s.inner_state))
            u, s = update(g, s, p)
            p = jaxmp.apply_updates(p, u, s)
            flags.append(bool(s.last_step_finite))
            if not flags[-1]:
                assert leaf_bytes((p, s.inner_state)) == before
            bits.append(np.asarray(p["w"], np.float32))
        results[mode] = flags, bits
    assert results["cond"][0] == results["select"][0] == [True, True, False, True, True, True]
    # Same decisions; applied values agree to rounding (XLA may fuse the two programs differently).
    for a, b in zip(results["cond"][1], results["select"][1]):
        np.testing.assert_allclose(a, b, rtol=2e-3)


def test_a_named_chain_after_master_weights_is_refused_like_a_chain():
    inner = jaxmp.loss_scaling(optax.sgd(0.5), "none", master_weights=True)
    tx = optax.named_chain(("ls", inner), ("scale", optax.scale(0.1)))
    params = {"w": jnp.ones(2, jnp.bfloat16)}
    state = tx.init(params)
    updates, state = tx.update({"w": jnp.ones(2, jnp.bfloat16)}, state, params)
    with pytest.raises(ValueError, match="after the one keeping"):
        jaxmp.apply_updates(params, updates, state)


def test_an_infinite_adaptive_clipping_threshold_trains_as_optax():
    # adaptive_grad_clip(inf) multiplies by inf in the branch jnp.where (a nested jit) never takes.
    params = {"w": jnp.ones((4, 3))}
    grads = {"w": jnp.full((4, 3), 0.1)}
    inner = optax.chain(optax.adaptive_grad_clip(float("inf")), optax.sgd(0.1))
    tx = jaxmp.loss_scaling(inner, "none")
    got, _ = tx.update(grads, tx.init(params), params)
    want, _ = inner.update(grads, inner.init(params), params)
    np.testing.assert_array_equal(np.asarray(got["w"]), np.asarray(want["w"]))
