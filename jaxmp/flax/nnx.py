"""Run an unmodified Flax NNX model under a precision policy and its rules (class and path rules).

Each call runs a throw-away ``nnx.merge`` copy with cast params inside the engine; the ruled
classes carry the engine's once-installed ``__call__`` hook. The user's model is never modified;
its running statistics are updated. See docs/design.md#the-nnx-door.
"""

from __future__ import annotations

# What this door module offers; the rest of its namespace is its own machinery.
__all__ = ["MixedPrecision", "call", "module_rules", "optimizer_state", "overridden_float32", "store_params", "train_step"]

import contextlib
import dataclasses
import warnings
import weakref
from typing import Any, Callable

import jax
import numpy as np
from flax import nnx

from jaxmp.engine._seams import TRACING
from jaxmp.engine._seams import flax_config
from jaxmp.engine._seams import engine_function
from jaxmp.engine._seams import install_call_hooks, instance_rules
from jaxmp.flax._attention import fused_attention
from jaxmp import _tree, fp8
from jaxmp._scaling import _loss_view
from jaxmp._typing import AxisName, PolicyLike, PyTree
from jaxmp.flax import _steps as steps
from jaxmp.flax.fp8 import install_nnx_fp8
from jaxmp.flax._casting import Path, cast_by_path, enclosing_float32, is_float32_rule
from jaxmp.engine._seams import AutocastRules, ModuleRule
from jaxmp.flax._overrides import (door_rules, explicit_float32, join_path, overridden_float32_message,
                                   resolve_rules, unmatched_rules_message)
from jaxmp._misuse import MixedPrecisionWarning
from jaxmp._precision._policy import Policy
from jaxmp._scaling._transform import LossScalingState

def _str_path(path: tuple) -> Path:
    return tuple(str(k) for k in path)


def _check_model(model: Any) -> None:
    if isinstance(model, type):
        raise TypeError(f"expected an NNX module instance, got the class {model.__name__}; instantiate it first")
    if not isinstance(model, nnx.Module):
        raise TypeError(f"expected a flax.nnx.Module instance, got {type(model).__name__}")
    if not callable(model):
        raise TypeError(f"{type(model).__name__} defines no __call__, so it cannot be run under a policy")


def module_rules(model: nnx.Module, policy: Policy, rules: AutocastRules) -> dict[Path, ModuleRule]:
    """``{module path: rule}`` for every ruled submodule of an NNX model (paths as strings).

    Args:
      model: the NNX model.
      policy: the model-wide [`jaxmp.Policy`][jaxmp.Policy].
      rules: the [`jaxmp.AutocastRules`][jaxmp.AutocastRules] (as [`jaxmp.flax.default_rules`][jaxmp.flax.default_rules] gives).

    Returns:
      The rules of the modules some list names.

    Example:
      >>> import jaxmp, jaxmp.flax
      >>> from flax import nnx
      >>> model = nnx.Sequential(nnx.Linear(4, 3, rngs=nnx.Rngs(0)),
      ...                        nnx.BatchNorm(3, rngs=nnx.Rngs(0)))
      >>> policy, defaults = jaxmp.get_policy("O1-bf16"), jaxmp.flax.default_rules()
      >>> rules = jaxmp.flax.nnx.module_rules(model, policy, defaults)
      >>> rules[("layers", "0")].compute_dtype, rules[("layers", "1")].compute_dtype
      (dtype(bfloat16), dtype('float32'))
    """
    compiled = rules.module_rules(policy)
    found: dict[Path, ModuleRule] = {}
    for path, node in nnx.iter_graph(model):
        if isinstance(node, nnx.Module):
            rule = compiled.rule_at(_str_path(path), node)
            if rule is not None:
                found.setdefault(_str_path(path), rule)
    return _inherit_float32(found)


def _inherit_float32(rules: dict) -> dict:
    wide = {p: r for p, r in rules.items() if r.action != "half" and is_float32_rule(r)}
    return {path: (enclosing_float32(path, wide) or rule) if rule.action == "half" else rule
            for path, rule in rules.items()}


def _ruled_modules(model: nnx.Module, policy: Policy, rules: AutocastRules):
    """``(path, module, rule)`` for each module of the graph, once each (its first path), rule None if unruled."""
    seen: set[int] = set()
    compiled = rules.module_rules(policy)
    for path, node in nnx.iter_graph(model):
        if isinstance(node, nnx.Module) and id(node) not in seen:
            seen.add(id(node))
            yield _str_path(path), node, compiled.rule_at(_str_path(path), node)


