"""The element formats jaxmp stores numbers in, as one table: E4M3, E5M2, E2M1 and E8M0.

Each row says what a format is (dtype, largest finite value, the exponents of that value and of
the smallest normal, mantissa bits) and which roles it plays: an fp8 recipe's per-tensor operand
(E4M3 forward, E5M2 gradients), a block-scaled element (E4M3, E5M2, E2M1) or a block scale (E8M0,
and E4M3 for NVFP4). The recipes' checks, the quantizers and the error messages read it, so a new
format is one row here (tests/formats/test_elements.py holds every row to ``jnp.finfo``). Lean's
8-bit and 4-bit moments store map indices, not an element format: their maps are
`jaxmp._formats._code_maps.CODE_MAPS`.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax.numpy as jnp
import numpy as np

FP8_TENSOR = "fp8 tensor"
"""Role: an operand of a per-tensor fp8 recipe (`jaxmp.fp8.DelayedScaling`, ``CurrentScaling``)."""
BLOCK_ELEMENT = "block element"
"""Role: the elements of a block-scaled recipe (MXFP8, NVFP4 ...)."""
BLOCK_SCALE = "block scale"
"""Role: the per-block scales of a block-scaled recipe."""


class ElementFormat(NamedTuple):
    """An element format: its dtype, largest finite value, exponent of that value, mantissa bits,
    the exponent of its smallest normal, its short name and its roles in jaxmp."""

    dtype: Any
    max: float
    emax: int
    mbits: int
    emin: int
    name: str = ""
    roles: frozenset = frozenset()


FORMATS: tuple[ElementFormat, ...] = (
    ElementFormat(np.dtype(jnp.float8_e4m3fn), 448.0, 8, 3, -6, "E4M3", frozenset({FP8_TENSOR, BLOCK_ELEMENT, BLOCK_SCALE})),
    ElementFormat(np.dtype(jnp.float8_e5m2), 57344.0, 15, 2, -14, "E5M2", frozenset({FP8_TENSOR, BLOCK_ELEMENT})),
    ElementFormat(np.dtype(jnp.float4_e2m1fn), 6.0, 2, 1, 0, "E2M1", frozenset({BLOCK_ELEMENT})),
    ElementFormat(np.dtype(jnp.float8_e8m0fnu), 2.0 ** 127, 127, 0, -127, "E8M0", frozenset({BLOCK_SCALE})),
)
"""The table: one row per format."""

_BY_NAME = {f.name: f for f in FORMATS}
E4M3 = _BY_NAME["E4M3"].dtype
"""``float8_e4m3fn``: the format of forward operands (largest finite value 448)."""
E5M2 = _BY_NAME["E5M2"].dtype
"""``float8_e5m2``: the format of gradients (largest finite value 57344)."""
E2M1 = _BY_NAME["E2M1"].dtype
"""``float4_e2m1fn``: NVFP4's and MXFP4's element format (largest value 6)."""
E8M0 = _BY_NAME["E8M0"].dtype
"""``float8_e8m0fnu``: the power-of-two scale of the MX formats."""


def with_role(role: str) -> tuple[np.dtype, ...]:
    """The dtypes of the table's rows that play ``role``, in the table's order.

    Args:
      role: `FP8_TENSOR`, `BLOCK_ELEMENT` or `BLOCK_SCALE`.

    Returns:
      The dtypes.

    Example:
      >>> import jaxmp
      >>> [d.name for d in jaxmp._formats.with_role(jaxmp._formats.FP8_TENSOR)]
      ['float8_e4m3fn', 'float8_e5m2']
    """
    return tuple(f.dtype for f in FORMATS if role in f.roles)


def spelled(dtypes: tuple) -> str:
    """``"a, b or c"``: the dtypes' names for an error message."""
    names = [np.dtype(d).name for d in dtypes]
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"


FP8_DTYPES = with_role(FP8_TENSOR)
"""The two fp8 formats a per-tensor recipe may name."""
ELEMENTS = {f.dtype: f for f in FORMATS if BLOCK_ELEMENT in f.roles}
"""``{dtype: ElementFormat}`` of the block-scaled quantizer's element formats."""


def element_format(dtype: Any) -> ElementFormat:
    """The `ElementFormat` of E4M3, E5M2 or E2M1, or a ``ValueError``."""
    d = np.dtype(dtype)
    if d not in ELEMENTS:
        raise ValueError(f"element format must be {spelled(tuple(ELEMENTS))}, got {d}")
    return ELEMENTS[d]


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
        raise TypeError(f"{what} must be an fp8 dtype ({spelled(FP8_DTYPES)}), got {value!r}") from e
    if dtype not in FP8_DTYPES:
        raise ValueError(f"{what} must be an fp8 dtype ({spelled(FP8_DTYPES)}), got {dtype}")
    return dtype


def fp8_max(dtype: Any) -> float:
    """The largest finite value of an fp8 format.

    Args:
      dtype: ``float8_e4m3fn`` or ``float8_e5m2``.

    Returns:
      448.0 for E4M3, 57344.0 for E5M2.

    Example:
      >>> import jaxmp
      >>> jaxmp._formats.fp8_max(jaxmp._formats.E5M2)
      57344.0
    """
    return ELEMENTS[fp8_dtype(dtype, "dtype")].max
