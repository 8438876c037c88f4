"""The scaled fp8 ops: ``dot_general`` and ``conv_general_dilated`` on fp8-rounded operands
(E4M3) with an fp8-rounded cotangent (E5M2), under either recipe; and the loss-scale context
delayed-scaling ops read ([`gradient_loss_scale`][jaxmp.fp8.gradient_loss_scale])."""

from __future__ import annotations

import contextlib
import contextvars
from typing import Any

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike, DTypeLike

from jaxmp.fp8._block_ops import block_dot_general
from jaxmp.fp8._recipes import CurrentScaling, DelayedScaling, Fp8Recipe, conv_recipe
from jaxmp.fp8._scaling import amax, dequantize, qdq, quantize
from jaxmp.fp8._state import Fp8Scales
from jaxmp.fp8._tangents import is_zero, rounded_cotangent, straight_through, tangent_sum

_GRAD_LOSS_SCALE: contextvars.ContextVar = contextvars.ContextVar("jaxmp_fp8_gradient_loss_scale", default=None)


@contextlib.contextmanager
def gradient_loss_scale(loss_scale: ArrayLike):
    """Tells delayed-scaling fp8 ops traced inside that gradients carry ``loss_scale``.

    The ops then keep gradient scales and amaxes in unscaled units, so a change of the loss scale
    never corrupts the E5M2 history. The `jaxmp.flax` steps enter it for you; a hand-written step
    that scales the loss enters it around its forward pass.
    See docs/fp8.md#fp8-state-is-not-a-gradient.

    Args:
      loss_scale: the scalar the loss is multiplied by (a traced value is fine).

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from jaxmp import fp8
      >>> recipe = fp8.DelayedScaling(history_length=4)
      >>> scales = fp8._state.layer_scales(fp8._state.init_layer_state(recipe))
      >>> def scaled_loss(s):
      ...     with fp8.gradient_loss_scale(1024.0):
      ...         y = fp8.fp8_dot_general(jnp.ones((2, 3)), jnp.ones((3, 4)),
      ...                                 (((1,), (0,)), ((), ())), recipe, scales=s)
      ...     return 1024.0 * jnp.sum(y)
      >>> # the cotangent is 1024; its amax, unscaled:
      >>> float(jax.grad(scaled_loss)(scales).output_grad)
      1.0
    """
    token = _GRAD_LOSS_SCALE.set(loss_scale)
    try:
        yield
    finally:
        _GRAD_LOSS_SCALE.reset(token)


def _check_operands(name: str, lhs: Any, rhs: Any) -> None:
    for side, x in (("lhs", lhs), ("rhs", rhs)):
        if not jnp.issubdtype(jnp.result_type(x), jnp.floating):
            raise TypeError(f"{name}: {side} must be floating, got {jnp.result_type(x)}")


def _recipe(recipe: Any, scales: Any, name: str) -> Fp8Recipe:
    recipe = CurrentScaling() if recipe is None else recipe
    if not isinstance(recipe, Fp8Recipe):
        raise TypeError(f"{name}: recipe must be a jaxmp.fp8.CurrentScaling or DelayedScaling, "
                        f"got {type(recipe).__name__}")
    delayed = isinstance(recipe, DelayedScaling)
    if delayed and scales is None:
        raise TypeError(f"{name}: delayed scaling needs scales=Fp8Scales(...) from the layer's fp8 state "
                        "(see fp8._state.init_layer_state); use CurrentScaling() for a stateless op")
    if not delayed and scales is not None:
        raise TypeError(f"{name}: scales are only used with a DelayedScaling recipe")
    return recipe


