"""The fp8 scaling recipes: [`CurrentScaling`][jaxmp.fp8.CurrentScaling] and [`DelayedScaling`][jaxmp.fp8.DelayedScaling], and the
per-tensor state a delayed recipe keeps ([`Fp8Meta`][jaxmp.fp8.Fp8Meta]).

The two recipes share their format and headroom fields through a non-public base, and neither
subclasses the other: ``isinstance(recipe, CurrentScaling)`` means current scaling exactly.
[`Fp8Recipe`][jaxmp.fp8.Fp8Recipe] (``CurrentScaling | DelayedScaling``) is what "any fp8 recipe" means, for
``isinstance`` and for annotations alike.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import DTypeLike

from jaxmp.fp8._formats import E4M3, E5M2, check_margin, fp8_dtype

REDUCTIONS = ("max", "most_recent")
"""How [`DelayedScaling`][jaxmp.fp8.DelayedScaling] reduces its amax history to one reference amax."""


@dataclasses.dataclass(frozen=True)
class _ScalingRecipe:
    """The fields both recipes have: formats, headroom, emulation (not a recipe by itself)."""

    margin: float = 0.0
    fwd_dtype: DTypeLike = E4M3
    bwd_dtype: DTypeLike = E5M2
    emulate: bool | None = None

    def __post_init__(self):
        if type(self) is _ScalingRecipe:
            raise TypeError("use jaxmp.fp8.CurrentScaling or jaxmp.fp8.DelayedScaling")
        if self.emulate not in (None, True, False):
            raise ValueError(f"emulate must be None, True or False, got {self.emulate!r}")
        object.__setattr__(self, "margin", check_margin(self.margin))
        object.__setattr__(self, "fwd_dtype", fp8_dtype(self.fwd_dtype, "fwd_dtype"))
        object.__setattr__(self, "bwd_dtype", fp8_dtype(self.bwd_dtype, "bwd_dtype"))


@dataclasses.dataclass(frozen=True)
class CurrentScaling(_ScalingRecipe):
    """Per-tensor current scaling: each tensor's scale from its own amax, in the same step.

    Attributes:
      margin: headroom in powers of two (the scale is divided by ``2**margin``).
      fwd_dtype: format of forward operands (E4M3).
      bwd_dtype: format of gradients (E5M2).
      emulate: None (default): native fp8 on GPUs with fp8 Tensor Cores, the emulation on CPU,
        and a clear error elsewhere (older GPUs, TPU); True: emulate anywhere (opt-in);
        False: require fp8 Tensor Cores. See [`jaxmp.fp8.check_hardware`][jaxmp.fp8.check_hardware].

    Example:
      >>> from jaxmp import fp8
      >>> fp8.CurrentScaling().fwd_dtype
      dtype(float8_e4m3fn)
    """


@dataclasses.dataclass(frozen=True)
class DelayedScaling(_ScalingRecipe):
    """Delayed scaling: the scale from a history of past amaxes (Transformer Engine's defaults).

    Not a [`CurrentScaling`][jaxmp.fp8.CurrentScaling]: code that accepts either checks ``isinstance(recipe,
    fp8.Fp8Recipe)``.

    Attributes:
      history_length: amaxes kept per tensor (>= 1; 1024 by default).
      reduction: ``"max"`` over the history, or ``"most_recent"``.
      margin: as in [`CurrentScaling`][jaxmp.fp8.CurrentScaling].
      fwd_dtype: as in [`CurrentScaling`][jaxmp.fp8.CurrentScaling].
      bwd_dtype: as in [`CurrentScaling`][jaxmp.fp8.CurrentScaling].
      emulate: as in [`CurrentScaling`][jaxmp.fp8.CurrentScaling].

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
        """A fresh [`Fp8Meta`][jaxmp.fp8.Fp8Meta]: scale 1 and an all-zero history."""
        return Fp8Meta(scale=jnp.ones((), jnp.float32), amax_history=jnp.zeros((self.history_length,), jnp.float32))


Fp8Recipe = CurrentScaling | DelayedScaling
"""Either fp8 recipe (``CurrentScaling | DelayedScaling``): for ``isinstance`` checks and
annotations that accept both, since neither recipe is a subclass of the other."""


class Fp8Meta(NamedTuple):
    """The delayed-scaling state of one tensor (not a gradient: never give it to an optimizer).

    Attributes:
      scale: float32 scalar the tensor is multiplied by before the fp8 cast.
      amax_history: float32 ``[history_length]``, newest first.
    """

    scale: jax.Array
    amax_history: jax.Array


def describe(recipe: Fp8Recipe) -> str:
    """How [`jaxmp.precision_report`][jaxmp.diagnostics._precision_report.precision_report] labels an op run under ``recipe``.

    Args:
      recipe: a [`CurrentScaling`][jaxmp.fp8.CurrentScaling] or [`DelayedScaling`][jaxmp.fp8.DelayedScaling].

    Returns:
      The label, naming the formats and the kind of scaling.

    Example:
      >>> from jaxmp import fp8
      >>> fp8._recipes.describe(fp8.DelayedScaling())
      'half list, fp8 (float8_e4m3fn forward, float8_e5m2 backward, delayed scaling)'
      >>> fp8._recipes.describe(fp8.CurrentScaling())
      'half list, fp8 (float8_e4m3fn forward, float8_e5m2 backward, current scaling)'
    """
    if not isinstance(recipe, Fp8Recipe):
        raise TypeError(f"expected a jaxmp.fp8 recipe (CurrentScaling or DelayedScaling), got {type(recipe).__name__}")
    kind = "delayed" if isinstance(recipe, DelayedScaling) else "current"
    return f"half list, fp8 ({recipe.fwd_dtype} forward, {recipe.bwd_dtype} backward, {kind} scaling)"
