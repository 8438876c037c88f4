"""Dtype names and parsing, and casting that touches floating leaves only.

The bottom of the package: everything else that reads a dtype name or casts a
pytree goes through here. Names follow jmp's grammar (``f32``, ``full``, ``bf16``,
``half`` ...); `float_dtype` is the one parser for user-given dtypes.
"""

from __future__ import annotations

from typing import Any, TypeVar

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import DTypeLike

T = TypeVar("T")

_FLOAT_NAMES: dict[str, Any] = {
    "bf16": jnp.bfloat16,
    "bfloat16": jnp.bfloat16,
    "f16": jnp.float16,
    "fp16": jnp.float16,
    "float16": jnp.float16,
    "full": jnp.float32,
    "f32": jnp.float32,
    "fp32": jnp.float32,
    "float32": jnp.float32,
    "f64": jnp.float64,
    "float64": jnp.float64,
}

#: Short names used by ``str(policy)`` (jmp's).
SHORT_NAME = {
    np.dtype(jnp.bfloat16): "bf16",
    np.dtype(jnp.float16): "f16",
    np.dtype(jnp.float32): "f32",
    np.dtype(jnp.float64): "f64",
}


def dtype_names() -> list[str]:
    """The dtype names `jaxmp._dtypes.parse_dtype` accepts.

    Returns:
      A sorted list of names.
    """
    return sorted(set(_FLOAT_NAMES) | {"half"})


def half_dtype() -> np.dtype:
    """Returns the half-precision dtype jmp picks for the current backend.

    bfloat16 on TPU, float16 elsewhere (jmp's semantics; [`jaxmp.recommended_policy`][jaxmp.recommended_policy]
    is the hardware-aware choice).

    Returns:
      ``jnp.bfloat16`` or ``jnp.float16`` as a numpy dtype.

    Example:
      >>> import jax, jaxmp
      >>> jaxmp.half_dtype() == ("bfloat16" if jax.default_backend() == "tpu" else "float16")
      True
    """
    on_tpu = jax.local_devices()[0].platform == "tpu"
    return np.dtype(jnp.bfloat16 if on_tpu else jnp.float16)


def parse_dtype(value: str) -> np.dtype:
    """Parses a dtype name of jmp's grammar (``f32``, ``full``, ``bf16``, ``half`` ...).

    Args:
      value: the name.

    Returns:
      The numpy dtype.

    Raises:
      TypeError: ``value`` is not a string.
      ValueError: the name is unknown.

    Example:
      >>> import jaxmp
      >>> jaxmp._dtypes.parse_dtype("bf16")
      dtype(bfloat16)
    """
    if not isinstance(value, str):
        raise TypeError(f"dtype name must be a string, got {type(value).__name__}: {value!r}")
    name = value.strip().lower()
    if name == "half":
        return half_dtype()
    if name not in _FLOAT_NAMES:
        raise ValueError(f"Unknown dtype name {value!r}: expected one of {dtype_names()}.")
    return np.dtype(_FLOAT_NAMES[name])


def float_dtype(dtype: DTypeLike, what: str = "dtype") -> np.dtype:
    """Returns a user-given dtype as a numpy floating dtype, or raises naming ``what``.

    Args:
      dtype: a dtype-like (``jnp.float16``, ``"bfloat16"``, ``np.dtype``) or a jmp-grammar name.
      what: how the error message calls this value (e.g. ``"compute_dtype"``).

    Returns:
      The numpy dtype.

    Raises:
      TypeError: ``dtype`` is not a floating dtype (``None`` included).
    """
    if isinstance(dtype, str) and dtype.strip().lower() in {*_FLOAT_NAMES, "half"}:
        return parse_dtype(dtype)
    if dtype is None:  # np.dtype(None) is float64: never what a missing dtype meant
        raise TypeError(f"{what} must be a floating dtype (float16/bfloat16/float32/float64), got None: "
                        f"pass one, e.g. jnp.float32 or a name from {dtype_names()}")
    try:
        dt = np.dtype(dtype)
    except TypeError as e:
        hint = f" (names: {dtype_names()})" if isinstance(dtype, str) else ""
        raise TypeError(f"{what} must be a floating dtype, got {dtype!r}{hint}") from e
    if not jnp.issubdtype(dt, jnp.floating):
        raise TypeError(f"{what} must be a floating dtype (float16/bfloat16/float32/float64), got {dt}")
    return dt


