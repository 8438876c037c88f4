"""What a run compiles: the model under its policy, the optimizer and the jitted steps.

* `make_model_apply` is the one place that turns a plain Linen module into the model a
  run calls (``init``/``apply``) under the plan's precision engine and policy;
* `make_optimizer` wraps the optax chain in ``jaxmp.loss_scaling`` with the recipe's
  loss scale and master weights (clipping inside, so it sees unscaled gradients), or with a
  ``jaxmp.lean`` recipe for the state (`lean_optimizer`);
* `build_program` jits the train and eval steps over a data mesh (sharded ``jit``: the
  batch split over the devices, the state replicated, XLA inserts the gradient all-reduce).
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

import jaxmp
import jaxmp.flax
import jaxmp.parallel as mpp
from experiments.validation import ENGINES, LEAN_NEAREST, LEAN_QUANTIZED_STUDY, Plan, UserError


class Program(NamedTuple):
    """A run's compiled pieces."""

    model: Any
    tx: Any
    mesh: Any
    init: Any          # (key, sample input) -> jaxmp.flax.TrainState, jitted
    train_step: Any    # (state, batch, rng) -> (state, metrics), jitted, state donated
    eval_step: Any     # (state, padded batch) -> sums, jitted
    compiled: dict     # the AOT-compiled train step, once lowered


def make_model_apply(plan: Plan, module) -> Any:
    """The model a run initialises and applies: ``module`` under ``plan.policy`` by ``plan.engine``.

    Args:
      plan: the run's plan (reads ``engine`` and ``policy``).
      module: a plain Flax Linen module (no dtype arguments).

    Returns:
      An object with Linen's ``init(key, x, train=...)`` and ``apply(variables, x, train=...)``.

    Raises:
      UserError: an unknown engine.

    Example:
      >>> from experiments import models
      >>> plan = Plan(**{f: None for f in Plan._fields})._replace(engine="flax", policy="O1")
      >>> model = make_model_apply(plan, models.get_model("cnn1d", 10))
    """
    if plan.engine == "flax":
        return jaxmp.flax.mixed_precision(module, plan.policy)
    if plan.engine == "autocast":
        return AutocastModel(module, plan.policy)
    raise UserError(f"--config.engine={plan.engine!r} is invalid: choose one of {', '.join(ENGINES)}.")


@dataclasses.dataclass(frozen=True)
class AutocastModel:
    """A Linen module run by `jaxmp.autocast` (op lists only, no module rules).

    ``init`` stores floating params in the preset's param dtype (float32 for O1, half for O2,
    with float32 masters in the optimizer); ``apply`` is ``jaxmp.autocast(module.apply, policy)``.
    ``policy`` and ``rules`` are what `jaxmp.flax.TrainState` reads (the loss is
    computed on float32 logits).

    Example:
      >>> from experiments import models
      >>> model = AutocastModel(models.get_model("cnn1d", 10), "O1-bf16")
    """

    module: Any
    preset: str

    @property
    def policy(self) -> jaxmp.Policy:
        # The dtypes alone (autocast applies the preset itself, fp8 recipe included): a preset's
        # through its recipe, since get_policy refuses an fp8 preset's name.
        try:
            return jaxmp.get_recipe(self.preset).policy
        except ValueError:  # not a preset: jmp's grammar or a dtype name
            return jaxmp.get_policy(self.preset)

    @property
    def rules(self) -> Any:
        return jaxmp.flax.default_rules()

    def init(self, rngs: Any, *args, **kwargs) -> Any:
        variables = self.module.init(rngs, *args, **kwargs)
        return {**variables, "params": jaxmp.cast_floating(variables["params"], self.policy.param_dtype)}

    def apply(self, variables: Any, *args, **kwargs) -> Any:
        return jaxmp.autocast(self.module.apply, self.preset)(variables, *args, **kwargs)


def make_schedule(plan: Plan, kind: str) -> optax.Schedule:
    """Linear warm-up to the plan's learning rate, then ``kind`` decay: cosine / linear to 0, or constant."""
    lr, warmup, total = plan.learning_rate, plan.warmup_steps, plan.num_train_steps
    if kind == "cosine":
        return optax.warmup_cosine_decay_schedule(0.0, lr, warmup, max(total, warmup + 1), 0.0)
    ramp = optax.linear_schedule(0.0, lr, max(warmup, 1))
    after = optax.linear_schedule(lr, 0.0, max(total - warmup, 1)) if kind == "linear" else optax.constant_schedule(lr)
    return optax.join_schedules([ramp, after], [warmup])


