"""The precision debugger on jaxmp's own train steps (issue 49): every step builder exposes the loss it
wraps (``step.loss_fn``, ``step.loss_view``), so the debugger gives the same answers on a step as on
its loss: the same culprit for a seeded forward overflow, the same ranking, the same strict refusal.

Builders are enumerated from ``jaxmp._scaling._loss_view.STEP_BUILDERS`` (each registers itself); a public
``*train_step`` builder that is not registered fails `test_every_public_step_builder_is_registered`."""

import inspect

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxmp
import jaxmp.flax
import jaxmp.flax.nnx
import jaxmp.parallel
from jaxmp._scaling._loss_view import STEP_BUILDERS
from jaxmp.diagnostics import StrictPrecisionError, compare_to_float32, locate_non_finite, strict_precision

X = np.asarray(jax.random.normal(jax.random.key(0), (16, 8)), np.float32)
Y = np.arange(16, dtype=np.int32) % 4


def _ce(logits, y):
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits.astype(jnp.float32)), y[:, None], axis=1))


# ---- a plain-JAX loss for the parallel builders: embed -> blowup -> sched (a float32 bias near 13.3) ----

def _loss(p, b):
    with jax.named_scope("embed"):
        h = jnp.tanh(b["x"] @ p["embed"])
    with jax.named_scope("blowup"):
        h = h @ p["blowup"]
    with jax.named_scope("sched"):
        g = h @ p["ws"] + p["bs"]
    with jax.named_scope("head"):
        logits = h @ p["head"] * jnp.exp(g - 13.0)
    return _ce(logits, b["y"])


def _params(blow=1.0):
    k = jax.random.split(jax.random.key(1), 4)
    return {"embed": np.asarray(jax.random.normal(k[0], (8, 16)) / 3, np.float32),
            "blowup": np.asarray(jax.random.normal(k[1], (16, 16)) / 4 * blow, np.float32),
            "ws": np.asarray(jax.random.normal(k[2], (16, 1)) * 0.01, np.float32),
            "bs": np.full((1,), 13.3, np.float32),
            "head": np.asarray(jax.random.normal(k[3], (16, 4)) / 4, np.float32)}


def _tx():
    return jaxmp.loss_scaling(optax.sgd(0.1), jaxmp.DynamicLossScale())


def _sharded(layout):
    def make(policy, blow=1.0):
        loss = jaxmp.autocast(_loss, policy)
        tx = _tx()
        step = jaxmp.parallel.make_sharded_train_step(loss, tx, jaxmp.parallel.make_data_mesh(), layout=layout)
        p = _params(blow)
        s = tx.init(p)
        b = {"x": X, "y": Y}
        return step, (p, s, b), loss, (p, b), jaxmp.get_loss_scale(s).loss_scale
    return make


def _pmap(policy, blow=1.0):
    loss = jaxmp.autocast(_loss, policy)
    tx = jaxmp.loss_scaling(optax.sgd(0.1), jaxmp.DynamicLossScale(), axis_name="batch")
    step = jaxmp.parallel.make_pmap_train_step(loss, tx, "batch")
    p = _params(blow)
    s = tx.init(p)
    b = {"x": X, "y": Y}
    rep = jaxmp.parallel.replicate
    return step, (rep(p), rep(s), jaxmp.parallel.shard_batch(b)), loss, (p, b), jaxmp.get_loss_scale(s).loss_scale


