"""Bad input to the core gets a ValueError/TypeError whose message names the problem.

Two tables, each by class of input (policies, loss scales, value_and_grad, loss_scaling as built
and as updated, data parallel, lean recipes, autocast): ``CASES_BY_CLASS`` for input that must be
refused, ``WARN_CASES_BY_CLASS`` for input that runs but would train wrong and must warn.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxmp

_P = {"w": jnp.ones(3)}


def _update_with(grads, **kw):
    tx = jaxmp.loss_scaling(optax.sgd(0.1), **kw)
    return tx.update(grads, tx.init(_P), _P)


def _update_without_params(inner):
    tx = jaxmp.loss_scaling(inner)
    state = tx.init(_P)
    _, grads = jaxmp.value_and_grad(lambda p: jnp.sum(p["w"] ** 2), state)(_P)
    return tx.update(grads, state)


def _pmap_aux_batch_stats():
    devices = jax.local_devices()[:2]
    tx = jaxmp.loss_scaling(optax.sgd(0.1), axis_name="batch")
    loss = lambda p, b: (jnp.mean(b["x"] @ p["w"]), {"batch_stats": {"mean": jnp.mean(b["x"], 0)}})  # noqa: E731
    step = jaxmp.parallel.make_pmap_train_step(loss, tx, "batch", devices=devices, has_aux=True)
    p, s = (jaxmp.parallel.replicate(t, devices) for t in (_P, tx.init(_P)))
    return step(p, s, jaxmp.parallel.shard_batch({"x": np.ones((4, 3), np.float32)}, 2))


def _plain_grad_update(jit):
    tx = jaxmp.loss_scaling(optax.sgd(0.1), "dynamic")

    def step(params, state):
        return tx.update(jax.grad(lambda p: jnp.sum(p["w"] ** 2))(params), state, params)

    return (jax.jit(step) if jit else step)(_P, tx.init(_P))


def _lean_update_without_params(tx):
    params = {"w": jnp.ones(3, jnp.bfloat16)}
    return tx.update(params, tx.init(params))


def _select_mismatch():
    return jaxmp.select_tree(jnp.array(True), {"a": jnp.ones(2)}, {"b": jnp.ones(2)})


def _master_state_to_plain(master_first):
    with_master = jaxmp.loss_scaling(optax.sgd(0.1), "none", master_weights=True)
    plain = jaxmp.loss_scaling(optax.sgd(0.1), "none")
    tx, made_by = (plain, with_master) if master_first else (with_master, plain)
    return tx.update(_P, made_by.init(_P), _P)


def _sharded(donate=False, layout="zero"):
    """A sharded step on a tiny problem and a fresh state laid out for it (no compile until called)."""
    tx = jaxmp.loss_scaling(optax.sgd(0.1), "dynamic")
    params = {"w": jnp.zeros((8, 128))}
    loss = lambda p, b: jnp.mean((b["x"] @ p["w"] - b["y"]) ** 2)  # noqa: E731
    mesh = jaxmp.parallel.make_data_mesh()
    step = jaxmp.parallel.make_sharded_train_step(loss, tx, mesh, layout=layout, min_shard_size=0, donate=donate)
    batch = {"x": np.ones((16, 8), np.float32), "y": np.ones((16, 128), np.float32)}
    return step, (params, tx.init(params)), batch


def _pmap_replicated(how):
    """A (params, opt_state) pair in the pmap layout: each way a user can come by one."""
    step, state, batch = _sharded()
    if how == "jaxmp":
        out = jaxmp.parallel.replicate(state)
    elif how == "flax":
        import flax.jax_utils

        out = flax.jax_utils.replicate(state)
    elif how == "pmap step":  # a pmap step's outputs: laid out over its (the user's) axis name
        devices = jax.local_devices()
        sharding = jax.sharding.NamedSharding(jax.sharding.Mesh(np.asarray(devices), ("batch",)),
                                              jax.sharding.PartitionSpec("batch"))
        out = jax.tree_util.tree_map(lambda x: jax.device_put(np.stack([np.asarray(x)] * len(devices)), sharding),
                                     state)
    else:  # fetched to the host: numpy leaves, nothing says where they came from but the shapes
        out = jax.device_get(jaxmp.parallel.replicate(state))
    return step, out, batch


def _shard_pmap_state(how):
    step, state, _ = _pmap_replicated(how)
    return jaxmp.parallel.shard_state(state, step.layout)


def _step_on_pmap_state(how):
    step, state, batch = _pmap_replicated(how)
    return step(*state, batch)


_DONATED = []


def _donated_state():
    """A state a donate=True sharded step deleted (one compile, shared by the cases)."""
    if not _DONATED:
        step, state, batch = _sharded(donate=True)
        state = jaxmp.parallel.shard_state(state, step.layout)
        step(*state, batch)
        _DONATED.append((state, batch))
    return _DONATED[0]


def _donated_to_another_step():
    state, batch = _donated_state()
    return _sharded(layout="fsdp")[0](*state, batch)


def _donated_to_shard_state():
    return jaxmp.parallel.shard_state(_donated_state()[0], _sharded()[0].layout)


_LAYERS = {"w": jnp.stack([jnp.eye(4) * 0.5] * 3)}


def _scan(layers, **kw):
    return jaxmp.parallel.scan_layers(lambda h, p: (h @ p["w"], None), jnp.ones(4), layers, **kw)


def _accumulate_in_loop_with_new_shape():
    return jax.lax.fori_loop(0, 3, lambda i, y: jaxmp.accumulate(y, jnp.ones((2, 3))), jnp.zeros(3))


# The table, by class of input (one part of the public surface each): (id, callable, exception,
# message regex). A case's test id is "<class>: <id>"; a new case goes into its class.
CASES_BY_CLASS = {
    "policies, presets and platforms": [
        ("unknown dtype name", lambda: jaxmp.get_policy("p=f32,c=f12"), ValueError, r"Unknown dtype name 'f12'"),
        ("bare unknown name", lambda: jaxmp.get_policy("quarter"), ValueError,
         r"Unknown policy 'quarter'.*a preset \(O0, O1"),
        ("preset O4 lists the presets", lambda: jaxmp.get_policy("O4"), ValueError,
         r"Unknown policy 'O4'.*O0, O1, O2, O3.*mixed_float16"),
        ("spaced preset lists the presets", lambda: jaxmp.get_policy("O1 - bf16"), ValueError,
         r"Unknown policy 'O1 - bf16'.*'O2-bf16'"),
        ("Keras typo lists the presets", lambda: jaxmp.get_policy("mixed_float32"), ValueError,
         r"mixed_float16, mixed_bfloat16"),
        ("unknown key", lambda: jaxmp.get_policy("q=f16"), ValueError, r"Unknown key 'q'"),
        ("malformed part", lambda: jaxmp.get_policy("p=f32,c"), ValueError, r"Malformed policy part 'c'"),
        ("double equals", lambda: jaxmp.get_policy("p==f32"), ValueError, r"Malformed policy part"),
        ("duplicate key", lambda: jaxmp.get_policy("p=f32,params=f16"), ValueError, r"given twice"),
        ("empty policy", lambda: jaxmp.get_policy("  "), ValueError, r"empty"),
        ("non-string policy", lambda: jaxmp.get_policy(16), TypeError, r"policy name must be a string"),
        ("bad preset suffix", lambda: jaxmp.get_policy("O2-fp4"), ValueError, r"Unknown half dtype 'fp4'.*'O2-fp8'"),
        ("unknown recipe", lambda: jaxmp.get_recipe("O7"), ValueError, r"Unknown preset 'O7'"),
        ("integer compute dtype", lambda: jaxmp.Policy(jnp.float32, jnp.int8, jnp.float32), TypeError,
         r"compute_dtype must be a floating dtype.*int8"),
        ("bool param dtype", lambda: jaxmp.Policy(jnp.bool_, jnp.float16, jnp.float32), TypeError,
         r"param_dtype must be a floating dtype"),
        ("not a policy", lambda: jaxmp.as_policy(3.0), TypeError, r"Expected a jaxmp.Policy"),
        ("unknown platform", lambda: jaxmp.recommended_policy(platform="fpga"), ValueError, r"unknown platform 'fpga'"),
        ("bad compute capability", lambda: jaxmp.recommended_policy(platform="gpu", compute_capability="x.y"),
         ValueError, r"compute_capability must look like"),
    ],
    "loss scales": [
        ("negative static scale", lambda: jaxmp.StaticLossScale(-2.0), ValueError,
         r"loss_scale must be a positive finite"),
        ("zero static scale", lambda: jaxmp.StaticLossScale(0.0), ValueError, r"loss_scale must be a positive finite"),
        ("inf dynamic scale", lambda: jaxmp.DynamicLossScale(float("inf")), ValueError,
         r"loss_scale must be a positive finite"),
        ("nan dynamic scale", lambda: jaxmp.DynamicLossScale(float("nan")), ValueError,
         r"loss_scale must be a positive finite"),
        ("vector scale", lambda: jaxmp.StaticLossScale([1.0, 2.0]), TypeError, r"loss_scale must be a real scalar"),
        ("string scale", lambda: jaxmp.StaticLossScale("big").scale(1.0), TypeError,
         r"loss_scale must be a real scalar"),
        ("zero growth interval", lambda: jaxmp.DynamicLossScale(period=0), ValueError,
         r"period \(growth interval\) must be >= 1"),
        ("float growth interval", lambda: jaxmp.DynamicLossScale(period=2.5), TypeError,
         r"period \(growth interval\) must be an int"),
        ("growth factor 1", lambda: jaxmp.DynamicLossScale(factor=1.0), ValueError,
         r"factor \(growth factor\) must be"),
        ("backoff above 1", lambda: jaxmp.DynamicLossScale(backoff_factor=2.0), ValueError,
         r"backoff_factor must be in \(0, 1\)"),
        ("min above max", lambda: jaxmp.DynamicLossScale(2.0, min_loss_scale=8.0, max_loss_scale=4.0), ValueError,
         r"min_loss_scale \(8.0\) is larger than max_loss_scale"),
        ("initial outside bounds", lambda: jaxmp.DynamicLossScale(2.0**30), ValueError,
         r"outside \[min_loss_scale, max_loss_scale\]"),
        ("negative counter", lambda: jaxmp.DynamicLossScale(counter=-1), ValueError, r"counter must be a non-negative"),
        ("bool dynamic scale", lambda: jaxmp.DynamicLossScale(True), TypeError,
         r"loss_scale must be a number, got the bool"),
        ("bool counter", lambda: jaxmp.DynamicLossScale(counter=True), TypeError,
         r"counter must be a number, got the bool"),
        ("counter 2**40 would wrap", lambda: jaxmp.DynamicLossScale(counter=2**40), ValueError,
         r"counter must be <= 2\*\*31 - 1 \(it is an int32 leaf"),
        ("counter 2**31 would turn negative", lambda: jaxmp.DynamicLossScale(counter=2**31), ValueError,
         r"counter must be <= 2\*\*31 - 1"),
        ("int64 numpy counter out of range", lambda: jaxmp.DynamicLossScale(counter=np.int64(2**33)), ValueError,
         r"counter must be <= 2\*\*31 - 1"),
        ("replicated counter out of range", lambda: jaxmp.DynamicLossScale(np.full(2, 8.0), np.array([0, 2**32])),
         ValueError, r"counter must hold integers in \[0, 2\*\*31 - 1\]"),
        ("negative replicated counter", lambda: jaxmp.DynamicLossScale(np.full(2, 8.0), np.array([0, -1])),
         ValueError, r"counter must hold integers in \[0, 2\*\*31 - 1\]"),
        ("float counter", lambda: jaxmp.DynamicLossScale(counter=1.5), ValueError,
         r"counter must be a non-negative integer"),
        ("growth interval past int32", lambda: jaxmp.DynamicLossScale(period=2**31), ValueError,
         r"period \(growth interval\) must be <= 2\*\*31 - 1"),
        ("unknown loss scale spec", lambda: jaxmp.make_loss_scale("huge"), ValueError, r"Unknown loss scale 'huge'"),
        ("bad static spec", lambda: jaxmp.make_loss_scale("static:lots"), ValueError, r"cannot read the static scale"),
        ("adjust with non-bool", lambda: jaxmp.DynamicLossScale().adjust(jnp.float32(1.0)), TypeError,
         r"boolean scalar.*float32"),
        ("adjust with vector", lambda: jaxmp.DynamicLossScale().adjust(jnp.ones(2, bool)), ValueError,
         r"boolean scalar, got shape"),
    ],
    "skip decision": [
        ("select_tree mismatched trees", _select_mismatch, ValueError, r"same structure"),
        ("select_tree mismatched leaves", lambda: jaxmp.select_tree(jnp.array(True), jnp.ones(2), jnp.ones(3)),
         ValueError, r"leaves differ"),
    ],
    "value_and_grad": [
        ("non-scalar loss", lambda: jaxmp.value_and_grad(lambda w: w * 2, jaxmp.NoOpLossScale())(jnp.ones(3)), ValueError,
         r"loss must be a scalar, got shape \(3,\)"),
        ("integer loss", lambda: jaxmp.value_and_grad(lambda w: jnp.int32(1), jaxmp.NoOpLossScale())(jnp.ones(3)),
         TypeError, r"loss must be floating point"),
        ("has_aux without pair", lambda: jaxmp.value_and_grad(lambda w: jnp.sum(w), jaxmp.NoOpLossScale(), has_aux=True)(
            jnp.ones(3)), ValueError, r"has_aux=True, fun must return a pair"),
        ("value_and_grad without scale", lambda: jaxmp.value_and_grad(lambda w: jnp.sum(w), optax.sgd(0.1).init(_P)),
         ValueError, r"no jaxmp.loss_scaling state found"),
        ("non-callable loss", lambda: jaxmp.value_and_grad(3, jaxmp.NoOpLossScale()), TypeError,
         r"fun must be callable"),
    ],
    "loss_scaling: building it": [
        ("inner not optax", lambda: jaxmp.loss_scaling(lambda g: g), TypeError,
         r"inner must be an optax GradientTransformation"),
        ("master_weights not bool", lambda: jaxmp.loss_scaling(optax.sgd(0.1), master_weights="yes"), TypeError,
         r"master_weights must be a bool"),
        ("integer master dtype", lambda: jaxmp.loss_scaling(optax.sgd(0.1), master_dtype=jnp.int32), TypeError,
         r"master_dtype must be a floating dtype"),
        ("master_dtype name accepted", lambda: jaxmp.loss_scaling(optax.sgd(0.1), master_dtype="bf17"), TypeError,
         r"master_dtype must be a floating dtype.*names: \["),
        ("bool static scale given to loss_scaling", lambda: jaxmp.loss_scaling(optax.sgd(0.1), jaxmp.StaticLossScale(True)),
         TypeError, r"StaticLossScale.loss_scale is the bool True"),
        ("axis_name list holding a list", lambda: jaxmp.loss_scaling(optax.sgd(0.1), axis_name=[["b"]]), TypeError,
         r"axis_name must be a str, or a tuple or list of str"),
        ("empty axis_name list", lambda: jaxmp.loss_scaling(optax.sgd(0.1), axis_name=[]), ValueError,
         r"axis_name must name at least one axis"),
    ],
    "loss_scaling: update and state": [
        ("mismatched grad tree", lambda: _update_with({"v": jnp.ones(3)}), ValueError, r"different tree structures"),
        ("mismatched grad shape", lambda: _update_with({"w": jnp.ones(4)}), ValueError, r"has shape \(4,\) but"),
        ("non-array grad leaf", lambda: _update_with({"w": "grad"}), TypeError, r"gradient leaf at \['w'\] is a str"),
        ("omitted params, weight decay", lambda: _update_without_params(optax.adamw(1e-3)), ValueError,
         r"inner optimizer needs the params.*tx.update\(grads, state, params\).*master_weights=True"),
        ("omitted params, lookahead", lambda: _update_without_params(optax.lookahead(optax.sgd(0.1), 2, 0.5)), ValueError,
         r"inner optimizer needs the params.*AttributeError"),
        ("wrong state type", lambda: jaxmp.loss_scaling(optax.sgd(0.1)).update(_P, optax.EmptyState(), _P), TypeError,
         r"state must be the LossScalingState"),
        ("master-weights state to a plain loss_scaling", lambda: _master_state_to_plain(True), ValueError,
         r"state has a float32 master copy.*this optimizer keeps none.*master_weights=True.*master_weights=False"),
        ("plain state to a master-weights loss_scaling", lambda: _master_state_to_plain(False), ValueError,
         r"state has no float32 master copy.*keeps float32 master weights.*tx.init\(params\)"),
        ("no master weights", lambda: jaxmp.master_params(jaxmp.loss_scaling(optax.sgd(0.1)).init(_P)), ValueError,
         r"keeps no master weights"),
        ("bad max_consecutive_skips", lambda: jaxmp.check_health(jaxmp.loss_scaling(optax.sgd(0.1)).init(_P), 0),
         ValueError, r"max_consecutive_skips must be an int >= 1"),
        ("two loss-scaling states", lambda: jaxmp._scaling._opt_state.find_loss_scaling_state(
            [jaxmp.loss_scaling(optax.sgd(0.1)).init(_P)] * 2), ValueError, r"found 2 jaxmp.loss_scaling states"),
    ],
    "data parallel": [
        ("pmap batch_stats carried in aux", _pmap_aux_batch_stats, ValueError,
         r"'batch_stats' in its aux.*model_state=True"),
    ],
    "data parallel: sharded state": [
        # Each was JAX's "Gradient only defined for scalar-output functions" (the replica axis
        # laid out as data) or a raw shape error.
        *[(f"shard_state of a {how}-replicated state", lambda how=how: _shard_pmap_state(how), ValueError,
           rf"{where} .*leading replica axis|{where} is pmap-replicated.*jaxmp.parallel.unreplicate\(state\).*"
           r"shard_state\(\(params, opt_state\), mesh, 'zero'\)")
          for how, where in (("jaxmp", r"params leaf at \['w'\]"), ("flax", r"params leaf at \['w'\]"),
                             ("pmap step", r"opt_state leaf at \.total_skips"),
                             ("host", r"opt_state leaf at \.total_skips"))],
        *[(f"sharded step given a {how}-replicated state", lambda how=how: _step_on_pmap_state(how), ValueError,
           r"leaf at .*(is pmap-replicated|a scalar, with a leading replica axis).*jaxmp.parallel.unreplicate\(state\)")
          for how in ("flax", "pmap step", "host")],
        ("donated state to another step", _donated_to_another_step, ValueError,
         r"params leaf at \['w'\] was donated to an earlier call of a step built with donate=True.*"
         r"pass the params and opt_state the last call returned"),
        ("donated state to shard_state", _donated_to_shard_state, ValueError,
         r"params leaf at \['w'\] was donated to an earlier call of a step built with donate=True"),
    ],
    "data parallel: per-layer gathers": [
        ("gather_params in int8", lambda: jaxmp.parallel.gather_params(_LAYERS, jnp.int8), TypeError,
         r"gather_params: dtype must be a floating dtype .*got int8.*or None to use them as stored"),
        ("scan_layers in int8", lambda: _scan(_LAYERS, dtype=jnp.int8), TypeError,
         r"scan_layers: dtype must be a floating dtype .*got int8"),
        ("gather_params dtype misspelt", lambda: jaxmp.parallel.gather_params(_LAYERS, "bfloat61"), TypeError,
         r"gather_params: dtype must be a floating dtype, got 'bfloat61' \(names: \[.*'bfloat16'"),
        ("scan_layers of layers of different lengths", lambda: _scan({**_LAYERS, "b": jnp.ones((2, 4))}), ValueError,
         r"scan_layers: the layers' leaves disagree on the number of layers .*2 layers: \['b'\]; 3 layers: \['w'\]"),
        ("scan_layers of no layers", lambda: _scan({}), ValueError, r"scan_layers got no layers: layers=\{\}"),
        ("scan_layers of a scalar leaf", lambda: _scan({"w": jnp.float32(2)}), ValueError,
         r"scan_layers: the layers leaf at \['w'\] is a scalar"),
    ],
    "lean recipes": [
        ("stochastic rounding without a key", lambda: jaxmp.lean.bf16_params(optax.sgd(0.1)), TypeError,
         r"bf16_params rounds stochastically and needs key="),
        ("seed past 32 bits", lambda: jaxmp.lean.bf16_params(optax.sgd(0.1), key=2**40), ValueError,
         r"int seed must fit in 32 bits.*got 1099511627776.*repeat the stream of seed 0"),
        ("numpy seed past 32 bits", lambda: jaxmp.lean.bf16_moments(optax.adam(0.1), key=np.int64(-2**33)), ValueError,
         r"int seed must fit in 32 bits"),
        ("non-threefry key", lambda: jaxmp.lean.bf16_moments(optax.adam(0.1), jax.random.key(0, impl="rbg")), ValueError,
         r"threefry2x32 key.*got a rbg key"),
        ("remainders of float16 params", lambda: jaxmp.lean.param_remainders(optax.sgd(0.1)).init(
            {"w": jnp.ones(2, jnp.float16)}), TypeError, r"float16 value is not the high half of a float32"),
        ("remainders updated without params", lambda: _lean_update_without_params(jaxmp.lean.param_remainders(
            optax.sgd(0.1))), ValueError, r"param_remainders updates the params themselves.*tx.update\(grads, state, params\)"),
        ("unknown lean preset", lambda: jaxmp.lean.preset("fp4", optax.adam(0.1)), ValueError,
         r"Unknown lean preset 'fp4'"),
    ],
    "autocast: accumulate": [
        ("accumulate mismatched trees", lambda: jaxmp.accumulate({"a": jnp.zeros(3)}, {"b": jnp.ones(3)}), ValueError,
         r"accumulate: total and delta must have the same tree structure"),
        ("accumulate into a Python float", lambda: jaxmp.accumulate(0.0, jnp.ones(3)), TypeError,
         r"accumulate: total must be an array, got the float 0.0.*jnp.float32\(0.0\)"),
        ("accumulate changing the carry shape in a loop", _accumulate_in_loop_with_new_shape, ValueError,
         r"accumulate: delta has shape \(2, 3\), which would change total's shape \(3,\) to \(2, 3\).*delta.sum\(0\)"),
    ],
}
CASES = [(f"{cls}: {case[0]}", *case[1:]) for cls, cases in CASES_BY_CLASS.items() for case in cases]


# Input that runs but would train wrong: a clear warning naming the fix (id, callable, warning, message regex).
WARN_CASES_BY_CLASS = {
    "value_and_grad": [
        ("float16 loss", lambda: jaxmp.value_and_grad(lambda p: jnp.sum(p["w"].astype(jnp.float16)),
                                                      jaxmp.DynamicLossScale())(_P),
         jaxmp.MixedPrecisionWarning, r"loss is float16.*overflows.*cast the logits or the loss to float32"),
        ("transform before loss_scaling", lambda: jaxmp.value_and_grad(
            lambda p: jnp.sum(p["w"]), optax.chain(optax.clip(1.0), jaxmp.loss_scaling(optax.sgd(0.1))).init(_P)),
         jaxmp.MixedPrecisionWarning, r"before jaxmp.loss_scaling.*scaled\* gradients.*outermost"),
    ],
    "loss_scaling: update and state": [
        ("jax.grad gradients to a dynamic scale, eager", lambda: _plain_grad_update(False), jaxmp.MixedPrecisionWarning,
         r"never multiplied a loss: were they computed with jax.grad\?.*jaxmp.value_and_grad"),
        ("jax.grad gradients to a dynamic scale, jit", lambda: _plain_grad_update(True), jaxmp.MixedPrecisionWarning,
         r"never multiplied a loss: were they computed with jax.grad\?.*jaxmp.value_and_grad"),
        ("float16 params without master weights", lambda: jaxmp.loss_scaling(optax.sgd(0.1)).init(
            {"w": jnp.ones(2, jnp.float16)}), jaxmp.MixedPrecisionWarning, r"without a float32 master copy.*master_weights=True"),
    ],
    "autocast": [
        ("autocast 'fp16' means pure half", lambda: jaxmp.autocast(lambda x: jnp.sum(x), "fp16"), jaxmp.MixedPrecisionWarning,
         r"'fp16' is a bare dtype name.*\*pure\* float16.*use 'O1-fp16'"),
        ("autocast 'bf16' means pure half", lambda: jaxmp.autocast(lambda x: jnp.sum(x), "bf16"), jaxmp.MixedPrecisionWarning,
         r"'bf16' is a bare dtype name.*\*pure\* bfloat16.*use 'O1-bf16'"),
    ],
}
WARN_CASES = [(f"{cls}: {case[0]}", *case[1:]) for cls, cases in WARN_CASES_BY_CLASS.items() for case in cases]


@pytest.mark.parametrize("fn,warning,pattern", [c[1:] for c in WARN_CASES], ids=[c[0] for c in WARN_CASES])
def test_bad_input_warns_clearly(fn, warning, pattern):
    with pytest.warns(warning, match=pattern):
        fn()


@pytest.mark.parametrize("fn,exc,pattern", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_raises_clear_error(fn, exc, pattern):
    with pytest.raises(exc, match=pattern):
        fn()


def test_there_are_at_least_twenty_cases():
    assert len(CASES) >= 20


def test_every_class_has_cases_and_every_id_is_unique():
    for table in (CASES_BY_CLASS, WARN_CASES_BY_CLASS):
        assert all(table.values()), [cls for cls, cases in table.items() if not cases]
    ids = [c[0] for c in CASES + WARN_CASES]
    assert len(ids) == len(set(ids)), sorted({i for i in ids if ids.count(i) > 1})


def test_traced_scale_inside_jit_is_allowed():
    # Building a loss scale from a traced value inside jit must not trip the validation.
    out = jax.jit(lambda s: jaxmp.DynamicLossScale(s).adjust(jnp.array(False)).loss_scale)(jnp.float32(8.0))
    assert float(out) == 4.0


def test_mixed_precision_presets_under_autocast_do_not_warn():
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error", jaxmp.MixedPrecisionWarning)
        for policy in ("O1-fp16", "O1-bf16", "O2-fp16", "O3-fp16", "float32", "p=f32,c=f16,o=f32"):
            jaxmp.autocast(lambda x: jnp.sum(x), policy)