def make_optimizer(hp: dict, plan: Plan) -> optax.GradientTransformation:
    """The inner optax chain wrapped in ``jaxmp.loss_scaling`` with the plan's scale and master weights.

    Clipping sits *inside* the wrapper, so it sees unscaled gradients. Weight decay applies to
    kernels only (ndim > 1), not to biases and norm scales.

    Args:
      hp: the optimizer fields of the config (``optimizer``, ``lr_schedule``, ``weight_decay``,
        ``grad_clip_norm``, ``momentum``, ``nesterov``).
      plan: the run's plan.
    """
    schedule = make_schedule(plan, hp["lr_schedule"])
    decay_mask = lambda p: jax.tree_util.tree_map(lambda x: x.ndim > 1, p)  # noqa: E731
    parts = [optax.clip_by_global_norm(hp["grad_clip_norm"])] if hp["grad_clip_norm"] > 0 else []
    if hp["optimizer"] == "adamw":
        parts.append(optax.adamw(schedule, weight_decay=hp["weight_decay"], mask=decay_mask))
    else:
        parts.append(optax.add_decayed_weights(hp["weight_decay"], mask=decay_mask))
        parts.append(optax.sgd(schedule, momentum=hp["momentum"], nesterov=hp["nesterov"]))
    if plan.lean_recipe:
        return jaxmp.loss_scaling(lean_optimizer(optax.chain(*parts), plan.lean_recipe, plan.seed),
                                  make_loss_scale(plan))
    return jaxmp.loss_scaling(optax.chain(*parts), make_loss_scale(plan), master_weights=plan.master_weights)


def lean_is_stochastic(name: str) -> bool:
    """Whether the ``lean_recipe`` ``name`` rounds stochastically (its key is the run's seed).

    The params of ``"bf16-sr*"`` (and the study variants) or the moments of the three named
    presets; the others round to nearest, and a key passed to them would be unused (jaxmp warns).
    """
    return name.startswith("bf16-sr") or name in ("masters-bf16-moments", "sr-params", "remainders-bf16-moments")


def lean_optimizer(inner: optax.GradientTransformation, name: str, seed: int) -> optax.GradientTransformation:
    """``inner`` under the ``lean_recipe`` ``name`` (unwrapped: put it in ``jaxmp.loss_scaling``).

    Args:
      inner: the optax chain.
      name: a ``jaxmp.lean`` preset, ``"bf16-nearest"`` (``jaxmp.lean.bf16_params`` with
        round-to-nearest: plain bf16 params, no master), or a study variant of the quantized
        presets (`experiments.validation.LEAN_QUANTIZED_STUDY`: every leaf quantized).
      seed: the stochastic-rounding key of the stochastic presets.

    Example:
      >>> import optax
      >>> tx = lean_optimizer(optax.adamw(1e-3), "bf16-sr", seed=0)
    """
    from jaxmp import lean

    if name == LEAN_NEAREST:
        return lean.bf16_params(inner, rounding="nearest")
    if name in LEAN_QUANTIZED_STUDY:
        bits, stochastic = LEAN_QUANTIZED_STUDY[name]
        moments = lean.quantized_moments(inner, seed + 1 if stochastic else None, bits=bits, min_size=0,
                                         rounding="stochastic" if stochastic else "nearest")
        return lean.bf16_params(moments, key=seed)
    return lean.preset(name, inner, key=seed if lean_is_stochastic(name) else None)


def make_loss_scale(plan: Plan):
    """The plan's loss scale; a dynamic one with the plan's initial value and growth period, if set."""
    if plan.dynamic_scale_init or plan.dynamic_scale_period:
        kw = {"loss_scale": plan.dynamic_scale_init} if plan.dynamic_scale_init else {}
        if plan.dynamic_scale_period:
            kw["period"] = plan.dynamic_scale_period
        return jaxmp.DynamicLossScale(**kw)
    return jaxmp.make_loss_scale(plan.loss_scale)


def make_loss_fn(num_classes: int, label_smoothing: float = 0.0):
    """``loss_fn(logits, labels) -> scalar`` in float32 (jaxmp's cross-entropy, optionally smoothed)."""
    if not label_smoothing:
        return jaxmp.flax.softmax_cross_entropy

    def loss_fn(logits, labels):
        onehot = optax.smooth_labels(jax.nn.one_hot(labels, num_classes, dtype=jnp.float32), label_smoothing)
        return jaxmp.flax.softmax_cross_entropy(logits.astype(jnp.float32), onehot)

    return loss_fn


