"""Class rules: mark every call of a module class, whatever the instance is called.

Linen's name stack holds module *names*, NNX has none and Equinox none either, so a rule such
as "every LayerNorm in float32" cannot be a name pattern. While autocast traces, each call of
an instance of a ruled class runs inside a ``jaxmp[<dtype>]:<ClassName>`` scope that the
engine reads. Flax Linen and Haiku calls are intercepted with their own (thread-local) method
interceptors; NNX, Equinox and any other class get a marking ``__call__`` installed once,
which reads the running trace's rules from a context variable (thread-safe).
Frameworks are only touched when already imported (nothing heavy is imported here).
"""

from __future__ import annotations

import contextlib
import contextvars
import sys
import threading
from typing import Any, Iterator

import jax

from jaxmp.engine.rules import marker


def _rule_for(obj: Any, class_rules) -> str | None:
    for cls, dtype in reversed(class_rules):
        if isinstance(obj, cls):
            return dtype
    return None


def _marking_interceptor(class_rules):
    """A Linen / Haiku method interceptor that runs ``__call__`` of ruled classes in a marker scope."""

    def interceptor(next_fun, args, kwargs, context):
        dtype = _rule_for(context.module, class_rules) if context.method_name == "__call__" else None
        if dtype is None:
            return next_fun(*args, **kwargs)
        with jax.named_scope(marker(dtype, type(context.module).__name__)):
            return next_fun(*args, **kwargs)

    return interceptor


@contextlib.contextmanager
def _intercepted(module_name: str, class_rules) -> Iterator[None]:
    """Flax Linen (``flax.linen``) and Haiku (``haiku``) have method interceptors: use them."""
    lib = sys.modules.get(module_name)
    if lib is None or not any(issubclass(c, lib.Module) for c, _ in class_rules):
        yield
        return
    with lib.intercept_methods(_marking_interceptor(class_rules)):
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


#: The class rules of the autocast trace running in this thread / context (None outside one).
_ACTIVE: contextvars.ContextVar = contextvars.ContextVar("jaxmp_class_rules", default=None)
_lock = threading.Lock()


def _wrap_call(original):
    """A ``__call__`` that marks the call when the running trace has a rule for the instance's class."""

    def __call__(self, *args, **kwargs):
        rules = _ACTIVE.get()
        dtype = _rule_for(self, rules) if rules else None
        if dtype is None:
            return original(self, *args, **kwargs)
        with jax.named_scope(marker(dtype, type(self).__name__)):
            return original(self, *args, **kwargs)

    __call__.__wrapped__ = original
    __call__._jaxmp_marking = True
    return __call__


@contextlib.contextmanager
def _generic(class_rules) -> Iterator[None]:
    """Classes without method interceptors (NNX, Equinox, plain classes) get a marking ``__call__``.

    The wrapper is installed once per class and stays; it reads the rules of the current trace
    from a context variable, so two threads tracing with different rules never see each
    other's (outside a trace the wrapper only forwards the call).
    """
    with _lock:
        for cls, _ in class_rules:
            if _is_intercepted_elsewhere(cls):
                continue
            # The ``__call__`` an instance runs may be defined by a base class (eqx.nn.Conv2d
            # inherits eqx.nn.Conv's): wrap the defining class; the wrapper checks the instance.
            for sub in _subclasses(cls):
                owner = next((c for c in sub.__mro__ if "__call__" in vars(c)), None)
                if owner is None or owner is object or owner is type:
                    continue
                original = vars(owner)["__call__"]
                if not getattr(original, "_jaxmp_marking", False):
                    type.__setattr__(owner, "__call__", _wrap_call(original))
    token = _ACTIVE.set(class_rules)
    try:
        yield
    finally:
        _ACTIVE.reset(token)


@contextlib.contextmanager
def class_markers(class_rules) -> Iterator[None]:
    """While active, calls of instances of the ruled classes run inside marker scopes.

    Args:
      class_rules: ``((module_class, dtype), ...)`` from :class:`jaxmp.AutocastRules`.

    Yields:
      Nothing; restores every patched class on exit.
    """
    if not class_rules:
        yield
        return
    with _intercepted("flax.linen", class_rules), _intercepted("haiku", class_rules), _generic(class_rules):
        yield
