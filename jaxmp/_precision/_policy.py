"""The ``Policy`` record: which dtype parameters are stored, computed and returned in.

[`Policy`][jaxmp.Policy] is a ``jmp.Policy`` (a subclass), so it goes wherever jmp's does
(Haiku's ``hk.mixed_precision.set_policy``, code typed against jmp), with two
additions: its dtypes are validated and canonicalised when it is built, and its
casts touch floating array leaves only. `parse_policy_grammar` reads jmp's
``"params=...,compute=...,output=..."`` grammar; presets and the string entry points
(`jaxmp.get_policy`, `jaxmp._precision._presets.resolve_policy`) live in `jaxmp._precision._presets`.
"""

from __future__ import annotations

import dataclasses
from typing import TypeVar

import jmp
import numpy as np
from jax.typing import DTypeLike

from jaxmp import _dtypes

T = TypeVar("T")

_KEYS = {"p": "params", "c": "compute", "o": "output", "params": "params", "compute": "compute", "output": "output"}


@dataclasses.dataclass(frozen=True)
class Policy(jmp.Policy):
    """Parameter / compute / output dtypes: a validated ``jmp.Policy``.

    Attributes:
      param_dtype: dtype parameters are stored in.
      compute_dtype: dtype the forward pass computes in.
      output_dtype: dtype the model returns (usually float32 for the loss).

    Example:
      >>> import jax.numpy as jnp, jmp, jaxmp
      >>> p = jaxmp.Policy(jnp.float32, jnp.bfloat16, jnp.float32)
      >>> p.cast_to_compute(jnp.ones(3)).dtype, isinstance(p, jmp.Policy)
      (dtype(bfloat16), True)
    """

    param_dtype: DTypeLike
    compute_dtype: DTypeLike
    output_dtype: DTypeLike

    def __post_init__(self):
        for field in ("param_dtype", "compute_dtype", "output_dtype"):
            object.__setattr__(self, field, _dtypes.float_dtype(getattr(self, field), field))

    def cast_to_param(self, x: T) -> T:
        """Casts floating leaves of ``x`` to the param dtype."""
        return _dtypes.cast_floating(x, self.param_dtype)

    def cast_to_compute(self, x: T) -> T:
        """Casts floating leaves of ``x`` to the compute dtype."""
        return _dtypes.cast_floating(x, self.compute_dtype)

    def cast_to_output(self, x: T) -> T:
        """Casts floating leaves of ``x`` to the output dtype."""
        return _dtypes.cast_floating(x, self.output_dtype)

    def with_output_dtype(self, output_dtype: DTypeLike) -> "Policy":
        """Returns a copy with another output dtype."""
        return dataclasses.replace(self, output_dtype=output_dtype)

    @property
    def uses_half(self) -> bool:
        """Whether any of the three dtypes is narrower than float32."""
        return any(np.dtype(d).itemsize < 4 for d in (self.param_dtype, self.compute_dtype, self.output_dtype))

    def __str__(self):
        return "p={},c={},o={}".format(*(_dtypes.SHORT_NAME.get(d, str(d)) for d in
                                         (self.param_dtype, self.compute_dtype, self.output_dtype)))


def parse_policy_grammar(text: str) -> Policy:
    """Parses jmp's policy grammar (not presets: see [`jaxmp.get_policy`][jaxmp.get_policy]).

    ``"params=float32,compute=bfloat16,output=float32"`` with short keys ``p``/``c``/``o``;
    unspecified params default to f32, compute follows params and output follows compute;
    a bare dtype name (``"half"``, ``"f32"``) sets all three.

    Args:
      text: the string.

    Returns:
      A [`Policy`][jaxmp.Policy].

    Raises:
      ValueError: malformed string, unknown key or unknown dtype name.
    """
    if "=" not in text:
        dt = _dtypes.parse_dtype(text)
        return Policy(dt, dt, dt)
    dtypes = {}
    for part in text.split(","):
        if part.count("=") != 1:
            raise ValueError(f"Malformed policy part {part!r} in {text!r}: expected 'key=dtype'.")
        key, value = (s.strip() for s in part.split("="))
        if key not in _KEYS:
            raise ValueError(f"Unknown key {key!r} in {text!r}: expected params/p, compute/c or output/o.")
        key = _KEYS[key]
        if key in dtypes:
            raise ValueError(f"Key {key!r} given twice in {text!r}.")
        dtypes[key] = _dtypes.parse_dtype(value)
    params = dtypes.get("params", np.dtype(np.float32))
    compute = dtypes.get("compute", params)
    return Policy(params, compute, dtypes.get("output", compute))

