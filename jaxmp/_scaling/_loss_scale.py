"""Loss scales as pytrees: no-op, static and dynamic.

Drop-in for jmp's loss scales, with every field a pytree leaf or static configuration, a float32
scale and a floor no scale goes below. See docs/design.md#loss-scales.
"""

from __future__ import annotations

import dataclasses
import math
import sys
import warnings
from typing import Any, ClassVar, TypeVar, Union

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

from jaxmp import _effects
from jaxmp import _misuse as misuse
from jaxmp._typing import LossScaleLike
from jaxmp._dtypes import is_inexact_array
from jaxmp._scaling._skip import check_flag

T = TypeVar("T")

#: Defaults (docs/concepts.md): jmp/Keras start at 2**15; Apex caps at 2**24.
DEFAULT_INITIAL_SCALE = 2.0**15
DEFAULT_GROWTH_INTERVAL = 2000
DEFAULT_GROWTH_FACTOR = 2.0
DEFAULT_MIN_SCALE = 1.0
DEFAULT_MAX_SCALE = 2.0**24
#: The smallest scale any loss scale may hold: the smallest normal float32. Below it the scale
#: would be subnormal, which XLA flushes to 0, and a scale of 0 never recovers.
SMALLEST_SCALE = float(np.finfo(np.float32).tiny)
#: The counter is an int32 leaf: every int field compared with it must fit int32.
INT32_MAX = int(np.iinfo(np.int32).max)

_STATIC = {"static": True}


def _is_tracer(x: Any) -> bool:
    return isinstance(x, jax.core.Tracer)


def _concrete_float(value: Any, name: str) -> float:
    """A Python float from a number or a concrete 0-d array, with a clear error otherwise."""
    if _is_tracer(value):
        raise TypeError(f"{name} must be a concrete number, not a traced value (build loss scales outside jit)")
    if isinstance(value, bool):
        raise TypeError(f"{name} must be a number, got a bool")
    if isinstance(value, int):
        # A Python int past int64 would become an object array; the range check that follows
        # reports it like the float it stands for (2**200 is as out of range as 2.0**200).
        try:
            return float(value)
        except OverflowError as e:
            raise ValueError(f"{name} is out of range: got an integer of {value.bit_length()} bits, beyond float32's "
                             f"largest value {float(np.finfo(np.float32).max):g}") from e
    try:
        arr = np.asarray(value)
    except Exception as e:  # noqa: BLE001 - any conversion failure is a type problem
        raise TypeError(f"{name} must be a number, got {type(value).__name__}") from e
    if arr.shape != () or not (np.issubdtype(arr.dtype, np.floating) or np.issubdtype(arr.dtype, np.integer)):
        raise TypeError(f"{name} must be a real scalar, got {arr.dtype} array of shape {arr.shape}")
    return float(arr)


def _float32_scale(value: Any, name: str) -> float:
    """``value`` cast to float32, then checked: finite and a normal number (>= 2**-126)."""
    v = _concrete_float(value, name)
    with np.errstate(over="ignore", under="ignore"):
        v32 = float(np.float32(v))
    if not math.isfinite(v32) or v32 < SMALLEST_SCALE:
        raise ValueError(
            f"{name} must be a positive finite number that float32 holds as a normal number "
            f"(between {SMALLEST_SCALE:g} and {float(np.finfo(np.float32).max):g}), got {v}"
            + (f", which is {v32} in float32" if v32 != v else "")
        )
    return v32