def overridden_float32(model: nnx.Module, policy: Policy, rules: AutocastRules) -> dict[str, str]:
    """``{joined path: class name}`` of half-list layers built with ``dtype=float32`` that run in half.

    Args:
      model: the NNX model.
      policy: the model-wide [`jaxmp.Policy`][jaxmp.Policy].
      rules: the [`jaxmp.AutocastRules`][jaxmp.AutocastRules] (its path and class rules keep
        a layer float32, and such a layer is not listed).

    Returns:
      The layers whose explicit float32 ``dtype`` the policy overrides (empty for a float32 policy).

    Example:
      >>> import jax.numpy as jnp, jaxmp, jaxmp.flax
      >>> from flax import nnx
      >>> model = nnx.Sequential(nnx.Linear(4, 3, rngs=nnx.Rngs(0)),
      ...                        nnx.Linear(3, 2, dtype=jnp.float32, rngs=nnx.Rngs(0)))
      >>> policy, rules = jaxmp.get_policy("O1-bf16"), jaxmp.flax.default_rules()
      >>> jaxmp.flax.nnx.overridden_float32(model, policy, rules)
      {'layers/1': 'Linear'}
      >>> pinned = rules.with_path("layers/1", "float32")
      >>> jaxmp.flax.nnx.overridden_float32(model, policy, pinned)
      {}
    """
    if np.dtype(policy.compute_dtype).itemsize >= 4:
        return {}
    return {join_path(path): type(node).__name__ for path, node, rule in _ruled_modules(model, policy, rules)
            if rule is not None and rule.action == "half" and explicit_float32(node)}


# Models nnx.call has already warned about (a weak set: the warning is once per model object).
_WARNED_CALL: "weakref.WeakSet[nnx.Module]" = weakref.WeakSet()


def _warn_overridden(model: nnx.Module, policy: Policy, rules: AutocastRules, stacklevel: int = 3) -> None:
    overridden = overridden_float32(model, policy, rules)
    if overridden:
        warnings.warn(overridden_float32_message(list(overridden), list(overridden.values()), policy.compute_dtype),
                      MixedPrecisionWarning, stacklevel=stacklevel)
    if rules.path_rules or rules.class_rules:  # a rule of the user's that matches no module of the model
        modules = [(join_path(path), type(node)) for path, node, _ in _ruled_modules(model, policy, rules)]
        message = unmatched_rules_message(rules, [p for p, _ in modules], [c for _, c in modules],
                                          type(model).__name__)
        if message is not None:
            warnings.warn(message, MixedPrecisionWarning, stacklevel=stacklevel)


def store_params(model: nnx.Module, policy: PolicyLike, rules: AutocastRules | None = None) -> nnx.Module:
    """Casts the model's params in place to their storage dtype (policy or per-module rule).

    Float32 modules keep float32 params; a no-op for O1.

    Args:
      model: the NNX model (modified in place).
      policy: a policy, preset name or Recipe.
      rules: a [`jaxmp.AutocastRules`][jaxmp.AutocastRules], or None for
        [`jaxmp.flax.default_rules`][jaxmp.flax.default_rules] of the preset.

    Returns:
      ``model``.

    Example:
      >>> import jaxmp.flax
      >>> from flax import nnx
      >>> model = nnx.Linear(4, 3, rngs=nnx.Rngs(0))
      >>> jaxmp.flax.nnx.store_params(model, "O2-bf16").kernel.dtype
      dtype(bfloat16)
    """
    policy, rules = resolve_rules(policy, rules)
    by_path = module_rules(model, policy, rules)
    params = nnx.as_pure(nnx.state(model, nnx.Param))
    nnx.update(model, cast_by_path(params, by_path, policy.param_dtype, "param_dtype"))
    return model


def _is_half(model: nnx.Module, policy: Policy, rules: AutocastRules):
    half = {id(node) for _, node, rule in _ruled_modules(model, policy, rules)
            if rule is not None and rule.action == "half"}

    def is_half(node) -> bool:
        return id(node) in half
    return is_half


