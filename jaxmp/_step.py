"""The one train-step builder: scaled gradients, all-reduce, the fused skip-aware update.

The Linen and NNX steps (`jaxmp.flax._steps`) and the pmap and sharded-jit steps (`jaxmp.parallel`)
are thin adapters over `make_step`; every step reports the same metrics (`step_metrics`).
What one step does, in order: see docs/design.md#the-train-step.
"""

from __future__ import annotations

import contextlib

import dataclasses
from collections.abc import Mapping
from typing import Any, Callable, ClassVar, NamedTuple, TypeVar, dataclass_transform

import jax
import jax.numpy as jnp
import optax

from jaxmp import fp8
from jaxmp._scaling._collectives import all_reduce_gradients, check_axis_name, mean_model_state
from jaxmp.fp8._seams import FP8_COLLECTION
from jaxmp._scaling._grad import value_and_grad
from jaxmp._scaling._opt_state import find_loss_scaling_state, get_loss_scale, scaling_stats
from jaxmp._scaling._skip import keep_if_finite
from jaxmp._scaling._transform import update_and_apply


class Fp8Hooks(NamedTuple):
    """How a step finds, feeds and updates delayed-scaling fp8 state inside its model state.

    Attributes:
      split: ``model_state -> (fp8_state, rest)``; ``fp8_state`` is differentiated (its
        gradient is the amaxes the step observed), ``rest`` is not.
      merge: ``(rest, fp8_state) -> model_state``, what the loss function is given (also used
        to put the updated fp8 state into the new model state).
      update: ``(fp8_state, observed) -> new fp8_state`` ([`jaxmp.fp8.update_state`][jaxmp.fp8.update_state]).
    """

    split: Callable[[Any], tuple[Any, Any]]
    merge: Callable[[Any, Any], Any]
    update: Callable[[Any, Any], Any]


def _reduce_whole(model_state: Any, mean: Callable[[Any], Any]) -> Any:
    return mean(model_state)


class StateRules(NamedTuple):
    """What a kind of model state needs from the step (Linen's collections, NNX's variable groups).

    The default is a plain pytree: averaged whole by the layout, restored whole on a skipped step.

    Attributes:
      fp8: delayed-scaling fp8 state inside the model state (`Fp8Hooks`), or None.
      keep: ``(finite, new, old) -> kept``, the skip rule (NNX keeps RNG counters moving).
      reduce: ``(model_state, mean) -> model_state``: applies the layout's mean over the replicas
        (`Strategy.reduce_model_state`) to the parts that are per-replica statistics.
    """

    fp8: Fp8Hooks | None = None
    keep: Callable[[Any, Any, Any], Any] = keep_if_finite
    reduce: Callable[[Any, Callable[[Any], Any]], Any] = _reduce_whole


#: A plain model-state pytree (the parallel steps' ``model_state=True``, or none at all).
PLAIN_STATE = StateRules()


class Strategy:
    """How one layout differentiates, reduces and places a step; this base is the single-device one.

    One small object per layout replaces a bag of hooks: `Replicas` (a bound ``pmap`` /
    ``shard_map`` axis) and `jaxmp.parallel._shard_step.Sharded` (sharded ``jit``: replicated,
    zero, fsdp). `make_step` calls, in order: `wrap_loss` once, `differentiate` (None: the
    default, `jaxmp.value_and_grad`), `reduce_grads`, `reduce_loss`, `reduce_model_state`,
    `place_params`; `make_loss_fn_step` also reads `replica_key` and `per_replica_aux`.

    Attributes:
      differentiate: ``differentiate(loss_fn, opt_state, params, model_state, batch, rng) ->
        ((loss, (new_model_state, aux)), grads)`` with ``grads`` those of the loss scaled by the
        loss scale in ``opt_state``, already reduced; None for the default differentiation.
      per_replica_aux: ``aux`` stays per replica (a ``batch_stats`` in it would drift apart).
    """

    differentiate: Callable[..., Any] | None = None
    per_replica_aux: bool = False

    def wrap_loss(self, loss_fn: Callable[..., Any]) -> Callable[..., Any]:
        """The loss the step differentiates, ``(params, model_state, batch, rng) -> (loss, (state, aux))``."""
        return loss_fn

    def reduce_grads(self, grads: Any) -> Any:
        """The gradient reduction over the replicas; runs before ``tx.update``, so a NaN on one
        replica is seen by every replica's finite check."""
        return grads

    def reduce_loss(self, loss: jax.Array) -> jax.Array:
        """The loss's reduction (what ``tx.update`` sees: every replica records the same skip reason)."""
        return loss

    def reduce_model_state(self, model_state: Any) -> Any:
        """The mean of per-replica model state (BatchNorm statistics) over the replicas."""
        return model_state

    def place_params(self, params: Any) -> Any:
        """Where the new params are made."""
        return params

    def replica_key(self, rng: Any) -> Any:
        """This replica's key from the step's one key (dropout masks differ between shards)."""
        return rng

    def update_context(self) -> contextlib.AbstractContextManager:
        """Entered around ``tx.update``'s trace (a layout's hints to the optimizer)."""
        return contextlib.nullcontext()


