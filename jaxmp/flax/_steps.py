"""The Flax train steps side by side: Linen (`make_train_step`, `make_eval_step`) and NNX (`nnx_train_step`).

Both turn their model into the step builder's loss ``(params, model_state, batch, rng) ->
(loss, (new_model_state, accuracy))`` and call `jaxmp._step.make_step` through
`_make_flax_step` (the layout: `jaxmp._step.Replicas` under pmap; the model state's rules:
`jaxmp._step.StateRules`); both report `_flax_metrics`: the metrics of every jaxmp step
(`jaxmp._step.step_metrics`) plus ``accuracy``, averaged over ``axis_name`` under pmap. What
differs is the model's state: Linen's is a dict of collections (``batch_stats``, the fp8
collection), NNX's the graph's variables split into fp8 state, running statistics and the rest
(RNG counters, which keep moving on a skipped step). The public NNX step is
[`jaxmp.flax.nnx.train_step`][jaxmp.flax.nnx.train_step] (it reads the policy off the
[`MixedPrecision`][jaxmp.flax.nnx.MixedPrecision] wrapper); the Linen ones are
[`jaxmp.flax.make_train_step`][jaxmp.flax.make_train_step] and
[`jaxmp.flax.make_eval_step`][jaxmp.flax.make_eval_step].
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import nnx

from jaxmp import fp8
from jaxmp._scaling import _loss_view
from jaxmp._typing import AxisName
from jaxmp._scaling._collectives import optional_axis_name
from jaxmp.flax.fp8 import FP8_COLLECTION, Fp8State
from jaxmp.flax._losses import accuracy, softmax_cross_entropy, split_batch
from jaxmp._scaling._opt_state import find_loss_scaling_state
from jaxmp._scaling._skip import keep_if_finite
from jaxmp._step import Fp8Hooks, StateRules, StepResult, TrainStep, make_step, step_metrics, strategy_for


def _make_flax_step(loss_fn: Callable, tx: Any, axis_name: Any, state: StateRules) -> Callable:
    """`make_step` as both Flax steps use it: the replicas of ``axis_name`` (model state averaged
    only under pmap), and no ``value`` for ``tx.update`` (their ``tx`` is the user's, possibly a
    plain optax one)."""
    return make_step(loss_fn, tx, strategy_for(axis_name), state=state, pass_value=False)


def _linen_reduce(model_state: Any, mean: Callable[[Any], Any]) -> Any:
    # Each replica's BatchNorm saw its own shard: averaged, the statistics stay replicated. The
    # fp8 state is left out: its update (Fp8Hooks.update) reduces it over the axis already.
    return {k: v if k == FP8_COLLECTION else mean(v) for k, v in model_state.items()}


def _flax_metrics(out: StepResult, axis_name: Any) -> dict[str, Any]:
    """Every step's metrics (`step_metrics`) plus the accuracy, averaged over the replicas under pmap."""
    acc = out.aux if axis_name is None else jax.lax.pmean(out.aux, axis_name)
    return step_metrics(out, accuracy=acc)


def _loss_and_logits(state: Any, params: Any, model_state: Any, inputs: Any, labels: Any, loss_fn: Callable,
                     rngs: Any, model_kwargs: dict, train: bool):
    # The fp8 state changes by the step's amax observations, not in the forward pass.
    # Linen returns (out, updates) for any mutable other than False, even an empty list.
    mutable = ([c for c in model_state if c != FP8_COLLECTION] or False) if train else False
    out = state.model.apply({"params": params, **model_state}, inputs, rngs=rngs, mutable=mutable, **model_kwargs)
    logits, new_model_state = out if mutable else (out, {})
    if state.rules.float32_loss:
        logits = logits.astype(jnp.float32)
    return loss_fn(logits, labels), (logits, {**model_state, **new_model_state})


