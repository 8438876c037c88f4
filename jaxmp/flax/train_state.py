"""A mixed-precision train state for Linen models and ready-made supervised train / eval steps.

In the spirit of ``flax.training.train_state.TrainState``, plus what mixed precision adds:
the model state (``batch_stats``) next to the params, the loss scale inside the optimizer
state, the policy and overrides as static data, and a step count of *applied* steps only.
A skipped (non-finite) step leaves params, inner optimizer state and ``batch_stats``
bitwise unchanged -- Flax's ImageNet example restores params and optimizer state but
keeps the batch statistics of the overflowing step.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from flax import struct

from jaxmp import fp8
from jaxmp._typing import AxisName, PyTree
from jaxmp.collectives import mean_model_state, optional_axis_name
from jaxmp.flax.fp8 import FP8_COLLECTION
from jaxmp.flax.linen import MixedPrecision
from jaxmp.flax.losses import accuracy, softmax_cross_entropy, split_batch
from jaxmp.opt_state import find_loss_scaling_state, skipped_steps
from jaxmp.skip import keep_if_finite
from jaxmp.step import Fp8Hooks, make_step
from jaxmp.transform import update_and_apply


class TrainState(struct.PyTreeNode):
    """Params, model state, optimizer state (with the loss scale) and the model under its policy.

    Attributes:
      step: int32 [], the number of *applied* updates (skipped steps do not count).
      params: the model's params as stored (float32 masters for O1; half for O2, whose
        float32 master copy lives in ``opt_state``).
      model_state: the other variable collections, e.g. ``{"batch_stats": ...}`` (float32).
      opt_state: the state of ``tx``; holds a [`jaxmp.LossScalingState`][jaxmp.LossScalingState].
      model: the [`jaxmp.flax.linen.MixedPrecision`][jaxmp.flax.linen.MixedPrecision] model (static: policy, overrides).
      tx: the optax transformation, wrapped in [`jaxmp.loss_scaling`][jaxmp.loss_scaling] (static).

    Example:
      >>> import jax, numpy as np, optax, flax.linen as nn, jaxmp, jaxmp.flax
      >>> x, y = np.ones((4, 3), np.float32), np.array([0, 1, 0, 1])
      >>> model = jaxmp.flax.mixed_precision(nn.Dense(2), "O1-fp16")
      >>> state = jaxmp.flax.TrainState.create(model, model.init(jax.random.key(0), x),
      ...                                      jaxmp.loss_scaling(optax.adam(1e-3), "dynamic"))
      >>> state, metrics = jax.jit(jaxmp.flax.make_train_step())(state, (x, y))
      >>> int(state.step), bool(metrics["finite"])
      (1, True)
    """

    step: jax.Array
    params: optax.Params
    model_state: PyTree
    opt_state: optax.OptState
    model: MixedPrecision = struct.field(pytree_node=False)
    tx: optax.GradientTransformation = struct.field(pytree_node=False)

    @classmethod
    def create(cls, model: MixedPrecision, variables: PyTree, tx: optax.GradientTransformation) -> "TrainState":
        """Builds the state from a policy-wrapped model, its variables and a loss-scaling optimizer.

        Args:
          model: from [`jaxmp.flax.mixed_precision`][jaxmp.flax.mixed_precision] on a Linen module.
          variables: ``model.init(...)`` output (``params`` plus other collections).
          tx: ``jaxmp.loss_scaling(inner, loss_scale, master_weights=..., axis_name=...)``.

        Returns:
          A [`TrainState`][jaxmp.flax.TrainState] at step 0.

        Raises:
          TypeError: ``model`` is not a Linen [`MixedPrecision`][jaxmp.flax.linen.MixedPrecision], or ``tx`` is not
            wrapped in [`jaxmp.loss_scaling`][jaxmp.loss_scaling].
          ValueError: ``variables`` has no ``params``.

        Example:
          >>> import jax, numpy as np, optax, flax.linen as nn, jaxmp, jaxmp.flax
          >>> x, y = np.ones((4, 3), np.float32), np.array([0, 1, 0, 1])
          >>> model = jaxmp.flax.mixed_precision(nn.Dense(2), "O1-fp16")
          >>> variables = model.init(jax.random.key(0), x)
          >>> state = jaxmp.flax.TrainState.create(model, variables, jaxmp.loss_scaling(optax.sgd(0.1)))
          >>> int(state.step)
          0
        """
        # Any hashable object with Linen's apply plus a policy and overrides will do (e.g. a
        # module whose apply runs under jaxmp.autocast); MixedPrecision is the usual one.
        if not (isinstance(model, MixedPrecision) or all(hasattr(model, a) for a in ("apply", "policy", "overrides"))):
            raise TypeError(
                f"model must be a Linen model wrapped by jaxmp.flax.mixed_precision(module, policy), got {type(model).__name__}"
            )
        if not hasattr(variables, "keys") or "params" not in variables:
            raise ValueError("variables must be the dict returned by model.init(...), with a 'params' collection")
        params = variables["params"]
        model_state = {k: v for k, v in variables.items() if k != "params"}
        opt_state = tx.init(params)
        try:
            find_loss_scaling_state(opt_state)
        except ValueError:
            raise TypeError("tx must be wrapped in jaxmp.loss_scaling(...) (use loss_scale='none' for bf16/fp32)") from None
        return cls(step=jnp.zeros([], jnp.int32), params=params, model_state=model_state,
                   opt_state=opt_state, model=model, tx=tx)

    @property
    def policy(self):
        """The model-wide [`jaxmp.Policy`][jaxmp.Policy]."""
        return self.model.policy

    @property
    def overrides(self):
        """The [`jaxmp.flax.PrecisionOverrides`][jaxmp.flax.PrecisionOverrides]."""
        return self.model.overrides

    @property
    def variables(self) -> dict:
        """``{"params": ..., **model_state}``, ready for ``model.apply``."""
        return {"params": self.params, **self.model_state}

    def apply_gradients(self, grads: optax.Updates, model_state: PyTree | None = None) -> "TrainState":
        """Applies scaled gradients; on a non-finite step nothing but the loss scale changes.

        Args:
          grads: gradients of the *scaled* loss (from [`jaxmp.value_and_grad`][jaxmp.value_and_grad] given this
            state's ``opt_state``, in the same jitted step), already averaged over replicas if
            data-parallel.
          model_state: the updated collections from this step's forward pass (e.g. new
            ``batch_stats``); kept only if the step is applied. None keeps the current one.

        Returns:
          The new state: ``step`` + 1, new params / model state / optimizer state when the
          gradients were finite; otherwise params, model state and the inner optimizer state
          bitwise unchanged, the loss scale backed off and the skip counters advanced.

        Example:
          >>> import jax, numpy as np, optax, flax.linen as nn, jaxmp, jaxmp.flax
          >>> x, y = np.ones((4, 3), np.float32), np.array([0, 1, 0, 1])
          >>> model = jaxmp.flax.mixed_precision(nn.Dense(2), "O1-fp16")
          >>> state = jaxmp.flax.TrainState.create(model, model.init(jax.random.key(0), x),
          ...                                      jaxmp.loss_scaling(optax.sgd(0.1)))
          >>> @jax.jit
          ... def train_step(state):
          ...     def loss_fn(params):
          ...         logits = state.model.apply({"params": params}, x)
          ...         return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
          ...     loss, grads = jaxmp.value_and_grad(loss_fn, state.opt_state)(state.params)
          ...     return state.apply_gradients(grads)
          >>> state = train_step(state)
          >>> int(state.step)
          1
        """
        # One fused update (jaxmp.transform.update_and_apply): a skipped step returns the old
        # params bit for bit, -0.0 and NaN payloads included.
        params, opt_state = update_and_apply(self.tx, grads, self.opt_state, self.params)
        finite = find_loss_scaling_state(opt_state).last_step_finite
        new_model_state = self.model_state
        if model_state is not None:
            new_model_state = keep_if_finite(finite, dict(model_state), dict(self.model_state))
        return self.replace(step=self.step + finite.astype(jnp.int32), params=params,
                            model_state=new_model_state, opt_state=opt_state)


def _loss_and_logits(state: TrainState, params: Any, model_state: Any, inputs: Any, labels: Any, loss_fn: Callable,
                     rngs: Any, model_kwargs: dict, train: bool):
    # The fp8 state changes by the step's amax observations, not in the forward pass.
    # Linen returns (out, updates) for any mutable other than False, even an empty list.
    mutable = ([c for c in model_state if c != FP8_COLLECTION] or False) if train else False
    out = state.model.apply({"params": params, **model_state}, inputs, rngs=rngs, mutable=mutable, **model_kwargs)
    logits, new_model_state = out if mutable else (out, {})
    if state.overrides.fp32_loss:
        logits = logits.astype(jnp.float32)
    return loss_fn(logits, labels), (logits, {**model_state, **new_model_state})


def _fp8_recipe(state: TrainState) -> fp8.DelayedScaling | None:
    """The delayed-scaling recipe whose state the step updates, or None (no fp8 state)."""
    if FP8_COLLECTION not in state.model_state:
        return None
    recipe = getattr(state.overrides, "fp8", None)
    if not isinstance(recipe, fp8.DelayedScaling):
        raise ValueError(f"the variables hold a {FP8_COLLECTION!r} collection (delayed fp8 scaling) but the model's "
                         f"policy has no DelayedScaling recipe (got {recipe!r}): wrap the model with an 'O2-fp8' "
                         "policy or PrecisionOverrides(fp8=jaxmp.fp8.DelayedScaling())")
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
                    rng_collections: tuple[str, ...] = ("dropout",)) -> Callable:
    """Returns ``train_step(state, batch, rng=None) -> (state, metrics)`` for supervised training.

    The step runs the model under its policy with every non-param collection mutable,
    computes the loss on float32 logits (when the overrides keep the loss in fp32),
    differentiates the scaled loss, averages gradients over ``axis_name`` (pmap), and
    calls [`TrainState.apply_gradients`][jaxmp.flax.TrainState.apply_gradients].

    Args:
      loss_fn: ``loss_fn(logits, labels) -> scalar``; default
        [`jaxmp.flax.softmax_cross_entropy`][jaxmp.flax.softmax_cross_entropy] (integer or one-hot labels).
      axis_name: the ``pmap`` axis: gradients, loss and accuracy are ``pmean``-ed over it, and
        so is the floating model state (BatchNorm statistics; a leaf equal on every replica is
        kept exactly), so replicas stay bitwise identical. Build ``tx`` with
        ``jaxmp.loss_scaling(..., axis_name=axis_name)`` too.
      model_kwargs: extra keyword arguments for the forward pass, e.g. ``{"train": True}``.
      rng_collections: RNG names fed from ``rng`` (folded with the number of steps taken,
        ``state.step + jaxmp.skipped_steps(state.opt_state)``, so the step after a skipped one
        draws a fresh mask), e.g. dropout.

    Returns:
      ``train_step(state, batch, rng=None)``; ``batch`` is ``(inputs, labels)`` or a dict
      with ``image``/``inputs``/``x`` and ``label``/``labels``/``y``. Metrics:
      ``{"loss", "accuracy", "loss_scale", "finite"}`` (``loss_scale``: the scale this
      step's loss was multiplied by; ``finite``: whether the step was applied).

    Labels outside the model's classes: an integer label ``< 0`` or ``>= classes`` makes the
    default loss NaN (optax's ``softmax_cross_entropy_with_integer_labels`` reads the logit
    out of range as NaN), while its gradient stays finite, so the step is *applied* and only
    ``metrics["loss"]`` shows it. Nothing inside the compiled step can raise on it; check the
    labels on the host, where the batch is still a NumPy array, before the step:
    ``assert 0 <= labels.min() and labels.max() < num_classes`` (or pass one-hot labels).

    Example:
      >>> import jax, numpy as np, optax, flax.linen as nn, jaxmp, jaxmp.flax
      >>> x, y = np.ones((4, 3), np.float32), np.array([0, 1, 0, 1])
      >>> assert 0 <= y.min() and y.max() < 2  # the labels fit the model's 2 classes
      >>> model = jaxmp.flax.mixed_precision(nn.Dense(2), "O1-fp16")
      >>> state = jaxmp.flax.TrainState.create(model, model.init(jax.random.key(0), x),
      ...                                      jaxmp.loss_scaling(optax.sgd(0.1)))
      >>> train_step = jax.jit(jaxmp.flax.make_train_step())
      >>> state, metrics = train_step(state, {"image": x, "label": y})
      >>> sorted(metrics)
      ['accuracy', 'finite', 'loss', 'loss_scale']
    """
    loss_fn = softmax_cross_entropy if loss_fn is None else loss_fn
    model_kwargs = dict(model_kwargs or {})
    axis_name = optional_axis_name(axis_name)

    def train_step(state: TrainState, batch: Any, rng: jax.Array | None = None):
        inputs, labels = split_batch(batch)
        rngs = None
        if rng is not None:
            # Steps taken, applied or skipped: state.step alone stands still on a skipped step,
            # and the next step would replay the skipped step's dropout mask. Without skips
            # this is state.step, the key Flax's examples fold in.
            rng = jax.random.fold_in(rng, state.step + skipped_steps(state.opt_state))
            if axis_name is not None:  # each replica its own dropout mask
                rng = jax.random.fold_in(rng, jax.lax.axis_index(axis_name))
            rngs = {name: jax.random.fold_in(rng, i) for i, name in enumerate(rng_collections)}

        def loss_and_accuracy(params, model_state, batch, rng):
            loss, (logits, new_model_state) = _loss_and_logits(state, params, model_state, inputs, labels, loss_fn,
                                                               rngs, model_kwargs, train=True)
            return loss, (new_model_state, accuracy(logits, labels))

        def reduce_model_state(model_state):
            # Each replica's BatchNorm saw its own shard: averaged, the statistics stay replicated.
            # The fp8 state is left out: the hooks replace it by one reduced over the axis already.
            return {k: v if k == FP8_COLLECTION else mean_model_state(v, axis_name) for k, v in model_state.items()}

        step = make_step(loss_and_accuracy, state.tx, axis_name=axis_name,
                         reduce_model_state=None if axis_name is None else reduce_model_state,
                         fp8_hooks=_fp8_hooks(_fp8_recipe(state), axis_name), pass_value=False)
        out = step(state.params, dict(state.model_state), state.opt_state, None)
        acc = out.aux if axis_name is None else jax.lax.pmean(out.aux, axis_name)
        new_state = state.replace(step=state.step + out.finite.astype(jnp.int32), params=out.params,
                                  model_state=out.model_state, opt_state=out.opt_state)
        metrics = {"loss": out.loss, "accuracy": acc, "loss_scale": out.loss_scale, "finite": out.finite}
        return new_state, metrics

    return train_step


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

    def eval_step(state: TrainState, batch: Any):
        inputs, labels = split_batch(batch)
        loss, (logits, _) = _loss_and_logits(state, state.params, state.model_state, inputs, labels, loss_fn, None,
                                             model_kwargs, train=False)
        metrics = {"loss": jnp.asarray(loss, jnp.float32), "accuracy": accuracy(logits, labels)}
        if axis_name is not None:
            metrics = jax.lax.pmean(metrics, axis_name)
        return metrics

    return eval_step