def _prepare(copy: nnx.Module, policy: Policy, rules: AutocastRules) -> dict[int, ModuleRule]:
    """Gives the throw-away copy its attention / fp8 ops; returns ``{id(module): rule}`` for the engine hooks.

    The copy is private to this call, so setting its fields touches nothing the user holds.
    """
    per_module = any(kind != "scope" for kind, _, _ in rules.matmul_formats)
    if per_module and isinstance(rules.fp8_matmuls, fp8.DelayedScaling):
        raise ValueError("per-module matmul formats (with_path/with_class given a format) take current scaling; "
                         "under the NNX door they do not combine with delayed-scaling fp8_matmuls, whose amax "
                         "histories live in the model: give fp8_matmuls current scaling (e.g. 'O2-fp8-current')")
    if per_module:
        # Each layer's own format (a path format, else its class's, else fp8_matmuls), as the Linen door.
        install_nnx_fp8(copy, None, _is_half(copy, policy, rules), recipe_of=rules.module_format)  # stateless
    elif rules.fp8_matmuls is not None and not isinstance(rules.fp8_matmuls, fp8.DelayedScaling):
        install_nnx_fp8(copy, rules.fp8_matmuls, _is_half(copy, policy, rules))  # stateless: per call
    by_id: dict[int, ModuleRule] = {}
    for _, node, rule in list(_ruled_modules(copy, policy, rules)):
        if rules.fused_attention and isinstance(node, nnx.MultiHeadAttention) \
                and node.attention_fn is nnx.dot_product_attention:
            node.attention_fn = fused_attention
        if rule is not None:
            by_id[id(node)] = rule
    install_call_hooks({type(node) for _, node, rule in _ruled_modules(copy, policy, rules) if rule is not None})
    return by_id


def call(model: nnx.Module, *args, policy: PolicyLike, rules: AutocastRules | None = None,
         **kwargs) -> Any:
    """Calls an NNX model under a policy; the functional form of [`MixedPrecision`][jaxmp.flax.nnx.MixedPrecision].

    Args:
      model: the NNX model (its params are not modified; running statistics are updated
        in place as in a normal call).
      *args: inputs; floating ones are cast to the compute dtype.
      policy: a policy, preset name or Recipe.
      rules: a [`jaxmp.AutocastRules`][jaxmp.AutocastRules], or None for
        [`jaxmp.flax.default_rules`][jaxmp.flax.default_rules] of the preset.
      **kwargs: forwarded to the model; floating arrays among them are cast.

    Returns:
      The model's output cast to the policy's output dtype.

    Example:
      >>> import jax.numpy as jnp, jaxmp.flax
      >>> from flax import nnx
      >>> model = nnx.Linear(4, 3, rngs=nnx.Rngs(0))
      >>> logits = jaxmp.flax.nnx.call(model, jnp.ones((2, 4)), policy="O1-bf16")
      >>> # f32 output; the params are left as they were
      >>> logits.dtype, model.kernel.dtype
      (dtype('float32'), dtype('float32'))
    """
    _check_model(model)
    policy, rules = resolve_rules(policy, rules)
    if isinstance(rules.fp8_matmuls, fp8.DelayedScaling):
        raise ValueError("delayed fp8 scaling keeps scales and amax histories in the model: wrap it with "
                         "jaxmp.flax.mixed_precision(model, policy) instead of calling jaxmp.flax.nnx.call")
    try:
        first = model not in _WARNED_CALL
    except TypeError:  # not weak-referenceable: warn every call rather than never
        first = True
    if first:
        _warn_overridden(model, policy, rules)
        try:
            _WARNED_CALL.add(model)
        except TypeError:
            pass
    return _call(model, policy, rules, args, kwargs)


