"""Test helper: the primitives of a traced function with their dtypes and name scopes.

A jaxpr walk is the ground truth for "which precision did this matmul / softmax / norm
run in": it sees every primitive, including those inside ``custom_jvp`` (softmax),
``pjit`` and control flow, whatever the Python code that emitted it.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import numpy as np

from jaxmp import _jaxpr


class Op(NamedTuple):
    """One primitive application: its name, name scope, input and output dtypes."""

    primitive: str
    scope: str
    in_dtypes: tuple[np.dtype, ...]
    out_dtypes: tuple[np.dtype, ...]


def _dtype(dtype):
    try:
        return np.dtype(dtype)
    except TypeError:  # PRNG keys
        return dtype


def _dtypes(avals) -> tuple:
    return tuple(_dtype(a.dtype) for a in avals if hasattr(a, "dtype"))


def op_dtypes(fn: Callable, *args: Any, **kwargs: Any) -> list[Op]:
    """Traces ``fn(*args, **kwargs)`` and returns every primitive (recursively) with dtypes.

    Args:
      fn: any JAX-traceable function.
      *args: its arguments.
      **kwargs: its keyword arguments.

    Returns:
      A list of :class:`Op` in program order.

    Example:
      >>> [op.primitive for op in op_dtypes(jnp.sin, jnp.ones(2))]
      ['sin']
    """
    return ops_of(jax.make_jaxpr(lambda *a: fn(*a, **kwargs))(*args))


def ops_of(closed: Any) -> list[Op]:
    """Every primitive of an already traced ``ClosedJaxpr`` (recursively), as `op_dtypes` gives them."""
    # scope: the name stack as JAX prints it (display: tests look for a module name in it).
    return [Op(e.primitive, e.name, _dtypes(e.in_avals), _dtypes(e.out_avals)) for e in _jaxpr.walk(closed)]


# ---------------------------------------------------------------------------------------------
# Assertions shared by the Linen and NNX tests.

F32 = np.dtype(np.float32)
MATMULS = ("dot_general", "conv_general_dilated")


def float_dtypes(op: Op) -> list[np.dtype]:
    """The floating dtypes among an op's inputs and outputs."""
    return [d for d in op.in_dtypes + op.out_dtypes if jax.numpy.issubdtype(d, jax.numpy.floating)]


def assert_matmuls_in(ops: list[Op], dtype) -> None:
    """Every matmul and convolution traced takes two ``dtype`` operands (and there is one)."""
    mm = [op for op in ops if op.primitive in MATMULS]
    assert mm, "no matmul or convolution traced"
    for op in mm:
        assert op.in_dtypes == (dtype, dtype), op


def assert_scope_fp32(ops: list[Op], name: str) -> None:
    """Every primitive under a module named ``name`` runs in float32, bar the cast in and out."""
    inside = [op for op in ops if name in op.scope and op.primitive != "convert_element_type"]
    assert inside, f"nothing traced under {name}"
    for op in inside:
        assert all(d == F32 for d in float_dtypes(op)), op
