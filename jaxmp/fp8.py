"""fp8 scaling: recipes, scale and amax-history updates, and a scaled fp8 ``dot_general``.

fp8 has so little range (E4M3: +-448, E5M2: +-57344) that every tensor is multiplied by a
per-tensor *scale* before the cast and divided by it after, the scale chosen so the tensor's
absolute maximum (amax) lands near the format's largest value. Two recipes, as in NVIDIA's
Transformer Engine:

* :class:`CurrentScaling`: the scale comes from the tensor's own amax in the same step. No
  state; invariant to a loss scale (a scaled gradient gets a proportionally smaller scale).
* :class:`DelayedScaling`: the scale comes from a history of past amaxes (:class:`Fp8Meta`,
  updated by :func:`update_meta`), so the cast needs no reduction over the tensor first.

Forward operands use E4M3 and gradients E5M2 (the "hybrid" format). :func:`fp8_dot_general`
quantizes and dequantizes its operands around a ``lax.dot_general`` (and the cotangent in its
backward pass). On CPU that is the emulation (fp8 rounding, matmul in the operands' dtype); on
GPUs with fp8 Tensor Cores (compute capability >= 8.9) XLA rewrites this pattern into an fp8
GEMM, which is how ``flax.linen.fp8_ops`` reaches them too. Under :func:`jaxmp.autocast`,
``AutocastRules(fp8_matmuls=CurrentScaling())`` makes every half-list ``dot_general`` one.

Example:
  >>> import jax.numpy as jnp
  >>> from jaxmp import fp8
  >>> float(fp8.compute_scale(jnp.float32(4.0), jnp.float32(1.0), fp8.E4M3))
  112.0
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

E4M3 = jnp.dtype(jnp.float8_e4m3fn)
E5M2 = jnp.dtype(jnp.float8_e5m2)
FP8_DTYPES = (E4M3, E5M2)
REDUCTIONS = ("max", "most_recent")


def _fp8_dtype(value: Any, what: str) -> np.dtype:
    try:
        dtype = jnp.dtype(value)
    except TypeError as e:
        raise TypeError(f"{what} must be an fp8 dtype (float8_e4m3fn or float8_e5m2), got {value!r}") from e
    if dtype not in FP8_DTYPES:
        raise ValueError(f"{what} must be an fp8 dtype (float8_e4m3fn or float8_e5m2), got {dtype}")
    return dtype


def _margin(margin: Any) -> float:
    if isinstance(margin, bool) or not isinstance(margin, (int, float)) or not np.isfinite(margin) or margin < 0:
        raise ValueError(f"margin must be a finite number >= 0 (powers of two of headroom), got {margin!r}")
    return float(margin)


@dataclasses.dataclass(frozen=True)
class CurrentScaling:
    """Per-tensor current scaling: each tensor's scale from its own amax, in the same step.

    Attributes:
      margin: headroom in powers of two (the scale is divided by ``2**margin``).
      fwd_dtype: format of forward operands (E4M3).
      bwd_dtype: format of gradients (E5M2).
      emulate: None (default): native fp8 on GPUs with fp8 Tensor Cores, the emulation on CPU,
        and a clear error elsewhere (older GPUs, TPU); True: emulate anywhere (opt-in);
        False: require fp8 Tensor Cores. See :func:`check_hardware`.

    Example:
      >>> from jaxmp import fp8
      >>> fp8.CurrentScaling().fwd_dtype
      dtype(float8_e4m3fn)
    """

    margin: float = 0.0
    fwd_dtype: Any = E4M3
    bwd_dtype: Any = E5M2
    emulate: bool | None = None

    def __post_init__(self):
        if self.emulate not in (None, True, False):
            raise ValueError(f"emulate must be None, True or False, got {self.emulate!r}")
        object.__setattr__(self, "margin", _margin(self.margin))
        object.__setattr__(self, "fwd_dtype", _fp8_dtype(self.fwd_dtype, "fwd_dtype"))
        object.__setattr__(self, "bwd_dtype", _fp8_dtype(self.bwd_dtype, "bwd_dtype"))


@dataclasses.dataclass(frozen=True)
class DelayedScaling(CurrentScaling):
    """Delayed scaling: the scale from a history of past amaxes (Transformer Engine's defaults).

    Attributes:
      history_length: amaxes kept per tensor (>= 1; 1024 by default).
      reduction: ``"max"`` over the history, or ``"most_recent"``.
      margin: as in :class:`CurrentScaling`.
      fwd_dtype: as in :class:`CurrentScaling`.
      bwd_dtype: as in :class:`CurrentScaling`.
      emulate: as in :class:`CurrentScaling`.

    Example:
      >>> from jaxmp import fp8
      >>> fp8.DelayedScaling(history_length=16).init_meta().amax_history.shape
      (16,)
    """

    history_length: int = 1024
    reduction: str = "max"

    def __post_init__(self):
        super().__post_init__()
        if isinstance(self.history_length, bool) or not isinstance(self.history_length, (int, np.integer)) \
                or self.history_length <= 0:
            raise ValueError(f"history_length must be an int >= 1, got {self.history_length!r}")
        if self.reduction not in REDUCTIONS:
            raise ValueError(f"reduction must be one of {REDUCTIONS}, got {self.reduction!r}")

    def init_meta(self) -> Fp8Meta:
        """A fresh :class:`Fp8Meta`: scale 1 and an all-zero history."""
        return Fp8Meta(scale=jnp.ones((), jnp.float32), amax_history=jnp.zeros((self.history_length,), jnp.float32))


class Fp8Meta(NamedTuple):
    """The delayed-scaling state of one tensor (not a gradient: never give it to an optimizer).

    Attributes:
      scale: float32 scalar the tensor is multiplied by before the fp8 cast.
      amax_history: float32 ``[history_length]``, newest first.
    """

    scale: jax.Array
    amax_history: jax.Array


def fp8_max(dtype: Any) -> float:
    """The largest finite value of an fp8 format.

    Args:
      dtype: ``float8_e4m3fn`` or ``float8_e5m2``.

    Returns:
      448.0 for E4M3, 57344.0 for E5M2.

    Example:
      >>> from jaxmp import fp8
      >>> fp8.fp8_max(fp8.E5M2)
      57344.0
    """
    return float(jnp.finfo(_fp8_dtype(dtype, "dtype")).max)


def compute_scale(amax: jax.Array, old_scale: jax.Array, dtype: Any, margin: float = 0.0) -> jax.Array:
    """``fp8_max / amax / 2**margin``, or ``old_scale`` where amax is zero or not finite.

    Args:
      amax: the reference absolute maximum (float32 scalar).
      old_scale: the scale kept when amax cannot give one.
      dtype: the fp8 format the scale is for.
      margin: headroom in powers of two.

    Returns:
      The new float32 scale.

    Example:
      >>> import jax.numpy as jnp
      >>> from jaxmp import fp8
      >>> float(fp8.compute_scale(jnp.float32(0.0), jnp.float32(3.0), fp8.E4M3))
      3.0
    """
    amax = jnp.asarray(amax, jnp.float32)
    old_scale = jnp.asarray(old_scale, jnp.float32)
    scale = jnp.float32(fp8_max(dtype) / 2.0 ** _margin(margin)) / amax
    usable = jnp.isfinite(amax) & (amax > 0) & jnp.isfinite(scale) & (scale > 0)
    return jnp.where(usable, scale, old_scale)


def amax(x: jax.Array) -> jax.Array:
    """The float32 absolute maximum of ``x``.

    Example:
      >>> import jax.numpy as jnp
      >>> from jaxmp import fp8
      >>> float(fp8.amax(jnp.array([1.0, -3.0])))
      3.0
    """
    return jnp.max(jnp.abs(x)).astype(jnp.float32)


def update_meta(meta: Fp8Meta, x: jax.Array, recipe: DelayedScaling, dtype: Any | None = None) -> Fp8Meta:
    """Records ``x``'s amax in the history and recomputes the scale from the reduced history.

    A non-finite amax (an overflowed step) is not recorded: history and scale stay as they were.

    Args:
      meta: the tensor's current state.
      x: the tensor (or its amax as a scalar).
      recipe: the delayed-scaling recipe (history length, reduction, margin).
      dtype: the fp8 format (default: the recipe's forward format).

    Returns:
      The new :class:`Fp8Meta`.

    Example:
      >>> import jax.numpy as jnp
      >>> from jaxmp import fp8
      >>> r = fp8.DelayedScaling(history_length=2)
      >>> float(fp8.update_meta(r.init_meta(), jnp.array([2.0]), r).scale)
      224.0
    """
    if not isinstance(recipe, DelayedScaling):
        raise TypeError(f"update_meta needs a DelayedScaling recipe, got {type(recipe).__name__}")
    if meta.amax_history.shape != (recipe.history_length,):
        raise ValueError(f"amax_history has shape {meta.amax_history.shape}, the recipe's history_length is "
                         f"{recipe.history_length}")
    new = amax(x)
    finite = jnp.isfinite(new)
    history = jnp.where(finite, jnp.roll(meta.amax_history, 1).at[0].set(new), meta.amax_history)
    ref = history[0] if recipe.reduction == "most_recent" else jnp.max(history)
    scale = compute_scale(ref, meta.scale, dtype or recipe.fwd_dtype, recipe.margin)
    return Fp8Meta(scale=jnp.where(finite, scale, meta.scale), amax_history=history)


def quantize(x: jax.Array, scale: jax.Array, dtype: Any) -> jax.Array:
    """``x * scale`` saturated to the format's range and cast to fp8; non-finite stays non-finite.

    Saturation applies to finite values only: an inf or NaN (an overflowed step) must reach the
    skip-on-overflow check, not be clipped into a plausible 448.

    Example:
      >>> import jax.numpy as jnp
      >>> from jaxmp import fp8
      >>> fp8.quantize(jnp.array([1000.0]), jnp.float32(1.0), fp8.E4M3).astype(jnp.float32)
      Array([448.], dtype=float32)
    """
    top = fp8_max(dtype)
    scaled = x.astype(jnp.float32) * scale
    return jnp.where(jnp.isfinite(scaled), jnp.clip(scaled, -top, top), scaled).astype(dtype)


def dequantize(q: jax.Array, scale: jax.Array, dtype: Any) -> jax.Array:
    """``q / scale`` in ``dtype``.

    Example:
      >>> import jax.numpy as jnp
      >>> from jaxmp import fp8
      >>> fp8.dequantize(fp8.quantize(jnp.array([3.0]), jnp.float32(2.0), fp8.E4M3), jnp.float32(2.0), jnp.float32)
      Array([3.], dtype=float32)
    """
    return (q.astype(jnp.float32) / scale).astype(dtype)


def qdq(x: jax.Array, dtype: Any, margin: float = 0.0, scale: jax.Array | None = None) -> jax.Array:
    """Quantize-dequantize ``x`` through ``dtype`` (current scaling unless ``scale`` is given).

    Example:
      >>> import jax.numpy as jnp
      >>> from jaxmp import fp8
      >>> fp8.qdq(jnp.array([1.0, 0.3]), fp8.E4M3).dtype
      dtype('float32')
    """
    if scale is None:
        scale = compute_scale(amax(x), jnp.float32(1.0), dtype, margin)
    return dequantize(quantize(x, scale, dtype), scale, x.dtype)


class Fp8Scales(NamedTuple):
    """The three delayed scales of one fp8 matmul or convolution (float32 scalars).

    Attributes:
      input: the scale of the activation (left operand, forward format).
      kernel: the scale of the weight (right operand, forward format).
      output_grad: the scale of the incoming gradient (backward format), in *unscaled* units:
        the op divides it by the loss scale of :func:`gradient_loss_scale`.
    """

    input: jax.Array
    kernel: jax.Array
    output_grad: jax.Array


_GRAD_LOSS_SCALE: contextvars.ContextVar = contextvars.ContextVar("jaxmp_fp8_gradient_loss_scale", default=None)


@contextlib.contextmanager
def gradient_loss_scale(loss_scale: Any):
    """Tells delayed-scaling fp8 ops traced inside that gradients carry ``loss_scale``.

    The gradient scale and the gradient amax a delayed-scaling op reports are kept in
    unscaled units, so a change of the loss scale never corrupts the E5M2 history: inside,
    each op quantizes the (scaled) cotangent with ``output_grad / loss_scale`` and, by the
    chain rule through that division, reports ``amax(cotangent) / loss_scale``. The train
    steps of :mod:`jaxmp.flax` enter it for you; call it yourself around the forward pass of a
    hand-written step that scales the loss.

    Args:
      loss_scale: the scalar the loss is multiplied by (a traced value is fine).

    Example:
      >>> import jax.numpy as jnp
      >>> from jaxmp import fp8
      >>> with fp8.gradient_loss_scale(jnp.float32(1024.0)):
      ...     pass
    """
    token = _GRAD_LOSS_SCALE.set(loss_scale)
    try:
        yield
    finally:
        _GRAD_LOSS_SCALE.reset(token)


def describe(recipe: CurrentScaling) -> str:
    """How :func:`jaxmp.precision_report` labels an op run under ``recipe``.

    Example:
      >>> from jaxmp import fp8
      >>> fp8.describe(fp8.DelayedScaling())
      'half list, fp8 (float8_e4m3fn forward, float8_e5m2 backward, delayed scaling)'
    """
    kind = "delayed" if isinstance(recipe, DelayedScaling) else "current"
    return f"half list, fp8 ({recipe.fwd_dtype} forward, {recipe.bwd_dtype} backward, {kind} scaling)"


def _check_operands(name: str, lhs: Any, rhs: Any) -> None:
    for side, x in (("lhs", lhs), ("rhs", rhs)):
        if not jnp.issubdtype(jnp.result_type(x), jnp.floating):
            raise TypeError(f"{name}: {side} must be floating, got {jnp.result_type(x)}")


def _recipe(recipe: Any, scales: Any, name: str) -> CurrentScaling:
    recipe = CurrentScaling() if recipe is None else recipe
    if not isinstance(recipe, CurrentScaling):
        raise TypeError(f"{name}: recipe must be a jaxmp.fp8.CurrentScaling or DelayedScaling, "
                        f"got {type(recipe).__name__}")
    delayed = isinstance(recipe, DelayedScaling)
    if delayed and scales is None:
        raise TypeError(f"{name}: delayed scaling needs scales=Fp8Scales(...) from the layer's fp8 state "
                        "(see fp8.init_layer_state); use CurrentScaling() for a stateless op")
    if not delayed and scales is not None:
        raise TypeError(f"{name}: scales are only used with a DelayedScaling recipe")
    return recipe


def _scaled_bilinear(op, lhs, rhs, recipe: CurrentScaling, scales: Fp8Scales | None):
    """``op(lhs, rhs)`` on fp8-rounded operands, with an fp8-rounded cotangent.

    ``op`` is linear in each operand (a dot or a convolution), so its VJP on the quantized
    operands is the gradient of the quantized forward pass. With delayed scaling the scales are
    inputs whose cotangents are the amaxes observed for them (``update_state`` records those).
    """
    fwd_dt, bwd_dt, margin = recipe.fwd_dtype, recipe.bwd_dtype, recipe.margin

    def q(x, dtype, scale):
        return qdq(x, dtype, margin) if scale is None else dequantize(quantize(x, scale, dtype), scale, x.dtype)

    if scales is None:
        def fwd(a, b):
            qa, qb = q(a, fwd_dt, None), q(b, fwd_dt, None)
            return op(qa, qb), (qa, qb)

        def bwd(res, g):
            qa, qb = res
            return jax.vjp(op, qa, qb)[1](q(g, bwd_dt, None))

        f = jax.custom_vjp(lambda a, b: fwd(a, b)[0])
        f.defvjp(fwd, bwd)
        return f(lhs, rhs)

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


def fp8_dot_general(lhs: jax.Array, rhs: jax.Array, dimension_numbers, recipe: CurrentScaling | None = None,
                    preferred_element_type: Any = None, *, scales: Fp8Scales | None = None,
                    precision: Any = None) -> jax.Array:
    """``lax.dot_general`` with fp8 operands (E4M3) and an fp8 cotangent (E5M2).

    Current scaling: each operand is quantized with the scale of its own amax; in the backward
    pass the incoming cotangent is quantized to the gradient format the same way (so a loss
    scale cancels out), then the gradients are the dot's transposes on the quantized values.
    Delayed scaling: the scales come from ``scales`` (the layer's state, see
    :func:`init_layer_state`) and the amaxes seen this step come back as their gradients.

    Args:
      lhs: left operand (floating), as for ``jax.lax.dot_general``.
      rhs: right operand (floating).
      dimension_numbers: as for ``jax.lax.dot_general``.
      recipe: a :class:`CurrentScaling` (default) or :class:`DelayedScaling`.
      preferred_element_type: the output dtype, as for ``jax.lax.dot_general``.
      scales: the :class:`Fp8Scales` of a delayed recipe (None for current scaling).
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

    def dot(a, b):
        return jax.lax.dot_general(a, b, dimension_numbers, precision=precision,
                                   preferred_element_type=preferred_element_type)

    return _scaled_bilinear(dot, lhs, rhs, recipe, scales)


def fp8_conv_general_dilated(lhs: jax.Array, rhs: jax.Array, window_strides, padding, lhs_dilation=None,
                             rhs_dilation=None, dimension_numbers=None, feature_group_count: int = 1,
                             batch_group_count: int = 1, precision: Any = None,
                             preferred_element_type: Any = None, *, recipe: CurrentScaling | None = None,
                             scales: Fp8Scales | None = None) -> jax.Array:
    """``lax.conv_general_dilated`` with fp8 operands and cotangent, like :func:`fp8_dot_general`.

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
      recipe: a :class:`CurrentScaling` (default) or :class:`DelayedScaling`.
      scales: the :class:`Fp8Scales` of a delayed recipe.

    Returns:
      The convolution of the fp8-rounded operands.

    Example:
      >>> import jax.numpy as jnp
      >>> from jaxmp import fp8
      >>> fp8.fp8_conv_general_dilated(jnp.ones((1, 1, 4)), jnp.ones((1, 1, 2)), (1,), "VALID").tolist()
      [[[2.0, 2.0, 2.0]]]
    """
    recipe = _recipe(recipe, scales, "fp8_conv_general_dilated")
    _check_operands("fp8_conv_general_dilated", lhs, rhs)

    def conv(a, b):
        return jax.lax.conv_general_dilated(a, b, window_strides, padding, lhs_dilation, rhs_dilation,
                                            dimension_numbers, feature_group_count, batch_group_count,
                                            precision=precision, preferred_element_type=preferred_element_type)

    return _scaled_bilinear(conv, lhs, rhs, recipe, scales)


# -- the per-layer delayed-scaling state, as variables ----------------------------------------

#: The tensors of one fp8 layer with a delayed scale each, and the format each is cast to.
LAYER_TENSORS = ("input", "kernel", "output_grad")
#: Name of the Linen variable collection (and model-state key) of the delayed-scaling state.
FP8_COLLECTION = "fp8_meta"


def init_layer_state(recipe: DelayedScaling) -> dict[str, jax.Array]:
    """The delayed-scaling state of one fp8 layer: a scale and an amax history per tensor.

    Keys follow ``flax.linen.fp8_ops``: ``input_scale``, ``input_amax_history``,
    ``kernel_scale``, ``kernel_amax_history``, ``output_grad_scale``,
    ``output_grad_amax_history``. It is state, not a parameter: never give it to an optimizer.

    Args:
      recipe: the :class:`DelayedScaling` recipe (its history length).

    Returns:
      ``{name: float32 array}``: scales 1, histories zero.

    Example:
      >>> from jaxmp import fp8
      >>> sorted(fp8.init_layer_state(fp8.DelayedScaling(history_length=4)))[:2]
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
    """The :class:`Fp8Scales` of one layer's state (from :func:`init_layer_state`).

    Example:
      >>> from jaxmp import fp8
      >>> float(fp8.layer_scales(fp8.init_layer_state(fp8.DelayedScaling())).kernel)
      1.0
    """
    return Fp8Scales(*(layer_state[f"{name}_scale"] for name in LAYER_TENSORS))


def _is_layer_state(node: Any) -> bool:
    return isinstance(node, Mapping) and all(f"{n}_scale" in node and f"{n}_amax_history" in node
                                             for n in LAYER_TENSORS)


def _update_layer(layer: Mapping, seen: Mapping, recipe: DelayedScaling) -> dict:
    out = dict(layer)
    for name in LAYER_TENSORS:
        dtype = recipe.bwd_dtype if name == "output_grad" else recipe.fwd_dtype
        meta = update_meta(Fp8Meta(layer[f"{name}_scale"], layer[f"{name}_amax_history"]),
                           seen[f"{name}_scale"], recipe, dtype)
        out[f"{name}_scale"], out[f"{name}_amax_history"] = meta.scale, meta.amax_history
    return out


def update_state(state: Any, observed: Any, recipe: DelayedScaling, axis_name: Any = None) -> Any:
    """Records one step's amaxes in every layer's history and recomputes the scales.

    ``observed`` is the gradient of the loss with respect to ``state``: a delayed-scaling op
    reports the amax it saw for each tensor as the gradient of that tensor's scale (the
    gradient amax in unscaled units, see :func:`gradient_loss_scale`). A layer called twice in
    a step reports the sum of its amaxes: a scale that errs towards headroom, never overflow.

    Args:
      state: a pytree holding layer states (:func:`init_layer_state` dicts, at any depth).
      observed: the same structure, from differentiating with respect to ``state``.
      recipe: the :class:`DelayedScaling` recipe.
      axis_name: a bound ``pmap``/``shard_map`` axis: the amaxes are maxed over it first, so
        every replica keeps the same scales. (Under sharded ``jit`` they are global already.)

    Returns:
      The new state; non-finite amaxes (an overflowed step) leave their tensor unchanged.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from jaxmp import fp8
      >>> recipe = fp8.DelayedScaling(history_length=4)
      >>> state = {"dense": fp8.init_layer_state(recipe)}
      >>> seen = jax.tree.map(lambda a: jnp.full_like(a, 2.0), state)
      >>> float(fp8.update_state(state, seen, recipe)["dense"]["input_scale"])
      224.0
    """
    if not isinstance(recipe, DelayedScaling):
        raise TypeError(f"update_state needs a DelayedScaling recipe, got {type(recipe).__name__}")
    if axis_name is not None:
        observed = jax.lax.pmax(observed, axis_name)

    def walk(node, seen):
        if _is_layer_state(node):
            return _update_layer(node, seen, recipe)
        if isinstance(node, Mapping):
            return {k: walk(v, seen[k]) for k, v in node.items()}
        return node

    return walk(state, observed)


def native_fp8(device: Any = None) -> tuple[bool, str]:
    """Whether ``device`` has fp8 Tensor Cores, and why (compute capability >= 8.9 on NVIDIA).

    Elsewhere (CPU, TPU, older GPUs) :func:`fp8_dot_general` still runs, emulated: fp8 rounding
    and scaling, the matmul in the operands' dtype.

    Args:
      device: a ``jax.Device`` (default: the first device).

    Returns:
      ``(available, reason)``.

    Example:
      >>> import jax
      >>> from jaxmp import fp8
      >>> fp8.native_fp8(jax.devices("cpu")[0])
      (False, 'cpu has no fp8 Tensor Cores: fp8 is emulated (fp8 rounding, matmul in the operand dtype)')
    """
    device = jax.devices()[0] if device is None else device
    emulated = "fp8 is emulated (fp8 rounding, matmul in the operand dtype)"
    if device.platform != "gpu":
        return False, f"{device.platform} has no fp8 Tensor Cores: {emulated}"
    cc = getattr(device, "compute_capability", None)
    try:
        major, minor = (int(p) for p in str(cc).split(".")[:2])
    except ValueError:
        return False, f"{device.device_kind}: compute capability unknown ({cc!r}): {emulated}"
    if (major, minor) < (8, 9):
        return False, f"{device.device_kind} (compute capability {cc}) needs >= 8.9 for fp8 Tensor Cores: {emulated}"
    return True, f"{device.device_kind} (compute capability {cc}) has fp8 Tensor Cores"


def check_hardware(recipe: CurrentScaling, device: Any = None) -> str:
    """Whether ``recipe`` runs natively or emulated on ``device``; a clear error if neither is allowed.

    ``recipe.emulate`` None (default): native on fp8 Tensor Cores (NVIDIA compute capability
    >= 8.9), emulated on CPU (so everything can be tested there), a ``ValueError`` on other
    accelerators (older GPUs, TPU), where the emulation is slower than bf16 and is opt-in
    (``emulate=True``). ``emulate=False`` requires fp8 Tensor Cores.

    Args:
      recipe: a :class:`CurrentScaling` or :class:`DelayedScaling`.
      device: a ``jax.Device`` (default: the first device).

    Returns:
      ``"native"`` or ``"emulated"``.

    Raises:
      TypeError: ``recipe`` is not an fp8 recipe.
      ValueError: the hardware cannot run it the way ``recipe.emulate`` asks.

    Example:
      >>> import jax
      >>> from jaxmp import fp8
      >>> fp8.check_hardware(fp8.DelayedScaling(), jax.devices("cpu")[0])
      'emulated'
    """
    if not isinstance(recipe, CurrentScaling):
        raise TypeError(f"expected a jaxmp.fp8 recipe (CurrentScaling or DelayedScaling), got {type(recipe).__name__}")
    device = jax.devices()[0] if device is None else device
    native, reason = native_fp8(device)
    if native:
        return "emulated" if recipe.emulate else "native"
    if recipe.emulate is False:
        raise ValueError(f"fp8 with emulate=False needs fp8 Tensor Cores: {reason}")
    if recipe.emulate is None and device.platform != "cpu":
        raise ValueError(f"fp8 is not supported natively here: {reason}. The emulation is slower than bf16 on "
                         "this hardware; opt in with emulate=True (e.g. fp8.DelayedScaling(emulate=True)) "
                         "to test fp8 numerics, or use a bf16 policy")
    return "emulated"