def _scaled_bilinear(op, lhs, rhs, recipe: Fp8Recipe, scales: Fp8Scales | None):
    """``op(lhs, rhs)`` on fp8-rounded operands, with an fp8-rounded cotangent.

    ``op`` is linear in each operand (a dot or a convolution), so its VJP on the quantized
    operands is the gradient of the quantized forward pass. Current scaling is a custom JVP
    (`jaxmp.fp8._tangents`): forward mode and reverse mode both work. With delayed scaling the
    scales are inputs whose cotangents are the amaxes observed for them (``update_state``
    records those): a custom VJP, so reverse mode only (a gradient's amax has no forward mode).
    """
    fwd_dt, bwd_dt, margin = recipe.fwd_dtype, recipe.bwd_dtype, recipe.margin

    def q(x, dtype, scale):
        return qdq(x, dtype, margin) if scale is None else dequantize(quantize(x, scale, dtype), scale, x.dtype)

    if scales is None:
        # Current scaling: a custom JVP whose tangent map, transposed, is the backward pass (the
        # op's transposes at the cotangent rounded to bwd_dtype), so forward mode works too.
        def primal(a, b):
            return op(q(a, fwd_dt, None), q(b, fwd_dt, None))

        def jvp(primals, tangents):
            (a, b), (ta, tb) = primals, tangents
            y = scaled(a, b)  # through this rule again in a second derivative, never through the casts
            qa, qb = (straight_through(lambda v: q(v, fwd_dt, None), v) for v in (a, b))
            # The derivative of the quantized forward, quantization passed straight through.
            parts = ([] if is_zero(ta) else [op(ta, qb)]) + ([] if is_zero(tb) else [op(qa, tb)])
            return y, rounded_cotangent(tangent_sum(parts, y), lambda g: q(g, bwd_dt, None))

        scaled = jax.custom_jvp(primal)
        scaled.defjvp(jvp, symbolic_zeros=True)
        return scaled(lhs, rhs)

    def fwd_d(a, b, sa, sb, sg):
        qa, qb = q(a, fwd_dt, sa), q(b, fwd_dt, sb)
        return op(qa, qb), (qa, qb, amax(a), amax(b), sg)

    def bwd_d(res, g):
        qa, qb, amax_a, amax_b, sg = res
        da, db = jax.vjp(op, qa, qb)[1](q(g, bwd_dt, sg))
        return da, db, amax_a, amax_b, amax(g)

    f = jax.custom_vjp(lambda a, b, sa, sb, sg: fwd_d(a, b, sa, sb, sg)[0])
    f.defvjp(fwd_d, bwd_d)
    sa, sb, sg = (jnp.asarray(s, jnp.float32) for s in scales)
    loss_scale = _GRAD_LOSS_SCALE.get()
    if loss_scale is not None:
        # In unscaled units: the cotangent carries the loss scale, and the chain rule through
        # this division hands back amax / loss_scale as the observed gradient amax.
        sg = sg / jnp.asarray(loss_scale, jnp.float32)
    return f(lhs, rhs, sa, sb, sg)


def fp8_dot_general(lhs: jax.Array, rhs: jax.Array, dimension_numbers, recipe: Fp8Recipe | None = None,
                    preferred_element_type: DTypeLike | None = None, *, scales: Fp8Scales | None = None,
                    precision: jax.lax.PrecisionLike = None) -> jax.Array:
    """``lax.dot_general`` with fp8 operands (E4M3) and an fp8 cotangent (E5M2).

    A [`CurrentScaling`][jaxmp.fp8.CurrentScaling] with ``block`` set runs block-scaled
    (MXFP8, NVFP4, rowwise, 128-blocks): each leg quantizes along its own contraction axis in
    the recipe's formats (docs/fp8.md#block-scaled-formats).

    Current scaling: each operand is quantized with the scale of its own amax; in the backward
    pass the incoming cotangent is quantized to the gradient format the same way (so a loss
    scale cancels out), then the gradients are the dot's transposes on the quantized values.
    Delayed scaling: the scales come from ``scales`` (the layer's state, see
    `init_layer_state`) and the amaxes seen this step come back as their gradients.

    Args:
      lhs: left operand (floating), as for ``jax.lax.dot_general``.
      rhs: right operand (floating).
      dimension_numbers: as for ``jax.lax.dot_general``.
      recipe: a [`CurrentScaling`][jaxmp.fp8.CurrentScaling] (default) or [`DelayedScaling`][jaxmp.fp8.DelayedScaling].
      preferred_element_type: the output dtype, as for ``jax.lax.dot_general``.
      scales: the `jaxmp.fp8._state.Fp8Scales` of a delayed recipe (None for current scaling).
      precision: as for ``jax.lax.dot_general``.

    Returns:
      The product in ``preferred_element_type`` (default: the operands' promoted dtype).

    Example:
      >>> import jax.numpy as jnp
      >>> from jaxmp import fp8
      >>> x = jnp.ones((2, 3)); w = jnp.full((3, 4), 0.5)
      >>> fp8.fp8_dot_general(x, w, (((1,), (0,)), ((), ()))).tolist()[0]
      [1.5, 1.5, 1.5, 1.5]
    """
    recipe = _recipe(recipe, scales, "fp8_dot_general")
    _check_operands("fp8_dot_general", lhs, rhs)
    if isinstance(recipe, CurrentScaling) and recipe.block is not None:
        return block_dot_general(lhs, rhs, dimension_numbers, recipe, preferred_element_type, precision)

    def dot(a, b):
        return jax.lax.dot_general(a, b, dimension_numbers, precision=precision,
                                   preferred_element_type=preferred_element_type)

    return _scaled_bilinear(dot, lhs, rhs, recipe, scales)


