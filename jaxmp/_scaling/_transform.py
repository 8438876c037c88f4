"""The optax transforms: loss scaling with skip-on-non-finite, and fp32 master weights.

`jaxmp._scaling._transform.master_weights` keeps a float32 copy of the params and runs the inner chain on
it; `jaxmp._scaling._transform.unscale_and_skip` unscales, checks, skips a non-finite step and adjusts the
scale. [`loss_scaling`][jaxmp.loss_scaling] composes the two. See docs/design.md#loss-scaling.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxmp import _cpu_layout, _tree, _misuse as misuse
from jaxmp._scaling import _fold as fold, _state_checks as state_checks
from jaxmp._typing import AxisName, LossScaleLike
from jaxmp._scaling._collectives import optional_axis_name
from jaxmp._dtypes import float_dtype, is_floating_array, is_inexact_array
from jaxmp._scaling._loss_scale import LOSS_SCALE_TYPES, DynamicLossScale, LossScale, NoOpLossScale, make_loss_scale
from jaxmp._scaling._skip import all_finite, keep_if_finite

#: With float32 master weights and no float16 leaf, a step whose unscaled gradients are not all
#: within this bound is skipped in place of checking its updates: 2**40 (1.1e12) keeps a squared
#: gradient (2**80) and a sum of 2**47 of them (a global norm) inside float32, and keeps an
#: update of ``lr * gradient`` or Adam's ``lr * mu / (sqrt(nu) + eps)`` some 10**23 steps away
#: from moving a master past 3.4e38 (docs/design.md#the-gradient-bound).
GRADIENT_BOUND = 2.0 ** 40

#: ``LossScalingState.skip_reason`` values.
APPLIED, NON_FINITE_LOSS, NON_FINITE_GRADIENTS, NON_FINITE_UPDATES = 0, 1, 2, 3


class MasterWeightsState(NamedTuple):
    """State of `jaxmp._scaling._transform.master_weights`.

    Attributes:
      inner_state: the wrapped transformation's state, built on the master copy.
      master_params: the ``master_dtype`` (float32) copy of the params.
    """

    inner_state: optax.OptState
    master_params: optax.Params


class LossScalingState(NamedTuple):
    """State of `jaxmp._scaling._transform.unscale_and_skip` (and so of [`loss_scaling`][jaxmp.loss_scaling]).

    Attributes:
      inner_state: the wrapped transformation's state (unchanged on skipped steps); a
        `jaxmp._scaling._transform.MasterWeightsState` when master weights are kept.
      loss_scale: the current loss-scale pytree (scale is float32 []).
      last_step_finite: bool [], whether the last update was applied.
      consecutive_skips: int32 [], skipped steps in a row (0 after an applied step).
      total_skips: int32 [], skipped steps since ``init``.
      skip_reason: int32 [], why the last step was skipped: 0 applied, 1 non-finite loss
        (when ``update`` is given ``value=loss``), 2 non-finite gradients, 3 finite gradients
        but non-finite updates.
    """

    inner_state: optax.OptState
    loss_scale: LossScale
    last_step_finite: jax.Array
    consecutive_skips: jax.Array
    total_skips: jax.Array
    skip_reason: jax.Array

    @property
    def master_params(self) -> Any:
        """The master copy when the inner chain keeps one (`jaxmp._scaling._transform.master_weights`), else None."""
        found = _tree.find_states(self.inner_state, MasterWeightsState)
        return found[0].master_params if found else None


def _negative_zeros(x):
    # x + (-0.0) == x for every x, -0.0 included, whereas -0.0 + 0.0 == +0.0: a skipped step
    # adds -0.0 so that even negative-zero params stay bitwise unchanged.
    return jnp.full_like(x, -0.0) if is_inexact_array(x) else jnp.zeros_like(x)


def add_floating(params, updates):
    """``optax.apply_updates`` on floating leaves; other leaves (ints, with float0 updates) pass through."""
    _tree.check_same_structure(updates, params, "updates", "params")

    def add(p, u):
        if not is_inexact_array(p):
            return p
        u = jnp.asarray(u)
        # Add in the wider of the two dtypes, as optax does, without relying on implicit promotion.
        wide = u.dtype if np.dtype(u.dtype).itemsize > np.dtype(p.dtype).itemsize else p.dtype
        return (p.astype(wide) + u.astype(wide)).astype(p.dtype)

    return jax.tree_util.tree_map(add, params, updates)


def _has_half(tree) -> bool:
    return any(is_floating_array(x) and np.dtype(x.dtype).itemsize < 4 for x in jax.tree_util.tree_leaves(tree))


def _float16_leaves(tree) -> list:
    """The float16 leaves of ``tree``: an optimizer state that can overflow on a finite step
    (bfloat16 has float32's range: its state overflows only where float32's would, and checking
    it would cost a pass over the state every step)."""
    return [x for x in jax.tree_util.tree_leaves(tree) if is_floating_array(x) and np.dtype(x.dtype) == np.float16]


def _all_within(tree, bound: float) -> jax.Array:
    """Whether every inexact leaf of ``tree`` has ``|x| <= bound`` (false for inf and NaN): the
    one pass of `all_finite`, one compare per element fused into the gradient's producer."""
    leaves = [x for x in jax.tree_util.tree_leaves(tree) if is_inexact_array(x)]
    if not leaves:
        return jnp.array(True)
    return jnp.all(jnp.stack([jnp.all(jnp.abs(x) <= jnp.asarray(bound, jnp.abs(x).dtype)) for x in leaves]))


