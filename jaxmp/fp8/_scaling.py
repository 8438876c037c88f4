"""The arithmetic of a scale: amaxes, the scale an amax gives, quantize / dequantize, and the
delayed-scaling update of one tensor's history (`jaxmp.fp8._scaling.update_meta`)."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from jaxmp._formats import fp8_max
from jaxmp.fp8._recipes import DelayedScaling, Fp8Meta, check_margin


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
      >>> import jaxmp
      >>> from jaxmp import fp8
      >>> amax, old_scale = jnp.float32(0.0), jnp.float32(3.0)
      >>> float(fp8._scaling.compute_scale(amax, old_scale, jaxmp._formats.E4M3))
      3.0
    """
    amax = jnp.asarray(amax, jnp.float32)
    old_scale = jnp.asarray(old_scale, jnp.float32)
    scale = jnp.float32(fp8_max(dtype) / 2.0 ** check_margin(margin)) / amax
    usable = jnp.isfinite(amax) & (amax > 0) & jnp.isfinite(scale) & (scale > 0)
    return jnp.where(usable, scale, old_scale)


def amax(x: jax.Array) -> jax.Array:
    """The float32 absolute maximum of ``x``.

    Example:
      >>> import jax.numpy as jnp
      >>> from jaxmp import fp8
      >>> float(fp8._scaling.amax(jnp.array([1.0, -3.0])))
      3.0
    """
    # initial=0: an empty tensor's amax is 0 (scale 1), not a reduction error.
    return jnp.max(jnp.abs(x), initial=0).astype(jnp.float32)


def update_meta(meta: Fp8Meta, x: jax.Array, recipe: DelayedScaling, dtype: Any | None = None) -> Fp8Meta:
    """Records ``x``'s amax in the history and recomputes the scale from the reduced history.

    A non-finite amax (an overflowed step) is not recorded: history and scale stay as they were.

    Args:
      meta: the tensor's current state.
      x: the tensor (or its amax as a scalar).
      recipe: the delayed-scaling recipe (history length, reduction, margin).
      dtype: the fp8 format (default: the recipe's forward format).

    Returns:
      The new [`Fp8Meta`][jaxmp.fp8.Fp8Meta].

    Example:
      >>> import jax.numpy as jnp
      >>> from jaxmp import fp8
      >>> r = fp8.DelayedScaling(history_length=2)
      >>> float(fp8._scaling.update_meta(r.init_meta(), jnp.array([2.0]), r).scale)
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
      >>> import jaxmp
      >>> from jaxmp import fp8
      >>> E4M3 = jaxmp._formats.E4M3
      >>> q = fp8._scaling.quantize(jnp.array([1000.0]), jnp.float32(1.0), E4M3)
      >>> q.astype(jnp.float32)
      Array([448.], dtype=float32)
    """
    top = fp8_max(dtype)
    scaled = x.astype(jnp.float32) * scale
    return jnp.where(jnp.isfinite(scaled), jnp.clip(scaled, -top, top), scaled).astype(dtype)


def dequantize(q: jax.Array, scale: jax.Array, dtype: Any) -> jax.Array:
    """``q / scale`` in ``dtype``.

    Example:
      >>> import jax.numpy as jnp
      >>> import jaxmp
      >>> from jaxmp import fp8
      >>> q = fp8._scaling.quantize(jnp.array([3.0]), jnp.float32(2.0), jaxmp._formats.E4M3)
      >>> fp8._scaling.dequantize(q, jnp.float32(2.0), jnp.float32)
      Array([3.], dtype=float32)
    """
    return (q.astype(jnp.float32) / scale).astype(dtype)


def qdq(x: jax.Array, dtype: Any, margin: float = 0.0, scale: jax.Array | None = None) -> jax.Array:
    """Quantize-dequantize ``x`` through ``dtype`` (current scaling unless ``scale`` is given).

    Example:
      >>> import jax.numpy as jnp
      >>> import jaxmp
      >>> from jaxmp import fp8
      >>> fp8._scaling.qdq(jnp.array([1.0, 0.3]), jaxmp._formats.E4M3).dtype
      dtype('float32')
    """
    if scale is None:
        scale = compute_scale(amax(x), jnp.float32(1.0), dtype, margin)
    return dequantize(quantize(x, scale, dtype), scale, x.dtype)
