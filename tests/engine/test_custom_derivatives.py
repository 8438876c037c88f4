"""Custom derivatives under ``jaxmp.autocast``: each rule sees what it sees in float32.

A ``custom_vjp`` forward rule learns which inputs are differentiated (``CustomVJPPrimal.perturbed``,
with ``symbolic_zeros=True``), and a ``custom_jvp`` rule which tangents are symbolic zeros. The
engine re-binds both; it must hand the rules the float32 run's flags, not "everything perturbed"
(wasted work for JAX's own rules, an ``AssertionError`` or "Unexpected tangent" in Equinox's
``filter_custom_vjp`` and in every library built on it: ODE adjoints, implicit solves).
See docs/autocast.md#control-flow-differentiation-and-parallelism.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.custom_derivatives import SymbolicZero

import jaxmp
from jaxmp import fp8
from jaxmp._precision._presets import PRESET_NAMES, get_recipe

# Float16 gradients here are taken without a loss scale on purpose (tiny, well-scaled programs).
pytestmark = pytest.mark.filterwarnings("ignore::jaxmp.MixedPrecisionWarning")

_RNG = np.random.default_rng(0)
X = _RNG.normal(size=(4, 8)).astype(np.float32)
W = (_RNG.normal(size=(8, 8)) / np.sqrt(8)).astype(np.float32)
B = (0.1 * _RNG.normal(size=(8,))).astype(np.float32)


def _refused(preset: str) -> bool:
    """Delayed fp8 scaling keeps amax histories per layer: a plain function has none, so autocast
    refuses it by design (jaxmp/engine/_config.py)."""
    return isinstance(get_recipe(preset).fp8, fp8.DelayedScaling)


def _asserted_refusal(preset: str) -> bool:
    """For a preset that refuses a plain function, asserts the refusal and returns True."""
    if not _refused(preset):
        return False
    with pytest.raises(ValueError, match="delayed fp8 scaling .* 'O2-fp8-current'"):
        jax.make_jaxpr(jaxmp.autocast(lambda x: x * 2, preset))(X)
    return True


# -- the flags each rule sees, per preset (trace only: no compile) -----------------------------

def _vjp_program(seen):
    @jax.custom_vjp
    def f(x, y):
        return jnp.sin(x) * y

    def fwd(x, y):
        seen.append((x.perturbed, y.perturbed))
        return jnp.sin(x.value) * y.value, (x.value, y.value)

    def bwd(res, g):
        x, y = res
        return jnp.cos(x) * y * g, jnp.sin(x) * g

    f.defvjp(fwd, bwd, symbolic_zeros=True)
    return lambda w, y: jnp.sum(f(X @ w, y))


def _jvp_program(seen):
    @jax.custom_jvp
    def f(x, y):
        return jnp.sin(x) * y

    def jvp(primals, tangents):
        (x, y), (tx, ty) = primals, tangents
        zx, zy = type(tx) is SymbolicZero, type(ty) is SymbolicZero
        seen.append((zx, zy))
        out = jnp.cos(x) * y * tx if not zx else jnp.zeros_like(x)
        out = out + jnp.sin(x) * ty if not zy else out
        return f(x, y), out

    f.defjvp(jvp, symbolic_zeros=True)
    return lambda w, y: jnp.sum(f(X @ w, y))


def _vjp_nondiff_program(seen):
    @functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
    def f(scale, x, y):
        return scale * jnp.sin(x) * y

    def fwd(scale, x, y):
        seen.append((x.perturbed, y.perturbed))
        return scale * jnp.sin(x.value) * y.value, (x.value, y.value)

    def bwd(scale, res, g):
        x, y = res
        return scale * jnp.cos(x) * y * g, scale * jnp.sin(x) * g

    f.defvjp(fwd, bwd, symbolic_zeros=True)
    return lambda w, y: jnp.sum(f(2.0, X @ w, y))


@pytest.mark.parametrize("program", [_vjp_program, _jvp_program, _vjp_nondiff_program],
                         ids=["custom_vjp", "custom_jvp", "custom_vjp_nondiff_argnums"])
@pytest.mark.parametrize("preset", PRESET_NAMES)
def test_rules_see_the_float32_runs_flags(preset, program):
    y = np.full((4, 8), 0.5, np.float32)

    if _asserted_refusal(preset):
        return
    for argnums in (0, 1, (0, 1)):  # w alone, y alone, both
        want, got = [], []
        jax.make_jaxpr(jax.grad(program(want), argnums=argnums))(W, y)
        jax.make_jaxpr(jax.grad(jaxmp.autocast(program(got), preset), argnums=argnums))(W, y)
        assert want and got == want, (argnums, got, want)


def test_float32_flags_are_the_ones_jax_gives():
    """The reference the test above compares with: a rule sees ``(True, False)`` when only the
    first input is differentiated (so an engine that says "all perturbed" cannot pass)."""
    seen = []
    jax.make_jaxpr(jax.grad(_vjp_program(seen)))(W, np.ones((4, 8), np.float32))
    assert seen == [(True, False)]
    seen = []
    jax.make_jaxpr(jax.grad(_jvp_program(seen)))(W, np.ones((4, 8), np.float32))
    assert seen == [(False, True)]


_SHIFT = np.linspace(-1.0, 1.0, 8, dtype=np.float32)  # an array constant of the rules below


@jax.custom_vjp
def _vjp_with_constant(x):
    return jnp.tanh(x + _SHIFT)


_vjp_with_constant.defvjp(lambda x: (jnp.tanh(x + _SHIFT), 1 - jnp.tanh(x + _SHIFT) ** 2), lambda r, g: (r * g,))


@jax.custom_jvp
def _jvp_with_constant(x):
    return jnp.tanh(x + _SHIFT)


_jvp_with_constant.defjvp(lambda p, t: (_jvp_with_constant(p[0]), (1 - jnp.tanh(p[0] + _SHIFT) ** 2) * t[0]))


@pytest.mark.parametrize("rule", [_vjp_with_constant, _jvp_with_constant], ids=["custom_vjp", "custom_jvp"])
def test_rules_with_array_constants(rule):
    """A rule's array constants reach it (jax 0.11+ traces them as leading inputs with the values
    beside: the engine read the forward rule's inputs shifted by them)."""
    loss = lambda w: jnp.sum(rule(X @ w) ** 2)  # noqa: E731
    want = jax.jit(jax.value_and_grad(loss))(W)
    got = jax.jit(jax.value_and_grad(jaxmp.autocast(loss, "O1-bf16")))(W)
    _assert_close(got, want, rtol=0.05)