def _scale_array(value: Any, name: str) -> Any:
    """A scale leaf: numbers are validated after the float32 cast; arrays are taken as they come.

    Arrays (restored or traced values, and JAX's own placeholders while it rebuilds a pytree)
    are not read back to the host here: that would sync the device on every rebuild.
    """
    if isinstance(value, (jax.Array, jax.core.Tracer)):
        # Replicated (pmap) or batched (vmap) states carry leading axes, so no shape check here.
        return value if value.dtype == jnp.float32 else value.astype(jnp.float32)
    if isinstance(value, np.ndarray) and value.ndim and np.issubdtype(value.dtype, np.number):
        # A host copy of a replicated state (device_get of a pmap state): checked element-wise.
        v32 = value.astype(np.float32)
        if not np.all(np.isfinite(v32) & (v32 >= SMALLEST_SCALE)):
            raise ValueError(f"{name} must hold positive finite normal float32 numbers, got {value}")
        return v32
    if isinstance(value, (int, float, np.number, np.ndarray, list, tuple)) and not isinstance(value, bool):
        return jnp.asarray(_float32_scale(value, name), jnp.float32)
    # A placeholder while JAX, orbax or Equinox rebuilds the tree (None, object(),
    # ShapeDtypeStruct, a parameter name, the booleans of an ``eqx.filter_jit`` filter spec):
    # the dataclass must accept it, so a wrong type is reported at first use.
    return value


def _usable(scale: Any) -> Any:
    if not isinstance(scale, (jax.Array, np.ndarray, jax.core.Tracer)):
        raise TypeError(f"loss_scale must be a real scalar number, got {type(scale).__name__}: {scale!r}")
    return scale


def _scale_leaf(x: Any, factor: jax.Array) -> Any:
    # Multiply in at least float32 and return the promoted dtype, as jmp does under standard
    # promotion, but explicitly so that strict dtype promotion does not reject it. Complex
    # leaves are scaled in their own dtype.
    if is_inexact_array(x):
        dtype = x.dtype if np.dtype(x.dtype).itemsize >= 4 else np.dtype(jnp.float32)
        return x.astype(dtype) * factor.astype(dtype)
    if isinstance(x, (float, int)) and not isinstance(x, bool):
        return jnp.float32(x) * factor
    return x


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class NoOpLossScale:
    """A loss scale that does nothing (for float32 and bfloat16 training).

    Example:
      >>> import jaxmp
      >>> ls = jaxmp.NoOpLossScale()
      >>> ls.scale(2.0), float(ls.loss_scale)
      (2.0, 1.0)
    """

    @property
    def loss_scale(self) -> jax.Array:
        return jnp.float32(1.0)

    def scale(self, tree: T) -> T:
        """Returns ``tree`` unchanged."""
        return tree

    def unscale(self, tree: T) -> T:
        """Returns ``tree`` unchanged."""
        return tree

    def adjust(self, grads_finite: jax.Array) -> "NoOpLossScale":
        """Returns ``self``."""
        check_flag(grads_finite)
        return self

    def fold_is_exact(self, built_with: "LossScale | None" = None) -> bool:
        """False: there is no scale to fold (see `jaxmp._scaling._fold`)."""
        return False


class _Scaling:
    """``scale``/``unscale`` by ``self.loss_scale``, shared by the static and dynamic scales."""

    loss_scale: jax.Array

    def scale(self, tree: T) -> T:
        """Multiplies every floating (or complex) leaf by the scale (in at least float32).

        Args:
          tree: a loss or any pytree.

        Returns:
          The tree with inexact leaves scaled; half-precision leaves come back float32.
        """
        _usable(self.loss_scale)
        misuse.note_scaled(self)
        return jax.tree_util.tree_map(lambda x: _scale_leaf(x, self.loss_scale), tree)

    def unscale(self, tree: T) -> T:
        """Divides every floating (or complex) leaf by the scale (in at least float32).

        Args:
          tree: gradients or any pytree.

        Returns:
          The tree with inexact leaves unscaled; half-precision leaves come back float32.
        """
        inv = 1.0 / _usable(self.loss_scale)
        return jax.tree_util.tree_map(lambda x: _scale_leaf(x, inv), tree)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, eq=False)