def _call(model: nnx.Module, policy: Policy, rules: AutocastRules, args: tuple, kwargs: dict) -> Any:
    by_path = module_rules(model, policy, rules)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    config = flax_config(policy, rules)
    compute = np.dtype(policy.compute_dtype)
    # O1 (promote="demand"): only the weights (params whose every use is a half-list op) go to
    # half, cast by the engine on entry; a bias or norm scale enters float32 and the engine's
    # promotion decides, as under jaxmp.autocast (see jaxmp.flax.linen). A model that refuses
    # float32 params while traced (a half-only kernel) is traced again with every param cast.
    weights_only = not config.identity and config.rules.promote == "demand"

    def make_run(weights_only):
        def run(params, rest, args, kwargs):
            cast = cast_by_path(params, by_path, policy.compute_dtype, "compute_dtype")
            if weights_only:  # only a per-class dtype other than the policy's is cast here
                cast = jax.tree.map(lambda c, p: p if c.dtype == compute else c, cast, params)
            copy = nnx.merge(graphdef, cast, rest)
            by_id = _prepare(copy, policy, rules)
            args, kwargs = policy.cast_to_compute((args, kwargs))
            promotion = jax.numpy_dtype_promotion("standard") if weights_only else contextlib.nullcontext()
            with promotion, instance_rules(by_id), TRACING(config) if config.identity else contextlib.nullcontext():
                out = copy(*args, **kwargs)
            # Running statistics, RNG counters and sown intermediates come back as outputs: the
            # engine traces ``run`` functionally, so the model is updated after it.
            return out, nnx.state(copy, nnx.Not(nnx.Param))

        run.__qualname__ = f"jaxmp.flax.mixed_precision({type(model).__name__})"  # as warnings name it
        if config.identity:
            return run
        run_config = dataclasses.replace(config, cast_inputs="weights") if weights_only else config
        return engine_function(run, run_config, cast_outputs=False, cache=False)

    try:
        out, new_rest = make_run(weights_only)(params, rest, args, kwargs)
    except Exception:
        if not weights_only:
            raise
        out, new_rest = make_run(False)(params, rest, args, kwargs)
    nnx.update(model, new_rest)
    return policy.cast_to_output(out)


class MixedPrecision(nnx.Module):
    """An NNX model run under a policy; train it like any NNX module.

    The wrapped model sits at ``self.model``; its params are cast in place to their storage
    dtype on construction ([`store_params`][jaxmp.flax.nnx.store_params]).

    Args:
      model: the NNX model.
      policy: a [`jaxmp.Policy`][jaxmp.Policy], preset name (``"O1-bf16"``), jmp string, Recipe or jmp.Policy.
      rules: a [`jaxmp.AutocastRules`][jaxmp.AutocastRules], or None for
        [`jaxmp.flax.default_rules`][jaxmp.flax.default_rules] of the preset.

    Raises:
      TypeError: ``model`` is not a callable NNX module instance, or a non-floating policy.

    Example:
      >>> import jax.numpy as jnp, optax, jaxmp, jaxmp.flax
      >>> from flax import nnx
      >>> model = jaxmp.flax.mixed_precision(nnx.Linear(4, 3, rngs=nnx.Rngs(0)), "O1-bf16")
      >>> tx = jaxmp.loss_scaling(optax.adam(1e-3), "none")
      >>> optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
      >>> batch = (jnp.ones((2, 4)), jnp.array([0, 2]))
      >>> metrics = jaxmp.flax.nnx.train_step(model, optimizer, batch)
      >>> metrics["last_step_finite"]
      Array(True, dtype=bool)
    """

    def __init__(self, model: nnx.Module, policy: PolicyLike, rules: AutocastRules | None = None):
        _check_model(model)
        self.policy, self.rules = resolve_rules(policy, rules)
        if isinstance(self.rules.fp8_matmuls, fp8.DelayedScaling):
            # The layers' fp8 ops hold the delayed-scaling state (Fp8State variables).
            install_nnx_fp8(model, self.rules.fp8_matmuls, _is_half(model, self.policy, self.rules))
        _warn_overridden(model, self.policy, self.rules)  # once per wrapped model: here, not per call
        self.model = store_params(model, self.policy, self.rules)

    def __call__(self, *args, **kwargs) -> Any:
        # door_rules: the door's rules, or those the precision debugger measures a fix with
        return _call(self.model, self.policy, door_rules(self, self.rules), args, kwargs)


