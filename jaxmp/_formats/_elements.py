"""The two fp8 formats and their ranges: E4M3 (forward operands, +-448) and E5M2 (gradients,
+-57344), with the validation every other fp8 module uses."""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np

E4M3 = jnp.dtype(jnp.float8_e4m3fn)
"""``float8_e4m3fn``: the format of forward operands (largest finite value 448)."""
E5M2 = jnp.dtype(jnp.float8_e5m2)
"""``float8_e5m2``: the format of gradients (largest finite value 57344)."""
FP8_DTYPES = (E4M3, E5M2)
"""The two fp8 formats a recipe may name."""


def fp8_dtype(value: Any, what: str) -> np.dtype:
    """``value`` as an fp8 dtype, or a ``TypeError``/``ValueError`` naming ``what``.

    Args:
      value: a dtype or dtype name.
      what: the argument's name, for the message.

    Returns:
      ``E4M3`` or ``E5M2``.
    """
    try:
        dtype = jnp.dtype(value)
    except TypeError as e:
        raise TypeError(f"{what} must be an fp8 dtype (float8_e4m3fn or float8_e5m2), got {value!r}") from e
    if dtype not in FP8_DTYPES:
        raise ValueError(f"{what} must be an fp8 dtype (float8_e4m3fn or float8_e5m2), got {dtype}")
    return dtype


def check_margin(margin: Any) -> float:
    """``margin`` (headroom in powers of two) as a float, or a ``ValueError``.

    Args:
      margin: a finite number >= 0.

    Returns:
      ``float(margin)``.
    """
    # numpy scalars count (a margin computed with numpy is a np.float32, not a float); bools do not.
    if isinstance(margin, (bool, np.bool_)) or not isinstance(margin, (int, float, np.integer, np.floating)) \
            or not np.isfinite(margin) or margin < 0:
        raise ValueError(f"margin must be a finite number >= 0 (powers of two of headroom), got {margin!r}")
    return float(margin)


def fp8_max(dtype: Any) -> float:
    """The largest finite value of an fp8 format.

    Args:
      dtype: ``float8_e4m3fn`` or ``float8_e5m2``.

    Returns:
      448.0 for E4M3, 57344.0 for E5M2.

    Example:
      >>> from jaxmp import fp8
      >>> fp8._formats.fp8_max(fp8._formats.E5M2)
      57344.0
    """
    return float(jnp.finfo(fp8_dtype(dtype, "dtype")).max)
