"""Run an unmodified Linen module under a precision policy with per-module-class overrides.

How it works (no edit to the model):

1. Params are cast before ``apply``: each param leaf goes to the compute dtype of the
   nearest enclosing module that has a rule (float32 under a ``BatchNorm``, the policy's
   compute dtype elsewhere). The cast is an ``astype`` inside the caller's trace, so the
   gradient comes back to the stored (float32 master) params in their own dtype.
   Which module class owns which param subtree is only known by running the model, so
   ``apply`` first traces it abstractly (``jax.eval_shape``, no FLOPs) with an interceptor
   that records ``module.path -> rule``. Under ``jit`` that is one extra trace per compile.
2. ``nn.intercept_methods`` casts the floating inputs of every ruled module to its compute
   dtype and its outputs as the rule says (float32 modules hand back their input's dtype).
   Casting params as well as inputs matters: Flax's ``dtype=None`` promotion would
   otherwise compute a Dense with float32 params in float32 whatever its inputs.
3. Attention modules get :func:`jaxmp.flax.fp32_softmax_attention` while they run, so
   their softmax is float32 and both matmuls stay in half.
4. Model inputs are cast to the policy's compute dtype and outputs to its output dtype.

Only the ``params`` collection is cast; ``batch_stats`` and other collections are passed
through untouched (BatchNorm statistics stay float32).
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Callable

import flax.linen as nn
import jax
import numpy as np

from jaxmp.flax.attention import fp32_softmax_attention
from jaxmp.flax.casting import Path, cast_by_path, cast_output, first_floating_dtype
from jaxmp.flax.overrides import ModuleRule, PrecisionOverrides, resolve_overrides
from jaxmp.dtypes import cast_floating
from jaxmp.policy import Policy

def _uses_default_attention(module: nn.Module) -> bool:
    return (
        isinstance(module, nn.MultiHeadDotProductAttention)
        and module.attention_fn is nn.dot_product_attention
        and module.qk_attn_weights_einsum_cls is None
        and module.attn_weights_value_einsum_cls is None
    )


@contextlib.contextmanager
def _fp32_softmax(module: nn.Module):
    """Temporarily gives a bound attention module the fp32-softmax attention function.

    Linen modules are frozen dataclasses, so the field is swapped with ``object.__setattr__``
    on the bound instance for the duration of the call and restored afterwards; the module
    the user holds is a different (unbound) object and never changes.
    """
    old = module.attention_fn
    object.__setattr__(module, "attention_fn", fp32_softmax_attention)
    try:
        yield
    finally:
        object.__setattr__(module, "attention_fn", old)


class _RuleCache:
    """Class -> rule lookups, memoised per apply (MRO walks add up in deep models)."""

    def __init__(self, policy: Policy, overrides: PrecisionOverrides):
        self.policy, self.overrides, self._by_class = policy, overrides, {}

    def __call__(self, module: Any) -> ModuleRule | None:
        cls = type(module)
        if cls not in self._by_class:
            self._by_class[cls] = self.overrides.rule_for(cls, self.policy)
        return self._by_class[cls]


def _skip(context: Any) -> bool:
    # setup() and private helpers are not layer calls: their arguments are not activations.
    name = context.method_name
    return name == "setup" or (name.startswith("_") and not name.startswith("__"))


def _recording_interceptor(rule_of: _RuleCache, rules: dict[Path, ModuleRule]) -> Callable:
    def interceptor(next_fun, args, kwargs, context):
        if not _skip(context):
            rule = rule_of(context.module)
            if rule is not None:
                rules.setdefault(tuple(context.module.path), rule)
        return next_fun(*args, **kwargs)

    return interceptor


def _casting_interceptor(rule_of: _RuleCache, overrides: PrecisionOverrides) -> Callable:
    def interceptor(next_fun, args, kwargs, context):
        if _skip(context):
            return next_fun(*args, **kwargs)
        module = context.module
        softmax = _fp32_softmax(module) if overrides.fp32_softmax and _uses_default_attention(module) else contextlib.nullcontext()
        rule = rule_of(module)
        if rule is None:
            with softmax:
                return next_fun(*args, **kwargs)
        input_dtype = first_floating_dtype((args, kwargs))
        args, kwargs = cast_floating((args, kwargs), rule.compute_dtype)
        with softmax:
            out = next_fun(*args, **kwargs)
        return cast_output(out, rule, input_dtype)

    return interceptor


@dataclasses.dataclass(frozen=True)
class MixedPrecision:
    """A Linen module run under a policy: ``init`` and ``apply`` like the module's own.

    Build it with :func:`jaxmp.flax.mixed_precision`. Hashable, so it can be static data
    (e.g. a field of :class:`jaxmp.flax.TrainState`).

    Attributes:
      module: the unmodified Linen module.
      policy: the model-wide :class:`jaxmp.Policy` (a string / jmp.Policy / Recipe is resolved).
      overrides: the :class:`jaxmp.flax.PrecisionOverrides` (None: the preset's defaults).

    Example:
      >>> model = jaxmp.flax.mixed_precision(ResNet18(), "O1-bf16")
      >>> variables = model.init(jax.random.key(0), x, train=False)
      >>> logits, updates = model.apply(variables, x, train=True, mutable=["batch_stats"])
    """

    module: nn.Module
    policy: Any
    overrides: Any = None

    def __post_init__(self):
        if isinstance(self.module, type) and issubclass(self.module, nn.Module):
            raise TypeError(f"expected a Linen module instance, got the class {self.module.__name__}; instantiate it first")
        if not isinstance(self.module, nn.Module):
            raise TypeError(f"expected a flax.linen.Module instance, got {type(self.module).__name__}")
        policy, overrides = resolve_overrides(self.policy, self.overrides)
        object.__setattr__(self, "policy", policy)
        object.__setattr__(self, "overrides", overrides)

    # -- the two Linen entry points --------------------------------------------------------

    def init(self, rngs: Any, *args, method: Any = None, **kwargs) -> Any:
        """Initialises the module; params are stored in their rule's param dtype.

        Params under float32-list modules stay float32; params under a per-class policy
        take its param dtype; all others take the policy's param dtype (float32 for O1,
        half for O2/O3). Other collections (``batch_stats``) are left as Flax made them.

        Args:
          rngs: a PRNG key or a dict of them, as for ``module.init``.
          *args: inputs for the forward pass that creates the variables.
          method: as for ``module.init``.
          **kwargs: forwarded to ``module.init`` (e.g. ``train=False``).

        Returns:
          The variables dict.

        Example:
          >>> variables = jaxmp.flax.mixed_precision(nn.Dense(3), "O2-bf16").init(jax.random.key(0), x)
          >>> variables["params"]["kernel"].dtype
          dtype(bfloat16)
        """
        rules: dict[Path, ModuleRule] = {}
        # A plain float32 forward: params do not exist yet, so nothing can be cast consistently
        # (half inputs against float32 params would even fail under strict dtype promotion).
        with nn.intercept_methods(_recording_interceptor(_RuleCache(self.policy, self.overrides), rules)):
            variables = self.module.init(rngs, *args, method=method, **kwargs)
        if "params" not in variables:
            return variables
        params = cast_by_path(variables["params"], rules, self.policy.param_dtype, "param_dtype")
        return {**variables, "params": params}

    def apply(self, variables: Any, *args, rngs: Any = None, method: Any = None, mutable: Any = False,
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
          >>> logits = model.apply(variables, x, train=False)
          >>> grads = jax.grad(lambda p: model.apply({"params": p}, x).sum())(variables["params"])
        """
        rule_of = _RuleCache(self.policy, self.overrides)
        rules = self._trace_rules(rule_of, variables, args, kwargs, rngs, method, mutable)
        if "params" in variables:
            params = cast_by_path(variables["params"], rules, self.policy.compute_dtype, "compute_dtype")
            variables = {**variables, "params": params}
        args, kwargs = self.policy.cast_to_compute((args, kwargs))
        with nn.intercept_methods(_casting_interceptor(rule_of, self.overrides)):
            out = self.module.apply(variables, *args, rngs=rngs, method=method, mutable=mutable, **kwargs)
        if mutable is not False and mutable is not None and isinstance(out, tuple) and len(out) == 2:
            return self.policy.cast_to_output(out[0]), out[1]
        return self.policy.cast_to_output(out)

    def _trace_rules(self, rule_of: _RuleCache, variables: Any, args: tuple, kwargs: dict, rngs: Any,
                     method: Any, mutable: Any) -> dict[Path, ModuleRule]:
        """Which ruled module owns which param subtree: an abstract pass (trace only, no FLOPs).

        It runs the model uncast and entirely in float32 so that it is a consistent program
        whatever the policy (params and inputs of mixed dtypes would, e.g., break the carry
        types of ``nn.scan``), and under standard promotion even if the caller is strict.
        """
        rules: dict[Path, ModuleRule] = {}
        f32_variables = cast_floating(variables, np.float32)
        f32_args, f32_kwargs = cast_floating((args, kwargs), np.float32)

        def run(v):
            with nn.intercept_methods(_recording_interceptor(rule_of, rules)):
                return self.module.apply(v, *f32_args, rngs=rngs, method=method, mutable=mutable, **f32_kwargs)

        with jax.numpy_dtype_promotion("standard"):
            jax.eval_shape(run, f32_variables)
        return rules

    # -- conveniences ------------------------------------------------------------------------

    def module_rules(self, variables: Any, *args, method: Any = None, **kwargs) -> dict[Path, ModuleRule]:
        """Which modules have a rule and what it is, as seen by tracing one call.

        Args:
          variables: the variables, as for :meth:`apply`.
          *args: inputs, as for :meth:`apply`.
          method: as for :meth:`apply`.
          **kwargs: as for :meth:`apply` (``mutable``/``rngs`` accepted).

        Returns:
          ``{module path: ModuleRule}`` for the ruled modules that ran.

        Example:
          >>> model.module_rules(variables, x)[("BatchNorm_0",)].compute_dtype
          dtype('float32')
        """
        rngs, mutable = kwargs.pop("rngs", None), kwargs.pop("mutable", False)
        return self._trace_rules(_RuleCache(self.policy, self.overrides), variables, args, kwargs, rngs, method, mutable)
