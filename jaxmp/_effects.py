"""Every effect jaxmp has outside its own objects, in one place: patches, registrations, marks.

``import jaxmp`` (and ``import jaxmp.flax``) patch nothing. Each effect below is installed by
the first call that needs it, once per process, and is never removed; each is inert outside
the call that needs it, so code that never uses it sees JAX and Flax as they ship.

1. ``jax.nn.dot_product_attention`` is replaced by the engine's router
   (``jaxmp.engine._attention.routed_attention``) when the first autocast trace starts. Outside
   an autocast trace of the calling thread the router calls JAX's own function unchanged.
2. ``__call__`` of the module classes a rule names (NNX, Equinox, plain classes) is wrapped when
   the first trace applies a rule to the class (``jaxmp.engine._modules.install_call_hooks``).
   The wrapper forwards unchanged outside an autocast trace. Linen and Haiku are never patched:
   their own thread-local method interceptors are used.
3. The loss scales are registered with ``flax.serialization`` when ``jaxmp.flax`` is imported
   or a loss scale is made for a transform (``jaxmp.make_loss_scale``) with Flax loaded: an
   entry in Flax's registry, not a change to Flax's code.
4. The loss scales are frozen dataclasses; the only field written after construction is their
   ``scaled_mark`` (``jaxmp._misuse.note_scaled``), a static marker that compares and hashes
   equal whatever its value, so it never changes a tree structure or a ``jit`` cache key.

Patching once and dispatching on per-thread state (rather than swapping per trace) keeps two
threads that trace at the same time from seeing each other's swaps. `installed` lists what this
process has installed so far (tests/core/test_effects.py checks a fresh process has nothing).
See docs/architecture.md#process-wide-effects.
"""

from __future__ import annotations

import threading
from typing import Any, Callable

_lock = threading.Lock()
#: ``{(id(owner), name): (owner, name, original)}`` for every attribute patched.
_PATCHED: dict[tuple[int, str], tuple[Any, str, Any]] = {}
#: The registrations done, by key (``"flax.serialization"``).
_REGISTERED: set[str] = set()


def _label(owner: Any, name: str) -> str:
    prefix = getattr(owner, "__qualname__", None) or getattr(owner, "__name__", type(owner).__name__)
    module = getattr(owner, "__module__", None) if isinstance(owner, type) else None
    return f"{module}.{prefix}.{name}" if module else f"{prefix}.{name}"


def original(owner: Any, name: str) -> Any:
    """The attribute ``owner.name`` as it was before jaxmp patched it (the current one if never)."""
    entry = _PATCHED.get((id(owner), name))
    return entry[2] if entry is not None else getattr(owner, name)


def patch(owner: Any, name: str, make: Callable[[Any], Any]) -> bool:
    """Replaces ``owner.name`` by ``make(original)``, once per process.

    Args:
      owner: a module or a class.
      name: the attribute.
      make: builds the replacement from the original (the replacement must forward to it
        whenever jaxmp is not tracing in the calling thread).

    Returns:
      True when installed now, False when it already was.
    """
    key = (id(owner), name)
    if key in _PATCHED:
        return False
    with _lock:
        if key in _PATCHED:
            return False
        before = vars(owner)[name] if isinstance(owner, type) else getattr(owner, name)
        replacement = make(before)
        if isinstance(owner, type):
            type.__setattr__(owner, name, replacement)
        else:
            setattr(owner, name, replacement)
        _PATCHED[key] = (owner, name, before)
    return True


def register_once(key: str, register: Callable[[], bool]) -> bool:
    """Runs ``register()`` until it succeeds once (returns True), then never again.

    Args:
      key: names the registration (``"flax.serialization"``).
      register: does it; returns False when it could not yet (the library is not loaded).

    Returns:
      Whether the registration is done.
    """
    if key in _REGISTERED:
        return True
    with _lock:
        if key not in _REGISTERED and register():
            _REGISTERED.add(key)
    return key in _REGISTERED


def set_mark(obj: Any, name: str, value: Any) -> None:
    """Writes the static marker field ``name`` of the frozen dataclass ``obj`` (effect 4 above)."""
    object.__setattr__(obj, name, value)


def installed() -> tuple[str, ...]:
    """What this process has installed so far: ``"patch: <attribute>"`` and ``"registered: <key>"`` lines."""
    with _lock:
        patches = sorted(f"patch: {_label(owner, name)}" for owner, name, _ in _PATCHED.values())
        return tuple(patches) + tuple(sorted(f"registered: {k}" for k in _REGISTERED))