def optimizer_state(optimizer: nnx.Optimizer) -> Any:
    """The plain optax state of an ``nnx.Optimizer`` (arrays, not ``OptState`` variables).

    Pass it to [`jaxmp.scaling_stats`][jaxmp.scaling_stats], [`jaxmp.get_loss_scale`][jaxmp.get_loss_scale]
    or [`jaxmp.check_health`][jaxmp.check_health].

    Args:
      optimizer: an ``nnx.Optimizer`` built with a ``jaxmp.loss_scaling`` transform.

    Returns:
      The optax state pytree.

    Example:
      >>> import optax, jaxmp, jaxmp.flax
      >>> from flax import nnx
      >>> model = jaxmp.flax.mixed_precision(nnx.Linear(4, 3, rngs=nnx.Rngs(0)), "O1-fp16")
      >>> tx = jaxmp.loss_scaling(optax.sgd(0.1), "dynamic")
      >>> optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
      >>> jaxmp.scaling_stats(jaxmp.flax.nnx.optimizer_state(optimizer))["loss_scale"]
      Array(32768., dtype=float32)
    """
    pure = nnx.as_pure(optimizer.opt_state)
    stored, copy = _tree.find_states(optimizer.opt_state, LossScalingState), _tree.find_states(pure, LossScalingState)
    if len(stored) == len(copy) == 1:
        # Scaling a loss with this copy's scale also marks the stored one, which optimizer.update
        # reads: the unscaled-gradient check (jaxmp._misuse.ScaledMark) then sees it.
        object.__setattr__(copy[0].loss_scale, "_jaxmp_stored", stored[0].loss_scale)
    return pure


def train_step(model: nnx.Module, optimizer: nnx.Optimizer, batch: PyTree, *,
               loss_fn: Callable[[jax.Array, jax.Array], jax.Array] | None = None,
               axis_name: AxisName | None = None, **model_kwargs) -> dict[str, jax.Array]:
    """One supervised step for an NNX model with an ``nnx.Optimizer`` around ``jaxmp.loss_scaling``.

    A skipped step is exact: params, ``BatchStat`` statistics, fp8 state and ``optimizer.step``
    stay bitwise unchanged. Call it inside ``nnx.jit``. See docs/design.md#the-train-step.

    Args:
      model: the model (usually a [`MixedPrecision`][jaxmp.flax.nnx.MixedPrecision]); updated in place.
      optimizer: ``nnx.Optimizer(model, jaxmp.loss_scaling(...), wrt=nnx.Param)``; updated in place.
      batch: ``(inputs, labels)`` or a dict with ``inputs``/``image``/``x`` and
        ``labels``/``label``/``y``.
      loss_fn: ``loss_fn(logits, labels) -> scalar``; default
        [`jaxmp.flax.softmax_cross_entropy`][jaxmp.flax.softmax_cross_entropy] (mean, integer or one-hot labels).
      axis_name: a bound ``pmap``/``shard_map`` axis: gradients, metrics and floating model
        state are averaged over it, and each replica folds its index into the RNG keys (build
        the transform with the same ``axis_name``).
      **model_kwargs: forwarded to ``model(inputs, ...)``.

    Returns:
      The step metrics of every jaxmp step plus ``accuracy``: ``loss``, ``accuracy``,
      ``loss_scale``, ``last_step_finite``, ``consecutive_skips``, ``total_skips``.

    Example:
      >>> import jax.numpy as jnp, optax, jaxmp, jaxmp.flax
      >>> from flax import nnx
      >>> model = jaxmp.flax.mixed_precision(nnx.Linear(4, 3, rngs=nnx.Rngs(0)), "O1-fp16")
      >>> tx = jaxmp.loss_scaling(optax.sgd(0.1), "dynamic")
      >>> optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
      >>> step = nnx.jit(jaxmp.flax.nnx.train_step)
      >>> metrics = step(model, optimizer, (jnp.ones((2, 4)), jnp.array([0, 2])))
      >>> metrics["loss_scale"], metrics["last_step_finite"]
      (Array(32768., dtype=float32), Array(True, dtype=bool))
    """
    rules = model.rules if isinstance(model, MixedPrecision) else None
    return steps.nnx_train_step(model, optimizer, optimizer_state(optimizer), batch, loss_fn=loss_fn,
                                axis_name=axis_name, float32_loss=rules.float32_loss if rules is not None else True,
                                recipe=rules.fp8_matmuls if rules is not None else None, model_kwargs=model_kwargs)


def _train_step_view(model: nnx.Module, optimizer: nnx.Optimizer, batch: PyTree, *,
                     loss_fn: Callable[[jax.Array, jax.Array], jax.Array] | None = None,
                     axis_name: AxisName | None = None, **model_kwargs):
    # What the precision debugger runs when handed train_step (jaxmp._scaling._loss_view).
    rules = model.rules if isinstance(model, MixedPrecision) else None
    return steps.nnx_loss_view(model, optimizer, optimizer_state(optimizer), batch, loss_fn=loss_fn,
                               float32_loss=rules.float32_loss if rules is not None else True, model_kwargs=model_kwargs)


_loss_view.expose(train_step, None, _train_step_view)
