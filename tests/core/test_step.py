"""The step family (jaxmp/_step.py): every train step reports the same metrics keys in a plain
dict, and the sharded step's layout is a value shard_state takes, so the layout is spelled once."""

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxmp
import jaxmp.flax
import jaxmp.parallel

#: What every jaxmp train step reports (the Flax steps add ``accuracy``, a parallel step with
#: ``has_aux`` adds ``aux``).
STEP_KEYS = {"loss", "loss_scale", "last_step_finite", "consecutive_skips", "total_skips"}

X = np.linspace(-1.0, 1.0, 16 * 4, dtype=np.float32).reshape(16, 4)
Y = np.arange(16) % 3


def _linen_metrics():
    model = jaxmp.flax.mixed_precision(nn.Dense(3), "O1-fp16")
    # init jitted: one program instead of the eager random draws (the values do not matter here)
    state = jaxmp.flax.TrainState.create(model, jax.jit(model.init)(jax.random.key(0), X),
                                         jaxmp.loss_scaling(optax.sgd(0.1), "dynamic"))
    return jax.jit(jaxmp.flax.make_train_step())(state, (X, Y))[1]


def _nnx_metrics():
    # A constant kernel: no eager random draw to compile (the metrics' keys do not depend on it).
    linear = nnx.Linear(4, 3, kernel_init=nnx.initializers.constant(0.1), rngs=nnx.Rngs(0))
    model = jaxmp.flax.mixed_precision(linear, "O1-fp16")
    optimizer = nnx.Optimizer(model, jaxmp.loss_scaling(optax.sgd(0.1), "dynamic"), wrt=nnx.Param)
    return nnx.jit(jaxmp.flax.nnx.train_step)(model, optimizer, (X, Y))


def _loss(p, b):
    return jnp.mean((b["x"] @ p["w"] - b["y"]) ** 2)


def _batch():
    return {"x": X, "y": np.ones((16, 3), np.float32)}


def _pmap_metrics():
    tx = jaxmp.loss_scaling(optax.sgd(0.1), "dynamic", axis_name="batch")
    params = {"w": jnp.zeros((4, 3))}
    step = jaxmp.parallel.make_pmap_train_step(_loss, tx, "batch")
    p, s = jaxmp.parallel.replicate(params), jaxmp.parallel.replicate(tx.init(params))
    return step(p, s, jaxmp.parallel.shard_batch(_batch()))[2]


def _sharded_metrics():
    mesh = jaxmp.parallel.make_data_mesh()
    tx = jaxmp.loss_scaling(optax.sgd(0.1), "dynamic")
    params = {"w": jnp.zeros((4, 3))}
    step = jaxmp.parallel.make_sharded_train_step(_loss, tx, mesh)
    p, s = jaxmp.parallel.shard_state((params, tx.init(params)), step.layout)
    return step(p, s, jaxmp.parallel.make_global_batch(_batch(), mesh))[2]


STEPS = {"linen make_train_step": _linen_metrics, "nnx train_step": _nnx_metrics,
         "pmap": _pmap_metrics, "sharded": _sharded_metrics}


@pytest.fixture(scope="module")
def metrics():
    return {name: build() for name, build in STEPS.items()}


def test_every_step_reports_the_same_metrics_keys(metrics):
    keys = {name: set(m) - {"accuracy"} for name, m in metrics.items()}
    assert keys == {name: STEP_KEYS for name in STEPS}, keys
    for name, m in metrics.items():
        assert type(m) is dict, name  # through jit, nnx.jit and pmap alike
        assert m["last_step_finite"].dtype == jnp.bool_ and m["total_skips"].dtype == jnp.int32, name
        assert np.all(np.asarray(m["last_step_finite"])) and not np.any(np.asarray(m["total_skips"])), name
    assert "accuracy" in metrics["linen make_train_step"] and "accuracy" in metrics["nnx train_step"]