class StaticLossScale(_Scaling):
    """Scales the loss (and unscales gradients) by a fixed constant.

    Args:
      loss_scale: a positive number that float32 holds as a normal finite number; stored
        as a float32 0-d array leaf.

    Example:
      >>> import jax.numpy as jnp, jaxmp
      >>> ls = jaxmp.StaticLossScale(128.0)
      >>> float(ls.scale(jnp.float32(2.0)))
      256.0
    """

    loss_scale: ArrayLike
    #: Whether this scale multiplied a loss (set by `scale`; see ``jaxmp._misuse.ScaledMark``).
    scaled_mark: misuse.ScaledMark = dataclasses.field(default=misuse.UNSCALED, kw_only=True, repr=False, metadata=_STATIC)

    def __post_init__(self):
        object.__setattr__(self, "loss_scale", _scale_array(self.loss_scale, "loss_scale"))

    def adjust(self, grads_finite: jax.Array) -> "StaticLossScale":
        """Returns ``self`` (unmarked, see ``jaxmp._misuse.ScaledMark``): a static scale never changes."""
        check_flag(grads_finite)
        return dataclasses.replace(self, scaled_mark=misuse.UNSCALED) if misuse.was_scaled(self) else self

    def fold_is_exact(self, built_with: "LossScale | None" = None) -> bool:
        """Whether the scale is >= 1, so that `jaxmp._scaling._fold` is exact (see `DynamicLossScale.fold_is_exact`).

        Args:
          built_with: the scale the transform was built with: a static scale never changes, so
            under ``jit`` (a traced scale) its value stands for this one's.
        """
        value = self.loss_scale
        if _is_tracer(value):
            if not isinstance(built_with, StaticLossScale):
                return False
            value = built_with.loss_scale
        return bool(np.all(np.asarray(value) >= 1))


def _whole_number(value: Any, name: str) -> int:
    """An int from an int, a whole float (jmp's ``period=5.``) or a concrete 0-d array of one."""
    if isinstance(value, bool) or isinstance(value, str):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}: {value!r}")
    if isinstance(value, (int, np.integer)):
        return int(value)
    try:
        number = _concrete_float(value, name)
    except TypeError:
        raise TypeError(f"{name} must be an int, got {type(value).__name__}: {value!r}") from None
    if not number.is_integer():
        raise TypeError(f"{name} must be an int (a whole number of steps), got {value!r}")
    return int(number)


def _warn_if_integer_array(value: Any, name: str) -> None:
    """jmp's warning for an integer array given as a scale (a Python int is taken without one)."""
    dtype = getattr(value, "dtype", None)
    if (isinstance(value, (jax.Array, np.ndarray, np.integer)) and not _is_tracer(value)
            and np.issubdtype(np.dtype(dtype), np.integer)):
        warnings.warn(f"Expected floating type for {name}, got {np.dtype(dtype).name}: it is used as float32",
                      stacklevel=4)


def _hashable(config: tuple) -> bool:
    try:
        hash(config)
    except TypeError:  # an array hyperparameter (jmp accepts jnp.float32(0.37))
        return False
    return True


