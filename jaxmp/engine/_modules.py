"""Module rules: the one place where "every LayerNorm in float32" is decided and applied.

`ModuleRules.rule_at` decides a module's rule; `call_with_rule` applies it, through
`module_interceptor` (Linen, Haiku) or a ``__call__`` hook installed once per class (NNX,
Equinox, any class). See docs/architecture.md#module-rules.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Iterable
from typing import Any, Callable, Iterator

import jax
import numpy as np

from jaxmp import _effects
from jaxmp._dtypes import cast_floating, is_floating_array
from jaxmp.engine import _config
from jaxmp.engine._module_rules import ModuleRule, ModuleRules
from jaxmp.engine._rules import marker

def first_floating_dtype(tree: Any) -> np.dtype | None:
    """The dtype of the first floating array leaf of ``tree``.

    Args:
      tree: any pytree (e.g. a module call's ``(args, kwargs)``).

    Returns:
      A numpy dtype, or None if the tree has no floating array leaf.
    """
    for leaf in jax.tree_util.tree_leaves(tree):
        if is_floating_array(leaf):
            return np.dtype(leaf.dtype)
    return None


def cast_output(out: Any, rule: ModuleRule, input_dtype: np.dtype | None) -> Any:
    """Casts a ruled module's output as its rule says.

    Args:
      out: the module's return value (any pytree; only floating arrays are cast).
      rule: the module's `jaxmp.engine._module_rules.ModuleRule`.
      input_dtype: the dtype of the module's first floating input, before casting.

    Returns:
      ``out`` unchanged (``"computed"``), cast back to ``input_dtype`` (``"input"``, the
      float32 list), or cast to the rule's dtype (a per-class policy's output dtype).
    """
    if rule.output == "computed":
        return out
    if rule.output == "input":
        return out if input_dtype is None else cast_floating(out, input_dtype)
    return cast_floating(out, rule.output)


def call_with_rule(rule: ModuleRule, label: str, call: Callable, args: tuple, kwargs: dict) -> Any:
    """Runs one module call under its rule: input casts, the engine region, the output cast.

    Args:
      rule: the `jaxmp.engine._module_rules.ModuleRule` (from `ModuleRules.rule_at`).
      label: shown after the region marker in profiles and jaxprs (the class name).
      call: the call itself, ``call(*args, **kwargs)``.
      args: positional arguments.
      kwargs: keyword arguments.

    Returns:
      The call's output, cast as the rule says.
    """
    input_dtype = None
    if rule.casts:
        input_dtype = first_floating_dtype((args, kwargs))
        args, kwargs = cast_floating((args, kwargs), rule.compute_dtype)
    # Half rules are no region: their casts are in the trace and the op lists decide the rest.
    scope = jax.named_scope(marker(rule.region, label) if rule.region is not None else label)
    with scope:
        out = call(*args, **kwargs)
    return cast_output(out, rule, input_dtype) if rule.casts else out


def is_layer_call(method_name: str) -> bool:
    """Whether an intercepted method is a layer call (its arguments are activations).

    ``setup`` and private helpers are not; ``__call__`` and public methods (``Embed.attend``) are.
    """
    return method_name != "setup" and not (method_name.startswith("_") and not method_name.startswith("__"))


def module_interceptor(decide: Callable[[Any], ModuleRule | None],
                       replace: Callable[[Any], Any] | None = None,
                       observe: Callable[[Any, ModuleRule], None] | None = None,
                       on_error: Callable[[Any], None] | None = None) -> Callable:
    """The method interceptor (Flax Linen, Haiku) that applies module rules.

    Args:
      decide: ``decide(module) -> ModuleRule | None`` (usually `ModuleRules.rule_at`
        on the module's path and class).
      replace: optional ``replace(module) -> module | None``: a module to call instead (a
        clone with other fields, e.g. the fused attention function); the replacement's call
        goes through this interceptor again. Nothing is set on the original module.
      observe: optional ``observe(module, rule)`` for each ruled call (recording).
      on_error: optional ``on_error(module)`` when a call raises (before it propagates).

    Returns:
      An interceptor for ``flax.linen.intercept_methods`` / ``haiku.intercept_methods``.
    """

    def interceptor(next_fun, args, kwargs, context):
        if not is_layer_call(context.method_name):
            return next_fun(*args, **kwargs)
        module = context.module
        if replace is not None:
            other = replace(module)
            if other is not None:
                return getattr(other, context.method_name)(*args, **kwargs)
        try:
            rule = decide(module)
            if rule is None:
                return next_fun(*args, **kwargs)
            if observe is not None:
                observe(module, rule)
            return call_with_rule(rule, type(module).__name__, next_fun, args, kwargs)
        except BaseException:
            if on_error is not None:
                on_error(module)
            raise

    return interceptor


@contextlib.contextmanager
def _intercepted(module_name: str, rules: ModuleRules) -> Iterator[None]:
    """Flax Linen (``flax.linen``) and Haiku (``haiku``) have (thread-local) method interceptors: use them."""
    lib = sys.modules.get(module_name)
    if lib is None or not any(issubclass(c, lib.Module) for c, _ in rules.classes):
        yield
        return

    def decide(module):
        saw(module)
        return rules.rule_for(module)

    with lib.intercept_methods(module_interceptor(decide)):
        yield


def _subclasses(cls: type) -> list[type]:
    out, todo = [], [cls]
    while todo:
        c = todo.pop()
        out.append(c)
        todo.extend(c.__subclasses__())
    return out


def _is_intercepted_elsewhere(cls: type) -> bool:
    linen, hk = sys.modules.get("flax.linen"), sys.modules.get("haiku")
    return bool((linen and issubclass(cls, linen.Module)) or (hk and issubclass(cls, hk.Module)))


#: Per-thread: the instance-rule lookup of the NNX model the Flax front door is running
#: (`instance_rules`); consulted only while an engine trace is active in this thread.
_INSTANCES = threading.local()
_lock = threading.Lock()


#: Per-thread: the classes of the module calls an autocast trace made (`recording_classes`).
_SEEN = threading.local()


@contextlib.contextmanager
def recording_classes() -> Iterator[set]:
    """While active, the classes of this thread's ruled-class and intercepted module calls are
    collected into the yielded set (an autocast trace: which class rules matched something).

    Yields:
      The set of classes seen so far.
    """
    previous = getattr(_SEEN, "classes", None)
    seen: set = set()
    _SEEN.classes = seen
    try:
        yield seen
    finally:
        _SEEN.classes = previous


def saw(module: Any) -> None:
    """Records ``module``'s class for `recording_classes` (nothing when it is not active)."""
    seen = getattr(_SEEN, "classes", None)
    if seen is not None:
        seen.add(type(module))


def _active_rule(obj: Any) -> ModuleRule | None:
    cfg = _config.current()
    if cfg is None:
        return None
    saw(obj)
    by_id = getattr(_INSTANCES, "rules", None)
    if by_id is not None and id(obj) in by_id:
        return by_id[id(obj)]
    return cfg.modules.rule_for(obj) if cfg.modules else None


def _wrap_call(original):
    """A ``__call__`` that applies the running trace's rule for the instance (or just forwards)."""

    def __call__(self, *args, **kwargs):
        rule = _active_rule(self)
        if rule is None:
            return original(self, *args, **kwargs)
        return call_with_rule(rule, type(self).__name__, lambda *a, **k: original(self, *a, **k), args, kwargs)

    __call__.__wrapped__ = original
    __call__._jaxmp_marking = True
    return __call__


def install_call_hooks(classes: Iterable[type]) -> None:
    """Installs the rule-applying ``__call__`` on ``classes`` (and subclasses), once each.

    Idempotent: a class whose ``__call__`` is already the hook is left alone. The hook reads the
    rules of the autocast trace running in the calling thread (a per-thread ``jax.jit`` cache-key
    state) and only forwards the call outside one, so installing it changes nothing for code
    that runs without jaxmp, in this thread or any other. Linen and Haiku classes are skipped:
    their method interceptors do this job.

    Args:
      classes: module classes (NNX, Equinox, plain Python classes with ``__call__``).
    """
    with _lock:
        for cls in classes:
            if _is_intercepted_elsewhere(cls):
                continue
            # The ``__call__`` an instance runs may be defined by a base class (eqx.nn.Conv2d
            # inherits eqx.nn.Conv's): wrap the defining class; the wrapper checks the instance.
            for sub in _subclasses(cls):
                owner = next((c for c in sub.__mro__ if "__call__" in vars(c)), None)
                if owner is None or owner is object or owner is type:
                    continue
                if not getattr(vars(owner)["__call__"], "_jaxmp_marking", False):
                    _effects.patch(owner, "__call__", _wrap_call)  # effect 2 of jaxmp._effects


@contextlib.contextmanager
def instance_rules(by_id: dict[int, ModuleRule]) -> Iterator[None]:
    """While active, this thread's hooked calls take the rule of their instance from ``by_id``.

    The NNX front door resolves path rules to instances of the graph it runs (NNX modules do
    not know their path); the mapping is thread-local, and read only inside an engine trace.

    Args:
      by_id: ``{id(module): rule}`` for the ruled modules of the graph.

    Yields:
      Nothing; the previous mapping is restored on exit.
    """
    previous = getattr(_INSTANCES, "rules", None)
    _INSTANCES.rules = by_id
    try:
        yield
    finally:
        _INSTANCES.rules = previous


@contextlib.contextmanager
def apply_module_rules(rules: ModuleRules, intercept: bool = True) -> Iterator[None]:
    """While an autocast trace is active, calls of ruled classes run under their rules.

    Linen and Haiku get the thread-local `module_interceptor`; other classes the
    once-installed hook of `install_call_hooks`, which reads the rules from the trace's
    config (`jaxmp.engine._config.current`).

    Args:
      rules: the compiled `ModuleRules` of the trace.
      intercept: push the Linen / Haiku interceptor too (False: the Flax front door pushes
        its own, with its recording and module replacements).

    Yields:
      Nothing.
    """
    if not rules:
        yield
        return
    install_call_hooks([c for c, _ in rules.classes])
    if not intercept:
        yield
        return
    with _intercepted("flax.linen", rules), _intercepted("haiku", rules):
        yield