def _verdict(finite: jax.Array, axis_name) -> jax.Array:
    if axis_name is None:
        return finite
    # Reduce in float32: every replica must reach the same verdict, and the flag itself must
    # not go through a half-precision collective.
    try:
        agreed = jax.lax.pmin(finite.astype(jnp.float32), axis_name)
    except NameError as e:
        raise ValueError(
            f"axis_name={axis_name!r} is not bound here: call update inside jax.pmap(..., axis_name={axis_name!r}) "
            "or shard_map with that mesh axis, or build loss_scaling with axis_name=None"
        ) from e
    return agreed > 0.5


class _NumericLeavesOnly(optax.GradientTransformationExtraArgs):
    """A transform that leaves int, bool and key leaves alone itself: `numeric_leaves_only`
    returns it as it is."""


class _MasterWeights(_NumericLeavesOnly):
    """`master_weights`' transform: its state holds the master copy (`jaxmp._scaling._state_checks.check_master_matches`)."""


class FusedTransformation(optax.GradientTransformationExtraArgs):
    """An optax ``GradientTransformationExtraArgs`` whose update can also step the params.

    Adds ``update_and_apply(grads, state, params, **extra_args) -> (new_params, new_state)``,
    which steps the params inside the skip. optax's wrappers drop it; `jaxmp._scaling._transform.update_and_apply`
    then falls back to ``update`` and [`jaxmp.apply_updates`][jaxmp.apply_updates].
    See docs/design.md#loss-scaling.

    Args:
      init: as optax's.
      update: as optax's.
      update_and_apply: ``(grads, state, params, **extra_args) -> (new_params, new_state)``.

    Example:
      >>> import jax.numpy as jnp, optax, jaxmp
      >>> tx = jaxmp.loss_scaling(optax.sgd(0.5), "static:4")
      >>> params = {"w": jnp.ones(2)}
      >>> tx.update_and_apply({"w": jnp.full(2, 4.0)}, tx.init(params), params)[0]["w"]
      Array([0.5, 0.5], dtype=float32)
    """

    update_and_apply: Callable[..., tuple[Any, Any]]

    def __new__(cls, init: Callable, update: Callable, update_and_apply: Callable[..., tuple[Any, Any]]):
        self = super().__new__(cls, init, update)
        # optax's transforms are NamedTuples of (init, update); the third entry is an attribute
        # of this type, so that unpacking, isinstance and optax's wrappers see optax's two.
        self.update_and_apply = update_and_apply
        return self

    def __getnewargs__(self):  # copy and pickle rebuild all three
        return (*self, self.update_and_apply)

    @classmethod
    def _make(cls, iterable):
        # _replace(update=...) builds from init and update alone: a plain transform, since the
        # fused entry would no longer match the new update.
        return optax.GradientTransformationExtraArgs(*iterable)


def check_inner(inner: Any) -> optax.GradientTransformationExtraArgs:
    """``inner`` as an optax transformation with extra-args support.

    Args:
      inner: an optax ``GradientTransformation`` (or anything with ``init`` and ``update``).

    Returns:
      ``optax.with_extra_args_support(inner)``.

    Raises:
      TypeError: ``inner`` has no ``init`` and ``update``.
    """
    if not isinstance(inner, optax.GradientTransformation) and not (hasattr(inner, "init") and hasattr(inner, "update")):
        raise TypeError(f"inner must be an optax GradientTransformation, got {type(inner).__name__}")
    return optax.with_extra_args_support(inner)