def _check_config(period, factor, backoff, lo, hi):
    """Validates a dynamic scale's configuration; returns it as Python numbers."""
    period = _whole_number(period, "period (growth interval)")
    if period < 1:
        raise ValueError(f"period (growth interval) must be >= 1, got {period}")
    if period > INT32_MAX:
        raise ValueError(f"period (growth interval) must be <= 2**31 - 1 (the counter is int32), got {period}")
    factor = _concrete_float(factor, "factor")
    if not math.isfinite(factor) or factor <= 1:
        raise ValueError(f"factor (growth factor) must be a finite number > 1, got {factor}")
    backoff = 1.0 / factor if backoff is None else _concrete_float(backoff, "backoff_factor")
    if not 0 < backoff < 1:
        raise ValueError(f"backoff_factor must be in (0, 1), got {backoff}")
    lo = _float32_scale(lo, "min_loss_scale (the floor every back-off stops at)")
    hi = _concrete_float(hi, "max_loss_scale")
    if math.isnan(hi) or hi <= 0:
        raise ValueError(f"max_loss_scale must be > 0, got {hi}")
    if lo > hi:
        raise ValueError(f"min_loss_scale ({lo}) is larger than max_loss_scale ({hi})")
    return int(period), factor, backoff, lo, hi


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, eq=False)
class DynamicLossScale(_Scaling):
    """Dynamic loss scaling: grow while gradients stay finite, back off when they overflow.

    Exact rule, applied by [`adjust`][jaxmp.DynamicLossScale.adjust] once per step::

        if grads_finite:
            counter += 1
            if counter == period:            # period consecutive finite steps
                counter = 0
                new = min(loss_scale * factor, max_loss_scale)
                if isfinite(new): loss_scale = new
        else:                                # the step is skipped by the caller
            counter = 0
            loss_scale = max(loss_scale * backoff_factor, min_loss_scale)

    The scale (float32) and counter (int32) are leaves, the configuration static metadata.
    See docs/design.md#loss-scales.

    Args:
      loss_scale: initial scale (validated after the cast to float32); default ``2**15``.
      counter: initial count of consecutive finite steps (int32).
      period: growth interval, consecutive finite steps before growing (>= 1; a whole float or
        a 0-d array is taken, as jmp takes it).
      factor: growth factor (> 1).
      min_loss_scale: floor applied on back-off (a normal float32, >= 2**-126). As in jmp, the
        hyperparameters may be concrete 0-d arrays (``jnp.float32(0.37)``); an integer array
        scale or floor warns, as jmp's does.
      backoff_factor: multiplier on overflow, in (0, 1); default ``1 / factor``.
      max_loss_scale: cap on growth (``inf`` allowed: growth still stops short of inf).

    Raises:
      TypeError: a non-number scale, counter or period.
      ValueError: a configuration out of range, or an initial scale outside [min, max].

    Example:
      >>> import jax.numpy as jnp, jaxmp
      >>> ls = jaxmp.DynamicLossScale(2.0**15, period=2)
      >>> ls = ls.adjust(jnp.array(True)).adjust(jnp.array(True))
      >>> float(ls.loss_scale)
      65536.0
    """

    loss_scale: ArrayLike = DEFAULT_INITIAL_SCALE
    counter: ArrayLike = 0
    period: int = dataclasses.field(default=DEFAULT_GROWTH_INTERVAL, metadata=_STATIC)
    factor: float = dataclasses.field(default=DEFAULT_GROWTH_FACTOR, metadata=_STATIC)
    min_loss_scale: float = dataclasses.field(default=DEFAULT_MIN_SCALE, metadata=_STATIC)
    backoff_factor: float | None = dataclasses.field(default=None, kw_only=True, metadata=_STATIC)
    max_loss_scale: float = dataclasses.field(default=DEFAULT_MAX_SCALE, kw_only=True, metadata=_STATIC)
    #: Whether this scale multiplied a loss (set by `scale`; see ``jaxmp._misuse.ScaledMark``).
    scaled_mark: misuse.ScaledMark = dataclasses.field(default=misuse.UNSCALED, kw_only=True, repr=False, metadata=_STATIC)

    # Configurations already validated: JAX rebuilds the dataclass on every tree operation.
    _valid: ClassVar[set] = set()

    def __post_init__(self):
        config = (self.period, self.factor, self.backoff_factor, self.min_loss_scale, self.max_loss_scale)
        ls, counter = self.loss_scale, self.counter
        if isinstance(ls, bool) != isinstance(counter, bool):
            # Booleans are accepted only as a filter spec (Equinox maps *every* leaf to a bool);
            # one bool beside a number is a mistake such as DynamicLossScale(True).
            name, value = ("loss_scale", ls) if isinstance(ls, bool) else ("counter", counter)
            raise TypeError(f"{name} must be a number, got the bool {value!r} (e.g. DynamicLossScale(2.0**15), "
                            "counter=0)")
        known = _hashable(config) and config in self._valid
        if (known and isinstance(ls, jax.Array) and isinstance(counter, jax.Array)
                and ls.dtype == np.float32 and counter.dtype == np.int32):
            return  # JAX rebuilding a state it flattened: nothing to check (runs on every jit call)
        _warn_if_integer_array(ls, "loss_scale")
        if not known:
            _warn_if_integer_array(self.min_loss_scale, "min_loss_scale")
            # Python numbers from here on (arrays read once), so the cache and the fast path apply.
            config = _check_config(*config)
            self._valid.add(config)
        for name, value in zip(("period", "factor", "backoff_factor", "min_loss_scale", "max_loss_scale"), config):
            object.__setattr__(self, name, value)
        scale = _scale_array(ls, "loss_scale")
        if isinstance(scale, jax.Array) and not _is_tracer(scale) and isinstance(ls, (int, float, np.number)):
            if not self.min_loss_scale <= float(scale) <= self.max_loss_scale:
                raise ValueError(
                    f"initial loss_scale {float(scale)} is outside [min_loss_scale, max_loss_scale] = "
                    f"[{self.min_loss_scale}, {self.max_loss_scale}]"
                )
        object.__setattr__(self, "loss_scale", scale)
        object.__setattr__(self, "counter", _counter_array(counter))

    @classmethod
    def torch_parity(cls) -> "DynamicLossScale":
        """``torch.amp.GradScaler()``'s defaults: init 2**16, x2 after 2000 finite steps, x0.5 on overflow.

        One deviation: a floor at 2**-126, where torch's scale dies at 0 (docs/design.md#loss-scales).

        Returns:
          A [`DynamicLossScale`][jaxmp.DynamicLossScale] whose sequence matches GradScaler's while
          GradScaler's scale is >= 2**-126.

        Example:
          >>> import jaxmp
          >>> float(jaxmp.DynamicLossScale.torch_parity().loss_scale)
          65536.0
        """
        return cls(2.0**16, period=2000, factor=2.0, min_loss_scale=SMALLEST_SCALE, backoff_factor=0.5,
                   max_loss_scale=math.inf)

    @property
    def growth_interval(self) -> int:
        """Alias of ``period`` (torch's name)."""
        return self.period

    @property
    def growth_factor(self) -> float:
        """Alias of ``factor`` (torch's name)."""
        return self.factor

    def fold_is_exact(self, built_with: "LossScale | None" = None) -> bool:
        """Whether the scale is >= 1 on every step (its floor is): then `jaxmp._scaling._fold` is exact.

        Args:
          built_with: unused (the floor is configuration); there for the static scale's sake.
        """
        return self.min_loss_scale >= 1

    def adjust(self, grads_finite: jax.Array) -> "DynamicLossScale":
        """Returns the next loss scale given whether this step's gradients were finite.

        Args:
          grads_finite: a boolean scalar (e.g. from [`all_finite`][jaxmp.all_finite]).

        Returns:
          The new [`DynamicLossScale`][jaxmp.DynamicLossScale] (same configuration).
        """
        grads_finite = check_flag(grads_finite)
        scale = self.loss_scale.astype(jnp.float32)
        counter = jnp.where(grads_finite, self.counter + 1, 0).astype(jnp.int32)
        grow = grads_finite & (counter >= self.period)
        grown = jnp.minimum(scale * jnp.float32(self.factor), jnp.float32(self.max_loss_scale))
        grown = jnp.where(jnp.isfinite(grown), grown, scale)
        lo = jnp.float32(self.min_loss_scale)
        backed_off = jnp.maximum(scale * jnp.float32(self.backoff_factor), lo)
        new_scale = jnp.where(grads_finite, jnp.where(grow, grown, scale), backed_off)
        # A scale restored from a damaged state (NaN, 0) falls back to the floor, and an inf one
        # to the cap (2**127, the largest power of two float32 holds, under an infinite cap):
        # none stays dead, as max(inf * backoff, floor) would.
        new_scale = jnp.where(new_scale >= lo, new_scale, lo)
        new_scale = jnp.where(jnp.isinf(new_scale), jnp.float32(min(self.max_loss_scale, 2.0**127)), new_scale)
        counter = jnp.where(grow, 0, counter).astype(jnp.int32)
        return dataclasses.replace(self, loss_scale=new_scale, counter=counter, scaled_mark=misuse.UNSCALED)