def _closing_over(w, x):
    @jax.custom_vjp
    def f(y):
        return jnp.sin(y) * w

    f.defvjp(lambda y: (jnp.sin(y) * w, jnp.cos(y) * w), lambda res, g: (res * g,))
    return jnp.sum(f(x @ W))


def test_custom_vjp_closing_over_a_differentiated_value():
    """The rule has no cotangent for a value its function closes over: JAX raises its error
    (under jit; the fix it names is ``jax.closure_convert``), and so does autocast, rather than
    dropping that gradient or leaking a tracer."""
    w = np.float32(2.0)
    with pytest.raises(Exception, match="closed-over value") as jax_error:
        jax.make_jaxpr(jax.grad(jax.jit(_closing_over)))(w, X)
    with pytest.raises(type(jax_error.value), match="closed-over value"):
        jax.make_jaxpr(jax.grad(jaxmp.autocast(_closing_over, "O1-bf16")))(w, X)


# -- Equinox's filtered custom derivatives ----------------------------------------------------

HALF_PRESETS = ["O1-bf16", "O2-bf16", "O1-fp16"]


def _eqx_programs():
    eqx = pytest.importorskip("equinox")

    @eqx.filter_custom_vjp
    def layer(vjp_arg, b):
        x, w = vjp_arg
        return jnp.tanh(x @ w + b)

    @layer.def_fwd
    def layer_fwd(perturbed, vjp_arg, b):
        x, w = vjp_arg
        y = jnp.tanh(x @ w + b)
        return y, y

    @layer.def_bwd
    def layer_bwd(y, g, perturbed, vjp_arg, b):
        x, w = vjp_arg
        px, pw = perturbed
        gz = g * (1 - y * y)
        return (gz @ w.T if px else None, x.T @ gz if pw else None)

    @eqx.filter_custom_jvp
    def act(x, b):
        return jnp.tanh(x + b)

    @act.def_jvp
    def act_jvp(primals, tangents):
        (x, b), (tx, tb) = primals, tangents
        y = jnp.tanh(x + b)
        t = sum(t for t in (tx, tb) if t is not None)
        return y, (1 - y * y) * t

    # w differentiated, x not (a data batch): the forward rule's perturbed flags say so
    vjp_loss = lambda w: jnp.sum(layer((X, w), B) ** 2)  # noqa: E731
    jvp_loss = lambda w: jnp.sum(act(X @ w, B) ** 2)  # noqa: E731
    return {"filter_custom_vjp": vjp_loss, "filter_custom_jvp": jvp_loss}


