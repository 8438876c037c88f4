"""Class rules: mark every call of a module class, whatever the instance is called.

Linen's name stack holds module *names*, NNX has none and Equinox none either, so a rule such
as "every LayerNorm in float32" cannot be a name pattern. While autocast traces, each call of
an instance of a ruled class runs inside a ``jaxmp[<dtype>]:<ClassName>`` scope that the
engine reads. Flax Linen and Haiku calls are intercepted with their own method interceptors;
NNX, Equinox and any other class get their ``__call__`` wrapped for the duration of the trace.
Frameworks are only touched when already imported (nothing heavy is imported here).
"""

from __future__ import annotations

import contextlib
import sys
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


def _wrap_call(cls: type, dtype: str, original):
    def __call__(self, *args, **kwargs):
        with jax.named_scope(marker(dtype, type(self).__name__)):
            return original(self, *args, **kwargs)

    __call__.__wrapped__ = original
    return __call__


@contextlib.contextmanager
def _generic(class_rules) -> Iterator[None]:
    patched: list[tuple[type, Any]] = []
    try:
        for cls, dtype in class_rules:
            if _is_intercepted_elsewhere(cls):
                continue
            for sub in _subclasses(cls):
                if "__call__" in vars(sub) and not any(s is sub for s, _ in patched):
                    original = vars(sub)["__call__"]
                    rule = _rule_for_class(sub, class_rules)
                    type.__setattr__(sub, "__call__", _wrap_call(sub, rule, original))
                    patched.append((sub, original))
        yield
    finally:
        for sub, original in reversed(patched):
            type.__setattr__(sub, "__call__", original)


def _rule_for_class(cls: type, class_rules) -> str:
    for c, dtype in reversed(class_rules):
        if issubclass(cls, c):
            return dtype
    raise AssertionError(cls)


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