def test_the_sharded_steps_layout_is_the_value_shard_state_takes():
    mesh = jaxmp.parallel.make_data_mesh()
    tx = jaxmp.loss_scaling(optax.adam(0.1), "dynamic", master_weights=True)
    params = {"w": jnp.zeros((4, 64), jnp.bfloat16), "b": jnp.zeros(64, jnp.bfloat16)}
    step = jaxmp.parallel.make_sharded_train_step(_loss, tx, mesh, layout="zero", min_shard_size=64)
    assert (step.layout.name, step.layout.mesh, step.layout.min_shard_size) == ("zero", mesh, 64)
    p, s = jaxmp.parallel.shard_state((params, tx.init(params)), step.layout)
    # The step's own shardings: its options (min_shard_size 64 shards the bias too) came along.
    ps, ss = step.shardings(params, tx.init(params))
    assert jaxmp.master_params(s)["b"].sharding.spec == jaxmp.master_params(ss)["b"].spec == jax.P("data")
    assert jax.tree_util.tree_all(jax.tree_util.tree_map(lambda x, sh: x.sharding == sh, (p, s), (ps, ss)))
    # The old spelling still works and agrees.
    p2, s2 = jaxmp.parallel.shard_state((params, tx.init(params)), mesh, "zero", min_shard_size=64)
    assert jax.tree_util.tree_all(jax.tree_util.tree_map(lambda a, b: a.sharding == b.sharding, (p, s), (p2, s2)))
    # A Layout's options are not given a second time.
    with pytest.raises(ValueError, match="given twice"):
        jaxmp.parallel.shard_state((params, tx.init(params)), step.layout, "fsdp")
    with pytest.raises(ValueError, match="min_shard_size given besides a Layout"):
        jaxmp.parallel.shard_state((params, tx.init(params)), step.layout, min_shard_size=0)
    step2 = jaxmp.parallel.make_sharded_train_step(_loss, tx, step.layout)
    assert step2.layout is step.layout


# ---------------------------------------------------------------------------------------------
# make_step, step_metrics, make_loss_fn_step and the checks, unit by unit.

from jaxmp._step import (LOCAL, Replicas, StateRules, StepResult, Strategy, TrainStep,  # noqa: E402
                        check_differentiable_params, check_no_model_state_in_aux, make_loss_fn_step, make_step,
                        step_metrics)


def _quad(p, s, b, rng):
    return jnp.mean((b @ p["w"]) ** 2), ({"calls": s["calls"] + 1}, {"rng": rng})


def test_make_step_applies_a_finite_step_and_keeps_the_model_state():
    tx = jaxmp.loss_scaling(optax.sgd(0.1), "static:4")
    params, ms = {"w": jnp.ones(3)}, {"calls": jnp.int32(0)}
    out = jax.jit(make_step(_quad, tx))(params, ms, tx.init(params), jnp.ones((2, 3)), jnp.uint32(7))
    assert isinstance(out, StepResult) and bool(out.finite)
    assert float(out.loss) == 9.0 and out.loss.dtype == jnp.float32 and float(out.loss_scale) == 4.0
    # d/dw mean((b @ w)^2) = 2 * (b @ w) * b averaged = 6 per entry: w - 0.1 * 6 (unscaled).
    np.testing.assert_allclose(out.params["w"], np.full(3, 0.4), rtol=1e-6)
    assert int(out.model_state["calls"]) == 1 and int(out.aux["rng"]) == 7


def test_make_step_skips_a_non_finite_step_and_keeps_the_old_model_state_bitwise():
    tx = jaxmp.loss_scaling(optax.sgd(0.1), "dynamic")
    params, ms = {"w": jnp.array([1.0, -0.0, 2.0])}, {"calls": jnp.int32(5)}
    batch = jnp.array([[jnp.inf, 1.0, 1.0]])
    out = jax.jit(make_step(_quad, tx))(params, ms, tx.init(params), batch)
    assert not bool(out.finite) and int(out.model_state["calls"]) == 5
    assert np.asarray(out.params["w"]).tobytes() == np.asarray(params["w"]).tobytes()
    s = jaxmp._scaling._opt_state.find_loss_scaling_state(out.opt_state)
    assert int(s.skip_reason) == 1  # the loss (given as value) was the non-finite thing
    assert float(s.loss_scale.loss_scale) == 2.0 ** 14  # backed off
    # Without the loss passed as value, the same step blames the gradients.
    out = jax.jit(make_step(_quad, tx, pass_value=False))(params, ms, tx.init(params), batch)
    assert int(jaxmp._scaling._opt_state.find_loss_scaling_state(out.opt_state).skip_reason) == 2