def make_steps(num_classes: int, label_smoothing: float, input_key: str):
    """Returns ``(train_step, eval_step)`` (not yet jitted).

    ``train_step(state, batch, rng) -> (state, metrics)`` is ``jaxmp.flax.make_train_step``
    plus the skip counters for logging; ``eval_step(state, batch)`` returns sums of correct
    predictions, loss and examples over the unmasked part of a padded batch.
    """
    base_step = jaxmp.flax.make_train_step(loss_fn=make_loss_fn(num_classes, label_smoothing),
                                           model_kwargs={"train": True})

    def train_step(state, batch, rng):
        state, metrics = base_step(state, batch, rng)
        stats = jaxmp.scaling_stats(state.opt_state)
        metrics.update(total_skips=stats["total_skips"], consecutive_skips=stats["consecutive_skips"],
                       next_loss_scale=stats["loss_scale"])
        return state, metrics

    def eval_step(state, batch):
        logits = state.model.apply(state.variables, batch[input_key], train=False).astype(jnp.float32)
        labels, mask = batch["label"], batch["mask"]
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
        correct = (jnp.argmax(logits, -1) == labels).astype(jnp.float32)
        return {"correct": jnp.sum(correct * mask), "loss": jnp.sum(loss * mask), "count": jnp.sum(mask)}

    return train_step, eval_step


def _init_fn(model, tx):
    def create(key, x):
        return jaxmp.flax.TrainState.create(model, model.init(key, x, train=False), tx)

    def init(key, x):
        # One jitted init instead of eager op-by-op execution (hundreds of tiny compiles). It runs
        # once, so on CPU it is compiled without LLVM optimisation: the random initialisers
        # (threefry per parameter) otherwise take 3-5x longer to compile than to run.
        lowered = jax.jit(create).lower(key, x)
        fast = {"xla_backend_optimization_level": 0} if jax.devices()[0].platform == "cpu" else None
        return lowered.compile(compiler_options=fast)(key, x)

    return init


_PROGRAMS: dict[str, Program] = {}


def build_program(plan: Plan, module, hp: dict, num_classes: int, input_key: str, input_shape) -> Program:
    """Builds (or reuses) the `Program` of a run.

    Runs that differ only in the seed -- the seeds of one comparison -- share one, so the
    train step is compiled once per policy: the seed enters only through the initial state,
    the data order and the dropout key, all runtime values (except under a stochastic
    ``lean_recipe``, whose rounding key is the seed: one program per seed).

    Args:
      plan: the run's plan.
      module: the plain Linen module.
      hp: the optimizer and loss fields of the config (see `make_optimizer`, plus
        ``label_smoothing``).
      num_classes: classes of the dataset.
      input_key: the batch key of the inputs.
      input_shape: one example's shape.
    """
    # A stochastic lean recipe's key (the seed) is a constant of the compiled init: one program per seed.
    shared = plan if lean_is_stochastic(plan.lean_recipe) else plan._replace(seed=0)
    key = json.dumps([repr(module), hp, shared, num_classes, input_key, list(input_shape)],
                     sort_keys=True, default=str)
    if key in _PROGRAMS:
        return _PROGRAMS[key]
    model = make_model_apply(plan, module)
    tx = make_optimizer(hp, plan)
    mesh = mpp.make_data_mesh(jax.devices()[:plan.num_devices])
    replicated = mpp.replicated_sharding(mesh)
    train_step, eval_step = make_steps(num_classes, hp["label_smoothing"], input_key)
    prog = Program(model, tx, mesh, _init_fn(model, tx),
                   jax.jit(train_step, out_shardings=(replicated, replicated), donate_argnums=0),
                   jax.jit(eval_step), {})
    if len(_PROGRAMS) >= 8:  # a comparison holds one per policy; drop the oldest beyond that
        _PROGRAMS.pop(next(iter(_PROGRAMS)))
    _PROGRAMS[key] = prog
    return prog


OPTIMIZER_FIELDS = ("optimizer", "lr_schedule", "weight_decay", "grad_clip_norm", "momentum", "nesterov",
                    "label_smoothing")


def model_kwargs(config) -> dict:
    """``config.model_kwargs`` as plain, hashable Python values (lists -> tuples)."""
    def fix(v):
        return tuple(fix(x) for x in v) if isinstance(v, (list, tuple)) else v
    return {k: fix(v) for k, v in config.model_kwargs.to_dict().items()}
