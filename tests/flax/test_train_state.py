"""Training Linen models with jaxmp.flax.TrainState: fp16 + dynamic scaling, bf16, O2, pmap, skipped steps.

The Flax guides' code blocks run in tests/docs/test_docs.py.
"""


import pathlib

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxmp

F32, BF16 = np.dtype(jnp.float32), np.dtype(jnp.bfloat16)
# These tiny programs are about dtypes and bookkeeping, not speed: compile them quickly.
FAST = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


class SmallCNN(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool = True):
        x = nn.Conv(8, (3, 3))(x)
        x = nn.BatchNorm(use_running_average=not train)(x)
        y = nn.Conv(8, (3, 3), use_bias=False)(nn.relu(x))
        x = nn.relu(x + nn.BatchNorm(use_running_average=not train)(y))
        return nn.Dense(4)(x.mean(axis=(1, 2)))


class SmallTransformer(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool = True):
        h = nn.LayerNorm()(x)
        x = x + nn.MultiHeadDotProductAttention(num_heads=2)(h, h)
        h = nn.LayerNorm()(x)
        x = x + nn.Dense(x.shape[-1])(nn.gelu(nn.Dense(16)(h)))
        return nn.Dense(4)(x.mean(axis=1))


def make_batch(kind, n=8):
    rng = np.random.default_rng(1)  # numpy: no eager XLA compiles for test data
    shape = {"cnn": (n, 6, 6, 3), "transformer": (n, 5, 8), "mlp": (n, 6)}[kind]
    return rng.normal(size=shape).astype(np.float32), rng.integers(0, 4, n).astype(np.int32)


class SmallMLP(nn.Module):
    """Dense + BatchNorm: the cheapest model with batch statistics (for pmap)."""

    @nn.compact
    def __call__(self, x, train: bool = True):
        x = nn.BatchNorm(use_running_average=not train)(nn.Dense(8)(x.reshape(x.shape[0], -1)))
        return nn.Dense(4)(nn.relu(x))


MODELS = {"cnn": SmallCNN, "transformer": SmallTransformer, "mlp": SmallMLP}


def same_bits(a, b):
    leaves_a, leaves_b = jax.tree.leaves(a), jax.tree.leaves(b)
    assert len(leaves_a) == len(leaves_b)
    return all(np.asarray(x).tobytes() == np.asarray(y).tobytes() for x, y in zip(leaves_a, leaves_b))


_INITIAL = {}


def initial_variables(kind):
    """float32 variables of the plain model, initialised once per model kind."""
    if kind not in _INITIAL:
        x, _ = make_batch(kind)
        _INITIAL[kind] = jax.jit(lambda k: MODELS[kind]().init(k, x, train=False), compiler_options=FAST)(jax.random.key(0))
    return _INITIAL[kind]


def make_state(kind, level, *, master_weights=False, axis_name=None, lr=1e-2):
    recipe = jaxmp.get_recipe(level)
    model = jaxmp.flax.mixed_precision(MODELS[kind](), recipe)
    x, _ = make_batch(kind)
    # The storage dtypes model.init would give (half params for O2, float32 norms), on shared values.
    storage = jax.eval_shape(lambda k: model.init(k, x, train=False), jax.random.key(0))
    variables = jax.tree.map(lambda v, s: np.asarray(v).astype(s.dtype), initial_variables(kind), storage)
    tx = jaxmp.loss_scaling(optax.adam(lr), recipe.loss_scale, master_weights=master_weights, axis_name=axis_name)
    return jaxmp.flax.TrainState.create(model, variables, tx)


@pytest.mark.standard_promotion(reason="optax.adam: bias correction is a Python float ** int32 count")
@pytest.mark.parametrize("kind,level", [("cnn", "O1-fp16"), ("cnn", "O1-bf16"),
                                        pytest.param("transformer", "O1-bf16", marks=pytest.mark.slow),
                                        pytest.param("transformer", "O1-fp16", marks=pytest.mark.slow)])
def test_training_and_forced_overflow(kind, level):
    state = make_state(kind, level)
    batch = make_batch(kind)
    step = jax.jit(jaxmp.flax.make_train_step(model_kwargs={"train": True}), compiler_options=FAST)
    losses = []
    for _ in range(5):
        state, metrics = step(state, batch)
        assert bool(metrics["last_step_finite"]) and metrics["loss"].dtype == F32
        losses.append(float(metrics["loss"]))
    assert np.all(np.isfinite(losses)) and losses[-1] < losses[0], losses
    assert int(state.step) == 5
    assert all(p.dtype == F32 for p in jax.tree.leaves(state.params))
    assert all(s.dtype == F32 for s in jax.tree.leaves(state.model_state))

    # An inf in the input poisons the activations, the batch statistics and the gradients.
    x, y = batch
    x = x.copy()
    x[0] = np.inf
    new, metrics = step(state, (x, y))
    assert not bool(metrics["last_step_finite"])
    assert same_bits(new.params, state.params)
    assert same_bits(new.model_state, state.model_state)  # batch_stats: the ImageNet example's miss
    assert same_bits(new.opt_state.inner_state, state.opt_state.inner_state)
    assert int(new.step) == int(state.step)  # applied steps only
    assert int(jaxmp.scaling_stats(new.opt_state)["total_skips"]) == 1
    old_scale = float(jaxmp.get_loss_scale(state.opt_state).loss_scale)
    expected = old_scale / 2 if level.endswith("fp16") else 1.0
    assert float(jaxmp.get_loss_scale(new.opt_state).loss_scale) == expected


