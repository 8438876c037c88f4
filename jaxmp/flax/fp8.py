"""fp8 matmuls and convolutions for Linen and NNX models under an ``O2-fp8`` policy.

Every half-list ``Dense``/``DenseGeneral``/``Conv`` (Linen) and ``Linear``/``LinearGeneral``/``Conv``
(NNX) gets an fp8 op under a recipe with fp8 (``"O2-fp8"``, or rules with ``fp8_matmuls=...``).
Delayed-scaling state is no parameter: the Linen ``"fp8_meta"`` collection (`FP8_COLLECTION`), or
NNX [`Fp8State`][jaxmp.flax.fp8.Fp8State] variables; the train steps update it from the amaxes
each op reports as its scale's gradient, after the step is known to be finite.
See docs/fp8.md#fp8-state-is-not-a-gradient.
"""

from __future__ import annotations

# What this door module offers; the rest of its namespace is its own machinery.
__all__ = ["Fp8ConvGeneralDilated", "Fp8DotGeneral", "Fp8State", "NnxFp8Op"]

import contextlib
from typing import Any

import flax.linen as nn
import jax
from flax import nnx

from jaxmp import fp8
from jaxmp.fp8._seams import recipes as fp8_recipes, state as fp8_state
from jaxmp.engine._seams import explain_enabled

FP8_COLLECTION = fp8_state.FP8_COLLECTION  # the Linen variable collection of the delayed-scaling state

#: Linen classes whose matmul / convolution an fp8 policy replaces (and the field it sets).
LINEN_FP8_FIELDS: dict[type, str] = {
    nn.Dense: "dot_general_cls", nn.DenseGeneral: "dot_general_cls", nn.Conv: "conv_general_dilated_cls",
}
#: NNX classes whose matmul / convolution an fp8 policy replaces (and the attribute it sets).
NNX_FP8_FIELDS: dict[type, str] = {
    nnx.Linear: "dot_general", nnx.LinearGeneral: "dot_general", nnx.Conv: "conv_general_dilated",
}
_LINEN_USER_FIELDS = {"dot_general_cls": "dot_general", "conv_general_dilated_cls": "conv_general_dilated"}


def _labelled(recipe: fp8.Fp8Recipe):
    # The same name scope autocast uses for its decisions, so precision_report names these ops.
    return jax.named_scope(f"jaxmp.rule={fp8_recipes.describe(recipe)}") if explain_enabled() else contextlib.nullcontext()


def _run(op_name: str, recipe, scales, args, kwargs):
    if kwargs.pop("out_sharding", None) is not None:  # NNX always passes it, usually None
        raise ValueError("fp8 layers do not take out_sharding: shard the operands instead")
    op = fp8.fp8_dot_general if op_name == "dot_general" else fp8.fp8_conv_general_dilated
    with _labelled(recipe if op_name == "dot_general" else fp8_recipes.conv_recipe(recipe)):
        return op(*args, recipe=recipe, scales=scales, **kwargs)


# -- Linen ------------------------------------------------------------------------------------

class _LinenFp8Op(nn.Module):
    """A Linen fp8 op; delayed scaling keeps its state in `FP8_COLLECTION`."""

    recipe: Any = None
    op_name: str = "dot_general"

    @nn.compact
    def __call__(self, *args, **kwargs):
        scales = None
        if isinstance(self.recipe, fp8.DelayedScaling):
            init = fp8_state.init_layer_state(self.recipe)
            state = {k: self.variable(FP8_COLLECTION, k, lambda v=v: v).value for k, v in init.items()}
            scales = fp8_state.layer_scales(state)
        return _run(self.op_name, self.recipe, scales, args, kwargs)


class Fp8DotGeneral(_LinenFp8Op):
    """Linen ``dot_general_cls`` running [`jaxmp.fp8.fp8_dot_general`][jaxmp.fp8.fp8_dot_general] (see the module docstring).

    Example:
      >>> import functools, jax, jax.numpy as jnp, flax.linen as nn
      >>> from jaxmp import fp8
      >>> from jaxmp.flax.fp8 import Fp8DotGeneral
      >>> recipe = fp8.DelayedScaling(history_length=8)
      >>> layer = nn.Dense(4, dot_general_cls=functools.partial(Fp8DotGeneral, recipe=recipe))
      >>> variables = layer.init(jax.random.key(0), jnp.ones((2, 3)))
      >>> variables["fp8_meta"]["Fp8DotGeneral_0"]["input_amax_history"].shape
      (8,)
    """

    op_name: str = "dot_general"