def _counter_array(counter: Any) -> Any:
    if isinstance(counter, (jax.Array, jax.core.Tracer)):
        return counter if counter.dtype == jnp.int32 else counter.astype(jnp.int32)
    if isinstance(counter, np.ndarray) and counter.ndim and np.issubdtype(counter.dtype, np.integer):
        # A host copy of a replicated state: checked element-wise, as a scalar counter is.
        if counter.size and (counter.min() < 0 or counter.max() > INT32_MAX):
            raise ValueError(f"counter must hold integers in [0, 2**31 - 1] (an int32 leaf), got {counter}")
        return counter.astype(np.int32)
    if isinstance(counter, (int, np.integer, np.ndarray)) and not isinstance(counter, bool):
        c = np.asarray(counter)
        if c.shape != () or not np.issubdtype(c.dtype, np.integer) or c < 0:
            raise ValueError(f"counter must be a non-negative integer scalar, got {counter!r}")
        if int(c) > INT32_MAX:
            raise ValueError(f"counter must be <= 2**31 - 1 (it is an int32 leaf; a larger value would wrap), "
                             f"got {int(c)}")
        return jnp.asarray(c, jnp.int32)
    if isinstance(counter, float):
        raise ValueError(f"counter must be a non-negative integer scalar, got {counter!r}")
    return counter