#: The single-device layout (and a global view under sharded ``jit`` needing no reduction).
LOCAL = Strategy()


class Replicas(Strategy):
    """A bound ``pmap`` / ``shard_map`` axis: gradients averaged over it in ``reduce_dtype``
    (`all_reduce_gradients`), the loss and the model state ``pmean``-ed, one key per replica."""

    per_replica_aux = True

    def __init__(self, axis_name: Any, reduce_dtype: Any = jnp.float32):
        self.axis_name = check_axis_name(axis_name)
        self.reduce_dtype = reduce_dtype

    def reduce_grads(self, grads: Any) -> Any:
        return all_reduce_gradients(grads, self.axis_name, self.reduce_dtype)

    def reduce_loss(self, loss: jax.Array) -> jax.Array:
        return jax.lax.pmean(loss, self.axis_name)

    def reduce_model_state(self, model_state: Any) -> Any:
        return mean_model_state(model_state, self.axis_name)

    def replica_key(self, rng: Any) -> Any:
        return jax.random.fold_in(rng, jax.lax.axis_index(self.axis_name))


def strategy_for(axis_name: Any) -> Strategy:
    """`LOCAL` without an axis, else `Replicas` over it (the Flax steps' ``axis_name``)."""
    return LOCAL if axis_name is None else Replicas(axis_name)


class StepResult(NamedTuple):
    """What one step returns.

    Attributes:
      params: the new params (bitwise the old ones on a skipped step).
      model_state: the new model state (bitwise the old one on a skipped step).
      opt_state: the new optimizer state (inner state bitwise unchanged on a skipped step).
      loss: the true (unscaled) loss, float32, averaged over the replicas under `Replicas`.
      aux: the loss function's auxiliary output (per replica).
      finite: bool [], whether the step was applied.
      loss_scale: float32 [], the scale this step's loss was multiplied by.
    """

    params: Any
    model_state: Any
    opt_state: Any
    loss: jax.Array
    aux: Any
    finite: jax.Array
    loss_scale: jax.Array


_Record = TypeVar("_Record", bound=type)


@dataclass_transform(frozen_default=True, field_specifiers=(dataclasses.field,))
def step_record(cls: _Record) -> _Record:
    """Makes ``cls`` (`TrainStep` or a builder's extension of it) a frozen, slotted step record.

    The dataclass decorator gives every frozen class its own ``__setattr__``; this one replaces
    it with the refusal that says what to do (`_refuse_assignment`), on the base and each
    extension alike. Slotted: no ``__dict__`` for ``jax.jit``'s ``functools.wraps`` to copy, so
    a field such as ``lower`` never hides the jitted function's own.

    Args:
      cls: the record class (its fields as annotations).

    Returns:
      The dataclass.

    Example (the pmap step's, `jaxmp.parallel._pmap.PmapTrainStep`, shortened)::

        @step_record
        class PmapTrainStep(TrainStep):
            builder_call: ClassVar[str] = "jaxmp.parallel.make_pmap_train_step(loss_fn, tx)"
            pmapped: Callable[..., Any]
    """
    record: Any = dataclasses.dataclass(frozen=True, eq=False, slots=True, weakref_slot=True)(cls)
    record.__setattr__ = _refuse_assignment
    record.__delattr__ = _refuse_assignment
    return record


