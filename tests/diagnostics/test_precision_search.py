"""jaxmp chooses the precision (issue 62): ``compare_to_float32(..., choose=ladder)`` gives each
module the lowest rung whose k-step drift against float32 stays within the noise band, and hands
the rules back as code that runs when pasted."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
import pytest

import jaxmp
from jaxmp.diagnostics import compare_to_float32
from jaxmp.diagnostics._choose import _module_flops

pytestmark = pytest.mark.standard_promotion(reason="optax.adam: bias correction is a Python float ** int32 count")

_K = jax.random.split(jax.random.key(0), 4)
PARAMS = {"l1": jax.random.normal(_K[0], (16, 32)) * 0.3, "l2": jax.random.normal(_K[1], (32, 32)) * 0.2,
          "head": jax.random.normal(_K[2], (32, 8)) * 0.2}
X = jax.random.normal(_K[3], (32, 16))
Y = jnp.arange(32) % 8
TX = optax.adam(1e-2)


def _head(p, h):
    # A large dynamic range: the features ride on an offset of 256 that cancels in float32; in
    # bf16 (8 bits of mantissa) the offset swallows them, so this layer needs float32.
    return (h + 256.0) @ p["head"] - 256.0 * jnp.sum(p["head"], 0)


def loss_fn(p, x, y):
    with jax.named_scope("l1"):
        h = jnp.tanh(x @ p["l1"])
    with jax.named_scope("l2"):
        h = jnp.tanh(h @ p["l2"])
    with jax.named_scope("head"):
        z = _head(p, h)
    return -jnp.mean(jax.nn.log_softmax(z)[jnp.arange(32), y])


@pytest.fixture(scope="module")
def plan():
    return compare_to_float32(loss_fn, PARAMS, X, Y, choose=("O2-mxfp8", "O2-bf16", "float32"), steps=6,
                              optimizer=TX)


def test_the_sensitive_head_stays_high_and_the_rest_goes_low(plan):
    rungs = {m.path: m.rung for m in plan.modules}
    assert rungs == {"l1": "O2-mxfp8", "l2": "O2-mxfp8", "head": "float32"}
    assert plan.drift_after <= plan.threshold < plan.drift_before
    assert plan.within_band and not plan.gave_up
    # the head was promoted one rung at a time, re-measured after each
    assert [(p, a, b) for p, a, b, _ in plan.promotions] == [("head", "O2-mxfp8", "O2-bf16"),
                                                            ("head", "O2-bf16", "float32")]
    assert plan.promotions[-1][3] == plan.drift_after
    flops = {m.path: m.flops for m in plan.modules}
    assert flops == {"l1": 2 * 32 * 16 * 32, "l2": 2 * 32 * 32 * 32, "head": 2 * 32 * 32 * 8}
    shares = plan.flop_shares()
    assert shares["O2-mxfp8"] == pytest.approx((flops["l1"] + flops["l2"]) / sum(flops.values()))
    assert shares["O2-bf16"] == 0.0 and sum(shares.values()) == pytest.approx(1.0)
    # cost: the float32 reference, its twin, the all-lowest run and one trial per module per promotion
    assert plan.cost_steps == 6 * (3 + 3 + 3)
    text = str(plan)
    assert "float32" in text and "search cost: 54 training steps" in text and "band" in text


def test_the_returned_code_runs_when_pasted_and_reproduces_the_rules(plan):
    ns = {"jaxmp": jaxmp, "loss_fn": loss_fn}
    exec(plan.code, ns)
    assert ns["rules"] == plan.rules
    assert ns["rules"].matmul_formats == (("scope", "l1", "O2-mxfp8"), ("scope", "l2", "O2-mxfp8"))
    assert ns["rules"].scope_rules == (("head", "float32"),)
    got = ns["step_loss"](PARAMS, X, Y)
    assert float(got) == float(jaxmp.autocast(loss_fn, "O2-bf16", rules=plan.rules)(PARAMS, X, Y))

    class MLP(nn.Module):  # the same model as Linen layers named as the scopes
        @nn.compact
        def __call__(self, x):
            h = jnp.tanh(nn.Dense(32, name="l1")(x))
            h = jnp.tanh(nn.Dense(32, name="l2")(h))
            return nn.Dense(8, name="head")(h)

    ns = {"jaxmp": jaxmp, "model": MLP()}
    exec(plan.flax_code, ns)
    assert ns["rules"].path_rules == (("head", "float32"),)
    variables = MLP().init(jax.random.key(0), X)
    out = ns["model"].apply(variables, X)
    assert out.shape == (32, 8) and bool(jnp.all(jnp.isfinite(out)))


def test_the_search_is_deterministic():
    runs = [compare_to_float32(loss_fn, PARAMS, X, Y, choose=("O2-bf16", "float32"), steps=4, optimizer=TX)
            for _ in range(2)]
    a, b = runs
    assert a.modules == b.modules and a.promotions == b.promotions
    assert (a.noise, a.drift_before, a.drift_after) == (b.noise, b.drift_before, b.drift_after)
    assert {m.path: m.rung for m in a.modules} == {"l1": "O2-bf16", "l2": "O2-bf16", "head": "float32"}


def test_it_gives_up_and_says_so_when_float32_everywhere_cannot_reach_the_band():
    def unscoped_head(p, x, y):
        with jax.named_scope("l1"):
            h = jnp.tanh(x @ p["l1"])
        with jax.named_scope("l2"):
            h = jnp.tanh(h @ p["l2"])
        z = _head(p, h)  # outside any scope: no rule reaches it, it runs in the policy's bf16
        return -jnp.mean(jax.nn.log_softmax(z)[jnp.arange(32), y])

    plan = compare_to_float32(unscoped_head, PARAMS, X, Y, choose=("O2-bf16", "float32"), steps=4, optimizer=TX)
    assert plan.gave_up.startswith("even float32 at every module")
    assert plan.rules is None and plan.code == "" and not plan.within_band
    assert {m.rung for m in plan.modules} == {"float32"} and plan.drift_after > plan.threshold
    assert plan.unscoped_flops == 2 * 32 * 32 * 8 and "(no scope)" in str(plan)


def test_a_diverging_float32_run_is_not_a_precision_problem():
    def quadratic(p, x, y):
        with jax.named_scope("l1"):
            z = x @ p["l1"]
        return jnp.mean(jnp.square(z))

    plan = compare_to_float32(quadratic, PARAMS, X, Y, choose=("O2-bf16", "float32"), steps=4,
                              optimizer=optax.sgd(1e30))
    assert "not a precision problem" in plan.gave_up and plan.rules is None
    assert plan.cost_steps == 4  # the float32 reference only


def test_plain_jax_without_scopes_is_told_which_scope_to_add():
    def bare(p, x, y):
        z = jnp.tanh(x @ p["l1"]) @ p["l2"]
        return jnp.mean(jnp.square(z))

    plan = compare_to_float32(bare, PARAMS, X, Y, choose=True, steps=2, optimizer=TX)
    assert "jax.named_scope" in plan.gave_up and plan.modules == ()


def test_a_scanned_stack_is_one_module_for_all_its_layers():
    ws = jnp.ones((3, 8, 8)) * 0.1

    def stacked(w, x):
        def layer(h, wi):
            return jnp.tanh(h @ wi), None
        with jax.named_scope("layers"):
            h, _ = jax.lax.scan(layer, x, w)
        return jnp.sum(h)

    found, loose = _module_flops(stacked, (ws, jnp.ones((4, 8))))
    assert found["layers"][:2] == [3 * 2 * 4 * 8 * 8, True] and loose == 0


def test_bad_ladders_and_arguments_are_refused_by_name():
    with pytest.raises(TypeError, match="tuple of at least two rungs"):
        compare_to_float32(loss_fn, PARAMS, X, Y, choose="O2-nvfp4")
    with pytest.raises(ValueError, match="each rung"):
        compare_to_float32(loss_fn, PARAMS, X, Y, choose=("O2-bf16", "bfloat16"))
    with pytest.raises(ValueError, match="drop rules="):
        compare_to_float32(loss_fn, PARAMS, X, Y, choose=True, policy="O2-bf16", rules=jaxmp.AutocastRules())
    with pytest.raises(TypeError, match="scalar"):
        compare_to_float32(lambda p, x, y: x @ p["l1"], PARAMS, X, Y, choose=True)


class _Head(nn.Module):
    @nn.compact
    def __call__(self, h):
        w = self.param("kernel", lambda k: jax.random.normal(k, (32, 8)) * 0.2)
        return (h + 256.0) @ w - 256.0 * jnp.sum(w, 0)


class _LinenMLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = jnp.tanh(nn.Dense(32, name="l1")(x))
        h = jnp.tanh(nn.Dense(32, name="l2")(h))
        return _Head(name="head")(h)


def test_a_linen_model_is_placed_by_its_module_scopes_and_spelled_for_the_door():
    model = _LinenMLP()
    variables = model.init(jax.random.key(0), X)

    def linen_loss(p, x, y):
        z = model.apply({"params": p}, x)
        return -jnp.mean(jax.nn.log_softmax(z)[jnp.arange(32), y])

    plan = compare_to_float32(linen_loss, variables["params"], X, Y, choose=("O2-bf16", "float32"), steps=4,
                              optimizer=TX)
    assert {m.path: m.rung for m in plan.modules} == {"_LinenMLP/l1": "O2-bf16", "_LinenMLP/l2": "O2-bf16",
                                                     "_LinenMLP/head": "float32"}
    assert plan.rules.scope_rules == (("_LinenMLP/head", "float32"),)
    ns = {"jaxmp": jaxmp, "model": _LinenMLP()}
    exec(plan.flax_code, ns)
    assert ns["rules"].path_rules == (("head", "float32"),)  # the door's path, relative to the model
    # the door with the chosen rules keeps the head in float32: the same logits as float32 there
    door = ns["model"].apply(variables, X)
    bf16 = jaxmp.flax.mixed_precision(_LinenMLP(), "O2-bf16").apply(variables, X)
    f32 = model.apply(variables, X)
    assert float(jnp.max(jnp.abs(door - f32))) < 0.1 * float(jnp.max(jnp.abs(bf16 - f32)))
