"""Run an unmodified Linen module under a precision policy and its rules (class and path rules).

``apply`` runs the model once inside the engine, under the engine's Linen interceptor, with the
``params`` collection cast by path to each module's rule; ``init`` stores each param in its
rule's param dtype. Nothing is patched and the module is never modified.
See docs/design.md#the-linen-door.
"""

from __future__ import annotations

# What this door module offers; the rest of its namespace is its own machinery.
__all__ = ["MixedPrecision"]

import contextlib
import dataclasses
import functools
import threading
import typing
import warnings
import weakref
from typing import Any, Callable, Sequence

import flax.linen as nn
import jax
import numpy as np

from jaxmp.engine._seams import flax_config
from jaxmp._typing import PolicyLike, PyTree
from jaxmp.engine._seams import engine_function
from jaxmp.engine._seams import module_interceptor
from jaxmp.flax._attention import fused_attention
from jaxmp.flax._casting import Path, cast_by_path, enclosing_float32, is_float32_rule
from jaxmp.flax.fp8 import Fp8ConvGeneralDilated, Fp8DotGeneral, linen_fp8_field
from jaxmp.engine._seams import AutocastRules, ModuleRule
from jaxmp.flax._overrides import (door_rules, explicit_float32, join_path, overridden_float32_message,
                                   resolve_rules, unmatched_rules_message)
from jaxmp._precision._policy import Policy
from jaxmp._misuse import MixedPrecisionWarning

#: How many times ``init`` re-runs for layers that refuse the float32 params they just created.
_MAX_INIT_PASSES = 64

#: The engine functions of each wrapper, by static setting (`MixedPrecision._cached_engine_fn`);
#: held weakly, so they go with the wrapper and never travel with it (pickle, copy).
_ENGINE_FNS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
#: The `_Call` of the ``apply`` being traced in this thread: a cached engine function's run reads
#: it when (and only when) it traces, so each trace reports to the call that caused it.
_TRACING = threading.local()


def _uses_default_attention(module: nn.Module) -> bool:
    return (
        isinstance(module, nn.MultiHeadDotProductAttention)
        and module.attention_fn is nn.dot_product_attention
        and module.qk_attn_weights_einsum_cls is None
        and module.attn_weights_value_einsum_cls is None
    )