@pytest.mark.standard_promotion(reason="optax.adam: bias correction is a Python float ** int32 count")
def test_o2_master_weights_keep_half_params_exact():
    state = make_state("cnn", "O2-bf16", master_weights=True)
    assert state.params["Conv_0"]["kernel"].dtype == BF16 and state.params["BatchNorm_0"]["scale"].dtype == F32
    step = jax.jit(jaxmp.flax.make_train_step(), compiler_options=FAST)
    batch = make_batch("cnn")
    first = None
    for _ in range(4):
        state, metrics = step(state, batch)
        first = float(metrics["loss"]) if first is None else first
    assert float(metrics["loss"]) < first
    master = jaxmp.master_params(state.opt_state)
    assert all(m.dtype == F32 for m in jax.tree.leaves(master))
    assert jax.tree.map(lambda p: p.dtype, state.params)["Dense_0"]["kernel"] == BF16
    assert same_bits(state.params, jax.tree.map(lambda p, m: m.astype(p.dtype), state.params, master))


@pytest.mark.standard_promotion(reason="optax.adam: bias correction is a Python float ** int32 count")
def test_pmap_replicas_agree_on_skipping():
    devices = jax.devices()[:2]
    state = make_state("mlp", "O1-fp16", axis_name="batch")
    state = jax.tree.map(lambda a: np.stack([a, a]), state)  # replicate along a leading axis
    x, y = make_batch("mlp")
    shard = lambda a: a.reshape((2, -1) + a.shape[1:])
    p_step = jax.pmap(jaxmp.flax.make_train_step(axis_name="batch"), axis_name="batch", devices=devices)
    state, metrics = p_step(state, (shard(x), shard(y)))
    assert np.asarray(metrics["last_step_finite"]).all()
    kernels = np.asarray(state.params["Dense_1"]["kernel"])
    np.testing.assert_array_equal(kernels[0], kernels[1])
    # Each replica's BatchNorm saw its own shard; the running statistics are averaged, not left
    # to drift apart (which would also break the next step's check that replicas agree).
    mean = np.asarray(state.model_state["batch_stats"]["BatchNorm_0"]["mean"])
    assert mean[0].tobytes() == mean[1].tobytes() and np.any(mean[0] != 0)
    jaxmp.parallel.check_replicated(state, num_replicas=2)
    # Only replica 0 sees an inf; both skip, both keep their params.
    x = x.copy()
    x[0] = np.inf
    new, metrics = p_step(state, (shard(x), shard(y)))
    assert not np.asarray(metrics["last_step_finite"]).any()
    assert same_bits(new.params, state.params) and same_bits(new.model_state, state.model_state)
    assert np.asarray(new.step).tolist() == [1, 1]


def test_state_survives_jit_identity():
    # The CNN: its variables are initialised once for the other tests already (the model is not the point).
    state = make_state("cnn", "O1-fp16")
    same = jax.jit(lambda s: s)(state)
    assert jax.tree.structure(same) == jax.tree.structure(state)
    assert same.model is state.model and same_bits(same, state)
    assert same.policy == jaxmp.get_policy("O1-fp16") and same.rules.float32_ops


def test_create_rejects_bad_arguments():
    model = jaxmp.flax.mixed_precision(SmallTransformer(), "O1-bf16")
    variables = {"params": {"w": jnp.ones(2)}}
    with pytest.raises(TypeError, match="loss_scaling"):
        jaxmp.flax.TrainState.create(model, variables, optax.sgd(0.1))
    with pytest.raises(TypeError, match="mixed_precision"):
        jaxmp.flax.TrainState.create(SmallTransformer(), variables, jaxmp.loss_scaling(optax.sgd(0.1)))
    with pytest.raises(ValueError, match="params"):
        jaxmp.flax.TrainState.create(model, {"batch_stats": {}}, jaxmp.loss_scaling(optax.sgd(0.1)))
    with pytest.raises(ValueError, match="label key"):
        jaxmp.flax._losses.split_batch({"image": 1})


_SEEN_MASKS: list = []   # module-level: Linen turns a list attribute into a tuple


class _DropoutNet(nn.Module):
    """Reports each forward pass's dropout mask to the host (the mask the step really drew)."""

    @nn.compact
    def __call__(self, x, train: bool = True):
        h = nn.Dropout(0.5, deterministic=not train)(x)
        jax.debug.callback(lambda m: _SEEN_MASKS.append(np.asarray(m)), h != 0)
        return nn.Dense(3)(h)


