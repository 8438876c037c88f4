"""The per-layer delayed-scaling state, as variables: a scale and an amax history for each of a
layer's three tensors (input, kernel, output gradient), and the step update of every layer's
state from the amaxes its ops observed."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

import jax

from jaxmp._typing import AxisName, PyTree

from jaxmp.fp8._recipes import DelayedScaling, Fp8Meta
from jaxmp.fp8._scaling import update_meta

LAYER_TENSORS = ("input", "kernel", "output_grad")
"""The tensors of one fp8 layer with a delayed scale each (``output_grad`` in the gradient format)."""
FP8_COLLECTION = "fp8_meta"
"""Name of the Linen variable collection (and model-state key) of the delayed-scaling state."""


class Fp8Scales(NamedTuple):
    """The three delayed scales of one fp8 matmul or convolution (float32 scalars).

    Attributes:
      input: the scale of the activation (left operand, forward format).
      kernel: the scale of the weight (right operand, forward format).
      output_grad: the scale of the incoming gradient (backward format), in *unscaled* units:
        the op divides it by the loss scale of `gradient_loss_scale`.
    """

    input: jax.Array
    kernel: jax.Array
    output_grad: jax.Array


def init_layer_state(recipe: DelayedScaling) -> dict[str, jax.Array]:
    """The delayed-scaling state of one fp8 layer: a scale and an amax history per tensor.

    Keys follow ``flax.linen.fp8_ops``: ``input_scale``, ``input_amax_history``,
    ``kernel_scale``, ``kernel_amax_history``, ``output_grad_scale``,
    ``output_grad_amax_history``. It is state, not a parameter: never give it to an optimizer.

    Args:
      recipe: the [`DelayedScaling`][jaxmp.fp8.DelayedScaling] recipe (its history length).

    Returns:
      ``{name: float32 array}``: scales 1, histories zero.

    Example:
      >>> from jaxmp import fp8
      >>> sorted(fp8._state.init_layer_state(fp8.DelayedScaling(history_length=4)))[:2]
      ['input_amax_history', 'input_scale']
    """
    if not isinstance(recipe, DelayedScaling):
        raise TypeError(f"init_layer_state needs a DelayedScaling recipe, got {type(recipe).__name__}")
    meta = recipe.init_meta()
    out = {}
    for name in LAYER_TENSORS:
        out[f"{name}_scale"], out[f"{name}_amax_history"] = meta.scale, meta.amax_history
    return out


def layer_scales(layer_state: Mapping[str, Any]) -> Fp8Scales:
    """The `jaxmp.fp8._state.Fp8Scales` of one layer's state (from `jaxmp.fp8._state.init_layer_state`).

    Example:
      >>> from jaxmp import fp8
      >>> state = fp8._state.init_layer_state(fp8.DelayedScaling())
      >>> float(fp8._state.layer_scales(state).kernel)
      1.0
    """
    return Fp8Scales(*(layer_state[f"{name}_scale"] for name in LAYER_TENSORS))


def _is_layer_state(node: Any) -> bool:
    return isinstance(node, Mapping) and all(f"{n}_scale" in node and f"{n}_amax_history" in node
                                             for n in LAYER_TENSORS)


def _update_layer(layer: Mapping, seen: Mapping, recipe: DelayedScaling) -> Mapping:
    out = dict(layer)
    for name in LAYER_TENSORS:
        dtype = recipe.bwd_dtype if name == "output_grad" else recipe.fwd_dtype
        meta = update_meta(Fp8Meta(layer[f"{name}_scale"], layer[f"{name}_amax_history"]),
                           seen[f"{name}_scale"], recipe, dtype)
        out[f"{name}_scale"], out[f"{name}_amax_history"] = meta.scale, meta.amax_history
    return out if type(layer) is dict else type(layer)(out)  # a FrozenDict layer stays one


def update_state(state: PyTree, observed: PyTree, recipe: DelayedScaling,
                 axis_name: AxisName | None = None) -> PyTree:
    """Records one step's amaxes in every layer's history and recomputes the scales.

    ``observed`` is the gradient of the loss with respect to ``state``: each delayed-scaling op
    reports the amax it saw as its scale's gradient (see docs/fp8.md#fp8-state-is-not-a-gradient).

    Args:
      state: a pytree holding layer states (`jaxmp.fp8._state.init_layer_state` dicts, at any depth).
      observed: the same structure, from differentiating with respect to ``state``.
      recipe: the [`DelayedScaling`][jaxmp.fp8.DelayedScaling] recipe.
      axis_name: a bound ``pmap``/``shard_map`` axis: the amaxes are maxed over it first.

    Returns:
      The new state; non-finite amaxes (an overflowed step) leave their tensor unchanged.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from jaxmp import fp8
      >>> recipe = fp8.DelayedScaling(history_length=4)
      >>> state = {"dense": fp8._state.init_layer_state(recipe)}
      >>> seen = jax.tree.map(lambda a: jnp.full_like(a, 2.0), state)
      >>> float(fp8.update_state(state, seen, recipe)["dense"]["input_scale"])
      224.0
    """
    if not isinstance(recipe, DelayedScaling):
        raise TypeError(f"update_state needs a DelayedScaling recipe, got {type(recipe).__name__}")
    if axis_name is not None:
        observed = jax.lax.pmax(observed, axis_name)

    # tree.map, not a dict walk: a FrozenDict, a list of layers or an nnx.State comes back as the
    # same container (a rebuilt plain dict would change the train state's pytree structure).
    return jax.tree.map(lambda node, seen: _update_layer(node, seen, recipe) if _is_layer_state(node) else node,
                        state, observed, is_leaf=_is_layer_state)