class _Call:
    """The Python-side state of one traced ``init`` / ``apply``: rules seen, layers warned about.

    Lives for one call only (nothing global): the interceptor built from it is pushed on Flax's
    thread-local interceptor stack for the duration of the call.
    """

    def __init__(self, policy: Policy, rules: AutocastRules, init: bool = False):
        self.policy, self.rules, self.init = policy, rules, init
        self.compiled = rules.module_rules(policy)
        self.seen: dict[Path, ModuleRule] = {}
        self.overridden: dict[str, str] = {}
        self.failed_params: Any = None  # the params created before a layer raised (init)
        self._by_class: dict[type, ModuleRule | None] = {}
        self.met: dict[str, type] = {}  # every module called: its path joined by "/", its class
        self.float32_paths: dict[Path, ModuleRule] = {}  # modules met with a float32 rule, by path

    def decide(self, module: nn.Module) -> ModuleRule | None:
        self.met.setdefault(join_path(module.path), type(module))
        if self.compiled.paths:
            rule = self._at_init(self.compiled.rule_at(module.path, module))
        else:
            cls = type(module)
            if cls not in self._by_class:  # memoised per call: path-free rules depend on the class only
                self._by_class[cls] = self._at_init(self.compiled.rule_for(cls))
            rule = self._by_class[cls]
        if rule is not None and rule.action == "half" and self.float32_paths:
            return enclosing_float32(tuple(str(p) for p in module.path), self.float32_paths) or rule
        return rule

    def _at_init(self, rule: ModuleRule | None) -> ModuleRule | None:
        # At init a half layer reads the float32 params it has just created, so its output is
        # float32; handing it on in the compute dtype keeps the activations' dtypes those of
        # apply (a scan carry keeps its type, a cache its dtype).
        if self.init and rule is not None and rule.action == "half":
            return dataclasses.replace(rule, output=rule.compute_dtype)
        return rule

    def replace(self, module: nn.Module) -> nn.Module | None:
        """A clone bound to the same scope with the fused attention / fp8 op, or None."""
        updates = {}
        if self.rules.fused_attention and _uses_default_attention(module):
            updates["attention_fn"] = fused_attention
        if self.rules.fp8_matmuls is not None or self.rules.matmul_formats:
            field = linen_fp8_field(module)
            # The module's own format (a path or class format rule), else the rules' fp8_matmuls.
            recipe = self.rules.module_format(module.path, module) if field is not None else None
            if field is not None and recipe is not None:
                rule = self.decide(module)
                if rule is not None and rule.action == "half":
                    cls = Fp8DotGeneral if field == "dot_general_cls" else Fp8ConvGeneralDilated
                    updates[field] = functools.partial(cls, recipe=recipe)
        if not updates:
            return None
        # Same scope, same path and name: params, sown values, RNG streams and fp8 state keys
        # are the module's own; the clone's call comes back through the interceptor.
        return module.clone(parent=module.scope, **updates)

    def observe(self, module: nn.Module, rule: ModuleRule) -> None:
        if self.init and rule.action == "half":
            rule = dataclasses.replace(rule, output="computed")
        self.seen.setdefault(tuple(str(p) for p in module.path), rule)
        if rule.action != "half" and is_float32_rule(rule):
            self.float32_paths.setdefault(tuple(str(p) for p in module.path), rule)
        if rule.action == "half" and np.dtype(rule.compute_dtype).itemsize < 4 and explicit_float32(module):
            self.overridden.setdefault(join_path(module.path), type(module).__name__)

    def on_error(self, module: nn.Module) -> None:
        if self.failed_params is None and module.scope is not None:
            # Everything created so far in this call (the root scope's params), for a second pass.
            self.failed_params = module.scope.root.variables().get("params")

    def interceptor(self) -> Callable:
        return module_interceptor(self.decide, self.replace, self.observe, self.on_error)


def _param_dtype_at(rules: dict[Path, ModuleRule], path: Path, default: np.dtype) -> np.dtype:
    for n in range(len(path), -1, -1):  # the nearest ruled module at or above ``path`` (as cast_by_path)
        rule = rules.get(path[:n])
        if rule is not None:
            return np.dtype(rule.compute_dtype)
    return np.dtype(default)


def _missed(seen: dict[Path, ModuleRule], used: dict[Path, ModuleRule], default: np.dtype) -> bool:
    """Whether some ruled module met in a call had its params cast to another dtype than its rule's."""
    return any(np.dtype(rule.compute_dtype) != _param_dtype_at(used, path, default) for path, rule in seen.items())


def _overlay(tree: Any, masters: Any) -> Any:
    """``tree`` with every leaf that ``masters`` also has taken from ``masters`` (the uncast values)."""
    if masters is None:
        return tree
    flat = {path: leaf for path, leaf in jax.tree_util.tree_flatten_with_path(masters)[0]}
    return jax.tree_util.tree_map_with_path(lambda path, leaf: flat.get(path, leaf), tree)


def _has_new_params(created: Any, known: Any) -> bool:
    known_paths = {p for p, _ in jax.tree_util.tree_flatten_with_path(known)[0]} if known is not None else set()
    return any(p not in known_paths for p, _ in jax.tree_util.tree_flatten_with_path(created)[0])