def _check_concrete_scale(ls: Any) -> None:
    """Validates a scale given as a concrete array, once, when a transform is built with it.

    (The constructors cannot: JAX rebuilds the dataclass on every tree operation, and reading the
    scale there would sync the device each time.)
    """
    value = ls.loss_scale
    if not isinstance(value, (jax.Array, np.ndarray)) or _is_tracer(value):
        return
    v = np.asarray(value, np.float32)
    lo = getattr(ls, "min_loss_scale", SMALLEST_SCALE)
    hi = getattr(ls, "max_loss_scale", float(np.finfo(np.float32).max))
    if not (np.all(np.isfinite(v)) and np.all(v >= max(lo, SMALLEST_SCALE)) and np.all(v <= hi)):
        raise ValueError(
            f"{type(ls).__name__}.loss_scale must be a positive finite float32 number in "
            f"[{max(lo, SMALLEST_SCALE):g}, {hi:g}], got {value}")


LossScale = Union[NoOpLossScale, StaticLossScale, DynamicLossScale]
LOSS_SCALE_TYPES = (NoOpLossScale, StaticLossScale, DynamicLossScale)

_LEAF_FIELDS = {NoOpLossScale: (), StaticLossScale: ("loss_scale",), DynamicLossScale: ("loss_scale", "counter")}


def register_flax_serialization(force: bool = False) -> bool:
    """Registers the loss scales with ``flax.serialization`` (``to_bytes``, ``from_bytes``, state dicts).

    Registers only once Flax is loaded (or imports it with ``force``), once per process, through
    `jaxmp._effects` (effect 3 there); `jaxmp.flax` and [`make_loss_scale`][jaxmp.make_loss_scale]
    call it, ``import jaxmp`` does not. The state dict holds the leaves; the configuration comes
    from the target restored into.

    Args:
      force: import ``flax.serialization`` if it is not loaded yet.

    Returns:
      Whether the loss scales are registered.
    """
    return _effects.register_once("flax.serialization", lambda: _register_with_flax(force))