def _all_inexact(tree) -> bool:
    return all(is_inexact_array(x) for x in jax.tree_util.tree_leaves(tree))


def numeric_leaves_only(inner: Any) -> optax.GradientTransformationExtraArgs:
    """``inner`` run on the floating and complex leaves only; the others pass through untouched.

    Integer, bool and PRNG-key leaves (``float0`` gradients) keep their gradients as updates,
    through ``optax.masked``. See docs/design.md#loss-scaling.

    Args:
      inner: the optax transformation to run on the inexact leaves.

    Returns:
      An ``optax.GradientTransformationExtraArgs``; its state is ``inner``'s, or an
      ``optax.MaskedState`` around it when the params hold non-inexact leaves.
    """
    inner = check_inner(inner)
    if isinstance(inner, _NumericLeavesOnly):
        return inner  # already leaves them alone (master_weights, or wrapped before)
    masked = optax.masked(inner, lambda tree: jax.tree_util.tree_map(is_inexact_array, tree))

    def init_fn(params):
        return inner.init(params) if _all_inexact(params) else masked.init(params)

    def update_fn(updates, state, params=None, **extra_args):
        tx = inner if _all_inexact(updates if params is None else params) else masked
        return tx.update(updates, state, params, **extra_args)

    return _NumericLeavesOnly(init_fn, update_fn)


def master_weights(inner: optax.GradientTransformation, master_dtype: Any = jnp.float32
                   ) -> optax.GradientTransformationExtraArgs:
    """Keeps a ``master_dtype`` copy of the params and runs ``inner`` on it (Apex O2).

    ``update`` returns the updates that move each half param onto the cast of the new master;
    [`jaxmp.apply_updates`][jaxmp.apply_updates] with the state returns exactly that cast. Compose it
    under `jaxmp._scaling._transform.unscale_and_skip`. See docs/design.md#loss-scaling.

    Args:
      inner: the optax transformation run on the master copy.
      master_dtype: dtype of the master copy (float32 or wider).

    Returns:
      An ``optax.GradientTransformationExtraArgs`` whose state is `jaxmp._scaling._transform.MasterWeightsState`.

    Raises:
      ValueError: a half-precision ``master_dtype``.
    """
    inner = check_inner(inner)
    # The master copy keeps int and key leaves as they are; the inner chain never sees them.
    inner = numeric_leaves_only(inner)
    master_dtype = _check_master_dtype(master_dtype)

    def init_fn(params):
        _tree.check_all_arrays(params, "params")
        # A real copy: float32 params (norms under O2) would otherwise share buffers with the
        # master, and donating the state would donate the same buffer twice.
        master = jax.tree_util.tree_map(
            lambda x: jnp.array(x, dtype=master_dtype if is_floating_array(x) else None, copy=True), params)
        return MasterWeightsState(inner.init(master), master)

    def update_fn(grads, state, params=None, **extra_args):
        master = state.master_params
        _tree.check_same_structure(grads, master, "gradients", "master params")
        if params is not None:
            _tree.check_same_structure(params, master, "params", "master params")
        # The half params' dtypes; gradients may arrive in float32 for bfloat16 params.
        ref = grads if params is None else params
        dtypes = jax.tree_util.tree_map(lambda p: jnp.asarray(p).dtype, ref)
        grads = jax.tree_util.tree_map(lambda g: g.astype(master_dtype) if is_floating_array(g) else g, grads)
        updates, inner_state = inner.update(grads, state.inner_state, master, **extra_args)
        stepped = add_floating(master, updates)
        # The returned updates move the half params onto the new master; apply_updates with
        # the state is the exact path (cast of the master), optax's is within rounding.
        deltas = jax.tree_util.tree_map(lambda new, old, d: _delta(new, old, d, master_dtype), stepped, master, dtypes)
        return deltas, MasterWeightsState(inner_state, stepped)

    return _MasterWeights(init_fn, update_fn)


def _check_master_dtype(master_dtype: Any) -> np.dtype:
    """A master dtype that can hold the params' small updates: float32 or wider (docs/design.md#loss-scaling)."""
    dt = float_dtype(master_dtype, "master_dtype")
    if dt.itemsize < 4:
        raise ValueError(
            f"master_dtype={dt.name}: a master copy in half precision drops every update smaller than half "
            f"an ulp of its param ({dt.name} keeps {jnp.finfo(dt).nmant + 1} significant bits, so a small "
            "learning rate never moves it), which is what a master copy exists to prevent; use "
            "master_dtype=jnp.float32 (the default), or master_weights=False to train the params directly")
    return dt