def accumulation_dtype(dtype: DTypeLike) -> np.dtype:
    """The dtype to sum or average values of ``dtype`` in: at least float32 (no implicit promotion).

    Args:
      dtype: a floating dtype-like.

    Returns:
      The numpy dtype to accumulate in.
    """
    dt = np.dtype(dtype)
    return dt if dt.itemsize >= 4 else np.dtype(np.float32)


#: The earlier name of `float_dtype`.
canonical_float_dtype = float_dtype


def _array_dtype(x: Any):
    if not isinstance(x, (np.ndarray, jax.Array, np.generic)):
        return None
    dtype = getattr(x, "dtype", None)
    if dtype is None or jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
        return None
    return dtype


def is_floating_array(x: Any) -> bool:
    """True for numpy/JAX arrays (and tracers) whose dtype is floating.

    PRNG key arrays, float0 tangents, ints, bools, complex and non-array leaves are not.

    Args:
      x: any pytree leaf.

    Returns:
      Whether casting policies should touch the leaf.
    """
    dtype = _array_dtype(x)
    return dtype is not None and jnp.issubdtype(dtype, jnp.floating)


def is_inexact_array(x: Any) -> bool:
    """True for floating and complex arrays: the leaves loss scaling unscales and checks.

    Args:
      x: any pytree leaf.

    Returns:
      Whether the leaf carries a (possibly scaled) real or complex value.
    """
    dtype = _array_dtype(x)
    return dtype is not None and jnp.issubdtype(dtype, jnp.inexact)


def cast_floating(tree: T, dtype: DTypeLike) -> T:
    """Casts the floating array leaves of ``tree`` to ``dtype``; other leaves pass through.

    Args:
      tree: any pytree.
      dtype: the target floating dtype.

    Returns:
      A tree of the same structure.

    Example:
      >>> import jax.numpy as jnp, jaxmp
      >>> tree = {"w": jnp.ones(2), "step": jnp.int32(3)}
      >>> jaxmp.cast_floating(tree, jnp.float16)["w"].dtype
      dtype('float16')
    """
    dtype = float_dtype(dtype)

    def cast(x):
        return x.astype(dtype) if is_floating_array(x) and x.dtype != dtype else x

    return jax.tree_util.tree_map(cast, tree)


def cast_to_full(tree: T) -> T:
    """Casts floating leaves to float32 (jmp's ``cast_to_full``).

    Args:
      tree: any pytree.

    Returns:
      The tree with floating leaves in float32, other leaves unchanged.

    Example:
      >>> import jax.numpy as jnp, jaxmp
      >>> jaxmp.cast_to_full(jnp.ones(2, jnp.float16)).dtype
      dtype('float32')
    """
    return cast_floating(tree, jnp.float32)


def cast_to_half(tree: T) -> T:
    """Casts floating leaves to [`half_dtype`][jaxmp.half_dtype] (jmp's ``cast_to_half``).

    Args:
      tree: any pytree.

    Returns:
      The tree with floating leaves in the half dtype, other leaves unchanged.

    Example:
      >>> import jax.numpy as jnp, jaxmp
      >>> jaxmp.cast_to_half(jnp.ones(2)).dtype == jaxmp.half_dtype()
      True
    """
    return cast_floating(tree, half_dtype())


def float32_backward(fn):
    """``fn`` as traced on the way forward, differentiated on float32 copies of its inputs.

    For kernels that feed half operands to a matmul with a float32 result (attention logits): their
    transpose mixes dtypes, which strict promotion refuses. Pass every array ``fn`` uses as an
    argument; a closure over a traced array would leak a tracer into the backward pass.
    See docs/design.md#float32-backward.

    Args:
      fn: a function of arrays (floating arrays are differentiated; ``None`` is allowed).

    Returns:
      The wrapped function (same signature, positional arguments only).
    """

    @jax.custom_vjp
    def wrapped(*xs):
        return fn(*xs)

    def fwd(*xs):
        return fn(*xs), xs

    def bwd(xs, ct):
        wide = [x.astype(jnp.float32) if is_floating_array(x) else x for x in xs]
        _, vjp = jax.vjp(fn, *wide)
        grads = vjp(cast_floating(ct, jnp.float32) if ct is not None else ct)
        return tuple(g.astype(x.dtype) if is_floating_array(x) and g is not None else g for g, x in zip(grads, xs))

    wrapped.defvjp(fwd, bwd)
    return wrapped