class _Odd(Strategy):
    # A layout whose every reduction is visible in the result.
    def reduce_grads(self, grads):
        return jax.tree_util.tree_map(jnp.zeros_like, grads)

    def reduce_loss(self, loss):
        return loss * 0 + 1

    def reduce_model_state(self, model_state):
        return {"calls": model_state["calls"] * 10}


def test_make_step_uses_the_strategys_reducers_and_the_state_rules_skip_rule():
    tx = jaxmp.loss_scaling(optax.sgd(1.0), "none")
    params = {"w": jnp.ones(3)}
    seen = {}
    step = make_step(_quad, tx, _Odd(), state=StateRules(keep=lambda f, new, old: seen.setdefault("kept", new)))
    out = jax.jit(step)(params, {"calls": jnp.int32(1)}, tx.init(params), np.ones((2, 3), np.float32))  # one program
    assert out.params["w"].tolist() == [1.0] * 3  # zeroed gradients: no move
    assert float(out.loss) == 1.0 and int(out.model_state["calls"]) == 20


def test_make_step_averages_gradients_over_a_pmap_axis_before_the_update():
    n = jax.local_device_count()
    tx = jaxmp.loss_scaling(optax.sgd(1.0), "none", axis_name="b")
    params = {"w": jnp.zeros(())}
    step = make_step(lambda p, s, b, r: (jnp.sum(p["w"] * b), (s, None)), tx, Replicas(["b"]))
    rep = lambda x: jax.tree_util.tree_map(lambda a: np.stack([np.asarray(a)] * n), x)  # noqa: E731
    out = jax.pmap(step, axis_name="b")(rep(params), rep({}), rep(tx.init(params)), np.arange(n, dtype=np.float32))
    np.testing.assert_allclose(out.params["w"], np.full(n, -(n - 1) / 2))  # every replica steps by the mean
    np.testing.assert_allclose(out.loss, np.zeros(n))


def test_every_builder_returns_a_train_step_record_with_its_settings_as_fields():
    """Built, not run (no compile): the sharded and pmap steps are `TrainStep` records whose
    fields are their settings, under one name (``reduce_dtype``), and the loss they wrap."""
    tx = jaxmp.loss_scaling(optax.sgd(0.1), "none")
    loss = lambda p, b: jnp.sum(p["w"] * b)  # noqa: E731
    sharded = jaxmp.parallel.make_sharded_train_step(loss, tx, jaxmp.parallel.make_data_mesh(), layout="zero",
                                                     reduce_dtype="bfloat16")
    pmapped = jaxmp.parallel.make_pmap_train_step(loss, tx, reduce_dtype=jnp.float16)
    linen = jaxmp.flax.make_train_step()
    assert all(isinstance(s, TrainStep) for s in (sharded, pmapped, linen))
    assert sharded.reduce_dtype == jnp.bfloat16 and pmapped.reduce_dtype == jnp.float16
    assert sharded.layout.name == "zero" and sharded.mesh is sharded.layout.mesh
    assert sharded.loss_fn is loss and pmapped.loss_fn is loss and pmapped.num_devices == jax.local_device_count()
    assert callable(sharded.lower) and callable(pmapped.pmapped)
    # A field another kind of step has is no None on this one: an AttributeError naming whose it is.
    with pytest.raises(AttributeError, match=r"'PmapTrainStep' object has no attribute 'lower': only a "
                                             r"ShardedTrainStep \(jaxmp.parallel.make_sharded_train_step"):
        pmapped.lower
    with pytest.raises(AttributeError, match=r"no attribute 'mesh': only a ShardedTrainStep"):
        pmapped.mesh
    with pytest.raises(AttributeError, match=r"'TrainStep' object has no attribute 'layout'"):
        linen.layout
    with pytest.raises(AttributeError, match=r"no attribute 'bogus'$"):
        linen.bogus


