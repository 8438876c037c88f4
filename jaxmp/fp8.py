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

import dataclasses
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

    Example:
      >>> from jaxmp import fp8
      >>> fp8.CurrentScaling().fwd_dtype
      dtype(float8_e4m3fn)
    """

    margin: float = 0.0
    fwd_dtype: Any = E4M3
    bwd_dtype: Any = E5M2

    def __post_init__(self):
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


def fp8_dot_general(lhs: jax.Array, rhs: jax.Array, dimension_numbers, recipe: CurrentScaling | None = None,
                    preferred_element_type: Any = None) -> jax.Array:
    """``lax.dot_general`` with fp8 operands (E4M3) and an fp8 cotangent (E5M2), current scaling.

    Each operand is quantized with the scale of its own amax; in the backward pass the incoming
    cotangent is quantized to the gradient format the same way (so a loss scale cancels out), then
    the gradients are the dot's transposes on the quantized values.

    Args:
      lhs: left operand (floating), as for ``jax.lax.dot_general``.
      rhs: right operand (floating).
      dimension_numbers: as for ``jax.lax.dot_general``.
      recipe: a :class:`CurrentScaling` (default ``CurrentScaling()``). Delayed scaling keeps
        state across steps, which this stateless function cannot: see :func:`update_meta`.
      preferred_element_type: the output dtype, as for ``jax.lax.dot_general``.

    Returns:
      The product in ``preferred_element_type`` (default: the operands' promoted dtype).

    Example:
      >>> import jax.numpy as jnp
      >>> from jaxmp import fp8
      >>> x = jnp.ones((2, 3)); w = jnp.full((3, 4), 0.5)
      >>> fp8.fp8_dot_general(x, w, (((1,), (0,)), ((), ()))).tolist()[0]
      [1.5, 1.5, 1.5, 1.5]
    """
    recipe = CurrentScaling() if recipe is None else recipe
    if isinstance(recipe, DelayedScaling) or not isinstance(recipe, CurrentScaling):
        raise TypeError(f"fp8_dot_general takes a CurrentScaling recipe, got {type(recipe).__name__}")
    for name, x in (("lhs", lhs), ("rhs", rhs)):
        if not jnp.issubdtype(jnp.result_type(x), jnp.floating):
            raise TypeError(f"fp8_dot_general: {name} must be floating, got {jnp.result_type(x)}")

    def dot(a, b):
        return jax.lax.dot_general(a, b, dimension_numbers, preferred_element_type=preferred_element_type)

    def fwd(a, b):
        qa, qb = qdq(a, recipe.fwd_dtype, recipe.margin), qdq(b, recipe.fwd_dtype, recipe.margin)
        return dot(qa, qb), (qa, qb)

    def bwd(res, g):
        qa, qb = res
        _, vjp = jax.vjp(dot, qa, qb)
        return vjp(qdq(g, recipe.bwd_dtype, recipe.margin))

    f = jax.custom_vjp(lambda a, b: fwd(a, b)[0])
    f.defvjp(fwd, bwd)
    return f(lhs, rhs)


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