def _refuse_assignment(self: "TrainStep", name: str, value: Any = None) -> None:
    # dataclasses' frozen __setattr__ says only "cannot assign to field"; this says what to do.
    raise dataclasses.FrozenInstanceError(
        f"cannot assign to TrainStep.{name}: a step is immutable (its run and loss_view were built around its "
        f"loss_fn). Build a new one with the call that built it, {self.builder_call}, or derive one with "
        "dataclasses.replace(step, run=..., loss_view=...)")


def _kinds(cls: type[TrainStep]) -> list[type[TrainStep]]:
    """``cls`` and every step record extending it."""
    subs: list[type[TrainStep]] = cls.__subclasses__()
    return [cls] + [k for sub in subs for k in _kinds(sub)]


@step_record
class TrainStep:
    """What the train-step builders return: the step, called as before, and what it is made of.

    ``step(*args)`` runs ``step.run(*args)``; ``jax.jit(step)`` compiles it under ``run``'s
    name and signature. A typed record, as optax's ``GradientTransformation`` is, but not a
    tuple: a step is no pytree, and ``jax.jit`` keys its caches on the step itself. These are
    the fields every step has (the Flax step's are these alone); a builder with more extends
    the record, as optax's ``GradientTransformationExtraArgs`` extends ``GradientTransformation``:
    the sharded step's `jaxmp.parallel._sharding.ShardedTrainStep` (``layout``, ``lower``, ...),
    the pmap step's `jaxmp.parallel._pmap.PmapTrainStep` (``pmapped``, ...). A field another
    kind of step has is an ``AttributeError`` naming that kind.

    Attributes:
      run: the step function.
      loss_fn: the loss the step wraps (the user's; the Linen step's ``loss_fn(logits, labels)``).
      loss_view: ``loss_view(*step_args) -> LossView``, the same loss as one function of plain
        arrays on the step's arguments: what the precision debugger runs (`jaxmp._scaling._loss_view`).
    """

    #: The call that builds a step of this kind, for messages (each extension names its builder).
    builder_call: ClassVar[str] = "jaxmp.flax.make_train_step(loss_fn=loss_fn)"
    #: How a step of this kind is called, for messages.
    call_form: ClassVar[str] = "state, metrics = step(state, batch)"

    run: Callable[..., Any]
    loss_fn: Callable[..., Any] | None
    loss_view: Callable[..., Any]
    #: ``(run, loss_fn, loss_view)`` as first built: ``dataclasses.replace`` passes it on, so a
    #: new ``loss_fn`` beside the old ``run`` or ``loss_view`` (built around the old loss) is seen.
    #: Keyword-only, so an extension's own fields follow the common ones.
    _built: tuple | None = dataclasses.field(default=None, repr=False, compare=False, kw_only=True)

    def __post_init__(self) -> None:
        if self._built is not None:
            run, loss_fn, view = self._built
            if self.loss_fn is not loss_fn and (self.run is run or self.loss_view is view):
                kept = " and ".join(n for n, same in (("run", self.run is run), ("loss_view", self.loss_view is view))
                                    if same)
                raise ValueError(
                    f"a TrainStep's {kept} {'were' if ' and ' in kept else 'was'} built around its loss_fn: replacing "
                    "loss_fn alone (dataclasses.replace(step, loss_fn=...)) would leave the step training, and the "
                    "precision debugger analysing, the old loss. Build the step again around the new loss, with "
                    f"the call that built this one: {self.builder_call}")
        object.__setattr__(self, "_built", (self.run, self.loss_fn, self.loss_view))

    def __getattr__(self, name: str) -> Any:
        # Reached only for a name this step lacks: one another kind of step has says whose it is.
        owners = [k for k in _kinds(TrainStep) if not name.startswith("__") and name in vars(k)]
        whose = (f": only {' and '.join(f'a {k.__name__} ({k.builder_call})' for k in owners)} "
                 f"{'has' if len(owners) == 1 else 'have'} it" if owners else "")
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}{whose}")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.run(*args, **kwargs)

    def __getitem__(self, index: Any) -> Any:
        # Also what tuple-unpacking a step reaches (it has no __iter__, so it is no Iterable).
        parts = ", ".join(f"step.{f.name}" for f in dataclasses.fields(self) if not f.name.startswith("_"))
        raise TypeError(f"a TrainStep is not a tuple, so it cannot be indexed or unpacked: call it and unpack what it "
                        f"returns, {self.call_form}; its parts are fields ({parts})")

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise TypeError("a jaxmp TrainStep cannot be pickled: its functions close over the loss, the optimizer and "
                        "compiled programs. Save the training state instead (params and opt_state, "
                        "docs/guides/checkpointing.md) and, in the process that loads it, build the step again with "
                        f"the call that built this one: {self.builder_call}")

    # copy.copy / copy.deepcopy would go through __reduce_ex__: a step is immutable, so it is its own copy.
    def __copy__(self) -> "TrainStep":
        return self

    def __deepcopy__(self, memo: Any) -> "TrainStep":
        return self

    # What jax.jit and inspect.signature read: the step's own name and signature, not __call__'s.
    @property
    def __wrapped__(self) -> Callable[..., Any]:
        return self.run

    @property
    def __name__(self) -> str:
        return getattr(self.run, "__name__", "step")