def _assert_close(got, want, rtol):
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        g, w = np.asarray(g, np.float32), np.asarray(w, np.float32)
        assert np.all(np.isfinite(g))
        np.testing.assert_allclose(g, w, rtol=rtol, atol=rtol * float(np.abs(w).max()) + 1e-6)


@pytest.mark.parametrize("which", ["filter_custom_vjp", "filter_custom_jvp"])
@pytest.mark.parametrize("preset", HALF_PRESETS)
def test_equinox_custom_derivatives_forward_and_gradient(preset, which):
    loss = _eqx_programs()[which]
    want = jax.jit(jax.value_and_grad(loss))(W)
    got = jax.jit(jax.value_and_grad(jaxmp.autocast(loss, preset)))(W)
    assert got[1].dtype == np.float32
    _assert_close(got, want, rtol=0.05)


@pytest.mark.parametrize("which", ["filter_custom_vjp", "filter_custom_jvp"])
@pytest.mark.parametrize("preset", PRESET_NAMES)
def test_equinox_custom_derivatives_trace_under_every_preset(preset, which):
    """Equinox checks the perturbation flags while tracing: every preset differentiates its
    custom derivatives (traced only; the numbers for the half presets are the test above's)."""
    if _asserted_refusal(preset):
        return
    value, grad = jax.eval_shape(jax.value_and_grad(jaxmp.autocast(_eqx_programs()[which], preset)), W)
    assert value.shape == () and grad.shape == W.shape and grad.dtype == np.float32


# -- checkpointed while loops -------------------------------------------------------------------

def _eqx_while(x, w):
    eqx = pytest.importorskip("equinox")

    def body(c):
        i, h = c
        return i + 1, jnp.tanh(h @ w)

    _, h = eqx.internal.while_loop(lambda c: c[0] < 3, body, (0, x), max_steps=4, kind="checkpointed",
                                   checkpoints=2)
    return jnp.sum(h ** 2)


def _lax_while(x, w):
    body = jax.checkpoint(lambda c: (c[0] + 1, jnp.tanh(c[1] @ w)))
    _, h = jax.lax.while_loop(lambda c: c[0] < 3, body, (0, x))
    return jnp.sum(h ** 2)


def _while_programs(preset):
    """Equinox's checkpointed while loop (reverse-differentiable: a filter_custom_vjp inside) and a
    ``lax.while_loop`` with a ``jax.checkpoint`` body (forward-differentiable only: its JVP)."""
    eqx_fn, lax_fn = (_eqx_while, _lax_while) if preset is None else (
        jaxmp.autocast(_eqx_while, preset), jaxmp.autocast(_lax_while, preset))
    # fp8 matmuls have a custom VJP and no JVP: forward mode stops there, so only the value there.
    forward_mode = preset is None or get_recipe(preset).fp8 is None

    def run(w, tw):
        lax_out = jax.jvp(lambda v: lax_fn(X, v), (w,), (tw,)) if forward_mode else lax_fn(X, w)
        return jax.value_and_grad(eqx_fn, argnums=1)(X, w), lax_out

    return run


@pytest.mark.parametrize("preset", PRESET_NAMES)
def test_checkpointed_while_loops_trace(preset):
    """Every preset differentiates both loops (traced only: the rules' flags are checked while
    tracing; the numbers are the slow test's)."""
    if _asserted_refusal(preset):
        return
    (value, grad), _ = jax.eval_shape(_while_programs(preset), W, W)
    assert value.shape == () and grad.shape == W.shape and grad.dtype == np.float32  # the input's dtype