class Fp8ConvGeneralDilated(_LinenFp8Op):
    """Linen ``conv_general_dilated_cls`` running [`jaxmp.fp8.fp8_conv_general_dilated`][jaxmp.fp8.fp8_conv_general_dilated].

    Example:
      >>> import functools, jax, jax.numpy as jnp, flax.linen as nn
      >>> from jaxmp import fp8
      >>> from jaxmp.flax.fp8 import Fp8ConvGeneralDilated
      >>> op = functools.partial(Fp8ConvGeneralDilated, recipe=fp8.CurrentScaling())
      >>> conv = nn.Conv(2, (3, 3), conv_general_dilated_cls=op)
      >>> x = jnp.ones((1, 4, 4, 1))
      >>> conv.apply(conv.init(jax.random.key(0), x), x).shape
      (1, 4, 4, 2)
    """

    op_name: str = "conv_general_dilated"


def linen_fp8_field(module: nn.Module) -> str | None:
    """The ``*_cls`` field an fp8 policy sets on ``module``, or None (not an fp8 layer, or a user op).

    Example:
      >>> import flax.linen as nn
      >>> from jaxmp.flax.fp8 import linen_fp8_field
      >>> linen_fp8_field(nn.Dense(3)), linen_fp8_field(nn.LayerNorm())
      ('dot_general_cls', None)
    """
    field = next((f for cls, f in LINEN_FP8_FIELDS.items() if isinstance(module, cls)), None)
    if field is None or getattr(module, field) is not None or getattr(module, _LINEN_USER_FIELDS[field]) is not None:
        return None  # the user's own op (e.g. flax's Fp8DotGeneralOp) is left alone
    return field


# -- NNX --------------------------------------------------------------------------------------

class Fp8State(nnx.Variable):
    """NNX variable type of the delayed-scaling state (scales, amax histories): not a ``Param``."""


class NnxFp8Op(nnx.Module):
    """An NNX layer's ``dot_general`` / ``conv_general_dilated`` in fp8 (see the module docstring).

    Args:
      recipe: a [`jaxmp.fp8.CurrentScaling`][jaxmp.fp8.CurrentScaling] or [`jaxmp.fp8.DelayedScaling`][jaxmp.fp8.DelayedScaling].
      op_name: ``"dot_general"`` or ``"conv_general_dilated"``.

    Example:
      >>> import jax.numpy as jnp
      >>> from flax import nnx
      >>> from jaxmp import fp8
      >>> from jaxmp.flax.fp8 import NnxFp8Op, Fp8State
      >>> op = NnxFp8Op(fp8.DelayedScaling(history_length=8))
      >>> layer = nnx.Linear(3, 4, rngs=nnx.Rngs(0), dot_general=op)
      >>> layer(jnp.ones((2, 3))).shape, len(nnx.state(layer, Fp8State))
      ((2, 4), 1)
    """

    def __init__(self, recipe: fp8.Fp8Recipe, op_name: str = "dot_general"):
        if not isinstance(recipe, fp8.Fp8Recipe):
            raise TypeError(f"recipe must be a jaxmp.fp8 recipe, got {type(recipe).__name__}")
        if op_name not in ("dot_general", "conv_general_dilated"):
            raise ValueError(f"op_name must be 'dot_general' or 'conv_general_dilated', got {op_name!r}")
        self.recipe, self.op_name = recipe, op_name
        if isinstance(recipe, fp8.DelayedScaling):
            for key, value in fp8_state.init_layer_state(recipe).items():
                setattr(self, key, Fp8State(value))

    def __call__(self, *args, **kwargs):
        scales = None
        if isinstance(self.recipe, fp8.DelayedScaling):
            scales = fp8_state.Fp8Scales(*(getattr(self, f"{n}_scale")[...] for n in fp8_state.LAYER_TENSORS))
        return _run(self.op_name, self.recipe, scales, args, kwargs)


def install_nnx_fp8(model: nnx.Module, recipe: fp8.Fp8Recipe | None, is_half: Any, recipe_of: Any = None) -> int:
    """Gives every fp8-eligible half layer of an NNX model an [`NnxFp8Op`][jaxmp.flax.fp8.NnxFp8Op] (in place).

    Args:
      model: the NNX model.
      recipe: the fp8 recipe.
      is_half: ``is_half(module) -> bool``: whether the policy runs the layer in half.
      recipe_of: ``recipe_of(path, module) -> recipe or None``: each layer's own format (the
        rules' path and class formats, ``AutocastRules.module_format``), over ``recipe``; None: the
        layer keeps its op.

    Returns:
      The number of layers given an fp8 op (layers with a user-set op are left alone).
    """
    count = 0
    for path, node in list(nnx.iter_graph(model)):
        field = next((f for cls, f in NNX_FP8_FIELDS.items() if isinstance(node, cls)), None)
        if field is None or not is_half(node):
            continue
        own = recipe if recipe_of is None else recipe_of(tuple(str(k) for k in path), node)
        if own is None:
            continue
        current = getattr(node, field)
        if isinstance(current, NnxFp8Op):
            count += 1
            continue
        if current is not getattr(jax.lax, field):
            continue  # the user's own op
        setattr(node, field, nnx.data(NnxFp8Op(own, field)))  # a graph node, so its state is found
        count += 1
    return count