def test_each_builder_fills_every_field_of_its_record():
    """Issue 61 item 4: the common fields, extended per builder (as optax's
    ``GradientTransformationExtraArgs`` extends ``GradientTransformation``): every field a step
    has is one its builder made, none left None for another builder's sake."""
    tx = jaxmp.loss_scaling(optax.sgd(0.1), "none")
    loss = lambda p, b: jnp.sum(p["w"] * b)  # noqa: E731
    mesh = jaxmp.parallel.make_data_mesh()
    steps = {"sharded": jaxmp.parallel.make_sharded_train_step(loss, tx, mesh, layout="fsdp"),
             "sharded, XLA's reduce": jaxmp.parallel.make_sharded_train_step(loss, tx, mesh, reduce_dtype=None),
             "pmap": jaxmp.parallel.make_pmap_train_step(loss, tx),
             "linen": jaxmp.flax.make_train_step()}
    common = ["run", "loss_fn", "loss_view"]
    assert [f.name for f in dataclasses.fields(TrainStep) if not f.name.startswith("_")] == common
    fields = {name: [f.name for f in dataclasses.fields(s) if not f.name.startswith("_")] for name, s in steps.items()}
    assert fields == {"sharded": common + ["layout", "reduce_dtype", "lower", "shardings"],
                      "sharded, XLA's reduce": common + ["layout", "reduce_dtype", "lower", "shardings"],
                      "pmap": common + ["reduce_dtype", "pmapped", "pmapped_with_rng", "num_devices"],
                      "linen": common}
    unfilled = {(name, f) for name, s in steps.items() for f in fields[name]
                if getattr(s, f) is None and f not in ("loss_fn", "reduce_dtype")}
    assert unfilled == set() and steps["sharded, XLA's reduce"].reduce_dtype is None
    assert type(steps["linen"]) is TrainStep and all(type(s) is not TrainStep for n, s in steps.items() if n != "linen")
    # Still one immutable, slotted record: no __dict__ for jax.jit's functools.wraps to copy.
    for s in steps.values():
        assert not hasattr(s, "__dict__")
        with pytest.raises(dataclasses.FrozenInstanceError, match=r"cannot assign to TrainStep.run"):
            s.run = None  # type: ignore[misc]
    # A replaced field keeps the record's kind (and its fields).
    jitted = dataclasses.replace(steps["pmap"], run=jax.jit(steps["pmap"].run))
    assert type(jitted) is type(steps["pmap"]) and jitted.pmapped is steps["pmap"].pmapped


def test_a_train_step_record_is_jitted_under_its_functions_name_and_signature():
    def my_step(params, opt_state, batch, rng=None):
        return params * batch

    step = TrainStep(my_step, None, lambda *a: None)
    # donate_argnames resolves against my_step's parameters, not __call__'s (*args, **kwargs).
    jitted = jax.jit(step, donate_argnames=("params",))
    assert "jit_my_step" in jitted.lower(np.ones(2, np.float32), None, np.ones(2, np.float32)).as_text()
    assert jitted.__wrapped__ is step and step.__name__ == "my_step"
    with pytest.raises(dataclasses.FrozenInstanceError):
        step.run = None  # type: ignore[misc]


def test_step_metrics_reports_the_scale_this_step_used():
    tx = jaxmp.loss_scaling(optax.sgd(0.1), jaxmp.DynamicLossScale(8.0, period=1))
    params = {"w": jnp.ones(3)}
    out = jax.jit(make_step(_quad, tx))(params, {"calls": jnp.int32(0)}, tx.init(params), np.ones((2, 3), np.float32))
    m = step_metrics(out, accuracy=jnp.float32(0.5))
    assert float(m["loss_scale"]) == 8.0 and float(m["accuracy"]) == 0.5 and type(m) is dict
    assert float(jaxmp.scaling_stats(out[2])["loss_scale"]) == 16.0  # grown after one finite step: the next


