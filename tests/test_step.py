"""The step family (jaxmp/step.py): every train step reports the same metrics keys, the renamed
key still reads with a DeprecationWarning, the metrics are a pytree jit and pmap return, and
the sharded step's layout is a value shard_state takes, so the layout is spelled once."""

import warnings

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
from jaxmp.step import DEPRECATED_METRICS, StepMetrics

#: What every jaxmp train step reports (the Flax steps add ``accuracy``, a parallel step with
#: ``has_aux`` adds ``aux``).
STEP_KEYS = {"loss", "loss_scale", "last_step_finite", "consecutive_skips", "total_skips"}

X = np.linspace(-1.0, 1.0, 16 * 4, dtype=np.float32).reshape(16, 4)
Y = np.arange(16) % 3


def _linen_metrics():
    model = jaxmp.flax.mixed_precision(nn.Dense(3), "O1-fp16")
    state = jaxmp.flax.TrainState.create(model, model.init(jax.random.key(0), X),
                                         jaxmp.loss_scaling(optax.sgd(0.1), "dynamic"))
    return jax.jit(jaxmp.flax.make_train_step())(state, (X, Y))[1]


def _nnx_metrics():
    model = jaxmp.flax.mixed_precision(nnx.Linear(4, 3, rngs=nnx.Rngs(0)), "O1-fp16")
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
        assert isinstance(m, StepMetrics), name  # through jit, nnx.jit and pmap alike
        assert m["last_step_finite"].dtype == jnp.bool_ and m["total_skips"].dtype == jnp.int32, name
        assert np.all(np.asarray(m["last_step_finite"])) and not np.any(np.asarray(m["total_skips"])), name
    assert "accuracy" in metrics["linen make_train_step"] and "accuracy" in metrics["nnx train_step"]


@pytest.mark.parametrize("name", ["linen make_train_step", "nnx train_step"])
def test_the_old_finite_key_still_reads_with_a_deprecation_warning(metrics, name):
    m = metrics[name]
    assert DEPRECATED_METRICS == {"finite": "last_step_finite"}
    with pytest.warns(DeprecationWarning, match=r"metrics\['finite'\] is deprecated.*metrics\['last_step_finite'\]"):
        old = m["finite"]
    assert old is m["last_step_finite"]
    with pytest.warns(DeprecationWarning, match="last_step_finite"):
        assert m.get("finite") is m["last_step_finite"]
    assert "finite" not in m and "finite" not in list(m)  # iteration and logging see the new keys only
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the new keys read silently
        m["last_step_finite"], m.get("loss_scale"), m.get("absent", 0)  # noqa: B018
    with pytest.raises(KeyError):
        m["absent"]  # noqa: B018


def test_step_metrics_are_a_pytree_that_jit_returns():
    m = StepMetrics(loss=jnp.float32(2.0), last_step_finite=jnp.bool_(True))
    leaves, treedef = jax.tree_util.tree_flatten(m)
    assert len(leaves) == 2 and isinstance(jax.tree_util.tree_unflatten(treedef, leaves), StepMetrics)
    out = jax.jit(lambda m: StepMetrics(m, loss=m["loss"] * 2))(m)
    assert isinstance(out, StepMetrics) and float(out["loss"]) == 4.0
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(m)]
    assert paths == ["['last_step_finite']", "['loss']"]  # as a plain dict's


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


def test_every_step_reports_the_loss_scale_this_step_used():
    """``metrics["loss_scale"]`` means one thing in the Flax, pmap and sharded steps: the scale
    this step's loss was multiplied by (on an overflow, the one that overflowed)."""
    model = jaxmp.flax.mixed_precision(nn.Dense(2), "O1-bf16")
    x = np.ones((8, 3), np.float32)
    y = np.zeros(8, np.int32)
    bad = x.copy()
    bad[0, 0] = np.inf  # a non-finite loss and gradients: the step is skipped, the scale halves
    batches = [x, bad, x]
    variables = model.init(jax.random.key(0), x)
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
