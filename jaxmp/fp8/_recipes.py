"""The fp8 scaling recipes: [`CurrentScaling`][jaxmp.fp8.CurrentScaling] and [`DelayedScaling`][jaxmp.fp8.DelayedScaling], and the
per-tensor state a delayed recipe keeps ([`Fp8Meta`][jaxmp.fp8.Fp8Meta]).

The two recipes share their format and headroom fields through a non-public base, and neither
subclasses the other: ``isinstance(recipe, CurrentScaling)`` means current scaling exactly.
[`Fp8Recipe`][jaxmp.fp8.Fp8Recipe] (``CurrentScaling | DelayedScaling``) is what "any fp8 recipe" means, for
``isinstance`` and for annotations alike.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import DTypeLike

from jaxmp._formats import BLOCK_ELEMENT, E2M1, E4M3, E5M2, fp8_dtype, spelled, with_role
from jaxmp._formats._block_scaled import POW2_RULES, SCALE_FORMATS, SCALE_RULES

REDUCTIONS = ("max", "most_recent")
"""How [`DelayedScaling`][jaxmp.fp8.DelayedScaling] reduces its amax history to one reference amax."""


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
    """Current scaling: each tensor's (or each block's) scale from its own amax, in the same step.

    Per tensor by default; with ``block`` set, block-scaled as MXFP8, NVFP4, rowwise fp8 and
    DeepSeek-V3's 128-blocks (the presets ``"O2-mxfp8"``, ``"O2-nvfp4"``, ``"O2-fp8-rowwise"``,
    ``"O2-fp8-block128"``; docs/fp8.md#block-scaled-formats has each recipe and its source).

    Attributes:
      margin: headroom in powers of two (the scale is divided by ``2**margin``; per tensor only).
      fwd_dtype: format of forward operands (E4M3; with ``block``, also E2M1 ``float4_e2m1fn``).
      bwd_dtype: format of gradients (E5M2; with ``block``, E4M3, E5M2 or E2M1).
      emulate: None (default): native fp8 on GPUs with fp8 Tensor Cores, the emulation on CPU,
        and a clear error elsewhere (older GPUs, TPU); True: emulate anywhere (opt-in);
        False: require fp8 Tensor Cores. See [`jaxmp.fp8.check_hardware`][jaxmp.fp8.check_hardware].
      block: None (one scale per tensor), ``"row"`` (one per row along the contraction axis) or
        ``(a, b)``: ``a`` rows by ``b`` contraction elements per scale (``(1, 32)`` MX,
        ``(1, 16)`` NVFP4, ``(1, 128)``, ``(128, 128)``). Each matmul quantizes its operands
        along its own contraction axis, the backward ones included.
      rhs_block: the block of a ``dot_general``'s second operand (the kernel of ``x @ w``);
        None: ``block``.
      scale_format: ``"float32"``, ``"e8m0"`` (a power of two) or ``"e4m3"`` (NVFP4's, with a
        per-tensor float32 second level from the tensor's amax).
      scale_rule: ``"exact"`` (``amax / max``; float32 and E4M3 scales) or, for E8M0, ``"floor"``
        (OCP MX, torchao FLOOR), ``"even"`` (torchao EVEN), ``"ceil"`` (torchao CEIL: amax's
        exponent rounded up) or ``"rceil"`` (``amax / max`` rounded up: torchao RCEIL, JAX's
        ``scaled_dot_general``, Transformer Engine). docs/fp8.md#block-scaled-formats.
      high_precision_legs: backward matmuls kept unquantized, in the compute dtype: any of
        ``"dgrad"`` (the input's gradient) and ``"wgrad"`` (the second operand's).
      stochastic_rounding: round gradients (the backward legs' cotangent) stochastically.
      hadamard: a random 16x16 Hadamard transform on both operands of the wgrad matmul.
      seed: the seed of the Hadamard signs and of the stochastic rounding (whose key is also
        folded with the cotangent's bits, so it changes from step to step).

    Example:
      >>> from jaxmp import fp8
      >>> fp8.CurrentScaling().fwd_dtype
      dtype(float8_e4m3fn)
      >>> fp8.CurrentScaling(block=(1, 32), scale_format="e8m0", scale_rule="rceil").block
      (1, 32)
    """

    block: tuple[int, int] | str | None = None
    rhs_block: tuple[int, int] | str | None = None
    scale_format: str = "float32"
    scale_rule: str = "exact"
    high_precision_legs: tuple[str, ...] = ()
    stochastic_rounding: bool = False
    hadamard: bool = False
    seed: int = 0

    def __post_init__(self):
        if self.block is None:
            super().__post_init__()
            extra = {f: getattr(self, f) for f in _BLOCK_ONLY if getattr(self, f) != _DEFAULTS[f]}
            if extra:
                raise ValueError(f"{', '.join(extra)}: only with block=... (per-tensor current scaling has one float32 "
                                 "scale and no block options)")
            return
        for name in ("fwd_dtype", "bwd_dtype"):
            object.__setattr__(self, name, _element_dtype(getattr(self, name), name))
        base = dataclasses.replace(self, block=None, fwd_dtype=E4M3, bwd_dtype=E5M2,
                                   **{f: _DEFAULTS[f] for f in _BLOCK_ONLY})
        object.__setattr__(self, "margin", base.margin)
        if self.margin:
            raise ValueError("margin is per-tensor scaling's headroom; block scales take a scale_rule instead")
        for name in ("block", "rhs_block"):
            object.__setattr__(self, name, _check_block(getattr(self, name), name))
        _check_scale(self.scale_format, self.scale_rule)
        legs = tuple(self.high_precision_legs)
        if not set(legs) <= {"dgrad", "wgrad"}:
            raise ValueError(f"high_precision_legs takes 'dgrad' and/or 'wgrad', got {legs!r}")
        object.__setattr__(self, "high_precision_legs", legs)
        for name in ("stochastic_rounding", "hadamard"):
            if not isinstance(getattr(self, name), (bool, np.bool_)):
                raise TypeError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, (int, np.integer)) \
                or not 0 <= int(self.seed) < 2**31:
            raise ValueError(f"seed must be an int in [0, 2**31), got {self.seed!r}")


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


_BLOCK_ONLY = ("rhs_block", "scale_format", "scale_rule", "high_precision_legs", "stochastic_rounding", "hadamard")
_DEFAULTS = {f.name: f.default for f in dataclasses.fields(CurrentScaling)}


def _element_dtype(value, what: str) -> np.dtype:
    try:
        dtype = jnp.dtype(value)
    except TypeError as e:
        raise TypeError(f"{what} must be {spelled(with_role(BLOCK_ELEMENT))}, got {value!r}") from e
    if dtype not in with_role(BLOCK_ELEMENT):
        raise ValueError(f"{what} of a block-scaled recipe must be {spelled(with_role(BLOCK_ELEMENT))}, got {dtype}")
    return dtype


def _check_block(block, what: str):
    if block is None or block == "row":
        return block
    try:
        a, b = (int(v) for v in block)
        ok = all(not isinstance(v, bool) for v in block) and a >= 1 and b >= 1
    except (TypeError, ValueError):
        ok = False
    if not ok:
        raise ValueError(f"{what} must be None, 'row' or (rows, contraction) of positive ints such as (1, 32), "
                         f"got {block!r}")
    return (a, b)


def _check_scale(scale_format: str, scale_rule: str) -> None:
    if scale_format not in SCALE_FORMATS:
        raise ValueError(f"scale_format must be one of {SCALE_FORMATS}, got {scale_format!r}")
    if scale_rule not in SCALE_RULES:
        raise ValueError(f"scale_rule must be one of {SCALE_RULES}, got {scale_rule!r}")
    if (scale_format == "e8m0") != (scale_rule in POW2_RULES):
        raise ValueError(f"scale_rule {scale_rule!r} does not go with scale_format {scale_format!r}: e8m0 scales take "
                         f"one of {POW2_RULES}, float32 and e4m3 scales take 'exact'")


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
    if isinstance(recipe, CurrentScaling) and recipe.block is not None:
        blocks = "rows" if recipe.block == "row" else "x".join(map(str, recipe.block))
        if recipe.rhs_block is not None and recipe.rhs_block != recipe.block:
            blocks += "/" + ("rows" if recipe.rhs_block == "row" else "x".join(map(str, recipe.rhs_block)))
        legs = "".join(f", {leg} unquantized" for leg in recipe.high_precision_legs)
        return (f"half list, block-scaled ({recipe.fwd_dtype} forward, {recipe.bwd_dtype} backward, {blocks} blocks, "
                f"{recipe.scale_format} scales, {recipe.scale_rule} rule{legs})")
    return f"half list, fp8 ({recipe.fwd_dtype} forward, {recipe.bwd_dtype} backward, {kind} scaling)"


def source(recipe: Fp8Recipe, **changes) -> str:
    """``recipe`` (with ``changes``) as the Python expression that builds it, for messages whose way
    out must run when pasted (it needs ``import jax.numpy as jnp, jaxmp``).

    Args:
      recipe: a [`CurrentScaling`][jaxmp.fp8.CurrentScaling] or [`DelayedScaling`][jaxmp.fp8.DelayedScaling].
      **changes: fields to change first (``emulate=True``).

    Returns:
      The constructor call, with the fields that differ from their defaults.

    Example:
      >>> import jax.numpy as jnp
      >>> from jaxmp import fp8
      >>> fp8._recipes.source(fp8.DelayedScaling(history_length=16), emulate=True)
      'jaxmp.fp8.DelayedScaling(emulate=True, history_length=16)'
      >>> fp8._recipes.source(fp8.CurrentScaling(bwd_dtype=jnp.float8_e4m3fn))
      'jaxmp.fp8.CurrentScaling(bwd_dtype=jnp.float8_e4m3fn)'
    """
    if not isinstance(recipe, Fp8Recipe):
        raise TypeError(f"expected a jaxmp.fp8 recipe (CurrentScaling or DelayedScaling), got {type(recipe).__name__}")
    recipe = dataclasses.replace(recipe, **changes)
    default = type(recipe)()
    parts = []
    for field in dataclasses.fields(recipe):
        value = getattr(recipe, field.name)
        if value == getattr(default, field.name):
            continue
        text = f"jnp.{value.name}" if isinstance(value, np.dtype) else repr(value)
        parts.append(f"{field.name}={text}")
    return f"jaxmp.fp8.{type(recipe).__name__}({', '.join(parts)})"


def conv_recipe(recipe: Fp8Recipe) -> Fp8Recipe:
    """The recipe a convolution runs under ``recipe``: a block-scaled one becomes per-tensor current
    scaling in its fp8 formats (E2M1 as E4M3), since a convolution's window has no contraction
    axis to block along; a per-tensor recipe as given.

    Example:
      >>> import jaxmp
      >>> from jaxmp import fp8
      >>> r = fp8._recipes.conv_recipe(jaxmp.get_recipe("O2-nvfp4").fp8)
      >>> r.block, r.fwd_dtype, r.bwd_dtype
      (None, dtype(float8_e4m3fn), dtype(float8_e4m3fn))
    """
    if not (isinstance(recipe, CurrentScaling) and recipe.block is not None):
        return recipe

    def fp8_of(dtype):
        return E4M3 if dtype == E2M1 else dtype
    return CurrentScaling(fwd_dtype=fp8_of(recipe.fwd_dtype), bwd_dtype=fp8_of(recipe.bwd_dtype), emulate=recipe.emulate)
