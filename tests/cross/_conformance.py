"""The axes of the conformance matrix: front doors, model libraries, presets and transformations.

Each axis is generated from what exists, so a new cell joins by existing:

- presets: every name of ``jaxmp._precision._presets.PRESET_NAMES`` (the names the docs list);
- doors: `DOORS` below, and tests/cross/test_conformance.py fails when a public jaxmp callable
  taking a ``policy`` is neither a door here nor listed in `NOT_DOORS` with its reason;
- libraries: one small model per library (plain JAX, Flax Linen, Flax NNX, Equinox, Haiku), the same
  network in each (Dense -> tanh -> LayerNorm -> Dense, a mean-squared loss in float32);
- transformations: `TRANSFORMS`, each a function of a door's functional loss.

A door turns a library's model and a preset into ``Cell``: a functional ``loss(params, x, y)``
and the params it takes (half under the Flax wrapper's O2 storage, float32 masters elsewhere).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

import jaxmp
import jaxmp.flax
from jaxmp._precision import _presets

D_IN, D_HIDDEN, D_OUT, BATCH = 8, 16, 4, 6

PRESETS = tuple(_presets.PRESET_NAMES)


def recipe(preset: str):
    return jaxmp.get_recipe(preset)


def distinct_presets() -> tuple[str, ...]:
    """One preset name per distinct recipe (aliases such as ``"O1"``/``"mixed_float16"`` resolve
    to the same one on this platform): the trained cells run each program once."""
    seen, names = set(), []
    for name in PRESETS:
        r = recipe(name)
        key = (r.policy, r.master_weights, r.loss_scale, r.keep_float32, repr(r.fp8), r.level)
        if key not in seen:
            seen.add(key)
            names.append(name)
    return tuple(names)


def data(seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(BATCH, D_IN)).astype(np.float32)
    y = np.sin(x @ rng.normal(size=(D_IN, D_OUT))).astype(np.float32)
    return x, y


def mse(out, y):
    return jnp.mean((out.astype(jnp.float32) - y) ** 2)


# -- one small model per library: (apply(params, x), params) ---------------------------------

def _plain():
    rng = np.random.default_rng(1)
    params = {"w1": (rng.normal(size=(D_IN, D_HIDDEN)) / 3).astype(np.float32),
              "b1": np.zeros(D_HIDDEN, np.float32),
              "scale": np.ones(D_HIDDEN, np.float32),
              "w2": (rng.normal(size=(D_HIDDEN, D_OUT)) / 4).astype(np.float32)}

    def apply(p, x):
        h = jnp.tanh(x @ p["w1"] + p["b1"])
        mean = jnp.mean(h, -1, keepdims=True)
        var = jnp.mean(jnp.square(h - mean), -1, keepdims=True)
        return ((h - mean) * jax.lax.rsqrt(var + 1e-5) * p["scale"]) @ p["w2"]
    return apply, params


@functools.cache
def _linen_module():
    import flax.linen as nn

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(D_OUT)(nn.LayerNorm()(jnp.tanh(nn.Dense(D_HIDDEN)(x))))
    return Net()


@functools.cache
def _linen_params():
    # numpy leaves: one compile per process, and no device arrays shared between tests
    init = jax.jit(_linen_module().init)(jax.random.key(0), np.zeros((BATCH, D_IN), np.float32))
    return jax.tree.map(np.asarray, init)


def _linen():
    return _linen_module().apply, _linen_params()


def _nnx_module():
    from flax import nnx

    class Net(nnx.Module):
        def __init__(self, rngs):
            self.dense1 = nnx.Linear(D_IN, D_HIDDEN, rngs=rngs)
            self.norm = nnx.LayerNorm(D_HIDDEN, rngs=rngs)
            self.dense2 = nnx.Linear(D_HIDDEN, D_OUT, rngs=rngs)

        def __call__(self, x):
            return self.dense2(self.norm(jnp.tanh(self.dense1(x))))
    return Net(nnx.Rngs(0))


def _nnx():
    from flax import nnx

    graphdef, params = nnx.split(_nnx_module())
    return (lambda p, x: nnx.merge(graphdef, p)(x)), params


def _equinox():
    import equinox as eqx

    k1, k2 = jax.random.split(jax.random.key(0))
    model = eqx.nn.Sequential([eqx.nn.Linear(D_IN, D_HIDDEN, key=k1), eqx.nn.Lambda(jnp.tanh),
                               eqx.nn.LayerNorm(D_HIDDEN), eqx.nn.Linear(D_HIDDEN, D_OUT, key=k2)])
    params, static = eqx.partition(model, eqx.is_inexact_array)
    return (lambda p, x: jax.vmap(eqx.combine(p, static))(x)), params


@functools.cache
def _haiku_net():
    import haiku as hk

    def forward(x):
        h = jnp.tanh(hk.Linear(D_HIDDEN)(x))
        return hk.Linear(D_OUT)(hk.LayerNorm(-1, create_scale=True, create_offset=True)(h))
    net = hk.without_apply_rng(hk.transform(forward))
    params = jax.jit(net.init)(jax.random.key(0), np.zeros((BATCH, D_IN), np.float32))
    return net.apply, jax.tree.map(np.asarray, params)


def _haiku():
    return _haiku_net()


# name -> (the module to import to run it, the builder)
LIBRARIES: dict[str, tuple[str | None, Callable[[], tuple[Callable, Any]]]] = {
    "plain": (None, _plain),
    "linen": ("flax.linen", _linen),
    "nnx": ("flax.nnx", _nnx),
    "equinox": ("equinox", _equinox),
    "haiku": ("haiku", _haiku),
}


# -- the front doors -------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Cell:
    """What a door makes of a model and a preset: a functional loss and the params it takes."""

    loss: Callable[[Any, Any, Any], jax.Array]
    params: Any
    output: Callable[[Any, Any], jax.Array]  # the model's output through the door
    loss_inside: bool = False  # the loss itself runs behind the door (its dtype is the policy's output)


def _autocast(library: str, preset: str) -> Cell:
    apply, params = LIBRARIES[library][1]()
    return Cell(jaxmp.autocast(lambda p, x, y: mse(apply(p, x), y), preset), params,
                jaxmp.autocast(apply, preset), loss_inside=True)


def _policy_casts(library: str, preset: str) -> Cell:
    # jmp's way: the user casts params and inputs to the compute dtype and the output back.
    apply, params = LIBRARIES[library][1]()
    policy = jaxmp.get_policy(preset)

    def output(p, x):
        p, x = policy.cast_to_compute((p, x))
        return policy.cast_to_output(apply(p, x))
    return Cell(lambda p, x, y: mse(output(p, x), y), policy.cast_to_param(params), output)


def _linen_wrapper(library: str, preset: str) -> Cell:
    model = jaxmp.flax.mixed_precision(_linen_module(), preset)
    # The wrapper stores params in the rule's dtype: the float32 init cast as its init would.
    x = np.zeros((BATCH, D_IN), np.float32)
    stored = jax.eval_shape(model.init, jax.random.key(0), x)
    if jax.tree.structure(stored) == jax.tree.structure(_linen_params()):
        params = jax.tree.map(lambda p, s: np.asarray(p, s.dtype), _linen_params(), stored)
    else:  # delayed fp8 adds its scales and amax histories: the wrapper's own init
        params = jax.jit(model.init)(jax.random.key(0), x)
    return Cell(lambda p, x, y: mse(model.apply(p, x), y), params, model.apply)


def _nnx_wrapper(library: str, preset: str) -> Cell:
    from flax import nnx

    graphdef, params = nnx.split(jaxmp.flax.mixed_precision(_nnx_module(), preset))

    def output(p, x):
        return nnx.merge(graphdef, p)(x)
    return Cell(lambda p, x, y: mse(output(p, x), y), params, output)


def _nnx_call(library: str, preset: str) -> Cell:
    from flax import nnx

    graphdef, params = nnx.split(_nnx_module())

    def output(p, x):
        return jaxmp.flax.nnx.call(nnx.merge(graphdef, p), x, policy=preset)
    return Cell(lambda p, x, y: mse(output(p, x), y), params, output)


@dataclasses.dataclass(frozen=True)
class Door:
    name: str
    api: str  # the public name it is reached by (the exhaustiveness test matches it)
    libraries: tuple[str, ...]
    build: Callable[[str, str], Cell]
    # O1's float32 list (exp, log, rsqrt, every reduction...) runs in float32 at this door
    float32_list: bool


DOORS = (
    Door("autocast", "jaxmp.autocast", tuple(LIBRARIES), _autocast, True),
    Door("linen-wrapper", "jaxmp.flax.mixed_precision", ("linen",), _linen_wrapper, True),
    Door("nnx-wrapper", "jaxmp.flax.mixed_precision", ("nnx",), _nnx_wrapper, True),
    Door("nnx-call", "jaxmp.flax.nnx.call", ("nnx",), _nnx_call, True),
    # Every cast by hand: no op lists, so no float32-list promise (docs/choose-your-way-in.md).
    Door("policy-casts", "jaxmp.Policy.cast_to_compute", tuple(LIBRARIES), _policy_casts, False),
)

# Public callables that take a ``policy`` but are not front doors, and why.
NOT_DOORS = {
    "jaxmp.as_policy": "parses a policy",
    "jaxmp.Recipe": "a record of a preset",
    "jaxmp.flax.default_rules": "the rules a door uses",
    "jaxmp.precision_report": "a diagnostic (the debugger's column)",
    "jaxmp.PrecisionReport": "a diagnostic's result",
    "jaxmp.diagnostics.precision_report": "a diagnostic",
    "jaxmp.diagnostics.PrecisionReport": "a diagnostic's result",
    "jaxmp.diagnostics.locate_non_finite": "a diagnostic",
    "jaxmp.diagnostics.compare_to_float32": "a diagnostic",
    "jaxmp.diagnostics.ShadowReport": "a diagnostic's result",
    "jaxmp.diagnostics.strict_precision": "a diagnostic",
    "jaxmp.diagnostics.block_report": "a diagnostic (block-scaled presets only)",
}


def refusal(door: Door, preset: str) -> str | None:
    """The documented refusal of a cell (a regex of its message), or None where the cell runs."""
    delayed = type(recipe(preset).fp8).__name__ == "DelayedScaling"
    # A Policy is dtypes only: jaxmp.get_policy refuses an fp8 preset's name rather than drop its recipe.
    if door.name == "policy-casts" and recipe(preset).fp8 is not None:
        return r"is an fp8 preset, and a Policy holds only dtypes.*jaxmp\.get_recipe"
    # Delayed scaling keeps amax histories in module state: a function has none.
    if delayed and door.name == "autocast":
        return "use 'O2-fp8-current'"
    if delayed and door.name == "nnx-call":
        return r"wrap it with jaxmp.flax.mixed_precision\(model, policy\)"
    return None


# -- transformations of a functional loss ----------------------------------------------------

def _grad(loss, params, x, y, scale):
    return jaxmp.value_and_grad(loss, scale)(params, x, y)


def _jit(loss, params, x, y, scale):
    return jax.jit(loss)(params, x, y), None


def _vmap(loss, params, x, y, scale):
    # per-example losses of the same params (a batch of batches of one example)
    losses = jax.vmap(loss, in_axes=(None, 0, 0))(params, x[:, None], y[:, None])
    return jnp.mean(losses), None


def _scan(loss, params, x, y, scale):
    # the door called in a scan body with per-iteration params, as a scan over layers does
    stacked = jax.tree.map(lambda a: jnp.stack([a, a]), params)

    def body(total, p):
        value, grads = jaxmp.value_and_grad(loss, scale)(p, x, y)
        return total + value.astype(jnp.float32), grads
    value_dtype = jax.eval_shape(loss, params, x, y).dtype
    total, grads = jax.lax.scan(body, jnp.zeros((), jnp.float32), stacked)
    return (total / 2).astype(value_dtype), jax.tree.map(lambda g: g[0], grads)


def _remat(loss, params, x, y, scale):
    return jaxmp.value_and_grad(jax.checkpoint(loss), scale)(params, x, y)


# name -> f(loss, params, x, y, loss_scale) -> (loss value, grads or None)
TRANSFORMS: dict[str, Callable] = {"jit": _jit, "grad": _grad, "vmap": _vmap, "scan": _scan, "remat": _remat}


def loss_scale(preset: str):
    return jaxmp.make_loss_scale(recipe(preset).loss_scale)