def test_the_checks_name_the_offending_leaf_and_the_way_out():
    check_differentiable_params({"w": jnp.ones(1), "h": jnp.ones(1, jnp.bfloat16)})
    with pytest.raises(TypeError, match=r"params leaf at \['idx'\] has dtype int32.*model_state=True"):
        check_differentiable_params({"w": jnp.ones(1), "idx": jnp.arange(2)})
    with pytest.raises(TypeError, match="leaf at <root> has dtype None"):
        check_differentiable_params("weights")
    check_no_model_state_in_aux({"acc": 1})
    check_no_model_state_in_aux(("batch_stats",))
    with pytest.raises(ValueError, match="'batch_stats' in its aux.*model_state=True"):
        check_no_model_state_in_aux({"batch_stats": {}})


class _PlusOneKey(Strategy):
    def replica_key(self, rng):
        return rng + 1


class _PerReplicaAux(Strategy):
    per_replica_aux = True


def _generic(loss_fn, strategy=LOCAL, **kw):
    tx = jaxmp.loss_scaling(optax.sgd(0.1), "none")
    kw = {"has_aux": False, "with_rng": False, **kw}
    return tx, make_loss_fn_step(loss_fn, tx, strategy, **kw)


def test_make_loss_fn_step_calls_each_loss_signature_as_declared():
    params = {"w": jnp.ones(2)}
    calls = []

    def loss(p, s, b, rng):
        calls.append((s, rng))
        return jnp.sum(p["w"] * b), ({"n": s["n"] + 1}, "aux")

    tx, body = _generic(loss, _PlusOneKey(), has_aux=True, with_model_state=True, with_rng=True)
    (p, s), _, m = body((params, {"n": jnp.int32(0)}), tx.init(params), jnp.ones(2), jnp.uint32(4))
    assert int(calls[-1][1]) == 5 and int(s["n"]) == 1 and m["aux"] == "aux"
    np.testing.assert_allclose(p["w"], [0.9, 0.9])
    assert set(m) == STEP_KEYS | {"aux"}
    tx, body = _generic(lambda p, b: (jnp.sum(p["w"] * b), {"x": 1}), has_aux=True)
    p, _, m = body(params, tx.init(params), jnp.ones(2))
    assert m["aux"] == {"x": 1} and set(m) == STEP_KEYS | {"aux"}


def test_make_loss_fn_step_refuses_per_replica_batch_stats_fp8_state_and_integer_params():
    params = {"w": jnp.ones(2)}
    tx, body = _generic(lambda p, b: (jnp.sum(p["w"]), {"batch_stats": 0}), _PerReplicaAux(), has_aux=True)
    with pytest.raises(ValueError, match="batch_stats"):
        body(params, tx.init(params), jnp.ones(2))
    tx, body = _generic(lambda p, s, b: (jnp.sum(p["w"]), s), with_model_state=True)
    with pytest.raises(ValueError, match="delayed fp8 scaling state"):
        body((params, {jaxmp.fp8._state.FP8_COLLECTION: {}}), tx.init(params), jnp.ones(2))
    tx, body = _generic(lambda p, b: jnp.sum(p["w"]))
    with pytest.raises(TypeError, match=r"\['n'\] has dtype int32"):
        body({"w": jnp.ones(2), "n": jnp.int32(0)}, tx.init(params), jnp.ones(2))


def test_every_step_reports_the_loss_scale_this_step_used():
    """``metrics["loss_scale"]`` means one thing in the Flax, pmap and sharded steps: the scale
    this step's loss was multiplied by (on an overflow, the one that overflowed)."""
    model = jaxmp.flax.mixed_precision(nn.Dense(2), "O1-bf16")
    x = np.ones((8, 3), np.float32)
    y = np.zeros(8, np.int32)
    bad = x.copy()
    bad[0, 0] = np.inf  # a non-finite loss and gradients: the step is skipped, the scale halves
    batches = [x, bad, x]
    variables = jax.jit(model.init)(jax.random.key(0), x)  # one program, not eager random draws
    tx = jaxmp.loss_scaling(optax.sgd(0.1), jaxmp.DynamicLossScale(2.0**15))

    state = jaxmp.flax.TrainState.create(model, variables, tx)
    flax_step, flax_scales = jax.jit(jaxmp.flax.make_train_step()), []
    for b in batches:
        state, m = flax_step(state, (b, y))
        flax_scales.append(float(m["loss_scale"]))

    def loss_fn(params, batch):
        logits = model.apply({"params": params}, batch["x"]).astype(jnp.float32)
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

    mesh = jaxmp.parallel.make_data_mesh()
    sharded = jaxmp.parallel.make_sharded_train_step(loss_fn, tx, mesh)
    p, s = jaxmp.parallel.replicate_on_mesh((variables["params"], tx.init(variables["params"])), mesh)
    sharded_scales = []
    for b in batches:
        p, s, m = sharded(p, s, jaxmp.parallel.make_global_batch({"x": b, "y": y}, mesh))
        sharded_scales.append(float(m["loss_scale"]))
    assert flax_scales == sharded_scales == [2.0**15, 2.0**15, 2.0**14]
    assert float(jaxmp.scaling_stats(s)["loss_scale"]) == 2.0**14  # the next step's: in the state