def _delta(new, old, dtype, master_dtype):
    """The update moving a param of ``dtype`` from the cast of ``old`` to the cast of ``new`` (master leaves)."""
    if not is_inexact_array(new):
        return jnp.zeros_like(new)
    # Subtract in the master's precision, where the difference of two casts is exact; a complex
    # master keeps the param's own dtype (no real master dtype holds it).
    wide = dtype if jnp.issubdtype(dtype, jnp.complexfloating) else master_dtype
    a, b = new.astype(dtype).astype(wide), old.astype(dtype).astype(wide)
    # A param the step leaves as it was gets a zero update, also where it holds inf (a -inf
    # mask): inf - inf would make it NaN, and the step would be skipped for good.
    return jnp.where(a == b, jnp.zeros_like(a), a - b).astype(dtype)


def _unscale(loss_scale, grads, keeps_master: bool):
    if keeps_master:
        # Unscale in float32: a half gradient cast back to half after unscaling could underflow
        # before it reaches the master copy.
        return loss_scale.unscale(grads)
    # Unscale in float32, then hand the inner chain gradients in their own dtype.
    return jax.tree_util.tree_map(
        lambda u, g: u.astype(g.dtype) if is_inexact_array(u) else u, loss_scale.unscale(grads), grads)


def apply_to_params(params, updates, state=None):
    """New params from ``updates``; with a master copy in ``state``, its exact cast to each param's dtype."""
    found = _tree.find_states(state, MasterWeightsState) if state is not None else []
    if found:
        state_checks.check_nothing_after_master(state, MasterWeightsState)
        master = found[0].master_params
        _tree.check_same_structure(params, master, "params", "master params")
        return jax.tree_util.tree_map(
            lambda p, m: m.astype(jnp.asarray(p).dtype) if is_inexact_array(m) else p, params, master)
    return add_floating(params, updates)


class _StepPlan(NamedTuple):
    """What one update does, decided once (from static facts: dtypes, the state's structure, the backend).

    Every flag the step reads is here, so the step's variations are one record, not a matrix of
    arguments.
    """

    keeps_master: bool  # the inner state holds a MasterWeightsState
    bounded: bool       # the gradient bound replaces the check after the update (docs/design.md#the-gradient-bound)
    use_cond: bool      # skip with lax.cond (only the taken branch runs) rather than a select
    from_master: bool   # fused with a master copy: the new params are made once, from the chosen master
    fused_inner: bool   # the inner step returns the new params instead of the updates
    check_after: bool   # check the updates (or new params) and float16 state after the update
    fold_ok: bool       # jaxmp._scaling._fold is exact for this loss scale