def _register_with_flax(force: bool) -> bool:
    serialization = sys.modules.get("flax.serialization")
    if serialization is None:
        if not force:
            return False
        import flax.serialization as serialization  # noqa: PLC0415 - Flax stays optional
    if isinstance(serialization.to_state_dict(NoOpLossScale()), dict):
        return True  # already in Flax's registry (an unregistered object comes back as is)
    for cls, fields in _LEAF_FIELDS.items():
        def to_state(x, fields=fields):
            return {f: serialization.to_state_dict(getattr(x, f)) for f in fields}

        def from_state(target, state, fields=fields):
            missing = [f for f in fields if f not in state]
            if missing:
                raise ValueError(f"{type(target).__name__} state dict lacks {missing}, got keys {sorted(state)}")
            return dataclasses.replace(
                target, **{f: serialization.from_state_dict(getattr(target, f), state[f], name=f) for f in fields})

        serialization.register_serialization_state(cls, to_state, from_state, override=True)
    return True


def make_loss_scale(spec: LossScaleLike = "dynamic") -> LossScale:
    """Builds a loss scale from a short description.

    Args:
      spec: a loss-scale object (returned as is); ``"dynamic"``; ``"torch"`` (GradScaler
        parity); ``"none"``/``"noop"``/``None``; a positive number or ``"static:1024"``
        for a static scale.

    Returns:
      A [`NoOpLossScale`][jaxmp.NoOpLossScale], [`StaticLossScale`][jaxmp.StaticLossScale] or [`DynamicLossScale`][jaxmp.DynamicLossScale].

    Raises:
      ValueError: unknown description, or a number that is not a normal float32 > 0.

    Example:
      >>> import jaxmp
      >>> jaxmp.make_loss_scale("static:1024")
      StaticLossScale(loss_scale=Array(1024., dtype=float32))
    """
    # Every transform's scale comes through here: Flax imported after jaxmp (without jaxmp.flax)
    # is registered when the transform is built, before any state exists to serialize.
    register_flax_serialization()
    if isinstance(spec, LOSS_SCALE_TYPES):
        for name in ("loss_scale", "counter"):
            # A filter-spec placeholder (bool) is fine inside a tree, not as the scale to train with.
            if isinstance(getattr(spec, name, None), bool) and not isinstance(spec, NoOpLossScale):
                raise TypeError(f"{type(spec).__name__}.{name} is the bool {getattr(spec, name)!r}: give a number "
                                f"(e.g. {type(spec).__name__}(2.0**15))")
        if not isinstance(spec, NoOpLossScale):
            _check_concrete_scale(spec)
        return spec
    if spec is None:
        return NoOpLossScale()
    if not isinstance(spec, (str, bool)) and np.ndim(spec) == 0 and np.issubdtype(np.asarray(spec).dtype, np.number):
        # Python, numpy or 0-d JAX numbers, validated after the cast to float32.
        return StaticLossScale(_float32_scale(spec, "loss_scale"))
    if isinstance(spec, str):
        s = spec.strip().lower()
        if s in ("none", "noop", "no_op", "off"):
            return NoOpLossScale()
        if s == "dynamic":
            return DynamicLossScale()
        if s in ("torch", "torch_parity"):
            return DynamicLossScale.torch_parity()
        if s.startswith("static:"):
            try:
                value = float(s.split(":", 1)[1])
            except ValueError as e:
                raise ValueError(f"cannot read the static scale in {spec!r}: expected e.g. 'static:1024'") from e
            return StaticLossScale(value)
    raise ValueError(
        f"Unknown loss scale {spec!r}: expected 'dynamic', 'torch', 'none', 'static:<scale>', a number or a loss-scale object."
    )