def test_the_step_after_a_skipped_step_draws_a_fresh_dropout_mask():
    x, y = np.ones((4, 16), np.float32), np.arange(4) % 3
    model = jaxmp.flax.mixed_precision(_DropoutNet(), "O1-fp16")
    init = jax.jit(lambda k: model.init(k, x, train=False), compiler_options=FAST)  # one program, not eager draws
    state = jaxmp.flax.TrainState.create(model, init(jax.random.key(0)), jaxmp.loss_scaling(optax.sgd(0.1), "dynamic"))
    jax.effects_barrier()
    seen = _SEEN_MASKS
    seen.clear()   # init's (deterministic) forward pass reported too
    step = jax.jit(jaxmp.flax.make_train_step(model_kwargs={"train": True}), compiler_options=FAST)
    rng = jax.random.key(7)   # one base key; the step folds in how many steps it has taken
    finite = []
    for t in range(3):
        xx = x.copy()
        if t == 1:
            xx[0] = np.inf    # overflows: skipped, state.step stays at 1
        state, metrics = step(state, (xx, y), rng)
        finite.append(bool(metrics["last_step_finite"]))
    jax.effects_barrier()
    assert finite == [True, False, True] and int(state.step) == 2 and len(seen) == 3
    assert not np.array_equal(seen[2], seen[1]) and not np.array_equal(seen[2], seen[0])
    # The t-th call draws with fold_in(rng, t), skipped steps counted: in a run that never skips
    # that is fold_in(rng, state.step), the key Flax's examples use, so such runs are unchanged.
    masks = list(seen)
    apply = jax.jit(lambda v, key: model.apply(v, x, train=True, rngs={"dropout": key}), compiler_options=FAST)
    for t in (0, 2):
        seen.clear()
        apply(state.variables, jax.random.fold_in(jax.random.fold_in(rng, t), 0))   # then the collection's index
        jax.effects_barrier()
        np.testing.assert_array_equal(seen[0], masks[t])


@pytest.mark.parametrize("spec", ["dynamic", "static:128", "none"])
def test_flax_msgpack_round_trip_restores_a_loss_scaling_state_exactly(spec):
    import dataclasses

    import flax.serialization as fs
    from flax.training import train_state

    params = {"w": jnp.ones(3)}
    tx = jaxmp.loss_scaling(optax.sgd(1e-2), spec)
    state = tx.init(params)
    if spec == "dynamic":  # a scale and counter that differ from the template's
        ls = dataclasses.replace(state.loss_scale, loss_scale=jnp.float32(2.0**9), counter=jnp.int32(7))
        state = state._replace(loss_scale=ls, total_skips=jnp.int32(3))
    back = fs.from_bytes(tx.init(params), fs.to_bytes(state))
    assert jax.tree_util.tree_structure(back) == jax.tree_util.tree_structure(state)
    for a, b in zip(jax.tree_util.tree_leaves(back), jax.tree_util.tree_leaves(state)):
        assert np.asarray(a).dtype == np.asarray(b).dtype
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    ts = train_state.TrainState.create(apply_fn=None, params=params, tx=tx).replace(opt_state=state)
    ts_back = fs.from_bytes(train_state.TrainState.create(apply_fn=None, params=params, tx=tx), fs.to_bytes(ts))
    assert float(jaxmp.get_loss_scale(ts_back.opt_state).loss_scale) == float(jaxmp.get_loss_scale(state).loss_scale)
    assert int(ts_back.opt_state.total_skips) == int(state.total_skips)


def test_labels_outside_the_classes_give_the_documented_nan_and_the_documented_check_catches_them():
    # Issue 37, item 7: a NaN loss (optax's behaviour, finite gradient, the step applied) is
    # documented with the host-side check to call, in the docstring and the Linen guide.
    x, y = np.ones((4, 3), np.float32), np.array([0, 1, 0, 7])
    model = jaxmp.flax.mixed_precision(nn.Dense(2), "O1-bf16")
    state = jaxmp.flax.TrainState.create(model, jax.jit(model.init, compiler_options=FAST)(jax.random.key(0), x),
                                         jaxmp.loss_scaling(optax.sgd(0.1), "none"))
    _, metrics = jax.jit(jaxmp.flax.make_train_step())(state, (x, y))
    assert np.isnan(float(metrics["loss"])) and bool(metrics["last_step_finite"])
    check = "assert 0 <= labels.min() and labels.max() < num_classes"
    doc = jaxmp.flax.make_train_step.__doc__
    assert "Labels outside the model's classes" in doc and check in doc
    with pytest.raises(AssertionError):
        exec(check, {"labels": y, "num_classes": 2})  # the documented check, as written, stops this batch
    guide = (pathlib.Path(__file__).parents[2] / "docs/guides/flax-linen.md").read_text()
    assert "Labels outside the model's classes" in guide and "y.max() < num_classes" in guide