def _inner_step(inner, plan: _StepPlan, grads, grads_finite, state, params, extra_args, check=None):
    """The inner update on a finite step; ``-0.0`` updates and the old inner state otherwise.

    Returns ``(out, inner_state, updates_finite)``. ``check(out, inner_state) -> bool`` (the check of
    the updates, or None): evaluated on the update before the skip and folded into its verdict, so
    a step with non-finite updates is skipped like one with non-finite gradients. XLA keeps of that
    evaluation only what the check reads (one fused reduction, no state written), and the state is
    updated in place under the skip: no select against the old state, which would keep it alive.

    The gradients are unscaled inside the step, so XLA fuses the unscaling into the inner chain and
    no unscaled copy is written out; reductions are folded (`jaxmp._scaling._fold`). ``plan.fused_inner``:
    return the new params instead of the updates, so the updates are never written out and read back.
    """
    loss_scale, fused = state.loss_scale, plan.fused_inner

    def inner_fn(g, ls):
        return inner.update(_unscale(ls, g, plan.keeps_master), state.inner_state, params, **extra_args)

    ref = grads if params is None else params
    try:
        closed, shapes = jax.make_jaxpr(inner_fn, return_shape=True)(grads, loss_scale)
    except (ValueError, TypeError, AttributeError) as e:
        state_checks.check_state_matches(inner, state.inner_state, ref)  # a state made for other params: named
        if params is not None:
            raise
        # Weight decay, LAMB/LARS, lookahead... read the params; optax's own message (or a raw
        # AttributeError on None) does not say which call to fix.
        raise ValueError(
            f"the inner optimizer needs the params, but tx.update(grads, state) was called without them: call "
            f"tx.update(grads, state, params) (or use loss_scaling(..., master_weights=True), which keeps its own "
            f"float32 copy). The inner optimizer said: {type(e).__name__}: {e}") from e
    misuse.check_update_constants(closed)
    state_checks.check_state_types(state.inner_state, shapes[1], lambda: state_checks.check_state_matches(inner, state.inner_state, ref))
    grad_leaves = jax.tree_util.tree_leaves(grads)
    scale_leaves = jax.tree_util.tree_leaves(loss_scale)
    scale_positions = [len(grad_leaves) + i for i, x in enumerate(scale_leaves) if is_floating_array(x)] \
        if plan.fold_ok else []
    out_tree = jax.tree_util.tree_structure(shapes)

    def inner_update(gl=grad_leaves):
        flat = fold.eval_folded(closed, [*gl, *scale_leaves], scale_positions)
        return jax.tree_util.tree_unflatten(out_tree, flat)

    def apply(gl=grad_leaves):
        updates, inner_state = inner_update(gl)
        return (apply_to_params(params, updates, inner_state) if fused else updates), inner_state

    def skip():
        if fused:
            return params, state.inner_state
        return (jax.tree_util.tree_map(lambda s: _negative_zeros(jnp.zeros(s.shape, s.dtype)), shapes[0]),
                state.inner_state)

    updates_finite = jnp.array(True)
    if check is not None:
        updates_finite = check(*apply())
    verdict = grads_finite & updates_finite
    if plan.use_cond:
        # Only the taken branch runs, so the applied inner chain never sees non-finite gradients
        # and XLA can update the optimizer state in place.
        operands = _cpu_layout.cond_operands(grad_leaves)  # XLA:CPU layouts: see there
        out, inner_state = jax.lax.cond(verdict, lambda ops: apply(_cpu_layout.restore(ops, grad_leaves)),
                                        lambda ops: skip(), operands)
        return out, inner_state, updates_finite
    out, inner_state = apply()  # the same program as the check's: XLA computes it once
    old, _ = skip() if fused else (jax.tree_util.tree_map(_negative_zeros, out), None)
    return keep_if_finite(verdict, out, old), keep_if_finite(verdict, inner_state, state.inner_state), updates_finite


def unscale_and_skip(inner: optax.GradientTransformation, loss_scale: Any = "dynamic", *,
                     axis_name: Any = None, skip_with: str = "auto",
                     check_updates: bool | None = None) -> FusedTransformation:
    """Unscales gradients, skips non-finite steps and adjusts the loss scale around ``inner``.

    The loss-scaling half of [`loss_scaling`][jaxmp.loss_scaling]; compose with
    `jaxmp._scaling._transform.master_weights` as ``unscale_and_skip(master_weights(inner))``.

    Args:
      inner: the optax transformation to wrap.
      loss_scale: a loss-scale object or a spec for [`jaxmp.make_loss_scale`][jaxmp.make_loss_scale].
      axis_name: the ``pmap``/``shard_map`` axis to agree on the finite verdict over.
      skip_with: ``"cond"``, ``"select"`` or ``"auto"``, as in [`loss_scaling`][jaxmp.loss_scaling].
      check_updates: also skip steps whose updates are non-finite, as in [`loss_scaling`][jaxmp.loss_scaling].

    Returns:
      A `jaxmp._scaling._transform.FusedTransformation` whose state is [`LossScalingState`][jaxmp.LossScalingState];
      ``update`` takes ``value=loss`` to tell a non-finite loss from non-finite gradients.

    Raises:
      ValueError: an unknown ``skip_with``.
      TypeError: ``check_updates`` is not None or a bool.
    """
    return _unscale_and_skip(inner, loss_scale, axis_name, skip_with, check_updates, check_bf16=False)


