"""The values the engine computes with: `Val` (an array and the bits the promotion rule
reads) and the dtype helpers the interpreter and the control-flow handlers share.

Below both `jaxmp.engine._interpreter` and `jaxmp.engine._control_flow`, so that the
interpreter can dispatch to the control-flow handlers and they can build values without the
two modules importing each other.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

F32 = np.dtype("float32")


class Val(NamedTuple):
    """An interpreted value: the array, whether it is a float32-list result, whether weak-typed,
    whether it is computed from constants only."""

    x: Any
    strong: bool = False
    weak: bool = False
    const: bool = False


def is_float(dtype: Any) -> bool:
    """Real floating (never complex, PRNG key or float0): the only dtypes the engine casts."""
    if dtype is None:  # no dtype (a token's aval, a non-array): numpy would read None as float64
        return False
    try:
        return _is_float(dtype)
    except TypeError:  # not a dtype (or an unhashable stand-in): not one the engine casts
        return False


# A memo of a pure function of a dtype (the engine asks it several times per equation); a
# TypeError (unhashable, or not a dtype) reaches is_float uncached.
@functools.lru_cache(maxsize=256)
def _is_float(dtype: Any) -> bool:
    return bool(jnp.issubdtype(dtype, jnp.floating))


def is_complex(dtype: Any) -> bool:
    """Complex floating (complex64, complex128): ops on these run as traced."""
    try:
        return _is_complex(dtype)
    except TypeError:  # not a dtype (None, an unhashable stand-in)
        return False


@functools.lru_cache(maxsize=256)
def _is_complex(dtype: Any) -> bool:
    return dtype is not None and bool(jnp.issubdtype(dtype, jnp.complexfloating))


def dtype_of(x: Any) -> Any:
    """The dtype of an array, tracer or Python scalar (extended dtypes such as PRNG keys as they are)."""
    if hasattr(x, "dtype"):
        dtype = x.dtype
        return dtype if isinstance(dtype, np.dtype) else np_dtype(dtype)
    return np.asarray(x).dtype


def np_dtype(dtype: Any) -> Any:
    """``np.dtype(dtype)``, or ``dtype`` itself for extended dtypes (PRNG keys) numpy cannot name."""
    try:
        return np.dtype(dtype)
    except TypeError:  # PRNG key and other extended dtypes
        return dtype


def saturate(x: Any, dtype: np.dtype) -> Any:
    """``x`` narrowed to ``dtype`` with finite values clipped to its finite range (inf, NaN kept)."""
    hi = float(jnp.finfo(dtype).max)
    if isinstance(x, (np.ndarray, np.generic, int, float)):
        a = np.asarray(x)
        return np.where(np.isfinite(a), np.clip(a, -hi, hi), a).astype(dtype)
    clipped = jnp.clip(x, -hi, hi)
    return jax.lax.convert_element_type(jnp.where(jnp.isfinite(x), clipped, x), dtype)


def lost_in(x: Any, dtype: np.dtype) -> bool:
    """Whether narrowing the concrete constant ``x`` to ``dtype`` loses it: a finite value beyond
    the type's range, or a nonzero one below its smallest normal (zero or a few-bit subnormal).

    Only small concrete constants are read (literals, closed-over numpy or jax arrays); anything
    else (a tracer, a large array) answers False: it is narrowed as data is.
    """
    if isinstance(x, (float, np.floating)) and not isinstance(x, np.ndarray):  # a literal: the common case
        if np.dtype(getattr(x, "dtype", np.float64)).itemsize <= np.dtype(dtype).itemsize:
            return False
        hi, tiny = _range(np.dtype(dtype))
        mag = abs(float(x))
        return mag != float("inf") and (mag > hi or 0 < mag < tiny)
    if isinstance(x, jax.Array) and not isinstance(x, np.ndarray) and x.size <= _READ_LIMIT:
        if not is_float(x.dtype):  # an int, bool or PRNG key constant (a key has no numpy view)
            return False
        try:  # a concrete closed-over jax.Array (jnp.float32(1e-8)); a tracer has no value to read
            x = np.asarray(x)
        except (jax.errors.ConcretizationTypeError, jax.errors.TracerArrayConversionError):
            return False
    if not isinstance(x, np.ndarray) or x.size > _READ_LIMIT:
        return False
    if not is_float(x.dtype) or x.dtype.itemsize <= np.dtype(dtype).itemsize:
        return False
    hi, tiny = _range(np.dtype(dtype))
    mag = np.abs(x[np.isfinite(x)].astype(np.float64))
    return bool(np.any(mag > hi) or np.any((mag > 0) & (mag < tiny)))


@functools.lru_cache(maxsize=16)
def _range(dtype: np.dtype) -> tuple[float, float]:
    info = jnp.finfo(dtype)
    return float(info.max), float(info.tiny)


#: Constants up to this many elements are read at trace time (`lost_in`).
_READ_LIMIT = 64


def widest(dtypes: Sequence[np.dtype]) -> np.dtype:
    """The widest floating dtype; two different half dtypes promote to float32."""
    wide = max(dtypes, key=lambda d: d.itemsize)
    if wide.itemsize < 4 and len(set(dtypes)) > 1:
        return F32
    return wide