def fp8_conv_general_dilated(lhs: jax.Array, rhs: jax.Array, window_strides, padding, lhs_dilation=None,
                             rhs_dilation=None, dimension_numbers=None, feature_group_count: int = 1,
                             batch_group_count: int = 1, precision: jax.lax.PrecisionLike = None,
                             preferred_element_type: DTypeLike | None = None, *, recipe: Fp8Recipe | None = None,
                             scales: Fp8Scales | None = None) -> jax.Array:
    """``lax.conv_general_dilated`` with fp8 operands and cotangent, like [`fp8_dot_general`][jaxmp.fp8.fp8_dot_general].

    A block-scaled recipe runs per-tensor here, in its fp8 formats (E2M1 as E4M3).

    Args:
      lhs: the input (floating), as for ``jax.lax.conv_general_dilated``.
      rhs: the kernel (floating).
      window_strides: as for ``jax.lax.conv_general_dilated``.
      padding: as for ``jax.lax.conv_general_dilated``.
      lhs_dilation: as for ``jax.lax.conv_general_dilated``.
      rhs_dilation: as for ``jax.lax.conv_general_dilated``.
      dimension_numbers: as for ``jax.lax.conv_general_dilated``.
      feature_group_count: as for ``jax.lax.conv_general_dilated``.
      batch_group_count: as for ``jax.lax.conv_general_dilated``.
      precision: as for ``jax.lax.conv_general_dilated``.
      preferred_element_type: as for ``jax.lax.conv_general_dilated``.
      recipe: a [`CurrentScaling`][jaxmp.fp8.CurrentScaling] (default) or [`DelayedScaling`][jaxmp.fp8.DelayedScaling].
      scales: the `jaxmp.fp8._state.Fp8Scales` of a delayed recipe.

    Returns:
      The convolution of the fp8-rounded operands.

    Example:
      >>> import jax.numpy as jnp
      >>> from jaxmp import fp8
      >>> x, kernel = jnp.ones((1, 1, 4)), jnp.ones((1, 1, 2))
      >>> y = fp8.fp8_conv_general_dilated(x, kernel, (1,), "VALID")
      >>> y.tolist()
      [[[2.0, 2.0, 2.0]]]
    """
    recipe = _recipe(recipe, scales, "fp8_conv_general_dilated")
    _check_operands("fp8_conv_general_dilated", lhs, rhs)
    recipe = conv_recipe(recipe)

    def conv(a, b):
        return jax.lax.conv_general_dilated(a, b, window_strides, padding, lhs_dilation, rhs_dilation,
                                            dimension_numbers, feature_group_count, batch_group_count,
                                            precision=precision, preferred_element_type=preferred_element_type)

    return _scaled_bilinear(conv, lhs, rhs, recipe, scales)