def _unscale_and_skip(inner: optax.GradientTransformation, loss_scale: Any, axis_name: Any, skip_with: str,
                      check_updates: bool | None, *, check_bf16: bool) -> FusedTransformation:
    # check_bf16: loss_scaling was not told master_weights, so bfloat16 params without a master
    # copy may be the O2-bf16 mistake (see misuse.check_bf16_without_master).
    inner = check_inner(inner)
    # Int, bool and PRNG-key params (float0 gradients) pass through; optax would multiply them.
    inner = numeric_leaves_only(inner)
    axis_name = optional_axis_name(axis_name)  # a list of names becomes the tuple JAX takes
    initial_scale = make_loss_scale(loss_scale)
    if skip_with not in ("auto", "cond", "select"):
        raise ValueError(f"skip_with must be 'auto', 'cond' or 'select', got {skip_with!r}")
    if check_updates is not None and not isinstance(check_updates, bool):
        raise TypeError(f"check_updates must be None or a bool, got {type(check_updates).__name__}")

    def init_fn(params):
        _tree.check_all_arrays(params, "params")
        inner_state = inner.init(params)
        misuse.check_init(params, inner_state, LossScalingState, MasterWeightsState,
                          scaled=not isinstance(initial_scale, NoOpLossScale))
        if check_bf16:
            misuse.check_bf16_without_master(params, inner_state, MasterWeightsState)
        misuse.check_inner_state(inner_state)
        return LossScalingState(
            inner_state=inner_state,
            # Fresh buffers on every init: a state donated to a jitted step deletes its buffers,
            # which must not be those of every other state this transform hands out.
            loss_scale=jax.tree_util.tree_map(lambda x: jnp.array(x, copy=True), initial_scale),
            last_step_finite=jnp.array(True),
            consecutive_skips=jnp.zeros([], jnp.int32),
            total_skips=jnp.zeros([], jnp.int32),
            skip_reason=jnp.zeros([], jnp.int32),
        )

    def check_args(grads, state, params):
        if not isinstance(state, LossScalingState):
            raise TypeError(f"state must be the LossScalingState made by this transform's init, got {type(state).__name__}")
        _tree.check_all_arrays(grads, "gradient")
        if params is not None:
            _tree.check_same_structure(grads, params, "gradients", "params")

    def update_fn(grads, state, params=None, **extra_args):
        check_args(grads, state, params)
        # Called from each entry itself: misuse's warnings name the line that called the entry.
        misuse.check_gradients(grads, state.loss_scale, dynamic=isinstance(state.loss_scale, DynamicLossScale))
        return step(grads, state, params, extra_args, fused=False)

    def update_and_apply_fn(grads, state, params, **extra_args):
        if params is None:
            raise ValueError("update_and_apply needs the params")
        check_args(grads, state, params)
        misuse.check_gradients(grads, state.loss_scale, dynamic=isinstance(state.loss_scale, DynamicLossScale))
        return step(grads, state, params, extra_args, fused=True)

    def plan_of(grads, state, params, fused) -> _StepPlan:
        keeps_master = bool(_tree.find_states(state.inner_state, MasterWeightsState))
        # With a master copy and no float16 anywhere the inner chain runs in float32 on float32
        # state, as without masters; what half precision adds is the cast of the master to the
        # params. The check after the update (a pass over the new params and a select that keeps
        # the old state alive beside the new one: 1.8x the bytes of a hand-written skip) is then
        # replaced by a bound folded into the gradient check, which proves the state and the
        # master cannot overflow (docs/design.md#the-gradient-bound). float16 anywhere keeps it.
        bounded = check_updates is None and keeps_master and not _float16_leaves((grads, state.inner_state, params))
        half_arithmetic = not bounded and (keeps_master or _has_half((grads, state.inner_state)))
        # With a master copy the fused step's params are the master's cast: they are made once,
        # from the master the skip has already chosen, instead of being chosen between the cast
        # of the new master and the old params. The same bits (the params are the cast of the
        # master they were stepped from, and the master is their exact widening at init), but no
        # select reads the old params: under ZeRO the params are replicated and the master
        # sharded, so that select held a copy of the old params' slice (measured: docs/parallel.md).
        from_master = fused and keeps_master
        return _StepPlan(
            keeps_master=keeps_master, bounded=bounded,
            use_cond=skip_with == "cond" or (skip_with == "auto" and jax.default_backend() != "gpu"),
            from_master=from_master, fused_inner=fused and not from_master,
            check_after=half_arithmetic if check_updates is None else check_updates,
            fold_ok=fold_ok(state.loss_scale))

    def step(grads, state, params, extra_args, fused):
        """Both entries' step; ``fused``: return the new params instead of the updates."""
        plan = plan_of(grads, state, params, fused)
        state_checks.check_master_matches(inner, plan.keeps_master, grads if params is None else params,
                                          isinstance(inner, _MasterWeights), MasterWeightsState)

        def unscale(g):
            return _unscale(state.loss_scale, g, plan.keeps_master)

        if plan.bounded:
            # A boolean reduction, as all_finite's: a float max would lose a NaN in a cross-device
            # max reduction under ZeRO (XLA:CPU's max does not propagate it). A finite gradient
            # past the bound is reported as reason 2 too: telling them apart is a second pass.
            grads_finite = _verdict(_all_within(unscale(grads), GRADIENT_BOUND), axis_name)
        else:
            grads_finite = _verdict(all_finite(unscale(grads)), axis_name)

        def updates_ok(out, inner_state):
            # Finite gradients can still give a non-finite update (Adam's epsilon flushed to zero
            # in float16, a master value past float16's range) or a non-finite float16 state
            # (pure-fp16 Adam's nu = g**2 past 65504 while the update stays finite, which would
            # freeze that param for good): such a step is skipped too. With a master copy the new
            # params (the master's cast) are checked, not the updates. Evaluated by _inner_step
            # before the skip, on the update it would apply (docs/benchmarks.md#the-o2-optimizer-step):
            # checked after it, the old state had to stay alive beside the new one for a select
            # (overhead.py's O2-fp16 MLP step: 1.277x the hand-written floor's bytes and 1.006x its
            # temporaries, against 1.173x and 0.587x this way).
            ok = all_finite(apply_to_params(params, out, inner_state) if plan.from_master else out)
            ok = ok & all_finite(_float16_leaves(inner_state))
            return _verdict(ok | jnp.logical_not(grads_finite), axis_name)

        # With a master copy the check runs before the skip (the state then updates in place). Without
        # one it runs after: evaluated before, the inner update ran twice for the lean recipes'
        # quantized and stochastically rounded state (bf16-sr-8bit: 148 -> 200 bytes accessed per
        # param in tests/lean/test_lean_quantized.py's update), where no old copy was kept alive.
        before = plan.check_after and plan.from_master
        out, inner_state, updates_finite = _inner_step(inner, plan, grads, grads_finite, state, params, extra_args,
                                                       updates_ok if before else None)
        if plan.check_after and not before:
            updates_finite = updates_ok(out, inner_state)
            inner_state = keep_if_finite(updates_finite, inner_state, state.inner_state)
            old = params if fused else jax.tree_util.tree_map(_negative_zeros, out)
            out = keep_if_finite(updates_finite, out, old)
        if plan.from_master:
            out = apply_to_params(params, out, inner_state)
        finite = grads_finite & updates_finite

        reason = jnp.where(grads_finite, jnp.where(updates_finite, APPLIED, NON_FINITE_UPDATES), NON_FINITE_GRADIENTS)
        if extra_args.get("value") is not None:
            loss_finite = _verdict(all_finite(jnp.asarray(extra_args["value"])), axis_name)
            reason = jnp.where(loss_finite | finite, reason, NON_FINITE_LOSS)
        skipped = jnp.logical_not(finite)
        new_state = LossScalingState(
            inner_state=inner_state,
            loss_scale=state.loss_scale.adjust(finite),
            last_step_finite=finite,
            consecutive_skips=jnp.where(skipped, state.consecutive_skips + 1, 0).astype(jnp.int32),
            total_skips=(state.total_skips + skipped.astype(jnp.int32)).astype(jnp.int32),
            skip_reason=reason.astype(jnp.int32),
        )
        return out, new_state

    def fold_ok(loss_scale):
        # Whether jaxmp._scaling._fold is exact for this scale (the loss scale knows; see fold_is_exact).
        return isinstance(loss_scale, LOSS_SCALE_TYPES) and loss_scale.fold_is_exact(initial_scale)

    return FusedTransformation(init_fn, update_fn, update_and_apply_fn)


