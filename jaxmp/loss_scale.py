"""Loss scales as pytrees: no-op, static and dynamic; ``all_finite`` and ``select_tree``.

Drop-in for jmp's loss scales with three fixes: every configuration field of
:class:`DynamicLossScale` survives ``jit``/``tree_map``/checkpointing (jmp drops
``min_loss_scale``), the scale is always float32, and growth is capped by
``max_loss_scale`` and never produces a non-finite scale.
"""

from __future__ import annotations

import math
from typing import Any, TypeVar, Union

import jax
import jax.numpy as jnp
import numpy as np

from jaxmp.policy import is_floating_array

T = TypeVar("T")

#: Defaults (see DESIGN.md): jmp/Keras start at 2**15; Apex caps at 2**24.
DEFAULT_INITIAL_SCALE = 2.0**15
DEFAULT_GROWTH_INTERVAL = 2000
DEFAULT_GROWTH_FACTOR = 2.0
DEFAULT_MIN_SCALE = 1.0
DEFAULT_MAX_SCALE = 2.0**24


def _is_tracer(x: Any) -> bool:
    return isinstance(x, jax.core.Tracer)


def _concrete_float(value: Any, name: str) -> float:
    """A Python float from a number or a concrete 0-d array, with a clear error otherwise."""
    if _is_tracer(value):
        raise TypeError(f"{name} must be a concrete number, not a traced value (build loss scales outside jit)")
    if isinstance(value, bool):
        raise TypeError(f"{name} must be a number, got a bool")
    try:
        arr = np.asarray(value)
    except Exception as e:  # noqa: BLE001 - any conversion failure is a type problem
        raise TypeError(f"{name} must be a number, got {type(value).__name__}") from e
    if arr.shape != () or not (np.issubdtype(arr.dtype, np.floating) or np.issubdtype(arr.dtype, np.integer)):
        raise TypeError(f"{name} must be a real scalar, got {arr.dtype} array of shape {arr.shape}")
    return float(arr)


def _check_scale(value: Any, name: str) -> jax.Array:
    """Validates a user-given scale and returns it as a float32 0-d array."""
    if _is_tracer(value):
        if jnp.shape(value) != ():
            raise ValueError(f"{name} must be a scalar, got shape {jnp.shape(value)}")
        return jnp.asarray(value, jnp.float32)
    v = _concrete_float(value, name)
    if not math.isfinite(v) or v <= 0:
        raise ValueError(f"{name} must be a positive finite number, got {v}")
    return jnp.asarray(v, jnp.float32)


def _scale_leaf(x: Any, factor: jax.Array) -> Any:
    # Multiply in at least float32 and return the promoted dtype, as jmp does under standard
    # promotion, but explicitly so that strict dtype promotion does not reject it.
    if is_floating_array(x):
        dtype = x.dtype if np.dtype(x.dtype).itemsize >= 4 else np.dtype(jnp.float32)
        return x.astype(dtype) * factor.astype(dtype)
    if isinstance(x, (float, int)) and not isinstance(x, bool):
        return jnp.float32(x) * factor
    return x