@pytest.fixture(scope="module")
def while_reference():
    """The float32 while programs' results, compiled and run once for the presets' tests."""
    return jax.jit(_while_programs(None))(W, np.ones_like(W))


@pytest.mark.slow
@pytest.mark.parametrize("preset", PRESET_NAMES)
def test_checkpointed_while_loops(while_reference, preset):
    if _asserted_refusal(preset):
        return
    want_eqx, want_lax = while_reference
    got_eqx, got_lax = jax.jit(_while_programs(preset))(W, np.ones_like(W))
    recipe = get_recipe(preset)
    # float32 computes the same; half to a few bf16 roundings; fp8 matmuls (2-3 mantissa bits) coarser
    rtol = 0.25 if recipe.fp8 is not None else 1e-5 if np.dtype(recipe.policy.compute_dtype).itemsize == 4 else 0.05
    _assert_close(got_eqx, want_eqx, rtol)
    _assert_close(got_lax, want_lax, rtol)


# -- a real solver's adjoint: a tiny neural ODE with diffrax --------------------------------------

def _ode_loss(adjoint_name):
    diffrax = pytest.importorskip("diffrax")
    adjoint = {"recursive_checkpoint": diffrax.RecursiveCheckpointAdjoint(),
               "backsolve": diffrax.BacksolveAdjoint()}[adjoint_name]

    def field(t, y, params):
        w1, w2 = params
        return jnp.tanh(y @ w1) @ w2

    def loss(params, y0):
        sol = diffrax.diffeqsolve(diffrax.ODETerm(field), diffrax.Heun(), t0=0.0, t1=1.0, dt0=0.25, y0=y0,
                                  args=params, adjoint=adjoint, max_steps=8)
        return jnp.sum(sol.ys[-1] ** 2)

    return loss


@pytest.mark.slow
@pytest.mark.standard_promotion(reason="diffrax mixes Python floats and weak types in its step-size control")
@pytest.mark.parametrize("adjoint", ["recursive_checkpoint", "backsolve"])
@pytest.mark.parametrize("preset", ["O1-bf16", "O2-bf16", "O1-fp16", "O2-fp16"])
def test_neural_ode_adjoint(preset, adjoint):
    loss = _ode_loss(adjoint)
    params = ((_RNG.normal(size=(4, 8)) / 2).astype(np.float32), (_RNG.normal(size=(8, 4)) / 3).astype(np.float32))
    y0 = _RNG.normal(size=(4,)).astype(np.float32)
    want = jax.jit(jax.value_and_grad(loss))(params, y0)
    got = jax.jit(jax.value_and_grad(jaxmp.autocast(loss, preset)))(params, y0)
    assert all(g.dtype == np.float32 for g in jax.tree.leaves(got[1]))
    _assert_close(got, want, rtol=0.05)


def test_a_custom_vjp_under_autocast_inside_a_shard_map_keeps_its_cotangents_varying():
    # Inside a shard_map the values a rule sees vary over the mesh axis ({V:data}); the engine
    # traces the rule's backward again, and with shape-and-dtype copies of the avals its cotangent
    # lost that type: "the manual axis types do not match" (jaxmp.flax.mixed_precision's attention
    # in the sharded step's per-shard loss). Traced on the avals themselves it keeps it.
    from jax.sharding import PartitionSpec as P

    @jax.custom_vjp
    def sin(x):
        return jnp.sin(x)

    sin.defvjp(lambda x: (jnp.sin(x), x), lambda x, g: (g * jnp.cos(x),))

    def loss(w, x):
        return jnp.sum(sin(x @ w).astype(jnp.float32))

    def body(w, x):
        w = jax.lax.pcast(w, "data", to="varying")  # as the sharded step hands the loss a param
        return jax.grad(jaxmp.autocast(loss, "O1-bf16"))(w, x)[None]

    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    x = np.tile(X, (2, 1))
    grads = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(), P("data")), out_specs=P("data")))(W, x)
    expected = [jax.grad(jaxmp.autocast(loss, "O1-bf16"))(W, x[i:i + 1]) for i in range(8)]
    np.testing.assert_allclose(np.asarray(grads, np.float32), np.asarray(expected, np.float32), rtol=1e-2, atol=1e-3)