def loss_scaling(inner: optax.GradientTransformation, loss_scale: LossScaleLike = "dynamic", *,
                 axis_name: AxisName | None = None, master_weights: bool | None = None,
                 master_dtype: jax.typing.DTypeLike | None = None, skip_with: str = "auto",
                 check_updates: bool | None = None) -> FusedTransformation:
    """Wraps an optax transformation with loss scaling, non-finite step skipping and master weights.

    ``unscale_and_skip(master_weights(inner, master_dtype), loss_scale, ...)`` with ``master_weights``,
    else ``unscale_and_skip(inner, loss_scale, ...)``. Each update unscales the gradients before the
    inner chain, skips a step whose gradients (or, under half arithmetic, updates) are non-finite
    (``-0.0`` updates, inner state bitwise unchanged) and adjusts the scale. What one update does,
    gradient accumulation and master weights: see docs/design.md#loss-scaling.

    Args:
      inner: the optax transformation to wrap (e.g. ``optax.chain(clip, adamw)``).
      loss_scale: a loss-scale object or a spec for [`jaxmp.make_loss_scale`][jaxmp.make_loss_scale]
        (``"dynamic"`` default; ``"none"`` for bfloat16/float32; ``"torch"``; a number).
      axis_name: the ``pmap``/``shard_map`` axis to agree on the finite verdict over.
      master_weights: keep a ``master_dtype`` copy of the params in the state. ``None`` (default)
        is ``False`` but warns when bfloat16 params get no master copy; ``False`` says so on purpose.
      master_dtype: dtype of the master copy, float32 (``None``, the default) or wider; only
        with ``master_weights=True`` (without a master copy it would do nothing: refused).
      skip_with: ``"cond"``, ``"select"`` or ``"auto"`` (default: ``"select"`` on GPU, ``"cond"``
        elsewhere): how a step is skipped inside the compiled program.
      check_updates: also skip a step whose updates are non-finite. ``None`` (default): exactly
        when half arithmetic can cause it (master weights, or half gradients or state).

    Returns:
      A `jaxmp._scaling._transform.FusedTransformation` whose state is [`LossScalingState`][jaxmp.LossScalingState].

    Raises:
      TypeError: ``master_weights`` or ``check_updates`` is not a bool.
      ValueError: a half-precision ``master_dtype``, a ``master_dtype`` without
        ``master_weights=True``, or an unknown ``skip_with``.

    Example:
      >>> import jax.numpy as jnp, optax, jaxmp
      >>> tx = jaxmp.loss_scaling(optax.adam(1e-3))
      >>> params = {"w": jnp.ones(3)}
      >>> state = tx.init(params)
      >>> loss, grads = jaxmp.value_and_grad(lambda p: jnp.sum(p["w"] ** 2), state)(params)
      >>> updates, state = tx.update(grads, state, params)
      >>> loss, jaxmp.apply_updates(params, updates, state)["w"]
      (Array(3., dtype=float32), Array([0.999, 0.999, 0.999], dtype=float32))
    """
    if master_weights is not None and not isinstance(master_weights, bool):
        raise TypeError(f"master_weights must be a bool, got {type(master_weights).__name__}")
    if master_weights:
        inner = _master_weights_factory(inner, jnp.float32 if master_dtype is None else master_dtype)
    elif master_dtype is not None:
        dt = float_dtype(master_dtype, "master_dtype")
        # Accepted and ignored before, for float32 and half params alike: a setting that does
        # nothing says so.
        raise ValueError(
            f"master_dtype={dt.name} is given without master_weights=True: the master copy is kept only with "
            f"master_weights=True, so it would do nothing (the params train in their own dtype); pass "
            f"master_weights=True to keep a master copy (master_dtype float32, the default, or wider), or drop "
            f"master_dtype")
    return _unscale_and_skip(inner, loss_scale, axis_name, skip_with, check_updates,
                             check_bf16=master_weights is None)


