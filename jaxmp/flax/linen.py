"""Run an unmodified Linen module under a precision policy with per-module-class overrides.

How it works (no edit to the model, one trace, no float32 rehearsal):

1. ``apply`` runs the model once, inside :func:`jaxmp.autocast`'s engine. While it is traced,
   ``nn.intercept_methods`` casts the floating inputs of every ruled module to its compute
   dtype and its outputs as the rule says (float32 modules hand back their input's dtype), and
   every param a module reads (``Module.param``) is cast to the compute dtype of the nearest
   enclosing ruled module (float32 under a ``BatchNorm``, the policy's compute dtype
   elsewhere). A layer therefore sees half inputs and half params when it is traced: kernels
   that refuse float32 (cuDNN attention, fp8 dots, Pallas) work. The casts are ``astype`` in the
   caller's trace, so gradients come back to the stored (float32 master) params.
2. Float32 modules and per-class policies run inside ``jaxmp[<dtype>]`` regions; the engine's
   op lists decide the rest (the softmax of Flax's attention and every reduction in float32
   under O1; pure half under O2/O3 outside norms).
3. Attention modules get :func:`jaxmp.flax.fused_attention`: ``jax.nn.dot_product_attention``
   (cuDNN on GPUs, XLA with a float32 softmax elsewhere) where the call allows it.
4. Model inputs are cast to the policy's compute dtype and outputs to its output dtype.

A half-list module built with ``dtype=float32`` runs in half like the others (Flax casts back to
float32 and the engine's half list narrows the matmul); the interceptor notes its path and the
first ``apply`` that reaches it emits one :class:`jaxmp.MixedPrecisionWarning` per wrapped model.
Modules matching a path rule (``PrecisionOverrides.with_fp32_paths``) get the float32 rule.

Only the ``params`` collection is cast; ``batch_stats`` and other collections are passed
through untouched (BatchNorm statistics stay float32). ``init`` runs under the same casts,
records which module owns which param, and stores each param in its rule's param dtype.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import warnings
from typing import Any, Callable

import flax.linen as nn
import jax
import numpy as np

from jaxmp.engine import flax_config
from jaxmp.engine import engine_function
from jaxmp.engine.rules import marker
from jaxmp.flax.attention import fused_attention
from jaxmp.flax.fp8 import linen_fp8_field, linen_fp8_op
from jaxmp.flax.casting import Path, cast_by_path, cast_output, first_floating_dtype
from jaxmp.flax.overrides import (ModuleRule, PrecisionOverrides, explicit_float32, join_path,
                                  overridden_float32_message, resolve_overrides)
from jaxmp.dtypes import cast_floating
from jaxmp.policy import Policy
from jaxmp.traps import MixedPrecisionWarning

def _uses_default_attention(module: nn.Module) -> bool:
    return (
        isinstance(module, nn.MultiHeadDotProductAttention)
        and module.attention_fn is nn.dot_product_attention
        and module.qk_attn_weights_einsum_cls is None
        and module.attn_weights_value_einsum_cls is None
    )


@contextlib.contextmanager
def _fused_attention(module: nn.Module):
    """Temporarily gives a bound attention module :func:`jaxmp.flax.fused_attention`.

    Linen modules are frozen dataclasses, so the field is swapped with ``object.__setattr__``
    on the bound instance for the duration of the call and restored afterwards; the module
    the user holds is a different (unbound) object and never changes.
    """
    old = module.attention_fn
    object.__setattr__(module, "attention_fn", fused_attention)
    try:
        yield
    finally:
        object.__setattr__(module, "attention_fn", old)


class _RuleCache:
    """Module -> rule lookups (path rules first, then class rules), memoised per apply."""

    def __init__(self, policy: Policy, overrides: PrecisionOverrides):
        self.policy, self.overrides, self._by_class = policy, overrides, {}

    def __call__(self, module: Any) -> ModuleRule | None:
        if self.overrides.fp32_paths and self.overrides.fp32_path_match(module.path) is not None:
            return self.overrides.rule_at(module.path, module, self.policy)
        cls = type(module)
        if cls not in self._by_class:
            self._by_class[cls] = self.overrides.rule_for(cls, self.policy)
        return self._by_class[cls]


def _skip(context: Any) -> bool:
    # setup() and private helpers are not layer calls: their arguments are not activations.
    name = context.method_name
    return name == "setup" or (name.startswith("_") and not name.startswith("__"))


#: The param-dtype stack of the Linen apply traced in this thread / context (None outside one).
_PARAM_DTYPES: contextvars.ContextVar = contextvars.ContextVar("jaxmp_linen_param_dtypes", default=None)
_ORIGINAL_PARAM = nn.Module.param


def _casting_param(self, name, init_fn, *init_args, unbox=True, **init_kwargs):
    value = _ORIGINAL_PARAM(self, name, init_fn, *init_args, unbox=unbox, **init_kwargs)
    stack = _PARAM_DTYPES.get()
    return value if stack is None else cast_floating(value, stack[-1])


_casting_param.__wrapped__ = _ORIGINAL_PARAM


@contextlib.contextmanager
def _params_cast_to(stack: list):
    """While active, ``Module.param`` returns its value cast to ``stack[-1]`` (floating leaves only).

    Linen has no interceptor for ``param``, so jaxmp installs a casting ``Module.param`` once; it
    reads the stack from a context variable, so outside a ``mixed_precision`` apply (and in any
    other thread) it is Flax's own ``param``.
    """
    if nn.Module.param is not _casting_param:
        nn.Module.param = _casting_param
    token = _PARAM_DTYPES.set(stack)
    try:
        yield
    finally:
        _PARAM_DTYPES.reset(token)


def _region(rule: ModuleRule, module: nn.Module):
    # Half modules need no region: their traced casts are kept and the op lists do the rest.
    if rule.kind == "half":
        return contextlib.nullcontext()
    return jax.named_scope(marker(np.dtype(rule.compute_dtype).name, type(module).__name__))


def _casting_interceptor(rule_of: _RuleCache, overrides: PrecisionOverrides, param_dtypes: list,
                         record: dict | None = None, overridden: dict | None = None) -> Callable:
    def interceptor(next_fun, args, kwargs, context):
        if _skip(context):
            return next_fun(*args, **kwargs)
        module = context.module
        attention = _fused_attention(module) if overrides.fused_attention and _uses_default_attention(module) \
            else contextlib.nullcontext()
        rule = rule_of(module)
        if rule is None:
            with attention:
                return next_fun(*args, **kwargs)
        if record is not None:
            record.setdefault(tuple(module.path), rule)
        if overridden is not None and rule.kind == "half" and np.dtype(rule.compute_dtype).itemsize < 4 \
                and explicit_float32(module):
            overridden.setdefault(join_path(module.path), type(module).__name__)
        input_dtype = first_floating_dtype((args, kwargs))
        args, kwargs = cast_floating((args, kwargs), rule.compute_dtype)
        param_dtypes.append(rule.compute_dtype)
        fp8_field = linen_fp8_field(module) if overrides.fp8 is not None and rule.kind == "half" else None
        fp8_op = linen_fp8_op(module, fp8_field, overrides.fp8) if fp8_field else contextlib.nullcontext()
        try:
            with attention, fp8_op, _region(rule, module):
                out = next_fun(*args, **kwargs)
        finally:
            param_dtypes.pop()
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
      >>> import jax, jax.numpy as jnp, flax.linen as nn, jaxmp, jaxmp.flax
      >>> net = nn.Sequential([nn.Dense(3), nn.BatchNorm(use_running_average=False)])
      >>> model = jaxmp.flax.mixed_precision(net, "O1-bf16")
      >>> x = jnp.ones((2, 4))
      >>> logits, updates = model.apply(model.init(jax.random.key(0), x), x, mutable=["batch_stats"])
      >>> logits.dtype, updates["batch_stats"]["layers_1"]["mean"].dtype
      (dtype('float32'), dtype('float32'))
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
          >>> import jax, jax.numpy as jnp, flax.linen as nn, jaxmp, jaxmp.flax
          >>> x = jnp.ones((2, 4))
          >>> variables = jaxmp.flax.mixed_precision(nn.Dense(3), "O2-bf16").init(jax.random.key(0), x)
          >>> variables["params"]["kernel"].dtype
          dtype(bfloat16)
        """
        rules: dict[Path, ModuleRule] = {}
        args, kwargs = self.policy.cast_to_compute((args, kwargs))
        with self._casting(rules):  # the same casts as apply: a half-only layer initialises too
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
          >>> import jax, jax.numpy as jnp, flax.linen as nn, jaxmp, jaxmp.flax
          >>> model, x = jaxmp.flax.mixed_precision(nn.Dense(3), "O1-bf16"), jnp.ones((2, 4))
          >>> variables = model.init(jax.random.key(0), x)
          >>> logits = model.apply(variables, x)
          >>> grads = jax.grad(lambda p: model.apply({"params": p}, x).sum())(variables["params"])
          >>> logits.dtype, grads["kernel"].dtype          # f32 output, grads for the f32 params
          (dtype('float32'), dtype('float32'))
        """
        out = self._runner(method, mutable)(variables, args, kwargs, rngs)
        if mutable is not False and mutable is not None and isinstance(out, tuple) and len(out) == 2:
            return self.policy.cast_to_output(out[0]), out[1]
        return self.policy.cast_to_output(out)

    def _runner(self, method: Any, mutable: Any) -> Callable:
        """The engine-wrapped apply for one (method, mutable)."""
        key = (method, tuple(mutable) if isinstance(mutable, list) else mutable)
        cache = self.__dict__.setdefault("_runners", {})
        if key not in cache:
            def run(variables, args, kwargs, rngs):
                args, kwargs = self.policy.cast_to_compute((args, kwargs))
                overridden: dict[str, str] = {}
                with self._casting(overridden=overridden):
                    out = self.module.apply(variables, *args, rngs=rngs, method=method, mutable=mutable, **kwargs)
                self._warn_overridden(overridden)
                return out

            config = flax_config(self.policy, self.overrides)
            cache[key] = run if config.identity else engine_function(run, config, cast_outputs=False, cache=False)
        return cache[key]

    @contextlib.contextmanager
    def _casting(self, record: dict | None = None, overridden: dict | None = None):
        """While active, ruled modules get their inputs and params in their compute dtype.

        Args:
          record: if given, filled with ``{module path: rule}`` for the ruled modules that run.
          overridden: if given, filled with ``{joined path: class name}`` for the half-list
            modules built with ``dtype=float32`` that run in the policy's half dtype.
        """
        param_dtypes = [self.policy.compute_dtype]
        rule_of = _RuleCache(self.policy, self.overrides)
        with nn.intercept_methods(_casting_interceptor(rule_of, self.overrides, param_dtypes, record, overridden)), \
                _params_cast_to(param_dtypes):
            yield

    def _warn_overridden(self, overridden: dict[str, str]) -> None:
        """One :class:`jaxmp.MixedPrecisionWarning` per wrapped model for layers whose float32 dtype lost.

        Runs at trace time; a layer is named at most once per wrapped model (a later trace that
        reaches layers not seen before, e.g. another ``method``, names only those).
        """
        warned = self.__dict__.setdefault("_warned_float32", set())
        new = {p: c for p, c in overridden.items() if p not in warned}
        if not new:
            return
        warned.update(new)
        warnings.warn(overridden_float32_message(list(new), list(new.values()), self.policy.compute_dtype),
                      MixedPrecisionWarning, stacklevel=2)

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
          >>> import jax, jax.numpy as jnp, flax.linen as nn, jaxmp, jaxmp.flax
          >>> net = nn.Sequential([nn.Dense(3), nn.BatchNorm(use_running_average=True)])
          >>> model, x = jaxmp.flax.mixed_precision(net, "O1-bf16"), jnp.ones((2, 4))
          >>> rules = model.module_rules(model.init(jax.random.key(0), x), x)
          >>> rules[("layers_0",)].compute_dtype, rules[("layers_1",)].compute_dtype
          (dtype(bfloat16), dtype('float32'))
        """
        rngs, mutable = kwargs.pop("rngs", None), kwargs.pop("mutable", False)
        rules: dict[Path, ModuleRule] = {}
        args, kwargs = self.policy.cast_to_compute((args, kwargs))

        def run(v):
            with self._casting(rules):
                return self.module.apply(v, *args, rngs=rngs, method=method, mutable=mutable, **kwargs)

        jax.eval_shape(run, variables)
        return rules