def make_step(loss_fn: Callable[..., Any], tx: Any, strategy: Strategy = LOCAL, *,
              state: StateRules = PLAIN_STATE, pass_value: bool = True) -> Callable[..., StepResult]:
    """Builds ``step(params, model_state, opt_state, batch, rng=None) -> StepResult``.

    Args:
      loss_fn: ``loss_fn(params, model_state, batch, rng) -> (loss, (new_model_state, aux))``,
        the loss a scalar (computed in float32).
      tx: the optax transformation holding a [`jaxmp.loss_scaling`][jaxmp.loss_scaling] state.
      strategy: the layout (`Strategy`): `LOCAL` (default), `Replicas` over a bound axis, or
        the sharded layouts' (`jaxmp.parallel._shard_step.Sharded`). Its ``differentiate``
        excludes ``state.fp8`` (the fp8 state's gradient is taken by the default differentiation).
      state: the model state's rules (`StateRules`: fp8 state, skip rule, which parts are averaged).
      pass_value: give ``tx.update`` the loss as ``value`` (``skip_reason`` then tells a
        non-finite loss from non-finite gradients).

    Returns:
      The step function (not jitted).
    """
    fp8_hooks = state.fp8
    differentiate = strategy.differentiate
    if differentiate is not None and fp8_hooks is not None:
        raise ValueError("make_step: a strategy's differentiate and fp8 state exclude each other (the fp8 "
                         "state's gradient is taken by the default differentiation)")
    loss_fn = strategy.wrap_loss(loss_fn)

    def step(params, model_state, opt_state, batch, rng=None) -> StepResult:
        scale = jnp.asarray(get_loss_scale(opt_state).loss_scale, jnp.float32)
        if differentiate is not None:
            with fp8.gradient_loss_scale(scale):
                (loss, (new_model_state, aux)), grads = differentiate(loss_fn, opt_state, params, model_state,
                                                                      batch, rng)
            return finish(params, model_state, opt_state, scale, (loss, new_model_state, aux), grads, None)
        fp8_state, rest = fp8_hooks.split(model_state) if fp8_hooks is not None else (None, model_state)

        def scaled(p, f):
            with fp8.gradient_loss_scale(scale):  # delayed-scaling fp8 ops report unscaled amaxes
                return loss_fn(p, model_state if fp8_hooks is None else fp8_hooks.merge(rest, f), batch, rng)

        # With delayed fp8 scaling, the gradient with respect to the fp8 state is the amaxes this
        # step observed (jaxmp.fp8.update_state); it never reaches the optimizer.
        (loss, (new_model_state, aux)), (grads, observed) = value_and_grad(
            scaled, opt_state, argnums=(0, 1), has_aux=True)(params, fp8_state)
        return finish(params, model_state, opt_state, scale, (loss, new_model_state, aux), grads,
                      (fp8_state, observed))

    def finish(params, model_state, opt_state, scale, evaluated, grads, fp8_observed):
        # ``evaluated``: the loss function's (loss, new model state, aux) on this replica.
        loss, new_model_state, aux = evaluated
        # Reduce before the update: a NaN on one replica, or an overflowing half-precision sum, is
        # then seen by every replica's finite check.
        grads = strategy.reduce_grads(grads)
        loss = strategy.reduce_loss(jnp.asarray(loss, jnp.float32))
        if new_model_state is not None:
            new_model_state = state.reduce(new_model_state, strategy.reduce_model_state)
        if fp8_hooks is not None:
            fp8_state, observed = fp8_observed
            new_fp8 = fp8_hooks.update(fp8_state, observed)
            new_model_state = fp8_hooks.merge(fp8_hooks.split(new_model_state)[1], new_fp8)
        extra = {"value": loss} if pass_value else {}
        with strategy.update_context():
            new_params, new_opt_state = update_and_apply(tx, grads, opt_state, params, **extra)
        new_params = strategy.place_params(new_params)
        finite = find_loss_scaling_state(new_opt_state).last_step_finite
        new_model_state = state.keep(finite, new_model_state, model_state)
        return StepResult(new_params, new_model_state, new_opt_state, loss, aux, finite, scale)

    return step


