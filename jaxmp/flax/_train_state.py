"""A mixed-precision train state for Linen models.

``flax.training.train_state.TrainState`` plus the model state next to the params, the loss scale
in the optimizer state, the policy and rules as static data and a count of *applied* steps; a skipped step
leaves params, inner optimizer state and ``batch_stats`` bitwise unchanged.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from flax import struct

from jaxmp._typing import PyTree
from jaxmp.flax.linen import MixedPrecision
from jaxmp._scaling._opt_state import find_loss_scaling_state
from jaxmp._scaling._skip import keep_if_finite
from jaxmp._scaling._transform import update_and_apply


class TrainState(struct.PyTreeNode):
    """Params, model state, optimizer state (with the loss scale) and the model under its policy.

    Attributes:
      step: int32 [], the number of *applied* updates (skipped steps do not count).
      params: the model's params as stored (float32 masters for O1; half for O2, whose
        float32 master copy lives in ``opt_state``).
      model_state: the other variable collections, e.g. ``{"batch_stats": ...}`` (float32).
      opt_state: the state of ``tx``; holds a [`jaxmp.LossScalingState`][jaxmp.LossScalingState].
      model: the [`jaxmp.flax.linen.MixedPrecision`][jaxmp.flax.linen.MixedPrecision] model (static: policy, rules).
      tx: the optax transformation, wrapped in [`jaxmp.loss_scaling`][jaxmp.loss_scaling] (static).

    Example:
      >>> import jax, numpy as np, optax, flax.linen as nn, jaxmp, jaxmp.flax
      >>> x, y = np.ones((4, 3), np.float32), np.array([0, 1, 0, 1])
      >>> model = jaxmp.flax.mixed_precision(nn.Dense(2), "O1-fp16")
      >>> tx = jaxmp.loss_scaling(optax.adam(1e-3), "dynamic")
      >>> state = jaxmp.flax.TrainState.create(model, model.init(jax.random.key(0), x), tx)
      >>> state, metrics = jax.jit(jaxmp.flax.make_train_step())(state, (x, y))
      >>> int(state.step), bool(metrics["last_step_finite"])
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
          >>> tx = jaxmp.loss_scaling(optax.sgd(0.1))
          >>> state = jaxmp.flax.TrainState.create(model, variables, tx)
          >>> int(state.step)
          0
        """
        # Any hashable object with Linen's apply plus a policy and rules will do (e.g. a
        # module whose apply runs under jaxmp.autocast); MixedPrecision is the usual one.
        if not (isinstance(model, MixedPrecision) or all(hasattr(model, a) for a in ("apply", "policy", "rules"))):
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
    def rules(self):
        """The model's [`jaxmp.AutocastRules`][jaxmp.AutocastRules]."""
        return self.model.rules

    @property
    def variables(self) -> dict:
        """``{"params": ..., **model_state}``, ready for ``model.apply``."""
        return {"params": self.params, **self.model_state}

    def apply_gradients(self, grads: optax.Updates, model_state: PyTree | None = None) -> "TrainState":
        """Applies scaled gradients; on a non-finite step nothing but the loss scale changes.

        Args:
          grads: gradients of the *scaled* loss (from [`jaxmp.value_and_grad`][jaxmp.value_and_grad] given
            this state's ``opt_state``), already averaged over replicas if data-parallel.
          model_state: this step's updated collections (e.g. ``batch_stats``), kept only if the step
            is applied; None keeps the current one.

        Returns:
          The new state (``step`` + 1 when applied; params, model state and inner optimizer state
          bitwise unchanged and the skip counters advanced when skipped).

        Example:
          >>> import jax, numpy as np, optax, flax.linen as nn, jaxmp, jaxmp.flax
          >>> x, y = np.ones((4, 3), np.float32), np.array([0, 1, 0, 1])
          >>> model = jaxmp.flax.mixed_precision(nn.Dense(2), "O1-fp16")
          >>> state = jaxmp.flax.TrainState.create(model, model.init(jax.random.key(0), x),
          ...                                      jaxmp.loss_scaling(optax.sgd(0.1)))
          >>> def loss_fn(params):
          ...     logits = state.model.apply({"params": params}, x)
          ...     return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
          >>> loss, grads = jaxmp.value_and_grad(loss_fn, state.opt_state)(state.params)
          >>> int(state.apply_gradients(grads).step)
          1
        """
        # One fused update (jaxmp._scaling._transform.update_and_apply): a skipped step returns the old
        # params bit for bit, -0.0 and NaN payloads included.
        params, opt_state = update_and_apply(self.tx, grads, self.opt_state, self.params)
        finite = find_loss_scaling_state(opt_state).last_step_finite
        new_model_state = self.model_state
        if model_state is not None:
            new_model_state = keep_if_finite(finite, dict(model_state), dict(self.model_state))
        return self.replace(step=self.step + finite.astype(jnp.int32), params=params,
                            model_state=new_model_state, opt_state=opt_state)


# The supervised steps live beside the NNX step in jaxmp.flax._steps; this module's names for them
# keep working.
from jaxmp.flax._steps import make_eval_step, make_train_step  # noqa: E402,F401
