"""The locator's fix (issue 60): code that runs as printed in the spelling of the door the step
came through, executed here and measured as compare_to_float32 measures its own fix; a fix that
moves the overflow says where to and what holds it."""

import contextlib

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxmp
import jaxmp.flax
from jaxmp.diagnostics import compare_to_float32, locate_non_finite

X = jax.random.normal(jax.random.key(0), (8, 8)) * 30.0


class _Block(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = nn.relu(nn.Dense(16, name="Dense_0")(x))  # the same names in both blocks
        return nn.Dense(16, name="Dense_1")(h)


class _Net(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Dense(16, name="embed")(x))
        x = _Block(name="block_0")(x)
        x = jnp.tanh(_Block(name="block_1")(x))  # a float32-list op after the seeded block: the fix holds
        return nn.Dense(4, name="head")(x)


def _linen():
    net = _Net()
    v = net.init(jax.random.key(1), X)
    v = jax.tree_util.tree_map(lambda a: a, v)
    v["params"]["block_1"]["Dense_1"]["kernel"] = v["params"]["block_1"]["Dense_1"]["kernel"] * 1e4
    return net, v


def _no_code_placeholders(code):
    assert "..." not in code.replace("#         ...", ""), code
    assert "(...)" not in code, code


def _grads_finite(fn, *args):
    grads = jax.grad(fn)(*args)
    return all(bool(np.all(np.isfinite(g))) for g in jax.tree_util.tree_leaves(grads)
               if jnp.issubdtype(jnp.asarray(g).dtype, jnp.floating))


def _measured(fixed, *args):
    """The fixed step measured as compare_to_float32 measures its own: loss error vs the float32 shadow."""
    assert np.isfinite(float(fixed(*args)))
    assert _grads_finite(fixed, *args)
    rep = compare_to_float32(fixed, *args, fix=False)
    assert rep.loss_error < 1e-2, rep
    assert not locate_non_finite(fixed, *args).found


@pytest.mark.slow  # ~20 s on a shared 2-core CPU: the locator, its measured fix and the comparison
def test_autocast_fix_names_the_module_path_and_runs_as_printed():
    net, v = _linen()
    loss = lambda p, x: jnp.mean(net.apply(p, x) ** 2)  # noqa: E731
    found = locate_non_finite(loss, v, X, policy="O1-fp16")
    assert found.found and found.path == "_Net/block_1/Dense_1", found
    # the module's path, not its class name nor a name that block_0 shares
    assert found.fix_module == "block_1/Dense_1" and "with_scope('block_1/Dense_1', 'float32')" in found.fix_code
    _no_code_placeholders(found.fix_code)
    assert found.fix_effect.startswith("with the fix, no op makes inf/NaN"), found
    ns = {"jaxmp": jaxmp, "fn": loss}
    exec(compile(found.fix_code, "fix", "exec"), ns)
    _measured(ns["fn"], v, X)


@pytest.mark.slow  # ~30 s on a shared 2-core CPU
def test_linen_door_fix_is_the_doors_path_rule_and_runs_as_printed():
    net, v = _linen()
    door = jaxmp.flax.mixed_precision(net, "O1-fp16")
    found = locate_non_finite(lambda p, x: jnp.mean(door.apply(p, x) ** 2), v, X)
    assert found.found and found.path.endswith("block_1/Dense_1/Dense"), found
    # the door's spelling (as its wrap-time warning spells paths): no root class, no trailing class scope
    assert "default_rules('O1-fp16').with_path('block_1/Dense_1', 'float32')" in found.fix_code, found.fix_code
    _no_code_placeholders(found.fix_code)
    assert found.fix_effect.startswith("with the fix, no op makes inf/NaN"), found
    ns = {"jaxmp": jaxmp, "model": door}
    exec(compile(found.fix_code, "fix", "exec"), ns)
    _measured(lambda p, x: jnp.mean(ns["model"].apply(p, x) ** 2), v, X)


def _nnx_model():
    from flax import nnx

    class M(nnx.Module):
        def __init__(self, rngs):
            self.enc = nnx.Linear(8, 16, rngs=rngs)
            self.mid = nnx.Linear(16, 16, rngs=rngs)
            self.head = nnx.Linear(16, 4, rngs=rngs)

        def __call__(self, x):
            return self.head(jnp.tanh(self.mid(nnx.relu(self.enc(x)))))

    m = M(nnx.Rngs(0))
    m.mid.kernel.set_value(m.mid.kernel.get_value() * 3e3)
    return m


@pytest.mark.slow  # ~30 s on a shared 2-core CPU
def test_nnx_door_fix_is_the_doors_path_rule_and_runs_as_printed():
    door = jaxmp.flax.mixed_precision(_nnx_model(), "O1-fp16")
    loss = lambda m, x: jnp.mean(m(x) ** 2)  # noqa: E731
    found = locate_non_finite(loss, door, X)
    assert found.found and found.fix_module == "mid", found
    assert "default_rules('O1-fp16').with_path('mid', 'float32')" in found.fix_code, found.fix_code
    assert "mixed_precision(model.model, 'O1-fp16', rules=rules)" in found.fix_code
    _no_code_placeholders(found.fix_code)
    assert found.fix_effect.startswith("with the fix, no op makes inf/NaN"), found
    ns = {"jaxmp": jaxmp, "model": door}
    exec(compile(found.fix_code, "fix", "exec"), ns)
    _measured(loss, ns["model"], X)


def _equinox():
    eqx = pytest.importorskip("equinox")

    class M(eqx.Module):
        enc: eqx.nn.Linear
        mid: eqx.nn.Linear
        head: eqx.nn.Linear

        def __call__(self, x):
            h = jax.vmap(self.mid)(jax.nn.relu(jax.vmap(self.enc)(x)))
            return jax.vmap(self.head)(jnp.tanh(h))

    k = jax.random.split(jax.random.key(0), 3)
    m = M(eqx.nn.Linear(8, 16, key=k[0]), eqx.nn.Linear(16, 16, key=k[1]), eqx.nn.Linear(16, 4, key=k[2]))
    return eqx.tree_at(lambda m: m.mid.weight, m, m.mid.weight * 3e3), {"equinox": eqx}


def _haiku():
    hk = pytest.importorskip("haiku")

    def f(x):
        h = hk.Linear(16, name="mid")(jax.nn.relu(hk.Linear(16, name="enc")(x)))
        return hk.Linear(4, name="head")(jnp.tanh(h))

    model = hk.without_apply_rng(hk.transform(f))
    p = model.init(jax.random.key(0), X)
    p = {k: ({"w": v["w"] * 3e3, "b": v["b"]} if k.endswith("mid") else v) for k, v in p.items()}
    return model.apply, p, {}


def _nnx_autocast():
    return _nnx_model(), {"flax": flax}


@pytest.mark.slow  # ~20 s each on a shared 2-core CPU
@pytest.mark.parametrize("make", ["equinox", "haiku", "nnx"])
def test_autocast_fix_for_modules_of_every_framework_runs_as_printed(make):
    if make == "haiku":
        apply, params, mods = _haiku()
        loss = lambda p, x: jnp.mean(apply(p, x) ** 2)  # noqa: E731
    else:
        params, mods = _equinox() if make == "equinox" else _nnx_autocast()
        loss = lambda m, x: jnp.mean(m(x) ** 2)  # noqa: E731
    found = locate_non_finite(loss, params, X, policy="O1-fp16")
    assert found.found and found.path.endswith("mid"), found
    _no_code_placeholders(found.fix_code)
    assert found.fix_effect.startswith("with the fix, no op makes inf/NaN"), found
    ns = {"jaxmp": jaxmp, "fn": loss, **mods}
    exec(compile(found.fix_code, "fix", "exec"), ns)
    _measured(ns["fn"], params, X)


def _scoped(p, x):
    """Plain JAX with name scopes: the autocast door's own spelling of a module."""
    with jax.named_scope("encoder"):
        with jax.named_scope("enc"):
            h = jax.nn.relu(x @ p["enc"])
        with jax.named_scope("blow"):
            h = h @ p["blow"]  # seeded past float16's range
    with jax.named_scope("head"):
        return jnp.mean((jnp.tanh(h) @ p["head"]) ** 2)


def _scoped_params():
    k = jax.random.split(jax.random.key(2), 3)
    return {"enc": jax.random.normal(k[0], (8, 16)) / 3, "blow": jax.random.normal(k[1], (16, 16)) * 1e4,
            "head": jax.random.normal(k[2], (16, 4)) / 4}


@pytest.mark.slow  # ~10 s CPU (~30 s on a loaded shared 2-core CPU): two located functions, each fix measured
def test_a_jaxmp_autocast_function_gets_its_scope_rule_re_wrapping_what_it_wraps():
    """The function handed over is ``jaxmp.autocast(loss, ...)`` itself (no ``policy=``): the fix
    was "your own casts" code that wrapped the autocast function again and left the overflow."""
    params = _scoped_params()
    user_rules = jaxmp.AutocastRules().with_scope("head", "float32")
    for rules in (None, user_rules):
        fn = jaxmp.autocast(_scoped, "O1-fp16", rules=rules)
        found = locate_non_finite(fn, params, X)
        assert found.found and found.path == "encoder/blow" and found.fix_module == "blow", found
        assert "your own casts" not in found.fix_code, found.fix_code
        assert "fn = jaxmp.autocast(fn.__wrapped__, 'O1-fp16', rules=rules)" in found.fix_code, found.fix_code
        assert ("with_scope('head', 'float32')" in found.fix_code) == (rules is not None), found.fix_code
        _no_code_placeholders(found.fix_code)
        assert found.fix_effect.startswith("with the fix, no op makes inf/NaN"), found
        ns = {"jaxmp": jaxmp, "fn": fn}
        exec(compile(found.fix_code, "fix", "exec"), ns)
        assert ns["fn"] is not fn and not locate_non_finite(ns["fn"], params, X).found
        assert np.isfinite(float(ns["fn"](params, X))) and _grads_finite(ns["fn"], params, X)


class _Moves(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Dense(16, name="embed")(x))
        x = nn.Dense(16, name="blowup")(x)  # kept in float32, its output is still beyond float16
        return nn.Dense(4, name="head")(nn.relu(x))


@pytest.mark.slow  # ~30 s on a shared 2-core CPU: the locator and two measured fixes
def test_a_fix_that_moves_the_overflow_says_where_and_what_holds_it():
    net = _Moves()
    v = net.init(jax.random.key(1), X)
    v = jax.tree_util.tree_map(lambda a: a, v)
    v["params"]["blowup"]["kernel"] = v["params"]["blowup"]["kernel"] * 3e3
    loss = lambda p, x: jnp.mean(net.apply(p, x))  # noqa: E731
    found = locate_non_finite(loss, v, X, policy="O1-fp16")
    assert found.fix_module == "blowup", found
    effect = found.fix_effect
    assert "moves to the next module" in effect and "_Moves/head" in effect, effect
    assert "keeping 'head' in float32 too holds it" in effect, effect
    assert "fn = jaxmp.autocast(fn, 'O1-bf16')" in effect, effect  # the other way to hold it
    text = str(found)
    assert "measured    : with the fix, the first inf moves" in text
    # the code that holds it, as printed under "measured", runs and is finite
    code = effect.split("\n", 1)[1].split("  or train in bfloat16")[0]
    ns = {"jaxmp": jaxmp, "fn": loss}
    exec(compile(code, "fix", "exec"), ns)
    _measured(ns["fn"], v, X)
    ns = {"jaxmp": jaxmp, "fn": loss}
    exec(compile(effect.rsplit("\n", 1)[1], "bf16", "exec"), ns)  # training in bfloat16 holds it too
    assert np.isfinite(float(ns["fn"](v, X)))


# ---- compare_to_float32 on plain JAX without scopes: the fix that applies there ----

def _sched_problem():
    k = jax.random.split(jax.random.key(0), 4)
    xs = jax.random.normal(k[0], (64, 16))
    params = {"w1": jax.random.normal(k[1], (16, 32)) / 4, "ws": jax.random.normal(k[2], (32, 1)) * 0.01,
              "bs": jnp.full((1,), 13.3), "w2": jax.random.normal(k[3], (32, 1)) / 6}
    h = jnp.tanh(xs @ params["w1"])
    ys = (h @ params["w2"] * 1.1) * jnp.exp(h @ params["ws"] + 13.33 - 13.0)
    return params, xs, ys


def _sched_loss(p, x, y, scope=False):
    h = jnp.tanh(x @ p["w1"])
    with jax.named_scope("bs") if scope else contextlib.nullcontext():  # the user's edit: a scope
        gamma = h @ p["ws"] + p["bs"]
    return jnp.mean((h @ p["w2"] * jnp.exp(gamma - 13.0) - y) ** 2)


@pytest.mark.slow  # ~60 s on a shared 2-core CPU: two 50-step comparisons
@pytest.mark.standard_promotion(reason="optax.adam: bias correction is a Python float ** int32 count")
def test_plain_jax_with_its_own_casts_gets_a_fix_that_applies_to_it():
    import optax

    params, xs, ys = _sched_problem()
    policy = jaxmp.get_policy("p=f32,c=bf16,o=f32")

    def hand(p, x, y):  # plain JAX, its own casts, no name scopes
        return jnp.asarray(_sched_loss(policy.cast_to_compute(p), policy.cast_to_compute(x),
                                       policy.cast_to_compute(y)), jnp.float32)

    rep = compare_to_float32(hand, params, xs, ys, steps=50, optimizer=optax.adam(2e-3))
    assert not rep.within_noise and rep.fix is not None and rep.fix.path == "bs", rep
    code = rep.fix.code
    # no Flax door, no module class: neither exists here
    assert "jaxmp.flax" not in code and "with_class" not in code and "with_path" not in code, code
    assert "half['bs'] = params['bs']" in code and "with jax.named_scope('bs')" in code, code
    assert "@jaxmp.float32_region" in code, code
    # the pasted code, on the loss with the lines of 'bs' in that scope as the comment says, closes the gap
    ns = {"jaxmp": jaxmp, "fn": lambda p, x, y: _sched_loss(p, x, y, scope=True)}
    exec(compile(code, "fix", "exec"), ns)
    after = compare_to_float32(ns["fn"], params, xs, ys, steps=50, optimizer=optax.adam(2e-3), fix=False)
    assert after.loss_error < 0.1 * rep.loss_error, (rep.loss_error, after.loss_error)


# ---- a rule of the user's that matches nothing warns once, naming the closest paths ----

def test_rules_that_match_nothing_warn_once_with_the_closest_paths():
    import warnings

    from flax import nnx

    net, v = _linen()
    # the locator's old spelling of the path: root class and trailing class scope
    rules = jaxmp.flax.default_rules("O1-fp16").with_path("_Net/block_1/Dense_1/Dense", "float32")
    door = jaxmp.flax.mixed_precision(net, "O1-fp16", rules=rules)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        door.apply(v, X)
        door.apply(v, X * 2)
    msgs = [str(w.message) for w in seen if issubclass(w.category, jaxmp.MixedPrecisionWarning)]
    assert len(msgs) == 1 and "'_Net/block_1/Dense_1/Dense'" in msgs[0], msgs
    assert "closest module paths: 'block_1/Dense_1'" in msgs[0], msgs[0]
    # the preset's own class rules (most models have some of those classes only) never warn
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        jaxmp.flax.mixed_precision(net, "O1-fp16").apply(v, X)
        good = jaxmp.flax.default_rules("O1-fp16").with_path("block_1/Dense_1")
        jaxmp.flax.mixed_precision(net, "O1-fp16", rules=good).apply(v, X)
    assert not [w for w in seen if "matches no" in str(w.message)], [str(w.message) for w in seen]
    # Linen door: a class rule of the user's for a class the model does not use; one it uses is silent
    conv = jaxmp.flax.mixed_precision(net, "O1-fp16", rules=jaxmp.flax.default_rules("O1-fp16").with_class(nn.Conv, "float32"))
    dense = jaxmp.flax.mixed_precision(net, "O1-fp16", rules=jaxmp.flax.default_rules("O1-fp16").with_class(nn.Dense, "float32"))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        conv.apply(v, X)
        conv.apply(v, X)
        dense.apply(v, X)
    msgs = [str(w.message) for w in seen if "matches no" in str(w.message)]
    assert len(msgs) == 1 and "class rule for Conv (no Conv in the model) matches no module" in msgs[0], msgs
    # NNX: a path rule and a class rule of the user's
    with pytest.warns(jaxmp.MixedPrecisionWarning, match=r"'layer/0' \(closest module paths: 'layers/0'"):
        jaxmp.flax.mixed_precision(nnx.Sequential(nnx.Linear(4, 3, rngs=nnx.Rngs(0))), "O1-fp16",
                                   rules=jaxmp.flax.default_rules("O1-fp16").with_path("layer/0"))
    with pytest.warns(jaxmp.MixedPrecisionWarning, match="class rule for _NnxConv"):
        jaxmp.flax.mixed_precision(nnx.Sequential(nnx.Linear(4, 3, rngs=nnx.Rngs(0))), "O1-fp16",
                                   rules=jaxmp.AutocastRules().with_class(_NnxConv, "float32"))
    # autocast: a scope rule that names no scope of the function
    def f(x):
        with jax.named_scope("enc"), jax.named_scope("Dense_0"):
            return jnp.sum(x @ x)

    with pytest.warns(jaxmp.MixedPrecisionWarning, match=r"'enc/Dense_1' matches no name scope.*'enc/Dense_0'"):
        jaxmp.autocast(f, "O1-bf16", rules=jaxmp.AutocastRules().with_scope("enc/Dense_1", "float32"))(jnp.ones((2, 2)))


def test_an_autocast_class_rule_that_matches_no_call_warns_once_and_one_that_matches_is_silent():
    import warnings

    import flax.linen as nn

    net, v = _linen()
    fn = lambda p, x: jnp.sum(net.apply(p, x))  # noqa: E731
    with pytest.warns(jaxmp.MixedPrecisionWarning, match=r"class rule for Conv matches no module call.*"
                                                         r"module classes it called: .*Dense") as caught:
        jaxmp.autocast(fn, "O1-fp16", rules=jaxmp.AutocastRules().with_class(nn.Conv, "float32"))(v, X)
    assert len([w for w in caught if "matches no module call" in str(w.message)]) == 1
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        jaxmp.autocast(fn, "O1-fp16", rules=jaxmp.AutocastRules().with_class(nn.Dense, "float32"))(v, X)
        # the Flax door's preset rules passed on to autocast: its own classes never warn
        jaxmp.autocast(fn, "O1-fp16", rules=jaxmp.flax.default_rules("O1-fp16"))(v, X)
    assert not [w for w in seen if "matches no" in str(w.message)], [str(w.message) for w in seen]


class _NnxConv:  # a user's module class the model does not use
    pass