def step_metrics(out: StepResult, **extra: Any) -> dict[str, Any]:
    """The metrics of one step, the same keys with the same meaning for every step (Flax, NNX,
    pmap, sharded).

    ``loss_scale`` is the scale this step's loss was multiplied by, the one its
    ``last_step_finite`` and ``loss`` belong to (as torch's ``GradScaler.get_scale()`` read
    before ``scaler.update()``): on an overflow it is the scale that overflowed, and the backed-off
    scale the next step uses is in the returned optimizer state
    (``jaxmp.scaling_stats(opt_state)["loss_scale"]``). The skip counters are after this step.

    Args:
      out: the step's `StepResult`.
      **extra: further entries (``accuracy``, ``aux``).

    Returns:
      A dict: ``loss``, ``loss_scale``, ``last_step_finite`` (whether the step was
      applied), ``consecutive_skips``, ``total_skips``, and ``extra``.
    """
    stats = scaling_stats(out.opt_state)
    stats["loss_scale"] = out.loss_scale
    return dict(loss=out.loss, **stats, **extra)


def check_no_model_state_in_aux(aux: Any) -> None:
    """Raises when a per-replica ``aux`` carries BatchNorm statistics (they would drift apart)."""
    if isinstance(aux, Mapping) and "batch_stats" in aux:
        raise ValueError(
            "loss_fn returned 'batch_stats' in its aux: under pmap aux is per replica and never reduced, so each "
            "replica's BatchNorm statistics would drift apart. Build the step with model_state=True and return "
            "(loss, new_model_state): the statistics are then averaged over the replicas (bitwise equal on every "
            "one) and kept unchanged on skipped steps."
        )


def _optimizer_state_in(tree: Any) -> str | None:
    """``"<type> at <path>"`` of the first optax or jaxmp optimizer state (``...State`` NamedTuple) in ``tree``."""
    def is_state(x: Any) -> bool:
        kind = type(x)
        return (isinstance(x, tuple) and hasattr(kind, "_fields") and kind.__name__.endswith("State")
                and kind.__module__.split(".")[0] in ("optax", "jaxmp"))

    for path, leaf in jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_state)[0]:
        if is_state(leaf):
            return f"{type(leaf).__module__.split('.')[0]}'s {type(leaf).__name__} at {jax.tree_util.keystr(path) or '<root>'}"
    return None


def check_argument_order(params: Any, form: str) -> None:
    """A TypeError when the step's first argument holds an optimizer state: ``params`` and
    ``opt_state`` were swapped (else the params check blames the state's integer counters).

    Args:
      params: the step's first argument.
      form: the step's call, for the message (``"step(params, opt_state, batch)"``).
    """
    found = _optimizer_state_in(params)
    if found is not None:
        raise TypeError(f"the step's first argument holds an optimizer state ({found}): the step is called {form}. "
                        "Were params and opt_state swapped? Pass the params first and the state tx.init returned "
                        "second")