@dataclasses.dataclass(frozen=True)
class MixedPrecision:
    """A Linen module run under a policy: ``init`` and ``apply`` like the module's own.

    Build it with [`jaxmp.flax.mixed_precision`][jaxmp.flax.mixed_precision]. Hashable, so it can be static data
    (e.g. a field of [`jaxmp.flax.TrainState`][jaxmp.flax.TrainState]).

    Attributes:
      module: the unmodified Linen module.
      policy: the model-wide [`jaxmp.Policy`][jaxmp.Policy] (a string / jmp.Policy / Recipe is resolved).
      rules: the [`jaxmp.AutocastRules`][jaxmp.AutocastRules] (None: [`jaxmp.flax.default_rules`][jaxmp.flax.default_rules] of the preset).

    Example:
      >>> import jax, jax.numpy as jnp, flax.linen as nn, jaxmp, jaxmp.flax
      >>> net = nn.Sequential([nn.Dense(3), nn.BatchNorm(use_running_average=False)])
      >>> model = jaxmp.flax.mixed_precision(net, "O1-bf16")
      >>> x = jnp.ones((2, 4))
      >>> variables = model.init(jax.random.key(0), x)
      >>> logits, updates = model.apply(variables, x, mutable=["batch_stats"])
      >>> logits.dtype, updates["batch_stats"]["layers_1"]["mean"].dtype
      (dtype('float32'), dtype('float32'))
    """

    module: nn.Module
    policy: PolicyLike
    rules: AutocastRules | None = None

    def __post_init__(self):
        if isinstance(self.module, type) and issubclass(self.module, nn.Module):
            raise TypeError(f"expected a Linen module instance, got the class {self.module.__name__}; instantiate it first")
        if not isinstance(self.module, nn.Module):
            raise TypeError(f"expected a flax.linen.Module instance, got {type(self.module).__name__}")
        policy, rules = resolve_rules(self.policy, self.rules)
        object.__setattr__(self, "policy", policy)
        object.__setattr__(self, "rules", rules)

    # -- the two Linen entry points --------------------------------------------------------

    def init(self, rngs: jax.Array | dict[str, jax.Array], *args, method: str | Callable | None = None,
             **kwargs) -> PyTree:
        """Initialises the module; params are stored in their rule's param dtype.

        Float32 modules keep float32 params; other collections (``batch_stats``) are left as
        Flax made them.

        Args:
          rngs: a PRNG key or a dict of them, as for ``module.init``.
          *args: inputs for the forward pass that creates the variables.
          method: as for ``module.init``.
          **kwargs: forwarded to ``module.init`` (e.g. ``train=False``).

        Returns:
          The variables dict.

        Example:
          >>> import jax, jax.numpy as jnp, flax.linen as nn, jaxmp, jaxmp.flax
          >>> x = jnp.ones((2, 4))
          >>> model = jaxmp.flax.mixed_precision(nn.Dense(3), "O2-bf16")
          >>> variables = model.init(jax.random.key(0), x)
          >>> variables["params"]["kernel"].dtype
          dtype(bfloat16)
        """
        args, kwargs = self.policy.cast_to_compute((args, kwargs))
        mutable = kwargs.pop("mutable", nn.DenyList("intermediates"))
        rng_dict = rngs if isinstance(rngs, dict) else {"params": rngs}
        compute = np.dtype(self.policy.compute_dtype)
        rules = dict(self._known_rules())
        known = None  # the params created by earlier passes, uncast (see docs/design.md#the-linen-door)
        for _ in range(_MAX_INIT_PASSES):
            call = _Call(self.policy, self.rules, init=True)
            try:
                # Params are created float32 and read as created in this pass, so it runs under
                # standard promotion; the params it makes do not depend on the promotion mode.
                with jax.numpy_dtype_promotion("standard"), nn.intercept_methods(call.interceptor()):
                    if known is None:
                        variables = self.module.init(rngs, *args, method=method, mutable=mutable, **kwargs)
                    else:
                        pre = {"params": cast_by_path(known, rules, compute, "compute_dtype")}
                        variables = self.module.apply(pre, *args, rngs=rng_dict, method=method, mutable=mutable,
                                                      **kwargs)[1]
            except Exception:
                rules.update(call.seen)
                if call.failed_params is None or not _has_new_params(call.failed_params, known):
                    raise
                # A layer refused what it was given (a float32 param it had just created): pass
                # everything created so far back in, cast by path, and run again.
                known = _overlay(call.failed_params, known)
                continue
            break
        else:
            raise RuntimeError(f"jaxmp.flax: init did not converge in {_MAX_INIT_PASSES} passes")
        rules.update(call.seen)
        self._remember(rules)
        self._mark_discovered(method)  # init met every module this method reaches: apply needs no abstract pass
        if "params" not in variables:
            return variables
        params = _overlay(variables["params"], known)
        params = cast_by_path(params, rules, self.policy.param_dtype, "param_dtype")
        return {**variables, "params": params}

    def apply(self, variables: PyTree, *args, rngs: jax.Array | dict[str, jax.Array] | None = None,
              method: str | Callable | None = None, mutable: bool | str | Sequence[str] = False,
              **kwargs) -> Any:
        """Runs the module under the policy; same signature and return as ``module.apply``.

        Args:
          variables: ``{"params": ..., "batch_stats": ...}`` (params in any float dtype;
            usually the float32 masters).
          *args: model inputs; floating ones are cast to the compute dtype.
          rngs: as for ``module.apply`` (e.g. ``{"dropout": key}``).
          method: as for ``module.apply``.
          mutable: as for ``module.apply`` (e.g. ``["batch_stats"]``).
          **kwargs: forwarded; floating arrays among them are cast to the compute dtype.

        Returns:
          The output cast to the policy's output dtype, or ``(output, updated_collections)``
          when ``mutable`` is set (collections are not cast).

        Example:
          >>> import jax, jax.numpy as jnp, flax.linen as nn, jaxmp, jaxmp.flax
          >>> model, x = jaxmp.flax.mixed_precision(nn.Dense(3), "O1-bf16"), jnp.ones((2, 4))
          >>> variables = model.init(jax.random.key(0), x)
          >>> logits = model.apply(variables, x)
          >>> grads = jax.grad(lambda p: model.apply({"params": p}, x).sum())(variables["params"])
          >>> logits.dtype, grads["kernel"].dtype          # f32 output, grads for the f32 params
          (dtype('float32'), dtype('float32'))
        """
        rules = door_rules(self, self.rules)
        if rules is not self.rules:  # the debugger measuring a fix: the door rebuilt with these rules
            return dataclasses.replace(self, rules=rules).apply(variables, *args, rngs=rngs, method=method,
                                                                mutable=mutable, **kwargs)
        out, _ = self._apply(variables, args, kwargs, rngs, method, mutable, engine=True)
        if mutable is not False and mutable is not None and isinstance(out, tuple) and len(out) == 2:
            return self.policy.cast_to_output(out[0]), out[1]
        return self.policy.cast_to_output(out)

    def _known_rules(self) -> dict[Path, ModuleRule]:
        """``{module path: rule}`` this wrapper has met (by ``init`` or an earlier ``apply``)."""
        return self.__dict__.setdefault("_param_rules", {})

    def _mark_discovered(self, method: Any) -> None:
        """Records that this wrapper knows every module ``method`` reaches (no abstract pass needed)."""
        try:
            self.__dict__.setdefault("_discovered", set()).add(method)
        except TypeError:  # an unhashable method is looked up every time
            pass

    def _remember(self, rules: dict[Path, ModuleRule]) -> dict[Path, ModuleRule]:
        known = self._known_rules()
        known.update(rules)  # paths -> rules is a function of the model: racing threads agree
        return known

    def _apply(self, variables: Any, args: tuple, kwargs: dict, rngs: Any, method: Any, mutable: Any,
               engine: bool) -> tuple[Any, _Call]:
        """Runs the model with params cast by path (rules found by an abstract pass the first time)."""
        try:
            first = method not in self.__dict__.get("_discovered", ())
        except TypeError:  # an unhashable method: look every time
            first = True
        if first:
            # A wrapper that has not run this method yet (e.g. built around restored params) may
            # not know which module owns which param: find out abstractly, so no ops are emitted.
            jax.eval_shape(lambda v: self._settled(v, args, kwargs, rngs, method, mutable, False)[0], variables)
            self._mark_discovered(method)
        return self._settled(variables, args, kwargs, rngs, method, mutable, engine)

    def _settled(self, variables: Any, args: tuple, kwargs: dict, rngs: Any, method: Any, mutable: Any,
                 engine: bool) -> tuple[Any, _Call]:
        """Runs the model once with params cast by path; again if it met a ruled module it had not known."""
        config = flax_config(self.policy, self.rules)
        compute = np.dtype(self.policy.compute_dtype)
        known = self._known_rules()
        # O1 (promote="demand"): only the weights, params whose every use is a half-list op, go
        # to half, cast by the engine on entry as O2 autocast casts its weights; a bias or a norm
        # scale enters float32 and the engine's promotion decides, as under jaxmp.autocast. A
        # model that refuses float32 params while traced (a half-only kernel) is traced again
        # with every param cast first, as O2 and O3 always do.
        weights_only = engine and not config.identity and config.rules.promote == "demand"
        for _ in range(_MAX_INIT_PASSES):
            used, call = dict(known), _Call(self.policy, self.rules)

            run = self._runner(method, mutable, used, weights_only)
            run_config = dataclasses.replace(config, cast_inputs="weights") if weights_only else config
            fn = run if (config.identity or not engine) else (
                self._cached_engine_fn(run_config, method, mutable, used, weights_only)
                or engine_function(run, run_config, cast_outputs=False, cache=False))
            try:
                _TRACING.call = call
                out = fn(variables, args, kwargs, rngs)
            except Exception:
                if weights_only:
                    weights_only = False
                    continue
                if not _missed(call.seen, used, compute):
                    raise
                known = self._remember(call.seen)  # e.g. a float32 norm that got half params: again
                continue
            if _missed(call.seen, used, compute):
                known = self._remember(call.seen)
                continue
            self._warn_overridden(call.overridden)
            self._warn_unmatched(call.met)
            return out, call
        raise RuntimeError(f"jaxmp.flax: the module rules of {type(self.module).__name__} did not settle")

    def _runner(self, method: Any, mutable: Any, used: dict[Path, ModuleRule], weights_only: bool) -> Callable:
        """``run(variables, args, kwargs, rngs)``: the module's ``apply`` with params cast by path, under
        the interceptor of the `_Call` of the ``apply`` that traces it (`_TRACING`)."""
        policy: Policy = typing.cast(Policy, self.policy)
        module = self.module
        compute = np.dtype(policy.compute_dtype)

        def run(variables, args, kwargs, rngs):
            args, kwargs = policy.cast_to_compute((args, kwargs))
            if "params" in variables:
                params = variables["params"]
                cast = cast_by_path(params, used, compute, "compute_dtype")
                if weights_only:  # only a per-class dtype other than the policy's is cast here
                    cast = jax.tree.map(lambda c, p: p if c.dtype == compute else c, cast, params)
                variables = {**variables, "params": cast}
            # Float32 biases meet half kernels in Flax's own promote_dtype: traced under standard
            # promotion (a caller's strict mode would refuse it); the engine then sets every dtype.
            promotion = jax.numpy_dtype_promotion("standard") if weights_only else contextlib.nullcontext()
            with promotion, nn.intercept_methods(_TRACING.call.interceptor()):
                return module.apply(variables, *args, rngs=rngs, method=method, mutable=mutable, **kwargs)

        run.__qualname__ = f"jaxmp.flax.mixed_precision({type(module).__name__})"  # as warnings name it
        return run

    def _cached_engine_fn(self, config: Any, method: Any, mutable: Any, used: dict[Path, ModuleRule],
                          weights_only: bool) -> Callable | None:
        """The engine function of this wrapper for one static setting, its traces cached per input signature.

        Traced once per signature (params, inputs, rngs: shapes and dtypes; static leaves), as
        ``jaxmp.autocast`` is, rather than on every ``apply``: the module is this wrapper's, and
        the key holds everything else the trace reads (method, mutable, the rules by path, the
        engine settings). None (trace on every call, as ``module.apply`` does) while a Flax method
        interceptor is active, whose trace-time effects a cached trace would skip, or when the
        setting is unhashable.
        """
        if len(getattr(nn.module, "_global_interceptor_stack", ())):
            return None
        try:
            key = (config, method, tuple(mutable) if isinstance(mutable, list) else mutable,
                   tuple(sorted(used.items())), weights_only)
            hash(key)
        except TypeError:
            return None
        try:  # equal wrappers (same module, policy and rules) trace alike: they share the cache
            fns = _ENGINE_FNS.setdefault(self, {})
        except TypeError:  # an unhashable module
            return None
        fn = fns.get(key)
        if fn is None:
            run = self._runner(method, mutable, used, weights_only)
            fn = fns[key] = engine_function(run, config, cast_outputs=False)
        return fn

    def _warn_overridden(self, overridden: dict[str, str]) -> None:
        """One [`jaxmp.MixedPrecisionWarning`][jaxmp.MixedPrecisionWarning] per wrapped model for layers whose float32 dtype lost.

        Runs at trace time; a layer is named at most once per wrapped model (a later trace that
        reaches layers not seen before, e.g. another ``method``, names only those).
        """
        warned = self.__dict__.setdefault("_warned_float32", set())
        new = {p: c for p, c in overridden.items() if p not in warned}
        if not new:
            return
        warned.update(new)
        warnings.warn(overridden_float32_message(list(new), list(new.values()), self.policy.compute_dtype),
                      MixedPrecisionWarning, stacklevel=3)

    def _warn_unmatched(self, met: dict[str, type]) -> None:
        """One [`jaxmp.MixedPrecisionWarning`][jaxmp.MixedPrecisionWarning] per wrapped model for the
        user's path and class rules that match no module the call met (`unmatched_rules_message`)."""
        if self.__dict__.get("_warned_unmatched") or not met or (not self.rules.path_rules
                                                                 and not self.rules.class_rules):
            return
        message = unmatched_rules_message(self.rules, met, met.values(), type(self.module).__name__)
        if message is not None:
            self.__dict__["_warned_unmatched"] = True
            warnings.warn(message, MixedPrecisionWarning, stacklevel=3)

    # -- conveniences ------------------------------------------------------------------------

    def module_rules(self, variables: PyTree, *args, method: str | Callable | None = None, **kwargs) -> dict[Path, ModuleRule]:
        """Which modules have a rule and what it is, as seen by tracing one call.

        Args:
          variables: the variables, as for [`apply`][jaxmp.flax.linen.MixedPrecision.apply].
          *args: inputs, as for [`apply`][jaxmp.flax.linen.MixedPrecision.apply].
          method: as for [`apply`][jaxmp.flax.linen.MixedPrecision.apply].
          **kwargs: as for [`apply`][jaxmp.flax.linen.MixedPrecision.apply] (``mutable``/``rngs`` accepted).

        Returns:
          ``{module path: ModuleRule}`` for the ruled modules that ran.

        Example:
          >>> import jax, jax.numpy as jnp, flax.linen as nn, jaxmp, jaxmp.flax
          >>> net = nn.Sequential([nn.Dense(3), nn.BatchNorm(use_running_average=True)])
          >>> model, x = jaxmp.flax.mixed_precision(net, "O1-bf16"), jnp.ones((2, 4))
          >>> rules = model.module_rules(model.init(jax.random.key(0), x), x)
          >>> rules[("layers_0",)].compute_dtype, rules[("layers_1",)].compute_dtype
          (dtype(bfloat16), dtype('float32'))
        """
        rngs, mutable = kwargs.pop("rngs", None), kwargs.pop("mutable", False)
        seen: dict[Path, ModuleRule] = {}

        def run(v):
            out, call = self._apply(v, args, kwargs, rngs, method, mutable, engine=False)
            seen.update(call.seen)
            return out

        jax.eval_shape(run, variables)
        return seen
