"""The Flax door's rules: its per-preset defaults, and the resolution of its ``policy`` / ``rules`` arguments.

[`default_rules`][jaxmp.flax.default_rules] gives the door's starting [`jaxmp.AutocastRules`][jaxmp.AutocastRules]:
`DEFAULT_HALF_MODULES` in half, `DEFAULT_NORM_MODULES` in float32, everything else follows.
See docs/guides/flax-linen.md#choosing-what-runs-in-float32.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from typing import Any, Iterable, Iterator, Sequence

import flax.linen as nn
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxmp.fp8._seams import hardware as fp8_hardware
from jaxmp._typing import PolicyLike
from jaxmp.engine._seams import PURE_HALF_RULES, AutocastRules, merge_rules
from jaxmp._precision._policy import Policy
from jaxmp._precision._presets import FLOAT32_CATEGORIES, resolve_policy

#: Linen and NNX matmul / convolution / attention classes that run in the compute dtype.
DEFAULT_HALF_MODULES: tuple[type, ...] = (
    nn.Dense, nn.DenseGeneral, nn.Conv, nn.ConvTranspose, nn.ConvLocal, nn.Einsum,
    nn.MultiHeadDotProductAttention,  # nn.MultiHeadAttention and nn.SelfAttention subclass it
    nnx.Linear, nnx.LinearGeneral, nnx.Conv, nnx.ConvTranspose, nnx.Einsum, nnx.MultiHeadAttention,
)

#: Linen and NNX normalisation classes that a recipe with the ``"norm"`` category keeps in float32.
DEFAULT_NORM_MODULES: tuple[type, ...] = (
    nn.BatchNorm, nn.LayerNorm, nn.GroupNorm, nn.RMSNorm, nn.InstanceNorm,
    nnx.BatchNorm, nnx.LayerNorm, nnx.GroupNorm, nnx.RMSNorm, nnx.InstanceNorm,
)

_F32 = np.dtype(jnp.float32)


def join_path(path: Sequence[Any]) -> str:
    """A module path as the string that path rules match: its components joined by ``"/"``.

    Args:
      path: a Linen ``module.path`` or an NNX graph path, e.g. ``("layers", 0)``.

    Returns:
      The joined string, e.g. ``"layers/0"`` (``""`` for the model itself).
    """
    return "/".join(str(p) for p in path)


def explicit_float32(module: Any) -> bool:
    """Whether a module instance has ``dtype`` set to float32 (not left as ``None``).

    Args:
      module: a Linen or NNX module instance.

    Returns:
      True for a layer built with ``dtype=jnp.float32`` (Flax's computation dtype).
    """
    dtype = getattr(module, "dtype", None)
    if dtype is None:
        return False
    try:
        return np.dtype(dtype) == _F32
    except TypeError:
        return False


def overridden_float32_message(paths: Sequence[str], classes: Sequence[str], compute_dtype: Any) -> str:
    """The warning for half-list layers whose explicit ``dtype=float32`` the policy overrode.

    Args:
      paths: the layers' module paths joined by ``"/"`` (``""`` for the wrapped model itself).
      classes: their class names, in the same order.
      compute_dtype: the policy's compute dtype they run in instead.

    Returns:
      One message naming every layer and the override that keeps them float32.
    """
    named = [p for p in paths if p]
    layers = ", ".join(f"{p!r} ({c})" if p else f"the wrapped model itself ({c})" for p, c in zip(paths, classes))
    routes = []
    if named:
        routes.append("rules" + "".join(f".with_path({p!r}, 'float32')" for p in named))
    roots = [c for p, c in zip(paths, classes) if not p]
    if roots:
        routes.append(f"rules.with_class({roots[0]}, 'float32') (the class rule; the model itself has no path)")
    return (
        f"jaxmp.flax.mixed_precision: {len(paths)} half-list layer(s) set dtype=float32, but the policy runs their "
        f"matmuls and convolutions in {np.dtype(compute_dtype).name} (wrapping a model asks for the policy; a "
        f"layer's dtype does not opt out): {layers}. To keep them in float32, pass "
        f"{' and '.join(routes)} as rules=, where rules is the jaxmp.AutocastRules in use "
        "(jaxmp.flax.default_rules(preset) by default). Warned once per wrapped model."
    )


def is_preset_class_rule(cls: type, dtype: Any) -> bool:
    """Whether ``(cls, dtype)`` is one of the presets' own class rules (`default_rules`): a half
    module class in ``"half"`` or a norm class in ``"float32"``. Most models use only some of
    those classes, so a rule that matches nothing warns only when it is not one of them.
    """
    return (cls in DEFAULT_HALF_MODULES and dtype == "half") or (cls in DEFAULT_NORM_MODULES and dtype == "float32")


def unmatched_rules_message(rules: AutocastRules, paths: Iterable[str], classes: Iterable[type],
                            model: str) -> str | None:
    """The warning for path and class rules of the user's that match no module of the model, or None.

    The preset's own class rules (`DEFAULT_HALF_MODULES`, `DEFAULT_NORM_MODULES`: most models have
    only some of them) are not the user's and are not checked.

    Args:
      rules: the door's rules.
      paths: every module path of the model, joined by ``"/"`` (relative to the wrapped model).
      classes: the classes of its modules.
      model: the model's class name, for the message.

    Returns:
      One message naming each rule that matches nothing and the closest paths that exist.
    """
    import difflib
    import fnmatch

    paths, classes = sorted({p for p in paths if p}), tuple(set(classes))
    prefixes = {"/".join(p.split("/")[:k]) for p in paths for k in range(1, p.count("/") + 2)}
    missed = []
    for pattern, _ in rules.path_rules:
        if not any(fnmatch.fnmatchcase(p, pattern) for p in prefixes):
            close = difflib.get_close_matches(pattern, paths, n=3, cutoff=0.0)
            missed.append(f"the path rule {pattern!r} (closest module paths: {', '.join(map(repr, close))})")
    for cls, dtype in rules.class_rules:
        if not is_preset_class_rule(cls, dtype) and not any(issubclass(c, cls) for c in classes):
            missed.append(f"the class rule for {cls.__name__} (no {cls.__name__} in the model)")
    if not missed:
        return None
    return (f"jaxmp.flax.mixed_precision({model}): {'; '.join(missed)} matches no module, so it does nothing. "
            "Module paths are relative to the wrapped model and joined by '/', as Flax names the modules "
            "(no root class, no trailing class scope: 'decoder/block_1/Dense_0'). Warned once per wrapped model.")


def default_rules(policy: PolicyLike = "O1", keep_float32: Iterable[str] | None = None) -> AutocastRules:
    """The Flax door's rules for a preset: its matmul layers in half, its norm layers in float32.

    What [`mixed_precision`][jaxmp.flax.mixed_precision] uses when no rules are given; edit the result
    (``.with_path("head", "float32")``, ``.with_class(MyNorm, "float32")``) and pass it as ``rules=``.

    Args:
      policy: a preset (``"O1"``, ``"O2-fp16"``, ``"O2-fp8"``, ``"mixed_bfloat16"``), a
        [`jaxmp.Recipe`][jaxmp.Recipe] or any policy (a bare policy keeps all three categories).
      keep_float32: the categories kept in float32, a subset of ``("norm", "softmax", "loss")``
        (None: the preset's). ``"norm"``: norm classes in float32; ``"softmax"``: the engine's
        float32 op list applies; ``"loss"``: ``float32_loss``.

    Returns:
      An [`AutocastRules`][jaxmp.AutocastRules] (with the preset's fp8 recipe, if any).

    Raises:
      ValueError: an unknown category or preset.

    Example:
      >>> import flax.linen as nn, jaxmp.flax
      >>> rules = jaxmp.flax.default_rules("O2")
      >>> by_class = dict(rules.class_rules)
      >>> by_class[nn.LayerNorm], by_class[nn.Dense], rules.float32_loss
      ('float32', 'half', True)
    """
    _, recipe = resolve_policy(policy)
    if keep_float32 is None:
        # O0 is all float32 anyway; keeping the default lists makes its rules inert, not different.
        keep = recipe.keep_float32 if recipe is not None and recipe.level != "O0" else FLOAT32_CATEGORIES
    else:
        keep = (keep_float32,) if isinstance(keep_float32, str) else tuple(keep_float32)
        unknown = [c for c in keep if c not in FLOAT32_CATEGORIES]
        if unknown:
            raise ValueError(f"unknown keep_float32 categories {unknown}: expected a subset of {FLOAT32_CATEGORIES}")
    # A whole rule set (promote set, _complete): the door uses it as given, edits and all.
    ops = AutocastRules(promote="demand") if "softmax" in keep else PURE_HALF_RULES
    classes = tuple((c, "half") for c in DEFAULT_HALF_MODULES)
    if "norm" in keep:
        classes += tuple((c, "float32") for c in DEFAULT_NORM_MODULES)
    return dataclasses.replace(ops, class_rules=classes, float32_loss="loss" in keep, _complete=True,
                               fp8_matmuls=recipe.fp8 if recipe is not None else None)


def resolve_rules(policy: PolicyLike, rules: AutocastRules | None = None) -> tuple[Policy, AutocastRules]:
    """Turns the Flax door's ``policy`` / ``rules`` arguments into a Policy and rules.

    Args:
      policy: a [`jaxmp.Policy`][jaxmp.Policy], ``jmp.Policy``, [`jaxmp.Recipe`][jaxmp.Recipe] or policy string;
        a preset also picks the default rules ([`default_rules`][jaxmp.flax.default_rules]).
      rules: an [`AutocastRules`][jaxmp.AutocastRules], or None for the preset's. Rules from
        [`default_rules`][jaxmp.flax.default_rules] (and copies edited by ``with_*``) are used as
        given; any other rules object is merged onto the preset's rules, its entries winning
        (`jaxmp.engine._rules.merge_rules`).

    Returns:
      ``(policy, rules)``.

    Raises:
      TypeError: a policy whose dtypes are not floating, or rules of the wrong type.
      ValueError: an fp8 recipe this hardware cannot run ([`jaxmp.fp8.check_hardware`][jaxmp.fp8.check_hardware]).
    """
    resolved, recipe = resolve_policy(policy)
    if rules is None:
        rules = default_rules(recipe if recipe is not None else resolved)
    elif not isinstance(rules, AutocastRules):
        hint = (f"; to keep the categories {tuple(rules)!r} in float32: "
                f"rules=jaxmp.flax.default_rules(policy, keep_float32={tuple(rules)!r})"
                if isinstance(rules, (tuple, list)) else "")
        raise TypeError(f"rules must be a jaxmp.AutocastRules (jaxmp.flax.default_rules(preset) to start from), "
                        f"got {type(rules).__name__}: {rules!r}{hint}")
    elif not rules._complete:
        # Rules built from AutocastRules() are edits: replacing the preset's rules with them would
        # drop its class rules (norms in float32) and op lists. They are merged onto them instead.
        rules = merge_rules(default_rules(recipe if recipe is not None else resolved), rules)
    for each in rules.format_recipes():
        # native, emulated (one warning off CPU for a block format), or a clear error naming the way out
        fp8_hardware.check_for_run(each)
    return resolved, rules


class _DoorWatch(threading.local):
    """The doors run in this thread while the precision debugger traces (`watch_doors`)."""

    doors: list | None = None
    swap: list | None = None


_WATCH = _DoorWatch()


@contextlib.contextmanager
def watch_doors(swap: Sequence[tuple[Any, AutocastRules]] = ()) -> Iterator[list]:
    """Records every Flax door (Linen or NNX ``MixedPrecision``) run in this thread, for the debugger.

    Args:
      swap: ``((door, rules), ...)``: a door like ``door`` (its class, policy and rules: a traced
        NNX door is a new object each trace) runs under ``rules`` instead of its own; the debugger
        measures a fix this way, as the door rebuilt with those rules would run.

    Yields:
      The list the doors are appended to, once each, in the order they first run.
    """
    old = (_WATCH.doors, _WATCH.swap)
    _WATCH.doors, _WATCH.swap = [], list(swap)
    try:
        yield _WATCH.doors
    finally:
        _WATCH.doors, _WATCH.swap = old


def door_rules(door: Any, rules: AutocastRules) -> AutocastRules:
    """The rules ``door`` runs under now: its own, or those `watch_doors` swaps in; records the door."""
    doors = _WATCH.doors
    if doors is None:
        return rules
    if not any(d is door for d in doors):
        doors.append(door)
    for like, other in _WATCH.swap or ():
        if door is like or (type(door) is type(like) and door.policy == like.policy and rules == like.rules):
            return other
    return rules