class NoOpLossScale:
    """A loss scale that does nothing (for float32 and bfloat16 training).

    Example:
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
        _check_flag(grads_finite)
        return self

    def __repr__(self):
        return "NoOpLossScale()"

    def __eq__(self, other):
        return type(other) is NoOpLossScale

    def __hash__(self):
        return hash(NoOpLossScale)


class _Scaling:
    """``scale``/``unscale`` by ``self.loss_scale``, shared by the static and dynamic scales."""

    loss_scale: jax.Array

    def scale(self, tree: T) -> T:
        """Multiplies every floating leaf by the scale (in at least float32).

        Args:
          tree: a loss or any pytree.

        Returns:
          The tree with floating leaves scaled; half-precision leaves come back float32.
        """
        return jax.tree_util.tree_map(lambda x: _scale_leaf(x, self.loss_scale), tree)

    def unscale(self, tree: T) -> T:
        """Divides every floating leaf by the scale (in at least float32).

        Args:
          tree: gradients or any pytree.

        Returns:
          The tree with floating leaves unscaled; half-precision leaves come back float32.
        """
        inv = 1.0 / self.loss_scale
        return jax.tree_util.tree_map(lambda x: _scale_leaf(x, inv), tree)


class StaticLossScale(_Scaling):
    """Scales the loss (and unscales gradients) by a fixed constant.

    Args:
      loss_scale: a positive finite number; stored as a float32 0-d array leaf.

    Example:
      >>> ls = jaxmp.StaticLossScale(128.0)
      >>> float(ls.scale(jnp.float32(2.0)))
      256.0
    """

    def __init__(self, loss_scale: Any):
        self.loss_scale = _check_scale(loss_scale, "loss_scale")

    def adjust(self, grads_finite: jax.Array) -> "StaticLossScale":
        """Returns ``self``: a static scale never changes."""
        _check_flag(grads_finite)
        return self

    def __repr__(self):
        return f"StaticLossScale(loss_scale={self.loss_scale!r})"


class DynamicLossScale(_Scaling):
    """Dynamic loss scaling: grow while gradients stay finite, back off when they overflow.

    Exact rule, applied by :meth:`adjust` once per step::

        if grads_finite:
            counter += 1
            if counter == period:            # period consecutive finite steps
                counter = 0
                new = min(loss_scale * factor, max_loss_scale)
                if isfinite(new): loss_scale = new
        else:                                # the step is skipped by the caller
            counter = 0
            loss_scale = max(loss_scale * backoff_factor, min_loss_scale)

    So with the defaults the scale doubles on the 2000th consecutive finite step.
    :meth:`torch_parity` reproduces ``torch.amp.GradScaler``'s sequence exactly.

    The scale and counter are pytree leaves (float32 and int32); the configuration
    (period, factor, backoff, min, max) is static pytree metadata, so it survives
    ``jax.jit(lambda s: s)``, ``tree_map`` and a checkpoint restored into a template.

    Args:
      loss_scale: initial scale (positive, finite); default ``2**15``.
      counter: initial count of consecutive finite steps (int32).
      period: growth interval, consecutive finite steps before growing (>= 1).
      factor: growth factor (> 1).
      min_loss_scale: floor applied on back-off (>= 0; 0 means no floor).
      backoff_factor: multiplier on overflow, in (0, 1); default ``1 / factor``.
      max_loss_scale: cap on growth (``inf`` allowed: growth still stops short of inf).

    Example:
      >>> ls = jaxmp.DynamicLossScale(2.0**15, period=2)
      >>> ls = ls.adjust(jnp.array(True)).adjust(jnp.array(True))
      >>> float(ls.loss_scale)
      65536.0
    """

    def __init__(self, loss_scale: Any = DEFAULT_INITIAL_SCALE, counter: Any = 0,
                 period: int = DEFAULT_GROWTH_INTERVAL, factor: float = DEFAULT_GROWTH_FACTOR,
                 min_loss_scale: Any = DEFAULT_MIN_SCALE, *, backoff_factor: float | None = None,
                 max_loss_scale: Any = DEFAULT_MAX_SCALE):
        if isinstance(period, bool) or not isinstance(period, (int, np.integer)):
            raise TypeError(f"period (growth interval) must be an int, got {type(period).__name__}: {period!r}")
        if period < 1:
            raise ValueError(f"period (growth interval) must be >= 1, got {period}")
        factor = _concrete_float(factor, "factor")
        if not math.isfinite(factor) or factor <= 1:
            raise ValueError(f"factor (growth factor) must be a finite number > 1, got {factor}")
        backoff = 1.0 / factor if backoff_factor is None else _concrete_float(backoff_factor, "backoff_factor")
        if not 0 < backoff < 1:
            raise ValueError(f"backoff_factor must be in (0, 1), got {backoff}")
        lo = _concrete_float(min_loss_scale, "min_loss_scale")
        hi = _concrete_float(max_loss_scale, "max_loss_scale")
        if not math.isfinite(lo) or lo < 0:
            raise ValueError(f"min_loss_scale must be a finite number >= 0, got {lo}")
        if math.isnan(hi) or hi <= 0:
            raise ValueError(f"max_loss_scale must be > 0, got {hi}")
        if lo > hi:
            raise ValueError(f"min_loss_scale ({lo}) is larger than max_loss_scale ({hi})")
        self.loss_scale = _check_scale(loss_scale, "loss_scale")
        if not _is_tracer(self.loss_scale) and not lo <= float(self.loss_scale) <= hi:
            raise ValueError(f"initial loss_scale {float(self.loss_scale)} is outside [min_loss_scale, max_loss_scale] = [{lo}, {hi}]")
        if not _is_tracer(counter):
            c = np.asarray(counter)
            if c.shape != () or not np.issubdtype(c.dtype, np.integer) or c < 0:
                raise ValueError(f"counter must be a non-negative integer scalar, got {counter!r}")
        self.counter = jnp.asarray(counter, jnp.int32)
        self.period = int(period)
        self.factor = factor
        self.backoff_factor = backoff
        self.min_loss_scale = lo
        self.max_loss_scale = hi

    @classmethod
    def torch_parity(cls) -> "DynamicLossScale":
        """``torch.amp.GradScaler()``'s defaults: init 2**16, x2 after 2000 finite steps, x0.5 on overflow, no floor.

        Returns:
          A :class:`DynamicLossScale` whose scale sequence matches GradScaler's for the same
          sequence of finite / non-finite steps.

        Example:
          >>> float(jaxmp.DynamicLossScale.torch_parity().loss_scale)
          65536.0
        """
        return cls(2.0**16, period=2000, factor=2.0, min_loss_scale=0.0, backoff_factor=0.5,
                   max_loss_scale=math.inf)

    @property
    def growth_interval(self) -> int:
        """Alias of ``period`` (torch's name)."""
        return self.period

    @property
    def growth_factor(self) -> float:
        """Alias of ``factor`` (torch's name)."""
        return self.factor

    def adjust(self, grads_finite: jax.Array) -> "DynamicLossScale":
        """Returns the next loss scale given whether this step's gradients were finite.

        Args:
          grads_finite: a boolean scalar (e.g. from :func:`all_finite`).

        Returns:
          The new :class:`DynamicLossScale` (same configuration).
        """
        grads_finite = _check_flag(grads_finite)
        scale = self.loss_scale.astype(jnp.float32)
        counter = jnp.where(grads_finite, self.counter + 1, 0).astype(jnp.int32)
        grow = grads_finite & (counter >= self.period)
        grown = jnp.minimum(scale * jnp.float32(self.factor), jnp.float32(self.max_loss_scale))
        grown = jnp.where(jnp.isfinite(grown), grown, scale)
        backed_off = jnp.maximum(scale * jnp.float32(self.backoff_factor), jnp.float32(self.min_loss_scale))
        new_scale = jnp.where(grads_finite, jnp.where(grow, grown, scale), backed_off)
        counter = jnp.where(grow, 0, counter).astype(jnp.int32)
        return self._replace(new_scale, counter)

    def _replace(self, loss_scale, counter) -> "DynamicLossScale":
        new = object.__new__(DynamicLossScale)
        new.__dict__.update(self.__dict__)
        new.loss_scale, new.counter = loss_scale, counter
        return new

    def _config(self):
        return (self.period, self.factor, self.backoff_factor, self.min_loss_scale, self.max_loss_scale)

    def __repr__(self):
        return (f"DynamicLossScale(loss_scale={self.loss_scale!r}, counter={self.counter!r}, period={self.period}, "
                f"factor={self.factor}, backoff_factor={self.backoff_factor}, min_loss_scale={self.min_loss_scale}, "
                f"max_loss_scale={self.max_loss_scale})")


def _flatten_dynamic(ls: DynamicLossScale):
    return (ls.loss_scale, ls.counter), ls._config()


def _unflatten_dynamic(config, children) -> DynamicLossScale:
    # Bypass __init__: JAX rebuilds pytrees with tracers and placeholder objects.
    new = object.__new__(DynamicLossScale)
    new.loss_scale, new.counter = children
    (new.period, new.factor, new.backoff_factor, new.min_loss_scale, new.max_loss_scale) = config
    return new


def _unflatten_static(_, children) -> StaticLossScale:
    new = object.__new__(StaticLossScale)
    (new.loss_scale,) = children
    return new


jax.tree_util.register_pytree_node(NoOpLossScale, lambda ls: ((), None), lambda _, __: NoOpLossScale())
jax.tree_util.register_pytree_node(StaticLossScale, lambda ls: ((ls.loss_scale,), None), _unflatten_static)
jax.tree_util.register_pytree_node(DynamicLossScale, _flatten_dynamic, _unflatten_dynamic)

LossScale = Union[NoOpLossScale, StaticLossScale, DynamicLossScale]
LOSS_SCALE_TYPES = (NoOpLossScale, StaticLossScale, DynamicLossScale)


def _check_flag(flag: Any) -> jax.Array:
    flag = jnp.asarray(flag)
    if flag.shape != ():
        raise ValueError(f"expected a boolean scalar, got shape {flag.shape}")
    if flag.dtype != jnp.bool_:
        raise TypeError(f"expected a boolean scalar, got dtype {flag.dtype}")
    return flag


def make_loss_scale(spec: Any = "dynamic") -> LossScale:
    """Builds a loss scale from a short description.

    Args:
      spec: a loss-scale object (returned as is); ``"dynamic"``; ``"torch"`` (GradScaler
        parity); ``"none"``/``"noop"``/``None``; a positive number or ``"static:1024"``
        for a static scale.

    Returns:
      A :class:`NoOpLossScale`, :class:`StaticLossScale` or :class:`DynamicLossScale`.

    Raises:
      ValueError: unknown description or invalid number.

    Example:
      >>> jaxmp.make_loss_scale("static:1024")
      StaticLossScale(loss_scale=Array(1024., dtype=float32))
    """
    if isinstance(spec, LOSS_SCALE_TYPES):
        return spec
    if spec is None:
        return NoOpLossScale()
    if not isinstance(spec, (str, bool)) and np.ndim(spec) == 0 and np.issubdtype(np.asarray(spec).dtype, np.number):
        return StaticLossScale(spec)  # Python, numpy or 0-d JAX numbers
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


def all_finite(tree: Any) -> jax.Array:
    """Whether every floating leaf of ``tree`` is free of inf and NaN.

    Non-floating leaves (ints, bools, PRNG keys, float0) are ignored.

    Args:
      tree: any pytree, typically gradients.

    Returns:
      A boolean scalar array (``True`` for a tree with no floating leaves).

    Example:
      >>> bool(jaxmp.all_finite({"a": jnp.ones(2), "b": jnp.array([jnp.inf])}))
      False
    """
    leaves = [x for x in jax.tree_util.tree_leaves(tree) if is_floating_array(x)]
    if not leaves:
        return jnp.array(True)
    # x * 0 is 0 for finite x and NaN for inf/NaN, so one float sum per leaf carries the verdict
    # and cannot overflow. On CPU this is ~3x cheaper than reducing a boolean isfinite mask.
    total = sum(jnp.sum((x * jnp.zeros((), x.dtype)).astype(jnp.float32)) for x in leaves)
    return jnp.isfinite(total)


def select_tree(pred: Any, a: T, b: T) -> T:
    """Selects ``a`` where ``pred`` is true else ``b``, leaf by leaf (``lax.select``).

    Args:
      pred: a boolean scalar.
      a: a pytree.
      b: a pytree of the same structure, shapes and dtypes.

    Returns:
      ``a`` or ``b``, chosen without Python branching (usable under ``jit``).

    Raises:
      ValueError / TypeError: ``pred`` is not a boolean scalar, or the trees differ.

    Example:
      >>> jaxmp.select_tree(jnp.array(False), {"x": jnp.ones(2)}, {"x": jnp.zeros(2)})["x"]
      Array([0., 0.], dtype=float32)
    """
    pred = _check_flag(pred)
    ta, tb = jax.tree_util.tree_structure(a), jax.tree_util.tree_structure(b)
    if ta != tb:
        raise ValueError(f"select_tree needs two trees of the same structure, got {ta} and {tb}")

    def sel(x, y):
        x, y = jnp.asarray(x), jnp.asarray(y)
        if x.shape != y.shape or x.dtype != y.dtype:
            raise ValueError(f"select_tree leaves differ: {x.dtype}{list(x.shape)} vs {y.dtype}{list(y.shape)}")
        return jax.lax.select(pred, x, y) if x.shape == () else jax.lax.select(jnp.broadcast_to(pred, x.shape), x, y)

    return jax.tree_util.tree_map(sel, a, b)