def check_differentiable_params(params: Any) -> None:
    """A TypeError naming the first params leaf the step cannot differentiate (integer, bool, key).

    Checked at trace time; without it ``jax.grad`` fails with a message that names no leaf.
    """
    for path, leaf in jax.tree_util.tree_leaves_with_path(params):
        dtype = getattr(leaf, "dtype", None)
        if dtype is None or not jnp.issubdtype(dtype, jnp.inexact):
            # An optimizer state's counters are integers: say the arguments were swapped instead.
            check_argument_order(params, "step(params[, model_state], opt_state, batch[, rng])")
            raise TypeError(
                f"params leaf at {jax.tree_util.keystr(path) or '<root>'} has dtype {dtype}: the step differentiates "
                "every params leaf, so each must be floating. Keep integer arrays (indices, counters, masks) out of "
                "the params: close over them in loss_fn, pass them in the batch, or carry them as model state "
                "(model_state=True)")


def make_loss_fn_step(loss_fn: Callable, tx: Any, strategy: Strategy, *, has_aux: bool, with_rng: bool,
                      with_model_state: bool = False) -> Callable:
    """`make_step` for a user's ``loss_fn(params[, model_state], batch[, rng])``: the pmap and sharded-jit steps.

    Args:
      loss_fn: ``loss_fn(params, batch)``, with ``model_state`` after the params and ``rng``
        last when asked; returns the loss, ``(loss, aux)`` with ``has_aux``, ``(loss,
        new_model_state)`` with ``with_model_state``, or ``(loss, (new_model_state, aux))`` with both.
      tx: the optax transformation holding a [`jaxmp.loss_scaling`][jaxmp.loss_scaling] state.
      strategy: the layout (`Strategy`): `Replicas` under pmap, the sharded layouts' under
        sharded jit. Its ``replica_key`` gives ``loss_fn`` this replica's rng, and with
        ``per_replica_aux`` an ``aux`` dict holding ``batch_stats`` is refused (it would drift).
      has_aux: whether ``loss_fn`` returns ``aux`` (reported as ``metrics["aux"]``).
      with_rng: whether the step takes an rng (passed to ``loss_fn`` last).
      with_model_state: the step's first argument is ``(params, model_state)``.

    Returns:
      ``body(state, opt_state, batch, rng=None) -> (state, opt_state, metrics)`` (not
      jitted), ``metrics`` from `step_metrics`.
    """
    # optax's name for the loss; the loss-scaling state then tells a NaN loss from NaN gradients.
    pass_value = isinstance(tx, optax.GradientTransformationExtraArgs)

    def canonical(params, model_state, batch, key):
        # The builder's loss signature, (params, model_state, batch, rng) -> (loss, (state, aux)).
        args = ((model_state,) if with_model_state else ()) + (batch,) + ((key,) if with_rng else ())
        out = loss_fn(params, *args)
        if not (has_aux or with_model_state):
            return out, (model_state, None)
        loss, aux = out
        if strategy.per_replica_aux and has_aux and not with_model_state:
            check_no_model_state_in_aux(aux)
        if with_model_state:
            new_model_state, aux = aux if has_aux else (aux, None)
            return loss, (new_model_state, aux)
        return loss, (model_state, aux)

    step = make_step(canonical, tx, strategy, pass_value=pass_value)

    def body(state, opt_state, batch, rng=None):
        params, model_state = state if with_model_state else (state, None)
        check_differentiable_params(params)
        if isinstance(model_state, Mapping) and FP8_COLLECTION in model_state:
            # Its update comes from the amaxes the step observes, which this generic step
            # cannot see: the scales would stay at their initial value without a word.
            raise ValueError(f"the model state holds delayed fp8 scaling state ({FP8_COLLECTION!r}), which this "
                             "generic step would never update: use jaxmp.flax.make_train_step(axis_name=...) "
                             "under pmap, or the 'O2-fp8-current' preset (no state)")
        key = strategy.replica_key(rng) if with_rng else None
        out = step(params, model_state, opt_state, batch, key)
        metrics = step_metrics(out, **({"aux": out.aux} if has_aux else {}))
        if with_model_state:
            return (out.params, out.model_state), out.opt_state, metrics
        return out.params, out.opt_state, metrics

    return body