def _fp8_recipe(state: Any) -> fp8.DelayedScaling | None:
    """The delayed-scaling recipe whose state the step updates, or None (no fp8 state)."""
    if FP8_COLLECTION not in state.model_state:
        return None
    recipe = getattr(state.rules, "fp8_matmuls", None)
    if not isinstance(recipe, fp8.DelayedScaling):
        raise ValueError(f"the variables hold a {FP8_COLLECTION!r} collection (delayed fp8 scaling) but the model's "
                         f"policy has no DelayedScaling recipe (got {recipe!r}): wrap the model with an 'O2-fp8' "
                         "policy or rules with fp8_matmuls=jaxmp.fp8.DelayedScaling()")
    return recipe


def _fp8_hooks(recipe: fp8.DelayedScaling | None, axis_name: Any) -> Fp8Hooks | None:
    if recipe is None:
        return None
    return Fp8Hooks(
        split=lambda ms: (ms[FP8_COLLECTION], {k: v for k, v in ms.items() if k != FP8_COLLECTION}),
        merge=lambda rest, f: {**rest, FP8_COLLECTION: f},
        update=lambda f, observed: fp8.update_state(f, observed, recipe, axis_name))


def make_train_step(*, loss_fn: Callable[[jax.Array, jax.Array], jax.Array] | None = None,
                    axis_name: AxisName | None = None, model_kwargs: dict | None = None,
                    rng_collections: tuple[str, ...] = ("dropout",)) -> TrainStep:
    """Returns ``train_step(state, batch, rng=None) -> (state, metrics)`` for supervised training.

    Runs the model under its policy with every non-param collection mutable, computes the loss on
    float32 logits (when the rules' ``float32_loss`` is on), differentiates the scaled loss and calls
    [`TrainState.apply_gradients`][jaxmp.flax.TrainState.apply_gradients].

    Labels outside the model's classes make the default loss NaN with a finite gradient, so the step
    is applied and only ``metrics["loss"]`` shows it: check them on the host before the step,
    ``assert 0 <= labels.min() and labels.max() < num_classes`` (or pass one-hot labels).

    Args:
      loss_fn: ``loss_fn(logits, labels) -> scalar``; default
        [`jaxmp.flax.softmax_cross_entropy`][jaxmp.flax.softmax_cross_entropy] (integer or one-hot labels).
      axis_name: the ``pmap`` axis: gradients, loss, accuracy and the floating model state are
        ``pmean``-ed over it. Build ``tx`` with ``jaxmp.loss_scaling(..., axis_name=axis_name)`` too.
      model_kwargs: extra keyword arguments for the forward pass, e.g. ``{"train": True}``.
      rng_collections: RNG names fed from ``rng`` (folded with the steps taken, skipped ones
        included, so each step draws a fresh mask), e.g. dropout.

    Returns:
      ``train_step(state, batch, rng=None)``; ``batch`` is ``(inputs, labels)`` or a dict with
      ``image``/``inputs``/``x`` and ``label``/``labels``/``y``. Its metrics (a
      dict, the keys of every jaxmp step, `jaxmp._step.step_metrics`): ``loss``, ``accuracy``, ``loss_scale`` (the scale this step used),
      ``last_step_finite``, ``consecutive_skips``, ``total_skips``. The step is a
      `jaxmp._step.TrainStep` record: ``step.loss_fn``, ``step.loss_view`` (the debugger's).

    Example:
      >>> import jax, numpy as np, optax, flax.linen as nn, jaxmp, jaxmp.flax
      >>> x, y = np.ones((4, 3), np.float32), np.array([0, 1, 0, 1])
      >>> model = jaxmp.flax.mixed_precision(nn.Dense(2), "O1-fp16")
      >>> state = jaxmp.flax.TrainState.create(model, model.init(jax.random.key(0), x),
      ...                                      jaxmp.loss_scaling(optax.sgd(0.1)))
      >>> step = jax.jit(jaxmp.flax.make_train_step())
      >>> state, metrics = step(state, {"image": x, "label": y})
      >>> sorted(metrics)
      ['accuracy', 'consecutive_skips', 'last_step_finite', 'loss', 'loss_scale',
       'total_skips']
    """
    loss_fn = softmax_cross_entropy if loss_fn is None else loss_fn
    model_kwargs = dict(model_kwargs or {})
    axis_name = optional_axis_name(axis_name)

    def rngs_of(state: Any, rng: Any, per_replica: bool):
        if rng is None:
            return None
        # Steps taken, applied or skipped: state.step alone stands still on a skipped step,
        # and the next step would replay the skipped step's dropout mask. Without skips
        # this is state.step, the key Flax's examples fold in.
        rng = jax.random.fold_in(rng, state.step + find_loss_scaling_state(state.opt_state).total_skips)
        if axis_name is not None and per_replica:  # each replica its own dropout mask
            rng = jax.random.fold_in(rng, jax.lax.axis_index(axis_name))
        return {name: jax.random.fold_in(rng, i) for i, name in enumerate(rng_collections)}

    def train_step(state: Any, batch: Any, rng: jax.Array | None = None):
        inputs, labels = split_batch(batch)
        rngs = rngs_of(state, rng, per_replica=True)

        def loss_and_accuracy(params, model_state, batch, rng):
            loss, (logits, new_model_state) = _loss_and_logits(state, params, model_state, inputs, labels, loss_fn,
                                                               rngs, model_kwargs, train=True)
            return loss, (new_model_state, accuracy(logits, labels))

        rules = StateRules(fp8=_fp8_hooks(_fp8_recipe(state), axis_name), reduce=_linen_reduce)
        step = _make_flax_step(loss_and_accuracy, state.tx, axis_name, rules)
        out = step(state.params, dict(state.model_state), state.opt_state, None)
        new_state = state.replace(step=state.step + out.finite.astype(jnp.int32), params=out.params,
                                  model_state=out.model_state, opt_state=out.opt_state)
        return new_state, _flax_metrics(out, axis_name)

    def loss_view(state: Any, batch: Any, rng: jax.Array | None = None) -> _loss_view.LossView:
        inputs, labels = split_batch(batch)
        rngs = rngs_of(state, rng, per_replica=False)

        def loss(params, model_state, inputs, labels):
            return _loss_and_logits(state, params, model_state, inputs, labels, loss_fn, rngs, model_kwargs,
                                    train=True)[0]

        return _loss_view.LossView(loss, (state.params, dict(state.model_state), inputs, labels),
                                   _loss_view.scale_of(state.opt_state), "jaxmp.flax.make_train_step")

    return TrainStep(train_step, loss_fn, loss_view)