class _Linen(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = jnp.tanh(nn.Dense(16, name="embed")(x))
        h = nn.Dense(16, name="blowup")(h)
        return nn.Dense(4, name="head")(h)


def _linen(policy, blow=1.0):
    model = jaxmp.flax.mixed_precision(_Linen(), policy)
    v = model.init(jax.random.key(2), X)
    v = jax.tree_util.tree_map_with_path(
        lambda path, x: x * blow if "blowup" in jax.tree_util.keystr(path) and "kernel" in jax.tree_util.keystr(path)
        else x, v)
    tx = _tx()
    state = jaxmp.flax.TrainState.create(model, v, tx)
    loss = lambda params, x, y: _ce(model.apply({"params": params}, x), y)  # noqa: E731
    return (jaxmp.flax.make_train_step(), (state, (X, Y)), loss, (v["params"], X, Y),
            jaxmp.get_loss_scale(state.opt_state).loss_scale)


class _Nnx(nnx.Module):
    def __init__(self, rngs):
        self.embed, self.blowup, self.head = nnx.Linear(8, 16, rngs=rngs), nnx.Linear(16, 16, rngs=rngs), \
            nnx.Linear(16, 4, rngs=rngs)

    def __call__(self, x):
        return self.head(self.blowup(jnp.tanh(self.embed(x))))


def _nnx(policy, blow=1.0):
    inner = _Nnx(nnx.Rngs(3))
    inner.blowup.kernel[...] = inner.blowup.kernel[...] * blow
    model = jaxmp.flax.mixed_precision(inner, policy)
    optimizer = nnx.Optimizer(model, _tx(), wrt=nnx.Param)
    gdef, params, rest = nnx.split(model, nnx.Param, ...)
    loss = lambda q, r, x, y: _ce(nnx.merge(gdef, q, r)(x), y)  # noqa: E731
    return (jaxmp.flax.nnx.train_step, (model, optimizer, (X, Y)), loss,
            (nnx.as_pure(params), nnx.as_pure(rest), X, Y),
            jaxmp.get_loss_scale(jaxmp.flax.nnx.optimizer_state(optimizer)).loss_scale)


# One case per builder (several for a builder with layouts); the builder's registered name first.
CASES = {
    "replicated": ("jaxmp.parallel.make_sharded_train_step", _sharded("replicated")),
    "zero": ("jaxmp.parallel.make_sharded_train_step", _sharded("zero")),
    "fsdp": ("jaxmp.parallel.make_sharded_train_step", _sharded("fsdp")),
    "pmap": ("jaxmp.parallel.make_pmap_train_step", _pmap),
    "linen": ("jaxmp.flax.make_train_step", _linen),
    "nnx": ("jaxmp.flax.nnx.train_step", _nnx),
}


def test_every_public_step_builder_is_registered_and_has_a_case():
    public = set()
    for module in (jaxmp, jaxmp.parallel, jaxmp.flax, jaxmp.flax.nnx):
        for name in getattr(module, "__all__", dir(module)):
            obj = getattr(module, name, None)
            if inspect.isfunction(obj) and name.endswith("train_step"):
                public.add(f"{module.__name__}.{name}")
    assert public <= set(STEP_BUILDERS), f"step builders the debugger cannot see into: {public - set(STEP_BUILDERS)}"
    assert {b for b, _ in CASES.values()} == set(STEP_BUILDERS)


@pytest.mark.parametrize("case", sorted(CASES))
def test_each_step_exposes_the_loss_it_wraps_and_its_value_matches(case):
    step, step_args, loss, loss_args, scale = CASES[case][1]("O1-bf16")
    view = step.loss_view(*step_args)
    assert callable(step.loss_view) and hasattr(step, "loss_fn")
    assert float(view.loss_scale) == float(scale) == 2.0 ** 15
    np.testing.assert_allclose(float(view.fn(*view.args)), float(loss(*loss_args)), rtol=1e-6)
    assert case.split("-")[0] in view.step or CASES[case][0].rsplit(".", 1)[-1] in view.step


@pytest.mark.parametrize("case", sorted(CASES))
def test_strict_precision_refuses_the_same_half_reduction_in_every_step(case):
    # A hand-written bf16 reduce_sum inside the loss: strict mode refuses it on the loss, and on the
    # step (inside its shard_map / pmap body too).
    builder = CASES[case][1]
    if case in ("linen", "nnx"):
        pytest.skip("the Flax steps take a model: checked in test_strict_precision_sees_into_the_flax_steps")
    step, step_args, loss, loss_args, _ = builder("O1-bf16")

    def half_sum(p, b):
        return _loss(p, b) + jax.lax.reduce_sum(b["x"].astype(jnp.bfloat16), (0, 1)).astype(jnp.float32) * 0.0

    maker = {"pmap": lambda: jaxmp.parallel.make_pmap_train_step(
        half_sum, jaxmp.loss_scaling(optax.sgd(0.1), jaxmp.DynamicLossScale(), axis_name="batch"), "batch")}.get(
        case, lambda: jaxmp.parallel.make_sharded_train_step(half_sum, _tx(), jaxmp.parallel.make_data_mesh(),
                                                             layout=case))
    bad_step = maker()
    with pytest.raises(StrictPrecisionError, match="reduce_sum runs in bf16") as on_loss:
        jax.make_jaxpr(strict_precision(half_sum))(*loss_args)
    with pytest.raises(StrictPrecisionError, match="reduce_sum runs in bf16") as on_step:
        strict_precision(bad_step)(*step_args)  # raises before the step runs
    source = [line for line in str(on_loss.value).splitlines() if "source:" in line]
    assert source and source == [line for line in str(on_step.value).splitlines() if "source:" in line]
    if case != "pmap":  # (a pmap step checks its replicas on the host: not traceable)
        jax.make_jaxpr(strict_precision(step))(*step_args)  # the step without it passes
        # A function that calls the step: the check enters the step's shard_map body.
        with pytest.raises(StrictPrecisionError, match="reduce_sum runs in bf16"):
            jax.make_jaxpr(strict_precision(lambda *a: bad_step(*a)[2]["loss"]))(*step_args)


def test_strict_precision_sees_into_the_flax_steps():
    # The loss head runs outside the model's autocast: a bf16 sum there is the user's own.
    def half_loss(logits, y):
        return _ce(logits, y) + jax.lax.reduce_sum(logits.astype(jnp.bfloat16), (0, 1)).astype(jnp.float32) * 0.0

    step, (state, batch), *_ = _linen("O1-bf16")
    with pytest.raises(StrictPrecisionError, match="reduce_sum runs in bf16"):
        jax.make_jaxpr(strict_precision(jaxmp.flax.make_train_step(loss_fn=half_loss)))(state, batch)
    jax.make_jaxpr(strict_precision(step))(state, batch)
    _, (model, optimizer, batch), *_ = _nnx("O1-bf16")
    with pytest.raises(StrictPrecisionError, match="reduce_sum runs in bf16"):
        strict_precision(jaxmp.flax.nnx.train_step)(model, optimizer, batch, loss_fn=half_loss)


@pytest.mark.slow  # ~2 s per case on a shared 2-core CPU: two instrumented programs compile
@pytest.mark.parametrize("case", sorted(CASES))
def test_locator_names_the_same_culprit_on_the_step_and_its_loss(case):
    step, step_args, loss, loss_args, scale = CASES[case][1]("O1-fp16", blow=6e4)
    on_loss = locate_non_finite(loss, *loss_args, loss_scale=scale)
    on_step = locate_non_finite(step, *step_args)
    assert on_loss.found and "blowup" in on_loss.path and on_loss.primitive == "dot_general", on_loss
    assert (on_step.primitive, on_step.path, on_step.backward) == (on_loss.primitive, on_loss.path, on_loss.backward)
    assert on_step.input_absmax == pytest.approx(on_loss.input_absmax, rel=1e-6)
    assert "the loss it wraps (step.loss_fn" in " ".join(str(on_step).split()) and "32768" in str(on_step)
    assert "shard_map" not in on_step.primitive


@pytest.mark.slow  # ~3 s per case on a shared 2-core CPU: two comparisons
@pytest.mark.parametrize("case", sorted(CASES))
def test_comparison_ranks_the_same_on_the_step_and_its_loss(case):
    step, step_args, loss, loss_args, _ = CASES[case][1]("O2-bf16")
    on_loss = compare_to_float32(loss, *loss_args, fix=False)
    on_step = compare_to_float32(step, *step_args, fix=False)
    assert on_step.loss == pytest.approx(on_loss.loss, rel=1e-6) and on_step.loss_error > 0
    assert [m.path for m in on_step.modules] == [m.path for m in on_loss.modules]
    assert [m.impact for m in on_step.modules] == pytest.approx([m.impact for m in on_loss.modules], rel=1e-3, abs=1e-9)
    if case not in ("linen", "nnx"):
        assert on_step.top.path == "sched", on_step
    assert "the loss it wraps (step.loss_fn" in " ".join(str(on_step).split())


# ---- a function that calls a sharded step (issue 60, item 5) ----

def _calling_the_step(layout, reduce_dtype):
    """``fn(params, opt_state, batch) -> loss`` that runs ``make_sharded_train_step``'s step."""
    step = jaxmp.parallel.make_sharded_train_step(jaxmp.autocast(_loss, "O2-bf16"), _tx(),
                                                  jaxmp.parallel.make_data_mesh(), layout=layout,
                                                  **({} if reduce_dtype == "default" else {"reduce_dtype": reduce_dtype}))
    return lambda p, s, b: step(p, s, b)[2]["loss"]


@pytest.fixture(scope="module")
def direct():
    """The comparison of the loss itself, the one a step's must equal."""
    return compare_to_float32(jaxmp.autocast(_loss, "O2-bf16"), _params(), {"x": X, "y": Y}, fix=False)


def _same_comparison(on_call, on_loss):
    assert on_loss.loss_error > 1e-3  # the seeded bias path: the policy run against itself would be 0
    assert on_call.loss == pytest.approx(on_loss.loss, rel=1e-6)
    assert on_call.loss_error == pytest.approx(on_loss.loss_error, rel=1e-4)
    assert on_call.top.path == on_loss.top.path == "sched"
    assert "ran as one op" not in on_call.note


def test_a_function_calling_the_sharded_step_is_compared_as_its_loss(direct):
    # The default layout and reduce dtype (float32) run the loss per data shard inside a shard_map,
    # which the shadow ran as one op: the comparison was the policy run against itself (error 0).
    p = _params()
    on_call = compare_to_float32(_calling_the_step("replicated", "default"), p, _tx().init(p), {"x": X, "y": Y},
                                 fix=False)
    _same_comparison(on_call, direct)


@pytest.mark.slow  # ~5-20 s per case on a shared 2-core CPU: a comparison with its noise runs
@pytest.mark.parametrize("layout", ["replicated", "zero", "fsdp"])
@pytest.mark.parametrize("reduce_dtype", ["default", "bfloat16", "float16", None])
def test_every_layout_and_reduce_dtype_of_the_sharded_step_is_compared_as_its_loss(layout, reduce_dtype, direct):
    p = _params()
    on_call = compare_to_float32(_calling_the_step(layout, reduce_dtype), p, _tx().init(p), {"x": X, "y": Y},
                                 fix=False)
    _same_comparison(on_call, direct)


def test_a_users_own_shard_map_is_said_to_be_one_op():
    mesh = jaxmp.parallel.make_data_mesh()
    P = jax.sharding.PartitionSpec
    mean = jax.shard_map(lambda v: jax.lax.pmean(jnp.mean(v, keepdims=True), "data"), mesh=mesh,
                         in_specs=P("data"), out_specs=P())
    report = compare_to_float32(lambda w, x: mean(jnp.tanh(x @ w).ravel())[0], _params()["embed"], X,
                                policy="O1-bf16", fix=False)
    assert "shard_map at (top level) ran as one op" in " ".join(report.note.split())
    assert "shard_map at (top level) ran as one op" in " ".join(str(report).split())