def test_a_train_step_says_what_to_do_when_misused():
    """Issue 59 item 15: swapped arguments, a replaced loss_fn, pickling, assigning and unpacking."""
    import copy
    import pickle

    tx = jaxmp.loss_scaling(optax.adam(0.1), "dynamic", axis_name=None)
    loss = lambda p, b: jnp.mean((b @ p["w"]) ** 2)  # noqa: E731
    params, batch = {"w": jnp.ones((3, 1))}, np.ones((8, 3), np.float32)
    mesh = jaxmp.parallel.make_data_mesh()
    sharded = jaxmp.parallel.make_sharded_train_step(loss, tx, mesh)
    pmapped = jaxmp.parallel.make_pmap_train_step(loss, tx)
    p, s = jaxmp.parallel.shard_state((params, tx.init(params)), mesh)
    # Swapped: named as a swap, not blamed on the optimizer state's integer counters.
    swapped = r"first argument holds an optimizer state \(jaxmp's LossScalingState at <root>\).*swapped"
    with pytest.raises(TypeError, match=swapped):
        sharded(s, p, batch)
    rep = jaxmp.parallel.replicate
    with pytest.raises(TypeError, match=swapped):
        pmapped(rep(tx.init(params)), rep(params), jaxmp.parallel.shard_batch(batch, jax.local_device_count()))
    with pytest.raises(TypeError, match=r"optimizer state \(optax's ScaleByAdamState at \[0\]\)"):
        check_differentiable_params(optax.adam(0.1).init(params))
    # A new loss beside the old run and loss_view would train one loss and debug another: refused.
    other = lambda p, b: jnp.sum(b @ p["w"])  # noqa: E731
    with pytest.raises(ValueError, match=r"run and loss_view were built around its loss_fn.*make_sharded_train_step"):
        dataclasses.replace(sharded, loss_fn=other)
    rebuilt = jaxmp.parallel.make_sharded_train_step(other, tx, mesh)
    # Replacing what is built around the loss along with it, or run alone (e.g. jitted), is fine.
    assert dataclasses.replace(sharded, run=jax.jit(sharded.run)).loss_fn is loss
    assert dataclasses.replace(sharded, loss_fn=other, run=rebuilt.run, loss_view=rebuilt.loss_view).loss_fn is other
    view = sharded.loss_view(p, s, batch)
    assert float(view.fn(*view.args)) == pytest.approx(float(loss(params, batch)))
    with pytest.raises(TypeError, match=r"cannot be pickled.*docs/guides/checkpointing.md.*make_sharded_train_step"):
        pickle.dumps(sharded)
    assert copy.copy(sharded) is sharded and copy.deepcopy(pmapped) is pmapped
    with pytest.raises(dataclasses.FrozenInstanceError, match=r"cannot assign to TrainStep.loss_fn: a step is immutable"):
        sharded.loss_fn = other  # type: ignore[misc]
    with pytest.raises(TypeError, match=r"not a tuple.*params, opt_state, metrics = step\(params, opt_state, batch\)"):
        _, _, _ = sharded
    with pytest.raises(TypeError, match=r"not a tuple.*state, metrics = step\(state, batch\)"):
        jaxmp.flax.make_train_step()[0]