def make_eval_step(*, loss_fn: Callable[[jax.Array, jax.Array], jax.Array] | None = None,
                   axis_name: AxisName | None = None, model_kwargs: dict | None = None) -> Callable:
    """Returns ``eval_step(state, batch) -> metrics`` (no mutation, no gradients).

    Args:
      loss_fn: as for [`make_train_step`][jaxmp.flax.make_train_step].
      axis_name: the ``pmap`` axis to average the metrics over.
      model_kwargs: extra keyword arguments for the forward pass, e.g. ``{"train": False}``.

    Returns:
      ``eval_step(state, batch)`` returning ``{"loss", "accuracy"}`` (float32).

    Example:
      >>> import jax, numpy as np, optax, flax.linen as nn, jaxmp, jaxmp.flax
      >>> x, y = np.ones((4, 3), np.float32), np.array([0, 1, 0, 1])
      >>> model = jaxmp.flax.mixed_precision(nn.Dense(2), "O1-fp16")
      >>> state = jaxmp.flax.TrainState.create(model, model.init(jax.random.key(0), x),
      ...                                      jaxmp.loss_scaling(optax.sgd(0.1)))
      >>> eval_step = jax.jit(jaxmp.flax.make_eval_step())
      >>> 0.0 <= float(eval_step(state, (x, y))["accuracy"]) <= 1.0
      True
    """
    loss_fn = softmax_cross_entropy if loss_fn is None else loss_fn
    model_kwargs = dict(model_kwargs or {})
    axis_name = optional_axis_name(axis_name)

    def eval_step(state: Any, batch: Any):
        inputs, labels = split_batch(batch)
        loss, (logits, _) = _loss_and_logits(state, state.params, state.model_state, inputs, labels, loss_fn, None,
                                             model_kwargs, train=False)
        metrics = {"loss": jnp.asarray(loss, jnp.float32), "accuracy": accuracy(logits, labels)}
        if axis_name is not None:
            metrics = jax.lax.pmean(metrics, axis_name)
        return metrics

    return eval_step