_master_weights_factory = master_weights


def update_and_apply(tx: Any, grads: Any, opt_state: Any, params: Any, **extra_args) -> tuple[Any, Any]:
    """``tx.update`` then [`jaxmp.apply_updates`][jaxmp.apply_updates] as one fused step.

    A [`loss_scaling`][jaxmp.loss_scaling] transform steps the params inside the skip; any other
    transform falls back to ``tx.update`` and ``apply_updates``. See docs/design.md#loss-scaling.
    With a master copy the params are cast from the master the skip kept (no select against the old
    params, which under ZeRO would hold a copy of their slice).

    Args:
      tx: the optax transformation (usually ``jaxmp.loss_scaling(...)``).
      grads: the scaled gradients (from [`jaxmp.value_and_grad`][jaxmp.value_and_grad]).
      opt_state: ``tx``'s state.
      params: the current params.
      **extra_args: forwarded to ``tx.update`` (e.g. ``value=loss``).

    Returns:
      ``(new_params, new_opt_state)``.

    Raises:
      ValueError: an optax chain with transforms after the one keeping master weights.
    """
    if isinstance(tx, FusedTransformation):
        return tx.update_and_apply(grads, opt_state, params, **extra_args)
    updates, new_state = tx.update(grads, opt_state, params, **extra_args)
    new_params = apply_to_params(params, updates, new_state)
    found = _tree.find_states(new_state, LossScalingState)
    if len(found) == 1:  # -0.0 updates keep the params; selecting keeps NaN payloads bit for bit too
        new_params = keep_if_finite(found[0].last_step_finite, new_params, params)
    return new_params, new_state

