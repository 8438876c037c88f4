"""The Flax door's rules: its per-preset defaults, and the deprecated ``PrecisionOverrides``.

[`default_rules`][jaxmp.flax.default_rules] gives the door's starting [`jaxmp.AutocastRules`][jaxmp.AutocastRules]:
`DEFAULT_HALF_MODULES` in half, `DEFAULT_NORM_MODULES` in float32, everything else follows.
See docs/guides/flax-linen.md#choosing-what-runs-in-float32.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any, Iterable, Mapping, Sequence, Union

import flax.linen as nn
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxmp import _deprecations
from jaxmp import fp8 as _fp8
from jaxmp._typing import PolicyLike
from jaxmp.engine._seams import PURE_HALF_RULES, AutocastRules, ModuleRule, ModuleRules, merge_rules
from jaxmp._policy import Policy
from jaxmp._presets import FLOAT32_CATEGORIES, Recipe, as_policy, get_recipe, resolve_policy

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


def _check_module_class(cls: Any, where: str) -> type:
    """Returns ``cls`` if it is a Linen or NNX module class, else raises a TypeError naming ``where``."""
    if isinstance(cls, type) and issubclass(cls, (nn.Module, nnx.Module)):
        return cls
    if isinstance(cls, (nn.Module, nnx.Module)):
        hint = f" (got an instance; pass its class, type(x) = {type(cls).__name__})"
    elif isinstance(cls, str):
        hint = f" (got the string {cls!r}; pass the class itself, e.g. flax.linen.{cls})"
    else:
        hint = f" (got {type(cls).__name__}: {cls!r})"
    raise TypeError(f"{where}: expected a flax.linen.Module or flax.nnx.Module subclass{hint}")


def _class_tuple(classes: Iterable[Any], where: str) -> tuple[type, ...]:
    if isinstance(classes, type) or isinstance(classes, (str, nn.Module, nnx.Module)):
        classes = (classes,)
    out: list[type] = []
    for c in classes:
        c = _check_module_class(c, where)
        if c not in out:
            out.append(c)
    return tuple(out)


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
      >>> dict(rules.class_rules)[nn.LayerNorm], dict(rules.class_rules)[nn.Dense], rules.float32_loss
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


#: What the deprecated ``overrides=`` argument takes (one release): a `PrecisionOverrides` or a
#: tuple of ``keep_float32`` categories; use ``rules=`` (an `AutocastRules`) instead.
DeprecatedOverrides = Union["PrecisionOverrides", Iterable[str], None]


def resolve_rules(policy: PolicyLike, rules: Any = None, overrides: Any = None) -> tuple[Policy, AutocastRules]:
    """Turns the Flax door's ``policy`` / ``rules`` arguments into a Policy and rules.

    Args:
      policy: a [`jaxmp.Policy`][jaxmp.Policy], ``jmp.Policy``, [`jaxmp.Recipe`][jaxmp.Recipe] or policy string;
        a preset also picks the default rules ([`default_rules`][jaxmp.flax.default_rules]).
      rules: an [`AutocastRules`][jaxmp.AutocastRules], or None for the preset's. Rules from
        [`default_rules`][jaxmp.flax.default_rules] (and copies edited by ``with_*``) are used as
        given; any other rules object is merged onto the preset's rules, its entries winning
        (`jaxmp.engine._rules.merge_rules`). (Deprecated, one release: a ``PrecisionOverrides`` or
        a tuple of categories.)
      overrides: the deprecated keyword of the same argument.

    Returns:
      ``(policy, rules)``.

    Raises:
      TypeError: a policy whose dtypes are not floating, or rules of the wrong type.
      ValueError: an fp8 recipe this hardware cannot run ([`jaxmp.fp8.check_hardware`][jaxmp.fp8.check_hardware]).
    """
    if overrides is not None:
        if rules is not None:
            raise TypeError("give rules= only (overrides= is its deprecated name), not both")
        warnings.warn("the overrides= argument of the Flax door is deprecated: pass rules= a jaxmp.AutocastRules "
                      f"(jaxmp.flax.default_rules(preset) to start from); overrides= will be removed in jaxmp "
                      f"{_deprecations.REMOVAL}", DeprecationWarning, stacklevel=3)
        rules = overrides
    resolved, recipe = resolve_policy(policy)
    if rules is None:
        rules = default_rules(recipe if recipe is not None else resolved)
    elif isinstance(rules, PrecisionOverrides):
        warnings.warn("PrecisionOverrides is deprecated: pass rules= a jaxmp.AutocastRules (overrides.to_rules() is "
                      "the same rules; jaxmp.flax.default_rules(preset) to start from); it will be removed in jaxmp "
                      f"{_deprecations.REMOVAL}", DeprecationWarning, stacklevel=3)
        rules = rules.to_rules()
    elif isinstance(rules, (str, tuple, list, frozenset, set)) and not isinstance(rules, AutocastRules):
        warnings.warn(f"a tuple of categories as the Flax door's rules is deprecated: pass "
                      f"rules=jaxmp.flax.default_rules(policy, keep_float32={tuple(rules)!r}); it will be removed "
                      f"in jaxmp {_deprecations.REMOVAL}", DeprecationWarning, stacklevel=3)
        rules = default_rules(resolved, keep_float32=rules)
    elif not isinstance(rules, AutocastRules):
        raise TypeError(f"rules must be a jaxmp.AutocastRules (jaxmp.flax.default_rules(preset) to start from), "
                        f"got {type(rules).__name__}: {rules!r}")
    elif not rules._complete:
        # Rules built from AutocastRules() are edits: replacing the preset's rules with them would
        # drop its class rules (norms in float32) and op lists. They are merged onto them instead.
        rules = merge_rules(default_rules(recipe if recipe is not None else resolved), rules)
    if rules.fp8_matmuls is not None:
        _fp8.check_hardware(rules.fp8_matmuls)  # native, emulated on CPU, or a clear error naming the device
    return resolved, rules


def _deprecated(old: str, new: str) -> None:
    warnings.warn(f"PrecisionOverrides.{old} is deprecated: use {new} on a jaxmp.AutocastRules "
                  f"(jaxmp.flax.default_rules(preset) to start from); PrecisionOverrides will be removed in jaxmp "
                  f"{_deprecations.REMOVAL}", DeprecationWarning, stacklevel=3)


@dataclasses.dataclass(frozen=True)
class PrecisionOverrides:
    """Deprecated: the Flax door's old rule object; use [`jaxmp.AutocastRules`][jaxmp.AutocastRules].

    Kept for one release; `to_rules` gives the same rules. The table of new spellings is in
    docs/guides/flax-linen.md#from-precisionoverrides.
    """

    half_modules: tuple[type, ...] = DEFAULT_HALF_MODULES
    fp32_modules: tuple[type, ...] = DEFAULT_NORM_MODULES
    module_policies: tuple[tuple[type, PolicyLike], ...] | Mapping[type, PolicyLike] = ()
    fp32_softmax: bool = True
    fp32_loss: bool = True
    fused_attention: bool = True
    fp8: _fp8.Fp8Recipe | None = None
    fp32_paths: tuple[str, ...] = ()

    def __post_init__(self):
        if self.fp8 is not None and not isinstance(self.fp8, _fp8.Fp8Recipe):
            raise TypeError(f"PrecisionOverrides.fp8 must be a jaxmp.fp8.DelayedScaling / CurrentScaling recipe or "
                            f"None, got {type(self.fp8).__name__}: {self.fp8!r}")
        half = _class_tuple(self.half_modules, "PrecisionOverrides.half_modules")
        f32 = _class_tuple(self.fp32_modules, "PrecisionOverrides.fp32_modules")
        both = [c.__name__ for c in half if c in f32]
        if both:
            raise ValueError(f"module classes {both} are in both half_modules and fp32_modules; pick one")
        items = self.module_policies.items() if isinstance(self.module_policies, Mapping) else self.module_policies
        policies: list[tuple[type, Policy]] = []
        for item in items:
            if not (isinstance(item, tuple) and len(item) == 2):
                raise TypeError(f"module_policies entries must be (module class, policy) pairs, got {item!r}")
            cls = _check_module_class(item[0], "PrecisionOverrides.module_policies")
            policies = [(c, p) for c, p in policies if c is not cls] + [(cls, as_policy(item[1]))]
        for name in ("fp32_softmax", "fp32_loss", "fused_attention"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"PrecisionOverrides.{name} must be a bool, got {getattr(self, name)!r}")
        paths = (self.fp32_paths,) if isinstance(self.fp32_paths, str) else self.fp32_paths
        if not isinstance(paths, (tuple, list)):
            raise TypeError(f"PrecisionOverrides.fp32_paths: expected a tuple of module path strings, "
                            f"got {type(paths).__name__}: {paths!r}")
        paths = AutocastRules(path_rules=tuple((p, "float32") for p in paths)).path_rules  # validated, deduplicated
        object.__setattr__(self, "half_modules", half)
        object.__setattr__(self, "fp32_modules", f32)
        object.__setattr__(self, "module_policies", tuple(policies))
        object.__setattr__(self, "fp32_paths", tuple(p for p, _ in paths))

    def to_rules(self) -> AutocastRules:
        """The same rules as an [`jaxmp.AutocastRules`][jaxmp.AutocastRules] (what the Flax door runs)."""
        ops = AutocastRules(promote="demand") if self.fp32_softmax else PURE_HALF_RULES
        classes = tuple((c, "half") for c in self.half_modules) + tuple((c, "float32") for c in self.fp32_modules)
        return dataclasses.replace(ops, class_rules=classes + self.module_policies, _complete=True,
                                   path_rules=tuple((p, "float32") for p in self.fp32_paths),
                                   float32_loss=self.fp32_loss, fused_attention=self.fused_attention, fp8_matmuls=self.fp8)

    @classmethod
    def from_categories(cls, keep_fp32: Iterable[str] = FLOAT32_CATEGORIES) -> "PrecisionOverrides":
        """Deprecated: ``jaxmp.flax.default_rules(keep_float32=...)``."""
        _deprecated("from_categories", "jaxmp.flax.default_rules(keep_float32=...)")
        keep = (keep_fp32,) if isinstance(keep_fp32, str) else tuple(keep_fp32)
        default_rules(keep_float32=keep)  # validates the categories
        return cls(fp32_modules=DEFAULT_NORM_MODULES if "norm" in keep else (), fp32_softmax="softmax" in keep,
                   fp32_loss="loss" in keep)

    @classmethod
    def from_recipe(cls, recipe: Recipe | str) -> "PrecisionOverrides":
        """Deprecated: ``jaxmp.flax.default_rules(recipe)``."""
        _deprecated("from_recipe", "jaxmp.flax.default_rules(recipe)")
        recipe = get_recipe(recipe) if isinstance(recipe, str) else recipe
        if not isinstance(recipe, Recipe):
            raise TypeError(f"expected a jaxmp.Recipe or a preset name, got {type(recipe).__name__}")
        keep = FLOAT32_CATEGORIES if recipe.level == "O0" else recipe.keep_float32
        return cls(fp32_modules=DEFAULT_NORM_MODULES if "norm" in keep else (), fp32_softmax="softmax" in keep,
                   fp32_loss="loss" in keep, fp8=recipe.fp8)

    def with_half(self, *classes: type) -> "PrecisionOverrides":
        """Deprecated: ``AutocastRules.with_class(cls, "half")``."""
        _deprecated("with_half", 'with_class(cls, "half")')
        add = _class_tuple(classes, "with_half")
        return self._without(add)._replace(half_modules=self.half_modules + add)

    def with_fp32(self, *classes: type) -> "PrecisionOverrides":
        """Deprecated: ``AutocastRules.with_class(cls, "float32")``."""
        _deprecated("with_fp32", 'with_class(cls, "float32")')
        add = _class_tuple(classes, "with_fp32")
        base = self._without(add)
        return base._replace(fp32_modules=base.fp32_modules + add)

    def with_fp32_paths(self, *patterns: str) -> "PrecisionOverrides":
        """Deprecated: ``AutocastRules.with_path(pattern, "float32")``."""
        _deprecated("with_fp32_paths", 'with_path(pattern, "float32")')
        if not patterns:
            raise TypeError("with_fp32_paths: give at least one module path, e.g. with_fp32_paths('decoder/head')")
        return self._replace(fp32_paths=self.fp32_paths + tuple(patterns))

    def with_policy(self, cls: type, policy: PolicyLike) -> "PrecisionOverrides":
        """Deprecated: ``AutocastRules.with_class(cls, jaxmp.get_policy(policy))``."""
        _deprecated("with_policy", "with_class(cls, jaxmp.get_policy(policy))")
        cls = _check_module_class(cls, "with_policy")
        base = self._without((cls,))
        return base._replace(module_policies=base.module_policies + ((cls, as_policy(policy)),))

    def without(self, *classes: type) -> "PrecisionOverrides":
        """Deprecated: ``AutocastRules.with_class(cls, "follow")``."""
        _deprecated("without", 'with_class(cls, "follow")')
        return self._without(_class_tuple(classes, "without"))

    def _without(self, classes: tuple[type, ...]) -> "PrecisionOverrides":
        return self._replace(
            half_modules=tuple(c for c in self.half_modules if c not in classes),
            fp32_modules=tuple(c for c in self.fp32_modules if c not in classes),
            module_policies=tuple((c, p) for c, p in self.module_policies if c not in classes),
        )

    def _replace(self, **changes) -> "PrecisionOverrides":
        return dataclasses.replace(self, **changes)

    def module_rules(self, policy: Policy) -> ModuleRules:
        """Deprecated: ``AutocastRules.module_rules(policy)``."""
        return self.to_rules().module_rules(policy)

    def rule_for(self, module_or_class: Any, policy: Policy) -> ModuleRule | None:
        """Deprecated: ``AutocastRules.module_rules(policy).rule_for(module_or_class)``."""
        return self.module_rules(policy).rule_for(module_or_class)

    def rule_at(self, path: Sequence[Any], module_or_class: Any, policy: Policy) -> ModuleRule | None:
        """Deprecated: ``AutocastRules.module_rules(policy).rule_at(path, module_or_class)``."""
        return self.module_rules(policy).rule_at(path, module_or_class)

    def fp32_path_match(self, path: Sequence[Any]) -> str | None:
        """Deprecated: ``AutocastRules.module_rules(policy).path_match(path)``."""
        return self.to_rules().module_rules(Policy(_F32, _F32, _F32)).path_match(path)