def _is_key(x: Any) -> bool:
    return isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def _per_replica_keys(rest: Any, axis_name: Any) -> Any:
    """The model's RNG keys with the replica's index folded in: a different dropout mask per replica."""
    index = jax.lax.axis_index(axis_name)
    fold = jnp.vectorize(lambda k: jax.random.fold_in(k, index))  # split streams hold key arrays
    return jax.tree_util.tree_map(lambda x: fold(x) if _is_key(x) else x, rest)


def _restore_keys(new: Any, folded: Any, original: Any) -> Any:
    """The stored keys back as they were, so replicas stay identical; only the counters move.

    A key the forward pass replaced itself (a reseed) is kept as the forward left it.
    """
    if jax.tree_util.tree_structure(new) != jax.tree_util.tree_structure(original):
        return new

    def restore(n, f, o):
        if not _is_key(n):
            return n
        untouched = jnp.all(jax.random.key_data(n) == jax.random.key_data(f))
        return jnp.where(untouched, o, n)

    return jax.tree_util.tree_map(restore, new, folded, original)


def nnx_train_step(model: nnx.Module, optimizer: nnx.Optimizer, opt_state: Any, batch: Any, *,
                   loss_fn: Callable[[jax.Array, jax.Array], jax.Array] | None, axis_name: Any, float32_loss: bool,
                   recipe: Any, model_kwargs: dict) -> dict[str, Any]:
    """The NNX step behind [`jaxmp.flax.nnx.train_step`][jaxmp.flax.nnx.train_step], which documents it.

    Args:
      model: the NNX model; updated in place.
      optimizer: its ``nnx.Optimizer``; updated in place.
      opt_state: ``jaxmp.flax.nnx.optimizer_state(optimizer)``.
      batch: ``(inputs, labels)`` or a dict (`jaxmp.flax._losses.split_batch`).
      loss_fn: ``loss_fn(logits, labels)``; None for softmax cross-entropy.
      axis_name: a bound pmap / shard_map axis, or None.
      float32_loss: cast the logits to float32 before the loss.
      recipe: the model's fp8 recipe (a ``DelayedScaling`` is updated by the step), or None.
      model_kwargs: forwarded to ``model(inputs, ...)``.

    Returns:
      The step's metrics (`jaxmp._step.step_metrics`), plus ``accuracy``.

    Example:
      >>> import jax.numpy as jnp, optax, jaxmp, jaxmp.flax
      >>> from flax import nnx
      >>> model = nnx.Linear(4, 3, rngs=nnx.Rngs(0))
      >>> tx = jaxmp.loss_scaling(optax.sgd(0.1), "none")
      >>> optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
      >>> batch = (jnp.ones((2, 4)), jnp.array([0, 2]))
      >>> metrics = jaxmp.flax.nnx.train_step(model, optimizer, batch)
      >>> bool(metrics["last_step_finite"])
      True
    """

    inputs, labels = split_batch(batch)
    loss_fn = softmax_cross_entropy if loss_fn is None else loss_fn
    axis_name = optional_axis_name(axis_name)
    delayed = isinstance(recipe, fp8.DelayedScaling)
    # The model as pure state: the params the optimizer steps, then the model state in three
    # groups: fp8 scaling state and running statistics (restored on a skipped step), and the
    # rest (RNG counters, which keep moving: a skipped step must not replay a dropout mask).
    graphdef, params, fp8_state, stats, rest = nnx.split(model, optimizer.wrt, Fp8State, nnx.BatchStat, ...)
    params, model_state = nnx.as_pure(params), nnx.as_pure((fp8_state, stats, rest))

    def loss_and_accuracy(params, model_state, batch, rng):
        fp8_in, stats_in, rest_in = model_state
        rest_run = rest_in if axis_name is None else _per_replica_keys(rest_in, axis_name)
        copy = nnx.merge(graphdef, params, fp8_in, stats_in, rest_run)
        logits = copy(inputs, **model_kwargs)
        if float32_loss:
            logits = logits.astype(jnp.float32)
        _, _, *new_model_state = nnx.split(copy, optimizer.wrt, Fp8State, nnx.BatchStat, ...)
        new_model_state = list(nnx.as_pure(new_model_state))
        if axis_name is not None:
            new_model_state[2] = _restore_keys(new_model_state[2], rest_run, rest_in)
        return loss_fn(logits, labels), (tuple(new_model_state), accuracy(logits, labels))

    def reduce_model_state(model_state, mean):
        # Each replica's BatchNorm saw its own shard: averaged, the statistics stay replicated.
        # The fp8 state is left out: its update reduces it over the axis already. So is the rest
        # (frozen params outside the optimizer's wrt, caches): averaging it would all-reduce a
        # frozen base model every step.
        fp8_state, stats, rest = model_state
        return fp8_state, mean(stats), rest

    def update_fp8(state, observed):
        new = fp8.update_state(nnx.to_pure_dict(state), nnx.to_pure_dict(observed), recipe, axis_name)
        state = jax.tree_util.tree_map(lambda x: x, state)  # a new container: the old one is kept on a skip
        nnx.replace_by_pure_dict(state, new)
        return state

    hooks = Fp8Hooks(split=lambda ms: (ms[0], ms[1:]), merge=lambda others, f: (f, *others),
                     update=update_fp8) if delayed else None

    def keep(finite, new, old):
        return (*keep_if_finite(finite, new[:2], old[:2]), new[2])

    step = _make_flax_step(loss_and_accuracy, optimizer.tx, axis_name,
                           StateRules(fp8=hooks, keep=keep, reduce=reduce_model_state))
    out = step(params, model_state, opt_state, None)
    nnx.update(model, out.params, *out.model_state)
    nnx.update(optimizer.opt_state, nnx.state(out.opt_state))
    optimizer.step[...] = jnp.where(out.finite, optimizer.step[...] + 1, optimizer.step[...])
    return _flax_metrics(out, axis_name)


def nnx_loss_view(model: nnx.Module, optimizer: nnx.Optimizer, opt_state: Any, batch: Any, *,
                  loss_fn: Callable[[jax.Array, jax.Array], jax.Array] | None, float32_loss: bool,
                  model_kwargs: dict) -> _loss_view.LossView:
    """The loss `nnx_train_step` differentiates, as a function of the optimizer's params, the
    rest of the model's state and the batch (the debugger's view of the step)."""
    inputs, labels = split_batch(batch)
    loss_fn = softmax_cross_entropy if loss_fn is None else loss_fn
    graphdef, params, rest = nnx.split(model, optimizer.wrt, ...)  # type: ignore[misc]  # nnx.split returns a variadic tuple

    def loss(params, rest, inputs, labels):
        logits = nnx.merge(graphdef, params, rest)(inputs, **model_kwargs)
        return loss_fn(logits.astype(jnp.float32) if float32_loss else logits, labels)

    return _loss_view.LossView(loss, (nnx.as_pure(params), nnx.as_pure(rest), inputs, labels),
                               _loss_view.scale_of(opt_state), "jaxmp.flax.nnx.train_step")
